"""Tool calls inside the rollout (trl's `tools=`): a completion that calls a tool gets the result and goes on.

    turn     the model writes <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes / Qwen2.5 format)
             and ends its turn with EOS
    call     the turn's tool calls run; an exception, an unknown tool or a malformed call gives the result
             {"error": ...} and counts as a failure
    result   the tool messages, rendered by the chat template up to the next assistant header, are fed to that
             row as forced tokens, one per decode step, while the other rows of the batch keep sampling
             (no group stall); their tool_mask is 0, so the loss, the KL and the entropy never count them
    resume   the row samples its next turn from its KV cache, which now holds the result

A turn without a tool call ends the row, and so does the max_tool_calling_iterations-th turn that calls one.
The completion budget (max_completion_length) counts every turn and every result: a result that would not fit
is dropped and the row ends after its call (trl's rule); a turn that reaches the budget is truncated.

Tools are plain Python functions with type hints and a docstring (transformers turns them into the JSON schema
that the chat template puts in the prompt); they run in the trainer's process, between two decode steps, so a
slow tool holds up the batch. `rewards.sandbox` runs untrusted code in a separate process.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from rewards.registry import load_function

logger = logging.getLogger("grpo")

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def load_tools(specs: list[str]) -> list[Callable]:
    """`module:function` or `path/to/file.py:function` names (the CLI's --tools) -> the functions."""
    return [load_function(spec, "tool") for spec in specs]


def parse_tool_calls(text: str) -> list[dict]:
    """The <tool_call>{json}</tool_call> blocks of a turn, as chat-template tool calls
    ({"type": "function", "function": {"name", "arguments"}}); a block that is not such JSON gets an "error"."""
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError("the arguments must be a JSON object")
            calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
        except ValueError as error:  # json.JSONDecodeError is a ValueError
            calls.append({"type": "function", "function": {"name": "unknown", "arguments": {}},
                          "error": f"malformed tool call: {error}"})
    return calls


class ToolCallFailed(Exception):
    """A tool that reports its own failure (an environment's call that raised, timed out or returned a non-string):
    the model reads the message as it is."""


def tool_parameters(tool: Callable) -> dict:
    """{argument: its JSON schema} of a tool, from its type hints and docstring as the chat template shows them
    (`parameters` set on a function that stands for another: an environment's method in its own process)."""
    if hasattr(tool, "parameters"):
        return tool.parameters
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)["function"]["parameters"].get("properties", {})
    except Exception:  # noqa: BLE001 - no schema (no docstring): the arguments go as the model wrote them
        return {}


def coerce_arguments(arguments: dict, parameters: dict) -> dict:
    """A string argument whose schema declares no string, converted to the declared type where it reads as one
    ("42" -> 42 for an integer, "true" -> True for a boolean, a JSON list or object), as transformers' response
    parser does for trl; anything else as written."""
    coerced = {}
    for key, value in arguments.items():
        declared = parameters.get(key, {}).get("type")
        types = declared if isinstance(declared, list) else [declared]
        coerced[key] = value if not isinstance(value, str) or "string" in types else _coerce(value, types)
    return coerced


def _coerce(text: str, types: list) -> object:
    for kind in types:
        try:
            if kind == "integer" and float(text).is_integer():  # "3.0" too, as JSON Schema's integers
                return int(float(text)) if not text.strip().lstrip("+-").isdigit() else int(text)
            if kind == "number" and math.isfinite(float(text)):
                return int(float(text)) if float(text).is_integer() and "." not in text else float(text)
            if kind == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
                return text.strip().lower() in ("true", "1")
            if kind in ("object", "array") and isinstance(json.loads(text), dict if kind == "object" else list):
                return json.loads(text)
        except ValueError:
            continue
    return text


def typed_calls(calls: list[dict], tools: dict[str, Callable]) -> list[dict]:
    """Parsed calls with their string arguments converted to the types their tool's schema declares
    (`coerce_arguments`), as trl's calls are."""
    return [call if "error" in call or call["function"]["name"] not in tools else
            {**call, "function": {**call["function"], "arguments": coerce_arguments(
                call["function"]["arguments"], tool_parameters(tools[call["function"]["name"]]))}}
            for call in calls]


def run_tool_call(tools: dict[str, Callable], call: dict) -> tuple[str, str, bool]:
    """(tool name, result text, failed) of one parsed call; nothing it does raises."""
    name = call["function"]["name"]
    if "error" in call:
        return name, json.dumps({"error": call["error"]}), True
    if name not in tools:
        return name, json.dumps({"error": f"Tool {name} not found."}), True
    try:
        return name, str(tools[name](**call["function"]["arguments"])), False
    except ToolCallFailed as error:
        return name, json.dumps({"error": str(error)}), True
    except (Exception, SystemExit) as error:  # noqa: BLE001 - a failing tool is reported back to the model
        return name, json.dumps({"error": f"{type(error).__name__}: {error}"}), True


