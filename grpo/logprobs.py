"""Per-token log-probabilities of completion tokens, without materialising (N, T, V) logits.

    log pi(o_t | q, o_<t) = z_t[o_t] - logsumexp(z_t),   z_t = W h_t / temperature

Notation: N completions (rows), P prompt length (left-padded), T completion length (right-padded),
H hidden size, V vocabulary, M = number of real completion tokens (mask == 1).

The transformer trunk runs once over the full sequences; only the hidden states that predict a real
completion token (M of the N*T positions) go through the output projection W (V, H), in chunks of
rows. `_ChunkedTokenLogProbs` keeps only the (M, H) hidden states for backward and recomputes each
chunk's logits there, so peak memory holds one (chunk, V) block instead of (N, T, V) logits and
their softmax (trl 1.16's fused LM head does the same with tiles; older trl built the full logits).

Training uses `completion_token_loss` when each token's loss depends on its own log-prob only
(token-level ratios): `_FusedTokenLoss` evaluates the loss per chunk and forms the gradient there,
while the chunk's exp(z - z[target]) is still in memory, so no logits are recomputed (three
vocabulary-sized products per chunk instead of four). With a tied embedding matrix, the head's and
the embedding's gradients are summed in one reused buffer (`_TiedGradient`).

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
    """A (rows, cols) tensor; on CPU a view of one reused storage per (name, dtype), grown when too small."""
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=dtype, device=device)
    key, size = (name, dtype), rows * cols
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < size:  # a normal tensor even when first asked for in inference mode
        with torch.inference_mode(False):  # (the CPU sampler runs in it), so it stays writable outside it
            buffer = _BUFFERS[key] = torch.empty(size, dtype=dtype, device=device)
    return buffer[:size].view(rows, cols)


def _column_storage(x: torch.Tensor) -> torch.Tensor | None:
    """x.T, (V, N), when the (N, V) tensor x is the transposed view of a contiguous (V, N) one (the layout of the CPU
    log-prob chunks and of the sampler's decode head); None otherwise."""
    return x.T if x.stride(-1) != 1 and x.T.is_contiguous() else None


def _columns_layout(h: torch.Tensor) -> bool:
    """Whether a chunk's logits are stored as (V, c) columns, W h^T, rather than (c, V) rows, h W^T: on CPU in fp32.
    There BLAS computes W h^T faster (0.35 against 0.43 ms a row of 151,936 x 128 at 192 and 220 rows on the
    benchmark machine) and the products that follow read either layout as fast. Code sees the (c, V) view."""
    return h.device.type == "cpu" and h.dtype == torch.float32


# Softmax statistics run in base 2: exp(x) = exp2(x log2(e)), and torch's vectorised exp2 costs ~60% of its
# exp on the benchmark CPU (as accurate: both within 1 ulp). The factor log2(e) goes on the (c, H) input of
# the projection, so the (c, V) logits come out in base 2 and no extra pass over them is needed.
_LOG2_E = 1.4426950408889634  # log2(e)
_LN_2 = 0.6931471805599453  # ln(2)


def _shifted_logits(h2: torch.Tensor, w: torch.Tensor, shift2: torch.Tensor) -> torch.Tensor:
    """fp32 (rows, V) base-2 logits h2 @ w.T minus a per-row base-2 `shift2` (rows,), in a reused buffer.

    The product runs in h2's dtype (bf16 under autocast), the subtraction in fp32.
    """
    rows, vocab = h2.shape[0], w.shape[0]
    if _columns_layout(h2):
        return _project(h2, w, shift2)  # (rows, V) view of (V, rows)
    shifted = _buffer("logits", rows, vocab, torch.float32, h2.device)
    if h2.dtype == torch.float32:
        return torch.matmul(h2, w.T, out=shifted).sub_(shift2[:, None])  # (rows, V)
    low = torch.matmul(h2, w.T, out=_buffer("logits_low", rows, vocab, h2.dtype, h2.device))  # (rows, V)
    return torch.sub(low, shift2[:, None], out=shifted)  # promoted to fp32


# CPU: reused fp32 (V, H) weight-gradient buffers, taken by a forward and handed back by its backward
# (two pending forwards never share one). Measured on the 2-core benchmark machine: writing a freshly
# allocated 78 MB gradient (Qwen vocabulary x 128) inside a training step took ~150 ms more than
# writing a reused one. The trainer keeps .grad allocated (zero_grad(set_to_none=False)), so autograd
# adds these into .grad in place instead of copying them.
_GRAD_BUFFERS: dict[tuple, torch.Tensor] = {}


def _take_grad_buffer(weight: torch.Tensor) -> torch.Tensor:
    buffer = _GRAD_BUFFERS.pop((tuple(weight.shape), weight.device), None) if weight.device.type == "cpu" else None
    return torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if buffer is None else buffer


def _give_back_grad_buffer(buffer: torch.Tensor) -> None:
    if buffer.device.type == "cpu":
        _GRAD_BUFFERS[(tuple(buffer.shape), buffer.device)] = buffer


def _project(h: torch.Tensor, w: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, V) logits h @ w.T in h's dtype (bf16 under autocast), written into a reused buffer; on CPU in fp32 the
    transposed view of a (V, rows) buffer (`_columns_layout`). There `shift` (rows,), if given, is subtracted from
    each row by the product itself (addmm: BLAS adds the broadcast -shift as it writes, no pass of its own)."""
    if _columns_layout(h):
        out = _buffer("columns", w.shape[0], h.shape[0], h.dtype, h.device)  # (V, rows)
        if shift is None:
            return torch.mm(w, h.T, out=out).T  # (rows, V)
        return torch.addmm(-shift[None, :], w, h.T, out=out).T  # (rows, V): logits - shift
    assert shift is None, "a shift in the product is for the columns layout"
    name = "logits" if h.dtype == torch.float32 else "logits_low"
    return torch.matmul(h, w.T, out=_buffer(name, h.shape[0], w.shape[0], h.dtype, h.device))  # (rows, V)


# Rows per block in `_softmax_pass`: 8 rows of 151,936 fp32 values (4.9 MB) stay in a CPU's last-level cache.
_BLOCK_ROWS = 8

# On CPU a row's exponentials are taken relative to its target token's logit, not its maximum (`_chunk_forward`). A row
# whose total of 2^(y_j - shift) exceeds 2^64 V (its max is then more than 64 above its target in base 2: a target
# probability under 2^-64, about 5e-20) falls back to its maximum. Within the bound every term and the total are at most
# 2^64 V (2^81.2 at Qwen's vocabulary), the products that follow stay far inside the range of fp32 and bf16, and the
# gradient's factor g / total stays a normal number for any |g| above 2^-44.
_MAX_SHIFT_GAP = 64.0


def _softmax_pass(logits: torch.Tensor, shift: torch.Tensor, with_entropy: bool, keep_exps: bool):
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
        return _column_softmax_pass(columns, shift, with_entropy, keep_exps)
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
            shifted = _buffer("shifted", block.shape[0], block.shape[1], torch.float32, block.device)
            shifted = torch.sub(block, block_shift, out=shifted)  # (b, V) fp32
            exps = torch.exp2(shifted, out=_buffer("exps", *shifted.shape, torch.float32, block.device))
            if with_entropy:  # sum_j 2^(s_j) s_j, one dot product per row
                dot = torch.linalg.vecdot(exps, shifted)  # (b,)
            if keep_exps:
                block.copy_(exps)
        block_total = exps.sum(-1)  # (b,)
        total[start : start + block_rows] = block_total
        if with_entropy:
            entropy[start : start + block_rows] = (block_total.log2() - dot / block_total) * _LN_2
    return total, entropy


def _column_softmax_pass(columns: torch.Tensor, shift: torch.Tensor, with_entropy: bool, keep_exps: bool):
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
                part, shift, out=_buffer("shifted", *part.shape, torch.float32, part.device))
            exps = torch.exp2(shifted, out=_buffer("exps", *part.shape, torch.float32, part.device))
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


def _chunk_forward(hidden, w, targets, rows, temperature, dtype, with_entropy, keep_exps):
    """One chunk: (c, H) scaled inputs h, (c, V) base-2 logits (2^(y - shift) if keep_exps), and per row (c,) the
    log-probs, the base-2 shift, total = sum_j 2^(y_j - shift), the entropy (nats; None unless with_entropy) and
    which rows were redone (bool; None when the shift is the max). lse = ln 2 (shift + log2 total).

    On CPU the shift is each row's target logit y_t, which the log-prob reads anyway: logp = ln 2 (y_t - lse2) =
    -ln 2 log2(total), and no pass over the (memory-bound) row looks for its max. In fp32 (the columns layout) y_t
    is taken first as the dot product h2 . W[target] and the projection writes y - y_t directly, so no pass
    subtracts it either (the product's own y_t may differ from the dot product's by rounding: the log-prob reads
    the product's, logp = ln 2 ((y_t - shift) - log2 total), consistent with the total). As y_t <= max, no term underflows
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
        logits = _project(h2, w, shift)  # (c, V) y - shift
        target_rel = logits.gather(-1, chunk_targets[:, None]).squeeze(-1)  # (c,) the product's y_t - shift, ~0
        total, entropy = _softmax_pass(logits, None, with_entropy, keep_exps)
    else:
        logits = _project(h2, w)  # (c, V) base 2
        target_logits = logits.gather(-1, chunk_targets[:, None]).squeeze(-1).float()  # (c,), before any overwrite
        shift = target_logits.clone() if by_target else logits.amax(-1).float()  # (c,) base 2
        target_rel = target_logits - shift  # (c,)
        total, entropy = _softmax_pass(logits, shift, with_entropy, keep_exps)
    # 2^gap * V bounds the total when max - shift <= gap: a larger total, inf or nan means the shift was too low
    # (nan also from non-finite logits, which the redo leaves non-finite: the trainer then skips the update).
    redo = ~(total <= 2.0 ** _MAX_SHIFT_GAP * logits.shape[-1]) if by_target else None
    if redo is not None and bool(redo.any()):
        index = redo.nonzero().squeeze(-1)  # (r,)
        fresh = _redo_logits(h2, w, index)  # (r, V) the rows' logits again (the buffer may hold exps)
        row_shift = fresh.amax(-1)  # (r,)
        target_rel[index] = fresh.gather(-1, chunk_targets[index, None]).squeeze(-1) - row_shift
        row_total, row_entropy = _softmax_pass(fresh, row_shift, with_entropy, keep_exps)  # fresh: exps if keep_exps
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
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool):
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
                    hidden, w, targets, rows, temperature, dtype, with_entropy, keep_exps=False)
                if with_entropy:
                    entropy[rows] = chunk_entropy
                if chunk_redone is not None:
                    redone[rows] = chunk_redone
        ctx.save_for_backward(hidden, weight, targets, shift, total, redone)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, shift, total, redone = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h, h2 = _chunk_inputs(hidden, rows, temperature, dtype)  # (chunk, H) each
                g = grad_logps[rows].float()  # (chunk,)
                exps = _shifted_logits(h2, w, shift[rows]).exp2_()  # (chunk, V) fp32: the forward's exp(z - shift)
                index = redone[rows].nonzero().squeeze(-1) if _shift_by_target(redone.device) else None  # (r,)
                if index is not None and index.numel():  # recomputed as the forward did
                    exps[index] = torch.exp2(_redo_logits(h2, w, index) - shift[rows][index, None])
                minus_scale = (-g / total[rows]).to(dtype)[:, None]  # (chunk, 1): -g p = minus_scale * exps
                if dtype != torch.float32:
                    exps = _buffer("logits_low", *exps.shape, dtype, h.device).copy_(exps)
                exps_w = exps @ w if grad_hidden is not None else None  # (chunk, H)
                _add_chunk_grads(exps, exps_w, minus_scale, g, h, w, targets[rows], rows, temperature,
                                 grad_hidden, grad_weight, first=False)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _FusedTokenLoss(torch.autograd.Function):
    """loss = sum_t f(logp_t, t) over (M,) tokens, with its gradients computed in the forward pass.

    When the loss of each token depends on that token's log-prob alone (token-level ratios: every
    GRPO/DAPO/Dr. GRPO variant), d loss / d logp_t = f'(logp_t) is known as soon as a chunk's
    log-probs are, so the chunk's gradients can be formed while its e = exp(z - z[target]) is still in memory:
        g   = f'(logp)                       (c,)   autograd on the small per-token function
        g p = (g / total) * e                (c, V) never formed: the scale goes on the (c, H) side
        dh  = (g W[target] - (g / total) * (e @ W)) / temperature
        dW  = (onehot(target) g - e (g / total))^T h / temperature,   total = sum_j e_j
    Three products per chunk (logits, dh, dW) instead of four (the recompute in backward), and one
    exp pass instead of two. Backward only scales the stored (M, H) and (V, H) gradients by the
    incoming scalar gradient. Liger-Kernel's fused linear losses use the same order of work.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool, loss_fn,
                tied: _TiedGradient | None):
        dtype = _compute_dtype(weight)
        num_rows = hidden.shape[0]
        logps = hidden.new_empty(num_rows, dtype=torch.float32)  # (M,)
        entropy = hidden.new_empty(num_rows, dtype=torch.float32) if with_entropy else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (M, H)
        grad_weight = tied.buffer if tied is not None else _take_grad_buffer(weight)  # (V, H) fp32, first chunk writes it
        loss = hidden.new_zeros((), dtype=torch.float32)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, num_rows, chunk_size):
                rows = slice(start, start + chunk_size)
                h, exps, chunk_logps, shift, total, _, _ = _chunk_forward(
                    hidden, w, targets, rows, temperature, dtype, with_entropy=False, keep_exps=True)  # exps (c, V)
                logps[rows] = chunk_logps
                probe = chunk_logps.detach().requires_grad_()
                with torch.enable_grad():
                    chunk_loss = loss_fn(probe, rows)  # scalar
                g = None
                if chunk_loss.requires_grad:
                    (g,) = torch.autograd.grad(chunk_loss, probe, allow_unused=True)  # (c,) d loss / d logp
                g = torch.zeros_like(chunk_logps) if g is None else g  # a loss that ignores these log-probs
                loss += chunk_loss.detach()
                minus_scale = (-g / total).to(dtype)[:, None]  # (c, 1): -g p = minus_scale * exps
                if grad_hidden is not None or with_entropy:
                    exps_w = exps @ w  # (c, H) = total * sum_j p_j W_j
                if with_entropy:  # sum_j p_j z_j = (sum_j p_j W_j) . h: entropy without another pass over (c, V)
                    lse = (shift + total.log2()) * _LN_2  # (c,) nats
                    entropy[rows] = lse - (exps_w.float() * h.float()).sum(-1) / total
                _add_chunk_grads(exps, exps_w if grad_hidden is not None else None, minus_scale, g, h, w,
                                 targets[rows], rows, temperature, grad_hidden, grad_weight, first=start == 0)
        if num_rows == 0:
            grad_weight.zero_()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.tied, ctx.weight_dtype = tied, weight.dtype
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(logps)
        return loss, logps, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_logps, grad_entropy):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Scaled in place: these are this call's own tensors (a fresh (V, H) copy is slow on CPU). loss.backward()
        # sends 1, which needs no pass over the (V, H) gradient (read on CPU only: elsewhere .item() waits).
        if grad_loss.device.type != "cpu" or grad_loss.item() != 1.0:
            if grad_hidden is not None:
                grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
            grad_weight.mul_(grad_loss)
        if ctx.tied is not None:  # the embedding's backward adds its rows and returns the sum
            ctx.tied.head_done = True
            return grad_hidden, None, None, None, None, None, None, None
        _give_back_grad_buffer(grad_weight)
        return grad_hidden, grad_weight.to(ctx.weight_dtype), None, None, None, None, None, None


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


def _plain_tied_embedding(model) -> torch.nn.Embedding | None:
    """The input embedding when it is a plain `nn.Embedding` sharing its matrix with the output head."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (type(embedding) is not torch.nn.Embedding or head is None or embedding.weight is not head.weight
            or embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse):
        return None
    return embedding


