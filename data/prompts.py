"""R1-style prompts: a system prompt asking for tagged reasoning and answer, the question as user turn; and a
GSM8K worked solution written as the completion that prompt asks for (for supervised warm starts)."""

from __future__ import annotations

import re

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


def r1_completion(solution: str, final_answer: str | None = None) -> str:
    """A GSM8K worked solution (`steps ... #### N`) in the R1 layout the strict_format reward pays for:

        <reasoning>\n{the steps, calculator annotations <<...>> removed}\n</reasoning>\n<answer>\n{N}\n</answer>

    `final_answer` replaces N (the number after ####) when given.
    """
    if "####" not in solution:
        raise ValueError(f"a GSM8K solution ends with '#### N', got {solution[-60:]!r}")
    steps, number = solution.rsplit("####", 1)
    reasoning = re.sub(r"<<[^>]*>>", "", steps).strip()
    answer = (number if final_answer is None else final_answer).strip()
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"
