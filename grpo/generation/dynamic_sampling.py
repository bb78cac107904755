"""Dynamic sampling (DAPO, arXiv 2503.14476 section 3.2): keep only groups whose rewards do not all tie.

A group whose G rewards are equal has zero advantage everywhere: it adds nothing to the policy gradient but
still dilutes the step's normalisers. With `dynamic_sampling`, tied groups are dropped and further rounds
sample other prompts until a rank has its share of the step's informative groups; after
`dynamic_sampling_max_rounds` rounds, tied groups fill what is missing (their advantages are 0: only the KL term
and the loss's normaliser see them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from grpo.algorithm.advantages import tied_groups, weighted_rewards
from grpo.generation.rollout import Rollout

logger = logging.getLogger("grpo")

FIRST_ROUND = "dynamic_sampling/first_round"  # the step's metrics carry round 0's (prompts, texts) under this key


def keep_informative_groups(first: tuple, sample_round: Callable[[int], tuple], wanted: int, group: int,
                            reward_weights, max_rounds: int, pad_token_id: int, step: int, clip_range=None):
    """`wanted` groups, informative ones first in the order they were sampled, from round 0 (`first`) and as
    many further rounds `sample_round(r)` as needed. Each round is (rollout, prompts, texts). `clip_range`: the
    weighted rewards are clipped there first (--reward-clip-range), as the advantages see them.

    Returns (rollout, prompts, texts, metrics of the rounds)."""
    pool = [first]
    informative, tied = [], []  # (round, group) of each group sampled so far
    rounds = 0
    while True:
        rewards = weighted_rewards(pool[rounds][0].rewards_per_func, reward_weights)  # (N,)
        rewards = rewards.clamp(*clip_range) if clip_range else rewards  # as the estimator sees them
        for index, is_tied in enumerate(tied_groups(rewards, group).tolist()):
            (tied if is_tied else informative).append((rounds, index))
        rounds += 1
        if len(informative) >= wanted or rounds >= max_rounds:
            break
        pool.append(sample_round(rounds))
    chosen = (informative + tied)[:wanted]
    filled = max(wanted - len(informative), 0)
    if filled:
        logger.warning("step %d: %d of %d groups are tied after %d sampling rounds; tied groups fill the step",
                       step + 1, filled, wanted, rounds)
    offsets = [0]  # the first group of each round in the merged rollout
    for rollout, _, _ in pool:
        offsets.append(offsets[-1] + rollout.num_rows // group)
    all_prompts = [prompt for part in pool for prompt in part[1]]
    all_texts = [text for part in pool for text in part[2]]
    groups = [offsets[r] + g for r, g in chosen]
    rows = [g * group + j for g in groups for j in range(group)]
    # the first round's mean reward: the policy's on this rank's share of the step's prompts, before any group is
    # dropped (the logged `reward` is the kept groups', which dropping pulls toward the middle)
    sampled = weighted_rewards(first[0].rewards_per_func, reward_weights).nanmean().item()
    metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/dropped_groups": len(tied) - filled,
               "dynamic_sampling/filled": filled, "dynamic_sampling/sampled_reward": sampled}
    merged = merge_rows([part[0] for part in pool], rows, pad_token_id)
    return merged, [all_prompts[r] for r in rows], [all_texts[r] for r in rows], metrics


def merge_rows(rollouts: list[Rollout], rows: list[int], pad_token_id: int) -> Rollout:
    """The given rows of the rollouts laid end to end: prompts left-padded and completions right-padded to
    common widths (ids with pad_token_id, the tool mask with 1, the other masks and log-probs with 0)."""
    prompt_len = max(r.prompt_ids.shape[1] for r in rollouts)
    completion_len = max(r.completion_ids.shape[1] for r in rollouts)
    padding = {"prompt_ids": pad_token_id, "completion_ids": pad_token_id, "tool_mask": 1}
    merged = {}
    for field in dataclasses.fields(Rollout):
        parts = [getattr(r, field.name) for r in rollouts]
        if any(part is None for part in parts):
            merged[field.name] = None
            continue
        if not isinstance(parts[0], torch.Tensor):  # policy_version: the oldest weights among the parts
            merged[field.name] = min(parts)
            continue
        if field.name.startswith("prompt_"):
            parts = [torch.nn.functional.pad(p, (prompt_len - p.shape[1], 0), value=padding.get(field.name, 0))
                     for p in parts]
        elif field.name in ("completion_ids", "completion_mask", "sampler_logprobs", "tool_mask"):  # (N, T)
            parts = [torch.nn.functional.pad(p, (0, completion_len - p.shape[1]), value=padding.get(field.name, 0))
                     for p in parts]
        merged[field.name] = torch.cat(parts)[torch.tensor(rows, dtype=torch.long)]
    return Rollout(**merged)
