import pytest
import torch

import grpo.kernels.logprobs
import grpo.algorithm.logprobs
from grpo.kernels.buffers import Buffers
from references import naive_completion_logprobs

# The plain chunked log-probs and the kernel that replaces them (--kernels auto) must pass the same tests.
IMPLEMENTATIONS = {"plain": grpo.algorithm.logprobs.completion_logprobs, "kernel": grpo.kernels.logprobs.completion_logprobs}


def _batch(vocab_size, generator):
    """3 rows: prompts of lengths 5, 3, 6 left-padded to 6; completions of 4, 2, 0+... right-padded to 4."""
    prompt_lengths, completion_lengths = [5, 3, 6], [4, 2, 3]
    P, T = 6, 4
    input_ids = torch.randint(3, vocab_size, (3, P + T), generator=generator)
    attention_mask = torch.zeros(3, P + T, dtype=torch.long)
    completion_mask = torch.zeros(3, T, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        attention_mask[row, P - p : P + c] = 1
        completion_mask[row, :c] = 1
        input_ids[row, : P - p] = 0  # pad
        input_ids[row, P + c :] = 0
    return input_ids, attention_mask, completion_mask


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_matches_naive_values_and_gradients(tiny_model_and_tokenizer, temperature, chunk_size, kernels):
    completion_logprobs = IMPLEMENTATIONS[kernels]
    model, _ = tiny_model_and_tokenizer
    model = model.float().train()
    generator = torch.Generator().manual_seed(1)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    weights = torch.randn(completion_mask.shape, generator=generator)

    model.zero_grad()
    fast, entropy = completion_logprobs(
        model, input_ids, attention_mask, completion_mask, temperature, with_entropy=True, chunk_size=chunk_size
    )
    (fast * weights).sum().backward()
    fast_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature)
    (naive * weights).sum().backward()

    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        # atol 1e-6 of the tensor's largest gradient (~7 here): an entry that is a sum of such terms cancelling
        # to ~0.03 differs by fp32 rounding of the terms, not of itself (as in the fused-loss test below).
        atol = 1e-6 * max(1.0, param.grad.abs().max().item())
        torch.testing.assert_close(fast_grads[name], param.grad, rtol=1e-5, atol=atol, msg=name)
    assert (fast[completion_mask == 0] == 0).all()

    # Entropy against the full softmax: H = -sum p log p of the tempered distribution.
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -5:-1] / temperature
        logp = torch.log_softmax(logits.float(), -1)
        expected = -(logp.exp() * logp).sum(-1) * completion_mask
    torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=1e-5)
    model.eval()


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
def test_bf16_autocast_is_close_to_fp32(tiny_model_and_tokenizer, kernels):
    completion_logprobs = IMPLEMENTATIONS[kernels]
    model, _ = tiny_model_and_tokenizer
    generator = torch.Generator().manual_seed(2)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, input_ids, attention_mask, completion_mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16, _ = completion_logprobs(model, input_ids, attention_mask, completion_mask)
    assert bf16.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: log-probs around -6 are off by a few 1e-2 at most.
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=0.1)


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
def test_zero_temperature_is_rejected(tiny_model_and_tokenizer, kernels):
    completion_logprobs = IMPLEMENTATIONS[kernels]
    model, _ = tiny_model_and_tokenizer
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        completion_logprobs(model, ids, torch.ones_like(ids), torch.ones(1, 2), temperature=0.0)


