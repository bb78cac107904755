"""Reward models as reward functions (rewards/reward_model.py): the same scores as trl 1.16's GRPOTrainer, the
--reward forms that name one, loading only when the run starts, the errors, and a run that trains with one.

The reward model is a tiny Qwen2ForSequenceClassification (one label, seeded random init, its score head scaled so
the scores are O(1)) saved with the tiny models' ChatML tokenizer (grpo/tiny_model.py). trl scores through its own
`GRPOTrainer._calculate_rewards` on a GRPOTrainer built with `reward_funcs=[folder, model]`, so trl loads the
folder, picks the name and fixes the pad token itself. Tolerances: rtol 1e-5 / atol 1e-6 in fp32 (our batches
of 1 or 2 texts pad differently from trl's one batch; the masked positions add exact zeros, the matmul shapes differ).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import processors
from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

from grpo.algorithm.advantages import weighted_rewards
from grpo.config import GRPOConfig
from grpo.core.metrics import read_jsonl
from grpo.core.trainer import Trainer
from grpo.tiny_model import IM_START, build_tokenizer, save_tiny_model
from rewards import parse_reward_specs, score_completions
from rewards.reward_model import RewardModel
from rewards.toy import tags

ROOT = Path(__file__).resolve().parents[1]

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
]
CHAT_COMPLETIONS = [  # 1 word, a long answer with tags, a sentence: the batch pads the short ones
    [{"role": "assistant", "content": "5"}],
    [{"role": "assistant", "content": "<reasoning>2 plus 3 makes 5</reasoning>\n<answer>5</answer>"}],
    [{"role": "assistant", "content": "Blue, like the sky on a clear day."}],
]
TEXT_PROMPTS = ["Question: 2 + 3 =", "Question: 2 + 3 =", "Name a colour:"]
TEXT_COMPLETIONS = [" 5", " <reasoning>2 plus 3 makes 5</reasoning><answer>5</answer>", " blue<|im_end|>"]


def build_reward_model(tokenizer, seed: int = 3, num_labels: int = 1) -> Qwen2ForSequenceClassification:
    """A tiny random-init sequence classifier, its score head scaled x30 so the scores spread over O(1)."""
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels, pad_token_id=None)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.score.weight.mul_(30.0)
    return model.eval()


def tokenizer_without_pad():
    """The tiny tokenizer without a pad token (trl, and we, pad with EOS then: <|im_end|>), which would prepend a
    BOS (<|im_start|>) if asked for special tokens: trl tokenizes with add_special_tokens=False (the template wrote
    them)."""
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    bos = tokenizer.convert_tokens_to_ids(IM_START)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single=f"{IM_START} $A",
                                                                               special_tokens=[(IM_START, bos)])
    return tokenizer


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """`my-rm/`: the reward model and the tiny ChatML tokenizer, saved as trl's reward_funcs=[folder] loads them."""
    folder = tmp_path_factory.mktemp("reward_models") / "my-rm"
    tokenizer = build_tokenizer()
    build_reward_model(tokenizer).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trl_trainer(rm_dir, tmp_path_factory):
    """trl's GRPOTrainer on the tiny policy with two reward models: the folder (trl loads it and its tokenizer) and
    a built model whose tokenizer (reward_processing_classes) has no pad token."""
    trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[parity]' (trl==1.16.0)")
    datasets = pytest.importorskip("datasets")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    out = tmp_path_factory.mktemp("trl_rm")
    policy = save_tiny_model(out / "policy", "tiny", seed=0)
    args = trl.GRPOConfig(output_dir=str(out / "run"), use_cpu=True, bf16=False, report_to="none",
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1)
    return trl.GRPOTrainer(model=str(policy), reward_funcs=[str(rm_dir), build_reward_model(build_tokenizer(), seed=4)],
                           reward_processing_classes=[None, tokenizer_without_pad()], args=args,
                           train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 4))


def trl_rewards(trainer, prompts, completions) -> torch.Tensor:
    """(N, 2) rewards through trl's own _calculate_rewards (its chat template, tokenization and logits[:, 0])."""
    return trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, [[0]] * len(prompts))


