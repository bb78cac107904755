import pytest
import torch

import grpo.kernels.sampling
import grpo.algorithm.sampler
from grpo.kernels.sampling import FastSampler
from grpo.algorithm.logprobs import position_ids_from_mask
from grpo.algorithm.sampler import SamplingParams, cache_kwarg, filter_logits, left_pad, sample_groups
from grpo.tiny_model import build_tiny_model


def fast_sample_groups(*args, **kwargs):
    return FastSampler().sample_groups(*args, **kwargs)


# The plain sampler and the kernel that replaces it (--kernels auto) pass the same tests.
SAMPLERS = {"plain": sample_groups, "kernel": fast_sample_groups}
NEXT_TOKEN = {"plain": grpo.algorithm.sampler.sample_next_token, "kernel": grpo.kernels.sampling.sample_next_token}

QUESTIONS = ["What is 2 + 3?", "Ava has 4 apples and buys 9 more. How many now?", "Hi"]


@pytest.fixture(scope="module")
def peaked(tokenizer):
    """A tiny model with large embeddings, so greedy decoding produces varied tokens, not one repeated."""
    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # tied embeddings at init make "repeat the last token" the greedy choice
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]


def _generate(model, prompts, pad, eos, max_new):
    ids, mask = left_pad(prompts, pad, "cpu")
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         pad_token_id=pad, eos_token_id=list(eos))
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("sampler,static_cache", [("plain", False), ("kernel", False), ("kernel", True)])
def test_greedy_matches_generate_with_and_without_early_eos(peaked, prompts, tokenizer, sampler, static_cache):
    pad = tokenizer.pad_token_id
    options = {"static_cache": True} if static_cache else {}
    free = _generate(peaked, prompts, pad, [pad], 10)  # pad as EOS: never produced here
    assert len(set(free[0].tolist())) > 2, "the greedy text should not be one repeated token"
    for eos in ([pad], [free[0, 3].item()]):  # the second stops row 0 early, after 4 tokens
        expected = _generate(peaked, prompts, pad, eos, 10)
        params = SamplingParams(max_completion_length=10, temperature=0.0, eos_token_ids=tuple(eos))
        sample = SAMPLERS[sampler](peaked, prompts, 1, params, pad, **options)
        got = sample.completion_ids
        assert torch.equal(got, expected[:, : got.shape[1]])
        assert (expected[:, got.shape[1]:] == pad).all()
    assert sample.completion_mask[0].tolist() == [1, 1, 1, 1] + [0] * (got.shape[1] - 4)
    assert not sample.truncated[0]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_prefix_sharing_changes_no_logit(peaked, prompts, tokenizer, sampler, monkeypatch):
    from transformers import DynamicCache

    group_size, pad = 3, tokenizer.pad_token_id
    seen = []
    params = SamplingParams(max_completion_length=6, temperature=1.0, eos_token_ids=(tokenizer.eos_token_id,))
    generator, watch = torch.Generator().manual_seed(0), {}
    if sampler == "plain":  # each step's logits, as the plain sampler hands them to sample_next_token
        draw = grpo.algorithm.sampler.sample_next_token
        monkeypatch.setattr(grpo.algorithm.sampler, "sample_next_token",
                            lambda logits, *args, **kwargs: seen.append(logits.clone()) or draw(logits, *args, **kwargs))
    else:  # the kernel's shifted base-2 frames are turned back into logits by its own callback
        watch["step_callback"] = lambda step, logits: seen.append(logits.clone())
    sample = SAMPLERS[sampler](peaked, prompts, group_size, params, pad, generator=generator, **watch)
    # Without sharing: each prompt repeated G times is prefilled as its own row, then the same tokens decoded.
    mask = sample.prompt_mask.repeat_interleave(group_size, 0)  # (N, P)
    ids = sample.prompt_ids.repeat_interleave(group_size, 0)
    cache, kwarg = DynamicCache(config=peaked.config), cache_kwarg(peaked)
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        for step, step_logits in enumerate(seen):
            logits = peaked(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{kwarg: cache}).logits[:, -1]
            # the kernel's decode step is transformers' to 1e-6 of the hidden state's scale (tests/test_lean_decode.py),
            # so its logits are to that share of theirs: transformers 5.19 and 5.25 round the reference apart by 1.9e-5
            # at logits of 14
            torch.testing.assert_close(step_logits, logits, rtol=1e-5, atol=max(1e-5, 2e-6 * logits.abs().max().item()))
            ids = sample.completion_ids[:, step : step + 1]
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
            positions = positions[:, -1:] + 1
    assert len(seen) == sample.completion_ids.shape[1] > 1


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_same_seed_same_completions_and_rows_differ(tiny_model_and_tokenizer, prompts, sampler):
    model, tokenizer = tiny_model_and_tokenizer
    params = SamplingParams(max_completion_length=8, eos_token_ids=(tokenizer.eos_token_id,))
    run = lambda seed: SAMPLERS[sampler](model, prompts, 4, params, tokenizer.pad_token_id,
                                     generator=torch.Generator().manual_seed(seed))
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    group = a.completion_ids[:4]
    assert len({tuple(row.tolist()) for row in group}) == 4  # the G rows of one prompt differ
    assert a.completion_ids.shape == (12, 8) and a.truncated.all() and a.num_generated_tokens == 96


