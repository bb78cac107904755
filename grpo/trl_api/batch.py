"""trl's batch arithmetic in this engine's units.

trl 1.16 counts completions per process and micro-step (GRPOConfig.__post_init__):
    per optimizer step   per_device_train_batch_size * world_size * gradient_accumulation_steps completions
    per generation       generation_batch_size = per_device_train_batch_size * world_size * steps_per_generation
                         (steps_per_generation defaults to gradient_accumulation_steps)
and each generation is reused num_iterations times, so one generation feeds
    num_iterations * steps_per_generation / gradient_accumulation_steps optimizer steps; max_steps counts those.
Here a step is one rollout: prompts_per_step (B, over all processes) x num_generations (G) completions in
micro-batches of micro_batch_size per process, k = steps_per_generation / accumulation steps slices of it, each
slice one optimizer update, num_iterations times. So
    micro_batch_size = per_device_train_batch_size
    B = per_device_train_batch_size * world_size * gradient_accumulation_steps / G
    max_steps (ours) = max_steps (trl's) / (num_iterations * k)
Where trl would let a group span two optimizer steps, or a generation end inside one, the translation refuses
with the nearest settings that agree; the numbers are otherwise trl's (tests/test_trl_api.py, and
tests/test_trl_parity.py, which builds both sides' batches from one call of `translate`).
"""

from __future__ import annotations

from typing import NamedTuple


class Batch(NamedTuple):
    """Our batch settings for one trl configuration."""

    prompts_per_step: int  # B, over all processes
    micro_batch_size: int  # completions per forward/backward, per process
    steps_per_generation: int | None  # None: one generation per optimizer update (k = 1)
    max_steps: int  # rollouts; 0: derive from the epochs
    updates_per_step: int  # optimizer updates one of our steps makes: num_iterations * k


def translate(per_device_train_batch_size: int, gradient_accumulation_steps: int, num_generations: int,
              world_size: int = 1, steps_per_generation: int | None = None, generation_batch_size: int | None = None,
              max_steps: int = -1, num_iterations: int = 1) -> Batch:
    """trl's batch settings -> ours (module docstring); a ValueError names the trl settings that do not translate."""
    per_device, accumulation, group = per_device_train_batch_size, gradient_accumulation_steps, num_generations
    for name, value in [("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", accumulation),
                        ("num_generations", group), ("world_size", world_size), ("num_iterations", num_iterations)]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if steps_per_generation is not None and generation_batch_size is not None:
        raise ValueError("set steps_per_generation or generation_batch_size, not both (as trl)")
    per_round = per_device * world_size  # completions of one micro-step over all processes
    if generation_batch_size is not None:
        if generation_batch_size < 1 or generation_batch_size % per_round:
            raise ValueError(f"generation_batch_size ({generation_batch_size}) must be a positive multiple of "
                             f"per_device_train_batch_size * world size = {per_round} (as trl)")
        steps_per_generation = generation_batch_size // per_round
    per_step = per_round * accumulation
    if per_step % group:
        raise ValueError(f"per_device_train_batch_size * world size * gradient_accumulation_steps = {per_device} * "
                         f"{world_size} * {accumulation} = {per_step} completions per optimizer step is not a multiple "
                         f"of num_generations = {group}: trl would split a group over two optimizer steps, which "
                         f"this engine does not; make it a multiple of {group}")
    k = 1
    if steps_per_generation is not None:
        if steps_per_generation < 1 or steps_per_generation % accumulation:
            raise ValueError(f"steps_per_generation ({steps_per_generation}) must be a positive multiple of "
                             f"gradient_accumulation_steps ({accumulation}) here: trl would end a generation inside an "
                             "optimizer step")
        k = steps_per_generation // accumulation
    updates = num_iterations * k
    ours_max_steps = 0
    if max_steps > 0:
        if max_steps % updates:
            raise ValueError(f"max_steps ({max_steps}) counts optimizer steps, and each generation here feeds "
                             f"num_iterations * steps_per_generation / gradient_accumulation_steps = {updates} of "
                             f"them: make max_steps a multiple of {updates}")
        ours_max_steps = max_steps // updates
    return Batch(per_step // group, per_device, None if k == 1 else k * accumulation, ours_max_steps, updates)
