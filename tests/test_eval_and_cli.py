import json

import pytest

import eval as eval_cli
from grpo.cli import build_parser, config_from_args
from grpo.config import GRPOConfig
from grpo.evaluation.evaluate import score_answer
from tests.conftest import gsm8k_dir

GOOD = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        (GOOD, "#### 7", dict(strict=True, lenient=True, format=True)),
        (GOOD, "#### 8", dict(strict=False, lenient=False, format=True)),
        ("The answer is 7.", "#### 7", dict(strict=False, lenient=True, format=False)),  # last number only
        ("<answer>7</answer> but really 9", "#### 7", dict(strict=True, lenient=False, format=False)),
        ("<reasoning>\nx\n</reasoning>\n<answer>\n$1,000\n</answer>", "#### 1000", dict(strict=True, lenient=True, format=True)),
        ("", "#### 7", dict(strict=False, lenient=False, format=False)),
    ],
)
def test_score_answer(completion, gold, expected):
    assert score_answer(completion, gold) == expected


@pytest.mark.skipif(gsm8k_dir() is None, reason="../shared/data/gsm8k is not present")
def test_eval_cli_on_the_shared_test_file(tmp_path, capsys):
    code = eval_cli.main(["--model", "tiny", "--dataset", str(gsm8k_dir() / "test.jsonl"), "--limit", "6",
                          "--max-completion-length", "8", "--batch-size", "4", "--device", "cpu",
                          "--compare", "tiny:tiny", "--output-dir", str(tmp_path),
                          "--chat-template-kwargs", '{"enable_thinking": false}'])  # the tiny template ignores it
    assert code == 0
    summary = json.loads((tmp_path / "tiny.summary.json").read_text())
    assert summary["num_samples"] == 6 and 0 <= summary["strict_accuracy"] <= 1
    records = [json.loads(line) for line in (tmp_path / "tiny.samples.jsonl").read_text().splitlines()]
    assert len(records) == 6 and records[0]["gold"] == "18"  # the first test problem's answer
    assert "tiny:tiny" in capsys.readouterr().out  # side by side


def test_flags_come_from_the_config_and_every_default_is_shown():
    help_text = " ".join(build_parser().format_help().split())
    import dataclasses

    for f in dataclasses.fields(GRPOConfig):
        assert "--" + f.name.replace("_", "-") in help_text, f.name
    assert "(default: 0.04)" in help_text  # beta


def test_precedence_defaults_preset_file_flags(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("beta: 0.1\nlearning_rate: 1.0e-4\nreward: [correctness:2, int]\n")
    config = config_from_args(["--preset", "smoke", "--config", str(config_file), "--beta", "0.2"])
    assert config.model == "tiny"  # preset
    assert config.learning_rate == 1e-4 and config.reward == ["correctness:2", "int"]  # file over preset
    assert config.beta == 0.2  # flag over file
    assert config_from_args(["--epsilon-high", "0.28"]).epsilon_high == 0.28
    assert config_from_args(["--no-gradient-checkpointing"]).gradient_checkpointing is False


def test_config_file_with_an_unknown_key_is_named(tmp_path):
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps({"betta": 0.1}))
    with pytest.raises(ValueError, match=r"unknown setting\(s\) betta \(did you mean beta\?\)"):
        config_from_args(["--config", str(config_file)])


# A Qwen3-style switch: the template writes an empty think block when enable_thinking is false.
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_in_training_and_evaluation(tmp_path, monkeypatch, capsys):
    from grpo.evaluation import evaluate as evaluation
    from grpo.generation.prompts import encode_prompt
    from grpo.tiny_model import build_tokenizer
    from grpo.core.trainer import Trainer
    from tests.test_trainer import make_config

    off = {"enable_thinking": False}
    assert config_from_args(["--chat-template-kwargs", '{"enable_thinking": false}']).chat_template_kwargs == off
    assert config_from_args(["--chat-template-kwargs", "none"]).chat_template_kwargs is None
    for bad in ("[1, 2]", "{enable_thinking: false}"):
        with pytest.raises(SystemExit):
            config_from_args(["--chat-template-kwargs", bad])
        assert "--chat-template-kwargs" in capsys.readouterr().err
    config_file = tmp_path / "run.yaml"
    config_file.write_text("chat_template_kwargs: [enable_thinking]\n")
    with pytest.raises(ValueError, match=r"chat_template_kwargs must be a mapping of names to values \(a JSON object\)"):
        config_from_args(["--config", str(config_file)])

    tokenizer = build_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "2 + 3?"}]
    plain, without_thinking = encode_prompt(tokenizer, messages), encode_prompt(tokenizer, messages, off)
    assert without_thinking[: len(plain)] == plain and tokenizer.decode(without_thinking[len(plain):]) == "<think>\n\n</think>\n\n"
    seen = []
    encode = evaluation.encode_prompts
    monkeypatch.setattr(evaluation, "encode_prompts", lambda *args, **kwargs: (seen.append(kwargs), encode(*args, **kwargs))[1])
    trainer = Trainer(make_config(tmp_path, chat_template_kwargs=off, eval_steps=1, eval_limit=2, max_steps=1),
                      tokenizer=tokenizer)
    think = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert all(ids[-len(think):] == think for ids in trainer.data.train_prompt_ids)
    trainer.train()
    assert seen and seen[-1]["chat_template_kwargs"] == off  # the periodic evaluation's prompts too
    assert eval_cli.EvalConfig(chat_template_kwargs=off).validate().chat_template_kwargs == off
