import math

import pytest
import torch

from grpo.loss import LOSS_TYPES, LossOptions, aggregate_loss, k3_kl, loss_statistics, per_token_loss, token_loss

T_MAX = 6


def _inputs(seed, n=4, off_policy=True):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(n, T_MAX, generator=g) * 3).requires_grad_()
    old = logps.detach() + (torch.randn(n, T_MAX, generator=g) * 0.3 if off_policy else 0.0)
    ref = logps.detach() + torch.randn(n, T_MAX, generator=g) * 0.2
    advantages = torch.randn(n, generator=g)
    lengths = torch.randint(1, T_MAX + 1, (n,), generator=g)
    mask = (torch.arange(T_MAX)[None, :] < lengths[:, None]).float()
    return logps, old, ref, advantages, mask


def _naive_loss(logps, old, ref, adv, mask, *, beta, eps, eps_high, delta, bias_kl, level, loss_type, ga, total_tokens):
    """Per-token Python loop written from the equations in grpo/loss.py's docstring."""
    n, T = logps.shape
    row_losses, token_sum, token_count = [], 0.0, 0.0
    for i in range(n):
        length = int(mask[i].sum())
        seq_log_ratio = sum(logps[i, t] - old[i, t] for t in range(length)) / max(length, 1)
        row_sum = 0.0
        for t in range(length):
            log_ratio = logps[i, t] - old[i, t] if level == "token" else seq_log_ratio
            rho = torch.exp(log_ratio)
            clipped = torch.clamp(rho, 1 - eps, 1 + eps_high)
            capped = rho if delta is None else torch.clamp(rho, max=delta)
            l = -torch.min(capped * adv[i], clipped * adv[i])
            if beta:
                d = ref[i, t] - logps[i, t]
                kl = torch.exp(d) - d - 1
                if bias_kl:
                    kl = kl * rho  # trl 1.16: the ratio before the delta cap
                l = l + beta * kl
            row_sum = row_sum + l
        row_losses.append(row_sum / max(length, 1))
        token_sum = token_sum + row_sum
        token_count += length
    if loss_type == "grpo":
        return sum(row_losses) / n / ga
    if loss_type == "bnpo":
        return token_sum / max(token_count, 1) / ga
    if loss_type == "dr_grpo":
        return token_sum / (n * T_MAX) / ga
    return token_sum / total_tokens


CONFIGS = [
    dict(beta=0.0, eps=0.2, eps_high=0.2, delta=None, bias_kl=False, level="token"),
    dict(beta=0.04, eps=0.2, eps_high=0.28, delta=None, bias_kl=True, level="token"),
    dict(beta=0.04, eps=0.2, eps_high=0.2, delta=1.5, bias_kl=False, level="token"),
    dict(beta=0.04, eps=0.2, eps_high=0.2, delta=1.05, bias_kl=True, level="token"),
    dict(beta=0.04, eps=3e-4, eps_high=4e-4, delta=1.0002, bias_kl=True, level="sequence"),
    dict(beta=0.0, eps=3e-4, eps_high=4e-4, delta=None, bias_kl=False, level="sequence"),
    dict(beta=0.1, eps=0.2, eps_high=0.2, delta=None, bias_kl=True, level="sequence"),
]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c['level']}-beta{c['beta']}-d{c['delta']}")
def test_against_naive_loop(loss_type, config):
    logps, old, ref, adv, mask = _inputs(seed=0)
    total_tokens = mask.sum().item() * 2  # pretend this micro-batch is half of the step's tokens
    options = LossOptions(beta=config["beta"], epsilon=config["eps"], epsilon_high=config["eps_high"],
                          delta=config["delta"], use_bias_correction_kl=config["bias_kl"],
                          importance_sampling_level=config["level"])
    loss = per_token_loss(logps, old, adv, mask, ref, options)
    fast = aggregate_loss(loss, mask, loss_type, num_micro_batches=2, max_completion_length=T_MAX,
                          num_items_in_batch=total_tokens)
    (fast_grad,) = torch.autograd.grad(fast, logps)
    naive = _naive_loss(logps, old, ref, adv, mask, loss_type=loss_type, ga=2, total_tokens=total_tokens, **config)
    (naive_grad,) = torch.autograd.grad(naive, logps)
    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fast_grad, naive_grad, rtol=1e-5, atol=1e-7)


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    g = torch.Generator().manual_seed(0)
    logps, ref = -torch.rand(100, generator=g) * 5, -torch.rand(100, generator=g) * 5
    assert (k3_kl(logps, ref) >= 0).all()
    assert torch.equal(k3_kl(logps, logps), torch.zeros(100))
    # Hand value: ref - logp = 1 -> e - 1 - 1 = 0.71828...
    assert k3_kl(torch.tensor([0.0]), torch.tensor([1.0])).item() == pytest.approx(math.e - 2)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_gradient_is_reinforce(loss_type):
    # With old = logps.detach(), rho = 1 and d(-min(rho A, clip(rho) A))/dlogp = -A: the REINFORCE gradient.
    logps, _, _, adv, mask = _inputs(seed=3)
    loss = per_token_loss(logps, logps.detach(), adv, mask)
    stats = loss_statistics(logps, logps.detach(), adv, mask)
    value = aggregate_loss(loss, mask, loss_type, max_completion_length=T_MAX, num_items_in_batch=mask.sum())
    (grad,) = torch.autograd.grad(value, logps)
    reinforce = aggregate_loss(-adv[:, None] * logps, mask, loss_type, max_completion_length=T_MAX,
                               num_items_in_batch=mask.sum())
    (expected,) = torch.autograd.grad(reinforce, logps)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)
    assert stats.clip_region == 0.0 and stats.kl is None


