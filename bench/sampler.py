"""Sampler throughput: ours (the plain grpo.algorithm.sampler.sample_groups and the grpo.kernels.sampling kernel) vs
transformers' model.generate, same model and prompts.

CPU default: the `small` shape (151,936 vocabulary), 4 prompts x G=4, 64 new tokens, fp32.
CUDA (`--device cuda`): the `qwen2.5-0.5b` shape in bf16, 64 prompts x G=8, 256 new tokens, eager and
with the compiled decode step. Every completion runs to the token budget (EOS never sampled: the
random-init model is given an EOS id outside its tokenizer), so both sides do the same work.

    python bench/sampler.py                 # CPU figures
    python bench/sampler.py --device cuda   # GPU figures
Also compares the per-step cost of next-token samplers at the full vocabulary (--samplers), times the CPU
decode head's product at each row count from 1 to N (--head-rows: how a step's cost follows the rows still
decoding), and splits the kernel sampler's time into its parts with completions that end at an EOS rate of
c / T a token (--phases c, as bench/trainer.py's --lengths: 2.3 realistic, 6.4 short).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from data.synthetic import make_synthetic_gsm8k  # noqa: E402
from data.prompts import build_prompt  # noqa: E402
from grpo.kernels.compiled_decode import use_packed_decode_attention  # noqa: E402
from grpo.kernels.sampling import FastSampler, _sample_base2, sample_next_token  # noqa: E402
from grpo.algorithm.sampler import SamplingParams, left_pad, sample_groups  # noqa: E402
from grpo.tiny_model import IM_END, build_tiny_model, set_eos_rate  # noqa: E402


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_it(fn, device, repeats):
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sampler_costs(vocab_size: int, rows: int, repeats: int = 20) -> dict[str, float]:
    """Median ms per decode step of several ways to draw one token per row from (rows, V) logits."""
    logits = torch.randn(rows, vocab_size)
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(rows, 128), torch.randn(vocab_size, 128)
    out, out_t = torch.empty(rows, vocab_size), torch.empty(vocab_size, rows)
    logits_t = logits.T.contiguous().T  # the same logits in (V, N) storage, as our CPU decode head writes them
    weights_t = torch.empty_like(logits_t)
    ways = {
        "output projection h W^T (hidden 128), (N, V) storage": lambda: torch.mm(hidden, weight.T, out=out),
        "output projection W h^T (hidden 128), (V, N) storage": lambda: torch.mm(weight, hidden.T, out=out_t),
        "ours: inverse CDF, (N, V) storage": lambda: sample_next_token(logits, 1.0, generator=generator),
        "ours: inverse CDF, (V, N) storage": lambda: sample_next_token(logits_t, 1.0, generator=generator),
        # the decode loop's CPU step: the projection wrote z log2(e) / T - c, so no max and no shift pass
        "ours: shifted base-2 step, (V, N) storage": lambda: _sample_base2(
            logits_t, torch.rand(rows, 1, generator=generator), out=weights_t),
        "torch.multinomial(softmax)": lambda: torch.multinomial(torch.softmax(logits, -1), 1, generator=generator),
        "exponential noise (argmax p/q)": lambda: (
            torch.softmax(logits, -1) / torch.empty_like(logits).exponential_(generator=generator)).argmax(-1),
    }
    return {name: time_it(fn, "cpu", repeats) * 1e3 for name, fn in ways.items()}


def head_costs(weight: torch.Tensor, max_rows: int, repeats: int = 7) -> dict[int, float]:
    """Median ms of the CPU decode head's product at each row count n = 1..max_rows: the (V, n) logits
    W h^T - shift, as grpo.kernels.sampling._DecodeHead forms them, into a preallocated buffer; the row
    counts interleaved repeat by repeat."""
    hidden = {n: torch.randn(n, weight.shape[1]) for n in range(1, max_rows + 1)}
    out = {n: torch.empty(weight.shape[0], n) for n in hidden}
    shift = {n: torch.zeros(1, n) for n in hidden}
    times = {n: [] for n in hidden}
    with torch.inference_mode():
        for _ in range(repeats):
            for n in hidden:
                times[n].append(time_it(lambda: torch.addmm(shift[n], weight, hidden[n].T, alpha=1.44, out=out[n]),
                                        "cpu", 1) * 1e3)
    return {n: statistics.median(values) for n, values in times.items()}


def decode_phases(model, tokenizer, prompts, group_size: int, new_tokens: int, rate: float, repeats: int) -> dict:
    """The kernel sampler's time per call split into its parts, eager CPU decoding, completions ending at an EOS
    rate of `rate` / new_tokens a token (set_eos_rate on a copy of the model): the trunk's decode steps, the head's
    products, sampling (exp2, block sums, the draw), compaction of the KV cache, the prefill's projection and the
    rest (the prefill's trunk, the loop's own operations). Each part's time is summed over its calls by wrapping
    the function that does it; the first call is warm-up. Returns ms per call and the mean rows a decode step."""
    import copy
    import functools

    import grpo.kernels.sampling as fast
    from grpo.kernels.lean_decode import LeanDecodeStep

    model = copy.deepcopy(model)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    set_eos_rate(model, rate / new_tokens, eos)
    params = SamplingParams(max_completion_length=new_tokens, temperature=1.0, eos_token_ids=(eos,))
    spent, rows = {}, []
    parts = {"decode trunk (lean step)": (LeanDecodeStep, "__call__"), "head product": (fast._DecodeHead, "project"),
             "sampling (exp2, sums, draw)": (fast, "_sample_base2"), "prefill projection": (fast._DecodeHead, "expand"),
             "compaction (KV cache)": (fast._ReservedLayer, "batch_select_indices")}

    def timed(label, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
            if label == "head product":
                rows.append(args[1].shape[0])  # (n, H) hidden states: the rows of this step
            return result
        return run

    originals = {label: getattr(owner, name) for label, (owner, name) in parts.items()}
    sampler, total = FastSampler(), 0.0
    try:
        for label, (owner, name) in parts.items():
            setattr(owner, name, timed(label, originals[label]))
        for attempt in range(repeats + 1):
            if attempt == 1:  # the first call was warm-up
                spent.clear()
                rows.clear()
                total = 0.0
            start = time.perf_counter()
            result = sampler.sample_groups(model, prompts, group_size, params, tokenizer.pad_token_id,
                                           generator=torch.Generator().manual_seed(attempt))
            total += time.perf_counter() - start
    finally:
        for label, (owner, name) in parts.items():
            setattr(owner, name, originals[label])
    per_call = {label: seconds / repeats * 1e3 for label, seconds in spent.items()}
    per_call["rest"] = total / repeats * 1e3 - sum(per_call.values())
    return {"ms": per_call, "total_ms": total / repeats * 1e3, "mean_rows": sum(rows) / max(len(rows), 1),
            "steps": len(rows) / repeats, "tokens": int(result.completion_mask.sum())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, help="default: small on CPU, qwen2.5-0.5b on CUDA")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samplers", action="store_true", help="also time next-token samplers alone")
    parser.add_argument("--head-rows", action="store_true", help="also time the CPU decode head's product at each "
                        "row count up to the batch's")
    parser.add_argument("--phases", type=float, metavar="C", help="also split the kernel sampler's CPU time into its "
                        "parts, completions ending at an EOS rate of C / new tokens")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    shape = args.shape or ("qwen2.5-0.5b" if cuda else "small")
    num_prompts = args.prompts or (64 if cuda else 4)
    group_size = args.group_size or (8 if cuda else 4)
    new_tokens = args.new_tokens or (256 if cuda else 64)
    dtype = torch.bfloat16 if cuda else torch.float32

    model, tokenizer = build_tiny_model(shape, seed=0)
    if cuda:
        use_packed_decode_attention(model)  # as grpo.generation.rollout.GroupSampler does with the compiled decode step
    model = model.to(args.device, dtype)
    rows = make_synthetic_gsm8k(num_prompts, seed=0)
    prompts = [tokenizer.apply_chat_template(build_prompt(r["question"]), add_generation_prompt=True,
                                             return_dict=False) for r in rows]
    never = model.config.vocab_size - 1  # an id the tokenizer never produces: completions run to the budget
    pad = tokenizer.pad_token_id
    params = SamplingParams(max_completion_length=new_tokens, temperature=1.0, eos_token_ids=(never,))
    ids, mask = left_pad(prompts, pad, args.device)
    total_tokens = num_prompts * group_size * new_tokens

    kernel = FastSampler()

    def ours(**kwargs):
        return lambda: kernel.sample_groups(model, prompts, group_size, params, pad, **kwargs)

    def hf_generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=group_size,
                           pad_token_id=pad, eos_token_id=never)

    contenders = {"model.generate": hf_generate,
                  "ours, plain": lambda: sample_groups(model, prompts, group_size, params, pad),
                  "ours, kernel (eager)": ours()}
    if cuda:
        contenders["ours (static cache + compiled decode)"] = ours(compile_decode=True)
        contenders["ours (static cache + compiled decode)"]()  # compile / capture outside the timing
    for fn in contenders.values():
        fn()  # warm-up
    # Alternate the contenders repeat by repeat so drifts in machine load hit all of them alike.
    times = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            times[name].append(time_it(fn, args.device, 1))
    base = statistics.median(times["model.generate"])
    print(f"device={args.device} shape={shape} dtype={dtype} prompts={num_prompts} G={group_size} "
          f"new_tokens={new_tokens} repeats={args.repeats} (median)")
    print(f"{'sampler':42s} {'s/call':>8s} {'tokens/s':>10s} {'vs generate':>12s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:42s} {median:8.3f} {total_tokens / median:10.0f} {base / median:11.2f}x")
    if args.samplers and not cuda:
        print(f"\nper decode step at V={model.config.vocab_size}, {num_prompts * group_size} rows (median ms):")
        for name, ms in sampler_costs(model.config.vocab_size, num_prompts * group_size).items():
            print(f"  {name:44s} {ms:7.3f}")
    if args.head_rows and not cuda:
        costs = head_costs(model.get_output_embeddings().weight.detach(), num_prompts * group_size)
        print(f"\ndecode head product W h^T - shift at V={model.config.vocab_size}, median ms by rows:")
        print("  " + "  ".join(f"{n}: {ms:.2f}" for n, ms in costs.items()))
    if args.phases and not cuda:
        split = decode_phases(model, tokenizer, prompts, group_size, new_tokens, args.phases, args.repeats)
        print(f"\nthe kernel sampler's parts at EOS rate {args.phases} / {new_tokens} a token: "
              f"{split['total_ms']:.1f} ms "
              f"a call, {split['tokens']} tokens in the last, {split['steps']:.1f} decode steps a call, "
              f"{split['mean_rows']:.1f} rows a step on average")
        for label, ms in split["ms"].items():
            print(f"  {label:30s} {ms:8.1f} ms")
    return times


if __name__ == "__main__":
    main()
