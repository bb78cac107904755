"""Rewards over tool rollouts, whose chat completions are the turns as messages (assistant, tool, ..., assistant;
grpo/tools.py): a tool message's content is the tool's result, or {"error": ...} when the call failed."""

from __future__ import annotations

import json


def _tool_results(completion) -> list[str]:
    if isinstance(completion, str):
        return []
    return [str(message.get("content", "")) for message in completion if message.get("role") == "tool"]


def _failed(result: str) -> bool:
    try:
        return isinstance(json.loads(result), dict) and "error" in json.loads(result)
    except ValueError:
        return False


def tool_success(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a completion that called a tool and got a result from every call, 0.0 otherwise (no call, or a
    call that failed: a malformed call, an unknown tool, or one that raised)."""
    rewards = []
    for completion in completions:
        results = _tool_results(completion)
        rewards.append(float(bool(results) and not any(_failed(result) for result in results)))
    return rewards


TOOL_REWARDS = {"tool_success": tool_success}
