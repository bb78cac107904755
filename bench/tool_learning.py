"""Tool use rewarded and learned on CPU: SmolLM2-135M-Instruct, the calculator (data/calculator.py), GRPO.

    python -m grpo.models fetch smollm2-135m-instruct      # once
    python bench/tool_learning.py [--steps 20] [--seed 0]

The task is 3-digit by 2-digit arithmetic (data.calculator.arithmetic_rows), which a 135M model gets wrong in its
head; the prompt shows one worked tool exchange. Rewards: correctness:2 (the tagged answer), tool_success (every
call got a result) and tool_call_format:0.5 (a well-formed call 1.0, a begun one 0.5). It runs train.py with
--tools data.calculator:calculator, then plots the per-step rewards and tools/call_frequency from metrics.jsonl
to docs/tool_learning.png and prints them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.calculator import arithmetic_rows  # noqa: E402
from grpo.core.metrics import read_jsonl  # noqa: E402

KEYS = ("reward", "rewards/correctness/mean", "rewards/tool_success/mean", "rewards/tool_call_format/mean",
        "tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "step_time")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/tool_learning")
    parser.add_argument("--figure", default=str(ROOT / "docs" / "tool_learning.png"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_rows(512, seed=args.seed)))
    command = [sys.executable, str(ROOT / "train.py"), "--model", args.model, "--dataset", str(data),
               "--tools", "data.calculator:calculator", "--reward", "correctness:2", "tool_success",
               "tool_call_format:0.5", "--max-steps", str(args.steps), "--prompts-per-step", "2",
               "--num-generations", "8", "--micro-batch-size", "8", "--max-prompt-length", "320",
               "--max-completion-length", "64", "--learning-rate", "1e-5", "--lr-scheduler-type", "constant",
               "--warmup-ratio", "0", "--beta", "0", "--temperature", "1.0", "--seed", str(args.seed),
               "--save-steps", "0", "--eval-steps", "0", "--log-completions-steps", "5", "--logging-steps", "1",
               "--device", "cpu", "--precision", "fp32", "--output-dir", str(out / "run"), "--overwrite"]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    metrics = read_jsonl(out / "run" / "metrics.jsonl")
    print("step " + " ".join(f"{key.split('/')[-2] if key.count('/') > 1 else key:>14}" for key in KEYS))
    for m in metrics:
        print(f"{m['step']:>4} " + " ".join(f"{m.get(key, float('nan')):>14.3f}" for key in KEYS))
    plot(metrics, Path(args.figure))
    return 0


def plot(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label in (("rewards/correctness/mean", "correctness (0 or 2)"),
                       ("rewards/tool_success/mean", "tool_success"),
                       ("rewards/tool_call_format/mean", "tool_call_format")):
        left.plot(steps, [m.get(key) for m in metrics], marker="o", ms=3, label=label)
    left.set_xlabel("GRPO step")
    left.set_title("rewards (mean over the step's 16 completions)")
    left.legend(fontsize=8)
    right.plot(steps, [m.get("tools/call_frequency") for m in metrics], marker="o", ms=3, label="calls per completion")
    right.plot(steps, [m.get("tools/failure_frequency") for m in metrics], marker="o", ms=3, label="failed / calls")
    right.set_xlabel("GRPO step")
    right.set_title("tool calls")
    right.legend(fontsize=8)
    figure.suptitle("SmolLM2-135M-Instruct, calculator tool, CPU (bench/tool_learning.py)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"figure: {path}")


if __name__ == "__main__":
    sys.exit(main())
