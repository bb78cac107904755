"""The advantage estimators of grpo/algorithm/advantages.py (part 2) against naive float64 references.

Each reference is plain Python over lists of floats (the math module only), written from the estimator's formula and
the source cited above it; it shares no code with the product. torch only builds the inputs and converts the results.
Each estimator also has one small case derived by hand in comments. Then the seam: estimate_advantages (shapes,
rows without a signal, normalize_advantages, the reward statistics, plug-in outputs), resolve_estimator and
check_estimator / check_advantages.

Notation as in the module: B prompts, G completions per prompt (group), N = B * G rows, T completion tokens,
K reward functions. Tolerances: rtol = atol = 1e-12 in float64.
"""

import math

import pytest
import torch

from grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageBatch,
    check_advantages,
    check_estimator,
    checked,
    decoupled_advantages,
    estimate_advantages,
    gdpo,
    group_advantages,
    leave_one_out_advantages,
    normalized,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    resolve_estimator,
)

NAN = float("nan")
F64 = torch.float64
TIGHT = dict(rtol=1e-12, atol=1e-12)
WIDTH = 6  # T of the random batches


def assert_close(actual: torch.Tensor, expected):
    """`expected`: nested lists of Python floats (NaN where the product must give NaN)."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), equal_nan=True, **TIGHT)


# ============================================================================= references: plain Python, math only


def is_nan(x: float) -> bool:
    return x != x


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def unbiased_std(values: list[float]) -> float:
    """sqrt(sum (x - mean)^2 / (n - 1)); NaN for fewer than two values (trl's nanstd)."""
    if len(values) < 2:
        return NAN
    m = mean(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))


def groups(values: list, group_size: int) -> list[list]:
    return [values[start:start + group_size] for start in range(0, len(values), group_size)]


# trl 1.16 RLOOTrainer._generate_and_score_completions: rewards = (rewards_per_func * weights).nansum(dim=1), and a row
# every reward function left None (all NaN) is unscorable: NaN.
def ref_weighted_rewards(per_func: list[list[float]], weights: list[float]) -> list[float]:
    out = []
    for row in per_func:
        scored = [w * r for w, r in zip(weights, row) if not is_nan(r)]
        out.append(sum(scored) if scored else NAN)
    return out


# RLOO (Ahmadian et al., arXiv 2402.14740, section 3.3 "REINFORCE Leave-One-Out"): A_i = r_i - 1/(k-1) sum_{j != i} r_j.
# trl 1.16 RLOOTrainer._generate_and_score_completions: baseline = (nansum(group) - r_i) / (scorable count - 1): an
# unscorable (NaN) row is left out of its siblings' baselines and stays NaN; a row with no scorable sibling divides
# 0 by 0 (NaN); both become 0 in nan_to_num.
def ref_rloo(rewards: list[float], group_size: int) -> list[float]:
    out = []
    for group in groups(rewards, group_size):
        for i, reward in enumerate(group):
            siblings = [other for j, other in enumerate(group) if j != i and not is_nan(other)]
            out.append(NAN if is_nan(reward) or not siblings else reward - mean(siblings))
    return out


# verl verl/utils/torch_functional.py masked_whiten: (x - masked_mean) * rsqrt(masked_var + 1e-8), masked_var with
# Bessel's correction mask_sum / (mask_sum - 1): the mean and the unbiased variance over every real token of the batch.
# REINFORCE++ (Hu, arXiv 2501.03262, section 3, "advantage normalization" over the global batch).
def ref_token_moments(token_values: list[list[float]]) -> tuple[float, float]:
    """The mean and unbiased variance of every value of every row (a row: its real tokens' values)."""
    flat = [value for row in token_values for value in row]
    m = mean(flat)
    return m, sum((x - m) ** 2 for x in flat) / (len(flat) - 1)


# verl verl/trainer/ppo/core_algos.py compute_reinforce_plus_plus_baseline_outcome_advantage: score - id2mean (the
# group's mean; a group of one response: id2mean = 0, the score is kept), tiled over the response's tokens, then
# masked_whiten over response_mask. REINFORCE++-baseline, arXiv 2501.03262. NaN rows (unscorable) are left out of the
# group mean and of the whitening, and stay NaN (the product's convention; verl has no unscorable rows).
def ref_reinforce_plus_plus_baseline(rewards: list[float], group_size: int, mask: list[list[float]]) -> list[float]:
    lengths = [int(sum(row)) for row in mask]  # real tokens per row
    centred = []
    for group in groups(rewards, group_size):
        scorable = [r for r in group if not is_nan(r)]
        for r in group:
            centred.append(NAN if is_nan(r) else r if group_size == 1 else r - mean(scorable))
    m, variance = ref_token_moments([[c] * length for c, length in zip(centred, lengths) if not is_nan(c)])
    return [NAN if is_nan(c) else (c - m) / math.sqrt(variance + 1e-8) for c in centred]