# ----------------------------------------------------------------------------- parity with trl 1.16
@pytest.mark.parity
@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_scores_are_trls(trl_trainer, rm_dir, kind, batch_size):
    prompts, completions = (CHAT_PROMPTS, CHAT_COMPLETIONS) if kind == "chat" else (TEXT_PROMPTS, TEXT_COMPLETIONS)
    expected = trl_rewards(trl_trainer, prompts, completions)  # (3, 2)
    from_folder = RewardModel(str(rm_dir), batch_size=batch_size)
    built = RewardModel(build_reward_model(build_tokenizer(), seed=4), tokenizer_without_pad(), batch_size=batch_size)
    ours = torch.tensor([from_folder(prompts, completions), built(prompts, completions)]).T  # (3, 2)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert from_folder.name == trl_trainer.reward_func_names[0] == "my-rm"
    assert built.tokenizer.pad_token == "<|im_end|>" and built.model.config.pad_token_id == built.tokenizer.eos_token_id
    assert len(set(ours[:, 0].tolist())) == 3  # three different scores: a test that can fail


@pytest.mark.parity
def test_the_texts_are_trls_chat_template_over_prompt_and_completion(rm_dir):
    """What the model reads: trl.data_utils.apply_chat_template({"messages": p + c})["text"], and p + c for text."""
    data_utils = pytest.importorskip("trl.data_utils", reason="trl is not installed: pip install -e '.[parity]'")

    model = RewardModel(str(rm_dir)).load("cpu")
    assert model.texts(CHAT_PROMPTS, CHAT_COMPLETIONS) == [
        data_utils.apply_chat_template({"messages": p + c}, model.tokenizer)["text"]
        for p, c in zip(CHAT_PROMPTS, CHAT_COMPLETIONS)]
    assert model.texts(TEXT_PROMPTS, TEXT_COMPLETIONS)[1] == TEXT_PROMPTS[1] + TEXT_COMPLETIONS[1]