def test_models_with_transformed_logits_are_refused(tiny_model_and_tokenizer):
    from grpo.algorithm.logprobs import check_plain_output_head

    model, _ = tiny_model_and_tokenizer
    check_plain_output_head(model.config)  # Qwen2: plain W h
    config = type(model.config)(**{**model.config.to_dict(), "final_logit_softcapping": 30.0})
    with pytest.raises(NotImplementedError, match="final_logit_softcapping=30.0"):
        check_plain_output_head(config)


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
def test_untied_output_head_matches_naive(tokenizer, kernels):
    completion_logprobs = IMPLEMENTATIONS[kernels]
    from grpo.tiny_model import build_tiny_model

    model, _ = build_tiny_model("tiny", seed=2, tokenizer=tokenizer)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    model.train()
    generator = torch.Generator().manual_seed(4)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    fast, _ = completion_logprobs(model, input_ids, attention_mask, completion_mask, 1.3)
    fast.sum().backward()
    fast_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, 1.3)
    naive.sum().backward()
    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_grad, model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)


def _grpo_token_loss(old, ref, advantages, weights):
    """A token-level GRPO loss with every option on: off-policy ratio, clip-higher, delta, bias-corrected KL."""
    from grpo.algorithm.loss import LossOptions, token_loss

    def loss_fn(logps, index):
        options = LossOptions(beta=0.1, epsilon=0.02, epsilon_high=0.05, delta=1.04, use_bias_correction_kl=True)
        return (token_loss(logps, old[index], advantages[index], ref[index], options) * weights[index]).sum()

    return loss_fn


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
@pytest.mark.parametrize("tied", [True, False])
def test_fused_token_loss_matches_autograd(tokenizer, temperature, chunk_size, tied):
    # completion_token_loss forms the gradient in the forward pass; it must equal autograd through the
    # naive full-logits log-probs and the same per-token loss: values, entropies and every parameter's grad.
    from grpo.kernels.fused_loss import completion_token_loss
    from grpo.tiny_model import build_tiny_model

    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    model = model.float().train()
    generator = torch.Generator().manual_seed(4)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    keep = completion_mask.bool()
    with torch.no_grad():
        naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature)[keep]
    # Old log-probs near the current ones so some ratios clip and some do not; a reference further away.
    old = naive + 0.05 * torch.randn(naive.shape, generator=generator)
    ref = naive + 0.5 * torch.randn(naive.shape, generator=generator)
    advantages = torch.randn(naive.shape, generator=generator)
    weights = torch.rand(naive.shape, generator=generator)
    loss_fn = _grpo_token_loss(old, ref, advantages, weights)

    model.zero_grad()
    loss, logps, entropy = completion_token_loss(model, input_ids, attention_mask, completion_mask, loss_fn,
                                                 temperature, with_entropy=True, chunk_size=chunk_size)
    (2.0 * loss).backward()  # a scale on the incoming gradient reaches every parameter
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature)
    expected_loss = loss_fn(naive[keep], slice(None))
    (2.0 * expected_loss).backward()

    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logps, naive.detach(), rtol=1e-5, atol=1e-5)
    assert not logps.requires_grad and (logps[~keep] == 0).all()
    clipped = (old - naive[keep].detach()).exp()
    assert ((clipped < 0.98) | (clipped > 1.05)).any() and ((clipped > 0.98) & (clipped < 1.05)).any()
    for name, param in model.named_parameters():
        # atol 1e-6 of the tensor's largest gradient (up to ~6 here): fp32 sums in another order differ by
        # a few 1e-7 of it, for the unfused chunked path as much as for the fused one.
        atol = 1e-6 * max(1.0, param.grad.abs().max().item())
        torch.testing.assert_close(fused_grads[name], param.grad, rtol=1e-5, atol=atol, msg=name)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -5:-1] / temperature
        logp = torch.log_softmax(logits.float(), -1)
        expected_entropy = -(logp.exp() * logp).sum(-1) * completion_mask
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-5)