# Critical values of chi-square at a false failure rate of 1e-4 (upper 0.9999 quantile):
# 7 degrees of freedom: 29.88; 4: 23.51; 3: 21.11. The seed is fixed, so the test is
# deterministic; the quantile says how unlikely a failure of a correct sampler is for a new seed.
CHI2_9999 = {7: 29.88, 4: 23.51, 3: 21.11}


def _chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert (counts[~keep] == 0).all(), "a zero-probability token was sampled"
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item(), int(keep.sum()) - 1


@pytest.mark.parametrize("sampler", NEXT_TOKEN)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_empirical_distribution_matches_softmax(temperature, sampler):
    sample_next_token = NEXT_TOKEN[sampler]
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    rows = 40_000
    tokens = sample_next_token(logits.expand(rows, -1), temperature, generator=torch.Generator().manual_seed(7))
    statistic, dof = _chi_square(tokens, torch.softmax(logits / temperature, -1))
    assert statistic < CHI2_9999[dof], statistic


@pytest.mark.parametrize("sampler", NEXT_TOKEN)
def test_filtered_sampling_matches_the_renormalised_distribution(sampler):
    sample_next_token = NEXT_TOKEN[sampler]
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = sample_next_token(logits.expand(40_000, -1), 1.0, top_k=4, generator=torch.Generator().manual_seed(8))
    kept = torch.full_like(logits, float("-inf"))
    kept[[0, 1, 6, 2]] = logits[[0, 1, 6, 2]]
    statistic, dof = _chi_square(tokens, torch.softmax(kept, -1))
    assert dof == 3 and statistic < CHI2_9999[dof], statistic


def test_filters_keep_exactly_the_right_tokens():
    probs = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]])
    logits = probs.log()
    kept = lambda filtered: torch.isfinite(filtered[0]).nonzero().flatten().tolist()
    assert kept(filter_logits(logits, top_k=2)) == [0, 1]
    # top_p = 0.8: 0.40 + 0.25 = 0.65 < 0.8, + 0.15 = 0.80 reaches it -> tokens 0, 1, 2.
    assert kept(filter_logits(logits, top_p=0.8)) == [0, 1, 2]
    # top_p = 0.81 needs the 4th token too (0.80 < 0.81).
    assert kept(filter_logits(logits, top_p=0.81)) == [0, 1, 2, 3]
    # min_p = 0.3: keep p >= 0.3 * 0.40 = 0.12 -> tokens 0, 1, 2.
    assert kept(filter_logits(logits, min_p=0.3)) == [0, 1, 2]
    # Combined: top_k=5 then top_p=0.5 of the renormalised five -> 0.40/0.96 = 0.417 < 0.5 -> 0, 1.
    assert kept(filter_logits(logits, top_k=5, top_p=0.5)) == [0, 1]
    # Order does not matter: the kept set is the same for a shuffled vocabulary.
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    assert sorted(order[kept(filter_logits(logits[:, order], top_p=0.8))].tolist()) == [0, 1, 2]


@pytest.mark.parametrize("sampler", NEXT_TOKEN)
def test_greedy_is_argmax_and_params_are_validated(sampler):
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert NEXT_TOKEN[sampler](logits, 0.0).tolist() == [1, 0]
    for bad in (dict(top_p=0.0), dict(top_k=-1), dict(min_p=1.0), dict(temperature=-1.0), dict(max_completion_length=0)):
        with pytest.raises(ValueError):
            SamplingParams(eos_token_ids=(1,), **bad)


