"""The GRPO policy objectives, their token masks, the KL penalty, and the aggregation over tokens.

A micro-batch's loss is built from four separate choices (trl 1.16's flag names and meanings):

1. The per-token policy objective p_t, chosen by `loss_type`: a function of `PolicyInputs` (OBJECTIVES), the same
   signature a plug-in has (`--loss-type path/to/file.py:fn`, docs/modify.md). With the importance ratio
       rho_t = exp(logp_t - logp_old_t)             ("token" level), or
       rho_i = exp(mean_t (logp_t - logp_old_t))    (one per completion, "sequence": GSPO arXiv 2507.18071),
   grpo, bnpo, dr_grpo, dapo, luspo   p = -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A)   (PPO arXiv 1707.06347,
                                      DeepSeekMath arXiv 2402.03300 eq. 3); `delta` caps the unclipped rho
                                      (two-sided clipping, INTELLECT-2 arXiv 2505.07291)
   rloo    the same with rho_i = exp(sum_t (logp_t - logp_old_t)), the completion's probability ratio, one per
           completion (trl 1.16's RLOOTrainer; RLOO arXiv 2402.14740)
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
   behaviour weights w      multiply p when the rollout was sampled by another policy than pi_old (stale
                            weights, another backend's kernels): w = pi_old / pi_b, truncated or masked
                            (grpo.algorithm.off_policy; vespo takes w inside phi instead, as trl)
3. The KL penalty, added after the masks: l_t = p_t + beta kl_t with the k3 estimator
       kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (Schulman, "Approximating KL divergence")
   times rho when `use_bias_correction_kl` (trl 1.16's default; before the `delta` cap, as trl).
4. The aggregation (`loss_type`) of one micro-batch, so that summing the micro-batches of one optimizer step
   gives the step's loss (see `aggregate_loss`):
    grpo, sapo,    mean over rows of (sum_t l m / sum_t m),  / num_micro_batches   (rloo: l is one per row)
    rloo
    bnpo           sum l m / sum m over the micro-batch,      / num_micro_batches
    dr_grpo        sum l m / (rows * max_completion_length),  / num_micro_batches   (Dr. GRPO arXiv 2503.20783)
    luspo          mean over rows of sum_t l m,               / num_micro_batches   (LUSPO arXiv 2602.05261)
    dapo, cispo,   sum l m / (completion tokens of the optimizer step)              (DAPO arXiv 2503.14476)
    vespo
   A plug-in objective names the built-in loss type whose aggregation it takes (its `aggregation`; default dapo).
An entropy bonus - coef * mean_t H_t (over the tokens the masks keep, / num_micro_batches) is added last
(grpo.entropy). `LossOptions` carries these settings; grpo.loss_stats computes what is logged.
Notation: n rows in the micro-batch, T completion tokens; m the completion mask; sg() stops the gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from grpo.errors import PluginError, guarded


CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "rloo")  # the PPO clipped surrogate
LOSS_TYPES = (*CLIPPED_LOSS_TYPES, "cispo", "sapo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def check_loss_type(loss_type: str) -> None:
    """The one check of a built-in loss_type name (aggregate_loss takes one as its aggregation)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES} or a plug-in module:function / "
                         f"path/to/file.py:function, got {loss_type!r}")


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
    # Resolved from loss_type (resolve_objective): the policy term, the aggregation's name, the ratio's level.
    objective: Callable = field(init=False, repr=False, compare=False)
    aggregation: str = field(init=False)  # a built-in loss type whose aggregation applies (aggregate_loss)
    ratio_level: str = field(init=False)  # "token", "sequence" (mean log-ratio) or "sequence_sum" (rloo)
    ratio_cap: float = field(init=False)  # delta for the clipped objectives, else inf: the rho the statistics read

    def __post_init__(self):
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        objective, aggregation = resolve_objective(self.loss_type)
        object.__setattr__(self, "objective", objective)
        object.__setattr__(self, "aggregation", aggregation)
        object.__setattr__(self, "ratio_level", "sequence_sum" if self.loss_type == "rloo" else
                           self.importance_sampling_level)
        capped = self.delta is not None and self.loss_type in CLIPPED_LOSS_TYPES
        object.__setattr__(self, "ratio_cap", self.delta if capped else math.inf)

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss itself (not only the logs) reads the token entropies."""
        return self.top_entropy_quantile < 1.0


# ----------------------------------------------------------------------------- token entropy ("80/20", Skywork-OR1)

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

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float | None:
        """The coefficient every micro-batch of the coming optimizer step uses; None when the bonus is off."""
        if not self.enabled:
            return None
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


# ----------------------------------------------------------------------------- the per-token terms
def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0, 0 when equal."""
    delta = ref_logps - logps  # (n, T)
    return torch.exp(delta) - delta - 1


