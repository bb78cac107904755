"""One GRPO update: a rollout's advantages and reference log-probs, then num_iterations x k optimizer updates.

    advantages  (N,) group-relative, scaled, over every rank's rows      grpo.advantages (DeepSeekMath 4.1.2)
    ref / old   (N, T) log-probs without grad, micro-batch by micro-batch  functions.logprobs
                (ref if beta != 0; old if the rollout feeds more than one update, else rho = 1)
    update      for each of num_iterations x k updates, over its slice of the rows:
                  micro-batches -> log-probs -> per-token loss -> aggregate   functions.update_loss, grpo.loss
                  (- entropy bonus) -> backward, the gradients accumulating
                -> clip the norm -> AdamW -> LR step (-> TR-DPO reference sync, entropy control)
    metrics     trl's names, over every rank's tokens and rows

`functions` (StepFunctions) are the calls that compute log-probs, the loss and the micro-batches, chosen once
by grpo.kernels.select_kernels: under `--kernels plain` they are `plain_step_functions` below, grpo/'s own
code; under `auto`, kernels that compute the same numbers. `run` is the Trainer: its models (ModelCalls,
wrapped in DDP / FSDP2 under torchrun), optimizer, scheduler, counters and config. Collectives go through
`run.world` and are identities at world size one.

Notation: N rows of this rank's rollout, n of a micro-batch, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from grpo.advantages import decoupled_advantages, group_advantages, weighted_rewards
from grpo.checkpoint import latest_checkpoint
from grpo.distributed import accumulating, full_tensor
from grpo.entropy import entropy_bonus, high_entropy_mask
from grpo.logprobs import completion_logprobs
from grpo.loss import LossOptions, aggregate_loss, per_token_loss
from grpo.loss_stats import loss_statistics, policy_loss_value
from grpo.metrics import step_metrics
from grpo.rollout import Rollout
from grpo.seeding import seeded

logger = logging.getLogger("grpo")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps); the last good checkpoint is kept."""


@dataclass
class StepFunctions:
    """What the update calls to get log-probs, a micro-batch's loss and the micro-batches (chosen once)."""

    logprobs: Callable  # (model, ids, attention_mask, completion_mask) -> ((n, T) logps, None); no grad passes
    update_loss: Callable  # (model, ids, attention_mask, loss_mask, advantages, old, ref, aggregation)
    #                        -> (loss, (n, T) logps, (n, T) entropy); old None when on-policy; the completion
    #                        the model reads is attention_mask's last T columns, loss_mask the tokens counted
    batches: Callable  # (lengths (N,), micro_batch_size) -> [rows]: the reference / old passes' micro-batches
    update_batches: Callable  # (order (N,), lengths (N,), micro_batch_size, num_updates) -> [rows], in order


