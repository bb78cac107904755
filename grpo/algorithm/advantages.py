"""Advantages: how one step's rewards become the numbers the loss weighs each completion (or token) by.

Part 1, GRPO's group-relative advantages (outcome supervision, DeepSeekMath arXiv 2402.03300, section 4.1.2):

    r_i   = sum_k w_k r_ik                      weighted reward (None/NaN entries left out: nansum)
    A_i   = (r_i - mean_group(r)) / (std + 1e-4)  scale_rewards="group": std over the group
                                                  scale_rewards="batch": std over the whole batch
    A_i   =  r_i - mean_group(r)                  scale_rewards="none" (Dr. GRPO, arXiv 2503.20783)

multi_objective_aggregation="normalize_then_sum" (GDPO, arXiv 2601.05242) normalises each reward function
within its group first, then sums them with their weights and normalises the sum over the batch:
    r~_ik = (r_ik - mean_group(r_k)) / (std_group(r_k) + 1e-4),   s_i = sum_k w_k r~_ik
    A_i   = (s_i - mean_batch(s)) / (std_batch(s) + 1e-4)        (scale_rewards does not apply)

As trl 1.16: the std is the unbiased (Bessel) one, 1e-4 is added to the std (not under the root),
a row that no reward function could score (all NaN) is left out of its group's mean and std and
gets advantage 0, and a group whose rewards are all equal gets advantage 0.

Notation: B prompts, G completions per prompt (group), N = B * G rows, K reward functions.
Rows are grouped as [prompt 0 x G, prompt 1 x G, ...].

Part 2, the advantage estimators (`--advantage-estimator`), GRPO's among them: each turns one step's rewards into
advantages, one per completion or one per token.

Every estimator, built in or a plug-in (`--advantage-estimator path/to/file.py:fn` or `module:fn`), has one
signature, documented here and checked when a run starts (`check_estimator`):

    fn(batch: AdvantageBatch) -> advantages                         (N,) one per completion, or (N, T) per token
                               or (advantages, {metric name: float})   extra values for the step's log line

NaN in the result means "no signal": such rows get advantage 0, after `normalize_advantages` (which leaves them out
of its mean and std, as trl), and so does every row no reward function could score. What each built-in gives a group
with one scorable row: rloo NaN (no sibling, as trl); grpo 0 (counted by normalize_advantages); opo 0;
reinforce_plus_plus_baseline 0 before the batch-wide whitening, which shifts every row alike (tied groups too, as
verl).
Built in, by verl's names (verl/trainer/ppo/core_algos.py, `@register_adv_est`):

    grpo                          (r_i - mean_group(r)) / (std_group(r) + 1e-4)     DeepSeekMath arXiv 2402.03300 4.1.2
                                  (--scale-rewards, GDPO's --multi-objective-aggregation: part 1)
    rloo                          r_i - mean_{j != i, scorable} r_j                   RLOO arXiv 2402.14740; trl 1.16's
                                                                                    RLOOTrainer (scorable siblings)
    reinforce_plus_plus_baseline  whiten_tokens(r_i - mean_group(r))               REINFORCE++ arXiv 2501.03262, verl
    reinforce_plus_plus           whiten_tokens(G_it),  G_it = sum_{s >= t} r_is    REINFORCE++ (no baseline), verl:
                                  (gamma = 1: r_is is the KL penalty per token plus the outcome reward at the last)
    opo                           r_i - sum_j |o_j| r_j / sum_j |o_j|  (the group's   OPO arXiv 2505.23585, verl
                                  length-weighted mean: the optimal baseline for a sequence-level REINFORCE)

whiten_tokens(x) = (x - mean) / sqrt(var + 1e-8) with the mean and the unbiased variance over every real token of
the batch (verl's masked_whiten): a long completion counts once per token.

The KL penalty in the reward (--kl-in-reward; grpo.core.update.advantage_batch forms it once): the reward minus
beta times the completion's first-order KL against the reference, summed over its tokens (the "k1" estimator, as
trl's RLOOTrainer, OpenRLHF and verl put it in the reward), from the log-probs of the policy that sampled:
    r_i <- r_i - beta sum_t (log pi_old(o_it) - log pi_ref(o_it))
`batch.kl_penalty` holds beta * k1 per token, for an estimator that spreads it over the tokens (reinforce_plus_plus).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from grpo.errors import NoSignalError, PluginError, guarded, source_file

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs; NaN where fewer than two values are present."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    squares = torch.nansum((values - torch.nanmean(values, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=True)
    std = (squares / (count - 1).clamp(min=1)).sqrt().masked_fill(count < 2, float("nan"))  # / (count - 1): unbiased
    return std if keepdim else std.squeeze(dim)


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, K) rewards and (K,) weights -> (N,) weighted sum; NaN for rows where every function gave None."""
    assert rewards_per_func.dim() == 2 and weights.shape == (rewards_per_func.shape[1],), \
        (rewards_per_func.shape, weights.shape)
    rewards = (rewards_per_func * weights[None, :]).nansum(dim=1)  # (N,)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # (N,)
    return rewards.masked_fill(unscorable, float("nan"))


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, dict[str, float]]:
    """(N,) weighted rewards (NaN = unscorable) -> (N,) advantages and the logger's reward statistics."""
    num_rows = rewards.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"{num_rows} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # (B, G)
    group_mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)  # (N,)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand(num_rows) if num_rows > 1 else torch.zeros_like(rewards)  # (N,)
    elif group_size > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(group_size)  # (N,); "none" uses it only for logging
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - group_mean  # (N,)
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)  # 1e-4 added to the std, as trl
    advantages = torch.nan_to_num(advantages, nan=0.0)  # unscorable rows, and groups with one scorable row
    stats = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item() if num_rows > 1 else 0.0,
             "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    return advantages, stats


