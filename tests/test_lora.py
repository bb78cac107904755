"""LoRA (grpo/lora.py, peft) against a hand-built W + (alpha / r) B A, the reference with adapters off, the
trainer with LoRA (checkpoints, resume, merged export, eval), the 8-bit optimizer and cast_lm_head_to_fp32."""

from __future__ import annotations

import copy
import json

import pytest
import torch

peft = pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[peft]'")

from grpo.config import GRPOConfig  # noqa: E402
from tests.conftest import record_updates
from grpo.lora import AdaptersOff, add_lora  # noqa: E402
from grpo.core.setup import lora_settings  # noqa: E402
from grpo.algorithm.logprobs import completion_logprobs  # noqa: E402
from grpo.core.metrics import read_jsonl  # noqa: E402
from grpo.tiny_model import build_tiny_model  # noqa: E402
from grpo.core.trainer import Trainer  # noqa: E402
from tests.test_trainer import BASE, make_config, params_of  # noqa: E402

R, ALPHA = 4, 8


def _batch(vocab, generator, rows=3, prompt=5, completion=6):
    ids = torch.randint(3, vocab, (rows, prompt + completion), generator=generator)
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # a left-padded prompt
    mask = torch.ones(rows, completion, dtype=torch.long)
    mask[1, 4:] = 0  # a completion that ended early
    return ids, attention, mask


class HandLoRA(torch.nn.Module):
    """W x + (alpha / r) B (A x), written out: the definition the peft layers must match."""

    def __init__(self, linear, a, b):
        super().__init__()
        self.linear, self.a, self.b = linear, torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())

    def forward(self, x):
        return self.linear(x) + (ALPHA / R) * (x @ self.a.T) @ self.b.T


def _lora_pair(targets=("q_proj", "v_proj", "down_proj")):
    config = GRPOConfig(model="tiny", lora_r=R, lora_alpha=ALPHA, lora_dropout=0.0, lora_target_modules=list(targets))
    base, _ = build_tiny_model("tiny", seed=1)
    hand = copy.deepcopy(base)
    wrapped = add_lora(base, lora_settings(config))
    policy = wrapped.get_base_model()
    g = torch.Generator().manual_seed(0)
    pairs = {}
    for name, module in policy.named_modules():
        if hasattr(module, "lora_A"):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            with torch.no_grad():  # B starts at 0 in peft; a nonzero B makes the test see the B A term
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            parent_name, child = name.rsplit(".", 1)
            parent = hand.get_submodule(parent_name)
            setattr(parent, child, HandLoRA(getattr(parent, child), a.detach(), b.detach()))
            pairs[name] = (module, parent.get_submodule(child))
    hand.requires_grad_(False)
    for _, hand_module in pairs.values():
        hand_module.a.requires_grad_(True)
        hand_module.b.requires_grad_(True)
    return wrapped, policy, hand, pairs


