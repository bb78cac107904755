"""Reward shaping that depends on the completion's length, not on its text.

DAPO's overlong reward shaping (arXiv 2503.14476, eq. 13): with the budget L_max = max_completion_length
and a buffer of L_cache tokens before it, a completion of |y| tokens (its EOS included) gets

    R(y) = 0                                       |y| <= L_max - L_cache
    R(y) = -factor * (|y| - (L_max - L_cache)) / L_cache     L_max - L_cache < |y| <= L_max

so a completion the budget cut off (|y| = L_max) gets -factor. The trainer adds it as the reward `overlong`
(weight 1) when overlong_buffer_len > 0; verl's `overlong_buffer` computes the same penalty.
"""

from __future__ import annotations

from collections.abc import Callable


def overlong_penalty(max_completion_length: int, buffer_len: int, factor: float = 1.0) -> Callable[..., list[float]]:
    """A reward function (trl's signature, reading `completion_ids`) giving DAPO's soft overlong penalty."""
    if not 0 < buffer_len < max_completion_length:
        raise ValueError(f"overlong buffer_len must be in (0, {max_completion_length}), got {buffer_len}")
    start = max_completion_length - buffer_len  # lengths up to here are not penalised

    def overlong(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [-factor * max(len(ids) - start, 0) / buffer_len for ids in completion_ids]

    return overlong
