"""Draw a run's curves from its metrics.jsonl into a PNG (matplotlib, the `[plot]` extra).

    python -m grpo.plot runs/grpo                   # writes runs/grpo/curves.png
    python -m grpo.plot runs/grpo --output run.png --smooth 10

Panels, each against the step, the ones the run logged: reward in total and per reward function,
evaluation accuracy (eval/*), KL to the reference, entropy, completion length (mean, min, max), and the
clip ratios. A resumed run has one metrics.jsonl whose lines past the checkpoint were dropped at the
resume, so its curves are continuous.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PANELS = [  # (title, metric names or a prefix ending in "/", y label)
    ("reward", ["reward", "rewards/"], "reward"),
    ("evaluation", ["eval/strict_accuracy", "eval/lenient_accuracy", "eval/format_compliance", "eval/"], "score"),
    ("KL to the reference", ["kl"], "nats / token"),
    ("entropy", ["entropy"], "nats / token"),
    ("completion length", ["completions/mean_length", "completions/min_length", "completions/max_length"], "tokens"),
    ("clipped ratios", ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"],
     "fraction of tokens"),
]


_NOT_SCORES = ("/std", "num_samples", "mean_length")  # under a prefix, not drawn with the scores


class PlotError(ValueError):
    """The folder has nothing to draw; the message says why."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise PlotError(f"{run_dir}: no such folder (pass a run folder, the --output-dir of train.py)")
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl here (a run folder holds one after its first step)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    if not records:
        raise PlotError(f"{path}: empty (no step has finished yet)")
    return records


def series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, the steps where it is a finite number."""
    steps, values = [], []
    for record in records:
        value = record.get(name)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _names(records: list[dict], wanted: list[str]) -> list[str]:
    present = {key for record in records for key in record}
    names = []
    for item in wanted:
        if item.endswith("/"):  # every metric under the prefix (per-function rewards' means, other eval scores)
            names += sorted(k for k in present if k.startswith(item) and not k.endswith(_NOT_SCORES) and k not in names
                            and (item != "rewards/" or k.endswith("/mean")))
        elif item in present and item not in names:
            names.append(item)
    return names


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path, output: str | Path | None = None, smooth: int = 1) -> Path:
    """Write the PNG (default RUN_DIR/curves.png) and return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotError("grpo.plot needs matplotlib: pip install -e '.[plot]'") from error
    records = read_metrics(run_dir)
    panels = [(title, _names(records, wanted), label) for title, wanted, label in PANELS]
    panels = [panel for panel in panels if panel[1]]
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(11, 3.2 * rows), squeeze=False)
    for axis, (title, names, label) in zip(axes.flat, panels):
        for name in names:
            steps, values = series(records, name)
            marker = "o" if len(steps) <= 20 else None  # sparse curves (evaluation) show their points
            axis.plot(steps, moving_average(values, smooth if len(steps) > 20 else 1), label=name, marker=marker,
                      markersize=3)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        if len(names) > 1:
            axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    figure.suptitle(str(Path(run_dir).resolve().name), fontsize=10)
    figure.tight_layout()
    output = Path(output) if output is not None else Path(run_dir) / "curves.png"
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run folder (train.py's --output-dir)")
    parser.add_argument("--output", help="the PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--smooth", type=int, default=1, help="moving average over this many steps (dense curves)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.output, args.smooth)
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
