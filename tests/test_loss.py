import dataclasses
import math

import pytest
import torch

from grpo.algorithm.loss import EntropyControl, entropy_bonus, high_entropy_mask
from grpo.algorithm.loss import LOSS_TYPES, LossOptions, aggregate_loss, k3_kl, off_policy_mask, per_token_loss, token_loss
from grpo.algorithm.loss import loss_statistics, loss_terms, policy_loss_value, vespo_phi
from grpo.config import GRPOConfig

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


def _naive_loss(logps, old, ref, adv, mask, *, beta, eps, eps_high, delta, bias_kl, level, loss_type, ga, total_tokens,
                sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0)):
    """Per-token Python loop written from the equations in grpo/algorithm/loss.py's docstring."""
    n, T = logps.shape
    row_losses, row_sums, token_sum, token_count = [], [], 0.0, 0.0
    for i in range(n):
        length = int(mask[i].sum())
        seq_log_ratio = sum(logps[i, t] - old[i, t] for t in range(length)) / max(length, 1)
        if loss_type == "rloo":  # the whole completion's probability ratio: the sum, not the mean
            seq_log_ratio = sum(logps[i, t] - old[i, t] for t in range(length))
        # vespo: w = exp(sum_t log rho_t), phi(w) = e^lam w^k e^(-lam w), k and lam by the sign of A; no gradient
        k, lam = (vespo[0], vespo[1]) if adv[i] >= 0 else (vespo[2], vespo[3])
        log_w = float(sum((logps[i, t] - old[i, t]).detach() for t in range(length)))
        phi = math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))
        row_sum = 0.0
        for t in range(length):
            log_ratio = logps[i, t] - old[i, t] if level == "token" and loss_type != "rloo" else seq_log_ratio
            rho = torch.exp(log_ratio)
            if loss_type == "cispo":
                l = -min(rho.item(), eps_high) * adv[i] * logps[i, t]
            elif loss_type == "sapo":
                tau = sapo[0] if adv[i] > 0 else sapo[1]
                l = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * adv[i]
            elif loss_type == "vespo":
                l = -phi * adv[i] * logps[i, t]
            else:
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
        row_sums.append(row_sum)
        token_sum = token_sum + row_sum
        token_count += length
    if loss_type in ("grpo", "sapo", "rloo"):
        return sum(row_losses) / n / ga
    if loss_type == "luspo":
        return sum(row_sums) / n / ga
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
                          importance_sampling_level=config["level"], loss_type=loss_type)
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
    # cispo (weight min(1, eps_high) = 1), sapo (gate slope 1 at rho = 1) and vespo (phi(1) = 1) too.
    logps, _, _, adv, mask = _inputs(seed=3)
    options = LossOptions(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None)
    loss = per_token_loss(logps, logps.detach(), adv, mask, options=options)
    stats = loss_statistics(logps, logps.detach(), adv, mask, options=options)
    value = aggregate_loss(loss, mask, loss_type, max_completion_length=T_MAX, num_items_in_batch=mask.sum())
    (grad,) = torch.autograd.grad(value, logps)
    # rloo's ratio is the completion's: d rho_i / d logp_t = rho_i, so each token gets -A (summed per row, mean over rows)
    reinforce = aggregate_loss(-adv[:, None] * logps, mask, "luspo" if loss_type == "rloo" else loss_type,
                               max_completion_length=T_MAX, num_items_in_batch=mask.sum())
    (expected,) = torch.autograd.grad(reinforce, logps)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)
    assert stats.clip_region in (0.0, None) and stats.kl is None


def _accumulated_grad(logps, old, ref, adv, mask, loss_type, splits):
    total = torch.zeros_like(logps)
    for rows in splits:
        options = LossOptions(beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True, loss_type=loss_type)
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


# ---- the objectives beyond the clipped surrogate, the masks and the entropy bonus, each on hand-derived values ----

def _one_token(logp, old, adv, options, ref=None):
    logps = torch.tensor([[logp]], requires_grad=True)
    loss = per_token_loss(logps, torch.tensor([[old]]), torch.tensor([adv]), torch.ones(1, 1),
                          None if ref is None else torch.tensor([[ref]]), options)
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    stats = loss_statistics(logps.detach(), torch.tensor([[old]]), torch.tensor([adv]), torch.ones(1, 1),
                            None if ref is None else torch.tensor([[ref]]), options)
    return loss.item(), grad.item(), stats


