"""The lines one training step runs: coverage over the product (grpo/, rewards/, data/, train.py) while the
smoke preset's trainer takes one step, set-up excluded.

    python bench/step_trace.py                     # --kernels plain: the table, the totals, the kernel imports
    python bench/step_trace.py --kernels auto      # the same with the kernels
    python bench/step_trace.py --lines             # also each file's executed line numbers
    python bench/step_trace.py --check-readme      # exit 1 unless README.md's step table is this trace
    python bench/step_trace.py --loop              # the whole loop instead: train() for 2 steps, final save included

One step is `Trainer.train_step()` (sample -> reward -> advantages -> reference/old log-probs -> micro-batches
-> clip -> optimizer -> metrics) and the metrics line it logs; evaluation and checkpoints, which run every
eval_steps / save_steps, are not in it. A first step runs untraced, so one-time work (lazy imports, caches) is
not counted. The README's table "One step, file by file" is this script's `--markdown` output; tests/test_docs.py
checks that they agree. Also printed: the grpo.kernels modules the whole run imported (none under plain).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("grpo", "rewards", "data")
TABLE_TITLE = "One step, file by file"
# issues #40, #62: a plain step a reader can follow, in lines of <= 120 characters; #63 added trl's metrics the step
# lacked (clip_ratio/low_min and high_max, terminated lengths, num_tokens), the data-order seam and the repetition
# penalty's branches in the sampler (+15), the rollout's tensors set up by one function that trl's evaluation
# shares (+2), trl's pad_to_multiple_of in micro_batch (+2) and the advantages the completions table shows (+3)
LINE_BUDGET, FILE_BUDGET = 502, 12
LOOP_BUDGET = 695  # issue #62: the whole loop, train() for 2 steps with its final save (#63: the hooks, as above,
# and the completions a caller's hook takes after each step, +2)
# The files of one step in the order a reader meets them, and what each holds (the README's table; a file the
# trace finds that is not listed comes last, with no description, and the README check then fails).
READER_ORDER = {
    "grpo/core/trainer.py": "`Trainer.train_step`: sample and reward this rank's prompts, then update",
    "grpo/generation/rollout.py": "the step's prompts, seeded noise, the generation seam, `sample_rollout`, `Rollout`",
    "grpo/algorithm/sampler.py": "`sample_groups`: each prompt prefilled once, G completions decoded with a KV cache",
    "rewards/scoring.py": "each reward function called safely: (N, K) rewards",
    "rewards/toy.py": "the smoke preset's reward (`tags`)",
    "grpo/core/update.py": "`train_on_rollout`: reference log-probs, the estimator's batch, micro-batches -> loss -> "
                           "backward, clip, AdamW, LR",
    "grpo/algorithm/advantages.py": "weighted rewards, the estimator seam, group-relative advantages (grpo)",
    "grpo/algorithm/step.py": "the update's plain functions: log-probs -> per-token loss -> aggregation, micro-batches",
    "grpo/algorithm/logprobs.py": "per-token log-probs and entropies, chunked output projection",
    "grpo/algorithm/loss.py": "the per-token objective (`clipped_objective`), masks and k3 KL, the aggregation, the "
                              "logged statistics",
    "grpo/parallel/distributed.py": "the collectives (identities at world size one), the model call",
    "grpo/core/metrics.py": "the step's metrics (trl's names) and its line in metrics.jsonl",
}


def trace_step(kernels: str = "plain", loop: bool = False) -> dict[str, list[int]]:
    """{product file (relative path): executed line numbers} of one smoke-preset step under `kernels`; with `loop`, of
    the whole loop instead: `Trainer.train()` for 2 steps (its final evaluation and save included)."""
    import coverage

    sys.path.insert(0, str(ROOT))
    from grpo.cli import PRESETS
    from grpo.config import GRPOConfig
    from grpo.core.metrics import MetricsLogger
    from grpo.core.trainer import Trainer

    with tempfile.TemporaryDirectory() as folder:
        settings = {**PRESETS["smoke"], "kernels": kernels, "output_dir": folder}
        if loop:
            settings.update(max_steps=2, eval_steps=0)
        trainer = Trainer(GRPOConfig(**settings))
        logger = MetricsLogger(folder)
        if not loop:
            trainer.train_step()  # untraced: one-time work is set-up
        include = [str(ROOT / package / "*") for package in PRODUCT] + [str(ROOT / "train.py")]
        tracer = coverage.Coverage(data_file=None, include=include)
        tracer.start()
        try:
            if loop:
                trainer.train()
            else:
                output = trainer.train_step()
                logger.log(trainer.step, output.metrics, console=False)
        finally:
            tracer.stop()
        logger.close()
        data = tracer.get_data()
        trace = {str(Path(path).relative_to(ROOT)): sorted(data.lines(path)) for path in data.measured_files()
                 if data.lines(path)}
    rank = {path: index for index, path in enumerate(READER_ORDER)}
    return dict(sorted(trace.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def markdown(trace: dict[str, list[int]]) -> str:
    """The README's table: one row per file, in the order a reader meets them, with its executed lines."""
    rows = ["| file | lines run | what it holds |", "|---|---|---|"]
    rows += [f"| `{path}` | {len(lines)} | {READER_ORDER.get(path, '')} |" for path, lines in trace.items()]
    rows.append(f"| {len(trace)} files | {sum(len(lines) for lines in trace.values())} | |")
    return "\n".join(rows)


