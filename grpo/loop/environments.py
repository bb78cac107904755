"""Multi-turn environments (trl's `environment_factory`): each rollout plays against its own environment.

    factory      a class (or any callable) that makes an environment; `--environment module:Class` or
                 `file.py:Class`, several times (or a dict from Python) for a mix chosen by each row's
                 `environment` column
    reset        `reset(**row)` for each rollout before it samples: None, or a string appended to the last user
                 message of the row's prompt (so rollouts may start from different prompts)
    tools        the environment's public methods (not `reset`, `get_reward` or `_private`) are the rollout's tools,
                 run through grpo.loop.tools: the chat template shows their schemas, a turn that calls one gets the
                 result as forced tokens (tool_mask 0) and samples on
    get_reward   optional: called once when the rollout ends; a reward column named after the class, weight 1,
                 beside --reward (which may then be empty); None for rows of another environment
    rewards      reward functions get the rollouts' environments as the `environments` keyword (trl's)

Token in, token out: the sampler feeds each result into the same KV cache and the update reads the same
completion_ids, so what the model saw is what it is trained on; no turn is ever re-tokenized.

Isolation and reliability (where we differ from trl, which runs the instances in its own process and reuses them):
every rollout's environment is made fresh in its own forked process, so no instance, class attribute or module
global is shared between rollouts, and a call that raises, returns something other than a string or runs past
`--environment-timeout` seconds is a failed call: `{"error": ...}` is the result the model reads, it counts in
tools/failure_frequency, and a timed-out (or crashed) process is killed, every later call of that rollout failing
too. `reset` failing stops the step with the row's index (a broken environment is a bug, not a move); `get_reward`
failing scores the rollout None (left out of its weighted sum) with a warning. Each process seeds `random` (and
numpy's global generator) from the rollout's own sampling noise, so runs repeat, also resumed or on another world
size.
"""

from __future__ import annotations

import inspect
import logging
import math
import multiprocessing
import numbers
import os
import random
import signal
import sys
from dataclasses import dataclass, field
from typing import Callable

from grpo.loop.tools import ToolCallFailed, ToolSet, ToolTurns, tool_parameters

logger = logging.getLogger("grpo")

NOT_TOOLS = ("reset", "get_reward")  # trl's: every other public function of the class is a tool


class EnvironmentStartError(RuntimeError):
    """An environment could not start a rollout (its factory or `reset` failed); the message names it and the row."""


def load_environments(specs: list[str]) -> dict[str, Callable]:
    """`--environment` values -> {name: factory}. `module:Class` or `file.py:Class`, optionally `name=...`; the name
    (default: the class name) is what a row's `environment` column selects."""
    from rewards.registry import load_function

    factories = {}
    for spec in specs:
        name, _, reference = spec.rpartition("=") if "=" in spec.split(":")[0] else ("", "", spec)
        factory = load_function(reference, "environment")
        name = name or getattr(factory, "__name__", reference)
        if name in factories:
            raise ValueError(f"--environment {spec!r}: a second environment named {name!r}; name them "
                             "name=module:Class")
        factories[name] = factory
    return factories