def decoupled_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """GDPO's normalize_then_sum: (N, K) rewards (NaN = None) and (K,) weights -> (N,) advantages, statistics.

    Logged `reward` / `reward_std` are of the plain weighted sum, as with sum_then_normalize (and trl).
    """
    num_rows, num_funcs = rewards_per_func.shape
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"{num_rows} rewards do not split into groups of {group_size}")
    grouped = rewards_per_func.view(-1, group_size, num_funcs)  # (B, G, K)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # (B, 1, K)
    std = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + 1e-4)).view(num_rows, num_funcs)  # (N, K)
    summed = weighted_rewards(normalized, weights)  # (N,), NaN where no function scored
    batch_std = nanstd(summed).expand(num_rows) if num_rows > 1 else torch.zeros_like(summed)  # (N,)
    advantages = torch.nan_to_num((summed - torch.nanmean(summed)) / (batch_std + 1e-4), nan=0.0)
    rewards = weighted_rewards(rewards_per_func, weights)
    stats = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": nanstd(rewards).item() if num_rows > 1 else 0.0,
        "frac_reward_zero_std": torch.isclose(batch_std, torch.zeros_like(batch_std)).float().mean().item(),
    }
    return advantages, stats


def tied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: groups whose weighted rewards all tie (or hold fewer than two scorable rows): no learning signal.

    DAPO's dynamic sampling (arXiv 2503.14476, section 3.2) drops them and samples more prompts.
    """
    grouped = rewards.view(-1, group_size)  # (B, G)
    spread = torch.nan_to_num(nanstd(grouped, dim=1), nan=0.0)  # (B,)
    return torch.isclose(spread, torch.zeros_like(spread))


def reward_function_stats(rewards_per_func: torch.Tensor, names: list[str]) -> dict[str, float]:
    """`rewards/<name>/mean` and `rewards/<name>/std` over the rows each function scored."""
    stats = {}
    for column, name in enumerate(names):
        values = rewards_per_func[:, column]
        stats[f"rewards/{name}/mean"] = torch.nanmean(values).item()
        stats[f"rewards/{name}/std"] = nanstd(values).item() if values.numel() > 1 else 0.0
    return stats


# ============================================================================= the estimators


@dataclass(frozen=True)
class AdvantageBatch:
    """What an estimator reads: one step's rewards over every rank's rows, grouped by prompt."""

    rewards: torch.Tensor  # (N,) sum_k w_k r_ik, NaN where no function scored; clipped to --reward-clip-range, then
    #                        minus the KL penalty's sum with --kl-in-reward
    rewards_per_func: torch.Tensor  # (N, K) each reward function's values, NaN = None
    weights: torch.Tensor  # (K,) the reward weights
    group_size: int  # G: rows [g * G, (g + 1) * G) answer the same prompt
    completion_mask: torch.Tensor  # (N, T) float: 1 on the tokens the loss trains on
    kl_penalty: torch.Tensor | None = None  # (N, T) beta * (log pi_old - log pi_ref) per token with --kl-in-reward
    scale_rewards: str = "group"  # grpo's --scale-rewards
    plain_rewards: torch.Tensor | None = None  # (N,) sum_k w_k r_ik before the clip and the KL penalty, when they
    #                                            changed it (None: `rewards` is that sum); the logged `reward`
    beta: float = 0.0  # the KL penalty's coefficient (the logged `kl` is the penalty's mean k1 per token)


# ----------------------------------------------------------------------------- the pure functions


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740): A_i = r_i - mean of the other scorable rewards.

    (N,) rewards, NaN = unscorable -> (N,) advantages; NaN for unscorable rows and for a row with no scorable
    sibling (0 / 0), as trl 1.16's RLOOTrainer.
    """
    grouped = rewards.view(-1, group_size)  # (B, G)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)  # (B, 1)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)  # (B, G): / the scorable siblings
    return (grouped - others).view(-1)  # (N,)