def readme_table(readme: str) -> str:
    section = readme.split(f"## {TABLE_TITLE}", 1)
    if len(section) < 2:
        raise SystemExit(f"README.md has no section '## {TABLE_TITLE}'")
    return "\n".join(line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("|"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="plain", choices=["plain", "auto"])
    parser.add_argument("--lines", action="store_true", help="print each file's executed line numbers")
    parser.add_argument("--markdown", action="store_true", help="print the README's table only")
    parser.add_argument("--check-readme", action="store_true", help="exit 1 unless README.md's table is this trace")
    parser.add_argument("--loop", action="store_true", help="trace the whole loop (train() for 2 steps) instead")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trace = trace_step(args.kernels, args.loop)
    if args.loop:
        total = sum(len(lines) for lines in trace.values())
        for path, lines in trace.items():
            print(f"{len(lines):5d}  {path}" + (f"  {lines}" if args.lines else ""))
        print(f"{total} lines in {len(trace)} files: the whole loop, 2 steps and the final save (--kernels "
              f"{args.kernels}; budget for plain: {LOOP_BUDGET} lines)")
        return 1 if args.kernels == "plain" and total > LOOP_BUDGET else 0
    table = markdown(trace)
    if args.markdown:
        print(table)
        return 0
    for path, lines in trace.items():
        print(f"{len(lines):5d}  {path}" + (f"  {lines}" if args.lines else ""))
    total = sum(len(lines) for lines in trace.values())
    kernel_modules = sorted(name for name in sys.modules if name == "grpo.kernels" or name.startswith("grpo.kernels."))
    print(f"{total} lines in {len(trace)} files (--kernels {args.kernels}; budget for plain: {LINE_BUDGET} lines "
          f"in {FILE_BUDGET} files)")
    print(f"grpo.kernels modules imported by the run: {', '.join(kernel_modules) or 'none'}")
    failed = []
    if args.kernels == "plain" and (total > LINE_BUDGET or len(trace) > FILE_BUDGET):
        failed.append("over the budget")
    if args.kernels == "plain" and kernel_modules:
        failed.append("--kernels plain imported grpo.kernels")
    if args.check_readme and readme_table((ROOT / "README.md").read_text()) != table:
        failed.append(f"README.md's table '{TABLE_TITLE}' is not this trace (python bench/step_trace.py --markdown)")
    for problem in failed:
        print("FAILED:", problem)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
