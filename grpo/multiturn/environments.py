"""Multi-turn environments (trl's `environment_factory`): each rollout plays against its own environment.

    factory      a class (or any callable) that makes an environment; `--environment module:Class` or
                 `file.py:Class`, several times (or a dict from Python) for a mix chosen by each row's
                 `environment` column
    reset        `reset(**row)` for each rollout before it samples: None, or a string appended to the last user
                 message of the row's prompt (so rollouts may start from different prompts)
    tools        the environment's public methods (not `reset`, `get_reward` or `_private`) are the rollout's tools,
                 run through grpo.multiturn.tools: the chat template shows their schemas, a turn that calls one gets the
                 result as forced tokens (tool_mask 0) and samples on
    get_reward   optional: called once when the rollout ends; a reward column named after the class, weight 1,
                 beside --reward (which may then be empty); None for rows of another environment
    rewards      reward functions get the rollouts' environments as the `environments` keyword (trl's)

Token in, token out: the sampler feeds each result into the same KV cache and the update reads the same
completion_ids, so what the model saw is what it is trained on; no turn is ever re-tokenized.

Isolation and reliability (where we differ from trl, which runs the instances in its own process and reuses them):
every rollout's environment is made fresh in its own forked process (its own process group; it dies with the
trainer), so no instance, class attribute or module global is shared between rollouts. A call that raises, returns
something other than a string or runs past `--environment-timeout` seconds (a reply that starts and stalls too) is
a failed call: `{"error": ...}` is the result the model reads and it counts in tools/failure_frequency; a timed-out
(or crashed) process is killed with its group, and every later call of that rollout fails too. Only exact plain
data comes back to the trainer (str subclasses made str), so no environment code runs in the trainer's process.
`reset` failing stops the step with the row's index (a broken environment is a bug, not a move); `get_reward`
failing scores the rollout None (left out of its weighted sum) with a warning, and so does any reward function's
read of a stopped environment (rewards.scoring.Unscorable). Each process seeds `random`, numpy's and torch's global
generators from the rollout's own sampling noise, so runs repeat, also resumed or on another world size.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import pickle
import random
import signal
import socket
import struct
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from grpo.multiturn.tools import ToolCallFailed, ToolSet, ToolTurns, tool_parameters
from rewards.scoring import FLOAT32_MAX, Unscorable

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


# The transport: a socket pair, each message an 8-byte length and a pickle. The trainer reads with a deadline on every
# byte (a reply that starts and stalls times out too); the environment's process only ever sends exact plain data.
PLAIN = (type(None), bool, int, float, str, bytes)


def _send(sock: socket.socket, message) -> None:
    payload = pickle.dumps(message)
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def _read(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket, deadline: float | None = None):
    (size,) = struct.unpack("!Q", _read(sock, 8, deadline))
    return pickle.loads(_read(sock, size, deadline))


def _plain(value, depth: int = 0):
    """`value` as exact plain data (str subclasses made str), or TypeError: what reaches the trainer runs no code of
    the environment's when it is unpickled or printed."""
    if depth > 32:
        raise TypeError("nested too deeply")
    if isinstance(value, str):
        return str.__str__(value)
    if type(value) in PLAIN:
        return value
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_plain(item, depth + 1) for item in value)
    if type(value) is dict:
        return {_plain(key, depth + 1): _plain(item, depth + 1) for key, item in value.items()}
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _plain(value.item(), depth + 1)  # a numpy scalar
    raise TypeError(f"a {type(value).__name__}, not plain data (None, bool, int, float, str, bytes, list, tuple, "
                    "dict, set)")