def tool_methods(instance) -> list[Callable]:
    """The instance's tools: its class's public functions other than reset and get_reward, bound (trl's rule)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


@dataclass
class Environments:
    """The run's environment factories, probed once: each one's tools (schemas for the chat template) and whether
    its class owns a reward. `multi`: a dict was given, so rows choose by their `environment` column."""

    factories: dict[str | None, Callable]
    multi: bool
    timeout: float = 10.0  # seconds a reset, tool call or get_reward may take
    tools: dict = field(default_factory=dict)  # {name: the probe instance's bound tool methods}
    reward_classes: dict = field(default_factory=dict)  # {class name: class} of those that define get_reward
    class_names: dict = field(default_factory=dict)  # {name: the class name its instances have}

    @classmethod
    def from_factory(cls, environment_factory, timeout: float = 10.0) -> "Environments":
        """A factory or a dict of them (trl's `environment_factory`), each probed by making one instance here."""
        multi = isinstance(environment_factory, dict)
        factories = dict(environment_factory) if multi else {None: environment_factory}
        if not factories:
            raise ValueError("environment_factory: an empty dict")
        environments = cls(factories, multi, timeout)
        for name, factory in factories.items():
            label = name or getattr(factory, "__name__", repr(factory))
            if not callable(factory):
                raise ValueError(f"environment {label!r}: {factory!r} is not callable (a class or a function that "
                                 "returns an environment)")
            try:
                probe = factory()
            except Exception as error:  # noqa: BLE001 - reported with the environment's name
                raise ValueError(f"environment {label!r}: making one raised {type(error).__name__}: {error}") from error
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"environment {label!r}: {type(probe).__name__} has no reset method (trl's contract: "
                                 "reset(**row) -> None or a string for the prompt)")
            environments.tools[name] = tool_methods(probe)
            environments.class_names[name] = type(probe).__name__
            if callable(getattr(type(probe), "get_reward", None)):
                environments.reward_classes[type(probe).__name__] = type(probe)
        return environments

    def name_of(self, row: dict, index: int):
        """The environment a row plays: the only one, or the one its `environment` column names."""
        if not self.multi:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"row {index}: environment={name!r} is not one of the environments given "
                             f"({', '.join(map(str, self.factories))}); every row needs an `environment` column")
        return name

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """(class name, reward fn) for each class with get_reward: trl's extra reward columns, weight 1."""
        def owned_by(class_name):
            def get_reward(environments=None, **_):
                if environments is None:
                    raise ValueError(f"the {class_name} reward needs the rollouts' environments")
                return [handle._reward() if handle._class_name == class_name else None for handle in environments]
            get_reward.__name__ = class_name
            return get_reward
        return [(name, owned_by(name)) for name in self.reward_classes]

    def start(self, rows: list[dict], group: int, seeds: list[int]) -> "Episodes":
        """One fresh environment per rollout (N = len(rows) * group), each in its own process, reset with its row;
        `seeds`: each process's `random` seed."""
        names = [self.name_of(row, index) for index, row in enumerate(rows)]
        handles = []
        try:
            for index, (row, name) in enumerate(zip(rows, names, strict=True)):
                kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)
                for member in range(group):
                    rollout = index * group + member
                    handles.append(EnvironmentHandle(self.factories[name], kwargs, self.class_names[name],
                                                     seeds[rollout], self.timeout))
            for rollout, handle in enumerate(handles):
                handle._wait_for_reset(rows[rollout // group], rollout // group)
        except BaseException:
            for handle in handles:
                handle._close()
            raise
        return Episodes(self, handles, [name for name in names for _ in range(group)])


# ----------------------------------------------------------------------------- one rollout's environment


def _serve(connection, factory, row: dict, seed: int) -> None:
    """The environment's process: make it, reset it with the row, then answer requests until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it kills this process
    os.setpgrp()  # a group of its own: stopping it also stops any program the environment started
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)

    def reply(kind, value):
        try:
            connection.send((kind, value))
        except Exception as error:  # noqa: BLE001 - a value that does not pickle
            connection.send(("error", f"{type(error).__name__}: {error}"))

    try:
        environment = factory()
        observation = environment.reset(**row)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}, not None or a string")
    except BaseException as error:  # noqa: BLE001 - reported to the trainer, which stops the step
        reply("error", f"{type(error).__name__}: {error}")
        return
    reply("ok", observation)
    while True:
        try:
            request, name, args, kwargs = connection.recv()
        except EOFError:  # the trainer is gone
            return
        if request == "close":
            return
        try:
            if request == "call":  # a tool call: its result must be a string
                result = getattr(environment, name)(**kwargs)
                if not isinstance(result, str):
                    raise TypeError(f"{name} returned {type(result).__name__}, not a string")
            elif request == "reward":  # a number, a bool or a numpy scalar, as trl's float tensor takes them
                result = environment.get_reward()
                if not isinstance(result, numbers.Real) and type(result).__module__ != "numpy":
                    raise TypeError(f"get_reward returned {result!r}, not a finite number")
                if not math.isfinite(float(result)):
                    raise TypeError(f"get_reward returned {result!r}, not a finite number")
                result = float(result)
            elif request == "getattr":  # a reward function reading the environment (trl's `environments`)
                value = getattr(environment, name)
                result = ("method", None) if callable(value) else ("value", value)
            else:  # "method": a method called by a reward function, any result
                result = getattr(environment, name)(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - SystemExit too: a failed call, the process goes on
            reply("error", f"{type(error).__name__}: {error}")
            continue
        reply("ok", result)


class EnvironmentHandle:
    """One rollout's environment, living in its own process: what reward functions get as `environments`. Any
    public attribute reads the environment's (`handle.score`, `handle.method(...)`), by a request with the
    timeout; the handle's own API is underscored so that it never hides one (tool calls `_call`, `_reward`)."""

    def __init__(self, factory, row: dict, class_name: str, seed: int, timeout: float):
        self._class_name, self._timeout, self._dead = class_name, timeout, None
        context = multiprocessing.get_context("fork")  # the factory and row need no pickling; starts in ms
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs, factory, row, seed), daemon=True)
        self._process.start()
        theirs.close()  # so that recv sees EOF when the process dies
        self._observation = None

    def _wait_for_reset(self, row: dict, index: int) -> None:
        try:
            self._observation = self._receive("reset")
        except ToolCallFailed as error:
            label = self._class_name
            raise EnvironmentStartError(f"environment {label}: reset(**row) of row {index} failed: {error} "
                                    f"(row keys: {', '.join(map(str, row))})") from None

    def _call(self, name: str, /, **arguments) -> str:
        """A tool call; raises ToolCallFailed (the model reads its message) when it fails in any way."""
        return self._request("call", name, (), arguments)

    def _reward(self) -> float | None:
        """get_reward(), or None (with a warning) when it fails."""
        try:
            return self._request("reward", "get_reward", (), {})
        except ToolCallFailed as error:
            logger.warning("environment %s: get_reward failed (%s); the rollout is not scored by it", self._class_name,
                           error)
            return None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        kind, value = self._request("getattr", name, (), {})
        if kind == "value":
            return value
        return lambda *args, **kwargs: self._request("method", name, args, kwargs)

    def _request(self, request: str, name: str, args: tuple, kwargs: dict):
        if self._dead is not None:
            raise ToolCallFailed(f"{name}: the environment is gone ({self._dead})")
        try:
            self._connection.send((request, name, args, kwargs))
        except (BrokenPipeError, OSError):
            self._dead = f"its process exited with code {self._process.exitcode}"
            raise ToolCallFailed(f"{name}: the environment is gone ({self._dead})") from None
        return self._receive(name)

    def _receive(self, name: str):
        if not self._connection.poll(self._timeout):
            self._kill(f"{name} ran past the {self._timeout:g} s timeout")
            raise ToolCallFailed(f"{name}: no answer within {self._timeout:g} s; the environment was stopped")
        try:
            kind, value = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(1)
            self._kill(f"its process exited with code {self._process.exitcode}")
            raise ToolCallFailed(f"{name}: the environment's process died ({self._dead})") from None
        if kind == "error":
            raise ToolCallFailed(value)
        return value

    def _kill(self, reason: str) -> None:
        self._dead = self._dead or reason
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # the process and whatever it started
        except (ProcessLookupError, PermissionError):
            pass
        self._process.join(5)

    def _close(self) -> None:
        if self._dead is None and self._process.is_alive():
            try:
                self._connection.send(("close", "", (), {}))
            except OSError:
                pass
            self._process.join(0.5)
        self._kill("closed")
        self._connection.close()


def class_name(environment: EnvironmentHandle) -> str:
    """The class name of a rollout's environment, for reward functions that see several kinds (the dict form)."""
    return environment._class_name


@dataclass
class Episodes:
    """One sampling call's environments, N rollouts: their handles, what `reset` said, and the tool turns."""

    environments: Environments
    handles: list[EnvironmentHandle]
    names: list  # (N,) each rollout's environment name

    def prompt(self, row_prompt, rollout: int):
        """The rollout's prompt: the row's, with its reset observation appended to the last user message."""
        observation = self.handles[rollout]._observation
        if not observation:
            return row_prompt
        if isinstance(row_prompt, str):
            return row_prompt + observation
        last = row_prompt[-1]
        return [*row_prompt[:-1], {**last, "content": str(last.get("content") or "") + observation}]

    def template_kwargs(self, rollout: int, standalone_tools: list, base: dict | None) -> dict:
        """The chat template's keywords for the rollout's prompt: its tools are the standalone ones and its
        environment's."""
        tools = [*standalone_tools, *self.environments.tools[self.names[rollout]]]
        return {**(base or {}), **({"tools": tools} if tools else {})}

    def toolset(self, base: ToolSet) -> "EpisodeTools":
        return EpisodeTools(base, self)

    def close(self) -> None:
        for handle in self.handles:
            handle._close()


