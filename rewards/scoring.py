"""Calling the reward functions safely and stacking their outputs into the (N, K) rewards of a rollout; what a
reward is (`RewardSpec`: a function and its weight) and the text of a completion in either of trl's two shapes
(`completion_text`).

`score_completions` is the single place where user reward code runs during training; anything it returns that
the loss could not use (wrong length, a non-number, NaN or inf) or any exception it raises stops the step with
the function's name and the row index, before an optimizer step. None is trl's "cannot score this row": NaN
here, left out of that row's weighted sum (grpo.algorithm.advantages.weighted_rewards).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch



RewardFn = Callable[..., list]
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class RewardSpec:
    """One reward function with its weight in the weighted sum r_i = sum_k w_k r_ik."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def completion_text(completion) -> str:
    """The assistant text of a completion: a plain string, or chat messages whose last content is used."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; the message names it and the row."""


class Unscorable(Exception):
    """Raised from inside a reward function by something it reads that is gone (a rollout's stopped environment,
    grpo.multiturn.environments): that completion scores None, as if the function had returned None for it."""


def _check_values(name: str, values, num_rows: int) -> list[float]:
    """Rewards as floats (NaN for None). Accepts what trl accepts: any sequence of numbers, bools, numpy
    or 0-d torch scalars; anything else, a wrong count, or NaN/inf is an error naming the function and row."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise RewardError(f"reward {name!r} returned {type(values).__name__}, expected a list of {num_rows} floats")
    if len(values) != num_rows:
        raise RewardError(f"reward {name!r} returned {len(values)} values for {num_rows} completions")
    checked = []
    for row, value in enumerate(values):
        if value is None:
            checked.append(math.nan)  # trl's convention: None = cannot score this row
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):  # bool, int, float and numpy scalars are Real
            raise RewardError(f"reward {name!r} returned {value!r} ({type(value).__name__}) for row {row}")
        value = float(value)
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:  # the rewards are fp32: it would be inf there
            raise RewardError(f"reward {name!r} returned {value}, not a finite fp32 number, for row {row} (return None "
                              "for a row it cannot score: trl's convention, which leaves it out of the reward)")
        checked.append(value)
    return checked


def _call(spec: RewardSpec, prompts: list, completions: list, columns: dict[str, list]) -> list:
    try:
        return spec.fn(prompts=prompts, completions=completions, **columns)
    except (Exception, SystemExit) as batch_error:  # noqa: BLE001 - re-raised with the row that causes it
        # Find the row that fails by scoring rows one at a time, so the message can name it; rows that read something
        # gone (Unscorable) score None, and then the rows one at a time are the function's values.
        scored = []
        for row in range(len(completions)):
            row_columns = {key: values[row : row + 1] for key, values in columns.items()}
            try:
                value = spec.fn(prompts=prompts[row : row + 1], completions=completions[row : row + 1], **row_columns)
            except Unscorable:
                value = [None]
            except (Exception, SystemExit) as row_error:  # noqa: BLE001
                raise RewardError(
                    f"reward {spec.name!r} raised {type(row_error).__name__} on row {row}: {row_error}"
                ) from row_error
            scored.append(_check_values(spec.name, value, 1)[0])
        if any(math.isnan(value) for value in scored):
            return [None if math.isnan(value) else value for value in scored]
        raise RewardError(
            f"reward {spec.name!r} raised {type(batch_error).__name__} on the batch: {batch_error}"
        ) from batch_error


def score_completions(
    specs: Sequence[RewardSpec], prompts: list, completions: list, columns: dict[str, list]
) -> torch.Tensor:
    """Rewards matrix (N, K) in fp32: row i, function k; NaN where a function returned None."""
    num_rows = len(completions)
    for key, values in columns.items():
        if len(values) != num_rows:
            raise ValueError(f"column {key!r} has {len(values)} values for {num_rows} completions")
    per_function = [_check_values(spec.name, _call(spec, prompts, completions, columns), num_rows) for spec in specs]
    return torch.tensor(per_function, dtype=torch.float32).T.reshape(num_rows, len(specs))  # (N, K)


def score_rows(specs: Sequence[RewardSpec], rows: list[dict], texts: list[str], completion_ids: list[list[int]],
               group_size: int = 1, messages: list[list[dict]] | None = None, prompts: list | None = None,
               extra_columns: dict | None = None) -> torch.Tensor:
    """(N, K) rewards of completion texts for dataset rows, `group_size` consecutive completions per row.

    trl's convention: chat prompts get chat-message completions, plain-string prompts plain strings, and
    every column but `prompt` arrives as a keyword list aligned with the completions, `completion_ids` too.
    `messages`: each completion's turns (tool rollouts: assistant, tool, ..., assistant), used for chat prompts;
    `prompts`: each completion's own prompt (environments append their reset text), default its row's;
    `extra_columns`: more keyword lists, one value per completion (`environments`: grpo.multiturn.environments).
    """
    prompts = prompts or [row["prompt"] for row in rows for _ in range(group_size)]
    as_messages = [[{"role": "assistant", "content": text}] for text in texts]
    completions = texts if isinstance(prompts[0], str) else messages or as_messages
    columns = {key: [row.get(key) for row in rows for _ in range(group_size)] for key in rows[0] if key != "prompt"}
    columns.update(completion_ids=completion_ids, **(extra_columns or {}))
    return score_completions(specs, prompts, completions, columns)


# What every call passes beside the rows' columns (score_rows); `environments` too with --environment
SUPPLIED_ARGUMENTS = ("prompts", "completions", "completion_ids")


def missing_columns(spec: RewardSpec, columns) -> list[str]:
    """The columns `spec.fn` needs that neither the loop nor the rows' `columns` supply: its parameters without a
    default, and the names in its `required_columns` attribute (for a parameter that keeps trl's default of None,
    as accuracy_reward's `solution`). A function whose signature cannot be read, or that takes only **kwargs,
    needs none but those it declares."""
    try:
        parameters = inspect.signature(spec.fn).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needed = [p.name for p in parameters if p.kind in required and p.default is inspect.Parameter.empty]
    needed += [name for name in getattr(spec.fn, "required_columns", ()) if name not in needed]
    return [name for name in needed if name not in SUPPLIED_ARGUMENTS and name not in columns]


def check_reward_columns(specs: Sequence[RewardSpec], rows: list[dict], where: str, supplied=()) -> None:
    """Refuse, before any model loads, a reward that needs a column the rows lack (accuracy_reward without
    `solution`, correctness without `answer`): it would fail at the first step. `supplied`: more arguments the
    run passes (`environments` with environments). The first row's columns stand for the rows' (rows of one file
    share them; a row missing one fails at its step, naming the row)."""
    columns = (set(rows[0]) - {"prompt"} if rows else set()) | set(supplied)
    problems = [f"reward {spec.name!r} needs the argument(s) {', '.join(missing)}" for spec in specs
                for missing in [missing_columns(spec, columns)] if missing]
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}, which neither the run nor these rows' columns give (the "
                         f"columns: {', '.join(sorted(columns)) or 'none but prompt'}); choose rewards for this data "
                         "with --reward")


__all__ = ["RewardError", "Unscorable", "check_reward_columns", "missing_columns", "score_completions", "score_rows"]
