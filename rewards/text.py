"""Getting the text out of a completion in either of trl's two shapes."""

from __future__ import annotations


def completion_text(completion) -> str:
    """The assistant text of a completion: a plain string, or chat messages whose last content is used."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )
