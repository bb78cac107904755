"""Choosing rewards by name (`correctness:2`), `module:function` or `path/to/file.py:function`, or reward models
(`./my-rm`, `model:ORG/NAME`, rewards/reward_model.py), each with an optional weight.

rewards.scoring calls them; this module turns the settings into `RewardSpec`s and says what ran.
"""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rewards.gsm8k import GSM8K_REWARDS
from rewards.scoring import RewardFn, RewardSpec, completion_text
from rewards.code import CODE_REWARDS
from rewards.math_answers import MATH_REWARDS
from rewards.reward_model import RewardModel, check_model_folder
from rewards.r1_format import R1_FORMAT_REWARDS
from rewards.reasoning_gym import TASK_REWARDS
from rewards.tools import TOOL_REWARDS
from rewards.toy import TOY_REWARDS

REWARD_FUNCTIONS: dict[str, RewardFn] = {**GSM8K_REWARDS, **TOY_REWARDS, **TOOL_REWARDS, **CODE_REWARDS, **MATH_REWARDS,
                                          **TASK_REWARDS, **R1_FORMAT_REWARDS}


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
        sys.modules[spec.name] = module  # as an import does: dataclasses and pickle look the module up there
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - reported with the file that failed
            sys.modules.pop(spec.name, None)
            raise ValueError(f"{what} {reference!r}: importing {path} raised {type(error).__name__}: "
                             f"{error}") from error
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ValueError(f"{what} {reference!r}: cannot import module {target!r} ({error})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{what} {reference!r}: {target} has no function {function_name!r}")
    return function


MODEL_PREFIX = "model:"  # `model:ORG/NAME` or `model:PATH`: a reward model (a hub id could pass for a reward's name)


def _split_weight(spec: str, text: str) -> tuple[str, float]:
    """`text` without its `:weight` suffix, and the weight (1.0 without one)."""
    head, _, last = text.rpartition(":")
    is_model_id = head + ":" == MODEL_PREFIX  # model:org/rm (the id, no weight)
    if not head or is_model_id or not (head in REWARD_FUNCTIONS or ":" in head or not last.isidentifier()):
        return text, 1.0
    try:
        weight = float(last)
    except ValueError:
        raise ValueError(f"reward {spec!r}: weight {last!r} is not a number") from None
    if not math.isfinite(weight):
        raise ValueError(f"reward {spec!r}: weight must be finite")
    return head, weight


def required_arguments(function: Callable) -> int | None:
    """How many arguments a plug-in needs: its parameters without a default, **kwargs aside; None when its signature
    cannot be read or takes *args (any number)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)


def _parse_spec(spec: str, model_options: dict) -> RewardSpec:
    """`name`, `module:function`, `file.py:function`, a reward model folder or `model:ID`, each with an optional
    `:weight` -> a RewardSpec. A reward model is only described here (rewards.reward_model loads it later)."""
    text, weight = _split_weight(spec, spec.strip())
    if text in REWARD_FUNCTIONS:
        return RewardSpec(text, REWARD_FUNCTIONS[text], weight)
    if text.startswith(MODEL_PREFIX):
        model = RewardModel(text[len(MODEL_PREFIX):], **model_options)
        return RewardSpec(model.name, model, weight)
    if Path(text).expanduser().is_dir():  # a folder given as it is: it must be a model's
        check_model_folder(text, f"reward {spec!r}")
        model = RewardModel(text, **model_options)
        return RewardSpec(model.name, model, weight)
    if ":" in text:
        function = load_function(text)
        return RewardSpec(function.__name__, function, weight)
    raise ValueError(f"unknown reward {text!r}; known rewards: {', '.join(sorted(REWARD_FUNCTIONS))}, "
                     "or give module:function or path/to/file.py:function, or a reward model: a local folder "
                     "(path/to/rm) or model:ORG/NAME")


def parse_reward_specs(specs: Sequence[str | RewardFn | RewardSpec], **model_options) -> list[RewardSpec]:
    """Turn `["correctness:2", "int", "my_rewards.py:score", "./my-rm:0.5", my_fn]` into RewardSpecs; unknown names
    list the known ones. `model_options`: RewardModel's keyword arguments for the reward models named by a string
    (trust_remote_code, chat_template_kwargs, ...)."""
    parsed = []
    for spec in specs:
        if isinstance(spec, RewardSpec):
            parsed.append(spec)
        elif callable(spec):
            parsed.append(RewardSpec(getattr(spec, "__name__", "reward"), spec))
        elif isinstance(spec, str):
            parsed.append(_parse_spec(spec, model_options))
        else:
            raise TypeError(f"a reward must be a name, a function or a RewardSpec, got {type(spec).__name__}")
    names = [spec.name for spec in parsed]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward(s) given twice: {duplicates}; give each once with a weight instead")
    return parsed


def describe_rewards(specs: Sequence[RewardSpec]) -> list[dict]:
    """What ran, for run_config.json: each function's name, weight and where its code lives (a reward model: the
    folder or hub id it loads, or the class of the model it was given)."""
    records = []
    for spec in specs:
        record = {"name": spec.name, "weight": spec.weight,
                  "function": f"{getattr(spec.fn, '__module__', '?')}:{getattr(spec.fn, '__qualname__', spec.name)}"}
        if isinstance(spec.fn, RewardModel):
            source = spec.fn.source
            record.update(function="rewards.reward_model:RewardModel",
                          model=source if isinstance(source, str) else type(source).__name__)
        records.append(record)
    return records


__all__ = ["MODEL_PREFIX", "REWARD_FUNCTIONS", "RewardModel", "RewardSpec", "completion_text", "describe_rewards",
           "load_function", "parse_reward_specs"]