@pytest.mark.slow
def test_compiled_decode_matches_eager_and_compiles_once(peaked, prompts, tokenizer):
    # On CPU torch.compile uses inductor (no CUDA graphs); the logic is the one CUDA runs: a StaticCache
    # of fixed length (prompt budget + completion budget) and one captured step reused across calls.
    torch._dynamo.reset()
    params = SamplingParams(max_completion_length=8, temperature=0.0, eos_token_ids=(tokenizer.eos_token_id,))
    pad = tokenizer.pad_token_id
    sampler = FastSampler()
    for batch in (prompts, prompts[::-1][:2]):  # the second call has other prompt lengths and fewer rows
        eager = sample_groups(peaked, batch, 2, params, pad)
        compiled = sampler.sample_groups(peaked, batch, 2, params, pad, compile_decode=True, max_prompt_length=128)
        assert torch.equal(compiled.completion_ids, eager.completion_ids)
    decoder = sampler.decoder
    again = sampler.sample_groups(peaked, prompts[1:], 2, params, pad, compile_decode=True, max_prompt_length=128)
    assert sampler.decoder is decoder  # the same captured step serves the next call
    assert torch.equal(again.completion_ids, sample_groups(peaked, prompts[1:], 2, params, pad).completion_ids)


@pytest.mark.slow
def test_compiled_decode_on_cpu_compiles_the_trunk_and_keeps_the_buffered_projection(peaked, prompts, tokenizer,
                                                                                      monkeypatch):
    """On CPU the compiled step is the trunk only when the head writes into its buffer (fp32, no autocast); a head
    that cannot (here: under bf16 autocast) gets the whole step compiled. Both give the eager greedy tokens."""
    import grpo.kernels.sampling as sampler_module

    torch._dynamo.reset()
    params = SamplingParams(max_completion_length=8, temperature=0.0, eos_token_ids=(tokenizer.eos_token_id,))
    pad = tokenizer.pad_token_id
    heads = []
    real_head = sampler_module._DecodeHead
    monkeypatch.setattr(sampler_module, "_DecodeHead", lambda *a, **k: heads.append(real_head(*a, **k)) or heads[-1])
    sampler = FastSampler()
    eager = sampler.sample_groups(peaked, prompts, 2, params, pad)
    compiled = sampler.sample_groups(peaked, prompts, 2, params, pad, compile_decode=True, max_prompt_length=128)
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    assert heads[-1].buffered and heads[-1].out is not None  # the projection went through the reused buffer
    assert sampler.decoder.run_trunk is not None
    seen = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, kwargs in (("eager", {}), ("compiled", {"compile_decode": True, "max_prompt_length": 128})):
            sampler.sample_groups(peaked, prompts, 2, params, pad, **kwargs,
                          step_callback=lambda step, logits, name=name: seen.setdefault((name, step), logits.clone()))
    assert not heads[-1].buffered and heads[-1].out is None  # the model's own forward, compiled whole
    # In bf16 the fused kernels round differently from eager ones, so a near-tie can pick another greedy token
    # later on: the first decode step's logits (same input tokens on both sides) are compared at bf16 precision.
    first = seen[("eager", 1)]
    torch.testing.assert_close(seen[("compiled", 1)], first, rtol=0, atol=0.02 * first.abs().max().item())


@pytest.mark.parametrize("block", [1, 3, 8, 1024])
def test_two_level_inverse_cdf_is_exact(block):
    # Blocks of 3 over 10 tokens: full blocks, a partial last block, a block of zeros (tokens 3-5) and
    # zero-weight tokens at block edges. The distribution must be w / sum(w), and zero weights never drawn,
    # even for uniforms at 0 and just below 1.
    from grpo.kernels.sampling import _inverse_cdf

    weights = torch.tensor([0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.5, 3.0, 0.0, 1.5])
    rows = 60_000
    uniform = torch.rand(rows, 1, generator=torch.Generator().manual_seed(9))
    uniform[:2] = torch.tensor([[0.0], [torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()]])
    tokens = _inverse_cdf(weights.expand(rows, -1).contiguous(), uniform, block=block)
    assert tokens[0] == 1 and tokens[1] == 9  # the first and the last token with weight
    statistic, dof = _chi_square(tokens, weights / weights.sum())
    assert statistic < CHI2_9999[dof], statistic