class _TiedGradient:
    """One (V, H) buffer in which the output head's and the input embedding's gradients are summed.

    Without it, autograd gets two vocabulary-sized gradients for the shared matrix (the head's, and
    the embedding's mostly-zero one) and adds them into a third tensor, every micro-batch.
    `_FusedTokenLoss` writes the head's gradient here and returns none for the weight;
    `_TiedEmbedding` adds the embedding rows and returns the sum, the weight's whole gradient.
    """

    def __init__(self, weight: torch.Tensor):
        self.buffer = _take_grad_buffer(weight)
        self.head_done = False


class _TiedEmbedding(torch.autograd.Function):
    """F.embedding(ids, weight) whose backward returns the tied matrix's whole gradient (see _TiedGradient)."""

    @staticmethod
    def forward(ctx, weight, input_ids, padding_idx, tied: _TiedGradient):
        ctx.save_for_backward(input_ids)
        ctx.padding_idx, ctx.tied, ctx.weight_dtype = padding_idx, tied, weight.dtype
        return torch.nn.functional.embedding(input_ids, weight, padding_idx)  # (N, L, H)

    @staticmethod
    def backward(ctx, grad_embeds):
        (input_ids,) = ctx.saved_tensors
        tied, buffer = ctx.tied, ctx.tied.buffer
        if not tied.head_done:  # the head's backward did not run (its loss was not used): embedding rows only
            buffer.zero_()
        ids, rows = input_ids.reshape(-1), grad_embeds.reshape(-1, grad_embeds.shape[-1])  # (N*L,), (N*L, H)
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        buffer.index_add_(0, ids, rows.to(buffer.dtype))
        _give_back_grad_buffer(buffer)
        return buffer.to(ctx.weight_dtype), None, None, None


