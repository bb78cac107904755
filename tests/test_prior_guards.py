"""It learns what it is taught: the defaults that follow the data (rewards, refusals before any model loads), the
run's opening summary, the reasoning-gym-small preset, and the guards against learning the prior (grpo/evaluation/answers.py):
the answers/* metrics, the collapse warning on a policy forced to one answer, and eval.py's best constant answer."""

import json
import logging

import pytest
import torch

import eval as eval_program
from data.prompts import SYSTEM_PROMPT, TASK_SYSTEM_PROMPT
import train
from grpo.cli import PRESETS, config_from_args
from grpo.config import GSM8K_RECIPE_REWARDS, GRPOConfig
from grpo.core import setup
from grpo.evaluation.answers import COLLAPSE_SHARE, WINDOW, CollapseWatch, answer_metrics, prior_summary
from grpo.evaluation.evaluate import EvalConfig
from grpo.core.metrics import read_jsonl
from grpo.core.trainer import Trainer

reasoning_gym = pytest.importorskip("reasoning_gym")

TINY = dict(model="tiny", prompts_per_step=2, num_generations=4, micro_batch_size=8, max_prompt_length=128,
            max_completion_length=8, device="cpu", precision="fp32", save_steps=0, log_completions_steps=0,
            logging_steps=100, warmup_ratio=0.0)
