"""Load GSM8K from the hub (`openai/gsm8k`, config `main`) or from local JSONL/Parquet files.

Every source ends in the same place: a list of row dicts that went through `validate_rows`, so a bad
row is reported (row index and file) before any model is loaded, never deep inside training.

Sources understood by `load_gsm8k`:
  "synthetic" or "synthetic:N"  the seeded GSM8K-shaped task (data/synthetic.py), N rows (default 2000)
  a local .jsonl/.json/.parquet file
  a local folder holding `{split}.jsonl`, `{split}.parquet` or `{split}-*.parquet` (the hub's layout)
  anything else: a hub dataset id, loaded with `datasets.load_dataset`
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from data.answers import gold_from_column
from data.synthetic import make_synthetic_gsm8k

logger = logging.getLogger("grpo.data")

HUB_ID = "openai/gsm8k"
REQUIRED_COLUMNS = ("question", "answer")


class DataError(ValueError):
    """A dataset problem, with the file and row that caused it in the message."""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        if path.suffix == ".json":
            payload = json.load(handle)
            if not isinstance(payload, list):
                raise DataError(f"{path}: expected a JSON list of objects, got {type(payload).__name__}")
            return payload
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: line {line_number} is not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {line_number} is a JSON {type(row).__name__}, expected an object")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_file(path: Path) -> list[dict]:
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")


def _split_files(folder: Path, split: str) -> list[Path]:
    """The files of one split inside a folder, in the hub's layouts or as `{split}.jsonl`."""
    patterns = [f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"{split}-*.parquet", f"*/{split}-*.parquet"]
    for pattern in patterns:
        found = sorted(folder.glob(pattern))
        if found:
            return found
    available = sorted(p.name for p in folder.iterdir())
    raise DataError(f"{folder}: no file for split {split!r} (looked for {', '.join(patterns)}); folder holds "
                    f"{available}")


def _load_hub(source: str, split: str) -> list[dict]:
    import datasets

    config = "main" if source == HUB_ID else None
    try:
        dataset = datasets.load_dataset(source, config, split=split)
    except (OSError, ValueError) as error:  # ConnectionError, FileNotFoundError (no such dataset), an unknown split
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"--dataset {source}: neither a local file or folder nor reachable on the hub ({reason}); pass a local "
            ".jsonl/.json/.parquet file or folder (the hub's layout, e.g. ../shared/data/gsm8k), or `synthetic` for "
            "the seeded offline task"
        ) from None
    return [dict(row) for row in dataset]


def validate_rows(rows: list[dict], where: str, skip_bad_rows: bool = False) -> list[dict]:
    """Check every row has a question and a parseable gold answer.

    A bad row raises DataError naming `where` (the file or source) and the row index; with
    `skip_bad_rows` it is dropped instead and the number dropped is logged as a warning.
    """
    if rows:
        missing = [column for column in REQUIRED_COLUMNS if column not in rows[0]]
        if missing:
            raise DataError(
                f"{where}: missing column(s) {missing}; the rows have columns {sorted(rows[0])}. "
                "GSM8K-style data needs `question` and `answer` (a solution ending in '#### N', or a number)."
            )
    kept, problems = [], []
    for index, row in enumerate(rows):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            problem = f"{where}: row {index} has an empty or missing question"
        elif answer is None or (isinstance(answer, str) and not answer.strip()):
            problem = f"{where}: row {index} has an empty or missing answer"
        elif gold_from_column(str(answer)) is None:
            problem = f"{where}: row {index} has a gold answer that does not parse as a number: {str(answer)[-60:]!r}"
        else:
            kept.append(row)
            continue
        if not skip_bad_rows:
            raise DataError(problem + " (pass --skip-bad-rows to drop such rows with a warning)")
        problems.append(problem)
    if problems:
        logger.warning("skipped %d bad row(s) of %s; first: %s", len(problems), where, problems[0])
    return kept


def read_rows(source: str, split: str) -> list[tuple[str, list[dict]]]:
    """The rows of a source as (where, rows) parts (one per file), unchecked; `where` names the file or source."""
    if source == "synthetic" or source.startswith("synthetic:"):
        size_text = source.split(":", 1)[1] if ":" in source else "2000"
        if not size_text.isdigit():
            raise DataError(f"{source}: expected synthetic or synthetic:N with N a number of rows")
        # Different seeds per split so a held-out slice is not the training data.
        return [(f"synthetic[{split}]", make_synthetic_gsm8k(int(size_text), seed=0 if split == "train" else 1))]
    if source == "humaneval":  # the code task of data/humaneval.py
        from data.humaneval import load_humaneval

        return [(f"humaneval[{split}]", load_humaneval(split))]
    path = Path(source).expanduser()
    if path.is_file():
        return [(str(path), _read_file(path))]
    if path.is_dir():
        return [(str(file), _read_file(file)) for file in _split_files(path, split)]
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        raise DataError(f"{source}: no such file or folder")
    return [(f"{source}[{split}]", _load_hub(source, split))]


def load_gsm8k(source: str = HUB_ID, split: str = "train", skip_bad_rows: bool = False) -> list[dict]:
    """Rows of GSM8K (or a GSM8K-shaped dataset) from the hub, a local file or folder, or `synthetic[:N]`."""
    return [row for where, rows in read_rows(source, split) for row in validate_rows(rows, where, skip_bad_rows)]
