"""One GRPO update: a rollout's reference log-probs and advantages, then num_iterations x k optimizer updates.

    ref / old   (N, T) log-probs without grad, micro-batch by micro-batch  functions.logprobs
                (ref if beta != 0; old if the rollout feeds more than one update, is corrected or the KL is in
                the reward, else rho = 1)
    advantages  (N, 1) over every rank's rows (or (N, T) per token): the  advantage_batch, then
                estimator (functions.advantage_estimator: grpo's group-   grpo.algorithm.advantages (DeepSeekMath
                relative ones by default) on the weighted rewards         4.1.2; --advantage-estimator)
    behaviour   w = pi_old / pi_b from the rollout's sampler log-probs,   grpo.algorithm.off_policy
                when the correction applies (UpdateOptions.corrects_behaviour)
    update      for each of num_iterations x k updates, over its slice of the rows:
                  micro-batches -> log-probs -> per-token loss -> aggregate   functions.update_loss, grpo.algorithm.loss
                  (- entropy bonus) -> backward, the gradients accumulating
                -> clip the norm -> AdamW -> LR step (-> TR-DPO reference sync, entropy control)
    metrics     trl's names, over every rank's tokens and rows              grpo.core.metrics

`train_on_rollout` takes what it reads as arguments: its settings (`UpdateOptions`, built once at set-up), the models
(`Models`), the optimizer and its schedule, the step's counters (`StepState`, the only thing it changes besides the
weights), the world (collectives, identities at world size one) and `functions` (grpo.algorithm.step.StepFunctions):
the calls that compute log-probs, the loss and the micro-batches. Under `--kernels plain` these are
grpo.algorithm.step.plain_step_functions; under `auto`, grpo.kernels hands over functions that compute the same
numbers. It returns an `UpdateResult`:
the step's metrics and every intermediate value (advantages, old and reference log-probs, each micro-batch's
loss and statistics), for researchers and for the parity tests.

Notation: N rows of this rank's rollout, n of a micro-batch, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from grpo.algorithm.advantages import AdvantageBatch, estimate_advantages, reward_statistics, weighted_rewards
from grpo.algorithm.loss import EntropyControl, LossStats
from grpo.algorithm.off_policy import behaviour_weights, mismatch_statistics
from grpo.algorithm.step import StepFunctions
from grpo.core.metrics import PER_UPDATE, sampling_metrics, step_metrics, update_metrics
from grpo.errors import NoSignalError, TrainingError
from grpo.generation.rollout import Rollout, seeded
from grpo.parallel.distributed import World, accumulating, full_tensor

logger = logging.getLogger("grpo")

@dataclass(frozen=True)
class UpdateOptions:
    """What an update reads of the run's settings, built once at set-up (grpo.core.setup.update_options)."""

    prompts_per_step: int  # B prompts of one optimizer update (over every rank)
    group_size: int  # G completions per prompt
    micro_batch_size: int  # completions per forward/backward
    num_iterations: int  # optimizer updates per rollout slice
    max_completion_length: int  # T_max, dr_grpo's divisor
    seed: int  # the micro-batch order's
    beta: float  # the KL coefficient (0: no reference)
    kl_in_reward: bool  # the KL penalty in the reward (k1) rather than the loss (k3)
    reward_clip_range: tuple[float, float] | None
    scale_rewards: str
    normalize_advantages: bool
    mask_truncated_completions: bool
    corrects_behaviour: bool  # multiply by w = pi_old / pi_b (the sampler's log-probs)
    importance_sampling_mode: str
    importance_sampling_clip_min: float | None
    importance_sampling_clip_max: float | None
    max_grad_norm: float  # 0: no clipping
    max_bad_steps: int  # skipped updates in a row that stop the run
    sync_ref_model: bool  # TR-DPO: ref <- alpha policy + (1 - alpha) ref every ref_model_sync_steps updates
    ref_model_sync_steps: int
    ref_model_mixup_alpha: float
    metrics_average: str  # "step" or "micro_batch" (grpo.core.metrics.step_metrics)
    pad_to_multiple_of: int = 1  # each micro-batch's sequence length a multiple of this (micro_batch)


