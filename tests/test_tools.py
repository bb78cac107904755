"""Tool calls in the rollout (grpo/multiturn/tools.py): parsing, running, the result's tokens, and the sampler's loop.

The sampler tests drive the tiny model's KV cache with scripted logits: each row writes a planned completion
(its turns), and where the plan has nothing (the tool result's positions) the model would write `FILLER`, so a
result that is not fed in shows up as filler tokens.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from data.calculator import calculator
from rewards.tools import tool_call_format, tool_success
from grpo.config import GRPOConfig
from grpo.generation.rollout import make_generation_backend
from tests.conftest import record_updates
from grpo.algorithm.sampler import SamplingParams, sample_groups
from grpo.multiturn.tools import ToolSet, load_tools, parse_tool_calls, run_tool_call, tool_suffix_ids

FILLER = 7


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def broken(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("out of order")


def call_text(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class Scripted(torch.nn.Module):
    """The tiny model's forward pass and cache, with logits that choose plans[row][i] as completion token i
    (i = input position - the row's prompt length + 1); FILLER where the plan is shorter or has None."""

    def __init__(self, model, plans: list[list[int | None]], group: int):
        super().__init__()
        self.inner, self.config, self.plans, self.group = model, model.config, plans, group

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=use_cache, logits_to_keep=logits_to_keep)
        prefill = input_ids.shape[1] > 1
        if prefill:  # B prompts: each row's prompt length
            self.prompt_lens = attention_mask.sum(-1).repeat_interleave(self.group).tolist()
        logits = torch.full((input_ids.shape[0], 1, self.config.vocab_size), -1e4)
        for batch_row in range(input_ids.shape[0]):
            row = batch_row * self.group if prefill else batch_row  # a prompt's prefill gives its group's first token
            index = int(position_ids[batch_row, -1]) - self.prompt_lens[row] + 1
            plan = self.plans[row]
            token = plan[index] if index < len(plan) and plan[index] is not None else FILLER
            logits[batch_row, 0, token] = 0.0
        out.logits = logits
        return out


@pytest.fixture(scope="module")
def setup(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tools=[add, broken],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    return model, tokenizer, list(prompt)


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    return ids


def suffix(tokenizer, *results, name="add") -> list[int]:
    return tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": r} for r in results],
                           tokenizer.eos_token_id)


def run(setup, plans, group, budget=200, max_iterations=None, tools=(add, broken), logprobs=False):
    model, tokenizer, prompt = setup
    eos = tokenizer.eos_token_id
    scripted = Scripted(model, plans, group)
    params = SamplingParams(max_completion_length=budget, temperature=0.0, eos_token_ids=(eos,))
    toolset = ToolSet(list(tools), tokenizer, eos, max_iterations)
    prompts = [prompt] * (len(plans) // group)
    return sample_groups(scripted, prompts, group, params, tokenizer.pad_token_id, return_logprobs=logprobs,
                         tools=toolset)


def test_parse_tool_calls_reads_hermes_blocks_and_names_malformed_ones():
    text = "Let me add. " + call_text("add", a=2, b=3) + " and " + call_text("add", a=1, b=1)
    calls = parse_tool_calls(text)
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": {"a": 2, "b": 3}},
                                             {"name": "add", "arguments": {"a": 1, "b": 1}}]
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')[0][
        "function"]["arguments"] == {"a": 1, "b": 2}  # arguments written as a JSON string
    assert parse_tool_calls("no call here") == []
    for bad in ("<tool_call>{not json</tool_call>", '<tool_call>["add"]</tool_call>',
                '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'):
        (call,) = parse_tool_calls(bad)
        assert call["error"].startswith("malformed tool call"), bad


def test_run_tool_call_turns_every_failure_into_an_error_result():
    tools = {"add": add, "broken": broken}
    assert run_tool_call(tools, parse_tool_calls(call_text("add", a=2, b=3))[0]) == ("add", "5", False)
    name, result, failed = run_tool_call(tools, parse_tool_calls(call_text("broken", x=1))[0])
    assert (name, failed) == ("broken", True) and "RuntimeError: out of order" in json.loads(result)["error"]
    name, result, failed = run_tool_call(tools, parse_tool_calls(call_text("nope"))[0])
    assert failed and json.loads(result) == {"error": "Tool nope not found."}
    _, result, failed = run_tool_call(tools, parse_tool_calls(call_text("add", a=1))[0])  # a missing argument
    assert failed and "TypeError" in result
    _, result, failed = run_tool_call(tools, parse_tool_calls("<tool_call>{oops</tool_call>")[0])
    assert failed and "malformed" in result
    _, result, failed = run_tool_call({"quit": sys.exit}, parse_tool_calls(call_text("quit"))[0])
    assert failed and "SystemExit" in result  # a tool that exits does not end the run