def test_decode_head_falls_back_to_the_model_for_transformed_logits(tiny_model_and_tokenizer):
    # The reused-buffer decode head computes W h itself; a model whose logits are soft-capped (or scaled,
    # or biased) must go through its own forward instead.
    from grpo.kernels.buffers import Buffers
    from grpo.kernels.sampling import _DecodeHead

    model, _ = tiny_model_and_tokenizer
    assert _DecodeHead(model, cache_kwarg(model), Buffers()).buffered
    model.config.final_logit_softcapping = 30.0
    try:
        assert not _DecodeHead(model, cache_kwarg(model), Buffers()).buffered
    finally:
        model.config.final_logit_softcapping = None


def test_reserved_cache_layer_matches_concatenation():
    """The sampler's in-place KV cache layer returns what DynamicLayer's concatenation returns, past its room too."""
    from transformers.cache_utils import DynamicLayer

    from grpo.kernels.sampling import _ReservedLayer

    torch.manual_seed(0)
    plain, filled = DynamicLayer(), DynamicLayer()
    prefix = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 6)  # (N, heads, length, D); values with another D
    plain.update(*prefix)
    filled.update(*prefix)
    reserved = _ReservedLayer(filled, extra=2)
    for step in range(4):  # two steps fit the room (5 + 2), then one of two positions and one more fall back
        length = 2 if step == 2 else 1
        new = torch.randn(3, 2, length, 4), torch.randn(3, 2, length, 6)
        expected, got = plain.update(*new), reserved.update(*new)
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert reserved.get_seq_length() == plain.get_seq_length()


def test_static_decoder_does_not_keep_its_model_alive(prompts, tokenizer):
    """The static-cache decoder kept between calls holds its model weakly: a dropped model is freed."""
    import gc
    import weakref

    from grpo.tiny_model import build_tiny_model

    model, _ = build_tiny_model("tiny", seed=1, tokenizer=tokenizer)
    params = SamplingParams(max_completion_length=4, eos_token_ids=(tokenizer.eos_token_id,))
    sampler = FastSampler()  # keeps its static decoder between calls
    sampler.sample_groups(model, prompts, 2, params, tokenizer.pad_token_id, static_cache=True)
    assert sampler.decoder is not None
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("vocab", [8, 37, 64, 1000, 2500])
def test_logits_stored_transposed_sample_exactly_as_contiguous_ones(vocab):
    """The CPU decode head returns (N, V) logits as a view of (V, N) storage; row maxima, weights, block sums
    and so the drawn tokens must not depend on the layout (vocabularies below, at and off the 64-row slots
    and the 1024-token blocks)."""
    from grpo.kernels.sampling import _row_max, sample_next_token

    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    transposed = logits.T.contiguous().T
    assert transposed.stride(-1) != 1 and torch.equal(transposed, logits)
    assert torch.equal(_row_max(transposed), logits.amax(-1, keepdim=True))
    for temperature in (1.0, 0.7):
        expected = sample_next_token(logits, temperature, generator=torch.Generator().manual_seed(1))
        got = sample_next_token(transposed, temperature, generator=torch.Generator().manual_seed(1),
                                out=torch.empty_like(transposed))
        assert torch.equal(got, expected)


def test_transposed_storage_matches_the_softmax_distribution():
    from grpo.kernels.sampling import sample_next_token

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    rows = 40_000
    transposed = logits.expand(rows, -1).T.contiguous().T  # (rows, 8) view of (8, rows)
    tokens = sample_next_token(transposed, 0.8, generator=torch.Generator().manual_seed(11))
    statistic, dof = _chi_square(tokens, torch.softmax(logits / 0.8, -1))
    assert statistic < CHI2_9999[dof], statistic