def _accumulated_grad(logps, old, ref, adv, mask, loss_type, splits):
    total = torch.zeros_like(logps)
    for rows in splits:
        options = LossOptions(beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True)
        loss = per_token_loss(logps[rows], old[rows], adv[rows], mask[rows], ref[rows], options)
        value = aggregate_loss(loss, mask[rows], loss_type, num_micro_batches=len(splits),
                               max_completion_length=T_MAX, num_items_in_batch=mask.sum())
        total += torch.autograd.grad(value, logps)[0]
    return total


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_accumulate_to_the_full_batch_gradient(loss_type):
    logps, old, ref, adv, mask = _inputs(seed=5, n=8)
    if loss_type == "bnpo":
        # bnpo (trl's definition) normalises per micro-batch: exact when micro-batches hold equal token counts.
        mask = (torch.arange(T_MAX)[None, :] < torch.tensor([3, 5, 2, 6, 4, 4, 6, 2])[:, None]).float()
    full = _accumulated_grad(logps, old, ref, adv, mask, loss_type, [slice(0, 8)])
    split = _accumulated_grad(logps, old, ref, adv, mask, loss_type, [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)])
    torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-8)


def test_bnpo_differs_under_unequal_token_counts():
    # The documented caveat above, pinned: unequal token counts per micro-batch change bnpo, not dapo.
    logps, old, ref, adv, mask = _inputs(seed=5, n=8)
    mask = (torch.arange(T_MAX)[None, :] < torch.tensor([1, 1, 6, 6, 1, 1, 6, 6])[:, None]).float()
    halves = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert not torch.allclose(_accumulated_grad(logps, old, ref, adv, mask, "bnpo", halves),
                              _accumulated_grad(logps, old, ref, adv, mask, "bnpo", [slice(0, 8)]))
    torch.testing.assert_close(_accumulated_grad(logps, old, ref, adv, mask, "dapo", halves),
                               _accumulated_grad(logps, old, ref, adv, mask, "dapo", [slice(0, 8)]))


def test_clip_statistics_hand_derived():
    # Two rows, one token each. Row 0: rho = e^0.5 = 1.65 > 1.2 with A > 0 -> high-clipped.
    # Row 1: rho = e^-0.5 = 0.61 < 0.8 with A < 0 -> low-clipped.
    logps = torch.tensor([[0.0], [0.0]])
    old = torch.tensor([[-0.5], [0.5]])
    stats = loss_statistics(logps, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    assert (stats.clip_high, stats.clip_low, stats.clip_region) == (0.5, 0.5, 1.0)
    # Same ratios with the advantages' signs flipped: the min() picks the unclipped branch, nothing counts.
    stats = loss_statistics(logps, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 1))
    assert stats.clip_region == 0.0
    # delta = 1.1 caps row 0's rho at 1.1 < 1.2 before it is counted (trl's order): no longer high-clipped.
    stats = loss_statistics(logps, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), options=LossOptions(delta=1.1))
    assert (stats.clip_high, stats.clip_low) == (0.0, 0.5)


def test_delta_caps_the_surrogate_but_not_the_kl_correction():
    # One token, on trl 1.16's order: rho = e^0.5 = 1.6487, capped at delta = 1.2 in the unclipped branch only.
    # A = 1: -min(1.2 * 1, clip(1.6487, 0.8, 1.2) * 1) = -1.2. KL: ref - logp = -0.5 -> e^-0.5 + 0.5 - 1 = 0.10653,
    # times the uncapped rho 1.6487 = 0.17564 (times the capped 1.2 it would be 0.12784). beta = 1.
    logps, old, ref = torch.tensor([[0.0]]), torch.tensor([[-0.5]]), torch.tensor([[-0.5]])
    options = LossOptions(beta=1.0, delta=1.2, use_bias_correction_kl=True)
    kl = (math.exp(-0.5) + 0.5 - 1) * math.exp(0.5)
    loss = per_token_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 1), ref, options)
    assert loss.item() == pytest.approx(-1.2 + kl, rel=1e-6)
    assert loss_statistics(logps, old, torch.tensor([1.0]), torch.ones(1, 1), ref, options).kl == pytest.approx(kl, rel=1e-6)
    assert token_loss(logps, old, torch.tensor([[1.0]]), ref, options).item() == pytest.approx(-1.2 + kl, rel=1e-6)


def test_errors_name_the_problem():
    logps, old, ref, adv, mask = _inputs(seed=0)
    with pytest.raises(ValueError, match="beta != 0 needs reference"):
        per_token_loss(logps, old, adv, mask, options=LossOptions(beta=0.1))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        LossOptions(importance_sampling_level="seq")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        LossOptions(loss_type="ppo")
    loss = per_token_loss(logps, old, adv, mask)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        aggregate_loss(loss, mask, "ppo")
