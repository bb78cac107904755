"""A run's state beyond its weights, saved with every checkpoint and restored on --resume.

    step, optimizer updates, skipped-update counters, the LR schedule, the entropy coefficient,
    every random generator (torch, CUDA, Python, the sampler's), the world size it was saved at
    the optimizer state, keyed by parameter names (torch.distributed.checkpoint.state_dict), so any world
    size can load it; under torchrun the optimizer is saved sharded and each rank's generators apart

Checkpoints are written atomically by grpo.checkpoint; the trainer state is read back with weights_only=True.
`run` is the Trainer.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from grpo.checkpoint import (REFERENCE, SHARDED, load_sharded_optimizer, load_trainer_state, save_checkpoint,
                             save_distributed_checkpoint)
from grpo.lora import merged_model
from rewards import describe_rewards

logger = logging.getLogger("grpo")


def rng_state() -> dict:
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": random.getstate(),
    }


def trainer_state(run, with_optimizer: bool = True) -> dict:
    """Everything but the weights."""
    state = {
        "step": run.step,
        "scheduler": run.scheduler.state_dict(),
        **rng_state(),
        "sample_generator": run.sample_generator.get_state(),
        "consecutive_bad_steps": run.consecutive_bad_steps,
        "skipped_updates": run.skipped_updates,
        "updates": run.updates,
        "entropy_control": run.entropy_control.state_dict(),
        "world_size": run.world.size,
    }
    if with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(run.policy_call, run.optimizer)
    return state


def run_record(run) -> dict:
    """The settings and what actually ran: the reward functions (also those passed from Python), the task,
    the kernels and the generation backend (run_config.json, and each checkpoint's)."""
    return {**run.config.to_dict(), "reward_functions": describe_rewards(run.rewards), "task": run.task,
            "kernels_used": run.kernels.used(), "kernels_off": run.kernels.reasons,
            "generation": type(run.generation).__name__, "world_size": run.world.size,
            "distributed_mode": run.distributed}


def save(run) -> Path:
    """An atomic checkpoint of the run at its current step; returns its folder."""
    config = run.config
    sync = config.sync_ref_model  # TR-DPO's mixed reference is state
    model = run.peft_model if run.peft_model is not None else run.policy  # LoRA: the adapter, peft's format
    merged = merged_model(run.peft_model) if config.save_merged and run.world.is_main else None
    if run.distributed != "none":  # DDP / FSDP2 (also at one process): sharded state, gathered weights
        return save_distributed_checkpoint(
            run.run_dir, run.step, run.world, run.policy_call, run.optimizer, model, run.tokenizer,
            trainer_state(run, with_optimizer=False), rng_state(), run_record(run), config.save_total_limit,
            reference_call=run.ref_call if sync else None, merged=merged)
    return save_checkpoint(run.run_dir, run.step, model, run.tokenizer, trainer_state(run), run_record(run),
                           config.save_total_limit, reference=run.ref_model if sync else None, merged=merged)


def restore(run, checkpoint: Path) -> None:
    """Load a checkpoint's trainer state into `run` (its weights were loaded with the models)."""
    state = load_trainer_state(checkpoint)
    run.step = state["step"]
    if (checkpoint / SHARDED).is_dir():  # saved under torchrun: resharded for this world
        load_sharded_optimizer(checkpoint, run.policy_call, run.optimizer)
    elif all(isinstance(key, int) for key in state["optimizer"]["state"]):  # older checkpoints
        run.optimizer.load_state_dict(state["optimizer"])
    else:
        set_optimizer_state_dict(run.policy_call, run.optimizer, optim_state_dict=state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    run.scheduler.load_state_dict(state["scheduler"])
    rank_file = checkpoint / f"rank-{run.world.rank:05d}.pt"
    rng = torch.load(rank_file, weights_only=True) if rank_file.exists() else state
    torch.set_rng_state(rng["torch_rng"])
    if rng["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda_rng"])
    random.setstate(rng["python_rng"])
    run.sample_generator.set_state(state["sample_generator"])
    run.consecutive_bad_steps = state["consecutive_bad_steps"]
    run.skipped_updates = state["skipped_updates"]
    run.updates = state.get("updates", run.step * run.config.num_iterations * run.config.updates_per_generation)
    if "entropy_control" in state:
        run.entropy_control.load_state_dict(state["entropy_control"])
    if run.config.sync_ref_model and not (checkpoint / REFERENCE).is_dir():
        logger.warning("%s holds no synced reference model (%s/): the reference restarts from --model",
                       checkpoint, REFERENCE)
    saved_world = state.get("world_size", 1)
    if saved_world != run.world.size:
        logger.info("checkpoint saved by %d process(es), resumed by %d: the optimizer state is resharded; "
                    "sampling is seeded per prompt, so the run continues as it would have", saved_world,
                    run.world.size)
    logger.info("resumed from %s at step %d", checkpoint, run.step)