def test_transposed_decode_head_gives_the_same_logits(tiny_model_and_tokenizer, prompts):
    from transformers import DynamicCache

    from grpo.kernels.buffers import Buffers
    from grpo.kernels.sampling import _DecodeHead

    model, _ = tiny_model_and_tokenizer
    ids, mask = left_pad(prompts, 0, "cpu")
    shift = torch.tensor([3.0, -2.0, 0.5])
    logits = {}
    for transposed in (False, True):
        head = _DecodeHead(model, cache_kwarg(model), Buffers(), transposed=transposed)
        for name, kwargs in (("plain", {}), ("scaled", {"scale": 1.7}), ("shifted", {"scale": 1.7, "shift": shift})):
            with torch.no_grad():
                logits[transposed, name] = head(DynamicCache(config=model.config), input_ids=ids, attention_mask=mask,
                                                position_ids=position_ids_from_mask(mask), **kwargs).clone()
    plain = logits[False, "plain"]
    assert plain.shape == (len(prompts), model.config.vocab_size)
    for transposed in (False, True):
        torch.testing.assert_close(logits[transposed, "plain"], plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[transposed, "scaled"], 1.7 * plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[transposed, "shifted"], 1.7 * plain - shift[:, None], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_return_logprobs_changes_no_drawn_token(sampler):
    """Asking for the log-probs must not change which tokens a seed draws (both read the same logits)."""
    model, tokenizer = build_tiny_model("small", seed=0)  # the real 151,936-token vocabulary
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in QUESTIONS]
    params = SamplingParams(max_completion_length=16, temperature=0.7, eos_token_ids=(tokenizer.eos_token_id,))
    plain, with_logprobs = (
        SAMPLERS[sampler](model, prompts, 8, params, tokenizer.pad_token_id,
                          generator=torch.Generator().manual_seed(0), return_logprobs=flag) for flag in (False, True))
    assert torch.equal(with_logprobs.completion_ids, plain.completion_ids)
    assert with_logprobs.logprobs.shape == plain.completion_ids.shape and (with_logprobs.logprobs <= 0).all()


