"""Sampler throughput: ours (the plain grpo.sampler.sample_groups and the grpo.kernels.sampling kernel) vs
transformers' model.generate, same model and prompts.

CPU default: the `small` shape (151,936 vocabulary), 4 prompts x G=4, 64 new tokens, fp32.
CUDA (`--device cuda`): the `qwen2.5-0.5b` shape in bf16, 64 prompts x G=8, 256 new tokens, eager and
with the compiled decode step. Every completion runs to the token budget (EOS never sampled: the
random-init model is given an EOS id outside its tokenizer), so both sides do the same work.

    python bench/sampler.py                 # CPU figures
    python bench/sampler.py --device cuda   # GPU figures
Also compares the per-step cost of next-token samplers at the full vocabulary (--samplers).
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
from grpo.sampler import SamplingParams, left_pad, sample_groups  # noqa: E402
from grpo.tiny_model import build_tiny_model  # noqa: E402


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
        "exponential noise (argmax p/q)": lambda: (torch.softmax(logits, -1) / torch.empty_like(logits).exponential_(generator=generator)).argmax(-1),
    }
    return {name: time_it(fn, "cpu", repeats) * 1e3 for name, fn in ways.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, help="default: small on CPU, qwen2.5-0.5b on CUDA")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samplers", action="store_true", help="also time next-token samplers alone")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    shape = args.shape or ("qwen2.5-0.5b" if cuda else "small")
    num_prompts = args.prompts or (64 if cuda else 4)
    group_size = args.group_size or (8 if cuda else 4)
    new_tokens = args.new_tokens or (256 if cuda else 64)
    dtype = torch.bfloat16 if cuda else torch.float32

    model, tokenizer = build_tiny_model(shape, seed=0)
    if cuda:
        use_packed_decode_attention(model)  # as grpo.generation.GroupSampler does with the compiled decode step
    model = model.to(args.device, dtype)
    rows = make_synthetic_gsm8k(num_prompts, seed=0)
    prompts = [tokenizer.apply_chat_template(build_prompt(r["question"]), add_generation_prompt=True, return_dict=False) for r in rows]
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
    return times


if __name__ == "__main__":
    main()
