import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.tiny_model import FORMAT_TAGS, SHAPES, build_tiny_model


def test_chat_template_is_chatml_character_for_character(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    # Without a system message, Qwen2.5's default system prompt is inserted.
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    # An assistant turn closes with <|im_end|>\n.
    text = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": "4"}], tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n")


def test_special_tokens_and_single_token_tags(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", *FORMAT_TAGS):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    text = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_shapes_and_determinism(tokenizer):
    model_a, _ = build_tiny_model("tiny", seed=1, tokenizer=tokenizer)
    model_b, _ = build_tiny_model("tiny", seed=1, tokenizer=tokenizer)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    assert model_a.config.vocab_size == len(tokenizer)
    assert SHAPES["qwen2.5-0.5b"]["hidden_size"] == 896 and SHAPES["small"]["vocab_size"] == 151_936
    small, _ = build_tiny_model("small", tokenizer=tokenizer)
    assert small.config.vocab_size == 151_936 and small.config.tie_word_embeddings


def test_saved_folder_loads_like_a_hub_id(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").exists()
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def _naive_attention(query, key, value, mask, scaling):
    """Float64 reference: each query head h attends over its key/value head h // G; mask True = attend."""
    heads, kv_heads = query.shape[1], key.shape[1]
    key, value = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))  # (N, H, L, D)
    scores = query.double() @ key.transpose(-1, -2) * scaling  # (N, H, 1, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)  # (N, 1, H, D)


@pytest.mark.parametrize("heads, kv_heads", [(14, 2), (4, 2), (6, 3), (8, 1)])
def test_packed_decode_attention_matches_a_naive_reference(heads, kv_heads):
    from grpo.kernels.compiled_decode import packed_decode_sdpa

    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    rows, length, dim = 5, 11, 16
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=generator) for _ in range(2))
    mask = torch.rand(rows, 1, 1, length, generator=generator) > 0.3
    mask[..., -1] = True  # every row attends at least to its own position
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    out, weights = packed_decode_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    assert weights is None and out.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(out.double(), _naive_attention(query, key, value, mask, dim**-0.5), rtol=1e-5, atol=1e-6)


def test_packed_decode_attention_leaves_other_calls_to_transformers():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from grpo.kernels.compiled_decode import packed_decode_sdpa

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 6, 8, generator=generator)  # six query tokens: a prefill, not a decode step
    key, value = (torch.randn(3, 2, 6, 8, generator=generator) for _ in range(2))
    mask = torch.ones(3, 1, 6, 6, dtype=torch.bool).tril()
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    ours, _ = packed_decode_sdpa(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert torch.equal(ours, theirs)


def test_models_switched_to_packed_attention_decode_the_same_logits(tokenizer):
    """A model switched by use_packed_decode_attention gives the logits of the unswitched one, eagerly and compiled
    (the compiled decode step is where transformers' own SDPA copies K and V for every head)."""
    import copy

    from grpo.kernels.compiled_decode import PACKED_DECODE_SDPA, use_packed_decode_attention
    from grpo.kernels.sampling import FastSampler
    from grpo.algorithm.sampler import SamplingParams

    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny shape groups its heads
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(8.0)  # sharp next-token distributions, so greedy tokens are not near-ties
    switched = copy.deepcopy(model)
    assert use_packed_decode_attention(switched) and switched.config._attn_implementation == PACKED_DECODE_SDPA
    assert not use_packed_decode_attention(switched)  # only models on transformers' SDPA are switched
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in ("What is 2 + 3?", "Hi", "Ava has 4 apples.")]
    params = SamplingParams(max_completion_length=10, temperature=0.0, eos_token_ids=(tokenizer.eos_token_id,))

    def logits_of(m, **kwargs):
        seen = []
        sample = FastSampler().sample_groups(m, prompts, 2, params, tokenizer.pad_token_id, max_prompt_length=64,
                               step_callback=lambda step, logits: seen.append(logits.clone()), **kwargs)
        return sample.completion_ids, torch.stack(seen)

    reference_ids, reference = logits_of(model)
    for kwargs in ({}, {"compile_decode": True}):
        ids, logits = logits_of(switched, **kwargs)
        assert torch.equal(ids, reference_ids), kwargs
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_models_outside_the_attention_interface_keep_their_attention(tokenizer):
    from grpo.kernels.compiled_decode import use_packed_decode_attention

    model, _ = build_tiny_model("tiny", seed=0, tokenizer=tokenizer)
    model._supports_attention_backend = False  # as remote-code models that pick their attention class by name
    assert not use_packed_decode_attention(model) and model.config._attn_implementation == "sdpa"
    model, _ = build_tiny_model("tiny", seed=0, tokenizer=tokenizer)
    model.set_attn_implementation("eager")
    assert not use_packed_decode_attention(model) and model.config._attn_implementation == "eager"


def test_set_eos_rate_makes_completions_end_at_that_rate(tokenizer):
    from grpo.algorithm.sampler import SamplingParams, sample_groups
    from grpo.tiny_model import IM_END, set_eos_rate

    model, _ = build_tiny_model("tiny", seed=2, tokenizer=tokenizer)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert set_eos_rate(model, 0.1, eos) == pytest.approx(0.1, rel=0.02)  # fitted on random contexts
    params = SamplingParams(max_completion_length=200, eos_token_ids=(eos,))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Ava has 4 apples."}], add_generation_prompt=True,
                                           return_dict=False)
    sample = sample_groups(model, [prompt], 400, params, tokenizer.pad_token_id, torch.Generator().manual_seed(0))
    lengths = sample.completion_mask.sum(-1).float()  # geometric, mean 1 / 0.1 = 10 (cut at 200: no row reaches it)
    assert lengths.mean().item() == pytest.approx(10.0, rel=0.15)  # 400 rows: the mean's sd is ~0.5
    assert not sample.truncated.any() and lengths.min() == 1
    with pytest.raises(ValueError, match="rate"):
        set_eos_rate(model, 1.5, eos)