@pytest.mark.parametrize("offset", [0.0, 40.0, -50.0, 150.0, -300.0])
def test_shifted_base2_sampling_matches_the_softmax_for_any_offset(offset):
    """The sampler's shifted steps draw from 2^y with y = z log2(e) / T - c for a c carried over from the last
    token. Whatever the offset (inside the accepted range, or far enough out that the sums overflow or the
    weights underflow, which redoes the row with its max), tokens follow softmax(z / T) and the returned
    log-normaliser is log2 sum 2^y. One row in four has no offset, so a redo must leave the other rows alone."""
    from grpo.kernels.sampling import _sample_base2

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    rows, temperature = 40_000, 0.8
    offsets = torch.full((rows, 1), offset)
    offsets[::4] = 0.0
    y = (logits / temperature * 1.4426950408889634).expand(rows, -1) + offsets
    y = y.T.contiguous().T  # (rows, V) view of (V, rows) storage, as the decode head writes it
    uniform = torch.rand(y.shape[0], 1, generator=torch.Generator().manual_seed(12))
    tokens, log2_total = _sample_base2(y, uniform, out=torch.empty_like(y))
    statistic, dof = _chi_square(tokens, torch.softmax(logits / temperature, -1))
    assert statistic < CHI2_9999[dof], statistic
    expected = torch.logsumexp(y.double() * torch.log(torch.tensor(2.0, dtype=torch.float64)), -1) / torch.log(
        torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(log2_total.double(), expected, rtol=0, atol=1e-5 * max(1.0, abs(offset)))


@pytest.mark.parametrize("margin", [-300.0, 300.0])
def test_shifted_steps_redone_with_the_max_draw_the_same_tokens(margin, monkeypatch):
    """A shift far from every row's maximum (the margin moves it: sums overflow, or weights underflow) makes each
    decode step redo its rows with their max. The tokens drawn and their log-probs must not change, and the
    log-probs must be those of softmax(z / T) of the step's logits."""
    import grpo.kernels.sampling as sampler_module

    model, tokenizer = build_tiny_model("small", seed=0)  # the real 151,936-token vocabulary: the shifted steps' path
    temperature = 0.05  # base-2 logits of tens: the shift matters
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in QUESTIONS]
    params = SamplingParams(max_completion_length=8, temperature=temperature, eos_token_ids=(tokenizer.eos_token_id,))

    def sample(seen=None):
        callback = None if seen is None else (lambda step, logits: seen.append(logits.clone()))
        return fast_sample_groups(model, prompts, 4, params, tokenizer.pad_token_id,
                                  generator=torch.Generator().manual_seed(3), return_logprobs=True, step_callback=callback)

    seen = []
    usual = sample(seen)
    assert len(set(usual.completion_ids.flatten().tolist())) > 8, "the tokens should vary"
    for step, logits in enumerate(seen):
        expected = torch.log_softmax(logits.double() / temperature, -1).gather(-1, usual.completion_ids[:, step : step + 1])
        done = usual.completion_mask[:, step] == 0
        torch.testing.assert_close(usual.logprobs[:, step].double(), expected.squeeze(-1).masked_fill(done, 0.0),
                                   rtol=0, atol=1e-4)
    calls = []
    real = sampler_module._row_max
    monkeypatch.setattr(sampler_module, "_row_max", lambda y: calls.append(1) or real(y))
    monkeypatch.setattr(sampler_module, "_SHIFT_MARGIN", margin)
    redone = sample()
    assert len(calls) == usual.completion_ids.shape[1] - 1  # every decode step after the first was redone
    assert torch.equal(redone.completion_ids, usual.completion_ids)
    torch.testing.assert_close(redone.logprobs, usual.logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sample_returns_tensors_usable_with_autograd(tiny_model_and_tokenizer, prompts, sampler):
    """On CPU the sampler runs in inference mode; what it returns must still work as autograd inputs and be
    writable (the trainer builds its training inputs from it)."""
    model, tokenizer = tiny_model_and_tokenizer
    params = SamplingParams(max_completion_length=4, temperature=1.0, eos_token_ids=(tokenizer.eos_token_id,))
    sample = SAMPLERS[sampler](model, prompts, 2, params, tokenizer.pad_token_id, return_logprobs=True,
                               generator=torch.Generator().manual_seed(0))
    tensors = [value for value in vars(sample).values() if isinstance(value, torch.Tensor)]
    assert len(tensors) == 6 and not any(t.is_inference() for t in tensors)
    sample.completion_mask[:, 0] = 1  # writable
    embedding = torch.nn.Embedding(model.config.vocab_size, 3)
    embedding(sample.completion_ids).sum().backward()  # the ids saved for backward
    assert embedding.weight.grad is not None


@pytest.fixture(scope="module")
def ends_often(tokenizer):
    """A tiny model that draws its EOS token with probability about 0.1 at every position."""
    from grpo.tiny_model import set_eos_rate

    model, _ = build_tiny_model("tiny", seed=5, tokenizer=tokenizer)
    set_eos_rate(model, 0.1, tokenizer.eos_token_id)
    return model


@pytest.mark.parametrize("sampler,static_cache", [("plain", False), ("kernel", False), ("kernel", True)])
def test_pad_equal_to_eos_ends_each_row_at_its_first_eos(ends_often, prompts, tokenizer, sampler, static_cache):
    """Most real tokenizers pad with their EOS token. A finished row is then padded with EOS at every later step,
    and those pads must not count as the row's end again: each row's length is its first EOS, found here by a
    plain scan of the drawn ids. The kernel's rows wait in the loop after they end (until a share of them has
    ended, or always with a static cache), so it meets the padded EOS too."""
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_completion_length=16, eos_token_ids=(eos,))
    options = {"static_cache": True} if static_cache else {}
    sample = SAMPLERS[sampler](ends_often, prompts, 8, params, eos, generator=torch.Generator().manual_seed(0),
                               **options)
    ids, width = sample.completion_ids, sample.completion_ids.shape[1]
    expected_lengths, ended = [], []
    for row in ids.tolist():
        first = row.index(eos) + 1 if eos in row else width
        assert all(token == eos for token in row[first:]), "a finished row must hold only padding"
        expected_lengths.append(first)
        ended.append(eos in row)
    assert sample.completion_mask.sum(1).tolist() == expected_lengths
    assert sample.truncated.tolist() == [not e for e in ended]
    assert sample.num_generated_tokens == sum(expected_lengths)
    assert sum(length < width - 1 for length in expected_lengths) >= 3, "too few rows ended early to test padding"


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_prompts_completions_do_not_depend_on_the_other_prompts_in_the_batch(tiny_model_and_tokenizer, prompts,
                                                                                 sampler):
    """With RowUniforms drawn per prompt (what the trainer passes), a prompt's G completions are the same alone or
    beside other prompts: so they do not depend on how many processes split the step."""
    from grpo.algorithm.sampler import RowUniforms

    model, tokenizer = tiny_model_and_tokenizer
    params = SamplingParams(max_completion_length=6, eos_token_ids=(tokenizer.eos_token_id,))
    seeds = [11, 12, 13]
    noise = lambda chosen: RowUniforms.per_prompt([torch.Generator().manual_seed(seeds[i]) for i in chosen], 3, 6)
    together = SAMPLERS[sampler](model, prompts, 3, params, tokenizer.pad_token_id, generator=noise([0, 1, 2]))
    alone = SAMPLERS[sampler](model, [prompts[1]], 3, params, tokenizer.pad_token_id, generator=noise([1]))
    width = alone.completion_ids.shape[1]
    assert torch.equal(together.completion_ids[3:6, :width], alone.completion_ids)
    assert not torch.equal(together.completion_ids[0:3, :width], alone.completion_ids)