def _serve(sock: socket.socket, factory, row: dict, seed: int, trainer_pid: int) -> None:
    """The environment's process: make it, reset it with the row, then answer requests until told to stop."""
    owner = os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it kills this process
    os.setpgrp()  # a group of its own: stopping it also stops the programs it started (in their own group or not)
    if sys.platform.startswith("linux"):  # and it dies with the trainer, however the trainer dies
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != trainer_pid:  # the trainer died before that took effect
            return
    random.seed(seed)
    for name in ("numpy", "torch"):  # their global generators too, when the trainer has them
        module = sys.modules.get(name)
        if module is not None:
            module.random.seed(seed % 2**32) if name == "numpy" else module.manual_seed(seed)

    def reply(kind, value):
        if os.getpid() != owner:  # a copy the environment forked returned here: it must not answer
            os._exit(0)
        try:
            _send(sock, (kind, value))
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as error:  # it does not pickle
            _send(sock, ("error", f"{type(error).__name__}: {error}"))

    try:
        environment = factory()
        observation = environment.reset(**row)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}, not None or a string")
        observation = _plain(observation)
    except BaseException as error:  # noqa: BLE001 - reported to the trainer, which stops the step
        reply("error", f"{type(error).__name__}: {error}")
        return
    reply("ok", observation)
    while True:
        try:
            request, name, args, kwargs = _receive(sock)
        except (EOFError, OSError):  # the trainer is gone
            return
        if request == "close":
            return
        try:
            if request == "call":  # a tool call: its result must be a string
                result = getattr(environment, name)(**kwargs)
                if not isinstance(result, str):
                    raise TypeError(f"{name} returned {type(result).__name__}, not a string")
            elif request == "reward":  # a number, a bool, a numpy scalar (as trl's float tensor takes them) or None
                result = environment.get_reward()
                if result is not None:
                    if not isinstance(result, numbers.Real) and type(result).__module__ != "numpy":
                        raise TypeError(f"get_reward returned {result!r}, not a finite number")
                    if not math.isfinite(float(result)) or abs(float(result)) > FLOAT32_MAX:  # rewards are fp32
                        raise TypeError(f"get_reward returned {result!r}, not a finite number")
                    result = float(result)
            elif request == "getattr":  # a reward function reading the environment (trl's `environments`)
                try:
                    value = getattr(environment, name)
                except AttributeError as error:
                    reply("missing", str(error))
                    continue
                result = ("method", None) if callable(value) else ("value", value)
            else:  # "method": a method called by a reward function
                result = getattr(environment, name)(*args, **kwargs)
            result = _plain(result)
        except BaseException as error:  # noqa: BLE001 - SystemExit too: a failed call, the process goes on
            reply("error", f"{type(error).__name__}: {error}")
            continue
        reply("ok", result)


class EnvironmentGone(ToolCallFailed, Unscorable):
    """The rollout's environment was stopped (a call ran past the timeout) or its process died: a tool call fails,
    and a reward function that reads it scores that completion None."""


_OPEN: "weakref.WeakSet[EnvironmentHandle]" = weakref.WeakSet()  # the trainer's handles, which a new process closes