def test_lora_logprobs_and_gradients_equal_the_hand_built_update():
    wrapped, policy, hand, pairs = _lora_pair()
    ids, attention, mask = _batch(policy.config.vocab_size, torch.Generator().manual_seed(2))
    logps, _ = completion_logprobs(policy, ids, attention, mask, temperature=0.7)
    expected, _ = completion_logprobs(hand, ids, attention, mask, temperature=0.7)
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-6)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    (logps * weights).sum().backward()
    (expected * weights).sum().backward()
    for name, (module, hand_module) in pairs.items():
        torch.testing.assert_close(module.lora_A["default"].weight.grad, hand_module.a.grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(module.lora_B["default"].weight.grad, hand_module.b.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Only the adapters train: the base weights get no gradient.
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)


def test_reference_with_adapters_off_is_the_base_model():
    wrapped, policy, _, _ = _lora_pair()
    base, _ = build_tiny_model("tiny", seed=1)
    ids, attention, mask = _batch(policy.config.vocab_size, torch.Generator().manual_seed(4))
    reference = AdaptersOff(policy, wrapped)
    ref_logps, _ = reference(completion_logprobs, ids, attention, mask, 0.7)
    base_logps, _ = completion_logprobs(base, ids, attention, mask, 0.7)
    torch.testing.assert_close(ref_logps, base_logps, rtol=1e-6, atol=1e-6)
    policy_logps, _ = completion_logprobs(policy, ids, attention, mask, 0.7)
    assert not torch.allclose(policy_logps, base_logps)  # the adapters are on again afterwards


LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


@pytest.mark.parametrize("kernels", ["auto", "plain"])
def test_lora_training_holds_no_reference_copy_and_resumes_exactly(tmp_path, kernels):
    overrides = dict(max_steps=4, save_steps=2, beta=0.04, kernels=kernels, **LORA)
    straight = Trainer(make_config(tmp_path / "a", **overrides))
    assert straight.models.reference is None and isinstance(straight.models.reference_call, AdaptersOff)
    before = params_of(straight.policy)
    straight.train()
    after = params_of(straight.policy)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all("lora_" in n for n in changed)  # only adapters moved
    first = Trainer(make_config(tmp_path / "b", **overrides))
    first.train(until_step=2)
    checkpoint = tmp_path / "b" / "run" / "checkpoints" / "step-000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    resumed = Trainer(make_config(tmp_path / "b", resume=str(tmp_path / "b" / "run"), **overrides))
    resumed.train()
    a = read_jsonl(tmp_path / "a" / "run" / "metrics.jsonl")
    b = read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
    for key in ("reward", "loss", "kl", "grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    for name, value in after.items():
        assert torch.equal(value, dict(resumed.policy.named_parameters())[name]), name


def test_adapter_and_merged_exports_load(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo.models import load_model

    trainer = Trainer(make_config(tmp_path, max_steps=2, save_merged=True, **LORA))
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    adapter_config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny" and adapter_config["r"] == 4
    merged = AutoModelForCausalLM.from_pretrained(checkpoint / "merged")
    via_adapter = load_model(str(checkpoint), torch.device("cpu"))  # what eval.py does with an adapter folder
    base, _ = build_tiny_model("tiny", seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(checkpoint))  # peft's own loader
    ids, attention, mask = _batch(merged.config.vocab_size, torch.Generator().manual_seed(5))
    expected, _ = completion_logprobs(trainer.policy, ids, attention, mask)
    for model in (merged, via_adapter, loaded.get_base_model()):
        got, _ = completion_logprobs(model, ids, attention, mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_starting_adapter_is_trained_and_is_the_reference(tmp_path):
    first = Trainer(make_config(tmp_path / "first", max_steps=2, **LORA))
    first.train()
    adapter = str(tmp_path / "first" / "run" / "checkpoints" / "step-000002")
    second = Trainer(make_config(tmp_path / "second", max_steps=1, beta=0.04, peft_adapter=adapter, **LORA))
    for name, value in params_of(first.policy).items():  # starts where the adapter left off
        assert torch.equal(value, dict(second.policy.named_parameters())[name]), name
    rollout, _, _, _ = second.collect_rollout(0)
    records = record_updates(second)
    second.train_on_rollout(rollout)
    assert records[-1].ref_logps is not None
    # Its reference is that starting adapter (frozen), not the bare base: on-policy, the first KL is 0.
    assert records[-1].micro_batch_stats[0].kl == pytest.approx(0.0, abs=1e-7)
    trainable = [n for n, p in second.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".default." in n for n in trainable)


@pytest.mark.slow
def test_lora_learns_the_toy_reward(tmp_path):
    # As tests/test_trainer.py's learning test (the tags reward rises from ~0), with rank-16 adapters only. The
    # adapters change neither the tied embeddings nor the final norm, so a token's logit moves by at most about
    # |e_j| sqrt(H): 0.02 * 8 * 8 = 1.3 nats with the tiny model's 0.02-std embeddings, too little to make a tag
    # likely; embeddings scaled by 4 give them ~5 nats (the full fine-tune learns by changing the embeddings).
    # Observed: the mean reward goes from ~0.02 over the first five steps to ~0.55 over the last five.
    model, tokenizer = build_tiny_model("tiny", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config = make_config(tmp_path, model=str(tmp_path / "model"), max_steps=40, learning_rate=1e-2, max_grad_norm=1.0,
                         weight_decay=0.0, lr_scheduler_type="constant", max_completion_length=16, num_generations=8,
                         prompts_per_step=2, micro_batch_size=16, beta=0.0, use_peft=True, lora_r=16, lora_alpha=32,
                         lora_dropout=0.0)
    Trainer(config).train()
    rewards = [m["reward"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert late > early + 0.15, (early, late, rewards)


def test_settings_that_cannot_work_with_lora_are_named():
    with pytest.raises(ValueError, match="lm_head / embed_tokens cannot take an adapter"):
        GRPOConfig(use_peft=True, lora_target_modules=["q_proj", "lm_head"]).validate()
    with pytest.raises(ValueError, match="sync_ref_model with use_peft"):
        GRPOConfig(use_peft=True, sync_ref_model=True, beta=0.04).validate()
    with pytest.raises(ValueError, match="need --use-peft"):
        GRPOConfig(save_merged=True).validate()
    with pytest.raises(ValueError, match="match no module"):
        add_lora(build_tiny_model("tiny")[0], lora_settings(GRPOConfig(use_peft=True, lora_target_modules=["nothing_here"])))


def test_disable_dropout_leaves_the_adapters_dropout_as_given(tmp_path):
    from tests.test_trainer import _dropout_models

    tokenizer, models = _dropout_models()
    trainer = Trainer(make_config(tmp_path, **{**LORA, "lora_dropout": 0.1}), policy=models["qwen2"], tokenizer=tokenizer)
    lora = [m for name, m in trainer.policy.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name]
    assert lora and all(m.p == 0.1 for m in lora)
    assert all(m.attention_dropout == 0.0 for m in trainer.policy.modules() if hasattr(m, "attention_dropout"))


def test_8bit_adamw_runs_on_cpu_and_follows_adamw(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install -e '.[bnb]'")
    steps = {}
    for optim in ("adamw", "adamw_8bit"):
        trainer = Trainer(make_config(tmp_path / optim, optim=optim, max_steps=1, **{**BASE, "model": "tiny:small"}))
        before = params_of(trainer.policy)
        trainer.train()
        steps[optim] = {n: p.detach() - before[n] for n, p in trainer.policy.named_parameters()}
        if optim == "adamw_8bit":
            states = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            assert any(v.dtype == torch.uint8 for v in states)  # 8-bit moments for the large matrices
    # The same direction of update: AdamW's first step is lr * g / (|g| + eps); 8-bit quantises the moments.
    a = torch.cat([d.flatten() for d in steps["adamw"].values()])
    b = torch.cat([d.flatten() for d in steps["adamw_8bit"].values()])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


def test_cast_lm_head_to_fp32_needs_an_untied_head_and_runs_the_head_in_fp32(tmp_path):
    with pytest.raises(ValueError, match="needs an untied output head"):
        Trainer(make_config(tmp_path / "tied", cast_lm_head_to_fp32=True))
    from grpo.models import cast_head_to_fp32

    model, _ = build_tiny_model("tiny", seed=0)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    cast_head_to_fp32(model)
    model.to(torch.bfloat16)  # a pure-bf16 model keeps an fp32 head only if cast after; the head is cast again
    cast_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.float32
    hidden = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.lm_head(hidden)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hidden.float() @ model.lm_head.weight.T, rtol=1e-6, atol=1e-6)


def _saved_tiny(folder):
    model, tokenizer = build_tiny_model("tiny", seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_qlora_trains_adapters_over_a_4bit_base_and_resumes_exactly(tmp_path):
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install -e '.[bnb]'")
    model = _saved_tiny(tmp_path / "model")
    overrides = dict(model=model, max_steps=2, save_steps=1, beta=0.04, load_in_4bit=True, **LORA)
    straight = Trainer(make_config(tmp_path / "a", **overrides))
    linears = [m for m in straight.policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears and all(m.weight.quant_type == "nf4" for m in linears)  # every adapted projection's base
    trainable = {n: p for n, p in straight.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())

    # The 4-bit layers compute what their dequantized weights compute: the log-probs of the same model with each
    # base weight replaced by its dequantized fp32 matrix agree (the quantization error lives in the weights only).
    dequantized, _ = build_tiny_model("tiny", seed=0)
    hand = {}
    for name, module in straight.policy.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            path = name.replace(".base_layer", "")
            hand[path] = weight
    with torch.no_grad():
        for path, weight in hand.items():
            dequantized.get_submodule(path).weight.copy_(weight)
    ids, attention, mask = _batch(dequantized.config.vocab_size, torch.Generator().manual_seed(5))
    got, _ = straight.models.reference_call(completion_logprobs, ids, attention, mask)  # the adapters off
    expected, _ = completion_logprobs(dequantized, ids, attention, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    before = params_of(straight.policy)
    straight.train()
    after = params_of(straight.policy)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all("lora_" in n for n in changed)
    first = Trainer(make_config(tmp_path / "b", **overrides))
    first.train(until_step=1)
    resumed = Trainer(make_config(tmp_path / "b", resume=str(tmp_path / "b" / "run"), **overrides))
    resumed.train()
    a, b = (read_jsonl(tmp_path / side / "run" / "metrics.jsonl") for side in "ab")
    for key in ("reward", "loss", "kl", "grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key


def test_qlora_settings_that_cannot_work_are_named(tmp_path):
    with pytest.raises(ValueError, match="load_in_4bit need --use-peft"):
        GRPOConfig(load_in_4bit=True).validate()
    with pytest.raises(ValueError, match="load_in_4bit with save_merged"):
        GRPOConfig(load_in_4bit=True, save_merged=True, use_peft=True, model="x").validate()
    with pytest.raises(ValueError, match="load_in_4bit with a tiny model"):
        GRPOConfig(load_in_4bit=True, use_peft=True, model="tiny").validate()
    with pytest.raises(ValueError, match="quantized .* set use_peft"):
        bnb = pytest.importorskip("bitsandbytes")  # noqa: F841
        from transformers import AutoModelForCausalLM

        from grpo.models import four_bit_config
        quantized = AutoModelForCausalLM.from_pretrained(_saved_tiny(tmp_path / "m"), device_map={"": "cpu"},
                                                         quantization_config=four_bit_config("nf4", False,
                                                                                             torch.float32))
        Trainer(make_config(tmp_path, model=str(tmp_path / "m")), policy=quantized)
