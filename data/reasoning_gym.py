"""reasoning-gym's procedural tasks (the `tasks` extra): `--dataset reasoning-gym:NAME[:N]`.

reasoning-gym (https://github.com/open-thought/reasoning-gym, Apache-2.0) generates problems from a seed and a task's
settings, and checks an answer with the task's own `score_answer(answer, entry)`. Here:

    task_rows("reasoning-gym:chain_sum:500", "train", {"min_terms": 2, "max_terms": 2}, seed=0)

gives N problems (default 2000) per split as rows with `question`, `answer` (the task's oracle answer as it gives it:
text, or None for a task that accepts many answers and checks them itself),
`metadata` (the task's, as it made it), `task` and `task_settings` (the name and the settings as JSON: the reward
rewards.reasoning_gym.task_score rebuilds the task's scorer from them, so a row carries all it needs) and
`answer_extraction` (how that reward finds a completion's answer: `tag`, `tag-or-last-number`, `tag-or-last-line`).

Train and held-out problems are disjoint: the train split is the task at `seed`, the held-out split (`test`,
`validation` or `eval`) the task at a seed far from it, less every problem whose question is also a train question.
Small problem spaces repeat questions between seeds, so the held-out split can be shorter than N; how many were
dropped is logged, and a split left empty is an error. The held-out split is disjoint from the train split of the
same N: evaluate with the N you trained with.

Some verifiers cannot be trusted with a policy's answers (`verifier_problems`): those that evaluate the answer as
code (eval, sympy's parser: `countdown`, `puzzle24`, `n_queens`, ...), and those that give full marks to a
constant nonsense answer (`game_of_life_halting` pays any non-empty answer, `coin_flip` pays "0", `complex_arithmetic`
pays "nan"). Their tasks are refused unless `trust_verifier` (`--trust-task-verifier`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import re
import textwrap

from data.gsm8k import DataError

logger = logging.getLogger("grpo.data")

PREFIX = "reasoning-gym:"
DEFAULT_SIZE = 2000
HELD_OUT_SPLITS = ("test", "validation", "eval")
# reasoning-gym seeds problem i of a task with `seed + i`: the held-out seed sits this far away, so no held-out
# problem shares a random stream with a train problem for any N below it.
HELD_OUT_SEED_OFFSET = 1_000_000_007
# How the task_score reward finds a completion's answer (rewards/reasoning_gym.extract_answer)
ANSWER_EXTRACTIONS = ("tag", "tag-or-last-number", "tag-or-last-line")
INSTALL_HINT = "pip install -e '.[tasks]' (the reasoning-gym package)"


def is_source(source: str) -> bool:
    return source.startswith(PREFIX)


def parse_source(source: str) -> tuple[str, int]:
    """`reasoning-gym:NAME[:N]` -> (NAME, N)."""
    name, colon, size_text = source[len(PREFIX):].partition(":")
    if not name:
        raise DataError(f"--dataset {source}: expected reasoning-gym:NAME or reasoning-gym:NAME:N (N problems per "
                        "split)")
    if colon and not (size_text.isascii() and size_text.isdigit() and int(size_text) >= 1):
        raise DataError(f"--dataset {source}: N must be a positive number of problems per split, got {size_text!r}")
    return name, int(size_text) if size_text else DEFAULT_SIZE


def task_name(dataset: str | None) -> str | None:
    """The reasoning-gym task a dataset names (`reasoning-gym:chain_sum:500` -> chain_sum), else the dataset."""
    return parse_source(dataset)[0] if dataset and is_source(dataset) else dataset


def _package():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL_HINT}") from None
    return reasoning_gym


def settings_json(settings: dict | None) -> str:
    """The settings as canonical JSON (sorted keys): the `task_settings` column, and the scorer cache's key."""
    return json.dumps(settings or {}, sort_keys=True)


