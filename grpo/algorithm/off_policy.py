"""Three policies, and the importance-sampling correction between the one that sampled and the one updated.

    behaviour  pi_b    the weights (and kernels) that sampled the rollout; its per-token log-probs come with
                       the rollout (Rollout.sampler_logprobs), from our sampler or any backend that gives them
    old        pi_old  the policy before this rollout's updates, recomputed by the trainer without grad
    current    pi      the policy being updated

The clipped objective's ratio rho = pi / pi_old (grpo.algorithm.loss) assumes the tokens were drawn from
pi_old. They were drawn from pi_b: asynchronous rollouts sample with weights up to --max-staleness updates
old, and a generation backend's kernels (bf16, a compiled decode step) round differently from the update's.
The decoupled objective (AReaL, Fu et al. 2025, arXiv 2505.24298, eq. 5) multiplies each term by a second
ratio, detached:

    l_t = w * p_t(rho_t) + beta kl_t,          w = pi_old / pi_b

w as trl 1.16 computes it (`vllm_importance_sampling_mode`, our `importance_sampling_mode`):

    token_*       w_t = exp(logp_old_t - logp_b_t)                one per token
    sequence_*    w_i = exp(sum_t (logp_old_t - logp_b_t))        one per completion (over its loss tokens)
    *_truncate    w <- clamp(w, C_min, C_max)                     truncated IS (Ionides 2008; for LLM RL, Yao et
                                                                   al. 2025, "Your efficient RL framework secretly
                                                                   brings you off-policy RL training")
    *_mask        w <- 0 where w < C_min or w > C_max, else w     masked IS (Liu et al. 2025, "When speed kills
                                                                   stability": tokens or completions too far off
                                                                   are dropped, not down-weighted)

A token the backend could not score (NaN) gets logp_old - logp_b = 0, w = 1, as trl. vespo takes w inside its
own sequence weight instead (grpo.algorithm.loss.vespo_weights), as trl.
Notation: n rows, T completion tokens; m the loss mask (completion tokens the model wrote).
"""

from __future__ import annotations

import math

import torch

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def behaviour_weights(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                      clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """w = pi_old / pi_b, truncated or masked: (n, T) for token_* modes, (n, 1) for sequence_* modes.

    old_logps, behaviour_logps (n, T); mask (n, T) 0/1 (tokens outside it get w = 1 in token modes and do not
    count in a completion's sum). clip_min / clip_max: C_min, C_max (None: unbounded on that side).
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"importance_sampling_mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    log_w = torch.nan_to_num((old_logps - behaviour_logps) * mask, nan=0.0)  # (n, T)
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True)  # (n, 1)
    w = torch.exp(log_w)
    if mode.endswith("truncate"):
        return torch.clamp(w, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return w.masked_fill((w < low) | (w > high), 0.0)


@torch.no_grad()
def mismatch_statistics(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor,
                        weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """What trl logs of the behaviour / old mismatch, plus its KL, as sums and extremes over this rank's tokens
    (grpo.core.metrics reduces them over ranks):

        |logp_old - logp_b|             sampling/sampling_logp_difference/{mean,max}   (trl's names)
        w                               sampling/importance_sampling_ratio/{min,mean,max}
        KL(pi_b || pi_old), k3          sampling/mismatch_kl: mean_t of r - 1 - log r, r = pi_old / pi_b,
                                        an unbiased estimate from tokens drawn from pi_b (Schulman's k3)

    Tokens the backend could not score (NaN) are left out. Returns 0-d tensors: diff_sum, diff_max, tokens,
    kl_sum, w_sum, w_min, w_max, w_count (w over the loss tokens, or over completions for sequence modes). With
    nothing to measure the extremes are neutral for a reduction over ranks: 0 for the maxima, +inf for w_min.
    """
    real = mask.bool() & ~torch.isnan(behaviour_logps)  # (n, T)
    log_r = (old_logps - behaviour_logps)[real]  # (M,)
    diff = log_r.abs()
    flat_w = weights.flatten() if weights.shape[-1] == 1 else weights[mask.bool()]
    zero = old_logps.new_zeros(())
    return dict(diff_sum=diff.sum(), diff_max=diff.max() if diff.numel() else zero, tokens=zero + diff.numel(),
                kl_sum=(torch.exp(log_r) - 1 - log_r).sum(), w_sum=flat_w.sum(),
                w_min=flat_w.min() if flat_w.numel() else zero + float("inf"),
                w_max=flat_w.max() if flat_w.numel() else zero, w_count=zero + flat_w.numel())
