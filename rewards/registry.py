"""Choosing rewards by name (`correctness:2`), calling them safely, and stacking their outputs.

`score_completions` is the single place where user reward code runs during training; anything it
returns that the loss could not use (wrong length, a non-number, NaN or inf) or any exception it
raises stops the step with the function's name and the row index, before an optimizer step.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rewards.gsm8k import GSM8K_REWARDS
from rewards.text import completion_text
from rewards.toy import TOY_REWARDS

RewardFn = Callable[..., list]

REWARD_FUNCTIONS: dict[str, RewardFn] = {**GSM8K_REWARDS, **TOY_REWARDS}


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; the message names it and the row."""


@dataclass(frozen=True)
class RewardSpec:
    """One reward function with its weight in the weighted sum r_i = sum_k w_k r_ik."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def load_function(reference: str, what: str = "reward") -> Callable:
    """The function named by `module:function` (an importable module) or `path/to/file.py:function`."""
    target, _, function_name = reference.rpartition(":")
    if not target or not function_name.isidentifier():
        raise ValueError(f"{what} {reference!r}: expected module:function or path/to/file.py:function")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"{what} {reference!r}: no such file {path}")
        spec = importlib.util.spec_from_file_location(f"user_{what}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - reported with the file that failed
            raise ValueError(f"{what} {reference!r}: importing {path} raised {type(error).__name__}: {error}") from error
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ValueError(f"{what} {reference!r}: cannot import module {target!r} ({error})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{what} {reference!r}: {target} has no function {function_name!r}")
    return function


def _parse_spec(spec: str) -> RewardSpec:
    """`name`, `name:weight`, `module:function[:weight]` or `file.py:function[:weight]` -> a RewardSpec."""
    text, weight = spec.strip(), 1.0
    head, _, last = text.rpartition(":")
    if head and (head in REWARD_FUNCTIONS or ":" in head or not last.isidentifier()):  # the last part is a weight
        try:
            weight = float(last)
        except ValueError:
            raise ValueError(f"reward {spec!r}: weight {last!r} is not a number") from None
        text = head
    if not math.isfinite(weight):
        raise ValueError(f"reward {spec!r}: weight must be finite")
    if text in REWARD_FUNCTIONS:
        return RewardSpec(text, REWARD_FUNCTIONS[text], weight)
    if ":" in text:
        function = load_function(text)
        return RewardSpec(function.__name__, function, weight)
    raise ValueError(f"unknown reward {text!r}; known rewards: {', '.join(sorted(REWARD_FUNCTIONS))}, "
                     "or give module:function or path/to/file.py:function")


def parse_reward_specs(specs: Sequence[str | RewardFn | RewardSpec]) -> list[RewardSpec]:
    """Turn `["correctness:2", "int", "my_rewards.py:score", my_fn]` into RewardSpecs; unknown names list the
    known ones."""
    parsed = []
    for spec in specs:
        if isinstance(spec, RewardSpec):
            parsed.append(spec)
        elif callable(spec):
            parsed.append(RewardSpec(getattr(spec, "__name__", "reward"), spec))
        elif isinstance(spec, str):
            parsed.append(_parse_spec(spec))
        else:
            raise TypeError(f"a reward must be a name, a function or a RewardSpec, got {type(spec).__name__}")
    if not parsed:
        raise ValueError("at least one reward function is needed")
    names = [spec.name for spec in parsed]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward(s) given twice: {duplicates}; give each once with a weight instead")
    return parsed


def describe_rewards(specs: Sequence[RewardSpec]) -> list[dict]:
    """What ran, for run_config.json: each function's name, weight and where its code lives."""
    return [{"name": spec.name, "weight": spec.weight,
             "function": f"{getattr(spec.fn, '__module__', '?')}:{getattr(spec.fn, '__qualname__', spec.name)}"}
            for spec in specs]


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
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned a non-finite value {value} for row {row} (return None for a "
                              "row it cannot score: trl's convention, which leaves it out of the reward)")
        checked.append(value)
    return checked


def _call(spec: RewardSpec, prompts: list, completions: list, columns: dict[str, list]) -> list:
    try:
        return spec.fn(prompts=prompts, completions=completions, **columns)
    except Exception as batch_error:  # noqa: BLE001 - re-raised with the row that causes it
        # Find the row that fails by scoring rows one at a time, so the message can name it.
        for row in range(len(completions)):
            row_columns = {key: values[row : row + 1] for key, values in columns.items()}
            try:
                spec.fn(prompts=prompts[row : row + 1], completions=completions[row : row + 1], **row_columns)
            except Exception as row_error:  # noqa: BLE001
                raise RewardError(
                    f"reward {spec.name!r} raised {type(row_error).__name__} on row {row}: {row_error}"
                ) from row_error
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
               group_size: int = 1) -> torch.Tensor:
    """(N, K) rewards of completion texts for dataset rows, `group_size` consecutive completions per row.

    trl's convention: chat prompts get chat-message completions, plain-string prompts plain strings, and
    every column but `prompt` arrives as a keyword list aligned with the completions, `completion_ids` too.
    """
    prompts = [row["prompt"] for row in rows for _ in range(group_size)]
    completions = texts if isinstance(prompts[0], str) else [[{"role": "assistant", "content": t}] for t in texts]
    columns = {key: [row.get(key) for row in rows for _ in range(group_size)] for key in rows[0] if key != "prompt"}
    columns["completion_ids"] = completion_ids
    return score_completions(specs, prompts, completions, columns)


__all__ = ["REWARD_FUNCTIONS", "RewardError", "RewardSpec", "completion_text", "describe_rewards", "load_function",
           "parse_reward_specs", "score_completions", "score_rows"]
