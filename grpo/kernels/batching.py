"""Same losses and gradients as the plain path's micro-batches, less padding: rows of similar length together.

A micro-batch's sequences are as wide as its longest prompt plus its longest completion (grpo.core.trainer trims the
columns that are padding in every row), so a micro-batch that mixes a 20-token completion with a 250-token one
runs the trunk over 230 padding positions for the short row. Real runs end their completions anywhere in the
budget, and this padding is where much of the log-prob passes' time goes.

    plain      the update's rows in the step's random order, cut into consecutive micro-batches
    grouped    the same rows for each update (the same slice of the random order), sorted by completion length
               (stable), then cut into micro-batches: each update sees the same rows, in other micro-batches

For the loss types whose accumulated loss does not depend on which rows share a micro-batch (grpo, sapo,
dr_grpo, luspo: equal row counts per micro-batch; dapo, cispo, vespo: the step's token count; grpo.algorithm.loss.
aggregate_loss) the gradient is the same sum, in another order: equal to rounding. `bnpo`, the entropy mask
(a quantile per micro-batch) and the entropy bonus (a mean per micro-batch) depend on the grouping, so they keep
the plain one (grpo.kernels.select_kernels says so). The reference and old-policy passes have no such coupling:
their rows are always sorted (`length_sorted`). tests/test_kernels.py pins the grouped step to the plain one.
"""

from __future__ import annotations

import torch


def length_grouped(rows: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """One update's micro-batches: as grpo.algorithm.step.plain_update_batches cuts `rows` (N / k,), after sorting them
    by lengths[row] (stable), so each update sees the same rows, in other micro-batches."""
    return list(rows[torch.sort(lengths[rows], stable=True).indices].split(micro_batch_size))


def length_sorted(lengths: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """All N rows, shortest completion first, cut into micro-batches: for passes without a loss (no coupling)."""
    return list(torch.sort(lengths, stable=True).indices.split(micro_batch_size))
