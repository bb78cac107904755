"""R1-style prompts: a system prompt asking for tagged reasoning and answer, the question as user turn."""

from __future__ import annotations

SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""


def build_prompt(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages for one question: [system, user]."""
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": question},
    ]


def add_prompts(rows: list[dict], system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Return new rows with a `prompt` column (chat messages); all other columns are kept as they are."""
    return [{**row, "prompt": build_prompt(row["question"], system_prompt)} for row in rows]
