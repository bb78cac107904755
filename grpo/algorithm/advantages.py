"""Group-relative advantages (outcome supervision, DeepSeekMath arXiv 2402.03300, section 4.1.2).

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
"""

from __future__ import annotations

import torch

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
    assert rewards_per_func.dim() == 2 and weights.shape == (rewards_per_func.shape[1],), (rewards_per_func.shape, weights.shape)
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
    stats = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": nanstd(rewards).item() if num_rows > 1 else 0.0,
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
    }
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
