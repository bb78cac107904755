"""Our trainer vs trl 1.16's GRPOTrainer on the same model shape and the same work, plus a matmul floor.

    python bench/trainer.py --shape small                  # CPU, fp32: 4 prompts x G=4, 64 new tokens
    python bench/trainer.py --shape qwen2.5-0.5b --steps 2 # CPU, the real Qwen2.5-0.5B shape (random init)
    python bench/trainer.py --device cuda --shape qwen2.5-0.5b   # GPU, bf16: 16 prompts x G=8, 256 tokens
        --sides ours,trl,ours-plain      # ours: --kernels auto (the default); ours-plain: --kernels plain

    python bench/trainer.py --shape small --lengths full,realistic,short   # completions that end early too
        --profile DIR                    # and where one more step's reference and update time goes (torch.profiler)

Same work on both sides: one random-init model saved to a folder (with --lengths full, the default,
completions run to the token budget: EOS is a 1-in-150k token for it; realistic and short give the model an
EOS rate, LENGTHS below), the same prompts, num_generations, completions per optimizer step, micro-batch,
max_completion_length, beta and precision; gradient checkpointing off, no vLLM. Each side runs in its own subprocess
(its peak memory is its own), alternating
ours / trl for --repeats rounds; the first optimizer step of every run is warm-up and not timed.

Printed: median seconds per optimizer step, generated tokens/s, peak memory (CPU: peak resident
set size of the process; CUDA: torch.cuda.max_memory_allocated), the ratio ours/trl, and a floor:
the time of the matrix products one step cannot avoid at these shapes, measured here in the same
run (prefill of each distinct prompt, T decode steps of N rows, the training forward + backward of
the trunk and of the output projection on completion positions, the reference forward; each
product timed on its own, into a preallocated output, in the faster of its two orientations, on a GPU
ten times back to back: see floor_seconds), and ours/floor. The floor is measured right before and right after each of
our runs; ours/floor is the
median over rounds of (our median step in that run) / (the mean of its two floors), so the slow
drift of a shared machine's speed largely cancels in each ratio. The floor counts each product's fastest
timing; a second line sums each product's median timing instead ("median floor"), the statistic our
step is reported in, and gives ours against it too: on a noisy machine the two differ by the noise.
For every length setting, each timed step also gets its real-token floor (real_token_floor: the same products
over the step's real tokens, without padding or finished rows), and a setting other than full gives our step
against our full-length step scaled by the ratio of generated tokens (1 = the cost follows the real tokens).
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


def profiled(trainer, run, path: Path, device: str):
    """`run()` (the trainer's train_on_rollout for one step: its reference and update passes) under torch.profiler;
    writes where the time goes to `path`: the passes (reference / old-policy log-probs, each micro-batch's loss
    forward, its backward, the optimizer step) and the operations (CUDA kernels on a GPU) by self time, also by
    input shape. Returns what `run` returns."""
    import contextlib
    from unittest import mock

    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    def labelled(label, method):
        def call(*args, **kwargs):
            with record_function(label):
                return method(*args, **kwargs)
        return call

    import grpo.core.update

    passes = [(grpo.core.update, "no_grad_logprobs", "reference/old log-probs"),
              (trainer.functions, "update_loss", "micro-batch loss forward"),
              (torch.Tensor, "backward", "micro-batch backward"), (trainer.optimizer, "step", "optimizer step")]
    cuda = device == "cuda"
    with contextlib.ExitStack() as stack:
        for owner, name, label in passes:
            stack.enter_context(mock.patch.object(owner, name, labelled(label, getattr(owner, name))))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            with record_function("train_on_rollout"):
                result = run()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    events, labels = prof.key_averages(), ["train_on_rollout", *(label for _, _, label in passes)]
    lines = [f"{'pass':28s} {'calls':>6s} {'CPU total ms':>13s}" + (f" {'CUDA total ms':>14s}" if cuda else "")]
    if cuda:  # autograd launches the backward's kernels from its own device thread, outside the label's range
        lines.insert(0, "(CUDA: the backward's kernels are launched by autograd's device thread: see the tables below)")
    for event in sorted((e for e in events if e.key in labels), key=lambda e: labels.index(e.key)):
        device_ms = f" {event.device_time_total / 1e3:14.1f}" if cuda else ""
        lines.append(f"{event.key:28s} {event.count:6d} {event.cpu_time_total / 1e3:13.1f}{device_ms}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n\n" + events.table(sort_by=sort, row_limit=30) + "\n"
                    + prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=30,
                                                                         max_shapes_column_width=90))
    return result


def run_ours(model_dir: str, work: dict, steps: int, device: str, out_dir: str, kernels: str = "auto",
             profile: str | None = None, chunk_size: int | None = None) -> dict:
    """Our trainer's step times, phases, tokens and peak memory; kernels "auto-padded": auto without compaction,
    length grouping, packing and the real-token trunk passes (what they save); "auto-unshared": auto without the
    shared-prompt passes; "auto-padded-trunk": auto with the shared-prompt passes on the padded layout.
    `profile`: a path; one more step runs after the `steps`, its reference and update passes profiled into that
    file (`profiled`), and left out of the results. `chunk_size`: logprob_chunk_size (None: its default)."""
    padded, unshared, padded_trunk = (kernels == name for name in ("auto-padded", "auto-unshared", "auto-padded-trunk"))
    kernels = "auto" if padded or unshared or padded_trunk else kernels
    from data import add_prompts, make_synthetic_gsm8k
    import torch

    import grpo.core.update
    from grpo.config import GRPOConfig
    from grpo.core.metrics import read_jsonl
    from grpo.core.trainer import Trainer

    config = GRPOConfig(
        model=model_dir, dataset="synthetic:256", output_dir=out_dir, overwrite=True, max_steps=steps + bool(profile),
        prompts_per_step=work["prompts"], num_generations=work["group"], micro_batch_size=work["micro_batch"],
        max_completion_length=work["new_tokens"], max_prompt_length=256, beta=work["beta"], reward=["tags"],
        device=device, precision=work["precision"], learning_rate=1e-6, save_steps=0, log_completions_steps=0,
        logging_steps=10**6, warmup_ratio=0.0, kernels=kernels, logprob_chunk_size=chunk_size,
    )
    trainer = Trainer(config, train_rows=add_prompts(make_synthetic_gsm8k(256, seed=0)))
    trainer.save = lambda: None  # checkpoint writing is not part of a step on either side
    if padded:  # the real-length kernels off: every row decoded to the budget's end, random padded micro-batches
        import grpo.kernels.sampling as fast_sampling

        fast_sampling._COMPACT_SHARE = 10**9
        trainer.kernels.length_grouping = trainer.kernels.length_sorted_passes = trainer.kernels.packed_logprobs = False
        trainer.kernels.unpadded_trunk = False
    if unshared:  # every row's prompt through the trunk, as the plain path
        trainer.kernels.shared_prompt_passes = trainer.kernels.shared_prompt_update = False
    if padded_trunk or unshared:  # the trunk's projections and MLPs on every position, padding included
        trainer.kernels.unpadded_trunk = False
    if trainer.kernels is not None:  # the update's functions, from the flags as set here
        trainer.functions = trainer.kernels.step_functions(
            config.loss_options(), config.temperature, config.logprob_chunk_size, config.cast_lm_head_to_fp32)
    lengths, reference_times, train_on_rollout = [], [], trainer.train_on_rollout
    passes = grpo.core.update.no_grad_logprobs

    def timed_passes(*args, **kwargs):  # the reference / old-policy passes' time, their queued GPU work included
        started = time.perf_counter()
        out = passes(*args, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        reference_times[-1] += time.perf_counter() - started
        return out

    grpo.core.update.no_grad_logprobs = timed_passes

    def recording(rollout, **kwargs):  # each step's real prompt and completion tokens per row, for the floor
        lengths.append({"prompt": rollout.prompt_mask.sum(-1).tolist(),
                        "completion": rollout.completion_mask.sum(-1).tolist()})
        reference_times.append(0.0)
        return train_on_rollout(rollout, **kwargs)

    trainer.train_on_rollout = recording
    if profile:  # one more step, its reference and update passes profiled, not timed with the others
        def profiled_last(rollout, **kwargs):
            if trainer.step < steps:
                return recording(rollout, **kwargs)
            return profiled(trainer, lambda: train_on_rollout(rollout, **kwargs), Path(profile), device)

        trainer.train_on_rollout = profiled_last
    try:
        trainer.train()
    finally:
        grpo.core.update.no_grad_logprobs = passes
    metrics = read_jsonl(Path(out_dir) / "metrics.jsonl")[:steps]
    return {"step_times": [m["step_time"] for m in metrics],
            "phases": [{"sample": m["sample_time"], "reference": reference,
                        "update": m["step_time"] - m["sample_time"] - reference}
                       for m, reference in zip(metrics, reference_times)],
            "tokens": [m["completions/mean_length"] * config.completions_per_step for m in metrics],
            "lengths": lengths, "peak_mib": _peak_memory_mib(device)}


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
    rows = [{"prompt": row["prompt"], "answer": row["answer"]} for row in add_prompts(make_synthetic_gsm8k(256,
                                                                                                           seed=0))]

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
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history
               if "completions/mean_length" in entry]
    return {"step_times": timer.times, "tokens": [length * completions for length in lengths],
            "peak_mib": _peak_memory_mib(device)}


class Products:
    """Timings of the matrix products of one GRPO step at a model shape, each measured once and kept.

    Each product writes into a preallocated output (allocation is not part of a product), is timed in both
    orientations (A B, and (B^T A^T)^T with the weight's own (out, in) layout: BLAS speed depends on it) and up
    to `repeats` times; the faster orientation counts, by its fastest timing. `pick` 0 gives each product's
    fastest timing, 1 its median (a step's median includes the machine's timing noise, which the fastest of
    several timings leaves out). On a GPU one product is a kernel of microseconds: timing it alone would count
    the launch and the synchronisation, so there each timing runs it ten times back to back and takes the mean.
    """

    def __init__(self, shape: str, precision: str, device: str, repeats: int = 5):
        import torch

        from grpo.tiny_model import SHAPES

        dims = SHAPES[shape]
        self.hidden, self.inter, self.layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
        self.vocab = dims["vocab_size"] or 512
        self.heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
        self.head_dim = self.hidden // self.heads
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.device, self.repeats, self.calls = device, repeats, 10 if device == "cuda" else 1
        kv = kv_heads * self.head_dim
        h, i = self.hidden, self.inter
        # q, k, v, o, gate, up, down: (in, out)
        self.linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
        self.measured: dict[tuple, tuple[float, float]] = {}  # product -> (fastest, median) seconds

    def _sync(self):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _timed(self, run) -> tuple[float, float]:
        """(fastest, median) seconds of `run` over up to `repeats` timings."""
        times, spent = [], 0.0
        for attempt in range(self.repeats):
            self._sync()
            start = time.perf_counter()
            for _ in range(self.calls):
                run()
            self._sync()
            elapsed = time.perf_counter() - start
            times.append(elapsed / self.calls)
            spent += elapsed
            if attempt and spent > 1.0:  # large products: two or three timings are enough
                break
        return min(times), statistics.median(times)

    def product(self, m, k, n) -> tuple[float, float]:
        """One (m, k) @ (k, n) product in its faster orientation (by fastest timing); 0 when empty."""
        import torch

        if min(m, k, n) == 0:
            return 0.0, 0.0
        if (m, k, n) not in self.measured:
            device, dtype = self.device, self.dtype
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            plain = self._timed(lambda: torch.mm(a, b, out=out))
            del out
            b_rows, out = b.T.contiguous(), torch.empty(n, m, device=device, dtype=dtype)  # (n, k) and (n, m) storage
            self.measured[(m, k, n)] = min(plain, self._timed(lambda: torch.mm(b_rows, a.T, out=out)))
            del a, b, b_rows, out
        return self.measured[(m, k, n)]

    def attention(self, batch, queries, keys) -> tuple[float, float]:
        """QK^T and AV of every head, one batched product each."""
        import torch

        key = ("attention", batch, queries, keys)
        if key not in self.measured:
            q = torch.randn(batch * self.heads, queries, self.head_dim, device=self.device, dtype=self.dtype)
            k = torch.randn(batch * self.heads, self.head_dim, keys, device=self.device, dtype=self.dtype)
            self.measured[key] = self._timed(lambda: (torch.bmm(q, k), torch.bmm(q, k)))
        return self.measured[key]

    def linear(self, tokens, fan_in, fan_out, pick, backward=False) -> float:
        seconds = self.product(tokens, fan_in, fan_out)[pick]  # Y = X W^T
        if backward:  # dX = dY W, dW = dY^T X
            seconds += self.product(tokens, fan_out, fan_in)[pick] + self.product(fan_out, tokens, fan_in)[pick]
        return seconds

    def trunk(self, tokens, pick, backward=False) -> float:
        return sum(self.linear(tokens, i, o, pick, backward) for i, o in self.linears) * self.layers

    def head(self, tokens, pick, backward=False) -> float:
        return self.linear(tokens, self.hidden, self.vocab, pick, backward)


def floor_seconds(shape: str, work: dict, prompt_len: int, device: str, repeats: int = 5) -> dict:
    """Time of the matrix products one GRPO step cannot avoid at the step's shapes, every completion full-length.

    Every product of the step (`Products`): each linear layer's forward Y = X W^T and, for the update, its
    backward dX = dY W and dW = dY^T X; the output projection over all completion positions at once (no
    chunking); attention's two batched products per layer. Returns the parts and their total (seconds) from each
    product's fastest timing, and under "<part>_median" the same sums of each product's median timing.
    """
    timer = Products(shape, work["precision"], device, repeats)
    rows, new, layers = work["prompts"] * work["group"], work["new_tokens"], timer.layers

    def parts(pick: int) -> dict:
        """The step's parts (seconds) from each product's fastest (pick 0) or median (pick 1) timing."""
        seq = prompt_len + new
        prefill = timer.trunk(work["prompts"] * prompt_len, pick) + timer.attention(work["prompts"], prompt_len,
                                                                                    prompt_len)[pick] * layers
        decode = (timer.trunk(rows, pick) + timer.head(rows, pick) + timer.attention(rows, 1, seq)[pick] * layers) * new
        train = (timer.trunk(rows * seq, pick, backward=True) + timer.head(rows * new, pick, backward=True)
                 + timer.attention(rows, seq, seq)[pick] * layers * 3)
        reference = (timer.trunk(rows * seq, pick) + timer.head(rows * new, pick)
                     + timer.attention(rows, seq, seq)[pick] * layers
                     if work["beta"] else 0.0)
        return {"sample": prefill + decode, "reference": reference, "update": train,
                "total": prefill + decode + train + reference}

    return {**parts(0), **{f"{part}_median": seconds for part, seconds in parts(1).items()}}


def real_token_floor(timer: Products, work: dict, prompt_lengths: list[int], completion_lengths: list[int],
                     pick: int = 0) -> dict:
    """The floor of one step's real tokens: `floor_seconds`'s products with no padding and no finished row.

    prompt_lengths, completion_lengths: (N,) real tokens of each row (rows grouped by prompt, G per prompt).
    Prefill: each distinct prompt's tokens once. Decode step t: the rows whose completion is longer than t, each
    attending to a prompt of the mean length and the t tokens before. Training and reference: the trunk over every row's
    real
    prompt and completion tokens packed together (no padding), the output projection over the real completion
    tokens, attention per row over its own length. Returns the parts and their total, from each product's fastest
    timing (pick 0) or its median (pick 1, `Products`).
    """
    group, layers = work["group"], timer.layers
    prompts = prompt_lengths[::group]
    prefill = timer.trunk(sum(prompts), pick) + sum(timer.attention(1, p, p)[pick] for p in prompts) * layers
    mean_prompt = round(sum(prompt_lengths) / len(prompt_lengths))
    decode = 0.0
    for step in range(max(completion_lengths)):
        active = sum(length > step for length in completion_lengths)
        decode += (timer.trunk(active, pick) + timer.head(active, pick)
                   + timer.attention(active, 1, mean_prompt + step + 1)[pick] * layers)
    tokens = sum(prompt_lengths) + sum(completion_lengths)
    generated = sum(completion_lengths)
    attention = sum(timer.attention(1, p + c, p + c)[pick] for p, c in zip(prompt_lengths, completion_lengths)) * layers
    train = timer.trunk(tokens, pick, backward=True) + timer.head(generated, pick, backward=True) + attention * 3
    reference = timer.trunk(tokens, pick) + timer.head(generated, pick) + attention if work["beta"] else 0.0
    return {"sample": prefill + decode, "reference": reference, "update": train,
            "total": prefill + decode + train + reference}


# ours: our defaults (--kernels auto: the compiled decode step on CUDA, the fused loss, ...); ours-plain: --kernels
# plain;
# ours-padded: --kernels auto without the real-length kernels (compaction, length grouping, packing, real-token
# trunk passes); ours-unshared: --kernels auto without the shared-prompt passes (grpo.kernels.prefix);
# ours-padded-trunk: --kernels auto with the shared-prompt passes on the padded layout (no grpo.kernels.unpadded).
SIDES = {"ours": "auto", "ours-plain": "plain", "ours-padded": "auto-padded", "ours-unshared": "auto-unshared",
         "ours-padded-trunk": "auto-padded-trunk", "trl": None}


def child(args):
    work = workload(args)
    with tempfile.TemporaryDirectory() as out:
        if args.child == "trl":
            result = run_trl(args.model_dir, work, args.steps, args.device, out)
        else:
            result = run_ours(args.model_dir, work, args.steps, args.device, out, kernels=SIDES[args.child],
                              profile=args.profile_file, chunk_size=args.chunk_size)
    print("RESULT " + json.dumps(result))


# --lengths: how completions end. full: a random-init model, EOS one token in 151,936, so every completion runs
# to the budget T; realistic and short: the model draws EOS at rate c / T per token (grpo.tiny_model.set_eos_rate),
# lengths geometric and cut at T (mean (1 - e^-c) T / c). realistic (c = 2.3): a mean near 40% of the budget, a wide
# spread,
# a tenth of the rows at the budget, like an early GSM8K run; short (c = 6.4): a mean near 16%, almost no row
# long, like late training. Both sides sample at temperature 1 from the same model: the same distribution.
LENGTHS = {"full": None, "realistic": 2.3, "short": 6.4}


def run_side(args, side: str, model_dir: str, profile_file: str | None = None) -> dict | None:
    """One run of one side in its own process; None (reported) if it failed or ran out of time. `profile_file`
    (ours only): where its extra profiled step writes (run_ours)."""
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("prompts", "group_size", "new_tokens", "micro_batch", "chunk_size") and v is not None]
    command = [sys.executable, __file__, "--child", side, "--model-dir", model_dir, "--shape", args.shape,
               "--device", args.device, "--steps", str(args.steps), *forwarded]
    if profile_file and side != "trl":
        command += ["--profile-file", profile_file]
    try:
        run = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, timeout=args.side_timeout)
    except subprocess.TimeoutExpired as stopped:
        print(f"{side} run stopped after {args.side_timeout} s:\n{_tail(stopped.stderr)}", flush=True)
        return None
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:  # reported, and the other runs go on
        print(f"{side} run failed (exit {run.returncode}):\n{_tail(run.stdout)}\n{_tail(run.stderr)}", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


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
    parser.add_argument("--chunk-size", type=int, help="our sides' logprob_chunk_size (rows of logits per chunk of "
                        "the log-prob passes; default: the trainer's)")
    parser.add_argument("--sides", default="ours,trl",
                        help=f"which trainers to run, comma-separated: {', '.join(SIDES)}")
    parser.add_argument("--lengths", default="full", help="completion lengths, comma-separated settings run side by "
                        f"side: {', '.join(LENGTHS)} (see LENGTHS in this file)")
    parser.add_argument("--side-timeout", type=float, default=None, help="seconds one run may take before it is "
                        "stopped and reported as failed (the other runs go on)")
    parser.add_argument("--profile", metavar="DIR", help="our runs each run one more step after the timed ones, its "
                        "reference and update passes under torch.profiler (not in the figures), and write where its "
                        "time goes to DIR/<lengths>-<side>-<round>.txt")
    parser.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--profile-file", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    from grpo.tiny_model import save_tiny_model

    work = workload(args)
    sides, settings = args.sides.split(","), args.lengths.split(",")
    unknown = [side for side in sides if side not in SIDES] + [name for name in settings if name not in LENGTHS]
    if unknown:
        parser.error(f"unknown side(s) or length setting(s) {unknown}; sides: {', '.join(SIDES)}; "
                     f"lengths: {', '.join(LENGTHS)}")
    runs = [(name, side) for name in settings for side in sides]
    results = {run: [] for run in runs}
    floors, round_ratios = [], {run: [] for run in runs}
    # (step time, its real-token floor, the same at median timings) per timed step
    real_floors = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as models:
        from transformers import AutoTokenizer

        from data import add_prompts, make_synthetic_gsm8k
        from grpo.generation.prompts import encode_prompt

        model_dirs = {}
        for name in settings:
            rate = None if LENGTHS[name] is None else LENGTHS[name] / work["new_tokens"]
            model_dirs[name] = str(save_tiny_model(Path(models) / name, args.shape, seed=0, eos_rate=rate))
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[settings[0]])
        prompt_len = max(len(encode_prompt(tokenizer, row["prompt"]))
                         for row in add_prompts(make_synthetic_gsm8k(64, seed=0)))
        for round_index in range(args.repeats):
            for name, side in runs:
                full_floor = side.startswith("ours") and name == "full"
                if full_floor:
                    floors.append(floor_seconds(args.shape, work, prompt_len, args.device))  # just before the run
                profile_file = (str(Path(args.profile).resolve() / f"{name}-{side}-{round_index}.txt")
                                if args.profile and side.startswith("ours") else None)
                result = run_side(args, side, model_dirs[name], profile_file)
                if result is None:
                    continue
                results[(name, side)].append(result)
                print(f"{name} {side} run: step times {', '.join(f'{t:.3f}' for t in result['step_times'])} s, "
                      f"tokens/step {', '.join(f'{n:.0f}' for n in result['tokens'])}, "
                      f"peak {result['peak_mib']:.0f} MiB"
                      + (f"; profile of one more step: {profile_file}" if profile_file else ""), flush=True)
                if side.startswith("ours"):  # the real-token floors, timed right after the run (the machine drifts)
                    timer = Products(args.shape, work["precision"], args.device)
                    for seconds, lengths in list(zip(result["step_times"], result["lengths"]))[args.untimed:]:
                        real_floors[(name, side)].append(
                            (seconds, *(real_token_floor(timer, work, lengths["prompt"], lengths["completion"], pick)
                                        for pick in (0, 1))))
                if full_floor:
                    floors.append(floor_seconds(args.shape, work, prompt_len, args.device))  # and just after it
                    around = (floors[-2]["total"] + floors[-1]["total"]) / 2
                    around_median = (floors[-2]["total_median"] + floors[-1]["total_median"]) / 2
                    step = statistics.median(result["step_times"][args.untimed:])
                    round_ratios[(name, side)].append((step / around, step, around, step / around_median))
    floor = {part: statistics.median(f[part] for f in floors) for part in floors[0]} if floors else None

    summary = {}
    for run, done in results.items():
        if not done:
            continue
        step_times = [t for r in done for t in r["step_times"][args.untimed:]]  # warm-up steps dropped
        tokens = [n for r in done for n in r["tokens"][args.untimed:]]
        step = statistics.median(step_times)
        summary[run] = {"step_s": step, "tokens_per_s": statistics.median(tokens) / step,
                        "peak_mib": statistics.median(r["peak_mib"] for r in done),
                        "mean_tokens": statistics.mean(tokens)}
    print(f"shape={args.shape} device={args.device} precision={work['precision']} prompts={work['prompts']} "
          f"G={work['group']} new_tokens={work['new_tokens']} micro_batch={work['micro_batch']} beta={work['beta']} "
          f"steps/run={args.steps} ({args.untimed} untimed) runs/side={args.repeats}, medians"
          + (f", our logprob_chunk_size={args.chunk_size}" if args.chunk_size else ""))
    for name in sorted(settings, key=lambda n: n != "full"):  # full first: the others compare with it
        rows = {side: summary[(name, side)] for side in sides if (name, side) in summary}
        rate = LENGTHS[name]
        print(f"\n[{name}] " + ("completions run to the budget" if rate is None else
                                f"EOS at rate {rate} / {work['new_tokens']} a token"))
        print(f"{'':18s} {'s/step':>9s} {'tokens/s':>10s} {'peak MiB':>10s} {'tokens/step':>12s}")
        for side, r in rows.items():
            print(f"{side:18s} {r['step_s']:9.3f} {r['tokens_per_s']:10.1f} {r['peak_mib']:10.0f} "
                  f"{r['mean_tokens']:12.0f}")
        ours_sides = [side for side in rows if side.startswith("ours")]
        if "trl" in rows:
            t = rows["trl"]
            for side in ours_sides:
                o = rows[side]
                print(f"{side + '/trl':18s} {o['step_s'] / t['step_s']:9.3f} "
                      f"{o['tokens_per_s'] / t['tokens_per_s']:10.2f} {o['peak_mib'] / t['peak_mib']:10.3f}   "
                      f"({side} steps/s = {t['step_s'] / o['step_s']:.2f} x trl's)")
        if name == "full" and floor and ours_sides:
            print(f"{'floor':18s} {floor['total']:9.3f}   (matmuls of one step at these shapes, measured here, each "
                  f"product's fastest timing; median of {len(floors)} measurements, before and after each of our runs)")
            print(f"{'median floor':18s} {floor['total_median']:9.3f}   (the same products, each at its median timing, "
                  "as our step is a median)")
        for side in ours_sides:
            full = summary.get(("full", side)) if name != "full" else None  # what this setting is compared with
            if full:
                tokens_ratio = rows[side]["mean_tokens"] / full["mean_tokens"]
                scaled = full["step_s"] * tokens_ratio
                rows[side]["vs_full_scaled"] = rows[side]["step_s"] / scaled
                print(f"{side + '/full scaled':18s} {rows[side]['vs_full_scaled']:9.3f}   "
                      "(our step / our full-length step "
                      f"x tokens ratio {tokens_ratio:.3f} = {scaled:.3f} s)")
            pairs = real_floors[(name, side)]
            if pairs:
                rows[side]["real_floor_ratio"] = statistics.median(seconds / f["total"] for seconds, f, _ in pairs)
                rows[side]["real_median_floor_ratio"] = statistics.median(seconds / f["total"] for seconds, _,
                                                                          f in pairs)
                parts = {part: statistics.median(f[part] for _, f, _ in pairs) for part in ("sample", "reference",
                                                                                            "update", "total")}
                rows[side]["real_floor"] = parts
                print(f"{side + '/real floor':18s} {rows[side]['real_floor_ratio']:9.3f}   "
                      "(median over timed steps of the "
                      f"step / its real-token floor; floor {parts['total']:.3f} s = {parts['sample']:.3f} sample + "
                      f"{parts['reference']:.3f} reference + {parts['update']:.3f} update)")
                print(f"{side + '/real median':18s} {rows[side]['real_median_floor_ratio']:9.3f}   "
                      "(the same against the "
                      "real-token floor of each product's median timing, as our step is a median)")
                if full and "real_floor" in full:  # how far the work itself follows the tokens
                    rows[side]["floor_vs_full_scaled"] = parts["total"] / (full["real_floor"]["total"] * tokens_ratio)
                    print(f"{'real floor/scaled':18s} {rows[side]['floor_vs_full_scaled']:9.3f}   (this floor / the "
                          f"full-length real-token floor x the tokens ratio: the same comparison for the work itself)")
            if name == "full" and floor:
                ratios = round_ratios[(name, side)]
                rows[side]["floor_ratio"] = statistics.median(r for r, _, _, _ in ratios)
                rows[side]["floor_median_ratio"] = statistics.median(r for _, _, _, r in ratios)
                print(f"{side + '/floor':18s} {rows[side]['floor_ratio']:9.3f}   (median over rounds of our step / the "
                      "floor around it; per round: "
                      f"{', '.join(f'{r:.3f} = {o:.3f}/{f:.3f}' for r, o, f, _ in ratios)})")
                print(f"{side + '/median floor':18s} {rows[side]['floor_median_ratio']:9.3f}   (the same against the "
                      f"floor of median timings; per round: {', '.join(f'{r:.3f}' for _, _, _, r in ratios)})")
        if ours_sides:
            print(f"per phase, s    {'sample':>8s} {'reference':>10s} {'update':>8s}")
            for side in ours_sides:
                phases = [ph for r in results[(name, side)] for ph in r["phases"][args.untimed:]]
                ours = rows[side]["phases"] = {part: statistics.median(ph[part] for ph in phases)
                                               for part in ("sample", "reference", "update")}
                print(f"{side:14s} {ours['sample']:8.3f} {ours['reference']:10.3f} {ours['update']:8.3f}")
            if name == "full" and floor:
                print(f"{'floor':14s} {floor['sample']:8.3f} {floor['reference']:10.3f} {floor['update']:8.3f}")
                print(f"{'median floor':14s} {floor['sample_median']:8.3f} {floor['reference_median']:10.3f} "
                      f"{floor['update_median']:8.3f}")
            real = rows[ours_sides[0]].get("real_floor")
            if real:
                print(f"{'real floor':14s} {real['sample']:8.3f} {real['reference']:10.3f} {real['update']:8.3f}")
    return {"summary": {f"{name}/{side}": value for (name, side), value in summary.items()}, "floor": floor,
            "runs": {f"{name}/{side}": done for (name, side), done in results.items()}}


def _tail(text, limit: int = 3000) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
    return text[-limit:]


if __name__ == "__main__":
    main()