@dataclass
class StepState:
    """What changes from one step to the next besides the weights and the optimizer (saved in checkpoints)."""

    step: int = 0  # steps (rollouts) done
    updates: int = 0  # optimizer updates applied (the reference syncs count them, as trl's global_step)
    consecutive_bad_steps: int = 0  # updates skipped in a row (non-finite loss or gradient)
    skipped_updates: int = 0
    tokens_seen: int = 0  # prompt and completion tokens of every rollout trained on (trl's num_tokens)
    entropy: EntropyControl = field(default_factory=EntropyControl)  # the entropy bonus's coefficient


@dataclass
class Models:
    """The models an update calls. `*_call`: as the loop calls them (ModelCall, or a DDP / FSDP2 wrapper under
    torchrun): `call(fn, *args)` = fn(model, *args) inside the wrapper's forward (grpo.parallel.distributed)."""

    policy: torch.nn.Module  # the trained weights (clipping, the reference sync)
    policy_call: torch.nn.Module
    reference: torch.nn.Module | None = None  # frozen; None when beta = 0 (or LoRA: the adapters switched off)
    reference_call: torch.nn.Module | None = None
    device: torch.device = torch.device("cpu")  # where the rollout's tensors go
    autocast: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)  # bf16 or nothing
    peft_model: torch.nn.Module | None = None  # LoRA: the adapted model, saved in peft's format
    distributed: str = "none"  # how the *_call wrappers were made: none, ddp or fsdp (grpo.parallel.distributed)


@dataclass
class UpdateResult:
    """An update's metrics and intermediate values (this rank's rows)."""

    metrics: dict  # trl's names, over every rank
    advantages: torch.Tensor  # (N, 1), or (N, T) from an estimator that gives one per token
    ref_logps: torch.Tensor | None  # (N, T) when beta != 0
    old_logps: torch.Tensor | None  # (N, T) when the rollout feeds more than one update, is corrected, or the KL
    #                                 is in the reward
    is_weights: torch.Tensor | None = None  # (N, T) or (N, 1): w = pi_old / pi_b, when the correction applies
    micro_batch_losses: list[float] = field(default_factory=list)  # in the order they ran
    micro_batch_stats: list[LossStats] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)  # per optimizer update, over every rank
    grad_norms: list[float] = field(default_factory=list)  # per optimizer update
    learning_rates: list[float] = field(default_factory=list)  # per optimizer update, the rate it stepped with
    entropy_coefs: list[float] = field(default_factory=list)  # per optimizer update, when the bonus is on
    num_items_in_batch: float = 0.0  # real completion tokens of one optimizer update over every rank


def micro_batch(tensors, rows, multiple: int = 1):
    """The rows' (n, L) sequences, attention mask and (n, T') loss mask, trimmed of the columns that are padding in
    every one of these rows (left of prompts, right of completions), L = P' + T' then padded on the left to a
    multiple of `multiple` (trl's pad_to_multiple_of: fewer shapes for a compiler; the positions follow the mask,
    so no number changes). `tensors`: the rollout's prompt ids, prompt mask, completion ids, completion mask and
    loss mask (grpo.generation.rollout.Rollout.loss_mask)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask = (tensor[rows] for tensor in tensors)
    prompt_len = int(prompt_mask.sum(-1).max())
    completion_len = max(1, int(completion_mask.sum(-1).max()))
    ids = torch.cat([prompt_ids[:, -prompt_len:], completion_ids[:, :completion_len]], 1)  # (n, P' + T')
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], completion_mask[:, :completion_len]], 1)
    extra = -ids.shape[1] % multiple
    if extra:  # (n, L) with L a multiple of `multiple`
        ids, attention_mask = (torch.nn.functional.pad(t, (extra, 0)) for t in (ids, attention_mask))
    return ids, attention_mask, loss_mask[:, :completion_len]  # (n, T')


def advantage_batch(rollout: Rollout, loss_mask: torch.Tensor, old_logps, ref_logps, weights: torch.Tensor,
                    options: UpdateOptions, world: World) -> AdvantageBatch:
    """The estimator's inputs over every rank's rows (on the CPU, padded to the widest rank's T): the weighted
    rewards, clipped to reward_clip_range, then with kl_in_reward minus the KL penalty, beta times the first-order
    KL of the policy that sampled against the reference, summed over the completion's tokens (trl's RLOOTrainer):
        r_i <- clip(sum_k w_k r_ik) - beta sum_t (log pi_old(o_it) - log pi_ref(o_it))"""
    per_func = world.gather_rows(rollout.rewards_per_func)  # (N_all, K); a plug-in estimator gets a copy of the batch
    plain = weighted_rewards(per_func, weights)  # (N_all,)
    rewards = plain.clamp(*options.reward_clip_range) if options.reward_clip_range else plain  # NaN stays NaN
    penalty = None
    if options.kl_in_reward:  # k1 per token, times beta; gather_rows pads each rank's T to the widest
        penalty = world.gather_rows(options.beta * (old_logps - ref_logps) * loss_mask).cpu()
    return AdvantageBatch(rewards if penalty is None else rewards - penalty.sum(-1), per_func, weights,
                          options.group_size, world.gather_rows(loss_mask.float()).cpu(), penalty,  # (N_all, T_max)
                          options.scale_rewards, None if rewards is plain and penalty is None else plain, options.beta)


@torch.no_grad()
def no_grad_logprobs(call, tensors, logprobs: Callable, batches: Callable, micro_batch_size: int,
                     autocast, multiple: int = 1) -> torch.Tensor:
    """(N, T) log-probs of the completions under `call`'s model, micro-batch by micro-batch, without grad
    (`multiple`: micro_batch's)."""
    completion_mask = tensors[3]  # (N, T)
    out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=completion_mask.device)
    for rows in batches(completion_mask.sum(-1), micro_batch_size):
        ids, attention_mask, mask = micro_batch(tensors, rows, multiple)
        with autocast:
            logps, _ = call(logprobs, ids, attention_mask, attention_mask[:, -mask.shape[1]:])  # (n, T')
        out[rows, : mask.shape[1]] = logps
    return out


