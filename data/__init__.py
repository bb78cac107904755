"""GSM8K data: loading (hub or local files), gold-answer extraction, prompts, a synthetic task.

The pieces, in the order the trainer uses them:
  load_gsm8k(source, split)  -> list of row dicts, columns as in `openai/gsm8k` (+ any user columns)
  add_prompts(rows)          -> each row gains `prompt` (chat messages); every other column is kept
  make_synthetic_gsm8k(n)    -> seeded GSM8K-shaped rows for offline runs and tests
"""

from data.answers import canonical_number, extract_gold_answer, extract_last_number
from data.gsm8k import DataError, load_gsm8k, validate_rows
from data.prompts import SYSTEM_PROMPT, add_prompts, build_prompt
from data.synthetic import make_synthetic_gsm8k

__all__ = [
    "DataError",
    "SYSTEM_PROMPT",
    "add_prompts",
    "build_prompt",
    "canonical_number",
    "extract_gold_answer",
    "extract_last_number",
    "load_gsm8k",
    "make_synthetic_gsm8k",
    "validate_rows",
]
