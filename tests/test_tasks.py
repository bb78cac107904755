"""Tasks beyond GSM8K from the command line, rewards and scorers from user files, and the generation seam."""

import json

import pytest
import torch

import train
from data import DataError, load_task_rows
from grpo.core.metrics import read_jsonl
from rewards import parse_reward_specs

REWARD_FILE = '''
from rewards import completion_text

def score(prompts, completions, target, **columns):
    """1 when the completion mentions the row's target word, else 0; None for rows without a target."""
    return [None if t is None else float(t in completion_text(c)) for c, t in zip(completions, target)]

def length_bonus(prompts, completions, **columns):
    return [min(len(completion_text(c)), 50) / 50 for c in completions]

def id_count(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]

def my_scorer(completion, row):
    return {"mentions_target": float(row["target"] in completion), "chars": len(completion)}
'''


def _write_task(tmp_path, chat: bool):
    rows = []
    for index in range(12):
        question = f"Name a colour, please ({index})."
        prompt = [{"role": "user", "content": question}] if chat else question
        rows.append({"prompt": prompt, "target": "red" if index % 2 else "blue", "source": f"toy-{index}"})
    data = tmp_path / "my.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(REWARD_FILE)
    return data, rewards


@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False])
def test_train_on_a_jsonl_task_with_a_reward_file(tmp_path, chat, capsys):
    data, rewards = _write_task(tmp_path, chat)
    out = tmp_path / "run"
    code = train.main(["--model", "tiny", "--dataset", str(data), "--eval-split", "train",
                       "--reward", f"{rewards}:score", f"{rewards}:length_bonus:0.5", f"{rewards}:id_count:0",
                       "--output-dir", str(out), "--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "4",
                       "--micro-batch-size", "8", "--max-completion-length", "8", "--max-prompt-length", "64",
                       "--device", "cpu", "--learning-rate", "1e-3", "--save-steps", "0", "--eval-steps", "2",
                       "--eval-limit", "4", "--logging-steps", "1"])
    assert code == 0, capsys.readouterr().err
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2 and "rewards/score/mean" in metrics[0] and "rewards/length_bonus/mean" in metrics[0]
    # evaluation scores with the training rewards, completion_ids included (trl's convention, as in training)
    assert {"eval/rewards/score", "eval/rewards/length_bonus", "eval/rewards/id_count", "eval/reward"} <= set(metrics[-1])
    assert metrics[-1]["eval/rewards/id_count"] == metrics[-1]["eval/mean_length"]
    record = json.loads((out / "run_config.json").read_text())
    assert record["task"] == "prompt"
    assert [(r["name"], r["weight"]) for r in record["reward_functions"]] == [("score", 1.0), ("length_bonus", 0.5),
                                                                              ("id_count", 0.0)]
    assert record["reward_functions"][0]["function"].endswith(":score")


def test_gsm8k_checks_apply_to_gsm8k_rows_only(tmp_path):
    data, _ = _write_task(tmp_path, chat=True)  # no question/answer columns: a prompt task, nothing to parse
    rows, task = load_task_rows(str(data), "train")
    assert task == "prompt" and len(rows) == 12 and rows[0]["target"] == "blue"
    rows, task = load_task_rows("synthetic:8", "train")
    assert task == "gsm8k" and rows[0]["prompt"][0]["role"] == "system"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": ""}) + "\n" + json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(DataError, match="row 1 has an empty prompt"):
        load_task_rows(str(bad), "train")
    rows, _ = load_task_rows(str(bad), "train", skip_bad_rows=True)
    assert rows == [{"prompt": "ok"}]
    neither = tmp_path / "neither.jsonl"
    neither.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(DataError, match="missing column"):  # not a prompt task, and not GSM8K either
        load_task_rows(str(neither), "train")


def test_reward_specs_from_modules_and_files(tmp_path):
    _, rewards = _write_task(tmp_path, chat=True)
    specs = parse_reward_specs(["correctness:2", f"{rewards}:score", f"{rewards}:length_bonus:0.25",
                                "rewards.toy:tags", "int:0.5"])
    assert [(s.name, s.weight) for s in specs] == [("correctness", 2.0), ("score", 1.0), ("length_bonus", 0.25),
                                                  ("tags", 1.0), ("int", 0.5)]
    for bad, message in [(f"{tmp_path}/missing.py:score", "no such file"), (f"{rewards}:nothing", "has no function"),
                         ("no_such_module_xyz:fn", "cannot import module"), ("correctness:two", "is not a number"),
                         ("unknown_reward", "unknown reward")]:
        with pytest.raises(ValueError, match=message):
            parse_reward_specs([bad])


