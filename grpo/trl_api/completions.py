"""trl's `log_completions`: each logged step's completions as a printed table and a parquet file.

trl 1.16 prints, at each log, a table of the last generation's completions (`num_completions_to_print` of them drawn
at random, all when None): prompt, completion, each reward, the advantage and the columns reward functions added
with `log_extra`. It also writes them all to `output_dir/completions/completions_<step>.parquet`. Both are done
here from the engine's records (grpo.core.metrics.completion_records), at each training log as trl: a chat
prompt is kept as its messages, and its completion as one assistant message.
"""

from __future__ import annotations

import random
import shutil
import textwrap
from pathlib import Path


def completions_frame(records: list[dict], step: int, extra: dict[str, list]):
    """The records as trl's table: step, prompt, completion, one column per reward, the extra columns, advantage."""
    import pandas as pd  # a dependency of datasets

    chat = [isinstance(r["prompt"], list) for r in records]  # trl keeps a conversation's messages
    columns = {"step": [step] * len(records), "prompt": [r["prompt"] for r in records],
               "completion": [[{"role": "assistant", "content": r["completion"]}] if is_chat else r["completion"]
                              for r, is_chat in zip(records, chat, strict=True)]}
    for name in records[0]["rewards"] if records else ():
        columns[name] = [r["rewards"][name] for r in records]
    columns.update({name: values for name, values in extra.items() if len(values) == len(records)})
    columns["advantage"] = [r["advantage"] for r in records]
    return pd.DataFrame(columns)


def write_completions(output_dir: str | Path, frame, step: int) -> Path:
    """trl's completions/completions_<step>.parquet."""
    folder = Path(output_dir) / "completions"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"completions_{step:05d}.parquet"
    frame.to_parquet(path)
    return path


def format_completions(frame, step: int, num_samples: int | None, width: int | None = None) -> str:
    """A plain-text table of `num_samples` rows drawn at random (all when None or more than there are), each cell
    wrapped to its column's width, as trl's printed table."""
    rows = list(range(len(frame)))
    if num_samples is not None and num_samples < len(rows):
        rows = sorted(random.sample(rows, num_samples))
    width = width or shutil.get_terminal_size((120, 20)).columns
    names = [name for name in frame.columns if name != "step"]
    text_columns = {"prompt", "completion"}
    narrow = max(10, max((len(name) for name in names if name not in text_columns), default=10))
    wide = max(20, (width - narrow * (len(names) - 2) - 3 * len(names)) // 2)
    widths = [wide if name in text_columns else narrow for name in names]

    def cell(value) -> str:
        if isinstance(value, (list, tuple)):  # messages: their texts, one after another
            value = " ".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in value)
        return f"{value:.2f}" if isinstance(value, float) else ("" if value is None else str(value))

    def line(cells: list[list[str]]) -> list[str]:
        height = max(len(c) for c in cells)
        return [" | ".join(c[i].ljust(w) if i < len(c) else " " * w for c, w in zip(cells, widths, strict=True))
                for i in range(height)]

    out = [f"Step {step}", *line([[name[:w]] for name, w in zip(names, widths, strict=True)]),
           "-+-".join("-" * w for w in widths)]
    for row in rows:
        out += line([textwrap.wrap(cell(frame[name].iloc[row]), w) or [""] for name, w in zip(names, widths,
                                                                                          strict=True)])
        out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)
