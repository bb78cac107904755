"""Per-token log-probabilities and entropies of completion tokens, without full (N, T, V) logits.

    log pi(o_t | q, o_<t) = z_t[o_t] - logsumexp(z_t),    z_t = W h_t / temperature
    entropy_t             = logsumexp(z_t) - sum_j p_j z_j,  p = softmax(z_t)

(DeepSeekMath arXiv 2402.03300 eq. 3 uses these log-probs in the ratio; trl divides the logits by the
sampling temperature, as here.)

Notation: N completions (rows), P prompt tokens (left-padded), T completion tokens (right-padded),
H hidden size, V vocabulary, M real completion tokens (completion_mask == 1).

The trunk runs once over the (N, P + T) sequences. Only the M hidden states that predict a real
completion token go through the output projection W (V, H), `chunk_size` rows at a time, and each
chunk is checkpointed: its (chunk, V) logits are freed after the forward and recomputed in backward.
Peak memory holds one chunk's logits instead of the (N, T, V) logits and their softmax.

Under autocast the projection runs in the autocast dtype (bf16) and the log-softmax in fp32.
`grpo.kernels.logprobs` and `grpo.kernels.fused_loss` compute the same numbers faster (--kernels auto).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                     "lm_head_multiplier")


def check_plain_output_head(config) -> None:
    """Our log-probs assume logits = W h. Refuse models whose config scales or soft-caps the logits."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise NotImplementedError(
                f"the model's config sets {name}={value}: its logits are not W h, which grpo.algorithm.logprobs assumes"
            )


def logit_divisor(temperature: float) -> float:
    """What the logits are divided by before the softmax that samples a token and that scores it: the sampling
    temperature (trl's log-probs too: the trained policy is the distribution that sampled); greedy decoding
    (temperature 0) samples the raw logits. The one place this rule lives: the plain log-probs and sampler, the
    log-prob and loss kernels (grpo.kernels.logprobs, grpo.kernels.fused_loss) and the kernel sampler
    (grpo.kernels.sampling) all divide by what it returns."""
    return temperature if temperature > 0 else 1.0


def check_temperature(temperature: float) -> None:
    """Log-probs divide the logits by the sampling temperature; 0 (greedy) has none to give."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token (as `generate` does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, L)


def default_chunk_size(vocab: int) -> int:
    """Rows of logits per chunk: as many as fit in 2^25 values (128 MiB in fp32), rounded down to a multiple
    of 64 when that leaves 64 or more (BLAS runs whole tiles), and at least 16."""
    rows = (1 << 25) // vocab
    return max(16, rows // 64 * 64 if rows >= 64 else rows)


def plain_output_weight(model) -> torch.Tensor:
    """The output matrix W (V, H), after checking that the output projection has no bias. That the config
    transforms no logit is check_plain_output_head's job, done once where a model is set up (the Trainer)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("output projections with a bias are not supported")
    return head.weight


def completion_hidden(model, input_ids, attention_mask, completion_mask, inputs_embeds=None):
    """The trunk once over the sequences; the hidden states that predict real completion tokens.

    input_ids, attention_mask (N, P + T); completion_mask (N, T). `inputs_embeds`, if given, replaces the
    embedding lookup (grpo.kernels.fused_loss passes embeddings with their own backward).
    Returns (hidden (M, H), targets (M,), keep (N, T) bool, output weight (V, H)).
    """
    total_len, completion_len = input_ids.shape[1], completion_mask.shape[1]
    assert attention_mask.shape == input_ids.shape and completion_len < total_len, \
        (input_ids.shape, completion_mask.shape)
    weight = plain_output_weight(model)  # before the trunk runs, not after
    trunk = getattr(model, model.base_model_prefix)
    inputs = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    hidden = trunk(**inputs, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                   use_cache=False).last_hidden_state  # (N, P + T, H)
    # Position t - 1 predicts token t: the T hidden states before each completion token.
    hidden = hidden[:, total_len - completion_len - 1 : total_len - 1]  # (N, T, H)
    keep = completion_mask.bool()  # (N, T)
    targets = input_ids[:, total_len - completion_len :][keep]  # (M,)
    return hidden[keep], targets, keep, weight


def scatter_rows(keep: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
    """(M,) values of the real tokens -> (N, T), 0 elsewhere."""
    if values is None:
        return None
    return values.new_zeros(keep.shape).masked_scatter(keep, values)


def chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool = False, fp32_head: bool = False):
    """One chunk: (c, H) hidden states, (V, H) weight, (c,) targets -> (c,) log-probs and (c,) entropies (nats)
    or None. Both carry gradients (the entropy bonus differentiates the entropy; unused, it costs nothing).
    fp32_head: the product in fp32 outside autocast (cast_lm_head_to_fp32)."""
    if fp32_head:
        with torch.autocast(hidden.device.type, enabled=False):
            logits = (hidden.float() @ weight.float().T) / logit_divisor(temperature)  # (c, V)
    else:
        logits = (hidden @ weight.T).float() / logit_divisor(temperature)  # (c, V), fp32 for the log-softmax
    log_probs = torch.log_softmax(logits, dim=-1)  # (c, V)
    logps = log_probs.gather(-1, targets[:, None]).squeeze(-1)  # (c,)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None  # (c,)
    return logps, entropy


def completion_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, T) of the last T tokens of `input_ids` (the completion), 0 where `completion_mask` is 0.

    input_ids, attention_mask: (N, P + T), prompts left-padded, completions right-padded.
    completion_mask: (N, T), 1 for real completion tokens. Returns (logps, entropy or None), fp32.
    chunk_size: rows of logits computed at once (default: `default_chunk_size`, 192 at Qwen's vocabulary).
    The kernels keep their own copy of this softmax (grpo.kernels.logprobs and grpo.kernels.fused_loss: base-2
    exponentials, relative to the target's logit); tests/test_kernels.py and tests/test_logprobs.py fail when the
    two drift. The temperature's rule (logit_divisor) they share.
    fp32_head: the output projection in fp32 outside autocast (trl's cast_lm_head_to_fp32).
    """
    check_temperature(temperature)
    hidden, targets, keep, weight = completion_hidden(model, input_ids, attention_mask, completion_mask)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for start in range(0, max(hidden.shape[0], 1), chunk_size):  # one empty chunk when M = 0: the graph stays whole
        rows = slice(start, start + chunk_size)
        args = (hidden[rows], weight, targets[rows], temperature, with_entropy, fp32_head)
        if differentiable:  # the chunk's (c, V) logits are recomputed in backward instead of kept
            chunk_logps, chunk_entropy = checkpoint(chunk_logprobs, *args, use_reentrant=False)
        else:
            chunk_logps, chunk_entropy = chunk_logprobs(*args)
        logps.append(chunk_logps)
        entropies.append(chunk_entropy)
    token_logps = torch.cat(logps)  # (M,)
    token_entropy = torch.cat(entropies) if with_entropy else None  # (M,)
    return scatter_rows(keep, token_logps), scatter_rows(keep, token_entropy)
