"""Peak memory of completion log-probs + backward: chunked (grpo.algorithm.logprobs) vs the naive full-logits reference.

Each method runs in a fresh subprocess so its peak is its own: on CPU the peak resident set size
(VmHWM) minus the resident size just before the forward; on CUDA torch.cuda.max_memory_allocated.

    python bench/logprob_memory.py --shape small --rows 16 --completion-length 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """This process's own peak resident set (VmHWM). Not getrusage's ru_maxrss: a child started by fork (or vfork)
    and exec keeps its parent's peak in it, so a child of a process holding gigabytes reports gigabytes."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:")) / 1024  # kB


def measure(method: str, shape: str, rows: int, prompt_length: int, completion_length: int, device: str) -> dict:
    import torch

    from grpo.algorithm.logprobs import completion_logprobs
    from tests.references import naive_completion_logprobs
    from grpo.tiny_model import build_tiny_model

    model, _ = build_tiny_model(shape, seed=0)
    model = model.to(device).train()
    generator = torch.Generator().manual_seed(0)
    length = prompt_length + completion_length
    input_ids = torch.randint(0, 500, (rows, length), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.ones(rows, completion_length, device=device)
    fn = completion_logprobs if method == "chunked" else naive_completion_logprobs
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mib()
    logps = fn(model, input_ids, attention_mask, completion_mask)
    logps = logps[0] if isinstance(logps, tuple) else logps
    logps.sum().backward()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _peak_rss_mib()
    return {"method": method, "peak_mib_above_model": round(peak - base, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--completion-length", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--method", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.method:  # child process
        print(json.dumps(measure(args.method, args.shape, args.rows, args.prompt_length, args.completion_length,
                                 args.device)))
        return {}
    results = {}
    for method in ("chunked", "naive"):
        command = [sys.executable, __file__, "--method", method] + [
            f"--shape={args.shape}", f"--rows={args.rows}", f"--prompt-length={args.prompt_length}",
            f"--completion-length={args.completion_length}", f"--device={args.device}",
        ]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[method] = json.loads(output.strip().splitlines()[-1])["peak_mib_above_model"]
    ratio = results["chunked"] / results["naive"]
    print(f"shape={args.shape} N={args.rows} P={args.prompt_length} T={args.completion_length} device={args.device}")
    print(f"peak MiB above the model, log-probs + backward: chunked {results['chunked']:.0f}, "
          f"naive {results['naive']:.0f}, ratio {ratio:.3f}")
    return {**results, "ratio": ratio}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