def test_row_uniforms_check_their_shape_and_give_one_seed_from_their_noise():
    from grpo.algorithm.sampler import RowUniforms, draw_uniform

    make = lambda seed: RowUniforms.per_prompt([torch.Generator().manual_seed(seed)], 4, 5)  # (4, 5)
    uniforms = make(0)
    assert torch.equal(draw_uniform(uniforms, 4, 2, "cpu"), uniforms.values[:, 2, None])
    with pytest.raises(ValueError, match=r"RowUniforms of shape \(4, 5\) for 3 rows at step 0"):
        draw_uniform(uniforms, 3, 0, "cpu")
    with pytest.raises(ValueError, match=r"for 4 rows at step 5"):
        draw_uniform(uniforms, 4, 5, "cpu")
    # The seed a one-seed backend (model.generate) takes: fixed by the noise, different for other noise.
    assert make(0).seed == uniforms.seed and make(1).seed != uniforms.seed and 0 < uniforms.seed < 2**31
    assert RowUniforms.per_prompt([torch.Generator().manual_seed(0)], 4, 0).seed == 0  # no noise drawn: seed 0
    assert RowUniforms(uniforms.values).seed == 0  # built from values alone
    seeds = [make(seed).seed for seed in range(20)]  # spread over [0, 2^31): a 32-bit signed seed, no collisions
    assert len(set(seeds)) == 20 and all(0 <= seed < 2**31 for seed in seeds)