@dataclass
class EnvironmentRollouts:
    """What grpo.loop.rollout.sample_rollout needs to play a batch: the environments, the run's ToolSet (its
    standalone --tools, maybe none; the result tokens, the turn limit) and how prompts are encoded."""

    environments: Environments
    toolset: ToolSet
    template_kwargs: dict  # the chat template's keywords besides the tools
    max_prompt_length: int

    def begin(self, rows: list[dict], group: int, seeds: list[int]) -> tuple[Episodes, list[list[int]], int, list]:
        """Start N = len(rows) * group environments; returns (episodes, prompt token ids, completions per prompt,
        each rollout's prompt). Rollouts whose reset said the same share one prompt (one prefill per group);
        otherwise every rollout has its own."""
        from grpo.loop.prompts import encode_prompt

        episodes = self.environments.start(rows, group, seeds)
        try:
            prompts = [episodes.prompt(rows[rollout // group]["prompt"], rollout)
                       for rollout in range(len(rows) * group)]
            ids = [encode_prompt(self.toolset.tokenizer, prompt,
                                 episodes.template_kwargs(rollout, self.toolset.tools, self.template_kwargs))
                   for rollout, prompt in enumerate(prompts)]
            too_long = [len(encoded) for encoded in ids if len(encoded) > self.max_prompt_length]
            if too_long:  # as grpo.loop.prompts.encode_prompts: keep the end, the question and the assistant header
                logger.warning("%d of %d prompts with their environment's text and tools are longer than "
                               "max_prompt_length=%d (up to %d tokens) and were truncated from the left",
                               len(too_long), len(ids), self.max_prompt_length, max(too_long))
                ids = [encoded[-self.max_prompt_length:] for encoded in ids]
        except BaseException:
            episodes.close()
            raise
        if all(ids[rollout] == ids[rollout - rollout % group] for rollout in range(len(ids))):
            return episodes, ids[::group], group, prompts
        return episodes, ids, 1, prompts

    def sample_rollout(self, generation, tokenizer, reward_specs, rows: list[dict], prompt_ids, group: int, params,
                       noise, return_logprobs: bool = False):
        """grpo.loop.rollout.sample_rollout with environments (its arguments; `prompt_ids` unused, the prompts are
        encoded here with each reset's text): start one per completion, sample with their tools, score (reward
        functions get them as `environments`), then stop them all. Returns (rollout, prompts, texts)."""
        from grpo.loop.rollout import rollout_from_sample, rollout_seeds

        episodes, prompt_ids, per_prompt, prompts = self.begin(rows, group, rollout_seeds(noise, len(rows) * group))
        try:
            sample = generation.generate(prompt_ids, per_prompt, params, noise, return_logprobs=return_logprobs,
                                         tools=episodes.toolset(self.toolset))
            return rollout_from_sample(sample, tokenizer, reward_specs, rows, group, prompts,
                                       {"environments": episodes.handles}, per_prompt)
        finally:
            episodes.close()


@dataclass
class EpisodeTools:
    """What the sampler's `tools=` takes: `start` gives ToolTurns whose rows call their own environment's methods."""

    toolset: ToolSet
    episodes: Episodes

    def start(self, num_rows: int, max_new: int, device) -> ToolTurns:
        if num_rows != len(self.episodes.handles):
            raise ValueError(f"{num_rows} rows sampled for {len(self.episodes.handles)} environments")
        row_tools = []
        for rollout, handle in enumerate(self.episodes.handles):
            tools = dict(self.toolset.by_name)
            for method in self.episodes.environments.tools[self.episodes.names[rollout]]:
                tools[method.__name__] = _remote(handle, method.__name__, tool_parameters(method))
            row_tools.append(tools)
        return ToolTurns(self.toolset, num_rows, max_new, device, row_tools=row_tools)


def _remote(handle: EnvironmentHandle, name: str, parameters: dict) -> Callable:
    def call(**arguments):
        return handle._call(name, **arguments)
    call.__name__, call.parameters = name, parameters  # the schema is the probe's method's (grpo.loop.tools)
    return call


__all__ = ["Environments", "EnvironmentHandle", "EnvironmentRollouts", "EnvironmentStartError", "Episodes",
           "class_name", "load_environments", "tool_methods"]
