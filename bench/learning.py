"""The learning experiment: GRPO makes a competent but flawed small model better on problems it has not seen.

    python bench/learning.py                                   # one seed, the default loss
    python bench/learning.py --loss-type dapo --beta 0
    python bench/learning.py --seeds 0 1 2 --loss-types grpo dapo --plot docs/learning.png   # the grid
    python bench/learning.py --seeds 0 1 2 --advantage-estimators grpo rloo reinforce_plus_plus_baseline opo

What it does, each step a command you can rerun on its own (they are printed):
1. Warm start. A random-init Qwen2 (`tiny`: the tiny tokenizer's 460-token vocabulary, hidden 64, 2 layers,
   about 0.1M parameters) is trained by supervised fine-tuning on worked solutions of the synthetic GSM8K-shaped task
   (data/synthetic.py, its `easy` scale), written in the R1 layout (`data.r1_completion`). The reasoning is always
   right, but in
   the `subtract` and `two_step` problems the final answer carries a systematic slip in --slip-rate of the
   examples: the last step's second operand (the amount given away, the cost) instead of its result. The model
   learns the format, the arithmetic and the habit: greedy decoding repeats the slip, while sampling writes the
   right number in about 1 - slip_rate of its tries. The right answer is within its reach; only a reward can
   tell it which of its two habits is right.
2. GRPO. train.py from that checkpoint with the GSM8K recipe's rewards (correctness, int, strict_format,
   soft_format, xmlcount) on other problems of the task (another seed).
3. Evaluation. eval.py, greedy, on held-out problems from a third seed (questions seen in steps 1 or 2 removed):
   strict accuracy (the number in <answer>), lenient accuracy (the last number) and format compliance, for the
   warm start and the trained model, in total and per problem kind.
4. The before/after table (stdout and OUT/results.json) and a plot: the runs' held-out accuracy and reward
   against the step (--plot), besides each run's own `python -m grpo.plot` curves.

Why this design: RL cannot add capacity. A warm start that has simply not learned the arithmetic does not gain
from GRPO; one whose right answer is a sample away can. docs/benchmarks.md ("Learning") has what the runs measured.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data import KINDS, build_prompt, make_synthetic_problems, r1_completion  # noqa: E402
from grpo.core.metrics import read_jsonl  # noqa: E402
from grpo.generation.prompts import encode_prompt  # noqa: E402

SLIP_KINDS = ("subtract", "two_step")


def problems(num_rows: int, seed: int, scale: str, kinds=KINDS) -> list[dict]:
    """`num_rows` seeded problems of the task (data.make_synthetic_problems), of the given kinds only."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be some of {KINDS}, got {list(kinds)}")
    drawn = make_synthetic_problems(math.ceil(num_rows * len(KINDS) / len(kinds) * 1.3) + 50, seed=seed, scale=scale)
    rows = [row for row in drawn if row["kind"] in kinds][:num_rows]
    if len(rows) < num_rows:
        raise RuntimeError(f"only {len(rows)} problems of kinds {list(kinds)} were drawn, {num_rows} asked for")
    return rows


def slipped_answer(row: dict) -> str:
    """The slip: the second operand of the solution's last step (`a - b = c` -> b), not its result."""
    last_step = re.sub(r"<<[^>]*>>", "", row["answer"].rsplit("####", 1)[0]).strip().splitlines()[-1]
    return re.findall(r"\d+", last_step)[1]


