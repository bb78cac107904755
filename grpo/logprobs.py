"""Per-token log-probabilities of completion tokens, without materialising (N, T, V) logits.

    log pi(o_t | q, o_<t) = z_t[o_t] - logsumexp(z_t),   z_t = W h_t / temperature

Notation: N completions (rows), P prompt length (left-padded), T completion length (right-padded),
H hidden size, V vocabulary, M = number of real completion tokens (mask == 1).

The transformer trunk runs once over the full sequences; only the hidden states that predict a real
completion token (M of the N*T positions) go through the output projection W (V, H), in chunks of
rows. `_ChunkedTokenLogProbs` keeps only the (M, H) hidden states for backward and recomputes each
chunk's logits there, so peak memory holds one (chunk, V) block instead of (N, T, V) logits and
their softmax (trl 1.16's fused LM head does the same with tiles; older trl built the full logits).

Precision: under autocast the projection runs in the autocast dtype (bf16) and the log-softmax in
fp32; gradients for fp32 weights are accumulated in fp32.
"""

from __future__ import annotations

import torch


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


# Reused (chunk, V) buffers. On CPU a fresh 100+ MiB tensor per chunk costs more in page faults than the
# exp() that fills it; CUDA's caching allocator already reuses memory, so only CPU keeps buffers here.
_BUFFERS: dict[tuple, torch.Tensor] = {}


def _buffer(name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=dtype, device=device)
    key = (name, dtype, cols)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.shape[0] < rows:
        buffer = _BUFFERS[key] = torch.empty(rows, cols, dtype=dtype, device=device)
    return buffer[:rows]


def _shifted_logits(h: torch.Tensor, w: torch.Tensor, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (rows, V) logits h @ w.T minus a per-row `shift` (the row max if None), in a reused buffer.

    Returns (shifted logits, shift). The product runs in h's dtype (bf16 under autocast), the rest in fp32.
    """
    rows, vocab = h.shape[0], w.shape[0]
    shifted = _buffer("logits", rows, vocab, torch.float32, h.device)
    if h.dtype == torch.float32:
        torch.matmul(h, w.T, out=shifted)  # (rows, V)
        shift = shifted.amax(-1) if shift is None else shift
        shifted.sub_(shift[:, None])
    else:
        low = torch.matmul(h, w.T, out=_buffer("logits_low", rows, vocab, h.dtype, h.device))  # (rows, V)
        shift = low.amax(-1).float() if shift is None else shift
        torch.sub(low, shift[:, None], out=shifted)  # promoted to fp32
    return shifted, shift


def _exp_sum_and_dot(shifted: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: sum_j exp(s_j) and sum_j exp(s_j) s_j, a few rows at a time so exp(s) stays in cache."""
    total = shifted.new_empty(shifted.shape[0])
    weighted = shifted.new_empty(shifted.shape[0])
    for start in range(0, shifted.shape[0], block):
        part = shifted[start : start + block]  # (block, V)
        exps = torch.exp(part, out=_buffer("exps", part.shape[0], part.shape[1], part.dtype, part.device))
        total[start : start + block] = exps.sum(-1)
        weighted[start : start + block] = exps.mul_(part).sum(-1)
    return total, weighted


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """(M, H) hidden states, (V, H) weight, (M,) targets -> (M,) log-probs and (M,) entropies (no grad).

    With z = W h / temperature and p = softmax(z), per row:
        forward    logp = z[target] - lse(z),   entropy = lse(z) - sum_j p_j z_j
        backward   d logp / d z_j = [j == target] - p_j, so with the incoming gradient g:
                   dz = g * onehot(target) - g * p,  dh = dz W / temperature,  dW = dz^T h / temperature
    In backward, g * p is computed as sign(g) * exp(z - lse + log|g|): one exp pass over the recomputed logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool):
        dtype = _compute_dtype(weight)
        num_rows = hidden.shape[0]
        logps = hidden.new_empty(num_rows, dtype=torch.float32)  # (M,)
        lse = hidden.new_empty(num_rows, dtype=torch.float32)  # (M,)
        entropy = hidden.new_zeros(num_rows, dtype=torch.float32) if with_entropy else None
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, num_rows, chunk_size):
                rows = slice(start, start + chunk_size)
                h = hidden[rows].to(dtype) / temperature  # scale the (chunk, H) input, not the (chunk, V) logits
                shifted, row_max = _shifted_logits(h, w, None)  # z - max(z), fp32 (chunk, V)
                target_shifted = shifted.gather(-1, targets[rows, None]).squeeze(-1)  # (chunk,)
                if with_entropy:
                    total, weighted = _exp_sum_and_dot(shifted)
                    # H = log(total) - sum_j exp(z_j - max) (z_j - max) / total
                    entropy[rows] = total.log() - weighted / total
                else:
                    total = shifted.exp_().sum(-1)
                log_total = total.log()
                lse[rows] = row_max + log_total
                logps[rows] = target_shifted - log_total
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h = hidden[rows].to(dtype) / temperature  # (chunk, H)
                g = grad_logps[rows].float()  # (chunk,)
                # exp(z - lse + log|g|) = |g| * p, recomputed from the logits (never stored).
                scaled_probs, _ = _shifted_logits(h, w, lse[rows] - g.abs().log())
                scaled_probs = scaled_probs.exp_()  # (chunk, V) fp32
                minus_sign = torch.where(g < 0, 1.0, -1.0).to(dtype)[:, None]  # -g * p = -sign(g) |g| p
                if dtype != torch.float32:
                    scaled_probs = _buffer("logits_low", *scaled_probs.shape, dtype, h.device).copy_(scaled_probs)
                target_rows = w[targets[rows]]  # (chunk, H)
                if grad_hidden is not None:
                    dh = (scaled_probs @ w) * minus_sign + g.to(dtype)[:, None] * target_rows  # (chunk, H)
                    grad_hidden[rows] = (dh / temperature).to(hidden.dtype)
                if grad_weight is not None:
                    if dtype == torch.float32:
                        grad_weight.addmm_(scaled_probs.T, h * minus_sign)  # (V, H), accumulated in place
                    else:
                        grad_weight += (scaled_probs.T @ (h * minus_sign)).float()
                    grad_weight.index_add_(0, targets[rows], (g[:, None] * h.float()))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


def check_plain_output_head(config) -> None:
    """Our log-probs assume logits = W h. Refuse models whose config scales or soft-caps the logits."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise NotImplementedError(
                f"the model's config sets {name}={value}: its logits are not W h, which grpo.logprobs assumes"
            )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token (as `generate` does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, L)


