"""A multi-turn environment learned on CPU: SmolLM2-135M-Instruct plays textarena's GuessTheNumber (data/games.py).

    python -m grpo.models fetch smollm2-135m-instruct      # once
    python bench/environment_learning.py [--steps 30] [--seed 0]
    python bench/environment_learning.py --startup        # what a step's 16 environment processes cost

Each rollout plays its own game in its own process (grpo/multiturn/environments.py): the model calls the `guess` tool,
textarena answers higher or lower, up to 10 guesses. The G = 8 rollouts of a row play the same secret (the row's
seed). The only reward is the environment's get_reward, textarena's score (1 for a solved game, else how close the
last guess was; 0 without a valid guess). It runs train.py with --environment data.games:GuessTheNumber and an
empty --reward, then plots the per-step reward, games solved, guesses and turns from metrics.jsonl and
samples.jsonl to docs/environment_learning.png and prints them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.games import game_rows  # noqa: E402
from grpo.core.metrics import read_jsonl  # noqa: E402

KEYS = ("reward", "reward_std", "tools/call_frequency", "tools/failure_frequency", "rollout/turns_mean",
        "completions/mean_length", "step_time")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/environment_learning")
    parser.add_argument("--figure", default=str(ROOT / "docs" / "environment_learning.png"))
    parser.add_argument("--plot-only", action="store_true", help="plot an earlier run's metrics")
    parser.add_argument("--startup", action="store_true",
                        help="only measure what starting and stopping a step's 16 environments costs, beside the model")
    args = parser.parse_args(argv)
    if args.startup:
        return startup_cost(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        data = out / "games.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in game_rows(512, seed=args.seed)))
        command = [sys.executable, str(ROOT / "train.py"), "--model", args.model, "--dataset", str(data),
                   "--environment", "data.games:GuessTheNumber", "--reward", "--max-steps", str(args.steps),
                   "--prompts-per-step", "2", "--num-generations", "8", "--micro-batch-size", "8",
                   "--max-prompt-length", "512", "--max-completion-length", "192", "--learning-rate", "1e-5",
                   "--lr-scheduler-type", "constant", "--warmup-ratio", "0", "--beta", "0", "--temperature", "1.0",
                   "--seed", str(args.seed), "--save-steps", "0", "--eval-steps", "0", "--log-completions-steps", "1",
                   "--logging-steps", "1", "--device", "cpu", "--precision", "fp32", "--output-dir",
                   str(out / "run"), "--overwrite"]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True)
    metrics = read_jsonl(out / "run" / "metrics.jsonl")
    solved = solved_per_step(out / "run" / "samples.jsonl")
    print("step " + " ".join(f"{key.split('/')[-1]:>15}" for key in KEYS) + "    solved")
    for m in metrics:
        print(f"{m['step']:>4} " + " ".join(f"{m.get(key, float('nan')):>15.3f}" for key in KEYS)
              + f"  {solved.get(m['step'], float('nan')):>8.3f}")
    plot(metrics, solved, Path(args.figure))
    return 0


def startup_cost(model: str, rounds: int = 7) -> int:
    """Milliseconds to fork, make and reset a step's 16 GuessTheNumber environments and stop them, with the
    policy, its reference and AdamW's state in the trainer's memory (a fork copies the page tables of all of it)."""
    import statistics
    import time

    import torch

    from data.games import GuessTheNumber
    from grpo.multiturn.environments import Environments
    from grpo.models import load_model, load_tokenizer, resolve_model_name

    path = resolve_model_name(model)
    tokenizer = load_tokenizer(path, False, None, "--model")
    policy = load_model(path, torch.device("cpu"), torch.float32, False, tokenizer, "--model")
    reference = load_model(path, torch.device("cpu"), torch.float32, False, tokenizer, "--model")
    state = [torch.zeros_like(p) for p in policy.parameters() for _ in range(2)]  # AdamW's two moments
    environments = Environments.from_factory(GuessTheNumber)
    rows = game_rows(2)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        episodes = environments.start(rows, 8, seeds=list(range(16)))
        reset = time.perf_counter()
        episodes.close()
        times.append((reset - started, time.perf_counter() - reset))
    resident = sum(p.numel() for p in [*policy.parameters(), *reference.parameters(), *state]) * 4 / 2**20
    start, stop = (1000 * statistics.median(column) for column in zip(*times))
    print(f"16 environments beside {resident:.0f} MiB of tensors, median of {rounds}: start and reset {start:.0f} ms, "
          f"stop {stop:.0f} ms")
    return 0


def solved_per_step(path: Path) -> dict[int, float]:
    """The share of logged games that were solved (textarena's score 1) at each step with samples."""
    steps: dict[int, list[float]] = {}
    for record in read_jsonl(path):
        score = record["rewards"].get("GuessTheNumber")
        steps.setdefault(record["step"], []).append(float(score == 1.0))
    return {step: sum(values) / len(values) for step, values in steps.items()}


def plot(metrics: list[dict], solved: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(steps, [m.get("reward") for m in metrics], marker="o", ms=3, label="textarena score (get_reward)")
    left.plot(sorted(solved), [solved[s] for s in sorted(solved)], marker="o", ms=3,
              label="solved, of the step's first 8 games (samples.jsonl)")
    left.set_xlabel("GRPO step")
    left.set_ylim(-0.02, 1.02)
    left.set_title("reward (mean over the step's 16 games)")
    left.legend(fontsize=8)
    right.plot(steps, [m.get("tools/call_frequency") for m in metrics], marker="o", ms=3, label="guesses per game")
    right.plot(steps, [m.get("rollout/turns_mean") for m in metrics], marker="o", ms=3, label="assistant turns")
    right.plot(steps, [m.get("tools/failure_frequency") for m in metrics], marker="o", ms=3, label="failed / calls")
    right.set_xlabel("GRPO step")
    right.set_title("moves")
    right.legend(fontsize=8)
    figure.suptitle("SmolLM2-135M-Instruct plays textarena GuessTheNumber-v0, CPU (bench/environment_learning.py)",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"figure: {path}")


if __name__ == "__main__":
    sys.exit(main())
