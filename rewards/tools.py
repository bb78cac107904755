"""Rewards over tool rollouts, whose chat completions are the turns as messages (assistant, tool, ..., assistant;
grpo/multiturn/tools.py): a tool message's content is the tool's result, or {"error": ...} when the call failed."""

from __future__ import annotations

import json


def _tool_results(completion) -> list[str]:
    if isinstance(completion, str):
        return []
    return [str(message.get("content", "")) for message in completion if message.get("role") == "tool"]


def _failed(result: str) -> bool:
    try:
        parsed = json.loads(result)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "error" in parsed


def tool_success(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a completion that called a tool and got a result from every call, 0.0 otherwise (no call, or a
    call that failed: a malformed call, an unknown tool, or one that raised)."""
    rewards = []
    for completion in completions:
        results = _tool_results(completion)
        rewards.append(float(bool(results) and not any(_failed(result) for result in results)))
    return rewards


def tool_call_format(prompts, completions, **kwargs) -> list[float]:
    """Shaping towards calls: 1.0 when some turn made a well-formed call (<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>), 0.5 when a turn only began one (the tag, but no well-formed call), 0.0 otherwise."""
    rewards = []
    for completion in completions:
        turns = [completion] if isinstance(completion, str) else [m for m in completion if m.get("role") == "assistant"]
        well_formed = any(not isinstance(turn, str) and any("error" not in call for call in turn.get("tool_calls", []))
                          for turn in turns)
        began = any("<tool_call>" in turn if isinstance(turn, str) else bool(turn.get("tool_calls"))  # a calling turn
                    or "<tool_call>" in str(turn.get("content", "")) for turn in turns)  # or an open tag
        rewards.append(1.0 if well_formed else 0.5 if began else 0.0)
    return rewards


TOOL_REWARDS = {"tool_success": tool_success, "tool_call_format": tool_call_format}