def test_cispo_clips_the_detached_weight():
    # logp = -1, old = -1.5: rho = e^0.5 = 1.6487 > eps_high = 1.2, so the weight is 1.2 (detached):
    # l = -1.2 * A * logp = -1.2 * 1 * -1 = 1.2, dl/dlogp = -1.2 * A (the token keeps its gradient).
    options = LossOptions(loss_type="cispo", epsilon_high=1.2)
    loss, grad, stats = _one_token(-1.0, -1.5, 1.0, options)
    assert (loss, grad) == (pytest.approx(1.2), pytest.approx(-1.2))
    assert stats.cispo_clip == 1.0 and stats.clip_region is None
    # A < 0: the same cap applies to the weight, but trl counts a clip only for A > 0.
    loss, grad, stats = _one_token(-1.0, -1.5, -1.0, options)
    assert (loss, grad, stats.cispo_clip) == (pytest.approx(-1.2), pytest.approx(1.2), 0.0)
    # Below the cap the weight is rho itself: logp = -1.5, rho = e^-0.5 -> l = -e^-0.5 * 1 * -1.5.
    loss, _, stats = _one_token(-1.5, -1.0, 1.0, options)
    assert loss == pytest.approx(1.5 * math.exp(-0.5)) and stats.cispo_clip == 0.0


def test_sapo_soft_gate():
    # rho = e^0.5; A = 1 with tau_pos = 1: l = -(4 / 1) sigmoid(rho - 1) * 1,
    # dl/dlogp = -4 s (1 - s) rho (the gate's slope times d rho / d logp = rho).
    rho = math.exp(0.5)
    s = 1 / (1 + math.exp(-(rho - 1)))
    loss, grad, stats = _one_token(-1.0, -1.5, 1.0, LossOptions(loss_type="sapo"))
    assert loss == pytest.approx(-4 * s) and grad == pytest.approx(-4 * s * (1 - s) * rho)
    assert stats.clip_region is None and stats.cispo_clip is None
    # A = -2 takes tau_neg = 1.05: l = -(4 / 1.05) sigmoid(1.05 (rho - 1)) * -2.
    s = 1 / (1 + math.exp(-1.05 * (rho - 1)))
    loss, _, _ = _one_token(-1.0, -1.5, -2.0, LossOptions(loss_type="sapo"))
    assert loss == pytest.approx(4 / 1.05 * s * 2)


def test_vespo_gamma_weight_of_the_sequence_ratio():
    # Two tokens with log-ratios 0.1 and 0.2: log w = 0.3 (a sum, not a mean). A = 1 -> k = 2, lambda = 3:
    # phi = e^3 w^2 e^(-3 w) = 0.9265..., detached; l_t = -phi A logp_t, dl/dlogp_t = -phi A.
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.2]])
    w = math.exp(0.3)
    phi = math.exp(3) * w**2 * math.exp(-3 * w)
    options = LossOptions(loss_type="vespo")
    loss = per_token_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 2), options=options)
    torch.testing.assert_close(loss.detach(), torch.tensor([[phi * 1.0, phi * 2.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    torch.testing.assert_close(grad, torch.tensor([[-phi, -phi]]))
    stats = loss_statistics(logps.detach(), old, torch.tensor([1.0]), torch.ones(1, 2), options=options)
    assert stats.vespo_phi == pytest.approx(phi)
    # A < 0: k = 3, lambda = 2; phi(1) = 1 for every k, lambda (on-policy: the REINFORCE weight).
    phi_neg = math.exp(2) * w**3 * math.exp(-2 * w)
    loss = per_token_loss(logps, old, torch.tensor([-1.0]), torch.ones(1, 2), options=options)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-phi_neg, -2 * phi_neg]]))


def test_luspo_sums_each_row_then_averages():
    # Rows of 2 and 3 real tokens with sequence-level terms 1 and 2: (1 * 2 + 2 * 3) / 2 rows = 4, / 2 micro-batches.
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert aggregate_loss(torch.tensor([[1.0], [2.0]]), mask, "luspo", num_micro_batches=2).item() == 2.0


