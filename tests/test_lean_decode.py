"""grpo.kernels.lean_decode: the lean decode step gives transformers' hidden states, and the sampler's tokens stay the same."""

import pytest
import torch

import grpo.kernels.sampling
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from grpo.kernels.compiled_decode import use_packed_decode_attention
from grpo.kernels.lean_decode import LeanDecodeStep, unsupported_reason
from grpo.kernels.sampling import FastSampler, _reserve
from grpo.algorithm.logprobs import position_ids_from_mask
from grpo.algorithm.sampler import SamplingParams, cache_kwarg, left_pad


def sample_groups(*args, lean_decode=True, **kwargs):
    """FastSampler's sample_groups; lean_decode=False: as for a trunk the lean step does not support (the model's
    own forward decodes)."""
    if lean_decode:
        return FastSampler().sample_groups(*args, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo.kernels.sampling, "unsupported_reason", lambda trunk: "turned off by the test")
        return FastSampler().sample_groups(*args, **kwargs)

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=512)


def _model(kind: str, heads: int = 4, kv_heads: int = 2, seed: int = 0, **extra):
    torch.manual_seed(seed)
    if kind == "qwen2":
        config = Qwen2Config(**SMALL, num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)
        model = Qwen2ForCausalLM(config)
    elif kind == "qwen3":
        config = Qwen3Config(**SMALL, num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)
        model = Qwen3ForCausalLM(config)
    else:
        config = LlamaConfig(**SMALL, num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the init's 0.02 scale, so every layer moves the hidden states
        for param in model.parameters():
            param.mul_(8.0 if param.dim() == 2 else 1.0).add_(0.05 * torch.randn_like(param))
    use_packed_decode_attention(model)
    return model.eval()


PROMPTS = [[5, 9, 13, 2, 77, 41, 8], [3, 4], [250, 17, 17, 99, 1]]  # left padding of 0, 5 and 2 positions


def _prefilled(model, group_size: int, extra: int):
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True,
          **{cache_kwarg(model): cache})  # the argument's name depends on the transformers release
    cache.batch_repeat_interleave(group_size)
    _reserve(cache, extra)
    return cache, mask.repeat_interleave(group_size, 0)


CASES = {
    "qwen2 grouped heads": ("qwen2", dict()),
    "qwen2 one key/value head": ("qwen2", dict(kv_heads=1)),
    "qwen2 no grouping": ("qwen2", dict(kv_heads=4)),
    "qwen3 q/k norms, head_dim apart from hidden / heads": ("qwen3", dict(head_dim=24)),
    "llama grouped, mlp and attention biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama 3 rope scaling, no biases": ("llama", dict(
        heads=8, kv_heads=2, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=64))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lean_step_gives_transformers_hidden_states(case):
    kind, options = CASES[case]
    model = _model(kind, **options)
    trunk, group_size, steps = model.model, 2, 6
    assert unsupported_reason(trunk) is None
    with torch.inference_mode():
        ours_cache, mask = _prefilled(model, group_size, steps)
        theirs_cache, _ = _prefilled(model, group_size, steps)
        lean = LeanDecodeStep(trunk, ours_cache, mask, steps)
        positions = mask.sum(-1, keepdim=True)  # (N, 1)
        full_mask = mask
        generator = torch.Generator().manual_seed(1)
        for step in range(steps):
            tokens = torch.randint(0, SMALL["vocab_size"], (mask.shape[0], 1), generator=generator)
            full_mask = torch.cat([full_mask, full_mask.new_ones(mask.shape[0], 1)], 1)
            theirs = trunk(input_ids=tokens, attention_mask=full_mask, position_ids=positions, use_cache=True,
                           **{cache_kwarg(trunk): theirs_cache}).last_hidden_state[:, -1]
            ours = lean(tokens, positions)
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
            assert (ours - theirs).abs().max() < 1e-6 * theirs.abs().max(), f"step {step}"
            positions = positions + 1
        for ours_layer, theirs_layer in zip(ours_cache.layers, theirs_cache.layers, strict=True):  # same keys
            torch.testing.assert_close(ours_layer.keys, theirs_layer.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(ours_layer.values, theirs_layer.values, rtol=0, atol=1e-5)


def test_sampler_draws_the_same_tokens_with_the_lean_step():
    model = _model("qwen2")
    params = SamplingParams(max_completion_length=12, temperature=1.0, eos_token_ids=(SMALL["vocab_size"] - 1,))
    runs = {}
    for lean in (True, False):
        generator = torch.Generator().manual_seed(3)
        runs[lean] = sample_groups(model, PROMPTS, 3, params, 0, generator=generator, return_logprobs=True,
                                   lean_decode=lean)
    assert torch.equal(runs[True].completion_ids, runs[False].completion_ids)
    torch.testing.assert_close(runs[True].logprobs, runs[False].logprobs, rtol=0, atol=1e-5)
    assert len(set(runs[True].completion_ids.flatten().tolist())) > 5  # varied tokens, not one repeated


def test_sampler_uses_the_lean_step_only_where_it_applies(monkeypatch):
    calls = []

    class Counting(LeanDecodeStep):
        def __call__(self, input_ids, position_ids):
            calls.append(1)
            return super().__call__(input_ids, position_ids)

    monkeypatch.setattr(grpo.kernels.sampling, "LeanDecodeStep", Counting)
    model = _model("qwen2")
    params = SamplingParams(max_completion_length=4, temperature=1.0, eos_token_ids=(SMALL["vocab_size"] - 1,))
    sample_groups(model, PROMPTS, 2, params, 0, generator=torch.Generator().manual_seed(0))
    assert len(calls) == 3  # every decode step after the prefill
    calls.clear()
    sample_groups(model, PROMPTS, 2, params, 0, static_cache=True)
    sample_groups(model, PROMPTS, 2, params, 0, lean_decode=False)
    assert not calls
    model.config._attn_implementation = "eager"  # transformers' forward, and the same tokens
    assert "attention implementation 'eager'" in unsupported_reason(model.model)
    sample_groups(model, PROMPTS, 2, params, 0)
    assert not calls


@pytest.mark.parametrize("change, reason", [
    (lambda m: m.config.__setattr__("layer_types", ["sliding_attention"] * 3), "sliding-window layers"),
    (lambda m: m.model.layers[1].self_attn.__setattr__("sliding_window", 16), "sliding-window attention"),
    (lambda m: (m.config.__setattr__("attention_dropout", 0.1), m.train()), "attention dropout in training mode"),
    (lambda m: m.model.layers.__setitem__(0, torch.nn.Identity()), "a decoder layer is not a Qwen2DecoderLayer"),
])
def test_unsupported_models_are_named_and_refused(change, reason):
    model = _model("qwen2")
    change(model)
    assert unsupported_reason(model.model) == reason
    with pytest.raises(ValueError, match=reason):
        LeanDecodeStep(model.model, None, torch.ones(1, 3, dtype=torch.long), 4)


def test_other_architectures_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert unsupported_reason(model.transformer) == "GPT2Model is not one of Qwen2Model, Qwen3Model, LlamaModel"