def token_moments(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and the unbiased variance of `values` over the entries where `mask` is 1 (values, mask (N, T))."""
    count = mask.sum()
    mean = (values * mask).sum() / count
    variance = (((values - mean) ** 2) * mask).sum() / (count - 1).clamp(min=1)  # / (count - 1): unbiased
    return mean, variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the entries where mask is 1 (verl's masked_whiten); 0 where mask is 0.

    values, mask (N, T) -> (N, T).
    """
    mean, variance = token_moments(values, mask)
    return (values - mean) * torch.rsqrt(variance + 1e-8) * mask


def group_mean_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) r_i - mean_group(r) over the scorable rows (NaN stays NaN); a group of one keeps r_i (verl)."""
    if group_size == 1:
        return rewards.clone()
    grouped = rewards.view(-1, group_size)  # (B, G)
    return (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, group_size: int,
                                            completion_mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262; verl's compute_reinforce_plus_plus_baseline_outcome_advantage):
    A_i = whiten_tokens(r_i - mean_group(r)), each row's value counted once per real token of the batch.

    rewards (N,) (NaN rows are left out of the means and stay NaN); completion_mask (N, T) -> (N,).
    """
    centred = group_mean_baseline(rewards, group_size)  # (N,)
    scorable = ~torch.isnan(centred)  # (N,)
    mask = completion_mask * scorable[:, None]  # (N, T) the tokens of scorable rows
    mean, variance = token_moments(torch.nan_to_num(centred)[:, None].expand_as(mask), mask)
    return (centred - mean) * torch.rsqrt(variance + 1e-8)  # (N,); NaN rows stay NaN


