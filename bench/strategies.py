"""What input-ignoring answers collect from HumanEval's cases: the best strategy per problem, replayed.

    python bench/strategies.py                                   # the cut of data/humaneval.py
    git show 0d79b6d:data/humaneval.py > /tmp/humaneval_0d79b6d.py
    python bench/strategies.py --cut /tmp/humaneval_0d79b6d.py   # the cut before the strategy family

Cuts the 164 problems into cases with the `humaneval_row` of the file --cut names (a copy of data/humaneval.py; the
current one by default), and times that. Then every strategy of each problem's family (data.strategies.
strategy_family: constants, call counts, alternating booleans, the docstring's outputs in order, every argument)
answers the problem's cases, replayed through the trusted test code in this process (data.strategies.replay; no
program runs, no sandbox), under
  (a) per-program state: one call count runs on across the problem's cases (one process for the whole problem)
  (b) fresh state per case: the count restarts at each case (the program imported anew for every case).
For each: the mean over the 164 problems of the best strategy's share of cases (a problem the cut leaves without a
case pays nothing), the problems above 0, the same for each sequence alone and for the best constant, and each
problem above 0 with the cases its best strategy passes (numbered from 0) and that strategy's name.

    python bench/strategies.py --sandbox                         # (c): every strategy as a program, sandboxed

(c) runs every strategy of every problem as a program (data.strategies.strategy_program) through the execution
reward itself (rewards.code.execution: the sandbox and its judge, two programs at once), so what it prints is what a
policy writing those programs would be paid.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.strategies import replay, strategy_family, strategy_program  # noqa: E402


def load_cut(path: Path):
    """The module at `path` (a version of data/humaneval.py), imported under its own name."""
    spec = importlib.util.spec_from_file_location(f"cut_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def passed_cases(row: dict, family: list, fresh_per_case: bool) -> dict[str, list[bool]]:
    """Each strategy's name -> which of the row's cases it passes."""
    return {strategy.name: replay(row, strategy, fresh_per_case) for strategy in family}


def share(passed: list[bool]) -> float:
    return sum(passed) / len(passed) if passed else 0.0  # a problem left without a case pays nothing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cut", type=Path, default=ROOT / "data" / "humaneval.py",
                        help="a version of data/humaneval.py whose humaneval_row cuts the cases")
    parser.add_argument("--sandbox", action="store_true",
                        help="also run every strategy as a program through the execution reward (minutes)")
    args = parser.parse_args(argv)
    cut = load_cut(args.cut)
    problems = cut._problems()
    start = time.perf_counter()
    rows = [cut.humaneval_row(problem) for problem in problems]
    seconds = time.perf_counter() - start
    print(f"cut {args.cut}: {len(problems)} problems in {seconds:.2f} s, {sum(len(r['tests']) for r in rows)} cases; "
          f"{sum(not row['tests'] for row in rows)} left without a case: "
          + (", ".join(row["task_id"] for row in rows if not row["tests"]) or "none"))
    families = [strategy_family(problem["prompt"], problem["test"]) for problem in problems]
    print(f"strategies per problem: {statistics.mean(map(len, families)):.1f} on average, {max(map(len, families))} "
          "at most")
    for label, fresh in (("(a) per-program state", False), ("(b) fresh state per case", True)):
        passed = [passed_cases(row, family, fresh) for row, family in zip(rows, families, strict=True)]
        best = [max(by_name.items(), key=lambda item: share(item[1])) for by_name in passed]  # the first of equals
        above = [(row, name, cases) for row, (name, cases) in zip(rows, best, strict=True) if share(cases) > 0]
        print(f"{label}: the best strategy's share of cases, mean over the {len(rows)} problems "
              f"{statistics.mean(share(cases) for _, cases in best):.4f}; {len(above)} problems above 0")
        for group, chosen in GROUPS.items():  # each sequence alone, and the best of a group, over all problems
            shares = [max((share(cases) for name, cases in by_name.items() if chosen(name)), default=0.0)
                      for by_name in passed]
            print(f"    {group}: mean {statistics.mean(shares):.4f}, {sum(s > 0 for s in shares)} problems above 0")
        for row, name, cases in above:
            print(f"  {row['task_id']}: {share(cases):.3f} ({sum(cases)} of {len(cases)} cases: "
                  f"{', '.join(str(index) for index, ok in enumerate(cases) if ok)}) by {name}")
    if args.sandbox:
        sandboxed(rows, families)
    return 0


def sandboxed(rows: list[dict], families: list) -> None:
    """(c): each problem's best strategy, every strategy run as a program through the execution reward."""
    from rewards.code import execution

    start, best = time.perf_counter(), []
    for row, family in zip(rows, families, strict=True):
        if not row["tests"]:
            best.append((0.0, "(no case)"))
            continue
        programs = [f"```python\n{strategy_program(row['entry_point'], strategy)}```" for strategy in family]
        columns = {key: [row[key]] * len(programs) for key in ("tests", "setup", "prompt_code", "entry_point")}
        scores = execution(None, programs, **columns)
        best.append(max(zip(scores, (strategy.name for strategy in family))))
    above = [(row["task_id"], score, name) for row, (score, name) in zip(rows, best, strict=True) if score > 0]
    print(f"(c) sandboxed, {sum(map(len, families))} programs in {time.perf_counter() - start:.0f} s: the best "
          f"strategy's reward, mean over the {len(rows)} problems {statistics.mean(s for s, _ in best):.4f}; "
          f"{len(above)} problems above 0"
          + "".join(f"\n  {task}: {score:.3f} by {name}" for task, score, name in above))


SEQUENCES = ("call count from 0", "call count from 1", "alternate True, False", "alternate False, True",
             "docstring outputs in order")
GROUPS = {**{name: name.__eq__ for name in SEQUENCES},
          "alternate, the better start": lambda name: name.startswith("alternate "),
          "an argument back, the best": lambda name: name.startswith("argument ") and name.endswith(" back"),
          "the best constant": lambda name: name.startswith("constant ")}


if __name__ == "__main__":
    sys.exit(main())