def _default_chunk_size(vocab: int) -> int:
    """Rows of logits per chunk: as many as fit in 2^25 values (128 MiB in fp32), rounded down to a multiple of 64
    when that leaves 64 or more (BLAS's speed jumps with the row count: on the benchmark CPU W h^T runs at 0.35 ms
    a row at 192 rows and 0.48 at 220), and at least 16."""
    rows = (1 << 25) // vocab
    return max(16, rows // 64 * 64 if rows >= 64 else rows)


def _completion_hidden(model, input_ids, attention_mask, completion_mask, temperature, chunk_size, tied=None):
    """Trunk once over the sequences; the (M, H) hidden states that predict real completion tokens.

    Returns (hidden (M, H), targets (M,), keep (N, T) bool, output weight (V, H), chunk_size).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    total_len = input_ids.shape[1]
    completion_len = completion_mask.shape[1]
    assert attention_mask.shape == input_ids.shape and completion_len < total_len, (input_ids.shape, completion_mask.shape)
    check_plain_output_head(model.config)  # checked before the trunk runs, not after
    lm_head = model.get_output_embeddings()
    if getattr(lm_head, "bias", None) is not None:
        raise NotImplementedError("output projections with a bias are not supported")
    chunk_size = chunk_size or _default_chunk_size(lm_head.weight.shape[0])
    trunk = getattr(model, model.base_model_prefix)
    inputs = {"input_ids": input_ids}
    if tied is not None:  # the trunk gets embeddings whose backward completes the tied matrix's gradient
        embedding = model.get_input_embeddings()
        inputs = {"inputs_embeds": _TiedEmbedding.apply(embedding.weight, input_ids, embedding.padding_idx, tied)}
    hidden = trunk(
        **inputs,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state  # (N, P+T, H)
    # Position t-1 predicts token t: the T hidden states before each completion token.
    hidden = hidden[:, total_len - completion_len - 1 : total_len - 1]  # (N, T, H)
    keep = completion_mask.bool()  # (N, T)
    targets = input_ids[:, total_len - completion_len :][keep]  # (M,)
    return hidden[keep], targets, keep, lm_head.weight, chunk_size


def _scatter_rows(keep: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
    """(M,) values of the real tokens -> (N, T), 0 elsewhere."""
    if values is None:
        return None
    return values.new_zeros(keep.shape).masked_scatter(keep, values)


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
    (128 MiB), rounded down to a multiple of 64 (192 rows at Qwen's 151,936 vocabulary).
    """
    hidden, targets, keep, weight, chunk_size = _completion_hidden(
        model, input_ids, attention_mask, completion_mask, temperature, chunk_size)
    token_logps, token_entropy = _ChunkedTokenLogProbs.apply(
        hidden, weight, targets, float(temperature), chunk_size, with_entropy
    )  # (M,), (M,)
    return _scatter_rows(keep, token_logps), _scatter_rows(keep, token_entropy)


def completion_token_loss(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_fn,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """loss = sum over real completion tokens of loss_fn(logp, index), the log-prob and loss in one pass.

    For losses in which each token's term depends on its own log-prob only (token-level ratios):
    `loss_fn(logps (c,), index)` gets a chunk of log-probs (with grad) and `index`, the slice of
    those tokens in row-major order of the real tokens (`completion_mask.bool()`), and returns that
    chunk's scalar loss. Gradients are formed chunk by chunk in the forward pass (see
    `_FusedTokenLoss`); `loss.backward()` sends them into the trunk and the output projection.
    Returns (loss scalar, logps (N, T) detached, entropy (N, T) or None); same inputs as
    `completion_logprobs`.
    """
    embedding = _plain_tied_embedding(model) if torch.is_grad_enabled() else None
    tied = None if embedding is None or not embedding.weight.requires_grad else _TiedGradient(embedding.weight)
    hidden, targets, keep, weight, chunk_size = _completion_hidden(
        model, input_ids, attention_mask, completion_mask, temperature, chunk_size, tied)
    loss, token_logps, token_entropy = _FusedTokenLoss.apply(
        hidden, weight, targets, float(temperature), chunk_size, with_entropy, loss_fn, tied
    )
    return loss, _scatter_rows(keep, token_logps), _scatter_rows(keep, token_entropy)


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