# verl core_algos.compute_reinforce_plus_plus_outcome_advantage (gamma = 1): token_level_rewards are -kl per token
# (verl compute_rewards: token_level_scores - kl * kl_ratio) with the outcome score at the last real token; the
# return-to-go is accumulated right to left (running_return = r_t + gamma * running_return); masked_whiten over
# response_mask, then * response_mask (0 on padding). REINFORCE++, arXiv 2501.03262, section 3. NaN rows (unscorable)
# are left out of the whitening and stay NaN on every token (the product's convention). The sums run over the real
# tokens only: a masked token inside the completion (a tool result) has no reward and gets 0. (verl's loop instead
# resets the running return at every masked token, which is the same for right padding only.)
def ref_reinforce_plus_plus(outcomes: list[float], kl: list[list[float]] | None,
                            mask: list[list[float]]) -> list[list[float]]:
    returns = []  # per row: {t: G_t} over its real tokens
    for row, outcome in enumerate(outcomes):
        if is_nan(outcome):
            returns.append(None)
            continue
        real = [t for t, m in enumerate(mask[row]) if m == 1.0]
        token_rewards = {t: 0.0 if kl is None else -kl[row][t] for t in real}
        token_rewards[real[-1]] += outcome
        running, row_returns = 0.0, {}
        for t in reversed(real):
            running = token_rewards[t] + running
            row_returns[t] = running
        returns.append(row_returns)
    m, variance = ref_token_moments([list(row.values()) for row in returns if row is not None])
    out = []
    for row, row_mask in zip(returns, mask):
        if row is None:
            out.append([NAN] * len(row_mask))
        else:
            out.append([(row[t] - m) / math.sqrt(variance + 1e-8) if t in row else 0.0 for t in range(len(row_mask))])
    return out


# OPO (Hao et al., arXiv 2505.23585, the optimal baseline for a sequence-level REINFORCE: b = sum_j |o_j| r_j /
# sum_j |o_j|); verl core_algos.compute_opo_outcome_advantage: id2bsl = (len * score).sum() / len.sum() over the
# group, a group of one response: baseline 0. Unscorable (NaN) rows are left out of the baseline and stay NaN.
def ref_opo(rewards: list[float], group_size: int, mask: list[list[float]]) -> list[float]:
    lengths = [sum(row) for row in mask]  # |o_j|: the real tokens
    out = []
    for group, group_lengths in zip(groups(rewards, group_size), groups(lengths, group_size)):
        scored = [(length, r) for length, r in zip(group_lengths, group) if not is_nan(r)]
        total_length = sum(length for length, _ in scored)
        baseline = 0.0 if group_size == 1 else (
            sum(length * r for length, r in scored) / total_length if total_length else NAN)
        out.extend(NAN if is_nan(r) else r - baseline for r in group)
    return out


# trl 1.16 RLOOTrainer (RLOOConfig.normalize_advantages): advantages = (A - nanmean(A)) / (nanstd(A) + 1e-4), trl's
# nanstd with Bessel's correction (NaN for fewer than two values): over the values with a signal (NaN left out).
def ref_normalize(values: list[float]) -> list[float]:
    signal = [v for v in values if not is_nan(v)]
    if not signal:
        return list(values)
    m, std = mean(signal), unbiased_std(signal)
    return [(v - m) / (std + 1e-4) for v in values]


