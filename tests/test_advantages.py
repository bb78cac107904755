import math

import pytest
import torch

from grpo.algorithm.advantages import group_advantages, nanstd, reward_function_stats, weighted_rewards

nan = float("nan")


def test_hand_derived_group_case():
    # Group of 4: rewards [1, 2, 3, 4]: mean 2.5, unbiased std sqrt(5/3) = 1.290994...
    # A = (r - 2.5) / (1.290994 + 1e-4).
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    advantages, stats = group_advantages(rewards, group_size=4)
    std = math.sqrt(5 / 3)
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-4)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=0)
    assert stats["reward"] == pytest.approx(2.5) and stats["frac_reward_zero_std"] == 0.0


def test_equal_rewards_give_zero_advantage():
    # Group 0 all equal (std 0 -> A = 0 / 1e-4 = 0); group 1 = [0, 1]: mean .5, std sqrt(.5) = .7071.
    advantages, stats = group_advantages(torch.tensor([0.5, 0.5, 0.0, 1.0]), group_size=2)
    assert advantages[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(advantages[2:], torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 1e-4))
    assert stats["frac_reward_zero_std"] == 0.5


def test_unscorable_row_is_left_out_and_gets_zero():
    # Function 0 returns None on row 1, function 1 on rows 1 and 3: row 1 is unscorable.
    per_func = torch.tensor([[1.0, 0.0], [nan, nan], [3.0, nan], [0.0, nan]])
    rewards = weighted_rewards(per_func, torch.tensor([1.0, 2.0]))
    assert math.isnan(rewards[1]) and rewards[[0, 2, 3]].tolist() == [1.0, 3.0, 0.0]
    # Group of 4 with row 1 out: mean of [1, 3, 0] = 4/3, std over those three = sqrt(7/3).
    advantages, _ = group_advantages(rewards, group_size=4)
    std = math.sqrt(((1 - 4 / 3) ** 2 + (3 - 4 / 3) ** 2 + (0 - 4 / 3) ** 2) / 2)
    expected = torch.tensor([1 - 4 / 3, 0.0, 3 - 4 / 3, -4 / 3]) / (std + 1e-4)
    expected[1] = 0.0
    torch.testing.assert_close(advantages, expected)


def test_group_of_two_and_none_scaling():
    # [0, 2]: mean 1, std sqrt(2); "none" keeps the centred reward (Dr. GRPO).
    advantages, _ = group_advantages(torch.tensor([0.0, 2.0]), 2, "none")
    assert advantages.tolist() == [-1.0, 1.0]
    advantages, _ = group_advantages(torch.tensor([0.0, 2.0]), 2, "group")
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1e-4))


def test_batch_scaling_uses_the_batch_std_and_group_mean():
    rewards = torch.tensor([0.0, 1.0, 5.0, 7.0])
    advantages, _ = group_advantages(rewards, 2, "batch")
    std = torch.tensor([0.0, 1.0, 5.0, 7.0]).std().item()  # unbiased over all four
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5, -1.0, 1.0]) / (std + 1e-4))


def _loop_advantages(rewards, group_size, scale):
    """Plain-Python reference from the equations."""
    values = rewards.tolist()
    num_rows = len(values)

    def std(xs):
        xs = [x for x in xs if not math.isnan(x)]
        if len(xs) < 2:
            return nan
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    batch_std = std(values)
    out = []
    for i in range(num_rows):
        group = values[(i // group_size) * group_size : (i // group_size + 1) * group_size]
        scored = [x for x in group if not math.isnan(x)]
        mean = sum(scored) / len(scored) if scored else nan
        a = values[i] - mean
        if scale == "group":
            a = a / (std(group) + 1e-4)
        elif scale == "batch":
            a = a / (batch_std + 1e-4)
        out.append(0.0 if math.isnan(a) else a)
    return torch.tensor(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_matches_python_loop_on_random_inputs(scale, seed):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (24,), generator=generator).float() * 0.5
    rewards[torch.rand(24, generator=generator) < 0.15] = nan
    advantages, _ = group_advantages(rewards, 6, scale)
    torch.testing.assert_close(advantages, _loop_advantages(rewards, 6, scale), rtol=1e-5, atol=1e-6)


def test_reward_function_stats_and_nanstd():
    per_func = torch.tensor([[1.0, nan], [3.0, 2.0]])
    stats = reward_function_stats(per_func, ["a", "b"])
    assert stats["rewards/a/mean"] == 2.0 and stats["rewards/a/std"] == pytest.approx(math.sqrt(2))
    assert stats["rewards/b/mean"] == 2.0 and math.isnan(stats["rewards/b/std"])
    assert math.isnan(nanstd(torch.tensor([1.0, nan])).item())


def test_bad_group_size_is_reported():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.zeros(6), 4)
    from grpo.config import GRPOConfig  # the choice is validated once, by the config

    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        GRPOConfig(scale_rewards="grp").validate()


def test_normalize_then_sum_hand_derived():
    # GDPO: two groups of 2, two rewards (weights 1 and 2). Group 0: f1 = [1, 0], f2 = [0, 0]; group 1: f1 = [1, 1],
    # f2 = [2, 0]. Per reward and group: (r - mean) / (std + 1e-4), std unbiased -> f1 group 0: +-0.5 / (0.70711 + 1e-4),
    # f2 group 0 and f1 group 1: 0 (tied), f2 group 1: +-1 / (1.41421 + 1e-4). Weighted sum s, then over the batch
    # (s - mean(s)) / (std(s) + 1e-4).
    from grpo.algorithm.advantages import decoupled_advantages

    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [1.0, 0.0]])
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    b = 2 * 1.0 / (math.sqrt(2.0) + 1e-4)
    s = [a, -a, b, -b]
    mean = sum(s) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 3)
    expected = torch.tensor([(x - mean) / (std + 1e-4) for x in s])
    advantages, stats = decoupled_advantages(rewards, torch.tensor([1.0, 2.0]), group_size=2)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-7)
    assert stats["reward"] == pytest.approx((1 + 0 + 5 + 1) / 4)  # the plain weighted sum is what is logged
    # A row no function scored stays out and gets 0, as with sum_then_normalize.
    rewards[1] = float("nan")
    advantages, _ = decoupled_advantages(rewards, torch.tensor([1.0, 2.0]), group_size=2)
    assert advantages[1].item() == 0.0 and torch.isfinite(advantages).all()


