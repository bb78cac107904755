"""Per-rank memory (and step time) of FSDP2 against DDP under torchrun, on CPU ranks or GPUs.

    python bench/distributed.py --shape qwen2.5-0.5b --processes 2      # 2 CPU ranks on gloo, one step each
    python bench/distributed.py --shape small --processes 2 --modes ddp,fsdp,none

Each mode trains the same random-init model for --steps steps (beta 0: no reference model; the loss
and data are the trainer's own) in a fresh `torchrun` launch, so each launch's peak memory is its own.
Printed per mode and rank: the bytes of parameters, gradients and AdamW state the rank holds (its local
shards under FSDP2), the peak resident set size of the process (CPU) or torch.cuda.max_memory_allocated
(GPU), and the median step time after the first step. `none` is one process without a wrapper (the
world-size-one path), for the overhead of the wrapper itself (`--processes 1 --modes none,fsdp`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(args) -> None:
    """One rank: build the trainer, run the steps, report what this rank holds and its peak."""
    import torch

    from grpo.config import GRPOConfig
    from grpo.core.trainer import Trainer

    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    mode = "fsdp" if args.mode == "fsdp" else "ddp" if args.mode == "ddp" else "auto"
    config = GRPOConfig(model=args.model_dir, dataset="synthetic:64", prompts_per_step=args.prompts,
                        num_generations=args.group, micro_batch_size=args.micro_batch, max_prompt_length=128,
                        max_completion_length=args.new_tokens, beta=0.0, reward=["tags"], device=args.device,
                        precision="bf16" if cuda else "fp32", max_steps=args.steps, save_steps=0, logging_steps=1000,
                        log_completions_steps=0, output_dir=tempfile.mkdtemp(), overwrite=True, distributed=mode,
                        warmup_ratio=0.0)
    trainer = Trainer(config)
    times = []
    original = trainer.train_on_rollout

    def timed(rollout):
        started = time.perf_counter()
        metrics = original(rollout)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        return metrics

    trainer.train_on_rollout = timed
    step_started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - step_started

    def local_bytes(tensors):
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)

    params = list(trainer.policy.parameters())
    held = {"parameters": local_bytes(params),
            "gradients": local_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": local_bytes([v for state in trainer.optimizer.state.values() for v in state.values()
                                      if torch.is_tensor(v) and v.dim() > 0])}
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result = {"rank": trainer.world.rank, "mode": trainer.models.distributed,
              "held_mib": {k: v / 2**20 for k, v in held.items()},
              "peak_mib": peak / 2**20, "update_s": statistics.median(times[1:] or times), "run_s": total}
    Path(args.report).with_suffix(f".{trainer.world.rank}.json").write_text(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--modes", default="ddp,fsdp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    # the per-rank entry point
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)

    from grpo.tiny_model import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    model_dir = save_tiny_model(work / "model", args.shape, seed=0)
    print(f"shape {args.shape}, {args.processes} process(es) on {args.device}, "
          f"{args.prompts} prompts x G={args.group}, "
          f"{args.new_tokens} new tokens, micro-batch {args.micro_batch}, {args.steps} steps, beta 0", flush=True)
    print(f"{'mode':6s} {'rank':>4s} {'params MiB':>11s} {'grads MiB':>10s} {'AdamW MiB':>10s} {'peak MiB':>9s} "
          f"{'update s':>9s}")
    for mode in args.modes.split(","):
        processes = 1 if mode == "none" else args.processes
        report = work / f"{mode}.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--rank-main", "--mode", mode, "--model-dir",
                   str(model_dir), "--report", str(report), "--device", args.device, "--steps", str(args.steps),
                   "--prompts", str(args.prompts), "--group", str(args.group), "--micro-batch", str(args.micro_batch),
                   "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        if mode != "none":  # a wrapper needs a process group, also at one process
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                       "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *command[1:]]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ,
                                                                            "OMP_NUM_THREADS": str(args.threads)})
        if done.returncode != 0:
            print(f"{mode}: failed\n{done.stderr[-3000:]}")
            continue
        for rank in range(processes):
            r = json.loads(report.with_suffix(f".{rank}.json").read_text())
            held = r["held_mib"]
            print(f"{r['mode']:6s} {rank:4d} {held['parameters']:11.0f} {held['gradients']:10.0f} "
                  f"{held['optimizer']:10.0f} "
                  f"{r['peak_mib']:9.0f} {r['update_s']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