def log_importance_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log rho: (n, T) per token, or (n, 1) per sequence: the masked mean of the token log-ratios (GSPO's
    "sequence"), or their sum, the log-ratio of the whole completion's probabilities ("sequence_sum": trl's
    RLOOTrainer)."""
    log_ratio = logps - old_logps  # (n, T)
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (n, 1)
    return (log_ratio * mask).sum(-1, keepdim=True)  # (n, 1) "sequence_sum" (LossOptions checked the names)


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor,
                  options: LossOptions, is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """phi(w_i) (n, 1), detached: VESPO's Gamma weighting of the sequence ratio w_i = exp(sum_t log rho_t).

    log phi = lambda + k log w - lambda w (so phi(1) = 1), k and lambda by the sign of A (A >= 0: _pos).
    As trl: token log-ratios clamped to [-20, 20], log w to [log 1e-8, 20]; a non-finite phi becomes 0.
    is_weights (n, T): the behaviour weights pi_old / pi_b (grpo.algorithm.off_policy), which join w as
    w_i = exp(sum_t log rho_t + sum_t log is_t), each log clamped to [log 1e-8, 20] (trl 1.16).
    advantages (n, 1); token_log_ratio, mask (n, T).
    """
    lower = math.log(1e-8)
    log_w = (token_log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # (n, 1)
    if is_weights is not None:
        log_w = log_w + torch.log(is_weights).clamp(lower, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(lower, 20.0)
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


class PolicyInputs(NamedTuple):
    """What a policy objective reads (built in or a plug-in: `--loss-type path/to/file.py:fn`, docs/modify.md)."""

    logps: torch.Tensor  # (n, T) log pi_theta of the sampled tokens, with grad
    old_logps: torch.Tensor  # (n, T) log pi_old, detached (logps.detach() on-policy: rho = 1)
    log_ratio: torch.Tensor  # (n, T) log rho per token, or (n, 1) per completion (options.ratio_level)
    advantages: torch.Tensor  # (n, 1), or (n, T) from an estimator that gives one per token
    mask: torch.Tensor  # (n, T) float: 1 on the tokens the loss trains on
    options: "LossOptions"  # epsilon, clip_high, delta, the sapo / vespo settings
    is_weights: torch.Tensor | None = None  # (n, T) or (n, 1) w = pi_old / pi_b, or None


def clipped_objective(x: PolicyInputs) -> torch.Tensor:
    """PPO's clipped surrogate -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A); `delta` caps the unclipped rho
    (taken after the clipped copy, as trl 1.16). grpo, bnpo, dr_grpo, dapo, luspo, rloo."""
    ratio = torch.exp(x.log_ratio)  # (n, T) or (n, 1)
    clipped_ratio = torch.clamp(ratio, 1 - x.options.epsilon, 1 + x.options.clip_high)
    if x.options.delta is not None:
        ratio = torch.clamp(ratio, max=x.options.delta)  # two-sided clipping: cap the unclipped branch too
    return -torch.min(ratio * x.advantages, clipped_ratio * x.advantages)


def cispo_objective(x: PolicyInputs) -> torch.Tensor:
    """CISPO: -sg(min(rho, eps_high)) A logp (the weight is clipped and detached, never the gradient)."""
    weight = torch.clamp(torch.exp(x.log_ratio), max=x.options.clip_high).detach()
    return -weight * x.advantages * x.logps


def sapo_objective(x: PolicyInputs) -> torch.Tensor:
    """SAPO: -(4 / tau) sigmoid(tau (rho - 1)) A, tau by the sign of A."""
    tau = torch.where(x.advantages > 0, x.options.sapo_temperature_pos, x.options.sapo_temperature_neg)
    return -torch.sigmoid(tau * (torch.exp(x.log_ratio) - 1)) * 4 / tau * x.advantages


def vespo_objective(x: PolicyInputs) -> torch.Tensor:
    """VESPO: -sg(phi(w_i)) A logp with the Gamma weight of the sequence ratio (vespo_weights)."""
    return -vespo_phi(x) * x.advantages * x.logps


def vespo_phi(x: PolicyInputs) -> torch.Tensor:
    return vespo_weights(x.advantages, x.logps - x.old_logps, x.mask, x.options, x.is_weights)  # (n, 1)


OBJECTIVES = {**dict.fromkeys(CLIPPED_LOSS_TYPES, clipped_objective), "cispo": cispo_objective,
              "sapo": sapo_objective, "vespo": vespo_objective}


@functools.lru_cache(maxsize=None)
def resolve_objective(loss_type: str) -> tuple[Callable, str]:
    """(policy objective, aggregation) of a loss_type: a built-in name, or a plug-in `module:function` /
    `path/to/file.py:function` taking PolicyInputs, whose `aggregation` attribute names the built-in loss type
    whose aggregation it takes (default "dapo": every token of the update weighs the same)."""
    if loss_type in LOSS_TYPES:
        return OBJECTIVES[loss_type], loss_type
    if ":" not in loss_type:
        check_loss_type(loss_type)
    from rewards.registry import load_function

    objective = load_function(loss_type, "loss_type")
    aggregation = getattr(objective, "aggregation", "dapo")
    if aggregation not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r}: its `aggregation` must be a built-in loss type whose "
                         f"aggregation it takes, one of {LOSS_TYPES}, got {aggregation!r}")
    return checked_objective(objective, loss_type), aggregation


def checked_objective(objective: Callable, loss_type: str) -> Callable:
    """A plug-in objective whose exceptions become one PluginError naming it and its file (grpo.errors.guarded) and
    whose term is checked at every call: (n, T) or (n, 1) of the micro-batch."""
    call = guarded(objective, "loss_type", loss_type)

    @functools.wraps(objective)  # its name and signature (check_objective reads them)
    def checked(x: PolicyInputs) -> torch.Tensor:
        return check_term(call(x), x.logps.shape, loss_type)

    return checked


class ObjectiveOutputError(PluginError, ValueError):
    """A plug-in objective's term is not the policy term of its micro-batch (check_term)."""


