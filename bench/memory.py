"""Peak memory of one training step: full fine-tune against LoRA, on CPU (or a GPU), random-init weights.

    python bench/memory.py --shape qwen2.5-0.5b                       # full, LoRA r=16, LoRA + checkpointing
    python bench/memory.py --shape qwen2.5-1.5b --setups lora,lora-gc  # the full fine-tune's need is printed
    python bench/memory.py --device cuda --shape qwen2.5-0.5b --setups full,full-8bit,lora

Each setup runs in its own subprocess (its peak is its own): the trainer builds the model, samples one
rollout (4 prompts x G=4, 64 new tokens by default) and makes one update with beta 0.04, so the full
fine-tune holds its reference copy and LoRA its adapters-off reference (none). Printed: the peak resident
set size of the process (CPU) or torch.cuda.max_memory_allocated (GPU), the trainable parameters, the
step time, and what the full fine-tune's weights, gradients, AdamW moments and reference need in fp32
(16 + 4 bytes per parameter), for a shape where running it does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETUPS = {
    "full": {},
    "full-8bit": dict(optim="adamw_8bit"),
    "full-gc": dict(gradient_checkpointing=True),
    "full-gc-8bit": dict(gradient_checkpointing=True, optim="adamw_8bit"),
    "lora": dict(use_peft=True, lora_r=16, lora_alpha=32),
    "lora-gc": dict(use_peft=True, lora_r=16, lora_alpha=32, gradient_checkpointing=True),
}


def run_one(args) -> None:
    import torch

    from grpo.config import GRPOConfig
    from grpo.core.trainer import Trainer

    cuda = args.device == "cuda"
    config = GRPOConfig(model=args.model_dir, dataset="synthetic:64", prompts_per_step=args.prompts,
                        num_generations=args.group, micro_batch_size=args.micro_batch, max_prompt_length=128,
                        max_completion_length=args.new_tokens, beta=0.04, reward=["tags"], device=args.device,
                        precision="bf16" if cuda else "fp32", max_steps=1, save_steps=0, logging_steps=1000,
                        log_completions_steps=0, output_dir=tempfile.mkdtemp(), overwrite=True, warmup_ratio=0.0,
                        **SETUPS[args.setup])
    trainer = Trainer(config)
    started = time.perf_counter()
    trainer.train_on_rollout(trainer.collect_rollout(0)[0])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainable = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.policy.parameters())
    print(json.dumps({"peak_mib": peak / 2**20, "trainable": trainable, "parameters": total, "step_s": seconds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--setups", default="full,lora,lora-gc", help=f"comma-separated, from {sorted(SETUPS)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_one(args)

    from grpo.tiny_model import SHAPES, save_tiny_model

    model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="bench_memory_")) / "model", args.shape, seed=0)
    dims = SHAPES[args.shape]
    print(f"shape {args.shape} on {args.device}: {args.prompts} prompts x G={args.group}, "
          f"{args.new_tokens} new tokens, "
          f"micro-batch {args.micro_batch}, beta 0.04, one step", flush=True)
    print(f"{'setup':10s} {'peak MiB':>9s} {'trainable':>12s} {'step s':>8s}")
    results = {}
    for setup in args.setups.split(","):
        command = [sys.executable, str(Path(__file__).resolve()), "--one", "1", "--setup", setup, "--model-dir",
                   str(model_dir), "--device", args.device, "--prompts", str(args.prompts), "--group", str(args.group),
                   "--micro-batch", str(args.micro_batch), "--new-tokens", str(args.new_tokens)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{setup:10s} failed: "
                  f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results[setup] = result
        print(f"{setup:10s} {result['peak_mib']:9.0f} {result['trainable']:12,d} {result['step_s']:8.1f}", flush=True)
    if "full" in results and "lora" in results:
        print(f"lora / full peak: {results['lora']['peak_mib'] / results['full']['peak_mib']:.3f}")
    parameters = next((r["parameters"] for r in results.values()), None)
    if parameters:
        print(f"the full fine-tune needs {parameters * 20 / 2**30:.1f} GiB for fp32 weights, gradients, AdamW moments "
              f"and the reference copy alone ({parameters / 1e9:.2f}B parameters, vocab {dims['vocab_size']})")


if __name__ == "__main__":
    main()
