"""A CPU training step beside a CPU-bound neighbour: the median step time on a quiet machine, then with one busy
process beside the run, and their ratio (the same process, the same trainer, one after the other).

    python bench/step_under_load.py                          # the product's defaults, the `small` shape
    python bench/step_under_load.py --fixed-threads          # torch's thread count throughout
    python bench/step_under_load.py --fixed-threads --env GOMP_SPINCOUNT=1000   # a wait policy to compare
    python bench/step_under_load.py --neighbours 2 --steps 8

The neighbour is a Python process spinning on arithmetic at normal priority (a compile, another job, a test
worker). With one of two cores taken, a step whose threads wait for each other at every parallel region runs at
the pace of the thread that shares its core. `--env` and `--threads` set what the trainer's process starts with
(the run happens in a child process, so OpenMP reads them at its start). Before each step the trainer's
thread count follows the other processes' load (grpo/parallel/threads.py), as Trainer.train does;
`--fixed-threads` turns that off. Prints figures; docs/benchmarks.md keeps them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def burn() -> None:
    value = 0
    while True:
        value = (value * 1_103_515_245 + 12_345) % 2**31


def child(args) -> dict:
    """Build the trainer, take one untimed step, then `steps` quiet and `steps` loaded ones; their times."""
    sys.path.insert(0, str(ROOT))
    import torch

    from grpo.config import GRPOConfig
    from grpo.core.trainer import Trainer

    with tempfile.TemporaryDirectory() as folder:
        config = GRPOConfig(adapt_cpu_threads=not args.fixed_threads, model=f"tiny:{args.shape}",
                            dataset="synthetic:256", output_dir=folder, prompts_per_step=4,
                            num_generations=4, micro_batch_size=8, max_prompt_length=256,
                            max_completion_length=args.new_tokens, beta=0.04, reward=["tags"], device="cpu",
                            precision="fp32", learning_rate=1e-6, save_steps=0, log_completions_steps=0,
                            warmup_ratio=0.0, kernels=args.kernels)
        trainer = Trainer(config)
        trainer.train_step()  # untimed: one-time work
        timings = {}
        for phase in ("quiet", "loaded"):
            burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.neighbours)]
            if phase == "loaded":
                for process in burners:
                    process.start()
                time.sleep(0.5)
            try:
                timings[phase], threads = [], []
                for _ in range(args.steps):  # as Trainer.train: the thread count, then the step
                    threads.append(trainer.cpu_threads.adjust())
                    timings[phase].append(trainer.train_step().metrics["step_time"])
                timings[phase + "_threads"] = threads
            finally:
                for process in burners:
                    if process.is_alive():
                        process.terminate()
        return {"threads": torch.get_num_threads(), **timings}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small", help="tiny_model shape (small: the real vocabulary)")
    parser.add_argument("--kernels", default="auto", choices=["auto", "plain"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per phase (medians are printed)")
    parser.add_argument("--neighbours", type=int, default=1, help="CPU-bound processes beside the loaded phase")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads in the run (default: the product's)")
    parser.add_argument("--fixed-threads", action="store_true", help="--no-adapt-cpu-threads: torch's count throughout")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the run's process (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(child(args)))
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **dict(item.split("=", 1) for item in args.env)}
    command = [sys.executable, __file__, "--child", "--shape", args.shape, "--kernels", args.kernels, "--new-tokens",
               str(args.new_tokens), "--steps", str(args.steps), "--neighbours", str(args.neighbours)]
    if args.fixed_threads:
        command.append("--fixed-threads")
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout + done.stderr)
        return done.returncode
    result = json.loads(done.stdout.strip().splitlines()[-1])
    quiet, loaded = statistics.median(result["quiet"]), statistics.median(result["loaded"])
    print(f"shape={args.shape} kernels={args.kernels} new_tokens={args.new_tokens} "
          f"threads at the end={result['threads']} "
          f"env={' '.join(args.env) or '-'} neighbours={args.neighbours} cores={os.cpu_count()} steps={args.steps}")
    for phase, median in (("quiet", quiet), ("loaded", loaded)):
        print(f"{phase:6s} median {median:.3f} s/step  ({' '.join(f'{t:.3f}' for t in result[phase])}; threads "
              f"{' '.join(str(n) for n in result[phase + '_threads'])})")
    print(f"loaded / quiet = {loaded / quiet:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
