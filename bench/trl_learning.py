"""The seed script learns under either import: examples/trl_seed_script.py with real sampling, run by trl 1.16 and by
grpo.trl_api on the same task, and the training reward of each, step by step.

    python bench/trl_learning.py                                 # 300 steps on each side, the table
    python bench/trl_learning.py --plot docs/trl_learning.png    # and the two curves (docs/trl.md shows them)

The task is bench/learning.py's (the learning experiment's smoke-sized form): a tiny Qwen2 warm-started by supervised
fine-tuning on synthetic GSM8K-shaped problems in the R1 layout, whose answers to `subtract` problems carry a
systematic slip. The seed script's five rewards (correctness 2.0, int, strict and soft format, xmlcount) then have
something to teach: the format is mostly there, the right answer is a sample away. The script runs as written
(its GRPOConfig, its rewards, trl's defaults: beta 0, loss dapo, 8 generations, temperature 1), with a learning rate
and completion budget for the tiny model (--learning-rate, --max-completion-length) and fp32 on CPU. Each side
samples its own completions (the samplers draw different tokens from one seed), so the curves agree in trend, not
draw by draw; tests/test_trl_dropin.py checks the numbers on equal completions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import learning  # noqa: E402

OURS_IMPORT = "from grpo.trl_api import GRPOConfig, GRPOTrainer\n"
ENGINES = ("trl", "ours")


def task(out: Path, args) -> tuple[Path, Path]:
    """The warm-started model and a folder with the task's train.jsonl (GSM8K's fields), made once in `out`."""
    settings = learning.parse_args(["--kinds", *args.kinds, "--warm-start-steps", str(args.warm_start_steps)])
    model_dir, seen = learning.warm_start(settings, args.seed, out)
    data = out / "data"
    if not (data / "train.jsonl").is_file():
        learning.make_task(data, args.seed, num_train=args.train_rows, num_heldout=10, seen=seen,
                           scale=settings.scale, kinds=args.kinds)
    return model_dir, data


def run(engine: str, model_dir: Path, data: Path, out: Path, args) -> list[dict]:
    """The seed script under `engine`'s import; its log_history (one entry per optimizer step)."""
    source = (ROOT / "examples" / "trl_seed_script.py").read_text()
    if engine == "trl":
        source = source.replace(OURS_IMPORT, "from trl import GRPOConfig, GRPOTrainer\n")
    namespace = {"__name__": f"seed_script_{engine}"}
    exec(compile(source, f"trl_seed_script[{engine}]", "exec"), namespace)  # noqa: S102 - the example, as written
    trainer = namespace["main"](["--model", str(model_dir), "--data", str(data), "--cpu", "--max-steps",
                                 str(args.steps), "--logging-steps", "1", "--learning-rate", str(args.learning_rate),
                                 "--max-completion-length", str(args.max_completion_length),
                                 "--output-dir", str(out / engine)])
    return [entry for entry in trainer.state.log_history if "reward" in entry and "train_runtime" not in entry]


def window_means(rewards: list[float], window: int) -> tuple[float, float]:
    """The mean reward of the first and of the last `window` steps."""
    return sum(rewards[:window]) / window, sum(rewards[-window:]) / window


def plot(curves: dict[str, list[float]], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    for engine, rewards in curves.items():
        smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
                  for i in range(len(rewards))]
        axis.plot(range(1, len(rewards) + 1), rewards, alpha=0.25)
        axis.plot(range(1, len(rewards) + 1), smooth, label=f"{engine} (mean of {window})",
                  color=axis.lines[-1].get_color())
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training reward (sum of the 5 rewards)")
    axis.set_title("examples/trl_seed_script.py: trl 1.16 and grpo.trl_api, real sampling")
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    print(f"wrote {path}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/trl_learning")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps on each side (2 prompts x 8 each)")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="the learning experiment's GRPO rate")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--kinds", nargs="+", default=["add", "subtract"], help="problem kinds (bench/learning.py)")
    parser.add_argument("--warm-start-steps", type=int, default=600)
    parser.add_argument("--train-rows", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=60, help="steps averaged at each end")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--plot", default=None, help="write the curves to this PNG (matplotlib)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = Path(args.out)
    model_dir, data = task(out, args)
    results = {}
    for engine in args.engines:
        started = time.perf_counter()
        history = run(engine, model_dir, data, out, args)
        rewards = [entry["reward"] for entry in history]
        first, last = window_means(rewards, args.window)
        correct = [entry["rewards/correctness_reward/mean"] for entry in history]
        results[engine] = {"rewards": rewards, "correctness": correct, "first": first, "last": last,
                           "correct_first": window_means(correct, args.window)[0],
                           "correct_last": window_means(correct, args.window)[1],
                           "seconds": time.perf_counter() - started}
        print(f"{engine:5s} reward {first:.3f} -> {last:.3f} (mean of the first and last {args.window} steps), "
              f"correctness {results[engine]['correct_first']:.3f} -> {results[engine]['correct_last']:.3f}, "
              f"{results[engine]['seconds']:.0f} s")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.plot:
        plot({engine: result["rewards"] for engine, result in results.items()}, Path(args.plot), args.window)
    return results


if __name__ == "__main__":
    main()