def test_padding_does_not_change_a_score(rm_dir):
    """The score is read at the last real token: a text scored alone, or beside a longer one, scores the same."""
    model = RewardModel(str(rm_dir), batch_size=16)
    alone = [model(CHAT_PROMPTS[i : i + 1], CHAT_COMPLETIONS[i : i + 1])[0] for i in range(3)]
    torch.testing.assert_close(torch.tensor(model(CHAT_PROMPTS, CHAT_COMPLETIONS)), torch.tensor(alone),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- --reward forms
def test_the_reward_forms_that_name_a_model(rm_dir, monkeypatch):
    monkeypatch.chdir(rm_dir.parent)
    forms = {str(rm_dir): 1.0, f"{rm_dir}/": 1.0, f"{rm_dir}:0.5": 0.5, "./my-rm:0.1": 0.1, "my-rm": 1.0,
             f"model:{rm_dir}": 1.0, f"model:{rm_dir}:2": 2.0, "model:./my-rm:-1": -1.0, "model:my-rm": 1.0,
             "model:some-org/some-rm": 1.0, "model:some-org/some-rm:2.5": 2.5}
    for form, weight in forms.items():
        (spec,) = parse_reward_specs([form])
        expected_name = "some-rm" if "some-org" in form else "my-rm"  # the last path component, as trl
        assert (spec.name, spec.weight, type(spec.fn)) == (expected_name, weight, RewardModel), form
        assert spec.fn.model is None and spec.fn.device is None, form  # described, not loaded
    assert parse_reward_specs(["model:some-org/some-rm"])[0].fn.source == "some-org/some-rm"
    mixed = parse_reward_specs(["tags", "correctness:2", "rewards.gsm8k:int_answer:3", "./my-rm:0.1"])
    assert [(s.name, s.weight) for s in mixed] == [("tags", 1.0), ("correctness", 2.0), ("int_answer", 3.0),
                                                   ("my-rm", 0.1)]


@pytest.mark.parametrize("spec, message", [
    ("nonexistent-reward", r"unknown reward 'nonexistent-reward'; .*a local folder \(path/to/rm\) or model:ORG/NAME"),
    ("model:", r"needs a folder or hub id"),
    ("model:./no-such-rm", r"no such folder"),
    ("model:org/rm:heavy", r"weight 'heavy' is not a number"),
    ("{empty}", r"the folder .*empty has no config.json, so it is not a model folder"),
    ("model:{empty}:2", r"the folder .*empty has no config.json"),
])
def test_reward_spec_errors(spec, message, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        parse_reward_specs([spec.format(empty=tmp_path / "empty")])


def test_checking_a_config_loads_no_model(rm_dir, monkeypatch):
    """Validation parses --reward (it names unknown ones) but never loads a reward model; the first call does."""
    loads = []
    original = AutoModelForSequenceClassification.from_pretrained.__func__
    def counted(cls, *args, **kwargs):
        loads.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", classmethod(counted))
    config = GRPOConfig(model="tiny", dataset="synthetic:8", reward=["tags", f"{rm_dir}:0.5",
                                                                      "model:some-org/unreachable-rm"]).validate()
    (_, spec, hub_spec) = parse_reward_specs(config.reward)
    assert loads == [] and spec.fn.model is None
    score = spec.fn(TEXT_PROMPTS[:1], TEXT_COMPLETIONS[:1])
    assert loads == [str(rm_dir)] and spec.fn.device == torch.device("cpu") and isinstance(score[0], float)
    with pytest.raises(ValueError, match=r"reward model 'some-org/unreachable-rm': could not be loaded"):
        hub_spec.fn.load("cpu")  # HF_HUB_OFFLINE (conftest.py): the hub id is tried only now


# ----------------------------------------------------------------------------- errors that name the model
def test_a_causal_lm_folder_is_refused_not_scored_by_a_random_head(tmp_path):
    policy = save_tiny_model(tmp_path / "policy", "tiny", seed=0)
    (spec,) = parse_reward_specs([str(policy)])  # a model folder: only loading can tell what it holds
    with pytest.raises(ValueError, match=r"reward model '.*policy': not a sequence-classification model with one label "
                                         r"\(its checkpoint is a Qwen2ForCausalLM; weights missing .*score.weight"):
        spec.fn.load("cpu")


def test_a_two_label_head_is_refused(tmp_path):
    tokenizer = build_tokenizer()
    build_reward_model(tokenizer, num_labels=2).save_pretrained(tmp_path / "two-labels")
    tokenizer.save_pretrained(tmp_path / "two-labels")
    with pytest.raises(ValueError, match=r"'.*two-labels': not a sequence-classification model with one label.*score"):
        RewardModel(str(tmp_path / "two-labels")).load("cpu")
    with pytest.raises(ValueError, match=r"reward model 'Qwen2ForSequenceClassification': its score head has 2 labels"):
        RewardModel(build_reward_model(tokenizer, num_labels=2), tokenizer)
    with pytest.raises(ValueError, match=r"reward model 'Qwen2ForCausalLM': a Qwen2ForCausalLM, not a sequence-class"):
        from grpo.tiny_model import build_tiny_model
        RewardModel(build_tiny_model("tiny")[0], tokenizer)


def test_chat_prompts_need_a_chat_template_and_a_built_model_a_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    model = RewardModel(build_reward_model(tokenizer), tokenizer, name="plain-rm")
    assert len(model(TEXT_PROMPTS, TEXT_COMPLETIONS)) == 3  # plain text needs no template
    with pytest.raises(ValueError, match=r"reward model 'plain-rm': the prompts are chat messages but its tokenizer "
                                         r"has no chat template"):
        model(CHAT_PROMPTS, CHAT_COMPLETIONS)
    with pytest.raises(ValueError, match=r"'Qwen2ForSequenceClassification': built in memory, so its tokenizer cannot"):
        RewardModel(build_reward_model(tokenizer)).load("cpu")


# ----------------------------------------------------------------------------- in a run
def test_the_weight_scales_the_models_score_in_the_reward(rm_dir):
    """r_i = 0.5 * RM_i + tags_i: the weighted sum of grpo.algorithm.advantages, by hand."""
    specs = parse_reward_specs([f"{rm_dir}:0.5", "tags"])
    rewards_per_func = score_completions(specs, CHAT_PROMPTS, CHAT_COMPLETIONS, {})  # (3, 2)
    scores = torch.tensor(RewardModel(str(rm_dir))(CHAT_PROMPTS, CHAT_COMPLETIONS))
    tag_scores = torch.tensor(tags(CHAT_PROMPTS, CHAT_COMPLETIONS))  # [0, 0.5, 0]: four tags in the second
    assert tag_scores.tolist() == [0.0, 0.5, 0.0]
    weights = torch.tensor([spec.weight for spec in specs])
    torch.testing.assert_close(weighted_rewards(rewards_per_func, weights), 0.5 * scores + tag_scores,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_trainer_puts_the_model_on_its_device_and_scores_its_rollout(rm_dir, tmp_path):
    config = GRPOConfig(model="tiny", dataset="synthetic:16", prompts_per_step=2, num_generations=2,
                        micro_batch_size=4, max_prompt_length=128, max_completion_length=6, device="cpu",
                        precision="fp32", reward=["tags", f"{rm_dir}:0.5"], save_steps=0, log_completions_steps=0,
                        output_dir=str(tmp_path / "run"))
    trainer = Trainer(config)
    model = trainer.rewards[1].fn
    assert model.device == trainer.models.device and next(model.model.parameters()).device == trainer.models.device
    metrics, rollout, prompts, texts, _ = trainer.train_step()
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    expected = RewardModel(str(rm_dir))(prompts, completions)
    torch.testing.assert_close(rollout.rewards_per_func[:, 1], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert metrics["rewards/my-rm/mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_reward_processing_classes_reach_the_reward_models(rm_dir, tmp_path):
    """trl's argument: one tokenizer or a list aligned with the reward functions; None keeps the model's own."""
    custom = tokenizer_without_pad()
    config = GRPOConfig(model="tiny", dataset="synthetic:16", prompts_per_step=2, num_generations=2,
                        micro_batch_size=4, max_prompt_length=128, max_completion_length=6, device="cpu",
                        save_steps=0, output_dir=str(tmp_path / "run"))
    trainer = Trainer(config, reward_functions=[tags, str(rm_dir), RewardModel(str(rm_dir), name="second-rm")],
                      reward_processing_classes=[build_tokenizer(), custom, None])
    assert trainer.rewards[0].fn is tags
    assert trainer.rewards[1].fn.tokenizer is custom and custom.pad_token == "<|im_end|>"  # trl: pad with EOS
    own = trainer.rewards[2].fn.tokenizer
    assert own is not custom and own.pad_token == "<|endoftext|>"  # loaded from the folder
    with pytest.raises(ValueError, match=r"number of reward processing classes \(1\) must match the number of reward "
                                         r"functions \(2\)"):
        Trainer(config, reward_functions=[tags, str(rm_dir)], reward_processing_classes=custom)


@pytest.mark.slow
@pytest.mark.own_kernels  # a subprocess: train.py's own --kernels
def test_train_py_trains_a_step_with_a_reward_model(rm_dir, tmp_path):
    out = tmp_path / "run"
    relative = os.path.relpath(rm_dir, tmp_path)  # `./path/to/rm:0.1`, from the folder the command runs in
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--preset", "smoke", "--max-steps", "1",
                             "--reward", "tags", f"./{relative}:0.1", "--output-dir", str(out)],
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rewards: tags, my-rm:0.1" in result.stdout
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert "rewards/my-rm/mean" in metrics and "rewards/tags/mean" in metrics
    reward = metrics["rewards/tags/mean"] + 0.1 * metrics["rewards/my-rm/mean"]  # no None rows: means add linearly
    assert metrics["reward"] == pytest.approx(reward, rel=1e-5, abs=1e-6)
    described = json.loads((out / "run_config.json").read_text())["reward_functions"][1]
    assert described == {"name": "my-rm", "weight": 0.1, "function": "rewards.reward_model:RewardModel",
                         "model": f"./{relative}"}


def test_eval_py_scores_with_a_reward_model(rm_dir, tmp_path):
    import eval as eval_cli

    code = eval_cli.main(["--model", "tiny", "--dataset", "synthetic:4", "--limit", "2", "--scorer", "rewards",
                          "--reward", f"{rm_dir}:2", "tags", "--max-completion-length", "4", "--device", "cpu",
                          "--output-dir", str(tmp_path)])
    assert code == 0
    records = read_jsonl(tmp_path / "tiny.samples.jsonl")
    assert len(records) == 2
    for record in records:  # reward = 2 * RM + tags, per completion
        assert record["reward"] == pytest.approx(2 * record["rewards/my-rm"] + record["rewards/tags"], rel=1e-6)
    summary = json.loads((tmp_path / "tiny.summary.json").read_text())
    assert summary["rewards/my-rm"] == pytest.approx(sum(r["rewards/my-rm"] for r in records) / 2, rel=1e-6)


def test_a_folder_without_tokenizer_files_is_refused_by_name(rm_dir, tmp_path):
    # transformers builds a one-token tokenizer from a folder that holds none: refused at load, before any scoring.
    import shutil

    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(rm_dir / name, folder / name)
    with pytest.raises(ValueError, match=r"reward model 'no-tokenizer': its tokenizer has 1 token\(s\)"):
        RewardModel(str(folder)).load()