def completion_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, T) of the last T tokens of `input_ids` (the completion), 0 where `completion_mask` is 0.

    input_ids, attention_mask: (N, P + T), prompts left-padded, completions right-padded.
    completion_mask: (N, T), 1 for real completion tokens. Returns (logps, entropy or None), fp32.
    chunk_size: rows of logits computed at once; default: as many as fit in 2^25 fp32 values
    (128 MiB, 220 rows at Qwen's 151,936 vocabulary).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    num_rows, total_len = input_ids.shape
    completion_len = completion_mask.shape[1]
    assert attention_mask.shape == input_ids.shape and completion_len < total_len, (input_ids.shape, completion_mask.shape)
    check_plain_output_head(model.config)  # checked before the trunk runs, not after
    lm_head = model.get_output_embeddings()
    if getattr(lm_head, "bias", None) is not None:
        raise NotImplementedError("output projections with a bias are not supported")
    chunk_size = chunk_size or max(16, (1 << 25) // lm_head.weight.shape[0])
    trunk = getattr(model, model.base_model_prefix)
    hidden = trunk(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state  # (N, P+T, H)
    # Position t-1 predicts token t: the T hidden states before each completion token.
    hidden = hidden[:, total_len - completion_len - 1 : total_len - 1]  # (N, T, H)
    keep = completion_mask.bool()  # (N, T)
    targets = input_ids[:, total_len - completion_len :][keep]  # (M,)
    token_logps, token_entropy = _ChunkedTokenLogProbs.apply(
        hidden[keep], lm_head.weight, targets, float(temperature), chunk_size, with_entropy
    )  # (M,), (M,)
    logps = hidden.new_zeros(num_rows, completion_len, dtype=torch.float32).masked_scatter(keep, token_logps)  # (N, T)
    entropy = None
    if with_entropy:
        entropy = hidden.new_zeros(num_rows, completion_len, dtype=torch.float32).masked_scatter(keep, token_entropy)
    return logps, entropy


def naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """Reference: full logits, log_softmax, gather. Materialises (N, T, V); for tests and the memory benchmark."""
    completion_len = completion_mask.shape[1]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits  # (N, L, V)
    logits = logits[:, -completion_len - 1 : -1].float() / temperature  # (N, T, V)
    targets = input_ids[:, -completion_len:]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)  # (N, T)
    return logps * completion_mask