def warm_start_completions(rows: list[dict], slip_rate: float, seed: int) -> list[str]:
    """R1-layout solutions of `rows`; in SLIP_KINDS the final answer is slipped with probability slip_rate."""
    rng = random.Random(seed)
    return [r1_completion(row["answer"], slipped_answer(row) if row["kind"] in SLIP_KINDS and rng.random() < slip_rate
                          else None) for row in rows]


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The token ids train.py and eval.py give the model: the chat template over [system prompt, question]."""
    return encode_prompt(tokenizer, build_prompt(question))


def supervised_warm_start(model, tokenizer, rows: list[dict], completions: list[str], steps: int, batch_size: int,
                          learning_rate: float, seed: int, progress: bool = True) -> list[float]:
    """Next-token cross-entropy on the completion tokens (the prompt is context only); returns the losses.

    AdamW with a short linear warmup and a cosine decay; batches are drawn from a seeded permutation. Rows are
    right-padded and the pads carry no label, so the causal mask alone keeps them out of every real token's view.
    """
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    examples = [(prompt_ids(tokenizer, row["question"]), tokenizer(text, add_special_tokens=False).input_ids + [eos])
                for row, text in zip(rows, completions, strict=True)]
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(steps // 20, 1)
    model.train()
    losses = []
    for step in tqdm(range(steps), desc="warm start", disable=not progress):
        batch = [examples[order[(step * batch_size + i) % len(order)]] for i in range(batch_size)]
        width = max(len(p) + len(c) for p, c in batch)
        input_ids = torch.full((batch_size, width), pad)  # (b, t)
        labels = torch.full((batch_size, width), -100)  # (b, t): -100 = no loss
        for i, (prompt, completion) in enumerate(batch):
            input_ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            labels[i, len(prompt) : len(prompt) + len(completion)] = torch.tensor(completion)
        factor = min((step + 1) / warmup, 1.0) * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * factor
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def make_task(folder: Path, seed: int, num_train: int, num_heldout: int, seen: set[str], scale: str,
              kinds=KINDS) -> dict:
    """train.jsonl (GRPO's prompts) and test.jsonl (held-out: no question of the warm start or of train.jsonl)."""
    train = problems(num_train, 10_000 + seed, scale, kinds)
    seen = seen | {row["question"] for row in train}
    candidates = problems(40 * num_heldout, 20_000 + seed, scale, kinds)
    heldout = [row for row in candidates if row["question"] not in seen][:num_heldout]
    if len(heldout) < num_heldout:
        raise RuntimeError(f"only {len(heldout)} unseen held-out problems; lower --heldout")
    write_rows(folder / "train.jsonl", train)
    write_rows(folder / "test.jsonl", heldout)
    return {"train": len(train), "heldout": len(heldout),
            "heldout_kinds": {kind: sum(row["kind"] == kind for row in heldout) for kind in KINDS}}


def per_kind(samples_path: Path, heldout: list[dict]) -> dict:
    """Strict accuracy per problem kind from eval.py's per-sample records (in the held-out rows' order)."""
    records = read_jsonl(samples_path)
    scores = {}
    for kind in KINDS:
        chosen = [r["strict_accuracy"] for r, row in zip(records, heldout, strict=True) if row["kind"] == kind]
        scores[kind] = sum(chosen) / len(chosen) if chosen else math.nan
    return scores


def run_command(module, argv: list[str]) -> None:
    print("$ python " + Path(module.__file__).name + " " + " ".join(argv), flush=True)
    code = module.main(argv)
    if code != 0:
        raise RuntimeError(f"{Path(module.__file__).name} exited with {code}")


def warm_start(args, seed: int, folder: Path) -> tuple[Path, set[str]]:
    """Step 1: the supervised warm start, saved as a model folder train.py and eval.py load."""
    from grpo.tiny_model import build_tiny_model

    rows = problems(args.warm_start_rows, seed, args.scale, args.kinds)
    model_dir = folder / "warm_start"
    if (model_dir / "model.safetensors").is_file() and not args.fresh:
        print(f"warm start: reusing {model_dir}")
        return model_dir, {row["question"] for row in rows}
    torch.manual_seed(seed)
    model, tokenizer = build_tiny_model(args.shape, seed=seed)
    started = time.perf_counter()
    losses = supervised_warm_start(model, tokenizer, rows, warm_start_completions(rows, args.slip_rate, seed),
                                   args.warm_start_steps, args.warm_start_batch, args.warm_start_lr, seed)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    info = {"seconds": time.perf_counter() - started, "first_loss": losses[0], "last_loss": sum(losses[-20:]) / 20}
    (model_dir / "warm_start.json").write_text(json.dumps({**vars(args), **info}, indent=2, default=str))
    print(f"warm start: {args.warm_start_steps} steps in {info['seconds']:.0f} s, loss {losses[0]:.3f} -> "
          f"{info['last_loss']:.3f}")
    return model_dir, {row["question"] for row in rows}


def loss_of(loss_type: str | None, estimator: str) -> str:
    """The loss type a run trains with: the one asked for, else train.py's default for the estimator."""
    return loss_type or ("rloo" if estimator == "rloo" else "grpo")


def grpo_flags(args, loss_type: str | None, beta: float, seed: int, estimator: str = "grpo") -> list[str]:
    """The train.py flags of step 2 (everything else is train.py's default; an unset loss type is the estimator's)."""
    return [*(["--loss-type", loss_type] if loss_type else []), "--advantage-estimator", estimator,
            "--beta", str(beta), "--seed", str(seed),
            "--max-steps", str(args.grpo_steps), "--prompts-per-step", str(args.prompts_per_step),
            "--num-generations", str(args.num_generations), "--micro-batch-size", str(args.micro_batch_size),
            "--max-prompt-length", "128", "--max-completion-length", str(args.max_completion_length),
            "--learning-rate", str(args.grpo_lr), "--max-grad-norm", str(args.max_grad_norm),
            "--warmup-ratio", "0.05", "--lr-scheduler-type", args.lr_scheduler_type, "--weight-decay", "0.0",
            "--eval-steps", str(args.eval_steps), "--eval-limit", str(args.heldout), "--eval-batch-size", "100",
            "--save-steps", "0", "--log-completions-steps", "20", "--logging-steps", "10",
            "--device", "cpu", "--precision", "fp32", "--overwrite"]


def run_one(args, seed: int, loss_type: str | None, beta: float, model_dir: Path, task: Path, folder: Path,
            estimator: str = "grpo") -> dict:
    """Steps 2 and 3 for one loss and estimator: GRPO from the warm start, then eval.py on the warm start and the
    result."""
    import eval as eval_cli
    import train as train_cli

    label = loss_of(loss_type, estimator)
    run_dir = folder / (f"grpo-{label}-beta{beta:g}" + ("" if estimator == "grpo" else f"-{estimator}"))
    run_command(train_cli, ["--model", str(model_dir), "--dataset", str(task), "--output-dir", str(run_dir),
                            *grpo_flags(args, loss_type, beta, seed, estimator)])
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    eval_dir = run_dir / "heldout_eval"
    run_command(eval_cli, ["--model", str(model_dir), "--compare", str(final), "--dataset", str(task),
                           "--split", "test", "--max-completion-length", str(args.max_completion_length),
                           "--batch-size", "100", "--device", "cpu", "--output-dir", str(eval_dir)])
    heldout = read_jsonl(task / "test.jsonl")
    result = {"seed": seed, "loss_type": label, "estimator": estimator, "beta": beta, "run_dir": str(run_dir)}
    for label, path in (("before", model_dir), ("after", final)):
        stem = eval_cli.output_stem(str(path))
        summary = json.loads((eval_dir / f"{stem}.summary.json").read_text())
        result[label] = {key: summary[key] for key in ("strict_accuracy", "lenient_accuracy", "format_compliance",
                                                       "mean_length")}
        result[label]["strict_by_kind"] = per_kind(eval_dir / f"{stem}.samples.jsonl", heldout)
    result["lift"] = result["after"]["strict_accuracy"] - result["before"]["strict_accuracy"]
    return result


def print_table(results: list[dict]) -> None:
    print(f"\n{'seed':>4} {'estimator':>28} {'loss':>6} {'beta':>5} | {'strict':>13} {'lift':>6} | "
          f"{'lenient':>13} | {'format':>13} | "
          + " ".join(f"{kind:>13}" for kind in KINDS))
    for r in results:
        b, a = r["before"], r["after"]
        cells = " ".join(f"{b['strict_by_kind'][k]:5.2f} -> {a['strict_by_kind'][k]:4.2f}" for k in KINDS)
        print(f"{r['seed']:>4} {r.get('estimator', 'grpo'):>28} {r['loss_type']:>6} {r['beta']:>5g} | "
              f"{b['strict_accuracy']:5.3f} -> {a['strict_accuracy']:5.3f}"
              f" {r['lift']:+6.3f} | {b['lenient_accuracy']:5.3f} -> {a['lenient_accuracy']:5.3f} | "
              f"{b['format_compliance']:5.3f} -> {a['format_compliance']:5.3f} | {cells}")


def plot_results(results: list[dict], output: Path) -> None:
    """Held-out strict accuracy (from the runs' periodic evaluation) and mean reward against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo.plot import moving_average, read_metrics, series

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    colours = {}
    for r in results:
        label = f"{r['loss_type']} beta={r['beta']:g}" + ("" if r.get("estimator",
                                                                      "grpo") == "grpo" else f" {r['estimator']}")
        colour = colours.setdefault(label, f"C{len(colours)}")
        records = read_metrics(r["run_dir"])
        steps, values = series(records, "eval/strict_accuracy")
        left.plot(steps, values, color=colour, marker="o", markersize=3, alpha=0.8,
                  label=label if label not in left.get_legend_handles_labels()[1] else None)
        steps, values = series(records, "reward")
        right.plot(steps, moving_average(values, 10), color=colour, alpha=0.8)
    left.set(title="held-out strict accuracy (greedy)", xlabel="GRPO step", ylabel="accuracy", ylim=(0, 1))
    right.set(title="mean reward (moving average of 10 steps)", xlabel="GRPO step", ylabel="reward")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    left.legend(fontsize=8)
    seeds = sorted({r["seed"] for r in results})
    figure.suptitle(f"GRPO from a warm start with a systematic slip (seeds {seeds})", fontsize=10)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=80)
    plt.close(figure)
    print(f"wrote {output}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/learning", help="experiment folder (one subfolder per seed)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds: warm start, task and GRPO")
    parser.add_argument("--loss-types", nargs="+", default=[None],
                        help="GRPO loss types, each a run (default: train.py's "
                        "for the estimator: rloo with rloo, else grpo)")
    parser.add_argument("--advantage-estimators", nargs="+", default=["grpo"],
                        help="advantage estimators (train.py's --advantage-estimator), each a run with each loss type")
    parser.add_argument("--loss-type", dest="loss_types", nargs=1, help="one loss type (as train.py)")
    parser.add_argument("--beta", type=float, default=None, help="KL coefficient (default 0.04; dapo: 0, as DAPO)")
    parser.add_argument("--shape", default="tiny", help="grpo/tiny_model.py shape of the warm-started model")
    parser.add_argument("--scale", default="easy", help="data/synthetic.py number scale of the problems")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="problem kinds of the task")
    parser.add_argument("--slip-rate", type=float, default=0.8, help="share of slipped answers in the slip kinds")
    parser.add_argument("--warm-start-rows", type=int, default=8_000)
    parser.add_argument("--warm-start-steps", type=int, default=600)
    parser.add_argument("--warm-start-batch", type=int, default=32)
    parser.add_argument("--warm-start-lr", type=float, default=5e-3)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--grpo-lr", type=float, default=5e-4)
    parser.add_argument("--lr-scheduler-type", default="cosine", help="train.py's learning-rate schedule")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--train-rows", type=int, default=2000, help="GRPO's training problems")
    parser.add_argument("--heldout", type=int, default=200, help="held-out problems evaluated")
    parser.add_argument("--eval-steps", type=int, default=20, help="held-out evaluation every N GRPO steps")
    parser.add_argument("--fresh", action="store_true", help="redo warm starts found in --out")
    parser.add_argument("--plot", default=None,
                        help="also write the accuracy/reward figure here (default OUT/learning.png)")
    return parser.parse_args(argv)


def run_experiment(args) -> list[dict]:
    results = []
    for seed in args.seeds:
        folder = Path(args.out) / f"seed{seed}"
        model_dir, seen = warm_start(args, seed, folder)
        task = folder / "task"
        print(f"task: {json.dumps(make_task(task, seed, args.train_rows, args.heldout, seen, args.scale, args.kinds))}")
        for estimator in args.advantage_estimators:
            for loss_type in args.loss_types:
                beta = args.beta if args.beta is not None else (0.0 if loss_type == "dapo" else 0.04)
                results.append(run_one(args, seed, loss_type, beta, model_dir, task, folder, estimator))
                print_table(results[-1:])
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    started = time.perf_counter()
    results = run_experiment(args)
    print_table(results)
    lifts = [r["lift"] for r in results]
    print(f"\nlift in held-out strict accuracy: min {min(lifts):+.3f}, mean {sum(lifts) / len(lifts):+.3f} over "
          f"{len(lifts)} run(s); {time.perf_counter() - started:.0f} s in all")
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot_results(results, Path(args.plot) if args.plot else out / "learning.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
