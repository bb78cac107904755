"""Reward functions over text and dataset columns, with trl's calling convention.

    fn(prompts, completions, **columns) -> list[float | None]

`completions` are chat messages (`[{"role": "assistant", "content": ...}]`) or plain strings;
every dataset column arrives as a keyword list aligned with the completions. None means "this
function cannot score this row" (trl's convention): it is left out of that row's weighted sum.
"""

from rewards.gsm8k import (
    GSM8K_REWARDS,
    correctness,
    extract_xml_answer,
    int_answer,
    soft_format,
    strict_format,
    xmlcount,
)
from rewards.registry import (
    REWARD_FUNCTIONS,
    RewardModel,
    RewardSpec,
    completion_text,
    describe_rewards,
    load_function,
    parse_reward_specs,
)
from rewards.scoring import RewardError, score_completions, score_rows

__all__ = [
    "GSM8K_REWARDS",
    "REWARD_FUNCTIONS",
    "RewardError",
    "RewardModel",
    "RewardSpec",
    "completion_text",
    "correctness",
    "describe_rewards",
    "load_function",
    "extract_xml_answer",
    "int_answer",
    "parse_reward_specs",
    "score_completions",
    "score_rows",
    "soft_format",
    "strict_format",
    "xmlcount",
]