def test_fused_token_loss_under_bf16_autocast_tracks_fp32(tiny_model_and_tokenizer):
    from grpo.kernels.fused_loss import completion_token_loss
    from grpo.algorithm.loss import LossOptions, token_loss

    model, _ = tiny_model_and_tokenizer
    model = model.float()
    generator = torch.Generator().manual_seed(5)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    count = int(completion_mask.sum())
    advantages = torch.randn(count, generator=generator)
    ref = torch.full((count,), -6.0)

    def loss_fn(logps, index):  # on-policy GRPO with a KL term
        return token_loss(logps, logps.detach(), advantages[index], ref[index], LossOptions(beta=0.04)).sum()

    results = []
    for autocast in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, logps, entropy = completion_token_loss(model, input_ids, attention_mask, completion_mask, loss_fn,
                                                         with_entropy=True)
        loss.backward()
        results.append((logps, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logps32, entropy32, grads32), (logps16, entropy16, grads16) = results
    assert logps16.dtype == torch.float32 and entropy16.dtype == torch.float32
    # bf16 products (8-bit mantissa) on logits of size ~6: differences of a few 1e-2 in log-probs.
    torch.testing.assert_close(logps16, logps32, rtol=0, atol=0.1)
    torch.testing.assert_close(entropy16, entropy32, rtol=0, atol=0.1)
    for name, grad in grads32.items():
        cosine = torch.nn.functional.cosine_similarity(grads16[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.99, (name, cosine)


def test_fused_token_loss_edge_cases(tiny_model_and_tokenizer):
    # No real completion token at all (every row masked), and a loss that ignores the log-probs:
    # both give zero gradients, not an error.
    from grpo.kernels.fused_loss import completion_token_loss

    model, _ = tiny_model_and_tokenizer
    model = model.float()
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, torch.Generator().manual_seed(6))
    for mask, loss_fn in [(torch.zeros_like(completion_mask), lambda logps, index: logps.sum()),
                          (completion_mask, lambda logps, index: torch.tensor(0.5))]:
        model.zero_grad(set_to_none=False)
        loss, logps, _ = completion_token_loss(model, input_ids, attention_mask, mask, loss_fn)
        loss.backward()
        assert logps.shape == mask.shape and (logps[mask == 0] == 0).all()
        assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()
    assert loss.item() == 0.5  # the constant, once: the 9 tokens fit in one chunk


def _far_targets(generator, rows=12, vocab=50, hidden=8):
    """Hidden states, weights and targets with logits up to ~110 nats: a third of the targets are each row's least
    likely token (more than 64 below the max in base 2, so their exponentials relative to the target would
    pass the bound and the rows are redone), a third one about 30 nats below the max (exponentials up to ~2^43
    relative to the target), a third the most likely."""
    weight = torch.randn(vocab, hidden, generator=generator)
    states = torch.randn(rows, hidden, generator=generator) * 8.0
    logits = states @ weight.T  # (rows, V)
    order = logits.argsort(-1)
    middling = ((logits.amax(-1, keepdim=True) - logits) - 30.0).abs().argmin(-1)  # ~30 nats below the max
    targets = torch.cat([order[0:4, 0], middling[4:8], order[8:12, -1]])
    gaps = (logits.amax(-1) - logits.gather(-1, targets[:, None]).squeeze(-1)) * 1.4426950408889634  # base 2
    assert (gaps[:4] > 64).all() and (gaps[4:8] > 20).any() and (gaps[4:8] < 64).all()
    return states, weight, targets


def _float64_reference(states, weight, targets, temperature):
    states, weight = states.double().requires_grad_(), weight.double().requires_grad_()
    logp_all = torch.log_softmax(states @ weight.T / temperature, -1)  # (M, V)
    logps = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return states, weight, logps, entropy


def _close_to(got, expected, name, scale=None):
    # fp32 against float64: atol 1e-6 of the largest value (fp32 sums of ~100-sized terms in another order), as
    # a plain fp32 log_softmax + autograd measures here; `scale` replaces the largest value where the result is a
    # difference of larger quantities.
    expected = expected.detach()
    atol = 1e-6 * max(1.0, scale or expected.abs().max().item())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("chunk_size", [5, 64])
@pytest.mark.parametrize("by_target", [True, False])
@pytest.mark.parametrize("columns", [True, False])
def test_targets_far_below_the_max(chunk_size, by_target, columns, monkeypatch):
    # On CPU exponentials are taken relative to the target's logit; rows whose target is less likely than 2^-64 are
    # redone with their max, and fp32 logits are stored as (V, c) columns. Accelerators shift by the max and store
    # (c, V) rows (both run here on CPU too). Log-probs, entropies and gradients against float64, both Functions.
    from grpo.kernels import logprobs as kernel
    from grpo.kernels.fused_loss import _FusedTokenLoss
    from grpo.kernels.logprobs import _ChunkedTokenLogProbs

    assert kernel._shift_by_target(torch.device("cpu")) and kernel._columns_layout(torch.zeros(1))
    monkeypatch.setattr(kernel, "_shift_by_target", lambda device: by_target)
    monkeypatch.setattr(kernel, "_columns_layout", lambda h: columns)
    passes, real_pass = [], kernel._softmax_pass
    monkeypatch.setattr(kernel, "_softmax_pass", lambda *args: passes.append(1) or real_pass(*args))

    generator = torch.Generator().manual_seed(7)
    states, weight, targets = _far_targets(generator)
    scale = torch.rand(targets.shape, generator=generator)  # d loss / d logp per token
    temperature = 0.9
    ref_states, ref_weight, ref_logps, ref_entropy = _float64_reference(states, weight, targets, temperature)
    (ref_logps * scale.double()).sum().backward()
    assert ref_logps.min() < -60

    chunks = -(-len(targets) // chunk_size)
    hidden, w = states.clone().requires_grad_(), weight.clone().requires_grad_()
    logps, _ = _ChunkedTokenLogProbs.apply(hidden, w, targets, temperature, chunk_size, False, Buffers())
    (logps * scale).sum().backward()
    assert len(passes) == (chunks + 1 if by_target else chunks)  # the far rows' chunk redone once
    for name, got, expected in [("logps", logps, ref_logps), ("d hidden", hidden.grad, ref_states.grad),
                                ("d weight", w.grad, ref_weight.grad)]:
        _close_to(got, expected, name)
    # The entropy is a difference of two terms as large as the gap between the max and the shift (the target's
    # logit: up to ~45 nats here below the redo bound), so its fp32 error scales with the logits.
    logits_scale = (states @ weight.T).abs().max().item() / temperature
    logps_again, entropy = _ChunkedTokenLogProbs.apply(states, weight, targets, temperature, chunk_size, True, Buffers())
    assert torch.equal(logps_again, logps.detach())  # the entropy changes no log-prob
    _close_to(entropy, ref_entropy, "entropy", scale=logits_scale)

    hidden, w = states.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, logps, entropy = _FusedTokenLoss.apply(hidden, w, targets, temperature, chunk_size, True,
                                                 lambda chunk, index: (chunk * scale[index]).sum(), None,
                                                 Buffers())
    loss.backward()
    for name, got, expected in [("loss", loss, (ref_logps * scale.double()).sum()), ("logps", logps, ref_logps),
                                ("d hidden", hidden.grad, ref_states.grad), ("d weight", w.grad, ref_weight.grad)]:
        _close_to(got, expected, name)
    # The fused pass takes the entropy as lse - sum_j p_j z_j from its (c, H) products, a difference of two
    # quantities as large as the logits (~120 nats here): its fp32 error scales with them, whatever the shift.
    _close_to(entropy, ref_entropy, "entropy", scale=logits_scale)


def test_non_finite_logits_give_non_finite_log_probs():
    # A row with a nan hidden state has no finite log-prob (the trainer then skips the update); the other rows are
    # unaffected and nothing raises.
    from grpo.kernels.logprobs import _ChunkedTokenLogProbs

    generator = torch.Generator().manual_seed(8)
    states, weight, targets = _far_targets(generator)
    states[3, 0] = float("nan")
    logps, entropy = _ChunkedTokenLogProbs.apply(states, weight, targets, 1.0, 5, True, Buffers())
    kept = [row for row in range(len(targets)) if row != 3]
    _, _, expected, _ = _float64_reference(states[kept], weight, targets[kept], 1.0)
    assert logps[3].isnan() and entropy[3].isnan()
    _close_to(logps[kept], expected, "logps")


# From the mutation run's survivors (docs/mutation.md): the plain path's helpers and options pinned by value.

def test_positions_start_at_each_rows_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]  # padding takes position 0, as generate does
    assert grpo.algorithm.logprobs.position_ids_from_mask(mask).tolist() == expected


@pytest.mark.parametrize("vocab,rows", [
    (151936, 192),  # Qwen: 2^25 / 151936 = 220.8 -> 220, down to a multiple of 64
    (49152, 640),  # SmolLM2: 682.7 -> 682 -> 640
    (8192, 4096),  # 4096, already a multiple of 64
    (532610, 63),  # 63.0: under 64, kept as it is
    (1 << 21, 16),  # 16
    ((1 << 21) + 1, 16),  # 15.99 -> 15, raised to the floor of 16
    (1 << 25, 16),  # 1 -> 16
])
def test_default_chunk_size_by_hand(vocab, rows):
    assert grpo.algorithm.logprobs.default_chunk_size(vocab) == rows


def test_logit_transforms_are_found_in_the_text_config_and_one_is_plain():
    from types import SimpleNamespace

    from grpo.algorithm.logprobs import check_plain_output_head

    class Composite:  # a multimodal config: the language model's settings are in its text config
        def get_text_config(self):
            return SimpleNamespace(final_logit_softcapping=30.0)

    with pytest.raises(NotImplementedError, match="final_logit_softcapping=30.0"):
        check_plain_output_head(Composite())
    with pytest.raises(NotImplementedError, match="logit_scale=2.0"):  # a config without get_text_config
        check_plain_output_head(SimpleNamespace(logit_scale=2.0))
    check_plain_output_head(SimpleNamespace(logit_scale=1.0, logits_scaling=None))  # a scale of 1 is W h


def test_bad_shapes_are_refused(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ids = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(AssertionError):  # the completion is the whole sequence: no position predicts its first token
        grpo.algorithm.logprobs.completion_logprobs(model, ids, torch.ones_like(ids), torch.ones(2, 6))
    with pytest.raises(AssertionError):  # an attention mask of another shape
        grpo.algorithm.logprobs.completion_logprobs(model, ids, torch.ones(2, 5, dtype=torch.long), torch.ones(2, 2))


def test_defaults_are_temperature_one_no_entropy_and_the_models_head_dtype(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, torch.Generator().manual_seed(5))
    with torch.no_grad():
        logps, entropy = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask, completion_mask)
        naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, 1.0)
        assert entropy is None
        torch.testing.assert_close(logps, naive, rtol=1e-5, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32_head off by default: the head runs in bf16
            default, _ = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask, completion_mask)
            bf16_head, _ = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask,
                                                                       completion_mask, fp32_head=False)
    assert torch.equal(default, bf16_head)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_head_under_bf16_autocast_matches_a_float32_head_on_the_same_hidden_states(tiny_model_and_tokenizer,
                                                                                      temperature):
    """fp32_head (trl's cast_lm_head_to_fp32): under autocast the trunk runs in bf16 and the output projection in
    fp32. Reference: the trunk's bf16 hidden states, then W h / temperature, log-softmax and gather in float32."""
    from grpo.algorithm.logprobs import position_ids_from_mask

    model, _ = tiny_model_and_tokenizer
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, torch.Generator().manual_seed(6))
    T = completion_mask.shape[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_head, _ = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask, completion_mask,
                                                                   temperature, fp32_head=True)
        bf16_head, _ = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask, completion_mask,
                                                                   temperature)
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_from_mask(attention_mask)).last_hidden_state[:, -T - 1 : -1]
    logits = hidden.float() @ model.lm_head.weight.float().T / temperature  # (N, T, V) in float32
    expected = torch.log_softmax(logits, -1).gather(-1, input_ids[:, -T:, None]).squeeze(-1) * completion_mask
    torch.testing.assert_close(fp32_head, expected, rtol=0, atol=1e-5)
    assert (bf16_head - expected).abs().max() > 1e-4  # the bf16 head is 10x further off (observed 9e-4): it can fail


