"""The GRPO policy objectives, their token masks, the KL penalty, and the aggregation over tokens.

A micro-batch's loss is built from four separate choices (trl 1.16's flag names and meanings):

1. The per-token policy objective p_t, chosen by `loss_type`. With the importance ratio
       rho_t = exp(logp_t - logp_old_t)             ("token" level), or
       rho_i = exp(mean_t (logp_t - logp_old_t))    (one per completion, "sequence": GSPO arXiv 2507.18071),
   grpo, bnpo, dr_grpo, dapo, luspo   p = -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A)   (PPO arXiv 1707.06347,
                                      DeepSeekMath arXiv 2402.03300 eq. 3); `delta` caps the unclipped rho
                                      (two-sided clipping, INTELLECT-2 arXiv 2505.07291)
   cispo   p = -sg(min(rho, eps_high)) A logp_t                  (MiniMax-M1 arXiv 2506.13585: the weight is clipped
                                                                   and detached, every token keeps a gradient)
   sapo    p = -(4 / tau) sigmoid(tau (rho - 1)) A,  tau = tau_pos if A > 0 else tau_neg   (SAPO arXiv 2511.20347)
   vespo   p = -sg(phi(w_i)) A logp_t,  w_i = exp(sum_t (logp_t - logp_old_t)),
           phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w)  (k, lambda by the sign of A;
           VESPO arXiv 2602.10693)
2. Token masks, each multiplying p (not the KL term):
   off_policy_mask_threshold d   drop completions with A < 0 whose mean_t (logp_old - logp) > d
                                 (DeepSeek-V3.2 arXiv 2512.02556 eq. 9)
   top_entropy_quantile rho      keep tokens whose entropy is in the top rho quantile of the micro-batch
                                 ("Beyond the 80/20 rule", arXiv 2506.01939)
3. The KL penalty, added after the masks: l_t = p_t + beta kl_t with the k3 estimator
       kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (Schulman, "Approximating KL divergence")
   times rho when `use_bias_correction_kl` (trl 1.16's default; before the `delta` cap, as trl).
4. The aggregation (`loss_type`) of one micro-batch, so that summing the micro-batches of one optimizer step
   gives the step's loss (see `aggregate_loss`):
    grpo, sapo     mean over rows of (sum_t l m / sum_t m),  / num_micro_batches
    bnpo           sum l m / sum m over the micro-batch,      / num_micro_batches
    dr_grpo        sum l m / (rows * max_completion_length),  / num_micro_batches   (Dr. GRPO arXiv 2503.20783)
    luspo          mean over rows of sum_t l m,               / num_micro_batches   (LUSPO arXiv 2602.05261)
    dapo, cispo,   sum l m / (completion tokens of the optimizer step)              (DAPO arXiv 2503.14476)
    vespo
An entropy bonus - coef * mean_t H_t (over the tokens the masks keep, / num_micro_batches) is added last
(grpo.entropy). `LossOptions` carries these settings; grpo.loss_stats computes what is logged.
Notation: n rows in the micro-batch, T completion tokens; m the completion mask; sg() stops the gradient.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from grpo.entropy import EntropyControl, entropy_bonus, high_entropy_mask  # noqa: F401 (the first two re-exported)

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO clipped surrogate
LOSS_TYPES = (*CLIPPED_LOSS_TYPES, "cispo", "sapo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossOptions:
    """The settings of the per-token loss and its aggregation, as GRPOConfig names them (trl's names)."""

    beta: float = 0.0  # KL coefficient; 0: no KL term
    epsilon: float = 0.2  # lower clip: rho >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip: rho <= 1 + epsilon_high (cispo: rho <= epsilon_high); None: epsilon
    delta: float | None = None  # cap on the unclipped rho (two-sided clipping); None: off
    use_bias_correction_kl: bool = False  # kl * rho (trl 1.16's default)
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)
    loss_type: str = "grpo"  # the objective and its aggregation, see the module docstring
    max_completion_length: int | None = None  # dr_grpo's constant divisor
    sapo_temperature_pos: float = 1.0  # sapo's tau for A > 0
    sapo_temperature_neg: float = 1.05  # sapo's tau for A <= 0
    vespo_k_pos: float = 2.0  # vespo's power k for A >= 0
    vespo_lambda_pos: float = 3.0  # vespo's decay lambda for A >= 0
    vespo_k_neg: float = 3.0  # vespo's k for A < 0
    vespo_lambda_neg: float = 2.0  # vespo's lambda for A < 0
    top_entropy_quantile: float = 1.0  # keep the policy term on the top quantile of tokens by entropy; 1: all
    off_policy_mask_threshold: float | None = None  # drop A < 0 completions this far off-policy; None: off

    def __post_init__(self):
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss itself (not only the logs) reads the token entropies."""
        return self.top_entropy_quantile < 1.0

    @classmethod
    def from_config(cls, config) -> "LossOptions":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


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


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor,
                  options: LossOptions) -> torch.Tensor:
    """phi(w_i) (n, 1), detached: VESPO's Gamma weighting of the sequence ratio w_i = exp(sum_t log rho_t).

    log phi = lambda + k log w - lambda w (so phi(1) = 1), k and lambda by the sign of A (A >= 0: _pos).
    As trl: token log-ratios clamped to [-20, 20], log w to [log 1e-8, 20]; a non-finite phi becomes 0.
    advantages (n, 1); token_log_ratio, mask (n, T).
    """
    lower = math.log(1e-8)
    log_w = (token_log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(lower, 20.0)  # (n, 1)
    positive = advantages >= 0
    k = torch.where(positive, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(positive, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """(n, 1) 1 = keep, 0 = drop: a completion is dropped when A < 0 and its mean_t (logp_old - logp) > threshold.

    DeepSeek-V3.2's off-policy sequence mask. `old_logps` are the log-probs the completion was sampled with
    (the old policy's, as trl without vLLM); on-policy they equal logps and nothing is dropped.
    """
    kl = torch.nan_to_num(old_logps - logps.detach(), nan=0.0)  # (n, T)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (n, 1)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def _objective(logps, log_ratio, token_log_ratio, advantages, mask, options: LossOptions):
    """The policy term p (n, T) or (n, 1) and what its statistics need: (p, rho after the cap, vespo's phi or None).

    The clipped copy is taken before `delta` caps rho; the cap applies to the unclipped branch only (trl 1.16).
    """
    ratio = torch.exp(log_ratio)  # (n, T) or (n, 1)
    if options.loss_type in CLIPPED_LOSS_TYPES:
        clipped_ratio = torch.clamp(ratio, 1 - options.epsilon, 1 + options.clip_high)
        if options.delta is not None:
            ratio = torch.clamp(ratio, max=options.delta)  # two-sided clipping: cap the unclipped branch too
        return -torch.min(ratio * advantages, clipped_ratio * advantages), ratio, None
    if options.loss_type == "cispo":
        weight = torch.clamp(ratio, max=options.clip_high).detach()  # the weight is clipped, never the gradient
        return -weight * advantages * logps, ratio, None
    if options.loss_type == "sapo":
        tau = torch.where(advantages > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, ratio, None
    if options.loss_type == "vespo":
        phi = vespo_weights(advantages, token_log_ratio, mask, options)  # (n, 1)
        return -phi * advantages * logps, ratio, phi
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {options.loss_type!r}")


def loss_terms(logps, old_logps, advantages, mask, ref_logps, options: LossOptions, entropy=None):
    """l = p * masks + beta kl (differentiable), and (rho, kl, phi, entropy mask) for the statistics."""
    token_log_ratio = logps - old_logps  # (n, T)
    log_ratio = log_importance_weights(logps, old_logps, mask, options.importance_sampling_level)
    kl = None
    if options.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)  # (n, T)
        if options.use_bias_correction_kl:
            kl = kl * torch.exp(log_ratio)  # trl 1.16: importance-sampling correction (not detached, not capped)
    loss, ratio, phi = _objective(logps, log_ratio, token_log_ratio, advantages, mask, options)
    if options.off_policy_mask_threshold is not None:
        loss = loss * off_policy_mask(advantages, logps, old_logps, mask, options.off_policy_mask_threshold)
    entropy_mask = None
    if options.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the token entropies")
        entropy_mask = high_entropy_mask(entropy, mask, options.top_entropy_quantile)
        loss = loss * entropy_mask
    if kl is not None:
        loss = loss + options.beta * kl  # after clipping and masks
    return loss, ratio, kl, phi, entropy_mask


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
               ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions()) -> torch.Tensor:
    """l_t of token-level ratios, elementwise: every argument has the same shape (any shape), no mask.

    The same terms as `per_token_loss` for options without masks and with a per-token objective (not vespo);
    the fused log-prob + loss kernel (grpo.kernels.fused_loss) evaluates it chunk by chunk on the real tokens.
    """
    if options.loss_type == "vespo" or options.off_policy_mask_threshold is not None or options.needs_entropy:
        raise ValueError("token_loss is elementwise: vespo and the token masks need per_token_loss")
    options = dataclasses.replace(options, importance_sampling_level="token")
    loss, _, _, _, _ = loss_terms(logps, old_logps, advantages, torch.ones_like(logps), ref_logps, options)
    return loss


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions(),
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss l (n, T); (n, 1) for sequence-level ratios with beta = 0 and no token mask.

    logps (n, T) with grad; old_logps (n, T) detached (logps.detach() when on-policy, which gives
    rho = 1 and the REINFORCE gradient); advantages (n,); mask (n, T); ref_logps (n, T) if beta != 0;
    entropy (n, T) if top_entropy_quantile < 1.
    """
    loss, _, _, _, _ = loss_terms(logps, old_logps, advantages[:, None], mask.to(logps.dtype), ref_logps, options,
                                   entropy)  # advantages (n, 1)
    return loss


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
      grpo, sapo, dr_grpo, luspo  exactly the full-batch loss when the micro-batches have equal row counts
                                  (the trainer enforces this);
      dapo, cispo, vespo          exactly the full-batch token mean (`num_items_in_batch` = real completion
                                  tokens of the optimizer step), whatever the micro-batches hold;
      bnpo                        the mean of the micro-batches' token means: the full-batch token mean only
                                  when micro-batches hold equal numbers of tokens. This is trl's definition;
                                  `dapo` is the variant that is exact under any split.
    """
    mask = mask.to(loss.dtype)
    if loss_type in ("grpo", "sapo"):
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
    if loss_type == "luspo":
        # Each row's token sum (a sequence-level term scaled by its length), mean over rows (LUSPO).
        return (loss * mask).sum(-1).mean() / num_micro_batches
    if loss_type in ("dapo", "cispo", "vespo"):
        # Token sum / real completion tokens of the optimizer step: every token of the step weighs the same.
        if num_items_in_batch is None:
            raise ValueError(f"loss_type={loss_type!r} needs num_items_in_batch (completion tokens in the step)")
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
