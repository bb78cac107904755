"""A run's state beyond its weights, saved with every checkpoint and restored on --resume.

    step, optimizer updates, skipped-update counters, the LR schedule, the entropy coefficient
    (grpo.core.update.StepState), every random generator (torch, CUDA, Python), the world size it was saved at
    the optimizer state, keyed by parameter names (torch.distributed.checkpoint.state_dict), so any world
    size can load it; under torchrun the optimizer is saved sharded and each rank's generators apart

Checkpoints are written atomically by grpo.core.checkpoint; the trainer state is read back with weights_only=True.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from dataclasses import dataclass

from grpo.core.checkpoint import (REFERENCE, SHARDED, load_sharded_optimizer, load_trainer_state, save_checkpoint,
                             save_distributed_checkpoint)
from grpo.lora import merged_model
from grpo.core.update import Models, StepState

logger = logging.getLogger("grpo")


def rng_state() -> dict:
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": random.getstate(),
    }


def trainer_state(state: StepState, scheduler, world, optimizer=None, policy_call=None) -> dict:
    """Everything but the weights (the optimizer's state too when it is given, keyed by parameter names)."""
    saved = {
        "step": state.step,
        "scheduler": scheduler.state_dict(),
        **rng_state(),
        "consecutive_bad_steps": state.consecutive_bad_steps,
        "skipped_updates": state.skipped_updates,
        "tokens_seen": state.tokens_seen,
        "updates": state.updates,
        "entropy_control": state.entropy.state_dict(),
        "world_size": world.size,
    }
    if optimizer is not None:
        saved["optimizer"] = get_optimizer_state_dict(policy_call, optimizer)
    return saved


@dataclass(frozen=True)
class CheckpointOptions:
    """What a checkpoint holds beside the weights and the trainer state, and how many are kept."""

    keep: int  # the newest checkpoints kept (0: all); --save-total-limit
    merged: bool  # LoRA: also the base weights with the adapter folded in (--save-merged)
    reference: bool  # TR-DPO's mixed reference model (--sync-ref-model), state of the run


def save(run_dir: Path, options: CheckpointOptions, state: StepState, models: Models, optimizer, scheduler, world,
         tokenizer, record: dict) -> Path:
    """An atomic checkpoint of the run at its current step; returns its folder. `record`: run_record's."""
    sync = options.reference  # TR-DPO's mixed reference is state
    model = models.peft_model if models.peft_model is not None else models.policy  # LoRA: the adapter, peft's format
    merged = merged_model(models.peft_model) if options.merged and world.is_main else None
    if models.distributed != "none":  # DDP / FSDP2 (also at one process): sharded state, gathered weights
        return save_distributed_checkpoint(
            run_dir, state.step, world, models.policy_call, optimizer, model, tokenizer,
            trainer_state(state, scheduler, world), rng_state(), record, options.keep,
            reference_call=models.reference_call if sync else None, merged=merged)
    return save_checkpoint(run_dir, state.step, model, tokenizer,
                           trainer_state(state, scheduler, world, optimizer, models.policy_call), record,
                           options.keep, reference=models.reference if sync else None, merged=merged)


def restore(checkpoint: Path, state: StepState, models: Models, optimizer, scheduler, world,
            sync_ref_model: bool = False) -> None:
    """Load a checkpoint's trainer state into `state`, the optimizer and the schedule (its weights were loaded
    with the models), and every random generator."""
    saved = load_trainer_state(checkpoint)
    state.step = saved["step"]
    if (checkpoint / SHARDED).is_dir():  # saved under torchrun: resharded for this world
        load_sharded_optimizer(checkpoint, models.policy_call, optimizer, world.group)
    else:
        set_optimizer_state_dict(models.policy_call, optimizer, optim_state_dict=saved["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(saved["scheduler"])
    rank_file = checkpoint / f"rank-{world.rank:05d}.pt"
    rng = torch.load(rank_file, weights_only=True) if rank_file.exists() else saved
    torch.set_rng_state(rng["torch_rng"])
    if rng["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda_rng"])
    random.setstate(rng["python_rng"])
    state.consecutive_bad_steps = saved["consecutive_bad_steps"]
    state.skipped_updates = saved["skipped_updates"]
    state.tokens_seen = saved.get("tokens_seen", 0)  # older checkpoints did not count them
    state.updates = saved["updates"]
    state.entropy.load_state_dict(saved["entropy_control"])
    if sync_ref_model and not (checkpoint / REFERENCE).is_dir():
        logger.warning("%s holds no synced reference model (%s/): the reference restarts from --model",
                       checkpoint, REFERENCE)
    saved_world = saved.get("world_size", 1)
    if saved_world != world.size:
        logger.info("checkpoint saved by %d process(es), resumed by %d: the optimizer state is resharded; "
                    "sampling is seeded per prompt, so the run continues as it would have", saved_world, world.size)
    logger.info("resumed from %s at step %d", checkpoint, state.step)