def ref_normalize_tokens(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    """Per-token advantages: normalised over the real tokens (mask 1); the others are left as they are."""
    real = [v for row, row_mask in zip(values, mask) for v, m in zip(row, row_mask) if m == 1.0]
    normalized_real = iter(ref_normalize(real))
    return [[next(normalized_real) if m == 1.0 else v for v, m in zip(row, row_mask)]
            for row, row_mask in zip(values, mask)]


# trl 1.16 RLOOTrainer logging: `reward` / `reward_std` = nanmean / nanstd of the weighted rewards recomputed from
# rewards_per_func (no clip, no KL), unscorable rows NaN; `frac_reward_zero_std` = the share of groups whose nanstd of
# `rewards` (after the KL penalty) isclose 0 (|std| <= 1e-8; a NaN std, fewer than two scorable rows, is not); with
# num_generations == 1 the std is zeros (every group counts).
def ref_reward_statistics(plain: list[float], rewards: list[float], group_size: int) -> dict[str, float]:
    scored = [r for r in plain if not is_nan(r)]
    if group_size == 1:
        zero_std = [True] * len(rewards)
    else:
        stds = [unbiased_std([r for r in group if not is_nan(r)]) for group in groups(rewards, group_size)]
        zero_std = [not is_nan(std) and abs(std) <= 1e-8 for std in stds]
    return {"reward": mean(scored), "reward_std": unbiased_std(scored) if len(plain) > 1 else 0.0,
            "frac_reward_zero_std": sum(zero_std) / len(zero_std)}


# ============================================================================= inputs


class Case:
    """A random step in float64: rewards with unscorable rows, a group with one scorable row, an unscorable group, a
    tied group, one function left None on some rows; completions of different lengths (one of a single token), zeros
    on the right of the mask, and with `holes` a masked token inside some completions (a tool result: the loss mask
    is completion_mask * tool_mask); optionally a KL penalty per token (0 on masked tokens, as advantage_batch)."""

    def __init__(self, group_size: int, seed: int, kl: bool = False, holes: bool = False, width: int = WIDTH):
        num_groups = {1: 6, 2: 5, 4: 4}[group_size]
        rows = group_size * num_groups
        generator = torch.Generator().manual_seed(seed)
        per_func = (torch.rand(rows, 2, generator=generator, dtype=F64) * 2 - 0.5).tolist()  # (N, K)
        per_func[0][1] = NAN  # one function left None: the row is still scored
        unscorable, tied = {1: ([2], []), 2: ([1, 6, 8, 9], [4, 5]),  # G = 2: groups 0 and 3 keep one scorable row
                            4: ([1, 5, 6, 7, 12, 13, 14, 15], [8, 9, 10, 11])}[group_size]  # G = 4: group 1 keeps one
        for row in unscorable:
            per_func[row] = [NAN, NAN]
        for row in tied:
            per_func[row] = list(per_func[tied[0]])
        lengths = torch.randint(1, width + 1, (rows,), generator=generator).tolist()
        lengths[0], lengths[3] = width, 1  # a full row and a single-token row
        mask = [[1.0 if t < length else 0.0 for t in range(width)] for length in lengths]  # (N, T)
        if holes:  # tokens 1 and 2 of every third row of 4 tokens or more are a tool's
            for row in range(0, rows, 3):
                if lengths[row] >= 4:
                    mask[row][1] = mask[row][2] = 0.0
        penalty = (torch.rand(rows, width, generator=generator, dtype=F64) - 0.5).tolist() if kl else None
        if penalty is not None:  # beta * k1 per token: any sign; 0 on masked tokens
            penalty = [[0.1 * p * m for p, m in zip(row, row_mask)] for row, row_mask in zip(penalty, mask)]

        self.group_size, self.mask, self.width, self.weights = group_size, mask, width, [1.0, 0.5]
        self.per_func, self.penalty = per_func, penalty
        self.plain = ref_weighted_rewards(per_func, self.weights)  # (N,) the outcome, no KL
        self.rewards = self.plain if penalty is None else [  # r_i - sum_t beta k1_it, as advantage_batch
            r - sum(row) for r, row in zip(self.plain, penalty)]

    def batch(self, scale_rewards: str = "group") -> AdvantageBatch:
        return AdvantageBatch(
            torch.tensor(self.rewards, dtype=F64), torch.tensor(self.per_func, dtype=F64),
            torch.tensor(self.weights, dtype=F64), self.group_size, torch.tensor(self.mask, dtype=F64),
            None if self.penalty is None else torch.tensor(self.penalty, dtype=F64), scale_rewards)


def assert_stats(stats: dict[str, float], expected: dict[str, float]):
    """`reward` and `reward_std` to 1e-12; `frac_reward_zero_std` exactly, as the float32 number nearest the fraction:
    the product takes the mean of a float32 0/1 tensor, as trl (`is_std_zero.float().mean().item()`)."""
    frac = torch.tensor(expected["frac_reward_zero_std"], dtype=torch.float32).item()  # conversion only
    stats = dict(stats)
    abs_mean = stats.pop("advantages/abs_mean", None)  # per-token advantages: pinned where the advantages are
    assert abs_mean is None or abs_mean >= 0
    assert stats == pytest.approx({**expected, "frac_reward_zero_std": frac}, rel=1e-12, abs=1e-12)
    assert stats["frac_reward_zero_std"] == frac


def hand_batch(rewards: list[float], group_size: int, lengths: list[int], penalty=None) -> AdvantageBatch:
    """One reward function (weight 1); rewards NaN = unscorable."""
    width = max(lengths)
    mask = torch.tensor([[1.0 if t < length else 0.0 for t in range(width)] for length in lengths], dtype=F64)
    per_func = torch.tensor([[r] for r in rewards], dtype=F64)
    return AdvantageBatch(per_func[:, 0], per_func, torch.tensor([1.0], dtype=F64), group_size, mask,
                          None if penalty is None else torch.tensor(penalty, dtype=F64))


SIZES_AND_SEEDS = [(group_size, seed) for group_size in (1, 2, 4) for seed in (0, 1, 2)]


# ============================================================================= rloo


@pytest.mark.parametrize("group_size, seed", SIZES_AND_SEEDS)
def test_rloo_matches_the_leave_one_out_reference(group_size, seed):
    case = Case(group_size, seed)
    advantages = leave_one_out_advantages(torch.tensor(case.rewards, dtype=F64), group_size)  # (N,)
    assert_close(advantages, ref_rloo(case.rewards, group_size))


def test_rloo_hand_derived():
    # group 0: r = [1, 0, 1]: baselines [0.5, 1, 0.5] -> A = [0.5, -1, 0.5]
    # group 1: r = [2, NaN, 4]: the NaN row is out of the baselines: [4, -, 2] -> A = [-2, NaN, 2]
    # group 2: r = [3, NaN, NaN]: no scorable sibling -> 0 / 0 = NaN; the NaN rows stay NaN
    rewards = torch.tensor([1.0, 0.0, 1.0, 2.0, NAN, 4.0, 3.0, NAN, NAN], dtype=F64)
    assert_close(leave_one_out_advantages(rewards, 3), [0.5, -1.0, 0.5, -2.0, NAN, 2.0, NAN, NAN, NAN])
    # through the seam, every NaN is 0: (N, 1)
    advantages, _ = estimate_advantages(resolve_estimator("rloo"), hand_batch(rewards.tolist(), 3, [1] * 9))
    assert_close(advantages, [[0.5], [-1.0], [0.5], [-2.0], [0.0], [2.0], [0.0], [0.0], [0.0]])


# ============================================================================= reinforce_plus_plus_baseline


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("group_size, seed", SIZES_AND_SEEDS)
def test_reinforce_plus_plus_baseline_matches_the_reference(group_size, seed, holes):
    case = Case(group_size, seed, holes=holes)
    advantages = reinforce_plus_plus_baseline_advantages(torch.tensor(case.rewards, dtype=F64), group_size,
                                                         torch.tensor(case.mask, dtype=F64))  # (N,)
    assert_close(advantages, ref_reinforce_plus_plus_baseline(case.rewards, group_size, case.mask))


def test_reinforce_plus_plus_baseline_hand_derived():
    # G = 2, r = [1, 0 | 3, 3], lengths [1, 3 | 2, 2]: centred [0.5, -0.5, 0, 0]
    # tokens: 0.5 x 1, -0.5 x 3, 0 x 4 (8 tokens): mean -1/8; deviations 0.625, -0.375, 0.125
    # unbiased var = (0.625^2 + 3 * 0.375^2 + 4 * 0.125^2) / 7 = 0.875 / 7 = 0.125
    # -> A = [0.625, -0.375, 0.125, 0.125] / sqrt(0.125 + 1e-8) ~ [1.76777, -1.06066, 0.35355, 0.35355]
    batch = hand_batch([1.0, 0.0, 3.0, 3.0], 2, [1, 3, 2, 2])
    scale = 1 / math.sqrt(0.125 + 1e-8)
    advantages = reinforce_plus_plus_baseline_advantages(batch.rewards, 2, batch.completion_mask)
    assert_close(advantages, [0.625 * scale, -0.375 * scale, 0.125 * scale, 0.125 * scale])
    # G = 1 keeps the score (verl: a group of one has mean 0): r = [1, 3], lengths [1, 3]: tokens 1, 3, 3, 3
    # mean 2.5, var (2.25 + 3 * 0.25) / 3 = 1 -> A = [-1.5, 0.5] / sqrt(1 + 1e-8)
    batch = hand_batch([1.0, 3.0], 1, [1, 3])
    assert_close(reinforce_plus_plus_baseline_advantages(batch.rewards, 1, batch.completion_mask),
                 [-1.5 / math.sqrt(1 + 1e-8), 0.5 / math.sqrt(1 + 1e-8)])


# ============================================================================= reinforce_plus_plus


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("group_size, seed", SIZES_AND_SEEDS)
def test_reinforce_plus_plus_matches_the_reference(group_size, seed, kl, holes):
    case = Case(group_size, seed, kl=kl, holes=holes)
    batch = case.batch()
    advantages = reinforce_plus_plus_advantages(batch.rewards, batch.completion_mask, batch.kl_penalty)  # (N, T)
    # the reference reads the outcome (no KL) and the penalty per token; the product reads `rewards`, the outcome
    # minus the penalty's sum
    assert_close(advantages, ref_reinforce_plus_plus(case.plain, case.penalty, case.mask))


def test_reinforce_plus_plus_hand_derived():
    # row 0: outcome 1, penalty [0.25, 0.25, 0.5]: token rewards [-0.25, -0.25, 1 - 0.5] -> G = [0, 0.25, 0.5]
    # row 1: outcome 0, penalty [0.25] (one token): G = [-0.25]
    # tokens 0, 0.25, 0.5, -0.25: mean 0.125; deviations -0.125, 0.125, 0.375, -0.375
    # unbiased var = (2 * 0.125^2 + 2 * 0.375^2) / 3 = 0.3125 / 3 -> A = deviation / sqrt(0.3125 / 3 + 1e-8)
    # `rewards` is the outcome minus the penalty's sum: [1 - 1, 0 - 0.25]
    penalty = [[0.25, 0.25, 0.5], [0.25, 0.0, 0.0]]
    batch = hand_batch([0.0, -0.25], 1, [3, 1], penalty)
    scale = 1 / math.sqrt(0.3125 / 3 + 1e-8)
    assert_close(reinforce_plus_plus_advantages(batch.rewards, batch.completion_mask, batch.kl_penalty),
                 [[-0.125 * scale, 0.125 * scale, 0.375 * scale], [-0.375 * scale, 0.0, 0.0]])
    # an unscorable row: NaN on every token, and left out of the whitening
    batch = hand_batch([0.0, -0.25, NAN], 1, [3, 1, 2], penalty + [[0.5, 0.5, 0.0]])
    advantages = reinforce_plus_plus_advantages(batch.rewards, batch.completion_mask, batch.kl_penalty)
    assert_close(advantages, [[-0.125 * scale, 0.125 * scale, 0.375 * scale], [-0.375 * scale, 0.0, 0.0], [NAN] * 3])
    # a tool result inside the completion: mask [1, 0, 1], outcome 1, penalty [0.25, 0, 0.5] (0 where masked)
    # token rewards t0: -0.25, t2: 1 - 0.5 -> G = [0.25, -, 0.5] (the masked token gets 0); with a second row,
    # outcome 0, penalty [0.25] -> G = [-0.25]: tokens 0.25, 0.5, -0.25: mean 1/6, deviations 1/12, 1/3, -5/12
    # var = (1/144 + 16/144 + 25/144) / 2 = 7/48 -> A = [1/12, 0, 1/3 | -5/12] / sqrt(7/48 + 1e-8)
    # (verl's loop resets its running return at the masked token and would give t0 G = -0.25)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)
    penalty = torch.tensor([[0.25, 0.0, 0.5], [0.25, 0.0, 0.0]], dtype=F64)
    rewards = torch.tensor([1.0 - 0.75, 0.0 - 0.25], dtype=F64)  # the outcome minus the penalty's sum
    scale = 1 / math.sqrt(7 / 48 + 1e-8)
    assert_close(reinforce_plus_plus_advantages(rewards, mask, penalty),
                 [[scale / 12, 0.0, scale / 3], [-5 * scale / 12, 0.0, 0.0]])


def test_reinforce_plus_plus_reads_no_penalty_on_masked_tokens():
    # advantage_batch zeroes the penalty where the loss mask is 0; a value there (padding, a tool's token) is not read
    case = Case(2, seed=3, kl=True, holes=True)
    batch = case.batch()
    garbage = batch.kl_penalty + 7.0 * (1 - batch.completion_mask)  # (N, T): 7 on every masked token
    advantages = reinforce_plus_plus_advantages(batch.rewards, batch.completion_mask, garbage)
    assert_close(advantages, ref_reinforce_plus_plus(case.plain, case.penalty, case.mask))


# ============================================================================= opo


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("group_size, seed", SIZES_AND_SEEDS)
def test_opo_matches_the_reference(group_size, seed, holes):
    case = Case(group_size, seed, holes=holes)
    advantages = opo_advantages(torch.tensor(case.rewards, dtype=F64), group_size,
                                torch.tensor(case.mask, dtype=F64))  # (N,)
    assert_close(advantages, ref_opo(case.rewards, group_size, case.mask))


def test_opo_hand_derived():
    # r = [1, 0, 1], lengths [1, 2, 1]: b = (1 * 1 + 2 * 0 + 1 * 1) / 4 = 0.5 (the plain mean would be 2/3)
    # -> A = [0.5, -0.5, 0.5]
    # r = [2, NaN, 4], lengths [3, 5, 1]: the NaN row is out: b = (3 * 2 + 1 * 4) / 4 = 2.5 -> A = [-0.5, NaN, 1.5]
    batch = hand_batch([1.0, 0.0, 1.0, 2.0, NAN, 4.0], 3, [1, 2, 1, 3, 5, 1])
    assert_close(opo_advantages(batch.rewards, 3, batch.completion_mask), [0.5, -0.5, 0.5, -0.5, NAN, 1.5])
    # G = 1 keeps the score (verl: a group of one has baseline 0)
    batch = hand_batch([1.0, NAN, -2.0], 1, [1, 2, 3])
    assert_close(opo_advantages(batch.rewards, 1, batch.completion_mask), [1.0, NAN, -2.0])


# ============================================================================= a group with one scorable row


def test_one_scorable_row_rloo_has_no_signal_opo_and_baseline_centre_it_to_zero():
    # r = [1, NaN | 0, 2], G = 2, lengths [2, 2 | 1, 2]. rloo: row 0 has no scorable sibling -> NaN (no signal).
    # opo and reinforce_plus_plus_baseline take the mean over the scorable rows, which is r_0 itself: centred 0.
    # reinforce_plus_plus_baseline then whitens: tokens 0, 0 | -1 | 1, 1 -> mean 0.2, so row 0 gets -0.2 / std.
    # (verl has no unscorable rows; with row 1 dropped its group would have one response and keep r_0 = 1.)
    batch = hand_batch([1.0, NAN, 0.0, 2.0], 2, [2, 2, 1, 2])
    assert_close(leave_one_out_advantages(batch.rewards, 2), [NAN, NAN, -2.0, 2.0])
    assert_close(opo_advantages(batch.rewards, 2, batch.completion_mask), [0.0, NAN, -4 / 3, 2 / 3])
    # opo group 1: b = (1 * 0 + 2 * 2) / 3 = 4/3 -> A = [-4/3, 2/3]
    # baseline: tokens 0, 0, -1, 1, 1: mean 0.2, var (2 * 0.04 + 1.44 + 2 * 0.64) / 4 = 0.7
    scale = 1 / math.sqrt(0.7 + 1e-8)
    assert_close(reinforce_plus_plus_baseline_advantages(batch.rewards, 2, batch.completion_mask),
                 [-0.2 * scale, NAN, -1.2 * scale, 0.8 * scale])


# ============================================================================= normalize_advantages


@pytest.mark.parametrize("group_size, seed", SIZES_AND_SEEDS)
def test_normalized_per_completion_matches_the_reference(group_size, seed):
    case = Case(group_size, seed)
    values = ref_rloo(case.rewards, group_size)  # NaN where there is no signal
    mask = torch.tensor(case.mask, dtype=F64)
    assert_close(normalized(torch.tensor(values, dtype=F64), mask), ref_normalize(values))


@pytest.mark.parametrize("group_size, seed", SIZES_AND_SEEDS)
def test_normalized_per_token_uses_the_real_tokens(group_size, seed):
    case = Case(group_size, seed, kl=True, holes=True)
    values = ref_reinforce_plus_plus(case.plain, case.penalty, case.mask)  # 0 on padding
    mask = torch.tensor(case.mask, dtype=F64)
    actual = normalized(torch.tensor(values, dtype=F64), mask)  # (N, T)
    expected = ref_normalize_tokens(values, case.mask)
    real = mask.bool()  # padding is not pinned: the loss masks it
    torch.testing.assert_close(actual[real], torch.tensor(expected, dtype=F64)[real], equal_nan=True, **TIGHT)


def test_normalized_hand_derived():
    # A = [1, NaN, 3, 2]: over [1, 3, 2]: mean 2, unbiased std sqrt((1 + 1 + 0) / 2) = 1
    # -> [-1, NaN, 1, 0] / (1 + 1e-4)
    advantages = torch.tensor([1.0, NAN, 3.0, 2.0], dtype=F64)
    assert_close(normalized(advantages, torch.ones(4, 1, dtype=F64)), [-1 / 1.0001, NAN, 1 / 1.0001, 0.0])
    # per token, A = [[1, 9], [3, 2]] with mask [[1, 0], [1, 1]]: the 9 is padding -> the same mean 2 and std 1
    advantages = torch.tensor([[1.0, 9.0], [3.0, 2.0]], dtype=F64)
    actual = normalized(advantages, torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=F64))
    assert_close(actual[[0, 1, 1], [0, 0, 1]], [-1 / 1.0001, 1 / 1.0001, 0.0])