def test_load_tools_names_the_bad_spec():
    assert load_tools(["json:dumps", "data.calculator:calculator"]) == [json.dumps, calculator]
    for spec, message in (("add", "expected module:function"), ("json:nothing", "has no function"),
                          ("no_such_module:f", "cannot import module"), ("json:__doc__", "has no function"),
                          ("missing.py:f", "no such file")):
        with pytest.raises(ValueError, match=f"tool {spec!r}: .*{message}"):
            load_tools([spec])


def test_result_tokens_are_what_the_template_writes_after_the_turn(setup):
    _, tokenizer, _ = setup
    assert tokenizer.decode(suffix(tokenizer, "5")) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                                        "<|im_end|>\n<|im_start|>assistant\n")
    # the tokens equal a conversation rendered whole: turn, result, next header
    model_turn = call_text("add", a=2, b=3)
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": model_turn},
                {"role": "tool", "name": "add", "content": "5"}]
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert whole.endswith(model_turn + "<|im_end|>" + tokenizer.decode(suffix(tokenizer, "5")))


def test_a_group_whose_rows_call_tools_at_different_steps(setup):
    _, tokenizer, _ = setup
    eos = tokenizer.eos_token_id
    first = encode(tokenizer, "Let me use the tool. ")
    call_23, call_broken = encode(tokenizer, call_text("add", a=2, b=3)), encode(tokenizer, call_text("broken", x=1))
    answer = encode(tokenizer, "<answer>5</answer>")
    s5, s_err = suffix(tokenizer, "5"), suffix(tokenizer, json.dumps({"error": "RuntimeError: out of order"}),
                                                name="broken")
    pad = [None]
    plans = [
        first[:1] + call_23[:] + [eos],  # calls early
        first + answer + [eos],  # no call: ends first, the others keep going
        first + first + call_23 + [eos],  # calls later
        first + call_broken + [eos],  # a failing tool
    ]
    expected = [plans[0] + s5 + answer + [eos], plans[1], plans[2] + s5 + answer + [eos],
                plans[3] + s_err + answer + [eos]]
    results = [s5, None, s5, s_err]
    full_plans = [plan + (pad * len(r) + answer + [eos] if r else []) for plan, r in zip(plans, results)]
    sample = run(setup, full_plans, group=4, logprobs=True)

    lengths = sample.completion_mask.sum(-1).tolist()
    assert lengths == [len(e) for e in expected]
    for row, tokens in enumerate(expected):
        assert sample.completion_ids[row, : lengths[row]].tolist() == tokens, row
        mask = [1] * len(plans[row]) + ([0] * len(results[row]) + [1] * (len(answer) + 1) if results[row] else [])
        assert sample.tool_mask[row, : lengths[row]].tolist() == mask, row
        assert torch.all(sample.logprobs[row, : lengths[row]][torch.tensor(mask) == 0] == 0)
    assert not sample.truncated.any()
    assert sample.tool_calls.tolist() == [[1, 0, 2], [0, 0, 1], [1, 0, 2], [1, 1, 2]]  # calls, failed, turns
    assert [m["role"] for m in sample.messages[0]] == ["assistant", "tool", "assistant"]
    assert sample.messages[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert sample.messages[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert sample.messages[0][2]["content"] == "<answer>5</answer>"
    assert sample.messages[1] == [{"role": "assistant", "content": tokenizer.decode(first + answer)}]


def test_several_turns_budget_and_turn_limit(setup):
    _, tokenizer, _ = setup
    eos = tokenizer.eos_token_id
    call_23, call_11 = encode(tokenizer, call_text("add", a=2, b=3)), encode(tokenizer, call_text("add", a=1, b=1))
    answer = encode(tokenizer, "<answer>7</answer>")
    s5, s2 = suffix(tokenizer, "5"), suffix(tokenizer, "2")
    two_calls = call_23 + [eos] + [None] * len(s5) + call_11 + [eos] + [None] * len(s2) + answer + [eos]
    plans = [two_calls, list(two_calls)]

    sample = run(setup, plans, group=2, budget=300)  # no limit: two tool turns, then the answer
    full = call_23 + [eos] + s5 + call_11 + [eos] + s2 + answer + [eos]
    assert sample.completion_ids[0, : len(full)].tolist() == full
    assert sample.tool_calls[0].tolist() == [2, 0, 3] and [m["role"] for m in sample.messages[0]] == [
        "assistant", "tool", "assistant", "tool", "assistant"]

    sample = run(setup, plans, group=2, max_iterations=1)  # the second call is not run: the row ends there
    ends_at = call_23 + [eos] + s5 + call_11 + [eos]
    assert sample.completion_mask[0].sum().item() == len(ends_at)
    assert sample.completion_ids[0, : len(ends_at)].tolist() == ends_at and not sample.truncated[0]
    assert sample.tool_calls[0].tolist() == [1, 0, 2]  # the turn that called past the limit is the last

    budget = len(call_23) + 1 + len(s5) - 1  # the result does not fit: dropped, the row ends after its call
    sample = run(setup, plans, group=2, budget=budget)
    assert sample.completion_mask[0].sum().item() == len(call_23) + 1 and not sample.truncated[0]
    assert sample.tool_mask[0].tolist() == [1] * sample.tool_mask.shape[1]
    assert sample.tool_calls[0].tolist() == [1, 0, 1]  # the call was made (as trl counts it), its result dropped

    budget = len(call_23) + 1 + len(s5) + 3  # the result fits, the next turn is cut at the budget
    sample = run(setup, plans, group=2, budget=budget)
    assert sample.completion_mask[0].sum().item() == budget and sample.truncated[0]
    assert sample.completion_ids[0].tolist() == call_23 + [eos] + s5 + call_11[:3]
    assert sample.tool_mask[0].tolist() == [1] * (len(call_23) + 1) + [0] * len(s5) + [1] * 3


def test_tools_run_through_our_sampler_whatever_the_kernel(setup):
    model, tokenizer, prompt = setup

    def fast_sampler(*args, **kwargs):
        raise AssertionError("the kernel sampler cannot feed tool results")

    toolset = ToolSet([add], tokenizer, tokenizer.eos_token_id)
    backend = make_generation_backend("sampler", model, tokenizer.pad_token_id, fast_sampler, toolset)
    params = SamplingParams(max_completion_length=4, temperature=1.0, eos_token_ids=(tokenizer.eos_token_id,))
    sample = backend.generate([prompt], 2, params, torch.Generator().manual_seed(0))
    assert sample.tool_mask is not None and sample.tool_calls.shape == (2, 3)
    with pytest.raises(ValueError, match="tools and environments need --generation-backend sampler"):  # checked once, by the config
        GRPOConfig(tools=["data.calculator:calculator"], generation_backend="transformers").validate()


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert [calculator(e) for e in ("48 / 2 + 3", "2 ** 10", "7 / 3", "-(3 - 5) * 1,000", "2^3", "17 % 5")] == [
        "27", "1024", "2.33333", "2000", "8", "2"]
    for bad in ("__import__('os').system('ls')", "x + 1", "2 ** 1000", "10 ** 40", "(", "1" * 300, "[1] * 3"):
        with pytest.raises(ValueError):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):  # reported to the model as {"error": "ZeroDivisionError: ..."}
        calculator("1 / 0")


def test_tool_success_pays_only_for_calls_that_all_worked():
    ok = [{"role": "assistant", "content": "c"}, {"role": "tool", "name": "calculator", "content": "5"},
          {"role": "assistant", "content": "a"}]
    failed = [ok[0], {"role": "tool", "name": "calculator", "content": '{"error": "Tool x not found."}'}, ok[2]]
    mixed = ok[:2] + failed[1:]
    assert tool_success(None, [ok, failed, mixed, ok[:1], "plain text"]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    called = [{"role": "assistant", "content": "<tool_call>...</tool_call>",
               "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {}}}]}]
    malformed = [{"role": "assistant", "content": "<tool_call>{oops</tool_call>",
                  "tool_calls": [{"type": "function", "function": {"name": "unknown", "arguments": {}}, "error": "x"}]}]
    begun = [{"role": "assistant", "content": "<tool_call>\n{\"name\": 1"}]
    assert tool_call_format(None, [called, malformed, begun, ok[:1], "<tool_call>"]) == [1.0, 0.5, 0.5, 0.0, 0.5]


@pytest.mark.slow
def test_a_training_step_on_tool_rollouts(tmp_path):
    """The trainer with --tools: the scripted policy calls the calculator in some rows; the rollout's loss mask
    leaves the results out, the rewards see the turns as messages, and the tool metrics are logged."""
    from grpo.config import GRPOConfig
    from grpo.core.metrics import read_jsonl
    from grpo.core.trainer import Trainer

    seen = {}

    def spy(prompts, completions, **kwargs):
        seen["completions"] = completions
        return [float(len(c)) for c in completions]

    config = GRPOConfig(model="tiny", dataset="synthetic:16", output_dir=str(tmp_path / "run"), max_steps=1,
                        prompts_per_step=2, num_generations=2, micro_batch_size=2, max_prompt_length=256,
                        max_completion_length=160, device="cpu", precision="fp32", save_steps=0, eval_steps=0,
                        log_completions_steps=0, tools=["data.calculator:calculator"], reward=["int"], beta=0.04)
    trainer = Trainer(config, reward_functions=[spy])
    tokenizer, eos = trainer.data.tokenizer, trainer.data.tokenizer.eos_token_id
    call = encode(tokenizer, call_text("calculator", expression="2 + 3"))
    answer = encode(tokenizer, "<answer>5</answer>")
    result = suffix(tokenizer, "5", name="calculator")
    plans = [call + [eos] + [None] * len(result) + answer + [eos], answer + [eos]] * 2
    plans[1][0] = plans[3][0] = call[0]  # each group's rows share their first token
    trainer.generation.model = Scripted(trainer.policy, plans, group=2)
    records = record_updates(trainer)
    trainer.train()

    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert metrics["tools/call_frequency"] == 0.5 and metrics["tools/failure_frequency"] == 0.0
    model_tokens = [len(call) + 1 + len(answer) + 1, len(answer) + 1] * 2
    assert metrics["completions/mean_length"] == sum(model_tokens) / 4  # the results are not the model's tokens
    assert records[0].num_items_in_batch == sum(model_tokens)  # the loss's token count leaves them out
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool", "assistant"]
    assert seen["completions"][0][1]["content"] == "5"


def test_rollout_from_token_lists_keeps_tool_results_out_of_the_loss_mask():
    from grpo.generation.rollout import Rollout

    eos, pad = 2, 0
    completions = [[5, eos, 9, eos, 6, 7, eos], [5, 6, eos]]  # row 0: a turn, a result (9, EOS) and a second turn
    masks = [[1, 1, 0, 0, 1, 1, 1], [1, 1, 1]]
    rollout = Rollout.from_token_lists([[4], [4]], completions, [1.0, 0.0], (eos,), pad, masks)
    assert rollout.completion_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]  # the result's EOS ends nothing
    assert rollout.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]]
    assert not rollout.truncated.any()
    with pytest.raises(ValueError, match="one 0/1 value per completion token"):
        Rollout.from_token_lists([[4], [4]], completions, [1.0, 0.0], (eos,), pad, [masks[0], [1]])


def test_string_arguments_take_the_type_their_schema_declares():
    from grpo.multiturn.tools import coerce_arguments, tool_parameters, typed_calls

    parameters = {"a": {"type": "integer"}, "b": {"type": "number"}, "c": {"type": "boolean"}, "d": {"type": "string"},
                  "e": {"type": "array"}, "f": {"type": ["integer", "null"]}}
    assert coerce_arguments({"a": "42", "b": "3.5", "c": "true", "d": "7", "e": "[1, 2]", "f": "x", "g": "9"},
                            parameters) == {"a": 42, "b": 3.5, "c": True, "d": "7", "e": [1, 2], "f": "x", "g": "9"}
    assert coerce_arguments({"a": "3.0", "b": "7"}, parameters) == {"a": 3, "b": 7}
    as_written = {"a": "3.5", "b": "nan", "c": "maybe"}
    assert coerce_arguments(as_written, parameters) == as_written
    assert tool_parameters(add) == {"a": {"type": "integer", "description": "The first number."},
                                    "b": {"type": "integer", "description": "The second number."}}
    (call,) = typed_calls(parse_tool_calls(call_text("add", a="2", b=3)), {"add": add})
    assert call["function"]["arguments"] == {"a": 2, "b": 3}