def micro_batch_order(num_rows: int, seed: int, step: int, iteration: int, rank: int) -> torch.Tensor:
    """(N,) the rows in the order an iteration cuts into micro-batches: a permutation seeded by
    (seed, step, iteration, rank), so a resumed run draws the same one."""
    return torch.randperm(num_rows, generator=seeded(seed, step, iteration, rank))


def make_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup: int, total: int):
    """The learning-rate schedule, as transformers' get_scheduler computes it: `constant` (no warmup, as theirs),
    `linear` and `cosine` (a half cosine to 0) after `warmup` linear steps, over `total` optimizer updates."""

    def factor(update: int) -> float:  # the learning rate's share of --learning-rate after `update` updates
        if name == "constant":
            return 1.0
        if update < warmup:
            return update / max(1, warmup)
        if name == "linear":
            return max(0.0, (total - update) / max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (update - warmup) / max(1, total - warmup))))  # cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def sync_reference(ref_model, policy, alpha: float) -> None:
    """TR-DPO (arXiv 2404.09656): ref <- alpha * policy + (1 - alpha) * ref."""
    with torch.no_grad():  # FSDP2: both are sharded alike, each rank mixes its shards
        for ref_param, param in zip(ref_model.parameters(), policy.parameters(), strict=True):
            ref_param.mul_(1.0 - alpha).add_(param.to(ref_param.dtype), alpha=alpha)


def apply_update(options: UpdateOptions, models: Models, optimizer, scheduler, state: StepState, world: World,
                 finite: bool, stats: list[LossStats], after_update: Callable[[], None]) -> float:
    """Clip the accumulated gradient, then AdamW and the LR step (skipped, everywhere, when any rank's loss or
    the norm is not finite); the reference sync and entropy control after a step. Returns the gradient norm."""
    finite = not world.any(not finite)  # a non-finite loss on any rank skips the update everywhere
    max_norm = options.max_grad_norm if options.max_grad_norm > 0 else float("inf")
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(models.policy.parameters(), max_norm)).item()
    if not finite or not math.isfinite(grad_norm):
        skip_update(state, grad_norm if finite else float("nan"), options.max_bad_steps)
    else:
        optimizer.step()
        scheduler.step()
        state.updates += 1
        state.consecutive_bad_steps = 0
        after_update()  # a generation backend with its own copy of the weights refreshes it
        if options.sync_ref_model and state.updates % options.ref_model_sync_steps == 0:
            sync_reference(models.reference, models.policy, options.ref_model_mixup_alpha)
        if state.entropy.adaptive:  # the update's entropy over every rank's tokens
            state.entropy.update(world.sum(sum(s.entropy_sum for s in stats)),
                                 world.sum(sum(s.entropy_count for s in stats)))
    # Kept allocated: the vocabulary-sized gradients are then added into .grad in place each micro-batch
    # instead of being copied into new tensors.
    optimizer.zero_grad(set_to_none=False)
    return grad_norm


