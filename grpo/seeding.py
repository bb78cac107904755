"""Seeded CPU generators whose stream depends only on the numbers given (seed, step, position, ...), and the
data order drawn from them.

The loop draws its data order, sampling noise and micro-batch shuffles from these, so a resumed run and a run on
another world size draw the same numbers as an uninterrupted single-process one.
"""

from __future__ import annotations

import torch


def seeded(*numbers: int) -> torch.Generator:
    """A CPU generator seeded by a hash of `numbers`."""
    seed = 0
    for number in numbers:
        seed = (seed * 1_000_003 + number) % (2**63)
    return torch.Generator().manual_seed(seed)


def step_prompts(step: int, count: int, dataset_size: int, seed: int, shuffle: bool = True) -> list[int]:
    """The `count` prompt indices of a step: the dataset read in a fresh seeded permutation per epoch (its own
    order without shuffle), `count` at a time, so any step's prompts follow from (seed, step) alone."""
    permutations = {}  # epoch -> its permutation; a step spans at most a few epochs
    indices = []
    for position in range(step * count, (step + 1) * count):
        epoch, offset = divmod(position, dataset_size)
        if epoch not in permutations:
            permutations[epoch] = (torch.randperm(dataset_size, generator=seeded(seed, epoch)) if shuffle
                                   else range(dataset_size))
        indices.append(int(permutations[epoch][offset]))
    return indices