# ============================================================================= estimate_advantages


def reference_advantages(name: str, case: Case) -> list[list[float]]:
    """(N, 1) or (N, T) lists, NaN where there is no signal, before normalisation."""
    if name == "rloo":
        return [[a] for a in ref_rloo(case.rewards, case.group_size)]
    if name == "reinforce_plus_plus_baseline":
        return [[a] for a in ref_reinforce_plus_plus_baseline(case.rewards, case.group_size, case.mask)]
    if name == "opo":
        return [[a] for a in ref_opo(case.rewards, case.group_size, case.mask)]
    return ref_reinforce_plus_plus(case.plain, case.penalty, case.mask)


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "opo"])
def test_estimate_advantages_matches_the_references(name, group_size, normalize, kl):
    case = Case(group_size, seed=group_size, kl=kl, holes=kl)
    advantages, stats = estimate_advantages(resolve_estimator(name), case.batch(), normalize)
    expected = reference_advantages(name, case)
    if normalize:
        per_token = len(expected[0]) > 1
        expected = ref_normalize_tokens(expected, case.mask) if per_token else \
            [[a] for a in ref_normalize([row[0] for row in expected])]
    # unscorable rows 0 on every token, and every other NaN (no signal) 0
    expected = [[0.0 if is_nan(reward) or is_nan(a) else a for a in row] for reward, row in zip(case.rewards, expected)]
    assert advantages.shape == (len(case.rewards), case.width if name == "reinforce_plus_plus" else 1)
    if name == "reinforce_plus_plus" and normalize:  # padding is not pinned after normalisation: the loss masks it
        real = torch.tensor(case.mask, dtype=F64).bool()
        torch.testing.assert_close(advantages[real], torch.tensor(expected, dtype=F64)[real], **TIGHT)
    else:
        assert_close(advantages, expected)  # reinforce_plus_plus: 0 on masked tokens
    assert_stats(stats, ref_reward_statistics(case.plain, case.rewards, group_size))