def skip_update(state: StepState, grad_norm: float, max_bad_steps: int) -> None:
    state.consecutive_bad_steps += 1
    state.skipped_updates += 1
    logger.warning("step %d: non-finite loss or gradient, or no advantage signal (grad_norm=%s): update skipped (%d "
                   "in a row, limit %d)", state.step + 1, grad_norm, state.consecutive_bad_steps, max_bad_steps)
    if state.consecutive_bad_steps >= max_bad_steps:
        raise TrainingError(f"{state.consecutive_bad_steps} consecutive updates were skipped (a non-finite loss or "
                            "gradient, or an advantage estimator without a signal); stopping. Lower the learning "
                            "rate, check the reward functions and plug-ins, or use --precision fp32.")


def check_rollout(options: UpdateOptions, world: World, rollout: Rollout, num_updates: int) -> None:
    prompts = options.prompts_per_step * num_updates // world.size  # this rank's share of k * B prompts
    if rollout.num_rows != prompts * options.group_size:
        raise ValueError(f"a rollout needs {prompts} prompts x num_generations = {prompts * options.group_size} "
                         f"rows grouped by {options.group_size} (per process, of {world.size}), "
                         f"got {rollout.num_rows}")


def behaviour_correction(rollout: Rollout, old_logps: torch.Tensor, loss_mask: torch.Tensor, options: UpdateOptions,
                         world: World) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The behaviour policy's log-probs pi_b (N, T) from the rollout, w = pi_old / pi_b truncated or masked (trl
    1.16's modes; (N, T) or (N, 1)), and trl's sampling/* metrics of the mismatch over every rank's tokens."""
    if rollout.sampler_logprobs is None:
        raise ValueError("the importance-sampling correction needs the rollout's sampler_logprobs (the behaviour "
                         "policy's per-token log-probs): build it with them, or pass "
                         "--no-importance-sampling-correction")
    behaviour = rollout.sampler_logprobs.to(old_logps.device)  # (N, T)
    is_weights = behaviour_weights(old_logps, behaviour, loss_mask, options.importance_sampling_mode,
                                   options.importance_sampling_clip_min, options.importance_sampling_clip_max)
    statistics = mismatch_statistics(old_logps, behaviour, loss_mask, is_weights)
    return behaviour, is_weights, sampling_metrics(world, statistics)


def rollout_tensors(rollout: Rollout, mask_truncated: bool, device) -> tuple[torch.Tensor, ...]:
    """(prompt ids, prompt mask, completion ids, completion mask, loss mask) on `device`, the truncated completions
    dropped from attention and loss when `mask_truncated` (trl's mask_truncated_completions)."""
    completion_mask, loss_mask = rollout.completion_mask.to(device), rollout.loss_mask.to(device)  # (N, T)
    if mask_truncated:
        kept = (~rollout.truncated.to(device))[:, None]
        completion_mask, loss_mask = completion_mask * kept, loss_mask * kept
    return (rollout.prompt_ids.to(device), rollout.prompt_mask.to(device), rollout.completion_ids.to(device),
            completion_mask, loss_mask)


def train_on_rollout(rollout: Rollout, options: UpdateOptions, models: Models, optimizer, scheduler,
                     state: StepState, world: World, functions: StepFunctions, reward_specs, num_updates: int = 1,
                     after_update=lambda: None, order: torch.Tensor | None = None) -> UpdateResult:
    """Advantages, reference/old log-probs, then num_iterations x k optimizer updates on one rollout.

    `rollout` holds this rank's rows (all of them at world size one). k = updates_per_generation: the
    rollout's micro-batches are split into k disjoint slices, one per update. Micro-batch losses are summed
    into the accumulated gradient, so each update equals the full-slice one (grpo.algorithm.loss.aggregate_loss says
    exactly when); DDP / FSDP2 average it over ranks. `reward_specs` (rewards.RewardSpec): the weights and
    names of the reward columns. `num_updates`: k (the run's updates per generation). `after_update`: called
    after each optimizer update (the generation backend's). `order`: (N,) the rows in the order every iteration cuts
    them into micro-batches (trl's: one shuffle per generation); None: a fresh seeded order per iteration.
    """
    check_rollout(options, world, rollout, num_updates)
    device, num_rows = models.device, rollout.num_rows
    tensors = rollout_tensors(rollout, options.mask_truncated_completions, device)
    completion_mask, loss_mask = tensors[3:]  # (N, T)

    # --- reference and old log-probs, without grad ---
    passes = partial(no_grad_logprobs, tensors=tensors, logprobs=functions.logprobs, batches=functions.batches,
                     micro_batch_size=options.micro_batch_size, autocast=models.autocast,
                     multiple=options.pad_to_multiple_of)
    ref_logps = passes(models.reference_call) if options.beta != 0.0 else None
    # old log-probs when some update runs after the policy moved, when w = pi_old / pi_b needs them, or the KL
    # penalty in the reward (of the policy that sampled)
    reused = options.num_iterations * num_updates > 1
    old_logps = passes(models.policy_call) if reused or options.corrects_behaviour or options.kl_in_reward else None

    # --- advantages: over every rank's rows, as one process would compute them ---
    weights = torch.tensor([spec.weight for spec in reward_specs], dtype=torch.float32)  # (K,)
    batch = advantage_batch(rollout, loss_mask, old_logps, ref_logps, weights, options, world)
    try:
        all_advantages, reward_stats = estimate_advantages(functions.advantage_estimator, batch,
                                                           options.normalize_advantages)
        signal = True
    except NoSignalError as error:  # a plug-in estimator gave nothing to learn from: skipped as a non-finite step
        logger.warning("step %d: %s; its updates are skipped", state.step + 1, error)
        all_advantages, reward_stats, signal = torch.zeros(batch.rewards.shape[0], 1), reward_statistics(batch), False
    advantages = world.local_rows(all_advantages).to(device)  # (N, 1), or (N, T_max) from a per-token estimator
    behaviour, is_weights, sampling_stats = None, None, {}
    if options.corrects_behaviour:
        behaviour, is_weights, sampling_stats = behaviour_correction(rollout, old_logps, loss_mask, options, world)

    # --- num_iterations x k x (micro-batches -> loss -> backward; clip; AdamW; LR) ---
    # dapo / cispo / vespo divide by the real tokens of one update over all ranks (the rollout's / k, as trl),
    # / world size because DDP and FSDP2 average the ranks' gradients
    num_items_in_batch = world.sum(loss_mask.sum().item()) / num_updates / world.size
    num_micro = num_rows // num_updates // options.micro_batch_size  # micro-batches of one update on this rank
    aggregation = dict(num_micro_batches=num_micro, max_completion_length=options.max_completion_length,
                       num_items_in_batch=num_items_in_batch)
    lengths = completion_mask.sum(-1).cpu()  # (N,)
    result = UpdateResult({}, advantages, ref_logps, old_logps, is_weights,
                          num_items_in_batch=num_items_in_batch * world.size)
    per_row = (advantages, old_logps, ref_logps, behaviour, is_weights)  # each (N, 1), (N, T) or None
    for iteration in range(options.num_iterations):
        rows_order = micro_batch_order(num_rows, options.seed, state.step, iteration, world.rank) if order is None \
            else order  # (N,)
        for update_rows in rows_order.chunk(num_updates):  # (N / k,) each update its own slice of the rows
            coef = state.entropy.applied()  # the same for the whole update; None: no entropy bonus
            finite, losses = signal, []
            for index, rows in enumerate(functions.update_batches(update_rows, lengths, options.micro_batch_size)):
                rows = rows.to(device)
                ids, attention_mask, mask = micro_batch(tensors, rows, options.pad_to_multiple_of)
                advantage, old, ref, sampled, weights = (None if values is None else values[rows, : mask.shape[1]]
                                                         for values in per_row)  # (n, 1) or (n, T') each
                with accumulating(models.policy_call, last=index == num_micro - 1):  # DDP: one all-reduce
                    with models.autocast:
                        loss, stats = models.policy_call(functions.update_loss, ids, attention_mask, mask, advantage,
                                                         old, ref, aggregation, coef, sampled, weights)
                    finite = finite and bool(torch.isfinite(loss))
                    loss.backward()  # also when not finite: every rank takes part in each gradient sync
                losses.append(loss.item())
                result.micro_batch_stats.append(stats)
            result.learning_rates.append(scheduler.get_last_lr()[0])  # what this update steps with
            result.grad_norms.append(apply_update(options, models, optimizer, scheduler, state, world, finite,
                                                  result.micro_batch_stats[-num_micro:], after_update))
            if coef is not None:
                result.entropy_coefs.append(state.entropy.coef)
            result.step_losses.append(world.sum(sum(losses)) / world.size)  # the loss whose gradient was applied
            result.micro_batch_losses += losses

    # trl counts each rollout's prompt tokens (once per completion) and completion tokens (the model's own)
    state.tokens_seen += int(world.sum(rollout.prompt_mask.sum().item() + rollout.loss_mask.sum().item()))
    # the estimator's statistics last: a per-token estimator's advantages/abs_mean is over the real tokens
    names = [spec.name for spec in reward_specs]
    metrics = step_metrics(world, rollout, loss_mask, batch.rewards_per_func, all_advantages, result, names,
                           result.learning_rates[-1], state.skipped_updates, state.tokens_seen, options.metrics_average)
    if len(result.grad_norms) > 1:  # each update's own loss, gradient norm, rate and loss statistics (trl logs them)
        metrics[PER_UPDATE] = update_metrics(world, result, num_micro, options.metrics_average)
    result.metrics = {**sampling_stats, **metrics, **reward_stats}
    return result


@torch.no_grad()
def evaluate_rollout(rollout: Rollout, options: UpdateOptions, models: Models, world: World,
                     functions: StepFunctions, reward_specs, tokens_seen: int) -> tuple[dict, float]:
    """A rollout's loss and metrics without an update, as trl evaluates a batch: its rows one micro-batch (no
    accumulation), the policy's own log-probs as the old ones (ratio 1), the advantages and the KL as in training,
    no entropy bonus. Returns the step's metrics (trl's names; the loss the mean over ranks) less grad_norm and
    learning_rate, and this rank's loss; nothing changes."""
    device = models.device
    tensors = rollout_tensors(rollout, options.mask_truncated_completions, device)
    loss_mask = tensors[4]  # (N, T)
    ref_logps = None
    if options.beta != 0.0:
        ref_logps = no_grad_logprobs(models.reference_call, tensors, functions.logprobs, functions.batches,
                                     options.micro_batch_size, models.autocast, options.pad_to_multiple_of)
    weights = torch.tensor([spec.weight for spec in reward_specs], dtype=torch.float32)  # (K,)
    batch = advantage_batch(rollout, loss_mask, None, ref_logps, weights, options, world)
    all_advantages, reward_stats = estimate_advantages(functions.advantage_estimator, batch,
                                                       options.normalize_advantages)
    advantages = world.local_rows(all_advantages).to(device)  # (N, 1) or (N, T_max)
    ids, attention_mask, mask = micro_batch(tensors, torch.arange(rollout.num_rows, device=device),
                                            options.pad_to_multiple_of)
    aggregation = dict(num_micro_batches=1, max_completion_length=options.max_completion_length,
                       num_items_in_batch=world.sum(loss_mask.sum().item()) / world.size)
    training = models.policy.training
    models.policy.eval()
    with models.autocast:
        loss, stats = models.policy_call(functions.update_loss, ids, attention_mask, mask,
                                         advantages[:, : mask.shape[1]], None,
                                         None if ref_logps is None else ref_logps[:, : mask.shape[1]], aggregation,
                                         None, None, None)
    models.policy.train(training)
    result = UpdateResult({}, advantages, ref_logps, None, micro_batch_stats=[stats],
                          step_losses=[world.sum(loss.item()) / world.size], grad_norms=[0.0], learning_rates=[0.0])
    names = [spec.name for spec in reward_specs]
    metrics = step_metrics(world, rollout, loss_mask, batch.rewards_per_func, all_advantages, result, names, 0.0, 0,
                           tokens_seen, options.metrics_average)
    for key in ("grad_norm", "learning_rate", "skipped_updates"):
        metrics.pop(key, None)
    return {**metrics, **reward_stats}, loss.item()