def plain_batches(lengths: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Consecutive rows."""
    return list(torch.arange(lengths.shape[0], device=lengths.device).split(micro_batch_size))


def plain_update_batches(order, lengths, micro_batch_size: int, num_updates: int) -> list[torch.Tensor]:
    """`order` cut into micro-batches; update u takes the u-th num_micro of them."""
    return list(order.split(micro_batch_size))


def logprob_loss(logprobs: Callable, options: LossOptions) -> Callable:
    """The update loss as the paper writes it: log-probs -> per-token loss -> aggregation."""

    def update_loss(model, ids, attention_mask, loss_mask, advantages, old_logps, ref_logps, aggregation):
        completion_mask = attention_mask[:, -loss_mask.shape[1]:]  # (n, T) tool results included
        logps, entropy = logprobs(model, ids, attention_mask, completion_mask, with_entropy=True)  # (n, T)
        old = logps.detach() if old_logps is None else old_logps  # on-policy: rho = 1
        token_losses = per_token_loss(logps, old, advantages, loss_mask, ref_logps, options, entropy)
        return aggregate_loss(token_losses, loss_mask, options.loss_type, **aggregation), logps, entropy

    return update_loss


def plain_step_functions(options: LossOptions, temperature: float, chunk_size: int | None = None,
                         fp32_head: bool = False) -> StepFunctions:
    """grpo/'s own functions (`--kernels plain`)."""
    logprobs = partial(completion_logprobs, temperature=temperature, chunk_size=chunk_size, fp32_head=fp32_head)
    return StepFunctions(logprobs, logprob_loss(logprobs, options), plain_batches, plain_update_batches)


def micro_batch(tensors, rows):
    """The rows' (n, P' + T') sequences, attention mask and (n, T') loss mask, trimmed of the columns that are
    padding in every one of these rows (left of prompts, right of completions). `tensors`: the rollout's
    prompt ids, prompt mask, completion ids, completion mask and loss mask (grpo.rollout.Rollout.loss_mask)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask = (tensor[rows] for tensor in tensors)
    prompt_len = int(prompt_mask.sum(-1).max())
    completion_len = max(1, int(completion_mask.sum(-1).max()))
    ids = torch.cat([prompt_ids[:, -prompt_len:], completion_ids[:, :completion_len]], 1)  # (n, P' + T')
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], completion_mask[:, :completion_len]], 1)
    return ids, attention_mask, loss_mask[:, :completion_len]  # (n, T')


def advantages_of(rewards_per_func: torch.Tensor, weights: torch.Tensor, config) -> tuple[torch.Tensor, dict]:
    """(N,) advantages and the reward statistics of (N, K) rewards, by multi_objective_aggregation."""
    if config.multi_objective_aggregation == "normalize_then_sum":  # GDPO: each reward normalised in its group
        return decoupled_advantages(rewards_per_func, weights, config.num_generations)
    rewards = weighted_rewards(rewards_per_func, weights)  # (N,)
    return group_advantages(rewards, config.num_generations, config.scale_rewards)


@torch.no_grad()
def no_grad_logprobs(run, call, tensors) -> torch.Tensor:
    """(N, T) log-probs of the completions under `call`'s model, micro-batch by micro-batch, without grad."""
    functions, completion_mask = run.step_functions, tensors[3]
    out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=completion_mask.device)
    for rows in functions.batches(completion_mask.sum(-1), run.config.micro_batch_size):
        ids, attention_mask, mask = micro_batch(tensors, rows)
        with run.autocast:
            logps, _ = call(functions.logprobs, ids, attention_mask, attention_mask[:, -mask.shape[1]:])  # (n, T')
        out[rows, : mask.shape[1]] = logps
    return out


def micro_batch_loss(run, ids, attention_mask, mask, advantages, old_logps, ref_logps, aggregation,
                     entropy_coef=0.0):
    """One micro-batch's aggregated loss (grad attached) and its statistics; old_logps None when on-policy.

    log-probs -> per-token loss -> aggregation (grpo.logprobs, grpo.loss), minus the entropy bonus when on.
    """
    options, num_micro = run.loss_options, aggregation["num_micro_batches"]
    with run.autocast:
        loss, logps, entropy = run.policy_call(run.step_functions.update_loss, ids, attention_mask, mask, advantages,
                                               old_logps, ref_logps, aggregation)
    detached = logps.detach()
    stats = loss_statistics(detached, detached if old_logps is None else old_logps, advantages, mask, ref_logps,
                            options, entropy.detach())
    if run.entropy_control.enabled:  # loss - coef * mean entropy over the tokens the policy loss keeps
        stats.policy_loss = policy_loss_value(loss.item(), options.loss_type, num_micro)
        acting = mask if options.top_entropy_quantile >= 1.0 else mask * high_entropy_mask(
            entropy, mask, options.top_entropy_quantile)
        loss = loss - entropy_coef * entropy_bonus(entropy, acting, num_micro)
    return loss, stats


