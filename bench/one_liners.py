"""What generic one-line bodies collect from HumanEval's cases: the trivial-program check of the code reward.

    python bench/one_liners.py [--problems 164] [--show 15]

Each body of BODIES (at least 100 generic expressions of the arguments `a`, `b`, `c`: `sorted(a)`, `len(a)`,
`a + b`, `max(a, key=len)`, `a != b`, ...) is the whole program for every problem whose function takes that many
arguments or more, replayed in this process through the trusted test code (no sandbox: the bodies are ours): the
problem's check cases (data/humaneval.py) and its generated groups (data/humaneval_cases.py), scored as the
execution reward scores them (rewards.code.case_reward: 1.0 for every case passed, else PARTIAL_CREDIT times the
share). For each problem, the best body's reward is split in two:

    agrees     the best body that passes every generated group: it agrees with the canonical solution on all of the
               mutated inputs (`len` for strlen: a one-liner that solves the problem)
    forgery    the best body that fails a generated group: the generated cases show it wrong, yet it is paid

and the means over the problems, the problems whose forgery passes 0.2, and the top forgeries are printed; the same
for the share of cases passed (what the reward paid before case_reward), which measures the cases alone.
    --check-only   the checks' cases alone, as before data/humaneval_cases.py (forgery: a body the generated
                   cases show wrong)
"""

from __future__ import annotations

import argparse
import math
import resource
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.humaneval import _problems, humaneval_row  # noqa: E402
from data.humaneval_cases import decode_group  # noqa: E402
from data.strategies import prompt_arity, replay_program  # noqa: E402
from rewards.code import case_reward  # noqa: E402
from rewards.judge import same_output  # noqa: E402

BODIES_1 = [
    "a", "sorted(a)", "sorted(a, reverse=True)", "len(a)", "a[::-1]", "sum(a)", "min(a)", "max(a)", "a[0]", "a[-1]",
    "set(a)", "list(set(a))", "sorted(set(a))", "len(set(a))", "a.upper()", "a.lower()", "a.swapcase()", "a.split()",
    "a.strip()", "a.title()", "a.capitalize()", "len(a.split())", "a == a[::-1]", "bool(a)", "not a", "a % 2 == 0",
    "a % 2 == 1", "a + 1", "a - 1", "a * 2", "a // 2", "a / 2", "a ** 2", "abs(a)", "-a", "str(a)", "int(a)",
    "round(a)", "float(a)", "a > 0", "a < 0", "a == 0", "a[1:]", "a[:-1]", "any(a)", "all(a)", "list(range(a))",
    "sum(range(a))", "sum(range(a + 1))", "max(a, key=len)", "min(a, key=len)", "sorted(a, key=len)",
    "[x for x in a if x > 0]", "[x for x in a if x % 2 == 0]", "[x for x in a if x % 2 == 1]", "[x * 2 for x in a]",
    "sum(x * x for x in a)", "sum(x for x in a if x > 0)", "sum(a) / len(a)", "sorted(a)[len(a) // 2]",
    "a.count(a[0])", "' '.join(a)", "''.join(a)", "''.join(sorted(a))", "' '.join(sorted(a))", "a.split(',')",
    "len(a) % 2 == 0", "a.isupper()", "a.islower()", "a.isdigit()", "a.isalpha()", "a[0].isupper()",
    "sorted(a) == a", "len(a) == len(set(a))", "a.count(' ')", "sum(map(int, str(a)))", "str(a)[::-1]",
    "int(str(a)[::-1])", "bin(a)[2:]", "a * (a + 1) // 2", "math.factorial(a)", "a ** 0.5", "math.isqrt(a)",
    "a.replace(' ', '')", "[len(x) for x in a]", "list(reversed(a))", "a + a", "a * a", "max(a) - min(a)",
    "[]", "sorted(a, key=abs)", "[x for x in a if x]", "a.count('a')", "len([x for x in a if x in 'aeiouAEIOU'])",
    "a[len(a) // 2]", "a and a[0]", "str(a).count('7')", "a.endswith('?')", "a.startswith(' ')",
]
BODIES_2 = [
    "b", "a + b", "a - b", "b - a", "a * b", "a // b", "a / b", "a % b", "a ** b", "max(a, b)", "min(a, b)",
    "a == b", "a != b", "a < b", "a > b", "a <= b", "a >= b", "a in b", "b in a", "a.startswith(b)", "a.endswith(b)",
    "a.count(b)", "a.split(b)", "b.join(a)", "a.replace(b, '')", "[x for x in a if b in x]",
    "[x for x in a if x.startswith(b)]", "[x for x in a if x != b]", "[x for x in a if x == b]",
    "sorted(a)[:b]", "sorted(a)[-b:]", "a[:b]", "a[b:]", "a[b]", "a.find(b)", "sorted(a + b)",
    "sorted(set(a) & set(b))", "sorted(set(a) | set(b))", "len(a) + len(b)", "[b] * a", "sum(a) <= b",
    "abs(a - b)", "math.gcd(a, b)", "(a + b) / 2", "a if len(a) >= len(b) else b", "a if len(a) <= len(b) else b",
    "sorted(a) == sorted(b)", "set(a) == set(b)", "list(range(a, b))", "list(range(a, b + 1))", "a * len(b)",
    "[x + b for x in a]", "[x * b for x in a]", "a.index(b) if b in a else -1", "b * a", "str(a) + str(b)",
    "a[-b:] + a[:-b]", "sum(a[:b])", "a + [b]", "a.count(b) > 0",
]
BODIES_3 = [
    "c", "a + b + c", "a * b * c", "max(a, b, c)", "min(a, b, c)", "a == b + c", "a + b > c", "b if a else c",
    "a + b == c", "a * b + c", "sorted([a, b, c])", "(a + b + c) / 3", "a ** 2 + b ** 2 == c ** 2",
    "a + b > c and a + c > b and b + c > a", "a == b or b == c or a == c", "[a, b, c]", "a + b - c",
]
BODIES = [(1, body) for body in BODIES_1] + [(2, body) for body in BODIES_2] + [(3, body) for body in BODIES_3]