def check_term(term, shape: torch.Size, loss_type: str, where: str = "a micro-batch") -> torch.Tensor:
    """`term` when it is the policy term of a micro-batch of `shape` (n, T): (n, T) or (n, 1); else one error naming
    the loss type."""
    rows, tokens = shape
    if not isinstance(term, torch.Tensor) or tuple(term.shape) not in ((rows, tokens), (rows, 1)):
        got = tuple(term.shape) if isinstance(term, torch.Tensor) else type(term).__name__
        raise ObjectiveOutputError(f"loss_type {loss_type!r} returned {got} on {where} of {rows} rows x {tokens} "
                                   f"tokens; expected the per-token policy term, (n, T) = {(rows, tokens)}, or one per "
                                   f"completion, (n, 1) = {(rows, 1)}")
    return term


def check_objective(loss_type: str, options: "LossOptions | None" = None) -> None:
    """The start-of-run check of a loss_type: a built-in name, or a plug-in taking one argument (PolicyInputs) whose
    output on a probe micro-batch (with the run's `options`) is (n, T) or (n, 1), finite and differentiable. Raises
    ValueError naming it."""
    objective, _ = resolve_objective(loss_type)
    if objective in OBJECTIVES.values():
        return
    objective = objective.__wrapped__  # the plug-in itself: its own errors are reported below
    from rewards.registry import required_arguments

    if required_arguments(objective) not in (1, None):
        raise ValueError(f"loss_type {loss_type!r} must take one argument, the PolicyInputs (fn(x) -> per-token policy "
                         f"term; grpo/algorithm/loss.py), but it takes {required_arguments(objective)}")
    generator = torch.Generator().manual_seed(0)
    logps = (-torch.rand(4, 5, generator=generator)).requires_grad_()  # (n, T)
    old = logps.detach() - 0.01 * torch.rand(4, 5, generator=generator)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0], [1.0] + [0.0] * 4])
    advantages = torch.tensor([[1.0], [-0.5], [0.25], [0.0]])  # (n, 1)
    options = options or LossOptions(loss_type=loss_type)
    inputs = PolicyInputs(logps, old, log_importance_weights(logps, old, mask, options.ratio_level), advantages, mask,
                          options)
    try:
        term = guarded(objective, "loss_type", loss_type)(inputs)
    except PluginError as error:  # named as at a step
        raise ValueError(f"{error} (on the start-of-run probe micro-batch of 4 rows x 5 tokens)") from error
    check_term(term, logps.shape, loss_type, "a probe micro-batch")
    if not term.requires_grad or not torch.isfinite(term).all():
        raise ValueError(f"loss_type {loss_type!r} returned a term that is not finite or has no gradient through "
                         "x.logps (the policy's log-probs)")


