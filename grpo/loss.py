"""The clipped GRPO policy loss with a KL penalty, and its aggregation over tokens.

Per token (DeepSeekMath arXiv 2402.03300 eq. 3; PPO's clipped surrogate, arXiv 1707.06347):

    rho_t   = exp(logp_t - logp_old_t)                        importance ratio ("token" level)
    rho_i   = exp(mean_t (logp_t - logp_old_t))               one ratio per completion ("sequence", GSPO arXiv 2507.18071)
    l_t     = -min(rho * A, clip(rho, 1 - eps, 1 + eps_high) * A) + beta * kl_t
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      k3 estimator (Schulman, "Approximating KL divergence")
              (* rho when kl_bias_correction, trl 1.16's default `use_bias_correction_kl`)

eps_high > eps is DAPO's clip-higher (arXiv 2503.14476); `delta` caps rho from above after the
clipped copy is taken (two-sided clipping, as trl).

Aggregation (`loss_type`) of one micro-batch, so that summing the micro-batches of one optimizer
step gives the step's loss (see `aggregate_loss`):
    grpo     mean over rows of (sum_t l m / sum_t m), / num_micro_batches
    bnpo     sum l m / sum m over the micro-batch,     / num_micro_batches
    dr_grpo  sum l m / (rows * max_completion_length), / num_micro_batches   (Dr. GRPO arXiv 2503.20783)
    dapo     sum l m / (completion tokens of the whole step)                 (DAPO arXiv 2503.14476)

Notation: n rows in the micro-batch, T completion tokens; m the completion mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class LossStats:
    """Detached statistics of one micro-batch, as trl logs them (means over real completion tokens)."""

    kl: float | None
    clip_low: float
    clip_high: float
    clip_region: float
    entropy: float | None = None


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0, 0 when equal."""
    delta = ref_logps - logps  # (n, T)
    return torch.exp(delta) - delta - 1


def log_importance_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log rho: (n, T) per token, or (n, 1) per sequence (the masked mean of the token log-ratios)."""
    log_ratio = logps - old_logps  # (n, T)
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (n, 1)
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over real tokens, or over rows when `values` is one value per row (n, 1)."""
    if values.shape[-1] == 1:
        return values.float().mean().item()
    return ((values * mask).sum() / mask.sum().clamp(min=1.0)).item()


def _loss_terms(logps, log_ratio, advantages, ref_logps, beta, epsilon, epsilon_high, delta, kl_bias_correction):
    """l = -min(rho A, clip(rho) A) + beta kl from log rho; returns (l, rho, kl or None), all differentiable."""
    ratio = torch.exp(log_ratio)  # (n, T) or (n, 1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)  # two-sided clipping: cap the unclipped branch too
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)  # (n, T)
        if kl_bias_correction:
            kl = kl * ratio  # trl 1.16: importance-sampling correction of the KL term (not detached)
        loss = loss + beta * kl  # added after clipping
    return loss, ratio, kl


def token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    kl_bias_correction: bool = False,
) -> torch.Tensor:
    """l_t of token-level ratios, elementwise: every argument has the same shape (any shape), no mask.

    The same terms as `per_token_loss(importance_sampling_level="token")`, without the statistics;
    the fused log-prob + loss path (grpo.logprobs.completion_token_loss) evaluates it chunk by chunk.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    loss, _, _ = _loss_terms(logps, logps - old_logps, advantages, ref_logps, beta, epsilon, epsilon_high, delta,
                             kl_bias_correction)
    return loss


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    kl_bias_correction: bool = False,
    importance_sampling_level: str = "token",
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Per-token loss l (n, T) (l has shape (n, 1) for sequence-level ratios with beta = 0) and its stats.

    logps (n, T) with grad; old_logps (n, T) detached (logps.detach() when on-policy, which gives
    rho = 1 and the REINFORCE gradient); advantages (n,); mask (n, T); ref_logps (n, T) if beta != 0.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantages = advantages[:, None]  # (n, 1)
    log_ratio = log_importance_weights(logps, old_logps, mask, importance_sampling_level)  # (n, T) or (n, 1)
    loss, ratio, kl = _loss_terms(logps, log_ratio, advantages, ref_logps, beta, epsilon, epsilon_high, delta,
                                  kl_bias_correction)
    with torch.no_grad():
        is_low = (ratio < 1 - epsilon) & (advantages < 0)
        is_high = (ratio > 1 + epsilon_high) & (advantages > 0)
        stats = LossStats(
            kl=None if kl is None else _masked_mean(kl.detach(), mask),
            clip_low=_masked_mean(is_low.float(), mask),
            clip_high=_masked_mean(is_high.float(), mask),
            clip_region=_masked_mean((is_low | is_high).float(), mask),
            entropy=None if entropy is None else _masked_mean(entropy, mask),
        )
    return loss, stats


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    num_micro_batches: int = 1,
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | None = None,
) -> torch.Tensor:
    """Reduce the per-token loss of one micro-batch to the scalar whose gradient is accumulated.

    Summing the returned values over the `num_micro_batches` micro-batches of a step gives:
      grpo, dr_grpo  exactly the full-batch loss when the micro-batches have equal row counts
                     (the trainer enforces this);
      dapo           exactly the full-batch token mean (`num_items_in_batch` = real completion
                     tokens of the whole step), whatever the micro-batches hold;
      bnpo           the mean of the micro-batches' token means: the full-batch token mean only
                     when micro-batches hold equal numbers of tokens. This is trl's definition;
                     `dapo` is the variant that is exact under any split.
    """
    mask = mask.to(loss.dtype)
    if loss_type == "grpo":
        # Each row's token mean (1/|o_i|), then the mean over rows; / micro-batches for accumulation.
        per_row = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (n,)
        return per_row.mean() / num_micro_batches
    if loss_type == "bnpo":
        # Token mean over this micro-batch; / micro-batches for accumulation.
        return (loss * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches
    if loss_type == "dr_grpo":
        # A constant divisor (rows * max_completion_length): no length bias (Dr. GRPO).
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return (loss * mask).sum() / (loss.shape[0] * max_completion_length) / num_micro_batches
    if loss_type == "dapo":
        # Token sum / real completion tokens of the whole step: every token of the step weighs the same.
        if num_items_in_batch is None:
            raise ValueError("loss_type='dapo' needs num_items_in_batch (completion tokens in the step)")
        return (loss * mask).sum() / max(float(num_items_in_batch), 1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def aggregation_weights(mask: torch.Tensor, loss_type: str, **kwargs) -> torch.Tensor:
    """w (n, T) with aggregate_loss(l, mask, loss_type, **kwargs) == sum(w * l) for every l.

    aggregate_loss is linear in l, so w is its gradient, taken here rather than written out a second time.
    """
    probe = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate_loss(probe, mask, loss_type, **kwargs), probe)
    return weights