def reinforce_plus_plus_advantages(rewards: torch.Tensor, completion_mask: torch.Tensor,
                                   kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262; verl's compute_reinforce_plus_plus_outcome_advantage, gamma = 1): the
    return-to-go of token rewards, whitened over every real token of the batch:
        r_it = -kl_penalty_it (+ the outcome reward at the last token),   G_it = sum_{s >= t} r_is
             = R_i + sum_{s < t} kl_penalty_is       where R_i = outcome - sum_s kl_penalty_is (`rewards`)
    rewards (N,) (already minus the penalty's sum), NaN = unscorable; completion_mask (N, T); kl_penalty (N, T)
    or None -> (N, T), NaN on unscorable rows.
    """
    mask = completion_mask * (~torch.isnan(rewards))[:, None]  # (N, T)
    penalty = torch.zeros_like(mask) if kl_penalty is None else kl_penalty * mask
    before = torch.cumsum(penalty, dim=1) - penalty  # (N, T): sum_{s < t} kl_penalty_s
    returns = torch.nan_to_num(rewards)[:, None] + before  # (N, T)
    return masked_whiten(returns, mask).masked_fill(torch.isnan(rewards)[:, None], float("nan"))


def opo_advantages(rewards: torch.Tensor, group_size: int, completion_mask: torch.Tensor) -> torch.Tensor:
    """OPO (arXiv 2505.23585; verl's compute_opo_outcome_advantage): A_i = r_i - b, with the group's
    length-weighted mean b = sum_j |o_j| r_j / sum_j |o_j| over its scorable rows.

    rewards (N,), NaN = unscorable; completion_mask (N, T) -> (N,); a group of one keeps r_i (verl).
    """
    if group_size == 1:
        return rewards.clone()
    lengths = completion_mask.sum(-1).view(-1, group_size)  # (B, G) |o_j|
    grouped = rewards.view(-1, group_size)  # (B, G)
    weights = lengths * ~torch.isnan(grouped)  # (B, G): scorable rows only
    baseline = torch.nansum(weights * grouped, dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True)  # (B, 1)
    return (grouped - baseline).view(-1)


# ----------------------------------------------------------------------------- the built-in estimators


def grpo(batch: AdvantageBatch):
    """GRPO's group-relative advantages (part 1), with its reward statistics."""
    return group_advantages(batch.rewards, batch.group_size, batch.scale_rewards)


def gdpo(batch: AdvantageBatch):
    """grpo with --multi-objective-aggregation normalize_then_sum (GDPO: each reward normalised in its group; part 1).
    The reward clip and a KL penalty in the reward do not apply: it reads each function's rewards."""
    return decoupled_advantages(batch.rewards_per_func, batch.weights, batch.group_size)


def rloo(batch: AdvantageBatch):
    """trl 1.16's RLOOTrainer: the leave-one-out baseline over the scorable siblings (leave_one_out_advantages)."""
    return leave_one_out_advantages(batch.rewards, batch.group_size)


def reinforce_plus_plus_baseline(batch: AdvantageBatch):
    """verl's reinforce_plus_plus_baseline: the group mean, then whitened over the batch's tokens."""
    return reinforce_plus_plus_baseline_advantages(batch.rewards, batch.group_size, batch.completion_mask)


def reinforce_plus_plus(batch: AdvantageBatch):
    """verl's reinforce_plus_plus: returns-to-go of the token rewards, whitened over the batch's tokens; (N, T)."""
    return reinforce_plus_plus_advantages(batch.rewards, batch.completion_mask, batch.kl_penalty)


def opo(batch: AdvantageBatch):
    """verl's opo: the group's length-weighted mean reward as the baseline."""
    return opo_advantages(batch.rewards, batch.group_size, batch.completion_mask)


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "grpo": grpo, "rloo": rloo, "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "reinforce_plus_plus": reinforce_plus_plus, "opo": opo,
}


# ----------------------------------------------------------------------------- the seam


@functools.lru_cache(maxsize=None)  # a plug-in's file runs once
def resolve_estimator(name: str, multi_objective_aggregation: str = "sum_then_normalize") -> Callable:
    """A built-in estimator by name (grpo becomes gdpo with normalize_then_sum), or a plug-in `module:function` /
    `path/to/file.py:function`."""
    if name == "grpo" and multi_objective_aggregation == "normalize_then_sum":
        return gdpo
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name]
    if ":" not in name:
        raise ValueError(f"advantage_estimator {name!r}: not one of {sorted(ADVANTAGE_ESTIMATORS)}, nor "
                         "module:function or path/to/file.py:function")
    from rewards.registry import load_function

    return checked(load_function(name, "advantage_estimator"), name)


class EstimatorOutputError(PluginError, ValueError):
    """An estimator's output is not advantages of the batch's shape (check_advantages)."""


def checked(estimator: Callable, name: str) -> Callable:
    """A plug-in estimator that reads a copy of the batch (what it changes in place reaches nothing else), whose
    exceptions become one PluginError naming it and its file (grpo.errors.guarded), and whose output is checked at
    every call as it was at start: its shape (check_advantages), and a signal: advantages that are all NaN raise
    NoSignalError (the update skips such a step and counts it, as a non-finite one)."""
    call = guarded(estimator, "advantage_estimator", name)

    @functools.wraps(estimator)  # its name and signature (check_estimator reads them)
    def checked_estimator(batch: AdvantageBatch):
        output = call(dataclasses.replace(batch, **{f.name: getattr(batch, f.name).clone()
                                                    for f in dataclasses.fields(batch)
                                                    if isinstance(getattr(batch, f.name), torch.Tensor)}))
        check_advantages(output[0] if isinstance(output, tuple) else output, batch, name, source_file(estimator))
        return output

    return checked_estimator


def reward_statistics(batch: AdvantageBatch, advantages: torch.Tensor | None = None) -> dict[str, float]:
    """trl's `reward`, `reward_std` (of the weighted rewards, without the clip and the KL penalty),
    `frac_reward_zero_std` (the share of groups whose rewards, as the estimator sees them, all tie), with the KL
    in the reward `kl`, and for per-token advantages (N, T) `advantages/abs_mean` over the real tokens."""
    plain = weighted_rewards(batch.rewards_per_func, batch.weights)  # (N,) without the clip and the KL penalty
    spread = nanstd(batch.rewards.view(-1, batch.group_size), dim=1) if batch.group_size > 1 else \
        torch.zeros(batch.rewards.shape[0] // batch.group_size)  # (B,)
    extra = {} if batch.kl_penalty is None or batch.beta == 0 else {  # trl's `kl`: the penalty's mean k1 per token
        "kl": batch.kl_penalty.sum().item() / batch.beta / max(batch.completion_mask.sum().item(), 1.0)}
    if advantages is not None and advantages.shape[1] > 1:  # (N, T): the real tokens' mean, not the padding's
        extra["advantages/abs_mean"] = advantages[batch.completion_mask.bool()].abs().mean().item()
    return {"reward": torch.nanmean(plain).item(), "reward_std": nanstd(plain).item() if plain.numel() > 1 else 0.0,
            "frac_reward_zero_std": torch.isclose(spread, torch.zeros_like(spread)).float().mean().item(), **extra}


def estimate_advantages(estimator: Callable, batch: AdvantageBatch,
                        normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, 1) or (N, T) advantages and the step's reward statistics: the estimator's output (a plug-in's checked by
    its wrapper, `checked`), normalised over the batch when `normalize` (trl's normalize_advantages: mean 0, std 1
    over the rows with a signal), and 0 where there is no signal (NaN) or no reward function scored the row."""
    advantages, metrics = output if isinstance(output := estimator(batch), tuple) else (output, {})  # metrics optional
    if normalize:
        advantages = normalized(advantages, batch.completion_mask)
    # 0 where no reward function scored the row (its weighted reward is NaN), on each of its tokens; (N, 1) or (N, T)
    unscorable = torch.isnan(batch.rewards)[:, None]  # (N, 1)
    advantages = torch.nan_to_num(advantages.view(len(batch.rewards), -1).masked_fill(unscorable, 0.0))
    # the estimator's own statistics (grpo's, as trl logs them) when it read the plain weighted rewards
    if "reward" in metrics and batch.plain_rewards is None:
        return advantages, metrics
    return advantages, {**metrics, **reward_statistics(batch, advantages)}


def normalized(advantages: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """trl's normalize_advantages: (A - mean) / (std + 1e-4) over the values with a signal (not NaN), the unbiased
    std; per-token advantages (N, T) over the real tokens (completion_mask) of the rows with a signal."""
    values = advantages if advantages.dim() == 1 else advantages.masked_fill(completion_mask == 0, float("nan"))
    return (advantages - torch.nanmean(values)) / (nanstd(values) + 1e-4)


def check_advantages(advantages, batch: AdvantageBatch, name: str, source: str | None = None) -> None:
    """One error naming the estimator when its output is not (N,) or (N, T) floats, or holds an infinity; for a
    plug-in (`source`: its file), NoSignalError when no value is finite (all NaN or infinite: nothing to learn)."""
    expected = [(batch.rewards.shape[0],), tuple(batch.completion_mask.shape)]
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in expected:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise EstimatorOutputError(f"advantage_estimator {name!r} returned {got}; expected a tensor of shape (N,) = "
                                   f"{expected[0]} or (N, T) = {expected[1]} (grpo/algorithm/advantages.py)")
    if not advantages.is_floating_point():
        raise EstimatorOutputError(f"advantage_estimator {name!r} returned {advantages.dtype} values, not floats")
    if source is not None and not torch.isfinite(advantages).any():
        raise NoSignalError(f"advantage_estimator {name!r} ({source}) returned no finite advantage for any of the "
                            f"{batch.rewards.shape[0]} rows (NaN marks a row without a signal): nothing to learn from")
    if torch.isinf(advantages).any():
        raise EstimatorOutputError(f"advantage_estimator {name!r} returned values with an infinity; NaN marks a row "
                                   "without a signal (it gets 0)")


def probe_batch(group_size: int = 4, num_groups: int = 2, width: int = 5, kl: bool = False,
                weights: list[float] | None = None, beta: float = 0.04) -> AdvantageBatch:
    """A small step's rewards (one unscorable row, completions of different lengths) with the run's group size, reward
    weights (K of them) and KL setting, for checking an estimator."""
    generator = torch.Generator().manual_seed(0)
    rows = group_size * num_groups
    weights = torch.tensor(weights or [1.0, 0.5], dtype=torch.float32)  # (K,)
    per_func = torch.rand(rows, len(weights), generator=generator)  # (N, K)
    per_func[0] = float("nan")  # a row no function scored
    rewards = weighted_rewards(per_func, weights)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # (N, T)
    penalty = beta * 0.01 * torch.rand(rows, width, generator=generator) * mask if kl else None
    return AdvantageBatch(rewards if penalty is None else rewards - penalty.sum(-1), per_func, weights, group_size,
                          mask, penalty, plain_rewards=None if penalty is None else rewards, beta=beta if kl else 0.0)


def check_estimator(estimator: Callable, name: str, group_size: int = 4, kl: bool = False,
                    weights: list[float] | None = None) -> int:
    """The start-of-run check of an estimator: one parameter (the AdvantageBatch), and on a probe batch an output
    of shape (N,) or (N, T), with the run's group size, reward weights and KL setting. Returns the output's number of
    dimensions (2: one advantage per token); raises ValueError naming it."""
    from rewards.registry import required_arguments

    if required_arguments(estimator) not in (1, None):
        raise ValueError(f"advantage_estimator {name!r} must take one argument, the AdvantageBatch (fn(batch) -> "
                         f"advantages; grpo/algorithm/advantages.py), but it takes {required_arguments(estimator)}")
    batch = probe_batch(max(group_size, 1), kl=kl, weights=weights)
    try:  # a plug-in's own exception, its output's shape, or no signal: named as at a step
        output = guarded(estimator, "advantage_estimator", name)(batch)  # (a plug-in's is already guarded)
        if isinstance(output, tuple) and (len(output) != 2 or not isinstance(output[1], dict) or not all(
                isinstance(key, str) and isinstance(value, (int, float)) for key, value in output[1].items())):
            got = type(output[1]).__name__ if len(output) == 2 else f"{len(output)} items"
            raise ValueError(f"advantage_estimator {name!r} returned a tuple: it must be (advantages, {{name: "
                             f"number}}), got {got}")
        advantages = output[0] if isinstance(output, tuple) else output
        built_in = estimator in (*ADVANTAGE_ESTIMATORS.values(), gdpo)
        check_advantages(advantages, batch, name, None if built_in else source_file(estimator))  # a plug-in: signal
    except PluginError as error:
        raise ValueError(f"{error} (on the start-of-run probe batch of {batch.rewards.shape[0]} rows)") from error
    return advantages.dim()