def test_reward_statistics_hand_derived():
    # rloo, G = 2, one function: outcome r = [1, 1 | 0, 2 | 5, NaN], penalty sums [0.5, 0.25 | 0, 0 | 0, 0]
    # reward = mean(1, 1, 0, 2, 5) = 1.8; reward_std = sqrt((0.64 * 2 + 3.24 + 0.04 + 10.24) / 4) = sqrt(3.7)
    # (without the KL); the rewards with it, [0.5, 0.75 | 0, 2 | 5, NaN]: no group ties (the third has one scorable
    # row: its std is NaN, not 0) -> frac_reward_zero_std = 0; without the penalty group 0 ties -> 1/3
    per_func = torch.tensor([[1.0], [1.0], [0.0], [2.0], [5.0], [NAN]], dtype=F64)
    penalty = torch.tensor([[0.5], [0.25], [0.0], [0.0], [0.0], [0.0]], dtype=F64)
    mask, weights = torch.ones(6, 1, dtype=F64), torch.tensor([1.0], dtype=F64)
    batch = AdvantageBatch(per_func[:, 0] - penalty[:, 0], per_func, weights, 2, mask, penalty)
    _, stats = estimate_advantages(resolve_estimator("rloo"), batch)
    assert_stats(stats, {"reward": 1.8, "reward_std": math.sqrt(3.7), "frac_reward_zero_std": 0.0})
    batch = AdvantageBatch(per_func[:, 0], per_func, weights, 2, mask)
    _, stats = estimate_advantages(resolve_estimator("rloo"), batch)
    assert_stats(stats, {"reward": 1.8, "reward_std": math.sqrt(3.7), "frac_reward_zero_std": 1 / 3})