class EnvironmentHandle:
    """One rollout's environment, living in its own process: what reward functions get as `environments`. Any
    public attribute reads the environment's (`handle.score`, `handle.method(...)`; a missing one raises
    AttributeError), by a request with the timeout; the handle's own API is underscored so that it never hides one
    (tool calls `_call`, `_reward`)."""

    def __init__(self, factory, row: dict, class_name: str, seed: int, timeout: float):
        self._class_name, self._timeout, self._dead, self._status = class_name, timeout, None, None
        self._socket, theirs = socket.socketpair()
        trainer_pid = os.getpid()
        self._pid = os.fork()  # the factory and row are inherited, not pickled; a fork takes milliseconds
        if self._pid == 0:  # the environment's process
            try:
                self._socket.close()
                for handle in list(_OPEN):  # other rollouts' trainer ends: only the trainer may hold them
                    handle._socket.close()
                _serve(theirs, factory, row, seed, trainer_pid)
            finally:
                os._exit(0)  # never the trainer's exit handlers
        theirs.close()
        _OPEN.add(self)
        self._observation = None

    def _wait_for_reset(self, row: dict, index: int) -> None:
        try:
            self._observation = self._receive("reset")
        except ToolCallFailed as error:
            raise EnvironmentStartError(f"environment {self._class_name}: reset(**row) of row {index} failed: {error} "
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
            raise EnvironmentGone(f"{name}: the environment is gone ({self._dead})")
        try:
            _send(self._socket, (request, name, args, kwargs))
        except OSError:
            self._kill(f"its process exited{self._exit_status()}")
            raise EnvironmentGone(f"{name}: the environment is gone ({self._dead})") from None
        except (pickle.PicklingError, TypeError, AttributeError) as error:  # arguments that do not pickle
            raise ToolCallFailed(f"{name}: {type(error).__name__}: {error}") from None
        return self._receive(name)

    def _receive(self, name: str):
        try:
            kind, value = _receive(self._socket, time.monotonic() + self._timeout)
        except (socket.timeout, TimeoutError):
            self._kill(f"{name} ran past the {self._timeout:g} s timeout")
            raise EnvironmentGone(f"{name}: no answer within {self._timeout:g} s; the environment was "
                                  "stopped") from None
        except (EOFError, OSError, pickle.UnpicklingError, struct.error):
            self._kill(f"its process exited{self._exit_status(wait=1.0)}")
            raise EnvironmentGone(f"{name}: the environment's process died ({self._dead})") from None
        if kind == "missing":
            raise AttributeError(value)
        if kind == "error":
            raise ToolCallFailed(value)
        return value

    def _exit_status(self, wait: float = 0.0) -> str:
        """' with code N' (or ' on signal S') once the process has ended, waiting up to `wait` seconds for it."""
        deadline = time.monotonic() + wait
        while self._status is None:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
            if pid:
                self._status = status
            elif time.monotonic() >= deadline:
                return ""
            else:
                time.sleep(0.01)
        if os.WIFSIGNALED(self._status):
            return f" on signal {signal.Signals(os.WTERMSIG(self._status)).name}"
        return f" with code {os.WEXITSTATUS(self._status)}"

    def _kill(self, reason: str) -> None:
        self._dead = self._dead or reason
        for kill in (os.killpg, os.kill):  # its group, and itself wherever it moved
            try:
                kill(self._pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._exit_status(wait=5.0)  # reaped, no zombie

    def _close(self, asked: bool = False) -> None:
        """Ask the process to end (unless `asked` already), give it half a second, then kill what is left."""
        if not asked:
            self._ask_to_close()
        if self._dead is None:
            self._exit_status(wait=0.5)
        self._kill("closed")
        self._socket.close()
        _OPEN.discard(self)

    def _ask_to_close(self) -> None:
        if self._dead is None:
            try:
                _send(self._socket, ("close", "", (), {}))
            except OSError:
                pass


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
        for handle in self.handles:  # all asked first, so that they end side by side
            handle._ask_to_close()
        for handle in self.handles:
            handle._close(asked=True)


@dataclass
class EnvironmentRollouts:
    """What grpo.generation.rollout.sample_rollout needs to play a batch: the environments, the run's ToolSet (its
    standalone --tools, maybe none; the result tokens, the turn limit) and how prompts are encoded."""

    environments: Environments
    toolset: ToolSet
    template_kwargs: dict  # the chat template's keywords besides the tools
    max_prompt_length: int

    def begin(self, rows: list[dict], group: int, seeds: list[int]) -> tuple[Episodes, list[list[int]], int, list]:
        """Start N = len(rows) * group environments; returns (episodes, prompt token ids, completions per prompt,
        each rollout's prompt). Rollouts whose reset said the same share one prompt (one prefill per group);
        otherwise every rollout has its own."""
        from grpo.generation.prompts import encode_prompt

        episodes = self.environments.start(rows, group, seeds)
        try:
            prompts = [episodes.prompt(rows[rollout // group]["prompt"], rollout)
                       for rollout in range(len(rows) * group)]
            ids = [encode_prompt(self.toolset.tokenizer, prompt,
                                 episodes.template_kwargs(rollout, self.toolset.tools, self.template_kwargs))
                   for rollout, prompt in enumerate(prompts)]
            too_long = [len(encoded) for encoded in ids if len(encoded) > self.max_prompt_length]
            # as grpo.generation.prompts.encode_prompts: keep the end, the question and the assistant
            # header
            if too_long:
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
        """grpo.generation.rollout.sample_rollout with environments (its arguments; `prompt_ids` unused, the prompts are
        encoded here with each reset's text): start one per completion, sample with their tools, score (reward
        functions get them as `environments`), then stop them all. Returns (rollout, prompts, texts)."""
        from grpo.algorithm.sampler import row_seeds
        from grpo.generation.rollout import rollout_from_sample

        episodes, prompt_ids, per_prompt, prompts = self.begin(rows, group, row_seeds(noise, len(rows) * group))
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
    call.__name__, call.parameters = name, parameters  # the schema is the probe's method's (grpo.multiturn.tools)
    return call


__all__ = ["Environments", "EnvironmentHandle", "EnvironmentRollouts", "EnvironmentStartError", "Episodes",
           "class_name", "load_environments", "tool_methods"]
