"""Same result as `grpo.algorithm.logprobs.completion_logprobs`, faster on CPU: base-2 exponentials, target-logit shifts
and (V, c) column layouts. Pinned to the plain function by tests/test_kernels.py (log-probs, entropies and
gradients at rtol 1e-5 in fp32) and tests/test_logprobs.py (far targets, redo rows, both layouts).

Chosen by `--kernels auto` on every device (grpo.kernels.select); the plain path is `--kernels plain`.
What it does differently from the plain chunked log-softmax (docs/design.md has the why of each):
- Softmax statistics in base 2: exp(x) = exp2(x log2 e), the factor on the (c, H) input of the product,
  so the logits come out in base 2 (torch's CPU exp2 is cheaper than its exp, as accurate).
- On CPU each row's exponentials are taken relative to its target token's logit, which the log-prob reads
  anyway: no pass over the row looks for its max. A row whose max is over 2^64 its target (probability
  under ~5e-20) is redone with its max. Accelerators shift by the max (one cheap kernel).
- On CPU in fp32 a chunk's logits are stored as (V, c) columns, W h^T (BLAS computes that orientation
  faster at a few hundred rows); the product subtracts the target logit as it writes (addmm).
- The softmax pass reads each block of logits once (8 rows at a time), and backward puts -g / total on
  the (c, H) side of its products instead of forming the (c, V) gradient.
- Large temporaries live in the caller's `Buffers` (reused storage instead of page-faulted new tensors).

Notation: M real completion tokens, c rows per chunk, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch

from grpo.kernels.buffers import Buffers
from grpo.kernels.packing import packed_completion_hidden
from grpo.kernels.prefix import shared_prompt_hidden
from grpo.kernels.unpadded import unpadded_shared_prompt_hidden
from grpo.algorithm.logprobs import (check_temperature, completion_hidden, default_chunk_size, logit_divisor,
                                     scatter_rows)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _column_storage(x: torch.Tensor) -> torch.Tensor | None:
    """x.T, (V, N), when the (N, V) tensor x is the transposed view of a contiguous (V, N) one (the layout of the CPU
    log-prob chunks and of the sampler's decode head); None otherwise."""
    return x.T if x.stride(-1) != 1 and x.T.is_contiguous() else None


def _columns_layout(h: torch.Tensor) -> bool:
    """Whether a chunk's logits are stored as (V, c) columns, W h^T, rather than (c, V) rows, h W^T: on CPU in fp32.
    There BLAS computes W h^T faster at a few hundred rows (docs/log.md) and the products that follow
    read either layout as fast. Code sees the (c, V) view."""
    return h.device.type == "cpu" and h.dtype == torch.float32


# Softmax statistics run in base 2: exp(x) = exp2(x log2(e)), and torch's vectorised exp2 costs less than its
# exp on CPU (as accurate: both within 1 ulp). The factor log2(e) goes on the (c, H) input of
# the projection, so the (c, V) logits come out in base 2 and no extra pass over them is needed.
_LOG2_E = 1.4426950408889634  # log2(e)
_LN_2 = 0.6931471805599453  # ln(2)


def _shifted_logits(buffers: Buffers, h2: torch.Tensor, w: torch.Tensor, shift2: torch.Tensor) -> torch.Tensor:
    """fp32 (rows, V) base-2 logits h2 @ w.T minus a per-row base-2 `shift2` (rows,), in a reused buffer.

    The product runs in h2's dtype (bf16 under autocast), the subtraction in fp32.
    """
    rows, vocab = h2.shape[0], w.shape[0]
    if _columns_layout(h2):
        return _project(buffers, h2, w, shift2)  # (rows, V) view of (V, rows)
    shifted = buffers.get("logits", rows, vocab, torch.float32, h2.device)
    if h2.dtype == torch.float32:
        return torch.matmul(h2, w.T, out=shifted).sub_(shift2[:, None])  # (rows, V)
    low = torch.matmul(h2, w.T, out=buffers.get("logits_low", rows, vocab, h2.dtype, h2.device))  # (rows, V)
    return torch.sub(low, shift2[:, None], out=shifted)  # promoted to fp32


def _project(buffers: Buffers, h: torch.Tensor, w: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, V) logits h @ w.T in h's dtype (bf16 under autocast), written into a reused buffer; on CPU in fp32 the
    transposed view of a (V, rows) buffer (`_columns_layout`). There `shift` (rows,), if given, is subtracted from
    each row by the product itself (addmm: BLAS adds the broadcast -shift as it writes, no pass of its own)."""
    if _columns_layout(h):
        out = buffers.get("columns", w.shape[0], h.shape[0], h.dtype, h.device)  # (V, rows)
        if shift is None:
            return torch.mm(w, h.T, out=out).T  # (rows, V)
        return torch.addmm(-shift[None, :], w, h.T, out=out).T  # (rows, V): logits - shift
    assert shift is None, "a shift in the product is for the columns layout"
    name = "logits" if h.dtype == torch.float32 else "logits_low"
    return torch.matmul(h, w.T, out=buffers.get(name, h.shape[0], w.shape[0], h.dtype, h.device))  # (rows, V)


# Rows per block in `_softmax_pass`: 8 rows of 151,936 fp32 values (4.9 MB) stay in a CPU's last-level cache.
_BLOCK_ROWS = 8

# On CPU a row's exponentials are taken relative to its target token's logit, not its maximum (`_chunk_forward`). A row
# whose total of 2^(y_j - shift) exceeds 2^64 V (its max is then more than 64 above its target in base 2: a target
# probability under 2^-64, about 5e-20) falls back to its maximum. Within the bound every term and the total are at most
# 2^64 V (2^81.2 at Qwen's vocabulary), the products that follow stay far inside the range of fp32 and bf16, and the
# gradient's factor g / total stays a normal number for any |g| above 2^-44.
_MAX_SHIFT_GAP = 64.0


def _softmax_pass(buffers: Buffers, logits: torch.Tensor, shift: torch.Tensor, with_entropy: bool, keep_exps: bool):
    """Row statistics of (rows, V) base-2 logits y = z log2(e), relative to a per-row base-2 `shift` (rows,),
    a block of rows at a time so each block is read from memory once.

    Returns (total, entropy or None), fp32 (rows,): total = sum_j 2^(y_j - shift), so lse = ln 2 (shift + log2 total),
    and entropy (nats) = ln 2 (log2 total - sum_j 2^(y_j - shift) (y_j - shift) / total); both hold for any shift.
    The usual shift is the row's max; `_chunk_forward` passes the target token's logit instead, which needs no pass
    over the row to find (the softmax is shift-invariant: only overflow limits the choice, see `_chunk_forward`).
    keep_exps: overwrite `logits` with 2^(y - shift) (in its own dtype), for the products that follow.
    The subtraction, the exp2 and the sums run in fp32 whatever the logits' dtype. shift None: the logits are
    already y - shift (the columns layout, whose product subtracts it; `_project`).
    """
    columns = _column_storage(logits)  # (V, c) or None
    if columns is not None:
        return _column_softmax_pass(buffers, columns, shift, with_entropy, keep_exps)
    if shift is None:  # a single row's (V, 1) column is also a row
        shift = logits.new_zeros(logits.shape[0], dtype=torch.float32)
    rows = logits.shape[0]
    block_rows = _BLOCK_ROWS if logits.device.type == "cpu" else rows  # accelerators: one pass, few kernels
    total = logits.new_empty(rows, dtype=torch.float32)
    entropy = logits.new_empty(rows, dtype=torch.float32) if with_entropy else None
    in_place = logits.dtype == torch.float32 and not with_entropy
    for start in range(0, rows, block_rows):
        block = logits[start : start + block_rows]  # (b, V)
        block_shift = shift[start : start + block_rows, None]  # (b, 1) fp32
        if in_place:  # fp32 without entropy: 2^(y - shift) written over y
            exps = block.sub_(block_shift).exp2_()
        else:
            shifted = buffers.get("shifted", block.shape[0], block.shape[1], torch.float32, block.device)
            shifted = torch.sub(block, block_shift, out=shifted)  # (b, V) fp32
            exps = torch.exp2(shifted, out=buffers.get("exps", *shifted.shape, torch.float32, block.device))
            if with_entropy:  # sum_j 2^(s_j) s_j, one dot product per row
                dot = torch.linalg.vecdot(exps, shifted)  # (b,)
            if keep_exps:
                block.copy_(exps)
        block_total = exps.sum(-1)  # (b,)
        total[start : start + block_rows] = block_total
        if with_entropy:
            entropy[start : start + block_rows] = (block_total.log2() - dot / block_total) * _LN_2
    return total, entropy


def _column_softmax_pass(buffers: Buffers, columns: torch.Tensor, shift: torch.Tensor, with_entropy: bool,
                         keep_exps: bool):
    """`_softmax_pass` for fp32 logits stored as (V, c) columns: blocks of vocabulary rows of about the size of 8
    logit rows (each read from memory once), every reduction over the vocabulary dimension. Same returns.
    shift None: the columns already hold y - shift."""
    vocab, rows = columns.shape
    block = max(1, _BLOCK_ROWS * vocab // rows)  # (block, c) ~ (8, V) values
    total = columns.new_zeros(rows)
    dot = columns.new_zeros(rows) if with_entropy else None
    for start in range(0, vocab, block):
        part = columns[start : start + block]  # (b, c)
        if not with_entropy:  # 2^(y - shift) written over y
            exps = (part if shift is None else part.sub_(shift)).exp2_()
        else:
            shifted = part if shift is None else torch.sub(
                part, shift, out=buffers.get("shifted", *part.shape, torch.float32, part.device))
            exps = torch.exp2(shifted, out=buffers.get("exps", *part.shape, torch.float32, part.device))
            dot += torch.linalg.vecdot(exps, shifted, dim=0)  # (c,) sum_j 2^(s_j) s_j
            if keep_exps:
                part.copy_(exps)
        total += exps.sum(0)
    entropy = (total.log2() - dot / total) * _LN_2 if with_entropy else None
    return total, entropy


def _chunk_inputs(hidden, rows, temperature, dtype):
    """A chunk's (c, H) inputs in the compute dtype: h = hidden / temperature (for the gradients) and
    h2 = hidden log2(e) / temperature, whose projection gives the base-2 logits. The (c, H) side is scaled,
    not the (c, V) logits; forward and the recompute in backward must scale alike, so both call this."""
    chunk = hidden[rows]
    return chunk.to(dtype) / temperature, (chunk.float() * (_LOG2_E / temperature)).to(dtype)


def _chunk_forward(buffers, hidden, w, targets, rows, temperature, dtype, with_entropy, keep_exps):
    """One chunk: (c, H) scaled inputs h, (c, V) base-2 logits (2^(y - shift) if keep_exps), and per row (c,) the
    log-probs, the base-2 shift, total = sum_j 2^(y_j - shift), the entropy (nats; None unless with_entropy) and
    which rows were redone (bool; None when the shift is the max). lse = ln 2 (shift + log2 total).

    On CPU the shift is each row's target logit y_t, which the log-prob reads anyway: logp = ln 2 (y_t - lse2) =
    -ln 2 log2(total), and no pass over the (memory-bound) row looks for its max. In fp32 (the columns layout) y_t
    is taken first as the dot product h2 . W[target] and the projection writes y - y_t directly, so no pass
    subtracts it either (the product's own y_t may differ from the dot product's by rounding: the log-prob reads
    the product's, logp = ln 2 ((y_t - shift) - log2 total), consistent with the total). As y_t <= max, no term
    underflows
    relative to the largest. A row whose total exceeds 2^_MAX_SHIFT_GAP V (its max is then more than _MAX_SHIFT_GAP
    above y_t: a target probability under ~5e-20) or is not finite is redone from its logits with its max as the
    shift. Accelerators shift by the row max (one cheap kernel; the redo test would cost a host sync per chunk).
    Every CPU pass uses the same shift, so the fused loss and the plain log-probs give identical log-probs (a
    token's clipping cannot differ between them). The entropy, ln 2 (log2 total - sum_j p_j (y_j - shift)), is a
    difference of two terms of size ~(max - shift): its fp32 error grows with that gap, ~1e-6 nats at a gap of 40.
    """
    h, h2 = _chunk_inputs(hidden, rows, temperature, dtype)
    chunk_targets = targets[rows]  # (c,)
    by_target = _shift_by_target(h2.device)
    if by_target and _columns_layout(h2):  # y_t = h2 . W[target] first, so the product itself subtracts it
        shift = (h2 * w[chunk_targets]).sum(-1)  # (c,) base 2
        logits = _project(buffers, h2, w, shift)  # (c, V) y - shift
        target_rel = logits.gather(-1, chunk_targets[:, None]).squeeze(-1)  # (c,) the product's y_t - shift, ~0
        total, entropy = _softmax_pass(buffers, logits, None, with_entropy, keep_exps)
    else:
        logits = _project(buffers, h2, w)  # (c, V) base 2
        target_logits = logits.gather(-1, chunk_targets[:, None]).squeeze(-1).float()  # (c,), before any overwrite
        shift = target_logits.clone() if by_target else logits.amax(-1).float()  # (c,) base 2
        target_rel = target_logits - shift  # (c,)
        total, entropy = _softmax_pass(buffers, logits, shift, with_entropy, keep_exps)
    # 2^gap * V bounds the total when max - shift <= gap: a larger total, inf or nan means the shift was too low
    # (nan also from non-finite logits, which the redo leaves non-finite: the trainer then skips the update).
    redo = ~(total <= 2.0 ** _MAX_SHIFT_GAP * logits.shape[-1]) if by_target else None
    if redo is not None and bool(redo.any()):
        index = redo.nonzero().squeeze(-1)  # (r,)
        fresh = _redo_logits(h2, w, index)  # (r, V) the rows' logits again (the buffer may hold exps)
        row_shift = fresh.amax(-1)  # (r,)
        target_rel[index] = fresh.gather(-1, chunk_targets[index, None]).squeeze(-1) - row_shift
        # fresh: exps if keep_exps
        row_total, row_entropy = _softmax_pass(buffers, fresh, row_shift, with_entropy, keep_exps)
        if keep_exps:
            logits[index] = fresh.to(logits.dtype)
        shift[index], total[index] = row_shift, row_total
        if with_entropy:
            entropy[index] = row_entropy
    chunk_logps = (target_rel - total.log2()) * _LN_2  # (c,) y_t - lse2 = ln 2 (y_t - shift - log2 total)
    return h, logits, chunk_logps, shift, total, entropy, redo


def _redo_logits(h2: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 (r, V) base-2 logits of the chunk rows `index`, for rows redone with their max. The backward of
    `_ChunkedTokenLogProbs` recomputes them with this same product, so its exponentials match the forward's total
    bit for bit (a product of another shape or layout may round differently)."""
    return torch.matmul(h2[index], w.T).float()


def _shift_by_target(device: torch.device) -> bool:
    """Whether `_chunk_forward` shifts a row's exponentials by its target logit (CPU) rather than its max."""
    return device.type == "cpu"


def _add_chunk_grads(probs, probs_w, minus_scale, g, h, w, targets, rows, temperature, grad_hidden, grad_weight,
                     first: bool) -> None:
    """A chunk's gradients from d logp / d z = onehot(target) - p, given -g p = minus_scale * probs.

    probs (c, V) in the compute dtype; probs_w = probs @ w (c, H), or None when grad_hidden is None;
    h (c, H) the temperature-scaled inputs; targets (c,). Writes grad_hidden[rows] and adds into the fp32
    grad_weight (V, H) (`first`: overwrite it instead, so it needs no zero fill):
        dh = (g W[target] - g p W) / temperature,   dW += (onehot(target) g - g p)^T h
    """
    if grad_hidden is not None:
        dh = probs_w * minus_scale + g.to(w.dtype)[:, None] * w[targets]  # (c, H)
        grad_hidden[rows] = (dh / temperature).to(grad_hidden.dtype)
    if grad_weight is not None:
        update = h * minus_scale  # (c, H)
        if probs.dtype == torch.float32 and first:
            torch.mm(probs.T, update, out=grad_weight)  # (V, H)
        elif probs.dtype == torch.float32:
            grad_weight.addmm_(probs.T, update)  # (V, H), accumulated in place
        elif first:
            grad_weight.copy_(probs.T @ update)
        else:
            grad_weight += (probs.T @ update).float()
        grad_weight.index_add_(0, targets, g[:, None] * h.float())


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """(M, H) hidden states, (V, H) weight, (M,) targets -> (M,) log-probs and (M,) entropies (no grad).

    With z = W h / temperature and p = softmax(z), per row:
        forward    logp = z[target] - lse(z),   entropy = lse(z) - sum_j p_j z_j
        backward   d logp / d z_j = [j == target] - p_j, so with the incoming gradient g:
                   dz = g * onehot(target) - g * p,  dh = dz W / temperature,  dW = dz^T h / temperature
    Backward recomputes the forward's e = exp(z - shift) (its shift and total are saved; p = e / total) and puts
    -g / total on the (c, H) side of the products, as `_FusedTokenLoss` does: one exp2 pass per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool,
                buffers: Buffers):
        dtype = _compute_dtype(weight)
        num_rows = hidden.shape[0]
        logps, shift, total = (hidden.new_empty(num_rows, dtype=torch.float32) for _ in range(3))  # (M,) each
        entropy = hidden.new_empty(num_rows, dtype=torch.float32) if with_entropy else None
        redone = hidden.new_zeros(num_rows, dtype=torch.bool)  # (M,) rows shifted by their max (see _chunk_forward)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, num_rows, chunk_size):
                rows = slice(start, start + chunk_size)
                _, _, logps[rows], shift[rows], total[rows], chunk_entropy, chunk_redone = _chunk_forward(
                    buffers, hidden, w, targets, rows, temperature, dtype, with_entropy, keep_exps=False)
                if with_entropy:
                    entropy[rows] = chunk_entropy
                if chunk_redone is not None:
                    redone[rows] = chunk_redone
        ctx.save_for_backward(hidden, weight, targets, shift, total, redone)
        ctx.temperature, ctx.chunk_size, ctx.dtype, ctx.buffers = temperature, chunk_size, dtype, buffers
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, shift, total, redone = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32,
                                  device=weight.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h, h2 = _chunk_inputs(hidden, rows, temperature, dtype)  # (chunk, H) each
                g = grad_logps[rows].float()  # (chunk,)
                # (chunk, V) fp32: the forward's exp(z - shift)
                exps = _shifted_logits(ctx.buffers, h2, w, shift[rows]).exp2_()
                index = redone[rows].nonzero().squeeze(-1) if _shift_by_target(redone.device) else None  # (r,)
                if index is not None and index.numel():  # recomputed as the forward did
                    exps[index] = torch.exp2(_redo_logits(h2, w, index) - shift[rows][index, None])
                minus_scale = (-g / total[rows]).to(dtype)[:, None]  # (chunk, 1): -g p = minus_scale * exps
                if dtype != torch.float32:
                    exps = ctx.buffers.get("logits_low", *exps.shape, dtype, h.device).copy_(exps)
                exps_w = exps @ w if grad_hidden is not None else None  # (chunk, H)
                _add_chunk_grads(exps, exps_w, minus_scale, g, h, w, targets[rows], rows, temperature,
                                 grad_hidden, grad_weight, first=False)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def choose_trunk_pass(packed: bool = False, shared_prompts: bool = False, unpadded: bool = False):
    """The log-prob kernels' trunk pass: padded rows (grpo.algorithm.logprobs.completion_hidden), packed rows
    (grpo.kernels.packing) or each distinct prompt once (grpo.kernels.prefix), with unpadded its per-token work on
    the real tokens only (grpo.kernels.unpadded)."""
    if packed and shared_prompts:
        raise ValueError("a packed trunk pass and shared prompts are two different trunk passes: choose one")
    if unpadded and not shared_prompts:
        raise ValueError("the unpadded trunk pass is the shared-prompt pass on real tokens: it needs shared_prompts")
    if unpadded:
        return unpadded_shared_prompt_hidden
    return packed_completion_hidden if packed else shared_prompt_hidden if shared_prompts else completion_hidden


def completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0,
                        with_entropy: bool = False, chunk_size: int | None = None, buffers: Buffers | None = None,
                        packed: bool = False, shared_prompts: bool = False, unpadded: bool = False):
    """Same inputs and result as `grpo.algorithm.logprobs.completion_logprobs`; `buffers` holds the reused chunk
    storage.
    packed: the trunk runs on the real tokens packed into one row (grpo.kernels.packing). shared_prompts: each
    distinct prompt's trunk pass runs once (grpo.kernels.prefix); unpadded: on its real tokens only
    (grpo.kernels.unpadded)."""
    check_temperature(temperature)
    trunk_pass = choose_trunk_pass(packed, shared_prompts, unpadded)
    hidden, targets, keep, weight = trunk_pass(model, input_ids, attention_mask, completion_mask)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    token_logps, token_entropy = _ChunkedTokenLogProbs.apply(  # (M,), (M,): the logits divided as the plain path's
        hidden, weight, targets, float(logit_divisor(temperature)), chunk_size, with_entropy, buffers or Buffers())
    return scatter_rows(keep, token_logps), scatter_rows(keep, token_entropy)