class LossTerms(NamedTuple):
    """A micro-batch's per-token loss and the terms its logged statistics read (computed once, by loss_terms)."""

    loss: torch.Tensor  # (n, T) or (n, 1): l = p * masks + beta kl, differentiable
    inputs: PolicyInputs  # what the objective read (the statistics read rho from it)
    kl: torch.Tensor | None  # (n, T) when beta != 0
    entropy_mask: torch.Tensor | None  # (n, T) when top_entropy_quantile < 1


def loss_terms(logps, old_logps, advantages, mask, ref_logps, options: LossOptions, entropy=None,
               behaviour_logps=None, is_weights=None) -> LossTerms:
    """l = p * masks * w + beta kl (differentiable), with rho, kl, phi and the entropy mask for the statistics.

    logps (n, T) with grad; old_logps (n, T); advantages (n, 1) or (n, T); mask (n, T) float; ref_logps (n, T) or None.
    behaviour_logps (n, T): what sampled (the off-policy mask then measures from them, as trl); is_weights
    (n, T) or (n, 1): w = pi_old / pi_b (grpo.algorithm.off_policy.behaviour_weights); None: no correction.
    """
    log_ratio = log_importance_weights(logps, old_logps, mask, options.ratio_level)
    kl = None
    if options.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)  # (n, T)
        if options.use_bias_correction_kl:
            kl = kl * torch.exp(log_ratio)  # trl 1.16: importance-sampling correction (not detached, not capped)
    inputs = PolicyInputs(logps, old_logps, log_ratio, advantages, mask, options, is_weights)
    loss = options.objective(inputs)  # p: (n, T) or (n, 1)
    if options.off_policy_mask_threshold is not None:  # from the policy that sampled: the old one, or pi_b
        sampled = old_logps if behaviour_logps is None else behaviour_logps
        loss = loss * off_policy_mask(advantages, logps, sampled, mask, options.off_policy_mask_threshold)
    entropy_mask = None
    if options.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the token entropies")
        entropy_mask = high_entropy_mask(entropy, mask, options.top_entropy_quantile)
        loss = loss * entropy_mask
    if is_weights is not None and options.loss_type != "vespo":  # vespo's phi took them
        loss = loss * is_weights  # after the masks, before the KL (trl 1.16)
    if kl is not None:
        loss = loss + options.beta * kl  # after clipping and masks
    return LossTerms(loss, inputs, kl, entropy_mask)


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
               ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions(),
               is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """l_t of token-level ratios, elementwise: every argument has the same shape (any shape), no mask.

    The same terms as `per_token_loss` for options without masks and with a per-token objective (not vespo);
    the fused log-prob + loss kernel (grpo.kernels.fused_loss) evaluates it chunk by chunk on the real tokens.
    """
    if options.loss_type == "vespo" or options.off_policy_mask_threshold is not None or options.needs_entropy:
        raise ValueError("token_loss is elementwise: vespo and the token masks need per_token_loss")
    options = dataclasses.replace(options, importance_sampling_level="token")
    return loss_terms(logps, old_logps, advantages, torch.ones_like(logps), ref_logps, options,
                      is_weights=is_weights).loss


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions(),
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss l (n, T); (n, 1) for sequence-level ratios with beta = 0 and no token mask.

    logps (n, T) with grad; old_logps (n, T) detached (logps.detach() when on-policy, which gives
    rho = 1 and the REINFORCE gradient); advantages (n,); mask (n, T); ref_logps (n, T) if beta != 0;
    entropy (n, T) if top_entropy_quantile < 1.
    """
    return loss_terms(logps, old_logps, advantages[:, None], mask.to(logps.dtype), ref_logps, options,
                      entropy).loss  # advantages (n, 1)


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
      grpo, sapo, rloo, dr_grpo,  exactly the full-batch loss when the micro-batches have equal row counts
      luspo                       (the trainer enforces this);
      dapo, cispo, vespo          exactly the full-batch token mean (`num_items_in_batch` = real completion
                                  tokens of the optimizer step), whatever the micro-batches hold;
      bnpo                        the mean of the micro-batches' token means: the full-batch token mean only
                                  when micro-batches hold equal numbers of tokens. This is trl's definition;
                                  `dapo` is the variant that is exact under any split.
    """
    check_loss_type(loss_type)
    mask = mask.to(loss.dtype)
    if loss_type in ("grpo", "sapo", "rloo"):
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
    # dapo, cispo, vespo (check_loss_type above): token sum / real completion tokens of the optimizer
    # step, so every token of the step weighs the same.
    if num_items_in_batch is None:
        raise ValueError(f"loss_type={loss_type!r} needs num_items_in_batch (completion tokens in the step)")
    return (loss * mask).sum() / max(float(num_items_in_batch), 1.0)


