"""R1-style prompts: a system prompt asking for tagged reasoning and answer, the question as user turn (with
`one_shot`, after one worked example as a user/assistant exchange); and a GSM8K worked solution written as the
completion that prompt asks for (for supervised warm starts and the worked example)."""

from __future__ import annotations

import re

SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""

# reasoning-gym tasks (the `reasoning-gym-small` preset): a short answer in the tag task_score reads, no R1 layout.
# Small instruct models asked for GSM8K's <reasoning> layout on such a task mostly answer "The answer is 1."
TASK_SYSTEM_PROMPT = ("Solve the task. Think briefly, then give only the final answer inside <answer></answer> "
                      "tags.")

# GSM8K's first train problem and its solution: the worked example of `one_shot` prompts.
EXAMPLE_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                    "How many clips did Natalia sell altogether in April and May?")
EXAMPLE_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def build_prompt(question: str, system_prompt: str = SYSTEM_PROMPT, one_shot: bool = False) -> list[dict[str, str]]:
    """Chat messages for one question: [system, user], or with `one_shot` [system, user, assistant, user], the
    first exchange a worked example answered in the format (`r1_completion`). Small instruct models that ignore
    the system prompt's format copy the example's; its question is a GSM8K train problem."""
    example = [{"role": "user", "content": EXAMPLE_QUESTION},
               {"role": "assistant", "content": r1_completion(EXAMPLE_SOLUTION)}] if one_shot else []
    return [{"role": "system", "content": system_prompt}, *example, {"role": "user", "content": question}]


def add_prompts(rows: list[dict], system_prompt: str = SYSTEM_PROMPT, one_shot: bool = False) -> list[dict]:
    """Return new rows with a `prompt` column (chat messages); all other columns are kept as they are."""
    return [{**row, "prompt": build_prompt(row["question"], system_prompt, one_shot)} for row in rows]


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