def accumulate_gradients(run, batches, tensors, advantages, old_logps, ref_logps, aggregation, entropy_coef):
    """loss.backward() over the update's micro-batches (their gradients add up in .grad).

    Returns (finite on this rank, the micro-batch losses, their statistics)."""
    finite, losses, stats = True, [], []
    for index, rows in enumerate(batches):
        rows = rows.to(advantages.device)
        ids, attention_mask, mask = micro_batch(tensors, rows)
        ref = None if ref_logps is None else ref_logps[rows, : mask.shape[1]]
        old = None if old_logps is None else old_logps[rows, : mask.shape[1]]
        with accumulating(run.policy_call, last=index == len(batches) - 1):  # DDP: one all-reduce, at the end
            loss, micro_stats = micro_batch_loss(run, ids, attention_mask, mask, advantages[rows], old, ref,
                                                 aggregation, entropy_coef)
            finite = finite and bool(torch.isfinite(loss))
            loss.backward()  # also when not finite: every rank takes part in each gradient sync
        losses.append(loss.item())
        stats.append(micro_stats)
    return finite, losses, stats


def sync_reference(ref_model, policy, alpha: float) -> None:
    """TR-DPO (arXiv 2404.09656): ref <- alpha * policy + (1 - alpha) * ref."""
    with torch.no_grad():  # FSDP2: both are sharded alike, each rank mixes its shards
        for ref_param, param in zip(ref_model.parameters(), policy.parameters(), strict=True):
            ref_param.mul_(1.0 - alpha).add_(param.to(ref_param.dtype), alpha=alpha)


def apply_update(run, finite: bool, stats: list) -> float:
    """Clip the accumulated gradient, then AdamW and the LR step (skipped, everywhere, when any rank's loss or
    the norm is not finite); the reference sync and entropy control after a step. Returns the gradient norm."""
    cfg, world = run.config, run.world
    finite = not world.any(not finite)  # a non-finite loss on any rank skips the update everywhere
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(run.policy.parameters(), max_norm)).item()
    if not finite or not math.isfinite(grad_norm):
        skip_update(run, grad_norm if finite else float("nan"))
    else:
        run.optimizer.step()
        run.scheduler.step()
        run.updates += 1
        run.generation.after_update()  # a backend with its own copy of the weights refreshes it
        run.consecutive_bad_steps = 0
        if cfg.sync_ref_model and run.updates % cfg.ref_model_sync_steps == 0:
            sync_reference(run.ref_model, run.policy, cfg.ref_model_mixup_alpha)
        if run.entropy_control.adaptive:  # the update's entropy over every rank's tokens
            run.entropy_control.update(world.sum(sum(s.entropy_sum for s in stats)),
                                       world.sum(sum(s.entropy_count for s in stats)))
    # Kept allocated: the vocabulary-sized gradients are then added into .grad in place each micro-batch
    # instead of being copied into new tensors.
    run.optimizer.zero_grad(set_to_none=False)
    return grad_norm


def skip_update(run, grad_norm: float) -> None:
    run.consecutive_bad_steps += 1
    run.skipped_updates += 1
    logger.warning("step %d: non-finite loss or gradient (grad_norm=%s): update skipped (%d in a row, limit %d)",
                   run.step + 1, grad_norm, run.consecutive_bad_steps, run.config.max_bad_steps)
    if run.consecutive_bad_steps >= run.config.max_bad_steps:
        raise TrainingError(
            f"{run.consecutive_bad_steps} consecutive steps had a non-finite loss or gradient; stopping. "
            f"The last good checkpoint is {latest_checkpoint(run.run_dir) or 'none (no checkpoint was saved yet)'}. Lower "
            "the learning rate, check the reward functions, or use --precision fp32.")


def check_rollout(run, rollout: Rollout) -> None:
    cfg, world = run.config, run.world
    expected = cfg.completions_per_generation // world.size
    if rollout.num_rows != expected or rollout.num_rows % cfg.num_generations:
        raise ValueError(f"a rollout needs {cfg.prompts_per_generation // world.size} prompts x num_generations = "
                         f"{expected} rows grouped by {cfg.num_generations} (per process, of {world.size}), "
                         f"got {rollout.num_rows}")