def test_sampling_params_defaults_are_trls_and_each_bound_is_where_the_docs_put_it():
    params = SamplingParams()
    assert (params.max_completion_length, params.temperature, params.top_p, params.top_k, params.min_p) == (
        256, 1.0, 1.0, 0, 0.0)
    for good in (dict(max_completion_length=1), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6),
                 dict(top_k=0), dict(min_p=0.0), dict(min_p=0.99)):
        SamplingParams(**good)
    for bad in (dict(top_p=1.0001), dict(top_p=1.5), dict(min_p=-0.01), dict(min_p=-0.5),
                dict(temperature=float("nan")), dict(max_completion_length=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_cache_argument_name_follows_the_models_forward():
    class NewStyle(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_kwarg(NewStyle()) == "cache" and cache_kwarg(OldStyle()) == "past_key_values"


def test_left_pad_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_token_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    for bad in ([], [[1, 2], []]):
        with pytest.raises(ValueError, match="at least one token"):
            left_pad(bad, 0, "cpu")


def test_filters_off_change_no_logit_and_act_on_each_row_alone():
    """top_p = 1 and min_p = 0 are off, also where float32 rounding puts the running probability at 1.0 before
    the last token (here p_0 = 1 - 4e-9 is 1.0 in float32); min_p keeps a token tied with the most likely one at
    any min_p <= 1; every filter works row by row (rows with different maxima)."""
    logits = torch.tensor([[20.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    for options in (dict(), dict(top_p=1.0), dict(min_p=0.0), dict(top_k=0), dict(top_k=3)):
        assert torch.equal(filter_logits(logits, **options), logits), options
    finite = lambda filtered: torch.isfinite(filtered).tolist()
    assert finite(filter_logits(logits, min_p=1.0)) == [[True, False, False], [False, True, True]]
    assert finite(filter_logits(logits, min_p=0.5)) == [[True, False, False], [False, True, True]]
    assert finite(filter_logits(logits, top_k=1)) == [[True, False, False], [False, True, True]]  # ties kept
    assert finite(filter_logits(logits + torch.tensor([0.0, 0.0, 1.0]), top_p=0.5)) == [[True, False, False],
                                                                                     [False, False, True]]


@pytest.mark.parametrize("sampler", NEXT_TOKEN)
def test_a_draw_at_either_end_of_the_unit_interval_never_takes_an_impossible_token(sampler):
    """u = 0 takes the first token of positive probability, u -> 1 the last: a filtered (-inf) token at either
    end of the vocabulary occupies an empty interval."""
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")]] * 2)
    uniform = torch.tensor([[0.0], [1.0 - 2**-24]])
    assert NEXT_TOKEN[sampler](logits, 1.0, uniform=uniform).tolist() == [1, 2]


def test_default_temperature_is_one():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]).expand(4000, -1)
    uniform = torch.rand(4000, 1, generator=torch.Generator().manual_seed(3))
    from grpo.algorithm.sampler import sample_next_token

    assert torch.equal(sample_next_token(logits, uniform=uniform), sample_next_token(logits, 1.0, uniform=uniform))


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_the_samplers_log_probs_are_the_models_log_probs_of_the_drawn_tokens(peaked, tokenizer, prompts, sampler,
                                                                              temperature):
    """What the importance-sampling correction reads as pi_b: log softmax(logits / T) of each drawn token (T = 1
    when greedy), recomputed here by a full forward pass over prompt + completion; 0 after a row's EOS."""
    from references import naive_completion_logprobs

    model = peaked  # varied tokens also when greedy
    run = lambda eos: SAMPLERS[sampler](
        model, prompts, 3, SamplingParams(max_completion_length=12, temperature=temperature, eos_token_ids=eos),
        tokenizer.pad_token_id, generator=torch.Generator().manual_seed(5), return_logprobs=True)
    sample = run((int(run((tokenizer.eos_token_id,)).completion_ids[0, 3]),))  # row 0's 4th token ends rows
    assert not sample.truncated.all() and sample.truncated.any()  # some rows end early, some run to the budget
    prompt_ids = sample.prompt_ids.repeat_interleave(3, 0)
    prompt_mask = sample.prompt_mask.repeat_interleave(3, 0)
    ids = torch.cat([prompt_ids, sample.completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, sample.completion_mask], 1)
    with torch.no_grad():
        expected = naive_completion_logprobs(model, ids, attention_mask, sample.completion_mask,
                                             temperature=temperature or 1.0)
    torch.testing.assert_close(sample.logprobs, expected, rtol=1e-4, atol=1e-4)
    assert (sample.logprobs[sample.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_decode_stops_when_every_row_has_ended(peaked, tokenizer, prompts, sampler):
    """One prefill, then one forward per further token until the last row ends: no step after every row's EOS
    (nor after the budget), and the completions are as wide as the longest row. Greedy draws no random numbers."""
    model = peaked  # varied greedy tokens
    first = sample_groups(model, prompts, 2, SamplingParams(max_completion_length=6, temperature=0.0,
                                                            eos_token_ids=(tokenizer.eos_token_id,)),
                          tokenizer.pad_token_id).completion_ids
    eos = sorted(set(first[:, 2].tolist()))  # every row holds one of them by its third token
    ends = [next(t for t, token in enumerate(row.tolist()) if token in eos) + 1 for row in first]
    assert max(ends) >= 2
    for budget in (10, max(ends) - 1):
        width = min(max(ends), budget)
        calls = []
        hook = model.register_forward_hook(lambda module, args, output: calls.append(1))
        generator = torch.Generator().manual_seed(0)
        state = generator.get_state()
        try:
            sample = SAMPLERS[sampler](model, prompts, 2, SamplingParams(max_completion_length=budget, temperature=0.0,
                                                                         eos_token_ids=tuple(eos)),
                                       tokenizer.pad_token_id, generator=generator)
        finally:
            hook.remove()
        assert sample.completion_ids.shape == (6, width) and torch.equal(sample.completion_ids, first[:, :width])
        if sampler == "plain":  # the kernel's lean decode step runs the trunk without the model's forward
            assert len(calls) == width, (budget, len(calls))  # the prefill + width - 1 decode steps
        assert torch.equal(generator.get_state(), state)


def test_group_size_must_be_positive(tiny_model_and_tokenizer, prompts):
    model, tokenizer = tiny_model_and_tokenizer
    params = SamplingParams(max_completion_length=2, eos_token_ids=(tokenizer.eos_token_id,))
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        sample_groups(model, prompts, 0, params, tokenizer.pad_token_id)
    assert sample_groups(model, prompts, 1, params, tokenizer.pad_token_id).logprobs is None  # only when asked
