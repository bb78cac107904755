"""The R1 layout's format rewards as open-r1 defines them (src/open_r1/rewards.py), for its recipes' `format` and
`tag_count`: the completion reasons inside <think> tags, then answers inside <answer> tags."""

from __future__ import annotations

import re

from rewards.scoring import completion_text

_THINK_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")


def think_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion is `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>` (open-r1's format_reward;
    its re.MULTILINE lets `$` end any line, so text on lines after </answer> still matches)."""
    return [1.0 if _THINK_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def tag_count(prompts, completions, **kwargs) -> list[float]:
    """0.25 for each of the four R1 tags present exactly once (open-r1's tag_count_reward)."""
    return [sum((0.25 for tag in _TAGS if completion_text(c).count(tag) == 1), 0.0) for c in completions]


R1_FORMAT_REWARDS = {"think_format": think_format, "tag_count": tag_count}