# ----------------------------------------------------------------------------- grpo and gdpo through the seam


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_grpo_through_the_seam_is_group_advantages(group_size, scale_rewards, normalize):
    batch = Case(group_size, seed=5).batch(scale_rewards)
    advantages, stats = estimate_advantages(resolve_estimator("grpo"), batch, normalize)
    expected, expected_stats = group_advantages(batch.rewards, group_size, scale_rewards)  # (N,)
    if normalize:
        expected = normalized(expected, batch.completion_mask)
    expected = expected.masked_fill(torch.isnan(batch.rewards), 0.0)  # unscorable rows 0
    torch.testing.assert_close(advantages, expected[:, None], **TIGHT)
    assert stats == expected_stats


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_gdpo_through_the_seam_is_decoupled_advantages(group_size, normalize):
    batch = Case(group_size, seed=6).batch()
    estimator = resolve_estimator("grpo", "normalize_then_sum")
    assert estimator is gdpo
    advantages, stats = estimate_advantages(estimator, batch, normalize)
    expected, expected_stats = decoupled_advantages(batch.rewards_per_func, batch.weights, group_size)  # (N,)
    if normalize:
        expected = normalized(expected, batch.completion_mask)
    expected = expected.masked_fill(torch.isnan(batch.rewards), 0.0)
    torch.testing.assert_close(advantages, expected[:, None], **TIGHT)
    assert stats == expected_stats