def aggregation_weights(mask: torch.Tensor, loss_type: str, **kwargs) -> torch.Tensor:
    """w (n, T) with aggregate_loss(l, mask, loss_type, **kwargs) == sum(w * l) for every l.

    aggregate_loss is linear in l, so w is its gradient, taken here rather than written out a second time.
    """
    probe = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate_loss(probe, mask, loss_type, **kwargs), probe)
    return weights


# ----------------------------------------------------------------------------- what is logged (trl's statistics)

@dataclass
class LossStats:
    """Detached statistics of one micro-batch, as trl logs them (means over real completion tokens)."""

    kl: float | None
    clip_low: float | None  # clipped loss types only
    clip_high: float | None
    clip_region: float | None
    entropy: float | None = None
    clip_low_min: float | None = None  # the smallest low-clipped share of one completion's tokens (trl's low_min)
    clip_high_max: float | None = None  # the largest high-clipped share of one completion's tokens
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


def _row_extreme(flags: torch.Tensor, mask: torch.Tensor, extreme) -> float | None:
    """`extreme` (torch.min or torch.max) over completions of the share of their real tokens that `flags` (n, T),
    or (n, 1) one per completion, marks; completions without a real token are left out (None: all are)."""
    shares = (flags.float() * mask).sum(-1) / mask.sum(-1)  # (n,) NaN where a completion has no real token
    shares = shares[~shares.isnan()]
    return extreme(shares).item() if shares.numel() else None


