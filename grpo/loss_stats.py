"""What trl logs of a micro-batch's loss: mean KL, clipped fractions, entropy, cispo's and vespo's statistics.

Computed once per micro-batch from the same terms as the loss (grpo.loss), detached; the update weighs them by
the tokens or rows they are over, so the logged value is the step's mean whatever the micro-batches held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.loss import CLIPPED_LOSS_TYPES, LossOptions, loss_terms


@dataclass
class LossStats:
    """Detached statistics of one micro-batch, as trl logs them (means over real completion tokens)."""

    kl: float | None
    clip_low: float | None  # clipped loss types only
    clip_high: float | None
    clip_region: float | None
    entropy: float | None = None
    cispo_clip: float | None = None  # cispo: share of tokens whose weight was capped (A > 0)
    vespo_phi: float | None = None  # vespo: mean phi(w) over completions
    policy_loss: float | None = None  # the aggregated loss before the entropy bonus, not divided by micro-batches
    entropy_sum: float | None = None  # sum and count of the entropies the bonus acts on (adaptive control)
    entropy_count: float | None = None
    tokens: float = 0.0  # what the means are over: real tokens, and rows (for one-per-completion values)
    rows: float = 0.0
    per_row: bool = False  # the ratio statistics are one per completion (sequence-level ratios)

    def weights(self) -> dict[str, float]:
        """Each logged statistic's weight, so that sum(value * weight) / sum(weight) over micro-batches (and
        ranks) is the mean over the step's tokens or rows, whatever the micro-batches hold."""
        ratio_weight = self.rows if self.per_row else self.tokens
        return {"kl": self.tokens, "entropy": self.tokens, "clip_low": ratio_weight, "clip_high": ratio_weight,
                "clip_region": ratio_weight, "cispo_clip": ratio_weight, "vespo_phi": self.rows, "policy_loss": 1.0}


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over real tokens, or over rows when `values` is one value per row (n, 1)."""
    if values.shape[-1] == 1:
        return values.float().mean().item()
    return ((values * mask).sum() / mask.sum().clamp(min=1.0)).item()


@torch.no_grad()
def loss_statistics(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions(),
                    entropy: torch.Tensor | None = None) -> LossStats:
    """What trl logs of one micro-batch: mean KL, the clipped fractions (low, high, either), the entropy, and
    the statistics of cispo (capped weights) and vespo (mean phi).

    A token counts as clipped low when rho < 1 - epsilon with A < 0 (the clip removes its gradient), high
    when rho > 1 + epsilon_high with A > 0; rho after the `delta` cap, as trl. entropy_sum / entropy_count
    are over the tokens the entropy bonus acts on (the completion mask, times the entropy mask if any).
    """
    mask = mask.to(logps.dtype)
    advantages = advantages[:, None]  # (n, 1)
    _, ratio, kl, phi, entropy_mask = loss_terms(logps, old_logps, advantages, mask, ref_logps, options, entropy)
    stats = LossStats(kl=None if kl is None else _masked_mean(kl, mask), clip_low=None, clip_high=None,
                      clip_region=None, entropy=None if entropy is None else _masked_mean(entropy, mask),
                      tokens=mask.sum().item(), rows=float(mask.shape[0]), per_row=ratio.shape[-1] == 1)
    if options.loss_type in CLIPPED_LOSS_TYPES:
        is_low = (ratio < 1 - options.epsilon) & (advantages < 0)
        is_high = (ratio > 1 + options.clip_high) & (advantages > 0)
        stats.clip_low = _masked_mean(is_low.float(), mask)
        stats.clip_high = _masked_mean(is_high.float(), mask)
        stats.clip_region = _masked_mean((is_low | is_high).float(), mask)
    elif options.loss_type == "cispo":
        stats.cispo_clip = _masked_mean(((ratio > options.clip_high) & (advantages > 0)).float(), mask)
    elif options.loss_type == "vespo":
        stats.vespo_phi = _masked_mean(phi, mask)
    if entropy is not None:
        acting = mask if entropy_mask is None else mask * entropy_mask
        stats.entropy_sum, stats.entropy_count = (entropy * acting).sum().item(), acting.sum().item()
    return stats


def policy_loss_value(aggregated: float, loss_type: str, num_micro_batches: int) -> float:
    """trl's logged `policy_loss`: the micro-batch's aggregated loss before the division for accumulation."""
    return aggregated if loss_type in ("dapo", "cispo", "vespo") else aggregated * num_micro_batches
