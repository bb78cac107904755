"""Datasets: loading (hub or local files), the task their columns say, GSM8K answers and prompts, a synthetic task.

The pieces, in the order the trainer uses them:
  load_task_rows(source, split) -> (rows, task): rows with a `prompt` column as they are ("prompt"), or
                                   GSM8K rows checked and given chat prompts ("gsm8k"); data/tasks.py
  load_gsm8k(source, split)     -> GSM8K rows, columns as in `openai/gsm8k` (+ any user columns), checked
  add_prompts(rows)             -> each row gains `prompt` (chat messages); every other column is kept
  column_prompts(rows, column)  -> each row's `prompt` from one of its columns (open-r1's dataset_prompt_column)
  make_synthetic_gsm8k(n)       -> seeded GSM8K-shaped rows for offline runs and tests (make_synthetic_problems:
                                   the same rows with their template `kind`)
  r1_completion(solution)       -> a worked solution as the <reasoning>/<answer> completion (warm starts)
"""

from data.answers import canonical_number, extract_gold_answer, extract_last_number
from data.gsm8k import DataError, load_gsm8k, validate_rows
from data.prompts import SYSTEM_PROMPT, add_prompts, build_prompt, r1_completion
from data.synthetic import KINDS, make_synthetic_gsm8k, make_synthetic_problems
from data.tasks import column_prompts, detect_task, load_task_rows, prepare_rows

__all__ = [
    "DataError",
    "KINDS",
    "SYSTEM_PROMPT",
    "add_prompts",
    "build_prompt",
    "canonical_number",
    "column_prompts",
    "detect_task",
    "extract_gold_answer",
    "extract_last_number",
    "load_gsm8k",
    "load_task_rows",
    "make_synthetic_gsm8k",
    "make_synthetic_problems",
    "prepare_rows",
    "r1_completion",
    "validate_rows",
]