def body_function(body: str):
    """The body as a function of any arguments, its first three named a, b, c."""
    source = ("def program(*args, **kwargs):\n"
              "    a, b, c = (list(args) + [None, None, None])[:3]\n"
              f"    return {body}\n")
    namespace = {"math": math}
    exec(source, namespace)
    return namespace["program"]


class Late(BaseException):
    pass


def _late(signum, frame):
    raise Late


def check_cases_passed(row: dict, function) -> list[bool]:
    """Which of the row's check cases `function` passes as the candidate, replayed through the trusted test code."""
    return replay_program(row, lambda: function, runs=lambda code, namespace: _guarded(lambda: exec(code, namespace)))


def group_passed(group: str, function) -> bool:
    def run():
        for args, kwargs, expected in decode_group(group):
            if not same_output(function(*args, **kwargs), expected):
                raise AssertionError
    return _guarded(run)


def _guarded(run) -> bool:
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            run()
            return True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except (Exception, Late):  # noqa: BLE001 -- a wrong answer, an error, or too slow (the timer may fire late)
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=164, help="the first N problems")
    parser.add_argument("--show", type=int, default=15, help="forgeries to list")
    parser.add_argument("--check-only", action="store_true", help="score the checks' cases alone, as the share")
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGALRM, _late)
    try:
        return _report(args)
    finally:
        signal.signal(signal.SIGALRM, previous)


def _report(args) -> int:
    rows = [humaneval_row(problem) for problem in _problems()[:args.problems]]
    print(f"{len(BODIES)} bodies ({len(BODIES_1)} on one argument, {len(BODIES_2)} on two, {len(BODIES_3)} on "
          f"three); {len(rows)} problems")
    measures = {"reward": [], "share of cases": []}  # each: (task, best, agrees, forgery, forgery's body)
    for row in rows:
        cases = len(row["tests"]) + (0 if args.check_only else len(row["generated_cases"]))
        best = {name: [0.0, 0.0, ""] for name in measures}  # agrees, forgery, its body
        for needed, body in BODIES if row["tests"] else ():  # a problem left out of the split pays nothing
            if needed > prompt_arity(row["prompt_code"], row["entry_point"]):
                continue
            function = body_function(body)
            groups = [group_passed(group, function) for group in row["generated_cases"]]
            passed = check_cases_passed(row, function) + ([] if args.check_only else groups)
            right = bool(groups) and all(groups)
            reward = case_reward(passed, generated=not args.check_only)
            for name, value in (("reward", reward), ("share of cases", sum(passed) / cases)):
                if right:
                    best[name][0] = max(best[name][0], value)
                elif value > best[name][1]:
                    best[name][1:] = [value, body]
        for name, (agrees, forgery, body) in best.items():
            measures[name].append((row["task_id"], max(agrees, forgery), agrees, forgery, body))
    for name, results in measures.items():
        if args.check_only and name == "reward":
            continue
        print(f"{name}: the best body's, mean over the problems: {statistics.mean(r[1] for r in results):.4f}")
        print(f"  of which agreeing with the canonical solution on every generated case: "
              f"{statistics.mean(r[2] if r[2] >= r[3] else 0.0 for r in results):.4f}")
        print(f"  forgery (the best body the generated cases show wrong): mean "
              f"{statistics.mean(r[3] for r in results):.4f}, {sum(r[3] > 0 for r in results)} problems above 0, "
              f"{sum(r[3] > 0.2 for r in results)} above 0.2, max {max(r[3] for r in results):.3f}")
        for task, _, _, value, body in sorted(results, key=lambda r: -r[3])[:args.show]:
            if value > 0:
                print(f"    {task}: {value:.3f} by `{body}`")
    return 0


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))  # a body that builds a huge value
    sys.exit(main())
