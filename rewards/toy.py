"""A dense toy reward for offline runs, where a randomly initialised policy must show learning in minutes.

A random-init model almost never writes a whole well-formed answer, so the GSM8K rewards are all
zero for it and GRPO has nothing to learn from. `tags` pays for each format tag it does write:
the tiny tokenizer (grpo/tiny_model.py) has each tag as a single token, so a random policy scores
about 0.03 per completion of 32 tokens and a policy that learned to emit tags scores up to 1.0.
"""

from __future__ import annotations

from rewards.scoring import completion_text

FORMAT_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")


def tags(prompts, completions, **kwargs) -> list[float]:
    """0.125 per occurrence of a format tag in the completion, at most 1.0 (eight tags)."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        count = sum(text.count(tag) for tag in FORMAT_TAGS)
        rewards.append(min(count, 8) * 0.125)
    return rewards


TOY_REWARDS = {"tags": tags}