def test_off_policy_mask_drops_negative_far_off_policy_completions():
    # Row 0: A < 0, mean(old - logp) = 0.6 > 0.5 -> dropped. Row 1: A < 0, 0.4 -> kept. Row 2: A > 0, 0.9 -> kept.
    logps = torch.zeros(3, 2)
    old = torch.tensor([[0.5, 0.7], [0.4, 0.4], [0.9, 0.9]])
    adv = torch.tensor([[-1.0], [-1.0], [1.0]])
    assert off_policy_mask(adv, logps, old, torch.ones(3, 2), 0.5).flatten().tolist() == [0.0, 1.0, 1.0]
    # In the loss it removes the policy term only: the KL term stays (beta = 1, ref = logp + 1 -> e - 2 per token).
    options = LossOptions(off_policy_mask_threshold=0.5, beta=1.0, epsilon=0.9, epsilon_high=9.0)
    loss = per_token_loss(logps, old, adv.flatten(), torch.ones(3, 2), logps + 1.0, options)
    kl = math.e - 2
    torch.testing.assert_close(loss[0], torch.tensor([kl, kl]))
    torch.testing.assert_close(loss[1], torch.tensor([math.exp(-0.4) + kl] * 2))  # -min(rho A, clip A) = rho
    # Padding does not count in the mean: row 0 with its second token masked has mean 0.5 <= 0.5 -> kept.
    assert off_policy_mask(adv[:1], logps[:1], old[:1], torch.tensor([[1.0, 0.0]]), 0.5).item() == 1.0


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens():
    entropy = torch.tensor([[0.1, 0.5, 7.0], [0.9, 0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 7.0 is padding and must not count
    # Real values sorted 0.1 0.3 0.5 0.9: the 0.5 quantile (torch.quantile, linear) is 0.4 -> keep 0.5 and 0.9.
    kept = high_entropy_mask(entropy, mask, 0.5)
    assert kept.tolist() == [[False, True, False], [True, False, False]]
    assert high_entropy_mask(entropy, mask, 0.0).sum().item() == 1  # only the highest
    assert high_entropy_mask(entropy, mask, 1.0).sum().item() == 4  # all real tokens
    # In the loss: the policy term of the dropped tokens is 0 (on-policy REINFORCE term -A elsewhere).
    logps = torch.zeros(2, 3, requires_grad=True)
    options = LossOptions(top_entropy_quantile=0.5)
    loss = per_token_loss(logps, logps.detach(), torch.tensor([1.0, 2.0]), mask, options=options, entropy=entropy)
    assert loss.detach().tolist() == [[0.0, -1.0, 0.0], [-2.0, 0.0, 0.0]]
    stats = loss_statistics(logps.detach(), logps.detach(), torch.tensor([1.0, 2.0]), mask, options=options,
                            entropy=entropy)
    assert (stats.entropy_sum, stats.entropy_count) == (pytest.approx(1.4), 2.0)  # what the bonus acts on
    with pytest.raises(ValueError, match="needs the token entropies"):
        per_token_loss(logps, logps.detach(), torch.tensor([1.0, 2.0]), mask, options=options)


def test_entropy_bonus_and_its_adaptive_coefficient():
    entropy = torch.tensor([[1.0, 3.0], [2.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    bonus = entropy_bonus(entropy, mask, num_micro_batches=2)
    assert bonus.item() == pytest.approx((1 + 3 + 2) / 3 / 2)
    assert entropy_bonus(entropy, mask).item() == pytest.approx((1 + 3 + 2) / 3)  # one micro-batch by default
    # One real token: its entropy, over 1 token. None (every completion masked): 0 with a zero gradient, not 0 / 0.
    assert entropy_bonus(entropy, torch.tensor([[0.0, 0.0], [0.0, 1.0]])).item() == 9.0
    empty = entropy_bonus(entropy, torch.zeros(2, 2))
    assert empty.item() == 0.0 and torch.equal(torch.autograd.grad(empty, entropy)[0], torch.zeros(2, 2))
    (grad,) = torch.autograd.grad(bonus, entropy)
    torch.testing.assert_close(grad, torch.tensor([[1 / 6, 1 / 6], [1 / 6, 0.0]]))
    control = EntropyControl(coef=0.1, adaptive=True, coef_min=0.0, coef_max=0.2, delta=0.05, target=0.5)
    assert control.enabled and control.applied() == 0.0  # no measurement yet (last entropy +inf)
    control.update(0.8, 2.0)  # entropy 0.4 <= 0.5: more bonus, and it applies
    assert (control.coef, control.applied()) == (pytest.approx(0.15), pytest.approx(0.15))
    control.update(0.4, 1.0)  # 0.4 again: 0.2, coef_max
    control.update(0.4, 1.0)  # and again: capped at coef_max
    assert control.coef == pytest.approx(0.2)
    control.update(3.0, 5.0)  # 0.6 > 0.5: less bonus, and none applies while above the target
    assert (control.coef, control.applied()) == (pytest.approx(0.15), 0.0)
    restored = EntropyControl(coef=0.1, adaptive=True)
    restored.load_state_dict(control.state_dict())
    assert (restored.coef, restored.last_entropy) == (control.coef, control.last_entropy)
    floored = EntropyControl(coef=0.02, adaptive=True, coef_min=0.01, delta=0.05, target=0.5)
    floored.update(1.0, 1.0)  # entropy 1.0 > 0.5: 0.02 - 0.05 floored at coef_min
    assert floored.coef == pytest.approx(0.01)
    static = EntropyControl(coef=0.3)
    static.update(0.0, 1.0)
    assert static.applied() == 0.3 and not EntropyControl().enabled


def test_entropy_control_defaults_and_a_step_without_tokens():
    # EntropyControl() carries GRPOConfig's defaults (delta 0.005, target 0.2, coef range [0, 1]): one source of truth.
    assert EntropyControl(adaptive=True) == GRPOConfig(use_adaptive_entropy=True).entropy_control()
    # A step that kept no token (every completion masked): entropy 0 / max(0 tokens, 1) = 0 <= target 0.2,
    # so the coefficient rises by the default delta, 0.1 -> 0.105, and no ZeroDivisionError stops the run.
    control = EntropyControl(coef=0.1, adaptive=True)
    control.update(0.0, 0.0)
    assert (control.coef, control.last_entropy) == (pytest.approx(0.105), 0.0)
    # Entropy exactly at the target (0.4 / 2 tokens = 0.2) counts as low: more bonus (0.105 -> 0.11), and it applies.
    control.update(0.4, 2.0)
    assert (control.coef, control.applied()) == (pytest.approx(0.11), pytest.approx(0.11))


def test_high_entropy_mask_with_one_real_token_or_none():
    # One real token: the quantile of a single value is that value, so the token is kept at every quantile.
    entropy = torch.tensor([[0.3, 5.0]])
    for quantile in (0.0, 0.2, 1.0):
        assert high_entropy_mask(entropy, torch.tensor([[1.0, 0.0]]), quantile).tolist() == [[True, False]]
    # No real token (a micro-batch of masked completions): nothing is kept, and the empty quantile is not taken.
    assert high_entropy_mask(entropy, torch.zeros(1, 2), 0.2).tolist() == [[False, False]]


# Rows [1, 2, 3] and [4] (the 99s are padding): row means 2 and 4, row sums 6 and 4, 10 over 4 real tokens.
AGGREGATION_HAND_VALUES = {
    "grpo": (2 + 4) / 2, "sapo": (2 + 4) / 2, "rloo": (2 + 4) / 2,  # mean over rows of each row's token mean
    "bnpo": 10 / 4,  # token mean of the micro-batch
    "dr_grpo": 10 / (2 * 5),  # rows * max_completion_length 5
    "luspo": (6 + 4) / 2,  # mean over rows of each row's token sum
    "dapo": 10 / 8, "cispo": 10 / 8, "vespo": 10 / 8,  # num_items_in_batch = 8 tokens in the step
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregation_hand_values_and_the_logged_policy_loss(loss_type):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    expected = AGGREGATION_HAND_VALUES[loss_type]
    # One micro-batch is the default.
    assert aggregate_loss(loss, mask, loss_type, max_completion_length=5, num_items_in_batch=8).item() == expected
    # Four micro-batches: each is divided by 4 (dapo, cispo, vespo: num_items_in_batch already counts the step),
    # and the logged policy_loss undoes that division, as trl logs it.
    quarter = aggregate_loss(loss, mask, loss_type, num_micro_batches=4, max_completion_length=5, num_items_in_batch=8)
    assert quarter.item() == (expected if loss_type in ("dapo", "cispo", "vespo") else expected / 4)
    assert policy_loss_value(quarter.item(), loss_type, 4) == expected
    # One real token (5; the 99 is padding): its value over a divisor of 1 token or row, dr_grpo's 1 row * 2.
    one = aggregate_loss(torch.tensor([[5.0, 99.0]]), torch.tensor([[1.0, 0.0]]), loss_type, max_completion_length=2,
                         num_items_in_batch=1)
    assert one.item() == (5 / 2 if loss_type == "dr_grpo" else 5.0)


@pytest.mark.parametrize("options", [LossOptions(loss_type="vespo"), LossOptions(off_policy_mask_threshold=0.5),
                                     LossOptions(top_entropy_quantile=0.2)], ids=["vespo", "off-policy-mask", "entropy"])
def test_token_loss_refuses_what_needs_the_completion_mask(options):
    # Each one alone is refused: vespo's phi sums over a row, the masks need the row or the micro-batch.
    with pytest.raises(ValueError, match="vespo and the token masks need per_token_loss"):
        token_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), options=options)


# One row, two tokens with log-ratios (r1, r2), advantage A (A >= 0: k = 2, lambda = 3; A < 0: k = 3, lambda = 2):
# phi = exp(lambda + k log w - lambda w). Each case: (token log-ratios, behaviour weights, A, options, phi).
_LAMBDA = 2.0**-13  # exact in float32 (vespo takes k and lambda as float32 tensors)
VESPO_EDGES = {
    # trl clamps each token log-ratio to [-20, 20] before the sum: 30 counts as 20, log w = 20 - 19.5 = 0.5
    "token-log-ratio-above-20": ((30.0, -19.5), None, 1.0, {}, math.exp(3 + 2 * 0.5 - 3 * math.exp(0.5))),
    # ... and -30 as -20: log w = -20 + 19.5 = -0.5
    "token-log-ratio-below-20": ((-30.0, 19.5), None, 1.0, {}, math.exp(3 - 2 * 0.5 - 3 * math.exp(-0.5))),
    # each behaviour weight's log is clamped to 20 too: log w = -19.5 + min(log e^30, 20) + log 1 = 0.5
    "behaviour-weight-log-above-20": ((-19.5, 0.0), (math.exp(30), 1.0), 1.0, {}, math.exp(3 + 1 - 3 * math.exp(0.5))),
    # A = 0 takes the A >= 0 parameters (k = 2, lambda = 3): log w = 0.3
    "zero-advantage-is-positive": ((0.1, 0.2), None, 0.0, {}, math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3))),
    # lambda = 0 is floored at 1e-4: log w = 0.5 -> exp(1e-4 + 2 * 0.5 - 1e-4 e^0.5)
    "lambda-floor": ((0.25, 0.25), None, 1.0, dict(vespo_lambda_pos=0.0), math.exp(1e-4 + 1 - 1e-4 * math.exp(0.5))),
    # log w is capped at 20 after the sum (20 + 0.5 counts as 20); it shows only where phi(e^20) is finite,
    # lambda e^20 ~ 20 k: k = 2961.5, lambda = 2^-13 -> exp(lambda + 20 k - lambda e^20) = exp(5.73) = 308
    "log-w-cap": ((20.0, 0.5), None, 1.0, dict(vespo_k_pos=2961.5, vespo_lambda_pos=_LAMBDA),
                  math.exp(_LAMBDA + 20 * 2961.5 - _LAMBDA * math.exp(20))),
    # phi that overflows (k = 100, lambda = 1e-4, log w = 13: exp(1300 - 44) = inf) becomes 0, as trl
    "overflow": ((13.0, 0.0), None, 1.0, dict(vespo_k_pos=100.0, vespo_lambda_pos=0.0), 0.0),
    # a NaN log-ratio (phi NaN) also becomes 0: the row has no policy term
    "nan": ((math.nan, 0.0), None, 1.0, {}, 0.0),
}


@pytest.mark.parametrize("case", VESPO_EDGES.values(), ids=VESPO_EDGES.keys())
def test_vespo_weight_edges(case):
    log_ratios, is_weights, adv, settings, phi = case
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    old = logps - torch.tensor([log_ratios], dtype=torch.float64)
    terms = loss_terms(logps, old, torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                       None, LossOptions(loss_type="vespo", **settings),
                       is_weights=None if is_weights is None else torch.tensor([is_weights], dtype=torch.float64))
    torch.testing.assert_close(vespo_phi(terms.inputs), torch.tensor([[phi]], dtype=torch.float64), rtol=1e-9, atol=0)
    # l_t = -phi A logp_t
    torch.testing.assert_close(terms.loss, -phi * adv * logps, rtol=1e-9, atol=0)


def test_vespo_behaviour_weights_join_each_rows_own_ratio():
    # On-policy (rho = 1), so w_i = prod_t is_t of its own row:
    # row 0: is = [2, 1], w = 2, A = 1 (k = 2, lambda = 3): phi = e^3 2^2 e^-6 = 4 e^-3 = 0.19915;
    # row 1: is = [0.5, 0.5], w = 0.25, A = -1 (k = 3, lambda = 2): phi = e^2 0.25^3 e^-0.5 = e^1.5 / 64 = 0.07003.
    logps = torch.tensor([[-1.0, -2.0], [-3.0, -1.0]])
    is_weights = torch.tensor([[2.0, 1.0], [0.5, 0.5]])
    terms = loss_terms(logps, logps, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 2), None,
                       LossOptions(loss_type="vespo"), is_weights=is_weights)
    phi = torch.tensor([[4 * math.exp(-3)], [math.exp(1.5) / 64]])
    torch.testing.assert_close(vespo_phi(terms.inputs), phi, rtol=1e-5, atol=0)
    # l_t = -phi A logp_t; is_weights enter through phi only (not multiplied in a second time).
    torch.testing.assert_close(terms.loss, -phi * torch.tensor([[1.0], [-1.0]]) * logps, rtol=1e-5, atol=0)


def test_off_policy_mask_edge_rows():
    # Threshold 0.5; rows 0-2 and 4 have A < 0 (only those can be dropped).
    # Row 0: one real token, old - logp = -0.2 - (-1) = 0.8: mean 0.8 / 1 token > 0.5 -> dropped (padding not counted).
    # Row 1: a token whose log-probs are both -inf (NaN difference) counts as 0: (0 + 0.8) / 2 = 0.4 -> kept.
    # Row 2: the same with 1.2: (0 + 1.2) / 2 = 0.6 -> dropped.
    # Row 3: A = 0 is not negative: kept however far off-policy (mean 0.8).
    # Row 4: no real token (a masked completion): mean 0 / max(0, 1) = 0 -> kept, not 0 / 0 = NaN.
    logps = torch.tensor([[-1.0, 0.0], [-math.inf, -1.0], [-math.inf, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    old = torch.tensor([[-0.2, 5.0], [-math.inf, -0.2], [-math.inf, 0.2], [-0.2, -0.2], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    kept = off_policy_mask(torch.tensor([[-1.0], [-1.0], [-1.0], [0.0], [-1.0]]), logps, old, mask, 0.5)
    assert kept.flatten().tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]


def test_sequence_level_ratio_of_a_row_without_real_tokens_is_one():
    # Row 1 is all padding (a masked completion): its mean log-ratio is 0 / max(0 tokens, 1) = 0, so rho = 1 and
    # l = -min(1 * A, 1 * A) = -1, not 0 / 0 = NaN, which would make the aggregated loss NaN (NaN * mask 0 = NaN).
    # Row 0: one real token with log-ratio 0.1: rho = e^0.1 = 1.105, inside [0.8, 1.2], A = 1 -> l = -e^0.1.
    logps = torch.zeros(2, 2, requires_grad=True)
    old = torch.tensor([[-0.1, 3.0], [3.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    loss = per_token_loss(logps, old, torch.ones(2), mask, options=LossOptions(importance_sampling_level="sequence"))
    torch.testing.assert_close(loss.detach(), torch.tensor([[-math.exp(0.1)], [-1.0]]), rtol=1e-6, atol=0)
    # dapo over the step's 1 real token: -e^0.1, and d(-exp(mean_t log rho))/dlogp = -e^0.1 on row 0's real token only.
    value = aggregate_loss(loss, mask, "dapo", num_items_in_batch=1)
    (grad,) = torch.autograd.grad(value, logps)
    assert value.item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-math.exp(0.1), 0.0], [0.0, 0.0]]), rtol=1e-6, atol=0)


def test_behaviour_weights_scale_the_policy_term_but_not_the_kl():
    # On-policy (rho = 1), A = 1: the grpo policy term is -1; w = pi_old / pi_b multiplies it, the KL is added after:
    # beta = 1, ref - logp = 1 -> k3 = e - 2. w = 0.5 -> -0.5 + e - 2; w = 2 -> -2 + e - 2.
    logps, adv, ref = torch.zeros(2, 1), torch.ones(2, 1), torch.ones(2, 1)
    is_weights = torch.tensor([[0.5], [2.0]])
    expected = torch.tensor([[-0.5 + math.e - 2], [-2.0 + math.e - 2]])
    options = LossOptions(beta=1.0)
    terms = loss_terms(logps, logps, adv, torch.ones(2, 1), ref, options, is_weights=is_weights)
    torch.testing.assert_close(terms.loss, expected, rtol=1e-6, atol=0)
    # token_loss (the fused kernel's elementwise loss) the same
    torch.testing.assert_close(token_loss(logps, logps, adv, ref, options, is_weights=is_weights), expected,
                               rtol=1e-6, atol=0)


def test_loss_options_cannot_be_changed():
    # per_token_loss, token_loss and loss_statistics share one default LossOptions(): no caller can change it for
    # every later call.
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossOptions().beta = 0.1


def test_clip_statistics_count_strictly_beyond_the_bound_and_only_for_the_clipping_sign():
    # eps = eps_high = 0.25: the bounds 0.75 and 1.25 are exact in float32, and so is exp(log 1.25), exp(log 0.75).
    # Row: rho, A -> counted?
    #   1.25 (on the bound), 1   -> not high: min(rho A, clip(rho) A) are equal, the gradient still flows
    #   e^0.5 = 1.65,        0   -> not high: trl counts A > 0 only
    #   e^0.5,            -0.5   -> not high: the min takes the unclipped rho A
    #   0.75 (on the bound), -1  -> not low
    #   e^-0.5 = 0.61,       0   -> not low: A < 0 only
    #   e^-0.5,            0.5   -> not low
    #   e^0.5,               1   -> high
    #   e^-0.5,             -1   -> low
    # clip_high = 1/8, clip_low = 1/8, clip_region = 2/8.
    log_rho = torch.tensor([math.log(1.25), 0.5, 0.5, math.log(0.75), -0.5, -0.5, 0.5, -0.5])
    adv = torch.tensor([1.0, 0.0, -0.5, -1.0, 0.0, 0.5, 1.0, -1.0])
    stats = loss_statistics(torch.zeros(8, 1), -log_rho[:, None], adv, torch.ones(8, 1),
                            options=LossOptions(epsilon=0.25))
    assert (stats.clip_high, stats.clip_low, stats.clip_region) == (1 / 8, 1 / 8, 2 / 8)
    # cispo with eps_high = 1.25 counts rho > 1.25 with A > 0: of rho = 1.25 (A = 1), e^0.5 (A = 0),
    # e^0.5 (A = -1) and e^0.5 (A = 1) only the last.
    log_rho = torch.tensor([math.log(1.25), 0.5, 0.5, 0.5])
    stats = loss_statistics(torch.zeros(4, 1), -log_rho[:, None], torch.tensor([1.0, 0.0, -1.0, 1.0]), torch.ones(4, 1),
                            options=LossOptions(loss_type="cispo", epsilon_high=1.25))
    assert stats.cispo_clip == 1 / 4


def test_statistics_of_a_single_padded_row_and_of_a_micro_batch_without_tokens():
    # One row, its third token padding: the entropy mean is (1 + 2) / 2 = 1.5 (not (1 + 2 + 9) / 3).
    # KL with logp = 0 and ref = [1, 0, 5]: k3 = [e - 2, 0, ...] -> (e - 2) / 2 over the real tokens.
    logps, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    stats = loss_statistics(logps, logps, torch.ones(1), mask, torch.tensor([[1.0, 0.0, 5.0]]), LossOptions(beta=0.1),
                            entropy=torch.tensor([[1.0, 2.0, 9.0]]))
    assert (stats.entropy, stats.kl) == (1.5, pytest.approx((math.e - 2) / 2, rel=1e-6))
    # No real token: every logged mean is 0, not 0 / 0 = NaN, which would make the step's token-weighted
    # mean NaN (metrics add value * 0 tokens).
    stats = loss_statistics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3),
                            torch.ones(2, 3), LossOptions(beta=0.1), entropy=torch.ones(2, 3))
    assert (stats.kl, stats.entropy, stats.clip_low, stats.clip_high, stats.clip_region) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert stats.tokens == 0.0
    # One real token: the means are that token's values (entropy 4, KL e - 2), over 1 token.
    stats = loss_statistics(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2), torch.tensor([[0.0, 0.0], [1.0, 0.0]]),
                            torch.ones(2, 2), LossOptions(beta=0.1), entropy=torch.tensor([[9.0, 9.0], [4.0, 9.0]]))
    assert (stats.entropy, stats.kl) == (4.0, pytest.approx(math.e - 2, rel=1e-6))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_micro_batch_without_real_tokens_adds_nothing(loss_type):
    # Every completion masked (e.g. all truncated): the loss and its gradient are 0, not 0 / 0 = NaN.
    logps = torch.zeros(2, 3, requires_grad=True)
    loss = aggregate_loss(logps * 2.0, torch.zeros(2, 3), loss_type, max_completion_length=3, num_items_in_batch=0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(2, 3))


def _step_mean(stats, name):
    """What the step logs over micro-batches: sum(value * weight) / sum(weight), LossStats.weights' contract."""
    return sum(getattr(s, name) * s.weights()[name] for s in stats) / sum(s.weights()[name] for s in stats)


def test_statistics_of_unequal_micro_batches_average_to_the_step():
    # Micro-batch A: 1 row of 4 tokens, micro-batch B: 2 rows of 2 tokens (trimmed to their own longest row).
    # Token-level ratios, eps 0.2, A = 1: A's tokens have rho = e^0.5, e^0.5, 1, 1 (two clipped high), B's are all 1.
    # The step's clip_high is over its 8 tokens: 2 / 8 = 0.25.
    adv_a, adv_b = torch.ones(1), torch.ones(2)
    old_a = torch.tensor([[-0.5, -0.5, 0.0, 0.0]])
    parts = [loss_statistics(torch.zeros(1, 4), old_a, adv_a, torch.ones(1, 4)),
             loss_statistics(torch.zeros(2, 2), torch.zeros(2, 2), adv_b, torch.ones(2, 2))]
    assert _step_mean(parts, "clip_high") == 0.25
    # Sequence-level ratios are one per completion: A's row has rho = e^mean(0.5, 0.5, 0, 0) = e^0.25 = 1.28 > 1.2,
    # B's two rows rho = 1. The step's clip_high is over its 3 completions: 1 / 3.
    options = LossOptions(importance_sampling_level="sequence")
    parts = [loss_statistics(torch.zeros(1, 4), old_a, adv_a, torch.ones(1, 4), options=options),
             loss_statistics(torch.zeros(2, 2), torch.zeros(2, 2), adv_b, torch.ones(2, 2), options=options)]
    assert _step_mean(parts, "clip_high") == pytest.approx(1 / 3, rel=1e-6)
    # vespo's phi is one per completion at every level: A's row has log w = 1 -> phi = e^(3 + 2 - 3e) = 0.0426,
    # B's rows phi(1) = 1: the step's mean phi over 3 completions is (0.0426 + 2) / 3.
    options = LossOptions(loss_type="vespo")
    parts = [loss_statistics(torch.zeros(1, 4), old_a, adv_a, torch.ones(1, 4), options=options),
             loss_statistics(torch.zeros(2, 2), torch.zeros(2, 2), adv_b, torch.ones(2, 2), options=options)]
    assert _step_mean(parts, "vespo_phi") == pytest.approx((math.exp(5 - 3 * math.e) + 2) / 3, rel=1e-6)
    # Within a micro-batch too, phi is averaged over completions, not tokens: rows of 1 and 3 real tokens with
    # log w = 1 and 0 -> (0.0426 + 1) / 2 (weighted by tokens it would be (0.0426 + 3) / 4).
    stats = loss_statistics(torch.zeros(2, 3), torch.tensor([[-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), torch.ones(2),
                            torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), options=options)
    assert stats.vespo_phi == pytest.approx((math.exp(5 - 3 * math.e) + 1) / 2, rel=1e-6)
    # The logged policy_loss is each micro-batch's undivided loss (policy_loss_value), so the step logs their
    # plain mean: micro-batches of 1 and 2 rows with losses 1 and 4 log 2.5.
    parts[0].policy_loss, parts[1].policy_loss = 1.0, 4.0
    assert _step_mean(parts, "policy_loss") == 2.5
