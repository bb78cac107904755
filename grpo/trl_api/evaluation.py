"""trl's evaluation on our engine: `evaluate()` as trl 1.16's GRPOTrainer runs it.

trl evaluates by sampling, not greedily: its eval sampler reads eval_dataset in one permutation seeded by
`args.seed` (the same at every evaluation), each prompt `num_generations_eval` times, `per_device_eval_batch_size`
completions a batch per rank; each batch is sampled (or given by the rollout_func), scored, and its loss computed as
in training but without an update (grpo.core.update.evaluate_rollout: one batch, no accumulation, ratio 1). The
logged values are the means over batches, under trl's names with the `eval_` prefix; the loss is weighted as
transformers and accelerate weigh it (each rank's batch loss counted batch_size times, the last batch cut to
len(eval_dataset) % (batch_size x ranks) of those; a stream's batch losses weigh the same).
"""

from __future__ import annotations

import math
import time

import torch

def eval_batches(num_rows: int, seed: int, prompts_per_batch: int, world_size: int,
                 in_order: bool = False) -> list[list[int]]:
    """The eval rows of each batch over every rank, in trl's order: a permutation seeded by `seed` (`in_order`: the
    rows as given, a stream trl shuffled as it read it), cut into batches of world_size * prompts_per_batch prompts;
    the last is filled from the start, as accelerate evens batches."""
    order = list(range(num_rows)) if in_order else \
        torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    size = prompts_per_batch * world_size
    batches = [order[start : start + size] for start in range(0, num_rows, size)]
    if world_size > 1 and len(batches[-1]) < size:
        batches[-1] = (batches[-1] + order * size)[:size]
    return batches


def evaluate_like_trl(engine, rows: list[dict], seed: int, group: int, batch_size: int,
                      in_order: bool = False) -> dict:
    """trl's evaluate() of `rows` on `engine` (grpo.core.trainer.Trainer), `group` completions per prompt and
    `batch_size` completions a batch per rank (`in_order`: eval_batches'). Returns trl's metrics without the `eval_`
    prefix: loss and the step's metrics (rewards, lengths, entropy, clip ratios, ...), and runtime, samples and steps
    per second."""
    from grpo.core.update import evaluate_rollout

    started = time.time()
    world = engine.world
    batches = eval_batches(len(rows), seed, batch_size // group, world.size, in_order)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    losses: list[float] = []
    completions = 0
    for number, batch in enumerate(batches):
        share = len(batch) // world.size
        own = [rows[index] for index in batch[world.rank * share : (world.rank + 1) * share]]
        rollout, _, _ = engine.sample_rows(own, group, (seed, 31337, number, world.rank))
        metrics, rank_loss = evaluate_rollout(rollout, engine.update_options, engine.models, world, engine.functions,
                                              engine.rewards, engine.state.tokens_seen)
        metrics.pop("loss")
        # transformers repeats each rank's batch loss batch_size times and gathers them, the last batch cut below as
        # accelerate knows the length; a stream's batches weigh the same (measured against trl 1.16)
        counted = 1 if in_order else batch_size
        for loss, times in world.gather_rows(torch.tensor([[rank_loss, counted]], dtype=torch.float64)).tolist():
            losses += [loss] * int(times)
        completions += rollout.num_rows
        for key, value in metrics.items():  # trl's mean leaves NaN out (None when all are)
            sums[key] = sums.get(key, 0.0) + (0.0 if math.isnan(value) else value)
            counts[key] = counts.get(key, 0) + (not math.isnan(value))
    # accelerate cuts the last batch's gathered losses to len(dataset) % (batch_size x ranks), counting the rows
    # against completions, so a short last batch weighs less (trl 1.16, accelerate's gather_for_metrics)
    remainder = len(rows) % (batch_size * world.size)
    if remainder and not in_order:
        losses = losses[: len(losses) - batch_size * world.size + remainder]
    runtime = time.time() - started
    result = {"loss": sum(losses) / len(losses)}
    result.update({key: sums[key] / counts[key] if counts[key] else None for key in sums})
    result.update(runtime=runtime, samples_per_second=completions / max(runtime, 1e-9),
                  steps_per_second=len(batches) / max(runtime, 1e-9))
    return result