def tool_suffix_ids(tokenizer, tool_messages: list[dict], eos_token_id: int,
                    chat_template_kwargs: dict | None = None) -> list[int]:
    """The tokens that follow an assistant turn's EOS: the tool messages and the next assistant header, as the
    chat template renders them (trl's `_get_tool_suffix_ids`: a dummy conversation with and without them)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kwargs = dict(tokenize=True, return_dict=False, **(chat_template_kwargs or {}))
    prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kwargs))
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **kwargs))
    ends = [i for i, token in enumerate(prefix) if token == eos_token_id]
    if ends:  # the turn ends at its EOS; what a template writes after it ("\n") belongs to the suffix
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders an assistant turn differently when tool messages follow it; "
                         "tool calls need a template whose earlier turns do not change")
    return full[len(prefix):]


@dataclass
class ToolSet:
    """The run's tools and how their results become tokens (one per run; `start` makes one sampling call's state)."""

    tools: list[Callable]
    tokenizer: object
    eos_token_id: int
    max_iterations: int | None = None  # tool-calling turns per completion; None: until the budget
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.by_name = {tool.__name__: tool for tool in self.tools}

    def start(self, num_rows: int, max_new: int, device) -> "ToolTurns":
        return ToolTurns(self, num_rows, max_new, device)


class ToolTurns:
    """One sampling call's tool state, N rows: results waiting to be fed, the tool mask, calls, messages.
    `row_tools`: each row's own {name: function} (environments, grpo.multiturn.environments); default the run's
    tools."""

    def __init__(self, toolset: ToolSet, num_rows: int, max_new: int, device, row_tools: list[dict] | None = None):
        self.toolset, self.max_new = toolset, max_new
        self.row_tools = row_tools or [toolset.by_name] * num_rows
        self.tool_mask = torch.ones(num_rows, max_new, dtype=torch.long, device=device)  # (N, T)
        self.calls = torch.zeros(num_rows, 3, dtype=torch.long)  # (N, 3) calls made, calls failed, assistant turns
        self.waiting: list[list[int]] = [[] for _ in range(num_rows)]  # result tokens each row still has to take
        self.turn_start = [0] * num_rows  # where each row's current assistant turn began
        self.turns = [0] * num_rows  # tool-calling turns so far
        self.messages: list[list[dict]] = [[] for _ in range(num_rows)]  # [assistant, tool..., assistant, ...]
        self.fed = torch.zeros(num_rows, dtype=torch.bool, device=device)  # (N,) rows fed a result token this step

    def feed(self, step: int, tokens: torch.Tensor) -> torch.Tensor:
        """(N,) this step's tokens, with the next result token in place of the sampled one where a row waits."""
        rows = [row for row, waiting in enumerate(self.waiting) if waiting]
        self.fed.zero_()
        if not rows:
            return tokens
        index = torch.tensor(rows, device=tokens.device)
        forced = torch.tensor([self.waiting[row].pop(0) for row in rows], device=tokens.device)
        self.fed[index] = True
        self.tool_mask[index, step] = 0
        return tokens.index_put((index,), forced)

    def end_turns(self, step: int, completion_ids: torch.Tensor, hit_eos: torch.Tensor) -> torch.Tensor:
        """(N,) the rows that end here: those that drew EOS, except the ones whose turn called a tool, which get
        its result to take next (when it fits the budget and the turn limit allows)."""
        hit_eos = hit_eos & ~self.fed  # an EOS inside a result (the template's end of a message) ends nothing
        if not bool(hit_eos.any()):
            return hit_eos
        toolset, limit = self.toolset, self.toolset.max_iterations
        for row in hit_eos.nonzero().flatten().tolist():
            text = toolset.tokenizer.decode(completion_ids[row, self.turn_start[row] : step + 1].tolist(),
                                            skip_special_tokens=True)
            calls = typed_calls(parse_tool_calls(text), self.row_tools[row])
            if not calls or (limit is not None and self.turns[row] >= limit):
                continue
            results = [run_tool_call(self.row_tools[row], call) for call in calls]
            tool_messages = [{"role": "tool", "name": name, "content": content} for name, content, _ in results]
            suffix = tool_suffix_ids(toolset.tokenizer, tool_messages, toolset.eos_token_id,
                                     toolset.chat_template_kwargs)
            self.calls[row, 0] += len(calls)
            self.calls[row, 1] += sum(failed for _, _, failed in results)
            if step + 1 + len(suffix) > self.max_new:  # the result does not fit: the row ends with its call
                continue
            # the turn's text around its calls, as trl's parse_response gives it; the calls as parsed
            turn = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip(), "tool_calls": calls}
            self.messages[row] += [turn, *tool_messages]
            self.waiting[row] = suffix
            self.turn_start[row] = step + 1 + len(suffix)
            self.turns[row] += 1
            hit_eos[row] = False
        return hit_eos

    def finish(self, sample):
        """The GroupSample with the tool mask, the calls and each row's messages (its last turn added)."""
        steps = sample.completion_ids.shape[1]
        sample.tool_mask = self.tool_mask[:, :steps]  # (N, T)
        if sample.logprobs is not None:
            sample.logprobs = sample.logprobs * sample.tool_mask
        lengths = sample.completion_mask.sum(-1).tolist()
        for row, length in enumerate(lengths):
            if self.turn_start[row] < length:
                text = self.toolset.tokenizer.decode(sample.completion_ids[row, self.turn_start[row] : length].tolist(),
                                                     skip_special_tokens=True)
                self.messages[row].append({"role": "assistant", "content": text})
        self.calls[:, 2] = torch.tensor(self.turns) + 1  # every row ends with a turn that called nothing
        sample.tool_calls, sample.messages = self.calls, self.messages
        return sample


def check_template_renders_tools(tokenizer, tools: list[Callable]) -> bool:
    """Whether the chat template writes the tools' schemas into a prompt (if not, the task's system prompt
    has to describe them)."""
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) != plain