def train_on_rollout(run, rollout: Rollout, shuffle: bool = True) -> dict:
    """Advantages, reference/old log-probs, then num_iterations x k optimizer updates on one rollout.

    `rollout` holds this rank's rows (all of them at world size one). k = updates_per_generation: the
    rollout's micro-batches are split into k disjoint slices, one per update. Returns the step's metrics
    (over every rank). Micro-batch losses are summed into the accumulated gradient, so each update equals
    the full-slice one (grpo.loss.aggregate_loss says exactly when); DDP / FSDP2 average it over ranks.
    shuffle=False: micro-batches of consecutive rows in rollout order, never regrouped (the parity tests).
    Each of `run.observers` is called with the step's intermediate values (advantages, log-probs, losses).
    """
    check_rollout(run, rollout)
    cfg, world, device = run.config, run.world, run.device
    num_rows, num_updates = rollout.num_rows, cfg.updates_per_generation
    completion_mask, loss_mask = rollout.completion_mask.to(device), rollout.loss_mask.to(device)  # (N, T)
    if cfg.mask_truncated_completions:  # drops them from attention and loss, as trl
        kept = (~rollout.truncated.to(device))[:, None]
        completion_mask, loss_mask = completion_mask * kept, loss_mask * kept
    tensors = (rollout.prompt_ids.to(device), rollout.prompt_mask.to(device), rollout.completion_ids.to(device),
               completion_mask, loss_mask)

    # --- advantages: over every rank's rows, as one process would compute them ---
    all_rewards = world.gather_rows(rollout.rewards_per_func)  # (N_all, K)
    all_advantages, reward_stats = advantages_of(all_rewards, run.reward_weights, cfg)  # (N_all,)
    advantages = world.local_rows(all_advantages).to(device)  # (N,)

    # --- reference and old log-probs, without grad ---
    started = time.perf_counter()
    ref_logps = no_grad_logprobs(run, run.ref_call, tensors) if cfg.beta != 0.0 else None
    off_policy = cfg.num_iterations * num_updates > 1  # some update runs after the policy moved
    old_logps = no_grad_logprobs(run, run.policy_call, tensors) if off_policy else None
    if device.type == "cuda":  # wait for the queued GPU work, so the time is the passes' own
        torch.cuda.synchronize(device)
    reference_time = time.perf_counter() - started

    # --- num_iterations x k x (micro-batches -> loss -> backward; clip; AdamW; LR) ---
    # dapo / cispo / vespo divide by the real tokens of one update over all ranks (the rollout's / k, as trl),
    # / world size because DDP and FSDP2 average the ranks' gradients
    num_items_in_batch = world.sum(loss_mask.sum().item()) / num_updates / world.size
    aggregation = dict(num_micro_batches=run.local_micro_batches, max_completion_length=cfg.max_completion_length,
                       num_items_in_batch=num_items_in_batch)
    lengths = completion_mask.sum(-1).cpu()  # (N,)
    record = {"micro_batch_losses": [], "micro_batch_stats": [], "entropy_coefs": [], "step_losses": [],
              "grad_norms": []}
    for iteration in range(cfg.num_iterations):
        if shuffle:
            order = torch.randperm(num_rows, generator=seeded(cfg.seed, run.step, iteration, world.rank))
            batches = run.step_functions.update_batches(order, lengths, cfg.micro_batch_size, num_updates)
        else:
            batches = plain_update_batches(torch.arange(num_rows), lengths, cfg.micro_batch_size, num_updates)
        for update in range(num_updates):
            coef = run.entropy_control.applied()  # the same for every micro-batch of this update
            slice_ = batches[update * run.local_micro_batches : (update + 1) * run.local_micro_batches]
            finite, losses, stats = accumulate_gradients(run, slice_, tensors, advantages, old_logps, ref_logps,
                                                         aggregation, coef)
            record["grad_norms"].append(apply_update(run, finite, stats))
            if run.entropy_control.enabled:
                record["entropy_coefs"].append(run.entropy_control.coef)
            record["step_losses"].append(world.sum(sum(losses)) / world.size)  # the loss whose gradient was applied
            record["micro_batch_losses"] += losses
            record["micro_batch_stats"] += stats

    record.update(advantages=advantages, ref_logps=ref_logps, old_logps=old_logps,
                  num_items_in_batch=num_items_in_batch * world.size)
    for observe in run.observers:
        observe(record)
    metrics = step_metrics(run, rollout, loss_mask, all_rewards, all_advantages, record)
    return {**reward_stats, **metrics, "reference_time": reference_time}
