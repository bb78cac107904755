"""Which task a dataset holds, decided by its columns, and the checks that fit it.

    prompt   rows with a `prompt` column (a string, or chat messages [{"role", "content"}, ...]), as trl's
             datasets: the prompt is used as it is, and every other column reaches the reward functions
    gsm8k    rows with GSM8K's `question` and `answer` (a solution ending in `#### N`, or a number): each row
             is checked (`validate_rows`) and gets the chat prompt [system prompt, question]
    reasoning-gym  `--dataset reasoning-gym:NAME[:N]`: a reasoning-gym task's problems (data/reasoning_gym.py),
             each given the chat prompt [system prompt, question] as GSM8K rows are; reward `task_score`

A row's problems are reported with the file and row index before any model is loaded.
"""

from __future__ import annotations

import logging

from data import reasoning_gym
from data.gsm8k import DataError, read_rows, validate_rows
from data.prompts import SYSTEM_PROMPT, add_prompts

logger = logging.getLogger("grpo.data")

def detect_task(rows: list[dict]) -> str:
    """`prompt` when the rows have a prompt column, else `gsm8k`."""
    return "prompt" if rows and "prompt" in rows[0] else "gsm8k"


def _prompt_problem(prompt) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else "an empty prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(m,
                                                              dict) and "role" in m and "content" in m for m in prompt):
        return None
    return f"a prompt that is neither a string nor chat messages ({type(prompt).__name__})"


def validate_prompt_rows(rows: list[dict], where: str, skip_bad_rows: bool = False) -> list[dict]:
    """Check every row has a usable `prompt`; a bad row raises DataError (or is dropped with `skip_bad_rows`)."""
    kept, problems = [], []
    for index, row in enumerate(rows):
        problem = _prompt_problem(row.get("prompt")) if "prompt" in row else "no prompt column"
        if problem is None:
            kept.append(row)
            continue
        if not skip_bad_rows:
            raise DataError(f"{where}: row {index} has {problem} (pass --skip-bad-rows to drop such rows with a "
                            "warning)")
        problems.append(f"{where}: row {index} has {problem}")
    if problems:
        logger.warning("skipped %d bad row(s) of %s; first: %s", len(problems), where, problems[0])
    return kept


def prepare_rows(rows: list[dict], where: str, skip_bad_rows: bool = False,
                 system_prompt: str = SYSTEM_PROMPT, one_shot: bool = False) -> tuple[list[dict], str]:
    """Rows checked for their task and given a `prompt`; returns (rows, task)."""
    task = detect_task(rows)
    if task == "prompt":
        return validate_prompt_rows(rows, where, skip_bad_rows), task
    return add_prompts(validate_rows(rows, where, skip_bad_rows), system_prompt, one_shot), task


def column_prompts(rows: list[dict], column: str, system_prompt: str, where: str) -> list[dict]:
    """Each row with a chat `prompt`: [system_prompt (none when empty), the row's `column` as the user's message], as
    open-r1's recipes build it (dataset_prompt_column)."""
    if rows and column not in rows[0]:
        raise DataError(f"{where}: no column {column!r} for the prompts (dataset_prompt_column); the columns are "
                        f"{', '.join(rows[0])}")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [{**row, "prompt": system + [{"role": "user", "content": row[column]}]} for row in rows]


def load_task_rows(source: str, split: str, skip_bad_rows: bool = False, system_prompt: str = SYSTEM_PROMPT,
                   one_shot: bool = False, task_settings: dict | None = None, task_seed: int = 0,
                   answer_extraction: str = "tag", trust_verifier: bool = False,
                   prompt_column: str | None = None) -> tuple[list[dict], str]:
    """Load a split (hub id, local file or folder, `synthetic[:N]`, `reasoning-gym:NAME[:N]` with its settings and
    seed, answer extraction and trust in its verifier), check it for its task; returns (rows, task).
    `prompt_column`: each row's prompt is built from that column (column_prompts)."""
    if reasoning_gym.is_source(source):
        rows = reasoning_gym.task_rows(source, split, task_settings, task_seed, answer_extraction, trust_verifier)
        return add_prompts(rows, system_prompt, one_shot), "reasoning-gym"
    parts = read_rows(source, split)
    if prompt_column:
        parts = [(where, column_prompts(rows, prompt_column, system_prompt, where)) for where, rows in parts]
    tasks = {detect_task(rows) for _, rows in parts if rows}
    if len(tasks) > 1:
        raise DataError(f"{source}[{split}]: some files have a prompt column and some do not")
    kept = []
    for where, rows in parts:
        kept.extend(prepare_rows(rows, where, skip_bad_rows, system_prompt, one_shot)[0])
    return kept, tasks.pop() if tasks else "gsm8k"
