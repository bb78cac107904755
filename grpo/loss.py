"""The clipped GRPO policy loss with a KL penalty, and its aggregation over tokens.

Per token (DeepSeekMath arXiv 2402.03300 eq. 3; PPO's clipped surrogate, arXiv 1707.06347):

    rho_t   = exp(logp_t - logp_old_t)                        importance ratio ("token" level)
    rho_i   = exp(mean_t (logp_t - logp_old_t))               one ratio per completion ("sequence", GSPO arXiv 2507.18071)
    l_t     = -min(rho * A, clip(rho, 1 - eps, 1 + eps_high) * A) + beta * kl_t
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      k3 estimator (Schulman, "Approximating KL divergence")
              (* rho when kl_bias_correction, trl 1.16's default `use_bias_correction_kl`)

eps_high > eps is DAPO's clip-higher (arXiv 2503.14476); `delta` caps rho from above after the
clipped copy is taken (two-sided clipping, as trl), and after the KL's correction factor took rho.
`LossOptions` carries these settings; `loss_statistics` computes what is logged, once per micro-batch.

Aggregation (`loss_type`) of one micro-batch, so that summing the micro-batches of one optimizer
step gives the step's loss (see `aggregate_loss`):
    grpo     mean over rows of (sum_t l m / sum_t m), / num_micro_batches
    bnpo     sum l m / sum m over the micro-batch,     / num_micro_batches
    dr_grpo  sum l m / (rows * max_completion_length), / num_micro_batches   (Dr. GRPO arXiv 2503.20783)
    dapo     sum l m / (completion tokens of the whole step)                 (DAPO arXiv 2503.14476)

Notation: n rows in the micro-batch, T completion tokens; m the completion mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossOptions:
    """The settings of the per-token loss and its aggregation, as GRPOConfig names them (trl's names)."""

    beta: float = 0.0  # KL coefficient; 0: no KL term
    epsilon: float = 0.2  # lower clip: rho >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip: rho <= 1 + epsilon_high; None: epsilon
    delta: float | None = None  # cap on the unclipped rho (two-sided clipping); None: off
    use_bias_correction_kl: bool = False  # kl * rho (trl 1.16's default)
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)
    loss_type: str = "grpo"  # aggregation, see aggregate_loss
    max_completion_length: int | None = None  # dr_grpo's constant divisor

    def __post_init__(self):
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_config(cls, config) -> "LossOptions":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


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


def _loss_terms(logps, log_ratio, advantages, ref_logps, options: LossOptions):
    """l = -min(rho A, clip(rho) A) + beta kl from log rho; returns (l, capped rho, kl or None), differentiable.

    The order is trl 1.16's: the KL is multiplied by the ratio before `delta` caps it, and the clipped copy
    is taken before the cap too; the cap applies to the unclipped branch of the surrogate only.
    """
    ratio = torch.exp(log_ratio)  # (n, T) or (n, 1)
    kl = None
    if options.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)  # (n, T)
        if options.use_bias_correction_kl:
            kl = kl * ratio  # trl 1.16: importance-sampling correction of the KL term (not detached, not capped)
    clipped_ratio = torch.clamp(ratio, 1 - options.epsilon, 1 + options.clip_high)
    if options.delta is not None:
        ratio = torch.clamp(ratio, max=options.delta)  # two-sided clipping: cap the unclipped branch too
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    if kl is not None:
        loss = loss + options.beta * kl  # added after clipping
    return loss, ratio, kl


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
               ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions()) -> torch.Tensor:
    """l_t of token-level ratios, elementwise: every argument has the same shape (any shape), no mask.

    The same terms as `per_token_loss` with importance_sampling_level="token"; the fused log-prob + loss
    kernel (grpo.kernels.fused_loss) evaluates it chunk by chunk on the real tokens.
    """
    loss, _, _ = _loss_terms(logps, logps - old_logps, advantages, ref_logps, options)
    return loss


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions()) -> torch.Tensor:
    """Per-token loss l (n, T); (n, 1) for sequence-level ratios with beta = 0.

    logps (n, T) with grad; old_logps (n, T) detached (logps.detach() when on-policy, which gives
    rho = 1 and the REINFORCE gradient); advantages (n,); mask (n, T); ref_logps (n, T) if beta != 0.
    """
    log_ratio = log_importance_weights(logps, old_logps, mask.to(logps.dtype), options.importance_sampling_level)
    loss, _, _ = _loss_terms(logps, log_ratio, advantages[:, None], ref_logps, options)  # advantages (n, 1)
    return loss


@torch.no_grad()
def loss_statistics(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions(),
                    entropy: torch.Tensor | None = None) -> LossStats:
    """What trl logs of one micro-batch: mean KL, the clipped fractions (low, high, either) and the entropy.

    A token counts as clipped low when rho < 1 - epsilon with A < 0 (the clip removes its gradient), high
    when rho > 1 + epsilon_high with A > 0; rho after the `delta` cap, as trl.
    """
    mask = mask.to(logps.dtype)
    advantages = advantages[:, None]  # (n, 1)
    log_ratio = log_importance_weights(logps, old_logps, mask, options.importance_sampling_level)
    _, ratio, kl = _loss_terms(logps, log_ratio, advantages, ref_logps, options)
    is_low = (ratio < 1 - options.epsilon) & (advantages < 0)
    is_high = (ratio > 1 + options.clip_high) & (advantages > 0)
    return LossStats(
        kl=None if kl is None else _masked_mean(kl, mask),
        clip_low=_masked_mean(is_low.float(), mask),
        clip_high=_masked_mean(is_high.float(), mask),
        clip_region=_masked_mean((is_low | is_high).float(), mask),
        entropy=None if entropy is None else _masked_mean(entropy, mask),
    )


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