def make_task(name: str, settings: dict | None, seed: int, size: int):
    """The reasoning-gym dataset object; an unknown name or setting raises DataError naming it."""
    package = _package()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        known = sorted(DATASETS)
        close = [k for k in known if name.lower() in k or k in name.lower()][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise DataError(f"reasoning-gym has no task {name!r}{hint}; its {len(known)} tasks: {', '.join(known)}")
    config_class = DATASETS[name][1]
    fields = sorted(set(getattr(config_class, "__dataclass_fields__", {})) - {"seed", "size"})
    given = sorted({"seed", "size"} & set(settings or {}))
    if given:
        raise DataError(f"--task-settings {settings_json(settings)}: {', '.join(given)} come from --task-seed and "
                        f"reasoning-gym:{name}:N, not from the settings")
    try:  # the first problem too: some settings pass the config and fail only when a problem is drawn
        task = package.create_dataset(name, seed=seed, size=size, **(settings or {}))
        task[0]
        return task
    except Exception as error:  # noqa: BLE001 - an unknown setting, or a value the task refuses, however it fails
        raise DataError(f"reasoning-gym task {name!r} refuses --task-settings {settings_json(settings)}: "
                        f"{type(error).__name__}: {error}; its settings: {', '.join(fields)}") from None


# A verifier that hands the answer to one of these runs the model's text as code in the training process.
_EVALUATING = re.compile(r"\b(eval|exec|compile|parse_expr|sympify|parse_latex)\s*\(")
# Answers no task should give full marks to: a verifier that does on nearly every problem pays a constant.
NONSENSE_ANSWERS = ("", "0", "1", "no idea", "nan", "inf", "None", "True", "[]")
PROBE_PROBLEMS, PROBE_SHARE = 32, 0.9


def evaluates_answers(task_class) -> bool:
    """Whether the task's score_answer, or a method of its class or a function of reasoning-gym it calls (at any
    depth), calls Python's eval, exec or compile, or sympy's parse_expr, sympify or parse_latex on something."""
    module = inspect.getmodule(task_class)
    seen, todo = set(), [task_class.score_answer]
    while todo:
        function = todo.pop()
        if function in seen:
            continue
        seen.add(function)
        try:
            source = textwrap.dedent(inspect.getsource(function))
        except (OSError, TypeError):
            continue
        if _EVALUATING.search(source):
            return True
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                for owner in (task_class, module):
                    found = getattr(owner, name, None) if name else None
                    if callable(found) and getattr(found, "__module__", "").startswith("reasoning_gym"):
                        todo.append(found)
    return False


def verifier_problems(name: str, settings: dict | None, seed: int = 0) -> list[str]:
    return list(_verifier_problems(name, settings_json(settings), seed))


@functools.lru_cache(maxsize=64)
def _verifier_problems(name: str, settings_text: str, seed: int) -> tuple[str, ...]:
    """Why the task's verifier cannot be trusted with a policy's answers (empty: it can): it evaluates them as code,
    or it gives full marks to a constant nonsense answer on nearly every problem (NONSENSE_ANSWERS, probed on
    PROBE_PROBLEMS problems). --trust-task-verifier skips this check."""
    from reasoning_gym.factory import DATASETS

    task = make_task(name, json.loads(settings_text), seed + 2 * HELD_OUT_SEED_OFFSET, PROBE_PROBLEMS)
    if evaluates_answers(DATASETS[name][0]):
        return (f"reasoning-gym task {name!r}: its verifier evaluates the answer as code (eval, exec or sympy's "
                "parser), so a completion would run Python in the training process",)
    problems = [task[index] for index in range(PROBE_PROBLEMS)]
    for answer in NONSENSE_ANSWERS:
        paid = 0
        for problem in problems:
            try:
                paid += float(task.score_answer(answer, problem)) >= 1.0
            except Exception:  # noqa: BLE001 - a verifier that raises on it does not pay it
                pass
        if paid >= PROBE_SHARE * PROBE_PROBLEMS:
            return (f"reasoning-gym task {name!r}: its verifier gives full marks to the constant answer {answer!r} on "
                    f"{paid} of {PROBE_PROBLEMS} problems, so a policy would learn that answer",)
    return ()


@functools.lru_cache(maxsize=64)
def scorer(name: str, settings: str):
    """The task's `score_answer(answer, entry) -> float`, built once per (task, settings JSON)."""
    return make_task(name, json.loads(settings), seed=0, size=1).score_answer


def _rows(name: str, settings: dict | None, seed: int, size: int, answer_extraction: str) -> list[dict]:
    task = make_task(name, settings, seed, size)
    columns = {"task": name, "task_settings": settings_json(settings), "answer_extraction": answer_extraction}
    return [{"question": entry["question"], "answer": entry["answer"], "metadata": entry.get("metadata", {}),
             **columns} for entry in (task[index] for index in range(size))]


def task_rows(source: str, split: str, settings: dict | None = None, seed: int = 0, answer_extraction: str = "tag",
              trust_verifier: bool = False) -> list[dict]:
    """The problems of one split (see the module docstring): train at `seed`, held-out disjoint from train. A task
    whose verifier fails `verifier_problems` is refused unless `trust_verifier`."""
    name, size = parse_source(source)
    if answer_extraction not in ANSWER_EXTRACTIONS:
        raise DataError(f"answer extraction {answer_extraction!r} is none of {', '.join(ANSWER_EXTRACTIONS)}")
    untrusted = [] if trust_verifier else verifier_problems(name, settings, seed)
    if untrusted:
        raise DataError(untrusted[0] + "; pass --trust-task-verifier to use it anyway")
    if split != "train" and split not in HELD_OUT_SPLITS:
        raise DataError(f"--dataset {source}: split {split!r} is neither train nor a held-out split "
                        f"({', '.join(HELD_OUT_SPLITS)})")
    train = _rows(name, settings, seed, size, answer_extraction)
    if split == "train":
        return train
    seen = {row["question"] for row in train}
    held_out = [row for row in _rows(name, settings, seed + HELD_OUT_SEED_OFFSET, size,
                                     answer_extraction) if row["question"] not in seen]
    if not held_out:
        raise DataError(f"--dataset {source}: every held-out problem is also a train problem (the task's settings "
                        "allow few distinct problems); lower N or widen --task-settings")
    if len(held_out) < size:
        logger.info("%s[%s]: %d of %d held-out problems dropped, their questions being train questions",
                    source, split, size - len(held_out), size)
    return held_out
