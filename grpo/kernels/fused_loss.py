"""Same result as `grpo.algorithm.logprobs.completion_logprobs` followed by `grpo.algorithm.loss.per_token_loss` and
`grpo.algorithm.loss.aggregate_loss`, faster because the loss gradient is formed during the log-prob pass.

When each token's loss depends on its own log-prob only (token-level ratios: every grpo / bnpo /
dr_grpo / dapo variant), d loss / d logp_t is known as soon as a chunk's log-probs are, so the chunk's
gradients are formed while its exp(z - shift) is still in memory:
    three vocabulary-sized products per chunk (logits, dh, dW) instead of four (the plain path
    recomputes the logits in backward), one exp pass instead of two, and the entropy from a (c, H)
    product instead of another pass over (c, V).
With a tied embedding (Qwen2.5), the head's and the embedding's gradients are summed in one reused
buffer (`_TiedGradient`) instead of autograd adding two vocabulary-sized gradients into a third.
Liger-Kernel's fused linear losses use the same order of work.

Chosen by `--kernels auto` for token-level ratios (grpo.kernels.select); sequence-level ratios (GSPO)
couple a completion's tokens, so they take the plain path. Pinned to the plain path by
tests/test_kernels.py (loss, log-probs, entropies and every gradient at rtol 1e-5 in fp32) and
tests/test_logprobs.py (tied embeddings, bf16 autocast, empty masks).

Notation: N rows, T completion tokens, M real completion tokens, c rows per chunk, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from grpo.kernels.buffers import Buffers
from grpo.kernels.logprobs import _LN_2, _add_chunk_grads, _chunk_forward, _compute_dtype, choose_trunk_pass
from grpo.algorithm.logprobs import check_temperature, default_chunk_size, logit_divisor, scatter_rows
from grpo.algorithm.loss import LossOptions, token_loss


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

    def __init__(self, weight: torch.Tensor, buffers: Buffers):
        self.buffer, self.buffers = buffers.take_grad(weight), buffers
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
        tied.buffers.give_back_grad(buffer)
        return buffer.to(ctx.weight_dtype), None, None, None


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
                tied: _TiedGradient | None, buffers: Buffers):
        dtype = _compute_dtype(weight)
        num_rows = hidden.shape[0]
        logps = hidden.new_empty(num_rows, dtype=torch.float32)  # (M,)
        entropy = hidden.new_empty(num_rows, dtype=torch.float32) if with_entropy else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (M, H)
        grad_weight = None  # (V, H) fp32, the first chunk writes it; none when the head is frozen (LoRA)
        if tied is not None:
            grad_weight = tied.buffer
        elif ctx.needs_input_grad[1]:
            grad_weight = buffers.take_grad(weight)
        loss = hidden.new_zeros((), dtype=torch.float32)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, num_rows, chunk_size):
                rows = slice(start, start + chunk_size)
                h, exps, chunk_logps, shift, total, _, _ = _chunk_forward(
                    # exps (c, V)
                    buffers, hidden, w, targets, rows, temperature, dtype, with_entropy=False, keep_exps=True)
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
        if num_rows == 0 and grad_weight is not None:
            grad_weight.zero_()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.tied, ctx.weight_dtype, ctx.buffers = tied, weight.dtype, buffers
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
            if grad_weight is not None:
                grad_weight.mul_(grad_loss)
        if ctx.tied is not None:  # the embedding's backward adds its rows and returns the sum
            ctx.tied.head_done = True
            return grad_hidden, None, None, None, None, None, None, None, None
        if grad_weight is None:  # a frozen head
            return grad_hidden, None, None, None, None, None, None, None, None
        ctx.buffers.give_back_grad(grad_weight)
        return grad_hidden, grad_weight.to(ctx.weight_dtype), None, None, None, None, None, None, None


def completion_token_loss(model, input_ids, attention_mask, completion_mask, loss_fn, temperature: float = 1.0,
                          with_entropy: bool = False, chunk_size: int | None = None, buffers: Buffers | None = None,
                          packed: bool = False, shared_prompts: bool = False, unpadded: bool = False):
    """loss = sum over real completion tokens of loss_fn(logp, index): the log-probs and the loss in one pass.

    `loss_fn(logps (c,), index)` gets a chunk of log-probs (with grad) and `index`, the slice of those tokens
    in row-major order of the real tokens (`completion_mask.bool()`), and returns that chunk's scalar loss.
    Gradients are formed chunk by chunk in the forward pass (`_FusedTokenLoss`); `loss.backward()` sends them
    into the trunk and the output projection. Returns (loss scalar, logps (N, T) detached, entropy (N, T) or
    None); the other inputs as `grpo.algorithm.logprobs.completion_logprobs`; packed, shared_prompts, unpadded: the
    trunk pass
    (grpo.kernels.logprobs.choose_trunk_pass).
    """
    check_temperature(temperature)
    buffers = buffers or Buffers()
    embedding = _plain_tied_embedding(model) if torch.is_grad_enabled() else None
    tied = None if embedding is None or not embedding.weight.requires_grad else _TiedGradient(embedding.weight, buffers)
    embeds = None
    if tied is not None:  # the trunk gets embeddings whose backward completes the tied matrix's gradient
        embeds = _TiedEmbedding.apply(embedding.weight, input_ids, embedding.padding_idx, tied)
    trunk_pass = choose_trunk_pass(packed, shared_prompts, unpadded)
    hidden, targets, keep, weight = trunk_pass(model, input_ids, attention_mask, completion_mask, embeds)
    loss, token_logps, token_entropy = _FusedTokenLoss.apply(  # the logits divided as the plain path's
        hidden, weight, targets, float(logit_divisor(temperature)), chunk_size or default_chunk_size(weight.shape[0]),
        with_entropy, loss_fn, tied, buffers)
    return loss, scatter_rows(keep, token_logps), scatter_rows(keep, token_entropy)


def fused_completion_loss(model, input_ids, attention_mask, completion_mask, advantages, old_logps, ref_logps,
                          weights, options: LossOptions, temperature: float = 1.0, chunk_size: int | None = None,
                          is_weights: torch.Tensor | None = None,
                          buffers: Buffers | None = None, packed: bool = False, shared_prompts: bool = False,
                          unpadded: bool = False):
    """The micro-batch loss sum(weights * per_token_loss(logps, ...)) for token-level ratios, in one pass.

    weights (n, T): `grpo.algorithm.loss.aggregation_weights(mask, loss_type, ...)`, so the loss equals
    `aggregate_loss(per_token_loss(...))`; advantages (n,); old_logps (n, T) or None (on-policy: logps
    detached); ref_logps (n, T) or None; is_weights (n, T) or (n, 1) the behaviour weights
    (grpo.algorithm.off_policy) or None. Returns (loss, logps (n, T) detached, entropy (n, T)).
    """
    if options.importance_sampling_level != "token":
        raise ValueError("the fused loss needs token-level ratios; sequence-level ratios take the plain path")
    keep = completion_mask.bool()  # (n, T): the fused pass sees the real tokens only, in this order
    token_weights = weights[keep]  # (M,)
    token_advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).expand(keep.shape)[keep]  # (M,)
    old = None if old_logps is None else old_logps[keep]  # (M,)
    ref = None if ref_logps is None else ref_logps[keep]  # (M,)
    behaviour = None if is_weights is None else is_weights.expand(keep.shape)[keep]  # (M,)

    def chunk_loss(logps, index):  # (c,) log-probs of the tokens `index` -> their share of the loss
        chunk_old = logps.detach() if old is None else old[index]  # on-policy: rho = 1
        chunk_ref = None if ref is None else ref[index]
        chunk_w = None if behaviour is None else behaviour[index]
        return (token_loss(logps, chunk_old, token_advantages[index], chunk_ref, options, chunk_w)
                * token_weights[index]).sum()

    return completion_token_loss(model, input_ids, attention_mask, completion_mask, chunk_loss, temperature,
                                 with_entropy=True, chunk_size=chunk_size, buffers=buffers, packed=packed,
                                 shared_prompts=shared_prompts, unpadded=unpadded)