def test_eval_py_on_a_prompt_task_with_a_scorer_file(tmp_path, tiny_model_dir, capsys):
    import eval as eval_program

    data, rewards = _write_task(tmp_path, chat=True)
    code = eval_program.main(["--model", str(tiny_model_dir), "--dataset", str(data), "--split", "train", "--limit", "3",
                              "--scorer", f"{rewards}:my_scorer", "--max-completion-length", "6", "--device", "cpu",
                              "--output-dir", str(tmp_path / "eval")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(next((tmp_path / "eval").glob("*.summary.json")).read_text())
    assert summary["num_samples"] == 3 and {"mentions_target", "chars", "mean_length"} <= set(summary)


def test_transformers_generate_backend_behind_the_seam(tiny_model_and_tokenizer):
    # Greedy decoding has one answer: model.generate behind the seam must give our sampler's tokens, mask and
    # truncation flags, grouped the same way, and the log-probs of the tokens it drew.
    from grpo.generation.rollout import GroupSampler, TransformersGenerate
    from grpo.algorithm.sampler import SamplingParams

    model, tokenizer = tiny_model_and_tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in ("What is 2 + 3?", "Hi")]
    eos = tokenizer.convert_tokens_to_ids("<answer>")  # a token the tiny model emits, so some rows stop early
    params = SamplingParams(max_completion_length=12, temperature=0.0, eos_token_ids=(eos,))
    ours = GroupSampler(model, tokenizer.pad_token_id).generate(prompts, 2, params, return_logprobs=True)
    theirs = TransformersGenerate(model, tokenizer.pad_token_id).generate(prompts, 2, params, return_logprobs=True)
    width = ours.completion_ids.shape[1]
    assert torch.equal(theirs.completion_ids[:, :width], ours.completion_ids)
    assert torch.equal(theirs.completion_mask[:, :width], ours.completion_mask)
    assert torch.equal(theirs.truncated, ours.truncated)
    torch.testing.assert_close(theirs.logprobs[:, :width], ours.logprobs, rtol=1e-5, atol=1e-5)
    sampled = TransformersGenerate(model, tokenizer.pad_token_id).generate(
        prompts, 3, SamplingParams(max_completion_length=6, eos_token_ids=(eos,)), torch.Generator().manual_seed(1))
    again = TransformersGenerate(model, tokenizer.pad_token_id).generate(
        prompts, 3, SamplingParams(max_completion_length=6, eos_token_ids=(eos,)), torch.Generator().manual_seed(1))
    assert sampled.completion_ids.shape[0] == 6 and torch.equal(sampled.completion_ids, again.completion_ids)
    # cache_implementation (trl's field) reaches generate: a static cache gives the dynamic one's greedy tokens; and
    # no sampling setting comes from the model's generation_config.json (Qwen2.5's sets a repetition penalty)
    model.generation_config.repetition_penalty = 1.5
    calls, generate = [], model.generate
    model.generate = lambda *args, **kwargs: calls.append(kwargs.get("cache_implementation")) or generate(*args,
                                                                                                         **kwargs)
    try:
        static = TransformersGenerate(model, tokenizer.pad_token_id, "static").generate(prompts, 2, params,
                                                                                        return_logprobs=True)
    finally:
        del model.generate
        model.generation_config.repetition_penalty = 1.0
    assert calls == ["static"]
    assert torch.equal(static.completion_ids, theirs.completion_ids)
    torch.testing.assert_close(static.logprobs, theirs.logprobs, rtol=1e-5, atol=1e-5)
    from grpo.config import GRPOConfig

    with pytest.raises(ValueError, match="cache_implementation='static' is an option of transformers' generate"):
        GRPOConfig(cache_implementation="static").validate()


@pytest.mark.slow
def test_training_through_the_transformers_backend(tmp_path):
    from grpo.config import GRPOConfig
    from grpo.core.trainer import Trainer

    config = GRPOConfig(model="tiny", dataset="synthetic:16", output_dir=str(tmp_path / "run"), max_steps=2,
                        prompts_per_step=2, num_generations=4, micro_batch_size=8, max_completion_length=8,
                        reward=["tags"], device="cpu", save_steps=0, generation_backend="transformers")
    trainer = Trainer(config)
    updates = []
    trainer.generation.after_update = lambda: updates.append(trainer.step)  # the hook runs after every update
    assert trainer.train()["status"] == "finished" and updates == [0, 1]
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["generation"] == "TransformersGenerate"
