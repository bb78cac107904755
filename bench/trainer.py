"""Our trainer vs trl 1.16's GRPOTrainer on the same model shape and the same work, plus a matmul floor.

    python bench/trainer.py --shape small                  # CPU, fp32: 4 prompts x G=4, 64 new tokens
    python bench/trainer.py --shape qwen2.5-0.5b --steps 2 # CPU, the real Qwen2.5-0.5B shape (random init)
    python bench/trainer.py --device cuda --shape qwen2.5-0.5b   # GPU, bf16: 16 prompts x G=8, 256 tokens
        --sides ours,trl,ours-plain      # ours: --kernels auto (the default); ours-plain: --kernels plain

Same work on both sides: one random-init model saved to a folder (so completions run to the token
budget: EOS is a 1-in-150k token for it), the same prompts, num_generations, completions per
optimizer step, micro-batch, max_completion_length, beta and precision; gradient checkpointing
off, no vLLM. Each side runs in its own subprocess (its peak memory is its own), alternating
ours / trl for --repeats rounds; the first optimizer step of every run is warm-up and not timed.

Printed: median seconds per optimizer step, generated tokens/s, peak memory (CPU: peak resident
set size of the process; CUDA: torch.cuda.max_memory_allocated), the ratio ours/trl, and a floor:
the time of the matrix products one step cannot avoid at these shapes, measured here in the same
run (prefill of each distinct prompt, T decode steps of N rows, the training forward + backward of
the trunk and of the output projection on completion positions, the reference forward; each
product timed on its own, into a preallocated output, in the faster of its two orientations, on a GPU
ten times back to back: see floor_seconds), and ours/floor. The floor is measured right before and right after each of our runs; ours/floor is the
median over rounds of (our median step in that run) / (the mean of its two floors), so the slow
drift of a shared machine's speed largely cancels in each ratio. The floor counts each product's fastest
timing; a second line sums each product's median timing instead ("median floor"), the statistic our
step is reported in, and gives ours against it too: on a noisy machine the two differ by the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def workload(args) -> dict:
    cuda = args.device == "cuda"
    return dict(
        prompts=args.prompts or (16 if cuda else 4), group=args.group_size or (8 if cuda else 4),
        new_tokens=args.new_tokens or (256 if cuda else 64), micro_batch=args.micro_batch or (32 if cuda else 8),
        beta=0.04, precision="bf16" if cuda else "fp32",
    )


def _peak_memory_mib(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model_dir: str, work: dict, steps: int, device: str, out_dir: str, kernels: str = "auto") -> dict:
    from data import add_prompts, make_synthetic_gsm8k
    from grpo.config import GRPOConfig
    from grpo.metrics import read_jsonl
    from grpo.trainer import Trainer

    config = GRPOConfig(
        model=model_dir, dataset="synthetic:256", output_dir=out_dir, overwrite=True, max_steps=steps,
        prompts_per_step=work["prompts"], num_generations=work["group"], micro_batch_size=work["micro_batch"],
        max_completion_length=work["new_tokens"], max_prompt_length=256, beta=work["beta"], reward=["tags"],
        device=device, precision=work["precision"], learning_rate=1e-6, save_steps=0, log_completions_steps=0,
        logging_steps=10**6, warmup_ratio=0.0, kernels=kernels,
    )
    trainer = Trainer(config, train_rows=add_prompts(make_synthetic_gsm8k(256, seed=0)))
    trainer.save = lambda: None  # checkpoint writing is not part of a step on either side
    trainer.train()
    metrics = read_jsonl(Path(out_dir) / "metrics.jsonl")
    return {"step_times": [m["step_time"] for m in metrics],
            "phases": [{"sample": m["sample_time"], "reference": m["reference_time"],
                        "update": m["step_time"] - m["sample_time"] - m["reference_time"]} for m in metrics],
            "tokens": [m["completions/mean_length"] * config.completions_per_step for m in metrics],
            "peak_mib": _peak_memory_mib(device)}


def run_trl(model_dir: str, work: dict, steps: int, device: str, out_dir: str) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig as TrlConfig, GRPOTrainer

    from data import add_prompts, make_synthetic_gsm8k
    from rewards.toy import tags

    completions = work["prompts"] * work["group"]
    args = TrlConfig(
        output_dir=out_dir, use_cpu=device == "cpu", bf16=work["precision"] == "bf16", report_to="none",
        gradient_checkpointing=False, per_device_train_batch_size=work["micro_batch"],
        gradient_accumulation_steps=completions // work["micro_batch"], num_generations=work["group"],
        max_completion_length=work["new_tokens"], beta=work["beta"], learning_rate=1e-6, max_steps=steps,
        logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0,
    )
    rows = [{"prompt": row["prompt"], "answer": row["answer"]} for row in add_prompts(make_synthetic_gsm8k(256, seed=0))]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.last)

    timer = StepTimer()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[tags], args=args,
                          train_dataset=datasets.Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry]
    return {"step_times": timer.times, "tokens": [length * completions for length in lengths],
            "peak_mib": _peak_memory_mib(device)}


def floor_seconds(shape: str, work: dict, prompt_len: int, device: str, repeats: int = 5) -> dict:
    """Time of the matrix products one GRPO step cannot avoid, with torch.mm at the step's shapes.

    Every product of the step is timed on its own: each linear layer's forward Y = X W^T and, for the
    update, its backward dX = dY W and dW = dY^T X; the output projection over all completion positions
    at once (no chunking); attention's two batched products per layer. Each product writes into a
    preallocated output (allocation is not part of a product), is timed in both orientations (A B, and
    (B^T A^T)^T with the weight's own (out, in) layout: BLAS speed depends on it) and up to `repeats`
    times; the fastest timing of the faster orientation counts. Returns the parts and their total
    (seconds), and under "<part>_median" the same sums of each product's median timing: a step's median
    includes the machine's timing noise, which the fastest of several timings leaves out.
    """
    import torch

    from grpo.tiny_model import SHAPES

    dims = SHAPES[shape]
    hidden, inter, layers, vocab = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"], dims["vocab_size"] or 512
    heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
    head_dim = hidden // heads
    dtype = torch.bfloat16 if work["precision"] == "bf16" else torch.float32
    rows, new = work["prompts"] * work["group"], work["new_tokens"]
    linears = [(hidden, hidden), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim), (hidden, hidden),
               (hidden, inter), (hidden, inter), (inter, hidden)]  # q, k, v, o, gate, up, down: (in, out)
    measured: dict[tuple, tuple[float, float]] = {}  # product -> (fastest, median) seconds

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    # On a GPU one product is a kernel of microseconds: timing it alone would count the launch and the
    # synchronisation. There each timing runs it `calls` times back to back and takes the mean.
    calls = 10 if device == "cuda" else 1

    def timed(run) -> tuple[float, float]:
        """(fastest, median) seconds of `run` over up to `repeats` timings."""
        times, spent = [], 0.0
        for attempt in range(repeats):
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            sync()
            elapsed = time.perf_counter() - start
            times.append(elapsed / calls)
            spent += elapsed
            if attempt and spent > 1.0:  # large products: two or three timings are enough
                break
        return min(times), statistics.median(times)

    def product(m, k, n) -> tuple[float, float]:
        """One (m, k) @ (k, n) product in its faster orientation (by fastest timing)."""
        if (m, k, n) not in measured:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            plain = timed(lambda: torch.mm(a, b, out=out))
            del out
            b_rows, out = b.T.contiguous(), torch.empty(n, m, device=device, dtype=dtype)  # (n, k) and (n, m) storage
            measured[(m, k, n)] = min(plain, timed(lambda: torch.mm(b_rows, a.T, out=out)))
            del a, b, b_rows, out
        return measured[(m, k, n)]

    def attention(batch, queries, keys) -> tuple[float, float]:  # QK^T and AV per head, one batched product each
        key = ("attention", batch, queries, keys)
        if key not in measured:
            q = torch.randn(batch * heads, queries, head_dim, device=device, dtype=dtype)
            k = torch.randn(batch * heads, head_dim, keys, device=device, dtype=dtype)
            measured[key] = timed(lambda: (torch.bmm(q, k), torch.bmm(q, k)))
        return measured[key]

    def parts(pick: int) -> dict:
        """The step's parts (seconds) from each product's fastest (pick 0) or median (pick 1) timing."""

        def linear(tokens, fan_in, fan_out, backward=False) -> float:
            seconds = product(tokens, fan_in, fan_out)[pick]  # Y = X W^T
            if backward:  # dX = dY W, dW = dY^T X
                seconds += product(tokens, fan_out, fan_in)[pick] + product(fan_out, tokens, fan_in)[pick]
            return seconds

        def trunk(tokens, backward=False) -> float:
            return sum(linear(tokens, i, o, backward) for i, o in linears) * layers

        seq = prompt_len + new
        prefill = trunk(work["prompts"] * prompt_len) + attention(work["prompts"], prompt_len, prompt_len)[pick] * layers
        decode = (trunk(rows) + linear(rows, hidden, vocab) + attention(rows, 1, seq)[pick] * layers) * new
        train = (trunk(rows * seq, backward=True) + linear(rows * new, hidden, vocab, backward=True)
                 + attention(rows, seq, seq)[pick] * layers * 3)
        reference = (trunk(rows * seq) + linear(rows * new, hidden, vocab) + attention(rows, seq, seq)[pick] * layers
                     if work["beta"] else 0.0)
        return {"sample": prefill + decode, "reference": reference, "update": train,
                "total": prefill + decode + train + reference}

    return {**parts(0), **{f"{part}_median": seconds for part, seconds in parts(1).items()}}


# ours: our defaults (--kernels auto: the compiled decode step on CUDA, the fused loss, ...); ours-plain: --kernels plain.
SIDES = {"ours": "auto", "ours-plain": "plain", "trl": None}


def child(args):
    work = workload(args)
    with tempfile.TemporaryDirectory() as out:
        if args.child == "trl":
            result = run_trl(args.model_dir, work, args.steps, args.device, out)
        else:
            result = run_ours(args.model_dir, work, args.steps, args.device, out, kernels=SIDES[args.child])
    print("RESULT " + json.dumps(result))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small", help="small, qwen2.5-0.5b or tiny (grpo/tiny_model.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--untimed", type=int, default=1, help="leading steps of each run not timed (warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating ours / trl")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--sides", default="ours,trl", help=f"which trainers to run, comma-separated: {', '.join(SIDES)}")
    parser.add_argument("--side-timeout", type=float, default=None, help="seconds one run may take before it is "
                        "stopped and reported as failed (the other runs go on)")
    parser.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    from grpo.tiny_model import save_tiny_model

    work = workload(args)
    sides = args.sides.split(",")
    unknown = [side for side in sides if side not in SIDES]
    if unknown:
        parser.error(f"unknown side(s) {unknown} in --sides; choose from {', '.join(SIDES)}")
    results = {side: [] for side in sides}
    floors, round_ratios = [], {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as model_dir:
        save_tiny_model(model_dir, args.shape, seed=0)
        from transformers import AutoTokenizer

        from data import add_prompts, make_synthetic_gsm8k
        from grpo.rollout import encode_prompt

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompt_len = max(len(encode_prompt(tokenizer, row["prompt"])) for row in add_prompts(make_synthetic_gsm8k(64, seed=0)))
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k in ("prompts", "group_size", "new_tokens", "micro_batch") and v is not None]
        for _ in range(args.repeats):
            for side in sides:
                if side.startswith("ours"):
                    floors.append(floor_seconds(args.shape, work, prompt_len, args.device))  # just before the run
                command = [sys.executable, __file__, "--child", side, "--model-dir", model_dir, "--shape", args.shape,
                           "--device", args.device, "--steps", str(args.steps), *forwarded]
                try:
                    run = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT,
                                         timeout=args.side_timeout)
                except subprocess.TimeoutExpired as stopped:
                    print(f"{side} run stopped after {args.side_timeout} s:\n{_tail(stopped.stderr)}", flush=True)
                    continue
                lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
                if run.returncode or not lines:  # reported, and the other runs go on
                    print(f"{side} run failed (exit {run.returncode}):\n{_tail(run.stdout)}\n{_tail(run.stderr)}", flush=True)
                    continue
                results[side].append(json.loads(lines[-1][len("RESULT "):]))
                print(f"{side} run: step times {', '.join(f'{t:.3f}' for t in results[side][-1]['step_times'])} s, "
                      f"peak {results[side][-1]['peak_mib']:.0f} MiB", flush=True)
                if side.startswith("ours"):
                    floors.append(floor_seconds(args.shape, work, prompt_len, args.device))  # and just after it
                    around = (floors[-2]["total"] + floors[-1]["total"]) / 2
                    around_median = (floors[-2]["total_median"] + floors[-1]["total_median"]) / 2
                    step = statistics.median(results[side][-1]["step_times"][args.untimed:])
                    round_ratios[side].append((step / around, step, around, step / around_median))
    floor = {part: statistics.median(f[part] for f in floors) for part in floors[0]} if floors else None

    summary = {}
    for side, runs in results.items():
        if not runs:
            continue
        step_times = [t for run in runs for t in run["step_times"][args.untimed:]]  # warm-up steps dropped
        tokens = [n for run in runs for n in run["tokens"][args.untimed:]]
        step = statistics.median(step_times)
        summary[side] = {"step_s": step, "tokens_per_s": statistics.median(tokens) / step,
                         "peak_mib": statistics.median(run["peak_mib"] for run in runs),
                         "mean_tokens": statistics.mean(tokens)}
    print(f"shape={args.shape} device={args.device} precision={work['precision']} prompts={work['prompts']} "
          f"G={work['group']} new_tokens={work['new_tokens']} micro_batch={work['micro_batch']} beta={work['beta']} "
          f"steps/run={args.steps} ({args.untimed} untimed) runs/side={args.repeats}, medians")
    print(f"{'':18s} {'s/step':>9s} {'tokens/s':>10s} {'peak MiB':>10s} {'tokens/step':>12s}")
    for side, s in summary.items():
        print(f"{side:18s} {s['step_s']:9.3f} {s['tokens_per_s']:10.1f} {s['peak_mib']:10.0f} {s['mean_tokens']:12.0f}")
    ours_sides = [side for side in summary if side.startswith("ours")]
    if "trl" in summary:
        t = summary["trl"]
        for side in ours_sides:
            o = summary[side]
            print(f"{side + '/trl':18s} {o['step_s'] / t['step_s']:9.3f} {o['tokens_per_s'] / t['tokens_per_s']:10.2f} "
                  f"{o['peak_mib'] / t['peak_mib']:10.3f}   ({side} steps/s = {t['step_s'] / o['step_s']:.2f} x trl's)")
    if ours_sides:
        print(f"{'floor':18s} {floor['total']:9.3f}   (matmuls of one step at these shapes, measured here, each "
              f"product's fastest timing; median of {len(floors)} measurements, before and after each of our runs)")
        print(f"{'median floor':18s} {floor['total_median']:9.3f}   (the same products, each at its median timing, "
              "as our step is a median)")
        for side in ours_sides:
            ratios = round_ratios[side]
            summary[side]["floor_ratio"] = statistics.median(r for r, _, _, _ in ratios)
            summary[side]["floor_median_ratio"] = statistics.median(r for _, _, _, r in ratios)
            print(f"{side + '/floor':18s} {summary[side]['floor_ratio']:9.3f}   (median over rounds of our step / the "
                  f"floor around it; per round: {', '.join(f'{r:.3f} = {o:.3f}/{f:.3f}' for r, o, f, _ in ratios)})")
            print(f"{side + '/median floor':18s} {summary[side]['floor_median_ratio']:9.3f}   (the same against the "
                  f"floor of median timings; per round: {', '.join(f'{r:.3f}' for _, _, _, r in ratios)})")
        print(f"\nper phase, s    {'sample':>8s} {'reference':>10s} {'update':>8s}")
        for side in ours_sides:
            phases = [p for run in results[side] for p in run["phases"][args.untimed:]]
            ours = summary[side]["phases"] = {part: statistics.median(p[part] for p in phases)
                                              for part in ("sample", "reference", "update")}
            print(f"{side:14s} {ours['sample']:8.3f} {ours['reference']:10.3f} {ours['update']:8.3f}")
        print(f"{'floor':14s} {floor['sample']:8.3f} {floor['reference']:10.3f} {floor['update']:8.3f}")
        print(f"{'median floor':14s} {floor['sample_median']:8.3f} {floor['reference_median']:10.3f} "
              f"{floor['update_median']:8.3f}")
    return {"summary": summary, "floor": floor}


def _tail(text, limit: int = 3000) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
    return text[-limit:]


if __name__ == "__main__":
    main()