TWO_TERMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def flags(values: dict) -> list[str]:
    out = []
    for key, value in values.items():
        out += [f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


# ------------------------------------------------------------------------------------ defaults that follow the data
def test_the_default_reward_is_the_datas_own():
    assert GRPOConfig(dataset="reasoning-gym:chain_sum").validate().reward == ["task_solved"]
    assert GRPOConfig(dataset="synthetic:8").validate().reward == GSM8K_RECIPE_REWARDS
    assert GRPOConfig(environment=["tests.test_environments:Tally"]).validate().reward == []
    assert GRPOConfig(dataset="reasoning-gym:chain_sum", reward=["task_solved"]).validate().reward == ["task_solved"]
    assert config_from_args(["--dataset", "reasoning-gym:gcd"]).reward == ["task_solved"]
    assert EvalConfig(dataset="reasoning-gym:chain_sum").validate().reward == ["task_solved"]
    assert EvalConfig(dataset="synthetic:8").validate().reward == ["correctness"]
    assert EvalConfig(environment=["tests.test_environments:Tally"]).validate().reward == []
    # the system prompt: a short-answer one for a reasoning-gym task, GSM8K's R1 layout otherwise; a given one stays
    assert GRPOConfig(dataset="reasoning-gym:chain_sum").validate().system_prompt == TASK_SYSTEM_PROMPT
    assert EvalConfig(dataset="reasoning-gym:chain_sum").validate().system_prompt == TASK_SYSTEM_PROMPT
    assert GRPOConfig(dataset="synthetic:8").validate().system_prompt == SYSTEM_PROMPT
    assert GRPOConfig(dataset="reasoning-gym:gcd", system_prompt="S").validate().system_prompt == "S"


def test_a_reasoning_gym_run_without_reward_trains_on_the_task_verifier(tmp_path, capsys):
    out = tmp_path / "run"
    argv = flags({**TINY, "dataset": "reasoning-gym:chain_sum:16", "task_settings": TWO_TERMS, "max_steps": 1,
                  "output_dir": str(out)})
    assert train.main(argv) == 0
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert "rewards/task_solved/mean" in metrics and not any(k.startswith("rewards/correctness") for k in metrics)
    printed = capsys.readouterr().out
    assert "rewards: task_solved" in printed


def test_an_environment_without_reward_trains_on_its_get_reward(tmp_path):
    source = tmp_path / "game.py"
    source.write_text("class Game:\n    def reset(self, **row):\n        return None\n"
                      "    def get_reward(self):\n        return 1.0\n")
    out = tmp_path / "run"
    argv = flags({**TINY, "dataset": "synthetic:16", "max_steps": 1, "output_dir": str(out)})
    assert train.main([*argv, "--environment", f"{source}:Game"]) == 0  # before: correctness() missing 'answer'
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["rewards/Game/mean"] == 1.0 and not any(k.startswith("rewards/correctness") for k in metrics)


def test_a_reward_whose_column_is_missing_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the policy was loaded before the rewards' columns were checked")

    monkeypatch.setattr(setup, "load_policy", no_model)
    config = GRPOConfig(**TINY, dataset="synthetic:8", reward=["accuracy_reward"], output_dir=str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"reward 'accuracy_reward' needs the argument\(s\) solution.*the columns: "
                                         r"answer, question"):
        Trainer(config)
    source = tmp_path / "mine.py"  # a user's reward: a parameter without a default is a column it needs
    source.write_text("def by_level(prompts, completions, level, answer, **kwargs):\n    return [0.0] * len(prompts)\n")
    config = GRPOConfig(**TINY, dataset="synthetic:8", reward=[f"{source}:by_level"], output_dir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"reward 'by_level' needs the argument\(s\) level,"):
        Trainer(config)
    source.write_text("def loose(prompts, completions, **kwargs):\n    return [0.0] * len(prompts)\n")
    config = GRPOConfig(**TINY, dataset="synthetic:8", reward=[f"{source}:loose"], output_dir=str(tmp_path / "c"),
                        max_steps=1)
    with pytest.raises(AssertionError, match="the policy was loaded"):  # **kwargs alone needs nothing: it goes on
        Trainer(config)


def test_a_refused_reward_leaves_the_run_that_overwrite_would_replace(tmp_path):
    old = tmp_path / "run"
    assert train.main(flags({**TINY, "dataset": "synthetic:16", "reward": "tags", "max_steps": 1,
                             "output_dir": str(old)})) == 0
    assert train.main([*flags({**TINY, "dataset": "synthetic:16", "reward": "accuracy_reward", "max_steps": 1,
                               "output_dir": str(old)}), "--overwrite"]) == 1
    assert (old / "metrics.jsonl").is_file() and (old / "checkpoints").is_dir()  # refused before anything was wiped


def test_eval_refuses_a_reward_whose_column_is_missing(tmp_path, capsys):
    argv = ["--model", "tiny", "--dataset", "synthetic:4", "--scorer", "rewards", "--reward", "accuracy_reward",
            "--device", "cpu", "--output-dir", str(tmp_path)]
    assert eval_program.main(argv) == 1
    assert "needs the argument(s) solution" in capsys.readouterr().err


def test_the_run_opens_with_a_short_summary_not_every_setting(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(flags({**TINY, "dataset": "synthetic:16", "reward": "tags", "max_steps": 1,
                             "output_dir": str(out)})) == 0
    printed = capsys.readouterr().out
    head = printed[: printed.index("output:")]
    assert "settings:" not in printed and len(head) < 600
    for part in ("model:   tiny", "data:    synthetic:16 [train]: 16 problems (gsm8k)", "rewards: tags",
                 "steps:   1; each 2 prompts x 4 completions", f"output:  {out}"):
        assert part in printed
    assert json.loads((out / "run_config.json").read_text())["reward"] == ["tags"]  # every setting is there


def test_the_reasoning_gym_small_preset(tmp_path):
    config = config_from_args(["--preset", "reasoning-gym-small"])
    assert config.dataset == "reasoning-gym:chain_sum:2000" and config.task_settings == PRESETS["reasoning-gym-small"]["task_settings"]
    assert config.system_prompt.startswith("Solve the task") and config.reward == ["task_solved"] and config.beta == 0
    other = config_from_args(["--preset", "reasoning-gym-small", "--dataset", "reasoning-gym:gcd"])
    assert other.task_settings is None  # chain_sum's settings are not gcd's
    given = config_from_args(["--preset", "reasoning-gym-small", "--dataset", "reasoning-gym:gcd", "--task-settings",
                              '{"max_value": 50}'])
    assert given.task_settings == {"max_value": 50}
    same_task = config_from_args(["--preset", "reasoning-gym-small", "--dataset", "reasoning-gym:chain_sum:500"])
    assert same_task.task_settings == PRESETS["reasoning-gym-small"]["task_settings"]  # another N, the same task
    # a config file's task settings are its own, with or without a preset
    file = tmp_path / "run.yaml"
    file.write_text("dataset: reasoning-gym:gcd\ntask_settings: {max_value: 40}\n")
    assert config_from_args(["--config", str(file)]).task_settings == {"max_value": 40}
    assert config_from_args(["--preset", "reasoning-gym-small", "--config", str(file)]).task_settings == {"max_value": 40}


# ------------------------------------------------------------------------------------------ the guards themselves
def test_answer_metrics_per_group_and_over_the_step():
    answers = ["1", "1", "2", None, "3", "3", "3", "3"]  # two groups of 4
    metrics = answer_metrics(answers, 4)
    assert metrics["answers/distinct_share"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["answers/most_common_share"] == pytest.approx(4 / 7)
    assert metrics["answers/answered"] == pytest.approx(7 / 8)


def test_collapse_warns_once_when_one_answer_outgrows_the_gold_answers(caplog):
    golds = [str(i % 7) for i in range(32)]
    watch = CollapseWatch()
    varied = [str((i * 3) % 7) for i in range(32)]
    assert all(watch.update(step, varied, golds) is None for step in range(WINDOW))  # answers as varied as the golds
    with caplog.at_level(logging.WARNING, logger="grpo"):
        warnings = [watch.update(step, ["1"] * 32, golds) for step in range(WINDOW, 3 * WINDOW)]
    fired = [w for w in warnings if w]
    assert len(fired) == 1 and "'1'" in fired[0] and "collapsing" in caplog.text  # once per answer
    # a task whose gold answer mostly is "1" is not a collapse when the policy says "1" as often
    honest = CollapseWatch()
    assert all(honest.update(step, ["1"] * 30 + ["2", "3"], ["1"] * 28 + ["2"] * 4) is None for step in range(10))
    # no gold answer known (an environment's rewritten prompt): only a near-total collapse warns
    unknown = CollapseWatch()
    assert all(unknown.update(step, ["1"] * 24 + [str(i) for i in range(8)], [None] * 32) is None for step in range(10))
    assert unknown.update(10, ["1"] * 32, [None] * 32) is None  # the window still holds the 75% steps
    assert any(unknown.update(step, ["1"] * 32, [None] * 32) for step in range(11, 11 + WINDOW))
    # below the share nothing fires, whatever the golds
    spread = CollapseWatch()
    half = ["1"] * int(32 * (COLLAPSE_SHARE - 0.1)) + [str(i) for i in range(100, 132)]
    assert all(spread.update(step, half[:32], golds) is None for step in range(10))


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_a_run_forced_to_one_answer_warns(tmp_path, caplog, dynamic_sampling):
    """A constant-answer policy: every completion the sampler makes is replaced by `<answer>7</answer>` before it is
    scored, so the run trains on exactly what such a policy would give; the warning must fire. Under dynamic
    sampling every such group ties and is dropped: the guards read round 0, which holds them all."""
    config = GRPOConfig(**TINY, dataset="synthetic:64", reward=["tags"], max_steps=WINDOW + 1,
                        dynamic_sampling=dynamic_sampling, output_dir=str(tmp_path / "run"))
    trainer = Trainer(config)
    fixed = trainer.data.tokenizer("<answer>7</answer>", add_special_tokens=False)["input_ids"] + [trainer.loop.sampling.eos_token_ids[0]]
    generate = trainer.generation.generate

    kept = []  # under dynamic sampling: the texts the update trained on

    def constant(prompt_ids, group, params, noise, **kwargs):
        sample = generate(prompt_ids, group, params, noise, **kwargs)
        rows = group if dynamic_sampling else sample.completion_ids.shape[0]  # dynamic: the first group only
        width = max(len(fixed), sample.completion_ids.shape[1])
        ids = torch.nn.functional.pad(sample.completion_ids, (0, width - sample.completion_ids.shape[1]),
                                      value=trainer.data.tokenizer.pad_token_id)  # (N, T')
        mask = torch.nn.functional.pad(sample.completion_mask, (0, width - sample.completion_mask.shape[1]))
        ids[:rows] = torch.tensor([fixed + [trainer.data.tokenizer.pad_token_id] * (width - len(fixed))] * rows)
        mask[:rows] = torch.tensor([[1] * len(fixed) + [0] * (width - len(fixed))] * rows)
        sample.completion_ids, sample.completion_mask = ids, mask
        sample.truncated = sample.truncated.clone()
        sample.truncated[:rows] = False
        sample.logprobs = None if sample.logprobs is None else torch.zeros(ids.shape)
        return sample

    trainer.generation.generate = constant
    train_step = trainer.train_step

    def recording_step(*args):
        output = train_step(*args)
        kept.append(output.texts)
        return output

    trainer.train_step = recording_step
    with caplog.at_level(logging.WARNING, logger="grpo"):
        trainer.train()
    assert "the answers are collapsing to one value: '7'" in caplog.text
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(m["answers/most_common_share"] == 1.0 for m in metrics)  # every answer given is '7'
    if not dynamic_sampling:
        assert all(m["answers/distinct_share"] == 1 / 4 for m in metrics)
    else:  # the constant group ties and is dropped when another is informative: the guards saw it anyway
        assert any(not any("<answer>7</answer>" in text for text in texts) for texts in kept)


def test_a_varied_run_does_not_warn(tmp_path, caplog):
    config = GRPOConfig(**TINY, dataset="synthetic:64", reward=["tags"], max_steps=WINDOW + 1, temperature=1.0,
                        output_dir=str(tmp_path / "run"))
    trainer = Trainer(config)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        trainer.train()
    assert "collapsing" not in caplog.text  # a random tiny model gives scattered answers, or none


def test_prior_summary_finds_the_best_constant_and_the_accuracy_beyond_it():
    golds = ["1"] * 6 + ["2"] * 3 + ["5"]
    answers = ["1"] * 6 + ["2", "3", None, "5"]
    correct = [a == g for a, g in zip(answers, golds)]
    summary = prior_summary(answers, golds, correct, lambda c: [g == c for g in golds])
    assert summary["best_constant_answer"] == "1" and summary["best_constant_accuracy"] == 0.6
    assert summary["answers/most_common"] == "1" and summary["answers/most_common_share"] == pytest.approx(6 / 9)
    assert summary["accuracy_beyond_constant"] == pytest.approx(2 / 4)  # "2" and "5" right among the 4 others
    assert "best_constant_answer" not in prior_summary(answers, [None] * 10, correct, None)


def test_eval_reports_the_prior_beside_accuracy(tmp_path, capsys):
    argv = ["--model", "tiny", "--dataset", "reasoning-gym:chain_sum:40", "--task-settings", json.dumps(TWO_TERMS),
            "--split", "test", "--limit", "12", "--max-completion-length", "4", "--batch-size", "12", "--device", "cpu",
            "--output-dir", str(tmp_path)]
    assert eval_program.main(argv) == 0
    summary = json.loads((tmp_path / "tiny.summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "tiny.samples.jsonl").read_text().splitlines()]
    golds = [row["gold"] for row in rows]
    best = max(golds.count(gold) for gold in golds) / len(golds)
    assert summary["best_constant_accuracy"] >= best  # at least the most common gold answer's share
    assert summary["best_constant_answer"] in golds and 0 <= summary["accuracy_beyond_constant"] <= 1
    assert "would score" in capsys.readouterr().out and all("answer" in row for row in rows)