def test_grpo_reward_statistics_leave_the_kl_penalty_out():
    # r = [1, 0], penalty sums [0.5, 0.5]: the rewards without the KL have mean 0.5, logged by every estimator; the
    # batch says so with plain_rewards (grpo.core.update.advantage_batch sets it when the clip or the KL changed them)
    per_func, mask = torch.tensor([[1.0], [0.0]], dtype=F64), torch.ones(2, 1, dtype=F64)
    penalty = torch.tensor([[0.5], [0.5]], dtype=F64)
    batch = AdvantageBatch(per_func[:, 0] - 0.5, per_func, torch.tensor([1.0], dtype=F64), 2, mask, penalty,
                           plain_rewards=per_func[:, 0], beta=0.25)
    for name in ("rloo", "grpo"):
        stats = estimate_advantages(resolve_estimator(name), batch)[1]
        assert stats["reward"] == 0.5 and stats["kl"] == 1.0 / 0.25 / 2  # kl: the penalty's mean k1 per token


def test_grpo_normalized_counts_its_zero_rows():
    # grpo gives 0 (not NaN) to the rows without a signal (documented in grpo/algorithm/advantages.py), so
    # normalize_advantages counts them. r = [1, NaN | 0, 2], G = 2, scale "group": A = [0, 0, -a, a] with
    # a = 1 / (sqrt(2) + 1e-4); mean 0, unbiased std over 4 rows sqrt(2 a^2 / 3) -> b = a / (sqrt(2/3) a + 1e-4)
    a = 1 / (math.sqrt(2) + 1e-4)
    advantages, _ = estimate_advantages(resolve_estimator("grpo"), hand_batch([1.0, NAN, 0.0, 2.0], 2, [1] * 4), True)
    b = a / (math.sqrt(2 / 3) * a + 1e-4)
    assert_close(advantages, [[0.0], [0.0], [-b], [b]])


# ----------------------------------------------------------------------------- plug-ins through the seam


def test_a_plug_in_per_completion_gets_zero_on_unscorable_rows_and_nan_and_keeps_its_metrics():
    case = Case(2, seed=7)

    def plug_in(batch):  # finite values on unscorable rows too, NaN on one scorable row, its own metric
        values = torch.arange(len(batch.rewards), dtype=F64) + 1.0  # (N,)
        values[3] = NAN
        return values, {"my/metric": 1.5}

    advantages, stats = estimate_advantages(plug_in, case.batch())
    expected = [[0.0 if is_nan(r) or row == 3 else row + 1.0] for row, r in enumerate(case.rewards)]
    assert_close(advantages, expected)
    assert stats.pop("my/metric") == 1.5
    assert_stats(stats, ref_reward_statistics(case.plain, case.rewards, 2))


def test_a_plug_in_per_token_gets_zero_on_every_token_of_an_unscorable_row():
    case = Case(4, seed=8)

    def plug_in(batch):
        return torch.full(batch.completion_mask.shape, 2.0, dtype=F64)  # (N, T)

    advantages, stats = estimate_advantages(plug_in, case.batch())
    assert_close(advantages, [[0.0 if is_nan(r) else 2.0] * case.width for r in case.rewards])
    # logged over the real tokens (not the padding): 2 on the scorable rows' tokens, 0 on the unscorable rows'
    real = [(0.0 if is_nan(r) else 2.0) for r, row_mask in zip(case.rewards, case.mask) for m in row_mask if m]
    assert stats["advantages/abs_mean"] == pytest.approx(sum(real) / len(real), rel=1e-12)
    assert_stats(stats, ref_reward_statistics(case.plain, case.rewards, 4))


@pytest.mark.parametrize("bad", ["inf", "-inf", "int", "shape"])
def test_a_plug_in_output_is_checked_every_step(bad):
    batch = Case(2, seed=9).batch()

    def my_estimator(batch):
        values = torch.zeros(len(batch.rewards), dtype=F64)  # (N,)
        if bad in ("inf", "-inf"):
            values[2] = float(bad)
        return {"int": values.long(), "shape": values[1:]}.get(bad, values)

    with pytest.raises(ValueError, match="'my_estimator'"):  # resolve_estimator wraps a plug-in so
        estimate_advantages(checked(my_estimator, "my_estimator"), batch)