@torch.no_grad()
def loss_statistics(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    ref_logps: torch.Tensor | None = None, options: LossOptions = LossOptions(),
                    entropy: torch.Tensor | None = None) -> LossStats:
    """terms_statistics of the terms of detached log-probs: for a loss computed elsewhere (a fused kernel).
    advantages (n,); the other arguments as per_token_loss takes them."""
    mask = mask.to(logps.dtype)
    terms = loss_terms(logps, old_logps, advantages[:, None] if advantages.dim() == 1 else advantages, mask, ref_logps,
                       options, entropy)
    return terms_statistics(terms, advantages, mask, options, entropy)


@torch.no_grad()
def terms_statistics(terms: LossTerms, advantages: torch.Tensor, mask: torch.Tensor, options: LossOptions,
                     entropy: torch.Tensor | None = None) -> LossStats:
    """What trl logs of one micro-batch, from its loss terms: mean KL, the clipped fractions (low, high,
    either), the entropy, and the statistics of cispo (capped weights) and vespo (mean phi).

    A token counts as clipped low when rho < 1 - epsilon with A < 0 (the clip removes its gradient), high
    when rho > 1 + epsilon_high with A > 0; rho after the `delta` cap, as trl. entropy_sum / entropy_count
    are over the tokens the entropy bonus acts on (the completion mask, times the entropy mask if any).
    advantages (n,) or (n, T) (the terms hold them as the objective read them); mask (n, T) float; entropy
    (n, T) or None.
    """
    advantages, kl = terms.inputs.advantages, None if terms.kl is None else terms.kl.detach()  # (n, 1) or (n, T)
    ratio = torch.exp(terms.inputs.log_ratio.detach()).clamp(max=options.ratio_cap)  # (n, T) or (n, 1)
    stats = LossStats(kl=None if kl is None else _masked_mean(kl, mask), clip_low=None, clip_high=None,
                      clip_region=None, entropy=None if entropy is None else _masked_mean(entropy.detach(), mask),
                      tokens=mask.sum().item(), rows=float(mask.shape[0]),
                      per_row=ratio.shape[-1] == advantages.shape[-1] == 1)
    if options.loss_type in CLIPPED_LOSS_TYPES:
        is_low = (ratio < 1 - options.epsilon) & (advantages < 0)
        is_high = (ratio > 1 + options.clip_high) & (advantages > 0)
        stats.clip_low = _masked_mean(is_low.float(), mask)
        stats.clip_high = _masked_mean(is_high.float(), mask)
        stats.clip_region = _masked_mean((is_low | is_high).float(), mask)
        stats.clip_low_min, stats.clip_high_max = _row_extreme(is_low, mask, torch.min), _row_extreme(is_high, mask,
                                                                                                    torch.max)
    elif options.loss_type == "cispo":
        stats.cispo_clip = _masked_mean(((ratio > options.clip_high) & (advantages > 0)).float(), mask)
    elif options.loss_type == "vespo":
        stats.vespo_phi = _masked_mean(vespo_phi(terms.inputs), mask)
    if entropy is not None:
        acting = mask if terms.entropy_mask is None else mask * terms.entropy_mask
        stats.entropy_sum, stats.entropy_count = (entropy.detach() * acting).sum().item(), acting.sum().item()
    return stats


def policy_loss_value(aggregated: float, loss_type: str, num_micro_batches: int) -> float:
    """trl's logged `policy_loss`: the micro-batch's aggregated loss before the division for accumulation
    (`loss_type`: the aggregation's name, LossOptions.aggregation)."""
    return aggregated if loss_type in ("dapo", "cispo", "vespo") else aggregated * num_micro_batches