def test_many_tokens_in_small_chunks_match_naive(tiny_model_and_tokenizer):
    """More real tokens than the hidden size, one row per chunk: every chunk is computed."""
    model, _ = tiny_model_and_tokenizer
    N, P, T = 6, 3, 40
    assert N * T > model.config.hidden_size
    input_ids = torch.randint(3, model.config.vocab_size, (N, P + T), generator=torch.Generator().manual_seed(7))
    attention_mask, completion_mask = torch.ones(N, P + T, dtype=torch.long), torch.ones(N, T, dtype=torch.long)
    with torch.no_grad():
        logps, _ = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask, completion_mask,
                                                               chunk_size=1)
        naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask)
    torch.testing.assert_close(logps, naive, rtol=1e-5, atol=1e-5)


def _untied_tiny_model(tokenizer):
    """The tiny model with its own output matrix (not the embeddings'), so the head and the trunk train apart."""
    from grpo.tiny_model import build_tiny_model

    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    return model


def test_a_trainable_head_over_a_frozen_trunk_gets_its_gradient(tokenizer):
    """Only the (untied) output matrix trains, so the hidden states carry no gradient: the chunks' recomputation in
    backward must still give W its gradient (a reentrant checkpoint would drop it)."""
    model = _untied_tiny_model(tokenizer)
    for name, param in model.named_parameters():
        param.requires_grad_(name == "lm_head.weight")
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, torch.Generator().manual_seed(8))
    logps, _ = grpo.algorithm.logprobs.completion_logprobs(model, input_ids, attention_mask, completion_mask,
                                                           chunk_size=5)
    logps.sum().backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    naive_completion_logprobs(model, input_ids, attention_mask, completion_mask).sum().backward()
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
@pytest.mark.parametrize("trains", ["everything", "trunk only (a frozen head, as with LoRA)", "head only"])
def test_backward_keeps_no_chunks_logits(tokenizer, trains, kernels):
    """The point of chunking: what autograd saves for backward holds no (c, V) logits block, whichever side of the
    head trains. A chunk computed outside the checkpoint keeps its logits and log-softmax (N*T*V floats in all),
    which computes the same numbers and shows only as memory (bench/logprob_memory.py measures it)."""
    model = _untied_tiny_model(tokenizer)
    head = model.lm_head.weight
    for name, param in model.named_parameters():
        is_head = name == "lm_head.weight"
        param.requires_grad_({"everything": True, "head only": is_head}.get(trains, not is_head))
    vocab = head.shape[0]
    input_ids, attention_mask, completion_mask = _batch(vocab, torch.Generator().manual_seed(8))
    logits_blocks = []

    def pack(tensor):
        shares_head = tensor.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
        if tensor.dim() >= 2 and tensor.shape[-1] == vocab and not shares_head:
            logits_blocks.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, entropy = IMPLEMENTATIONS[kernels](model, input_ids, attention_mask, completion_mask, chunk_size=2,
                                                  with_entropy=True)
    assert logps.requires_grad and entropy.requires_grad == (kernels == "plain")  # the kernel's entropy is a metric
    assert logits_blocks == []
    # the recomputation in backward still gives every gradient
    (logps.sum() + (entropy.sum() if entropy.requires_grad else 0)).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
