"""One optimizer update (grpo/core/update.py) against a naive float64 reference written from the equations.

The kernel-vs-plain, accumulation and resume tests compare the update with itself; this one does not share its
code: every row is run alone and unpadded through a float64 copy of the model, the advantages, the clipped
surrogate with its KL term, the aggregation, the truncation mask and the gradient clipping are each a line here.
It runs under --kernels auto and plain (the both_kernels fixture), so both paths meet the same reference.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.generation.rollout import Rollout
from grpo.core.trainer import Trainer
from tests.test_trainer import fixed_rollout, make_config

pytestmark = [pytest.mark.usefixtures("both_kernels"),  # the step below wraps optimizer.step to read the gradient
              pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")]

MAX_GRAD_NORM = 0.05  # below the tiny model's gradient norm here, so the clip is active (asserted)


def rollout_with_ended_and_truncated_rows(trainer: Trainer, seed: int = 0) -> Rollout:
    """Random completions of 2 to max_completion_length tokens, every other one ending with EOS (so half are
    truncated), and random rewards."""
    g = torch.Generator().manual_seed(seed)
    cfg, eos = trainer.config, trainer.loop.sampling.eos_token_ids
    vocab = len(trainer.data.tokenizer)
    prompts, completions = [], []
    for index in range(cfg.prompts_per_step):
        for member in range(cfg.num_generations):
            length = int(torch.randint(2, cfg.max_completion_length + 1, (1,), generator=g))
            tokens = [t for t in torch.randint(3, vocab, (3 * length,), generator=g).tolist() if t not in eos][:length]
            if member % 2 == 0:
                tokens[-1] = eos[0]
            prompts.append(trainer.data.train_prompt_ids[index])
            completions.append(tokens)
    rewards = torch.rand(len(completions), generator=g)
    rollout = Rollout.from_token_lists(prompts, completions, rewards, eos, trainer.data.tokenizer.pad_token_id)
    assert rollout.truncated.any() and not rollout.truncated.all()
    return rollout


def reference_update(policy, reference, rollout: Rollout, config, entropy_coef: float = 0.0) -> tuple[dict, float]:
    """The clipped gradient of one GRPO update and the gradient norm before clipping, in float64.

    A_i = (r_i - mean_group r) / (std_group r + 1e-4), the std unbiased (DeepSeekMath eq. 3, as trl);
    per token: -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta (exp(ref - logp) - (ref - logp) - 1), rho = 1 at
    the first update (old = logp, detached); aggregated as loss_type says over every row of the update; rows
    without EOS count no token when mask_truncated_completions; the policy term kept only on the top
    top_entropy_quantile of tokens by entropy; minus entropy_coef times the mean entropy -sum_v p log p over the
    counted tokens the policy term keeps (one micro-batch); g <- g * min(1, max_norm / (|g| + 1e-6)), max_norm 0
    leaving g as it is."""
    model, ref = copy.deepcopy(policy).double().eval(), copy.deepcopy(reference).double().eval()
    model.zero_grad(set_to_none=True)
    rewards = rollout.rewards_per_func[:, 0].double().view(-1, config.num_generations)  # (B, G)
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)  # std: unbiased
    advantages = ((rewards - mean) / (std + 1e-4)).flatten()  # (N,)
    rows = []  # per row: (log-probs (t,) with grad, entropies (t,) with grad, the reference's (t,), counted)
    for row in range(rollout.num_rows):
        prompt = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()]
        length = int(rollout.completion_mask[row].sum())
        completion = rollout.completion_ids[row, :length]
        ids = torch.cat([prompt, completion])[None]  # (1, L): alone, no padding
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / config.temperature  # (t, V)
        log_softmax = torch.log_softmax(logits, -1)  # (t, V)
        logp = log_softmax.gather(-1, completion[:, None]).squeeze(-1)  # (t,)
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits[0, len(prompt) - 1 : -1] / config.temperature
            ref_logp = torch.log_softmax(ref_logits, -1).gather(-1, completion[:, None]).squeeze(-1)
        kept = not (config.mask_truncated_completions and bool(rollout.truncated[row]))
        rows.append((logp, -(log_softmax.exp() * log_softmax).sum(-1), ref_logp, kept))
    # top_entropy_quantile q < 1: the policy term only on tokens whose entropy is >= the (1 - q) quantile of the
    # counted tokens' entropies (Wang et al. 2025, "Beyond the 80/20 rule"); the KL term on every token
    counted = torch.cat([h.detach() for _, h, _, kept in rows if kept])  # (M,)
    threshold = torch.quantile(counted, 1.0 - config.top_entropy_quantile)
    if config.top_entropy_quantile < 1.0:  # float32 and float64 entropies must fall on the same side of it
        assert (counted - threshold).abs().min() < 1e-12 or ((counted - threshold).abs() > 1e-5).all()
    row_sums, row_tokens, entropy_sum, entropy_tokens = [], [], 0.0, 0
    for row, (logp, entropy, ref_logp, kept) in enumerate(rows):
        high = (entropy.detach() >= threshold - 1e-12).double()  # (t,) all ones at q = 1
        ratio = torch.exp(logp - logp.detach())
        a = advantages[row]
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - config.epsilon, 1 + config.epsilon) * a)
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token = -surrogate * high + config.beta * kl  # (t,)
        row_sums.append(per_token.sum() * kept)
        entropy_sum = entropy_sum + (entropy * high).sum() * kept
        entropy_tokens += int(high.sum()) * kept
        row_tokens.append(len(logp) * kept)
    num_rows, tokens = rollout.num_rows, sum(row_tokens)
    if config.loss_type == "grpo":  # each completion's token mean, averaged over completions
        loss = sum(s / max(t, 1) for s, t in zip(row_sums, row_tokens)) / num_rows
    elif config.loss_type == "dr_grpo":  # every token over N x max_completion_length
        loss = sum(row_sums) / (num_rows * config.max_completion_length)
    elif config.loss_type == "dapo":  # every token over the update's tokens
        loss = sum(row_sums) / tokens
    else:
        raise NotImplementedError(config.loss_type)
    loss = loss - entropy_coef * entropy_sum / entropy_tokens  # the bonus over the tokens the policy term keeps
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
    scale = 1.0 if config.max_grad_norm == 0 else min(1.0, config.max_grad_norm / (norm + 1e-6))
    return {name: g * scale for name, g in grads.items()}, norm


@pytest.mark.parametrize("mask_truncated", [False, True], ids=["all-rows", "mask-truncated"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_one_update_matches_the_float64_reference(tmp_path, loss_type, mask_truncated):
    trainer = Trainer(make_config(tmp_path, loss_type=loss_type, mask_truncated_completions=mask_truncated,
                                  max_grad_norm=MAX_GRAD_NORM, beta=0.04, temperature=0.7, micro_batch_size=2))
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        generator = torch.Generator().manual_seed(1)
        for param in trainer.models.reference.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    rollout = rollout_with_ended_and_truncated_rows(trainer)
    expected, expected_norm = reference_update(trainer.policy, trainer.models.reference, rollout, trainer.config)
    assert expected_norm > MAX_GRAD_NORM, "the clip must be active for this test to check it"
    assert_update_gives(trainer, rollout, expected, expected_norm)


@pytest.mark.parametrize("case", ["clip-off", "entropy-bonus", "entropy-bonus-top-quantile"])
def test_one_update_without_clipping_or_with_an_entropy_bonus_matches_the_reference(tmp_path, case):
    """max_grad_norm 0 turns the clip off; a static entropy bonus (one micro-batch, so its token mean is the
    update's) subtracts coef x mean entropy from the loss, over the high-entropy tokens with a quantile < 1."""
    options = {"clip-off": dict(max_grad_norm=0.0),
               "entropy-bonus": dict(entropy_coef=0.05, micro_batch_size=8),
               "entropy-bonus-top-quantile": dict(entropy_coef=0.05, micro_batch_size=8, top_entropy_quantile=0.4)}[case]
    trainer = Trainer(make_config(tmp_path, **{"beta": 0.04, "temperature": 0.7, "micro_batch_size": 2,
                                               "max_grad_norm": MAX_GRAD_NORM, **options}))
    rollout = rollout_with_ended_and_truncated_rows(trainer)
    expected, norm = reference_update(trainer.policy, trainer.models.reference, rollout, trainer.config,
                                      entropy_coef=options.get("entropy_coef", 0.0))
    assert norm > MAX_GRAD_NORM  # so clipping, were it on, would change the gradient
    assert_update_gives(trainer, rollout, expected, norm)


def assert_update_gives(trainer: Trainer, rollout: Rollout, expected: dict, expected_norm: float) -> None:
    """The trainer's one update on `rollout` applies the gradient `expected` (read at optimizer.step, after the
    clip) and reports the norm before clipping."""
    captured, step = [], trainer.optimizer.step

    def capture():
        captured.append({n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters()})
        return step()

    trainer.optimizer.step = capture
    result = trainer.update(rollout)
    assert len(captured) == 1
    assert result.grad_norms[0] == pytest.approx(expected_norm, rel=1e-5)
    for name, want in expected.items():
        # fp32 against float64: 1e-5 of the tensor's largest gradient
        torch.testing.assert_close(captured[0][name].double(), want, rtol=0, atol=1e-5 * want.abs().max().item(),
                                   msg=name)


def test_a_non_finite_gradient_under_a_finite_loss_skips_the_update(tmp_path, caplog):
    """The loss is finite, but one parameter's gradient is made infinite: the update is skipped (no weight moves,
    the skip is counted), as when the loss itself is not finite."""
    trainer = Trainer(make_config(tmp_path, beta=0.04))
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    next(trainer.policy.parameters()).register_hook(lambda grad: grad * float("inf"))
    result = trainer.update(rollout_with_ended_and_truncated_rows(trainer))
    assert all(torch.isfinite(torch.tensor(result.micro_batch_losses)))
    assert trainer.state.skipped_updates == 1 and not torch.isfinite(torch.tensor(result.grad_norms[0]))
    assert "step 1: non-finite loss or gradient, or no advantage signal (grad_norm=inf): update skipped" in caplog.text  # the step, 1-based
    for name, param in trainer.policy.named_parameters():
        assert torch.equal(param, before[name]), name


def test_a_non_finite_loss_under_finite_gradients_skips_the_update(tmp_path, caplog, monkeypatch):
    """The mirror case: the reference gives one token log-prob -inf (a token it cannot emit), so that token's
    KL exp(ref - logp) - (ref - logp) - 1 is +inf while its gradient, 1 - exp(ref - logp), is finite. The loss
    says the step is broken although every gradient is finite: skipped all the same, its norm logged as nan."""
    import grpo.core.update

    trainer = Trainer(make_config(tmp_path, beta=0.04))
    real = grpo.core.update.no_grad_logprobs

    def reference_cannot_emit_one_token(call, *args, **kwargs):
        logps = real(call, *args, **kwargs)  # (N, T)
        if call is trainer.models.reference_call:
            logps[0, 0] = float("-inf")
        return logps

    monkeypatch.setattr(grpo.core.update, "no_grad_logprobs", reference_cannot_emit_one_token)
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    captured = []
    for param in trainer.policy.parameters():
        param.register_hook(lambda grad: captured.append(bool(torch.isfinite(grad).all())) or grad)
    result = trainer.update(rollout_with_ended_and_truncated_rows(trainer))
    assert captured and all(captured)  # every gradient finite
    assert not all(torch.isfinite(torch.tensor(result.micro_batch_losses)))
    assert trainer.state.skipped_updates == 1
    assert "step 1: non-finite loss or gradient, or no advantage signal (grad_norm=nan): update skipped" in caplog.text
    for name, param in trainer.policy.named_parameters():
        assert torch.equal(param, before[name]), name


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_old_log_probs_are_computed_only_when_an_update_follows_a_moved_policy(tmp_path, num_iterations):
    """One update per rollout, uncorrected: the policy that sampled is the one updated, so no separate pass for
    old log-probs runs (the ratio is exp(logp - logp.detach()) = 1); a second iteration needs them."""
    trainer = Trainer(make_config(tmp_path, num_iterations=num_iterations))
    result = trainer.update(rollout_with_ended_and_truncated_rows(trainer))
    assert (result.old_logps is None) == (num_iterations == 1)
    assert result.num_items_in_batch == rollout_with_ended_and_truncated_rows(trainer).completion_mask.sum().item()


def test_two_updates_per_generation_each_count_half_the_tokens(tmp_path):
    """steps_per_generation 2: the rollout feeds two updates on disjoint halves, and the token count the dapo-style
    losses divide by is one update's share (trl's num_items_in_batch), not the rollout's."""
    trainer = Trainer(make_config(tmp_path, steps_per_generation=2, loss_type="dapo"))
    rollout = fixed_rollout(trainer, num_prompts=2 * trainer.config.prompts_per_step)
    result = trainer.update(rollout)
    assert len(result.grad_norms) == 2
    assert result.num_items_in_batch == rollout.completion_mask.sum().item() / 2


def test_adaptive_entropy_control_reads_the_updates_entropy(tmp_path):
    """The tiny model's entropy (about ln 512 = 6.2 nats) is far above a target of 0.5, so after one update the
    coefficient falls by one delta: the controller saw the update's entropy, not an empty list of micro-batches."""
    trainer = Trainer(make_config(tmp_path, use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.01,
                                  entropy_target=0.5))
    result = trainer.update(fixed_rollout(trainer))
    assert result.entropy_coefs == [pytest.approx(0.04)]
    assert trainer.state.entropy.last_entropy > 3.0


def test_train_on_rollout_called_as_a_function_makes_one_update(tmp_path):
    """grpo.train_on_rollout is public: called without num_updates, one rollout makes one optimizer update."""
    from grpo import train_on_rollout

    trainer = Trainer(make_config(tmp_path))
    result = train_on_rollout(fixed_rollout(trainer), trainer.update_options, trainer.models, trainer.optimizer,
                              trainer.scheduler, trainer.state, trainer.world, trainer.functions, trainer.rewards)
    assert len(result.grad_norms) == 1 and trainer.state.updates == 1


def test_reference_sync_mixes_each_parameter_and_refuses_models_that_do_not_pair_up():
    """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter; a reference with other
    parameters than the policy (a LoRA-wrapped policy beside a plain copy, say) is an error, not a partial mix."""
    from grpo.core.update import sync_reference

    policy, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    expected = [0.25 * p.detach() + 0.75 * r.detach() for p, r in zip(policy.parameters(), reference.parameters())]
    sync_reference(reference, policy, 0.25)
    for got, want in zip(reference.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-7)
    with pytest.raises(ValueError):
        sync_reference(torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)), 0.5)