# ============================================================================= resolve_estimator, check_estimator


def test_resolve_estimator_picks_the_built_ins_by_name():
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "opo"):
        assert resolve_estimator(name) is ADVANTAGE_ESTIMATORS[name]
        assert resolve_estimator(name, "sum_then_normalize") is ADVANTAGE_ESTIMATORS[name]
    assert resolve_estimator("grpo", "normalize_then_sum") is gdpo
    # each name gives its own estimator: rloo through the seam is the leave-one-out reference
    case = Case(4, seed=10)
    advantages, _ = estimate_advantages(resolve_estimator("rloo"), case.batch())
    assert_close(advantages, [[0.0 if is_nan(a) else a] for a in ref_rloo(case.rewards, 4)])
    with pytest.raises(ValueError, match=r"advantage_estimator 'gae': not one of \['grpo', 'opo', "):
        resolve_estimator("gae")


def test_resolve_estimator_loads_a_plug_in_file(tmp_path):
    path = tmp_path / "my_estimators.py"
    path.write_text("import torch\n\ndef centred(batch):\n    return batch.rewards - torch.nanmean(batch.rewards)\n")
    estimator = resolve_estimator(f"{path}:centred")
    check_estimator(estimator, f"{path}:centred")
    # r = [1, 3]: mean 2 -> A = [-1, 1]
    advantages, _ = estimate_advantages(estimator, hand_batch([1.0, 3.0], 2, [1, 2]))
    assert_close(advantages, [[-1.0], [1.0]])


def two_arguments(batch, extra):
    return batch.rewards


def raises_runtime_error(batch):
    raise RuntimeError("boom")


def raises_key_error(batch):
    return {}["missing"]


def raises_value_error(batch):
    raise ValueError("boom")


def wrong_length(batch):
    return batch.rewards[1:]  # (N - 1,)


def wrong_width(batch):
    return torch.zeros(batch.completion_mask.shape[0], batch.completion_mask.shape[1] + 1)  # (N, T + 1)


def one_column(batch):
    return torch.zeros(len(batch.rewards), 1)  # (N, 1): neither (N,) nor (N, T)


def a_list(batch):
    return batch.rewards.tolist()


def an_infinity(batch):
    return torch.nan_to_num(batch.rewards).masked_fill(torch.arange(len(batch.rewards)) == 3, float("inf"))


def minus_infinity_per_token(batch):
    return torch.zeros_like(batch.completion_mask).masked_fill(batch.completion_mask == 0, -float("inf"))


def integers(batch):
    return torch.zeros(len(batch.rewards), dtype=torch.long)


def no_signal(batch):
    return torch.full((len(batch.rewards),), NAN)


def booleans(batch):
    return torch.zeros(len(batch.rewards), dtype=torch.bool)


@pytest.mark.parametrize("estimator, says", [
    (two_arguments, "must take one argument"), (raises_runtime_error, "raised RuntimeError"),
    (raises_key_error, "raised KeyError"), (wrong_length, r"returned \(7,\)"), (wrong_width, r"returned \(8, 6\)"),
    (one_column, r"returned \(8, 1\)"), (a_list, "returned list"), (an_infinity, "infinity"),
    (minus_infinity_per_token, "infinity"), (integers, "torch.int64"), (booleans, "torch.bool"),
    (raises_value_error, r"'raises_value_error' raised ValueError at .*test_estimators.py:\d+: boom \(on the "
                         r"start-of-run probe batch of 8 rows\)"),
    (no_signal, r"returned no finite advantage for any of the 8 rows"),
])
def test_check_estimator_refuses_a_broken_plug_in_by_name(estimator, says):
    with pytest.raises(ValueError, match=says) as error:
        check_estimator(estimator, estimator.__name__)
    assert f"advantage_estimator {estimator.__name__!r}" in str(error.value)


def test_check_advantages_names_the_estimator():
    batch = Case(2, seed=11).batch()
    check_advantages(torch.zeros(len(batch.rewards), dtype=F64), batch, "fine")  # (N,)
    check_advantages(torch.full(tuple(batch.completion_mask.shape), NAN), batch, "fine")  # (N, T); NaN = no signal
    with pytest.raises(ValueError, match="advantage_estimator 'mine' returned"):
        check_advantages(torch.zeros(len(batch.rewards) + 1), batch, "mine")


def defaulted_second_argument(batch, scale=2.0):
    return batch.rewards * scale


def variadic(batch, *args, **kwargs):
    return torch.zeros_like(batch.completion_mask)  # (N, T)


def with_metrics(batch):
    return torch.zeros_like(batch.rewards), {"my/metric": 1.0}


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("estimator", [*ADVANTAGE_ESTIMATORS.values(), gdpo, defaulted_second_argument, variadic,
                                       with_metrics], ids=lambda fn: fn.__name__)
def test_check_estimator_accepts_the_built_ins_and_correct_plug_ins(estimator, group_size, kl):
    check_estimator(estimator, estimator.__name__, group_size, kl)