def test_tied_groups():
    from grpo.algorithm.advantages import tied_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0, 3.0, 3.0])
    # group 0 ties; group 1 differs; group 2 has one scorable row (no spread); group 3 ties.
    assert tied_groups(rewards, 2).tolist() == [True, False, True, True]


# The edges of the group and batch statistics: one row per group, one row in all, two rows; and the logged
# reward_std, checked by value (a mutation run showed none of them pinned).
SCALINGS = [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("group", "normalize_then_sum")]


def _advantages(per_func, weights, group_size, scale, aggregation):
    from grpo.algorithm.advantages import decoupled_advantages

    if aggregation == "normalize_then_sum":
        return decoupled_advantages(per_func, weights, group_size)
    return group_advantages(weighted_rewards(per_func, weights), group_size, scale)


@pytest.mark.parametrize("scale,aggregation", SCALINGS)
def test_groups_of_one_have_no_spread(scale, aggregation):
    # G = 1: every row is its own group, so no row has a learning signal and every group counts as zero-std.
    per_func = torch.tensor([[1.0], [3.0], [8.0]])
    advantages, stats = _advantages(per_func, torch.tensor([1.0]), 1, scale, aggregation)
    assert advantages.tolist() == [0.0, 0.0, 0.0]
    assert stats["reward"] == pytest.approx(4.0)
    assert stats["reward_std"] == pytest.approx(math.sqrt(((1 - 4) ** 2 + (3 - 4) ** 2 + (8 - 4) ** 2) / 2))
    # the std the advantages were scaled by: each group's (none), the batch's (not zero), GDPO's batch std of zeros
    assert stats["frac_reward_zero_std"] == (0.0 if scale == "batch" else 1.0)


@pytest.mark.parametrize("scale,aggregation", SCALINGS)
def test_a_single_row_has_zero_advantage_and_zero_std(scale, aggregation):
    advantages, stats = _advantages(torch.tensor([[5.0]]), torch.tensor([1.0]), 1, scale, aggregation)
    assert advantages.tolist() == [0.0]
    assert stats == {"reward": 5.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0}


@pytest.mark.parametrize("scale,aggregation", SCALINGS)
def test_two_rows_use_their_unbiased_std(scale, aggregation):
    # One group of two: [0, 2] -> mean 1, unbiased std sqrt(2); every scaling gives -+1 / (sqrt(2) + 1e-4)
    # (GDPO: the per-reward values -+0.7071, then the batch std of those, sqrt(2) * 0.7071 = 1.0).
    advantages, stats = _advantages(torch.tensor([[0.0], [2.0]]), torch.tensor([1.0]), 2, scale, aggregation)
    if aggregation == "normalize_then_sum":
        unit = 1 / (math.sqrt(2) + 1e-4)
        expected = torch.tensor([-unit, unit]) / (math.sqrt(2) * unit + 1e-4)
    else:
        expected = torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=0)
    assert stats["reward_std"] == pytest.approx(math.sqrt(2))
    assert stats["frac_reward_zero_std"] == 0.0


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("num_rows,group_size", [(4, 0), (4, -2), (4, 3), (6, 4)])
def test_rows_that_do_not_split_into_groups_are_refused(aggregation, num_rows, group_size):
    per_func = torch.zeros(num_rows, 1)
    with pytest.raises(ValueError, match=f"{num_rows} rewards do not split into groups of {group_size}"):
        _advantages(per_func, torch.tensor([1.0]), group_size, "group", aggregation)


def test_reward_weights_must_match_the_reward_columns():
    with pytest.raises(AssertionError):
        weighted_rewards(torch.ones(4, 2), torch.ones(1))  # would broadcast one weight over both columns
    with pytest.raises(AssertionError):
        weighted_rewards(torch.ones(4), torch.ones(4))


def test_one_row_reward_function_stats_have_zero_std():
    assert reward_function_stats(torch.tensor([[2.0]]), ["a"]) == {"rewards/a/mean": 2.0, "rewards/a/std": 0.0}
