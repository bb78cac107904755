"""Dynamic sampling (DAPO, arXiv 2503.14476 section 3.2): keep only groups whose rewards do not all tie.

A group whose G rewards are equal has zero advantage everywhere: it adds nothing to the policy gradient but
still dilutes the step's normalisers. With `dynamic_sampling`, tied groups are dropped and further rounds
sample other prompts until a rank has its share of the step's informative groups; after
`dynamic_sampling_max_rounds` rounds, tied groups fill what is missing (their advantages are 0: only the KL term
and the loss's normaliser see them).
"""

from __future__ import annotations

import logging
from typing import Callable

from grpo.advantages import tied_groups, weighted_rewards
from grpo.rollout import Rollout

logger = logging.getLogger("grpo")


def keep_informative_groups(first: tuple, sample_round: Callable[[int], tuple], wanted: int, group: int,
                            reward_weights, max_rounds: int, pad_token_id: int, step: int):
    """`wanted` groups, informative ones first in the order they were sampled, from round 0 (`first`) and as
    many further rounds `sample_round(r)` as needed. Each round is (rollout, prompts, texts).

    Returns (rollout, prompts, texts, metrics of the rounds)."""
    pool = [first]
    informative, tied = [], []  # (round, group) of each group sampled so far
    rounds = 0
    while True:
        rewards = weighted_rewards(pool[rounds][0].rewards_per_func, reward_weights)  # (N,)
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
    merged = Rollout.concat([part[0] for part in pool], pad_token_id)
    all_prompts = [prompt for part in pool for prompt in part[1]]
    all_texts = [text for part in pool for text in part[2]]
    groups = [offsets[r] + g for r, g in chosen]
    rows = [g * group + j for g in groups for j in range(group)]
    metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/dropped_groups": len(tied) - filled,
               "dynamic_sampling/filled": filled}
    return merged.select_groups(groups, group), [all_prompts[r] for r in rows], [all_texts[r] for r in rows], metrics