@pytest.mark.parametrize("kernels", ["plain", "auto"])
def test_pad_to_multiple_of_pads_each_micro_batch_and_changes_no_number(tmp_path, kernels):
    """trl's pad_to_multiple_of: every forward of the update (and of the reference and old log-probs) sees a
    sequence length that is a multiple of 64, padded on the left; the positions follow the mask, so the log-probs,
    both updates' losses (the second on the weights the first made) and gradient norms are the unpadded run's.
    (The weights themselves are not compared element by element: AdamW divides each gradient by its own root mean
    square, so an element whose gradient is rounding noise, about 1e-9, moves by up to the learning rate either way.)"""
    import dataclasses

    results = {}
    for multiple in (None, 64):
        trainer = Trainer(make_config(tmp_path / str(multiple), pad_to_multiple_of=multiple, beta=0.04,
                                      num_iterations=2, kernels=kernels))
        lengths, loss = [], trainer.functions.update_loss

        def recording(model, ids, *args, **kwargs):
            lengths.append(ids.shape[1])
            return loss(model, ids, *args, **kwargs)

        trainer.functions = dataclasses.replace(trainer.functions, update_loss=recording)
        results[multiple] = trainer.update(fixed_rollout(trainer))
        assert lengths and all(length % 64 == 0 for length in lengths) == (multiple == 64), lengths
    plain, padded = results[None], results[64]
    for name in ("ref_logps", "old_logps"):
        torch.testing.assert_close(getattr(padded, name), getattr(plain, name), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(padded.step_losses), torch.tensor(plain.step_losses), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.tensor(padded.grad_norms), torch.tensor(plain.grad_norms), rtol=1e-5, atol=1e-7)
