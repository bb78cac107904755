"""Token entropy in the loss: the high-entropy token mask and the entropy bonus with its coefficient.

    mask   keep the policy term on tokens whose entropy is in the top rho quantile of the micro-batch
           ("Beyond the 80/20 rule", arXiv 2506.01939)
    bonus  loss - coef * mean_t H_t over the tokens the masks keep (trl 1.16's entropy_coef); the coefficient
           constant or adapted after each optimizer step (Skywork-OR1, arXiv 2505.22312)
Notation: n rows in the micro-batch, T completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(n, T) bool: real tokens whose entropy is at least the (1 - quantile) quantile of the real tokens' entropies.

    quantile = 0.2 keeps the 20% highest-entropy tokens ("Beyond the 80/20 rule"); 0 keeps the highest one(s).
    """
    real = mask.bool()
    values = entropy.detach()[real].float()  # (M,)
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach() * mask >= threshold) & real


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, num_micro_batches: int = 1) -> torch.Tensor:
    """mean_t H_t over the tokens in `mask` (the completion mask times the entropy mask), / num_micro_batches.

    The trainer subtracts coef * this from the loss (trl 1.16): the same meaning for every loss type.
    entropy (n, T) with grad.
    """
    mask = mask.to(entropy.dtype)
    return (entropy * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient: constant, or adapted once per optimizer step (Skywork-OR1).

    Adaptive: the bonus applies only while the last step's entropy was <= target; after each step the
    coefficient moves by `delta` towards more bonus when the step's token-mean entropy was <= target and
    towards less otherwise, within [coef_min, coef_max]. `last_entropy` starts at +inf (no bonus until
    a step has been measured), as trl. `state_dict` is saved in checkpoints.
    """

    coef: float = 0.0
    adaptive: bool = False
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    last_entropy: float = math.inf

    @classmethod
    def from_config(cls, config) -> "EntropyControl":
        return cls(config.entropy_coef, config.use_adaptive_entropy, config.entropy_coef_min, config.entropy_coef_max,
                   config.entropy_coef_delta, config.entropy_target)

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient every micro-batch of the coming optimizer step uses."""
        if self.adaptive:
            return self.coef if self.last_entropy <= self.target else 0.0
        return self.coef

    def update(self, entropy_sum: float, token_count: float) -> None:
        """After an optimizer step: the step's entropy (sum and count over its micro-batches) moves the coefficient."""
        if not self.adaptive:
            return
        entropy = entropy_sum / max(token_count, 1.0)
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
