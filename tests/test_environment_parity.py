"""Parity with trl 1.16's `environment_factory` on one fixed multi-turn rollout, and one update on it.

Both trainers play the same environment (`Vault`, below) from the same tiny model folder, fp32 on CPU, with the
policy's turns scripted and everything else their own:

    trl    GRPOTrainer(environment_factory=Vault): its environment pool, reset(**row) appended to the prompt, its
           `_tool_call_loop` (parsing, running the calls, `_get_tool_suffix_ids`, tool_mask) and the get_reward
           column. Only `_generate_single_turn` is replaced: it hands each rollout its next planned turn (the first
           call gets every rollout; each later call the rollouts whose last turn called a tool, in ascending order,
           which the stand-in checks by the tokens it is given).
    ours   Trainer(environment_factory=Vault): `collect_rollout`, i.e. sample_rollout with our environment processes
           and our sampler's tool loop, the policy wrapped in tests.test_tools.Scripted so that each row writes its
           plan (None where a tool result is fed in, its length that of the result the environment must give).

Compared: every completion's token ids, the tool masks (trl's `tool_mask`, ours `Rollout.tool_mask`; both also
against the masks written by hand from the plan), the messages reward functions see (roles, tool calls, tool results,
the last turn), the reward columns (`answer` and `Vault`, get_reward's, weight 1) and their values derived by hand,
the advantages, reference and old log-probs, each micro-batch's loss and the clipped gradient of every optimizer step,
at the parity suite's tolerances (rtol 1e-5, atol 1e-6; the gradient's atol 1e-6 of its largest entry, 5e-5 in an
off-policy second update; tests/test_trl_parity.py), and the logged tool, length and reward metrics.

The rollouts (N = 2 prompts x G = 3), with the results each call must get:

    r0  code 42    try_code(42) -> "open", then answers                        1 call
    r1  code 42    answers at once                                            0 calls
    r2  code 42    peek(0) -> "digit 0 is 4"; try_code(42) -> "open"; answers  2 calls in two turns
    r3  code 1234  peek(3) and try_code(1233) in one turn -> two results        2 calls in one turn
    r4  code 1234  try_code(1234) -> "open", then a turn cut at the budget     1 call, truncated
    r5  code 1234  answers at once                                            0 calls

trl reuses pooled instances in its own process, we make a fresh one per rollout in its own process: a deterministic
environment whose reset sets all its state gives the same results either way. A call routed to another rollout's
environment changes a result (so the tokens) or a tally (so get_reward).

test_the_messages_of_a_turn_are_trls compares single turns as trl's parser and our tool loop read them: the text of
a turn (around its calls) and its calls, arguments typed by the tool's schema. Where we differ on purpose (a malformed
<tool_call> block is a failed call the model is told about; trl reads it as text and ends the rollout) it pins the
difference as a strict xfail; the rollout above writes none of them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[parity]' (trl==1.16.0)")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grpo.config import GRPOConfig  # noqa: E402
from grpo.multiturn.tools import tool_suffix_ids  # noqa: E402
from grpo.core.trainer import Trainer  # noqa: E402
from grpo.tiny_model import save_tiny_model  # noqa: E402
from rewards import RewardSpec  # noqa: E402
from tests.test_tools import Scripted, call_text, encode  # noqa: E402
from tests.test_trl_parity import ADAM_EPS, BASE, LR, OFF, _extras, trl_step, update_in_rollout_order  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.slow]
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

PROMPTS, GROUP = 2, 3
MAX_LEN = 256  # completion budget: r2 (247 tokens) and r3 (243) fit, r4 (290) is cut
ANSWER_WEIGHT = 0.5  # the `answer` reward's weight; get_reward's is 1 on both sides


class Vault:
    """A lock with the row's code: `try_code` opens it, `peek` tells one digit. Every call is tallied."""

    def reset(self, **row):
        self.code, self.tries, self.peeks, self.opened = row["code"], 0, 0, False
        return f" The vault's code has {len(str(self.code))} digits."

    def peek(self, position: int) -> str:
        """Reveal one digit of the code.

        Args:
            position: Which digit, counted from 0.
        """
        self.peeks += 1
        return f"digit {position} is {str(self.code)[position]}"

    def try_code(self, code: int) -> str:
        """Try a code on the vault.

        Args:
            code: The code to try.
        """
        self.tries += 1
        self.opened = self.opened or code == self.code
        return "open" if code == self.code else f"wrong ({self.tries} tries)"

    def get_reward(self) -> float:
        return 2.0 * self.opened - 0.25 * self.tries - 0.1 * self.peeks


def answer(prompts, completions, code, **kwargs):
    """1 when the last turn names the code, plus 0.5 a tool result: reads the messages and a dataset column."""
    return [float(str(c) in messages[-1]["content"]) + 0.5 * sum(m["role"] == "tool" for m in messages)
            for messages, c in zip(completions, code, strict=True)]


ROWS = [{"prompt": [{"role": "user", "content": "Open the vault."}], "code": 42},
        {"prompt": [{"role": "user", "content": "Open the other vault."}], "code": 1234}]

# Each rollout's turns: (what the model writes, the results its calls must get). Every first turn starts with
# "Let me" (a group's rows share their first token: one prefill per group on our side).
TURNS = [
    [("Let me try. " + call_text("try_code", code=42), ["open"]), ("Opened: 42.", [])],
    [("Let me guess: 42.", [])],
    [("Let me look. " + call_text("peek", position=0), ["digit 0 is 4"]),
     ("Now " + call_text("try_code", code=42), ["open"]), ("Done, 42.", [])],
    [("Let me " + call_text("peek", position=3) + call_text("try_code", code=1233), ["digit 3 is 4", "wrong (1 tries)"]),
     ("Hmm, 1233 failed.", [])],
    [("Let me try. " + call_text("try_code", code=1234), ["open"]),
     ("It is open, and now I will write on and on about it until the budget runs out. " * 3, [])],
    [("Let me give up.", [])],
]
# By hand: get_reward = 2 * opened - 0.25 * tries - 0.1 * peeks; answer = [code in the last turn] + 0.5 * results.
EXPECTED_VAULT = [1.75, 0.0, 1.65, -0.35, 1.75, 0.0]
EXPECTED_ANSWER = [1.5, 1.0, 2.0, 1.0, 0.5, 0.0]  # r3's last turn names 1233, not 1234; r4's never names the code
TRUNCATED = [False, False, False, False, True, False]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: one intra-op thread computes them as fast as two, and several times faster when
    another process holds a core (two threads then wait on each other at every op). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with trl's `qwen2_5_chat_template`, which trl recognises for parsing tool calls."""
    from trl.chat_template_utils import qwen2_5_chat_template

    path = save_tiny_model(tmp_path_factory.mktemp("environment_parity_model"), "tiny", seed=5)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(path)
    return path


@dataclasses.dataclass
class Plan:
    """The scripted rollouts as token ids: each rollout's turns, the suffix of tokens its results take, and the
    completion and tool mask they make together (the expected ones)."""

    turns: list[list[list[int]]]  # [rollout][turn] the model's tokens, EOS-ended (the last turn maybe not)
    suffixes: list[list[list[int]]]  # [rollout][turn] the result tokens after that turn ([] after the last)

    @classmethod
    def from_turns(cls, tokenizer) -> Plan:
        eos = tokenizer.eos_token_id
        turns, suffixes = [], []
        for rollout in TURNS:
            turns.append([encode(tokenizer, text) + [eos] for text, _ in rollout])
            suffixes.append([tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": result}
                                                          for name, result in zip(_called(text), results, strict=True)],
                                             eos) if results else [] for text, results in rollout])
        return cls(turns, suffixes)

    def completion(self, rollout: int) -> list[int]:
        ids = [token for turn, suffix in zip(self.turns[rollout], self.suffixes[rollout]) for token in turn + suffix]
        return ids[:MAX_LEN]

    def tool_mask(self, rollout: int) -> list[int]:
        mask = [m for turn, suffix in zip(self.turns[rollout], self.suffixes[rollout])
                for m in [1] * len(turn) + [0] * len(suffix)]
        return mask[:MAX_LEN]

    def scripted(self, rollout: int) -> list[int | None]:
        """What our Scripted policy writes: the turns, None where the sampler feeds the results."""
        return [token for turn, suffix in zip(self.turns[rollout], self.suffixes[rollout])
                for token in turn + [None] * len(suffix)]


def _called(text: str) -> list[str]:
    """The tool names a turn calls, in order."""
    return [json.loads(block.split("</tool_call>")[0])["name"] for block in text.split("<tool_call>")[1:]]


# ----------------------------------------------------------------------------- trl


def make_trl(model_dir, settings, output_dir):
    from trl import GRPOConfig as TrlConfig, GRPOTrainer

    ga, iterations = settings["ga"], settings["iterations"]
    args = TrlConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS * GROUP // ga, gradient_accumulation_steps=ga, num_generations=GROUP,
        max_completion_length=MAX_LEN, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=ADAM_EPS, max_grad_norm=1.0,
        optim="adamw_torch", temperature=0.7, beta=settings["beta"], use_bias_correction_kl=settings["bias_kl"],
        epsilon=settings["epsilon"], epsilon_high=settings["epsilon_high"], loss_type=settings["loss_type"],
        scale_rewards=settings["scale"], num_iterations=iterations, importance_sampling_level=settings["level"],
        mask_truncated_completions=settings["mask_truncated"], reward_weights=[ANSWER_WEIGHT], seed=0,
        logging_steps=1, max_steps=iterations, shuffle_dataset=False, steps_per_generation=ga, **_extras(settings),
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[answer], args=args,
                          train_dataset=datasets.Dataset.from_list(ROWS), environment_factory=Vault)
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    return trainer


def script_trl(trainer, plan: Plan) -> dict:
    """Replace the trainer's `_generate_single_turn` by the plan; returns what trl's loop hands it, per call.

    The first call gets every rollout's prompt; each later one the rollouts whose last turn called a tool, in
    ascending order (trl's `_tool_call_loop`), each as prompt + completion so far + the results' tokens: the
    stand-in checks that those are the planned turns and results, so a call run on the wrong environment, or a
    rollout handed in another order, fails here and not as a misaligned number later."""
    num_rows = len(plan.turns)
    state = {"turn": [0] * num_rows, "so_far": [None] * num_rows, "calls": []}

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first = not state["calls"]
        if first:
            assert len(prompt_ids) == num_rows
            rows = list(range(num_rows))
        else:  # the rollouts whose last turn has results, in order
            rows = [r for r in range(num_rows) if state["turn"][r] < len(plan.turns[r])]
            assert len(prompt_ids) == len(rows), (len(prompt_ids), rows)
        state["calls"].append(rows)
        out = []
        for row, ids in zip(rows, prompt_ids, strict=True):
            turn = state["turn"][row]
            if first:
                state["so_far"][row] = list(ids)
            else:  # what came before, the results of the last turn, nothing else
                assert list(ids) == state["so_far"][row] + plan.suffixes[row][turn - 1], f"rollout {row}, turn {turn}"
            state["so_far"][row] = list(ids) + plan.turns[row][turn]
            state["turn"][row] = turn + 1 if plan.suffixes[row][turn] else len(plan.turns[row])
            out.append(plan.turns[row][turn][:MAX_LEN])  # the first turn cut at the budget as generate would
        return out, None

    trainer._generate_single_turn = generate_single_turn
    return state


# ----------------------------------------------------------------------------- ours


def make_ours(model_dir, settings, tmp_path, kernels, reward_fn):
    ga, iterations = settings["ga"], settings["iterations"]
    config = GRPOConfig(
        model=str(model_dir), output_dir=str(tmp_path / "ours"), prompts_per_step=PROMPTS, num_generations=GROUP,
        micro_batch_size=PROMPTS * GROUP // ga, max_completion_length=MAX_LEN, max_prompt_length=2048,
        learning_rate=LR, lr_scheduler_type="constant", warmup_ratio=0.0, weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.99, adam_epsilon=ADAM_EPS, max_grad_norm=1.0, temperature=0.7, beta=settings["beta"],
        use_bias_correction_kl=settings["bias_kl"], epsilon=settings["epsilon"], epsilon_high=settings["epsilon_high"],
        loss_type=settings["loss_type"], scale_rewards=settings["scale"], num_iterations=iterations,
        importance_sampling_level=settings["level"], mask_truncated_completions=settings["mask_truncated"],
        device="cpu", precision="fp32", reward=[], max_steps=1, kernels=kernels, steps_per_generation=ga,
        shuffle_dataset=False, save_steps=0, eval_steps=0, log_completions_steps=0, **_extras(settings),
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    return Trainer(config, policy=policy, reward_functions=[RewardSpec("answer", reward_fn, ANSWER_WEIGHT)],
                   train_rows=[dict(row) for row in ROWS], environment_factory=Vault)


# ----------------------------------------------------------------------------- the comparison


def recording(seen: list):
    """The `answer` reward, keeping the completions (messages) it was given."""
    def answer_reward(prompts, completions, **kwargs):
        seen.append(completions)
        return answer(prompts, completions, **kwargs)
    answer_reward.__name__ = "answer"
    return answer_reward


def tool_calls_of(messages: list[dict]) -> list:
    return [[(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []] for m in messages]


# (settings, kernels): grpo with beta 0.04 and the bias-corrected KL, two micro-batches, on-policy, with the kernels
# --kernels auto chooses; dapo with r4 masked as truncated and an off-policy second update, on the plain path.
SETTINGS = [(BASE, "auto"), (dict(BASE, loss_type="dapo", mask_truncated=True, ga=1, **OFF), "plain")]


@pytest.mark.parametrize("settings, kernels", SETTINGS, ids=["grpo-auto", "dapo-mask_truncated-off_policy-plain"])
def test_environment_rollout_and_update_match_trl(model_dir, settings, kernels, tmp_path):
    torch.manual_seed(0)
    trl_trainer = make_trl(model_dir, settings, tmp_path / "trl")
    trl_seen, our_seen = [], []
    trl_trainer.reward_funcs[0] = recording(trl_seen)
    assert trl_trainer.reward_func_names == ["answer", "Vault"]  # get_reward's column, after the reward functions
    torch.testing.assert_close(trl_trainer.reward_weights, torch.tensor([ANSWER_WEIGHT, 1.0]))
    ours = make_ours(model_dir, settings, tmp_path, kernels, recording(our_seen))
    assert [(spec.name, spec.weight) for spec in ours.rewards] == [("answer", ANSWER_WEIGHT), ("Vault", 1.0)]
    ours_named = dict(ours.policy.named_parameters())
    for name, param in trl_trainer.model.named_parameters():  # same start
        assert torch.equal(param, ours_named[name])

    plan = Plan.from_turns(ours.data.tokenizer)
    assert all(len({tuple(plan.turns[r][0][:1]) for r in range(g * GROUP, (g + 1) * GROUP)}) == 1
               for g in range(PROMPTS))  # one first token per group: our prefill gives it
    assert [len(plan.completion(r)) == MAX_LEN for r in range(len(TURNS))] == TRUNCATED

    # trl: its own environment path with scripted turns; the rewards as _calculate_rewards returns them
    trl_script = script_trl(trl_trainer, plan)
    calculate, trl_rewards = trl_trainer._calculate_rewards, []
    trl_trainer._calculate_rewards = lambda *args: trl_rewards.append(calculate(*args)) or trl_rewards[-1]
    inputs = [dict(row) for row in ROWS for _ in range(GROUP)]  # rows repeated per generation, as trl's sampler
    trl_record = trl_step(trl_trainer, {}, inputs, 0, settings["ga"], settings["iterations"])
    batch = trl_record["batch"]
    assert trl_script["calls"] == [[0, 1, 2, 3, 4, 5], [0, 2, 3, 4], [2]]  # the turns trl asked for, by rollout

    # ours: our sampler and environment processes, the policy scripted
    ours.generation.model = Scripted(ours.policy, [plan.scripted(r) for r in range(len(TURNS))], GROUP)
    rollout, prompts, _, _ = ours.collect_rollout(0)
    our_grads = []
    last = update_in_rollout_order(ours, rollout, our_grads)

    # The prompts: the row's with reset's text appended to the last user message, the tools' schemas shown.
    assert prompts[0][-1]["content"] == "Open the vault. The vault's code has 2 digits."
    trl_prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    our_prompts = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)]
    assert our_prompts == trl_prompts
    assert '"try_code"' in ours.data.tokenizer.decode(our_prompts[0]) and '"peek"' in ours.data.tokenizer.decode(our_prompts[0])

    # Completions token for token, and the tool masks: both as the plan says, results at 0.
    lengths = rollout.completion_mask.sum(-1).tolist()
    assert lengths == [len(plan.completion(r)) for r in range(len(TURNS))]
    assert rollout.truncated.tolist() == TRUNCATED
    assert torch.equal(rollout.completion_ids, batch["completion_ids"])  # the same width, padded alike
    # trl zeroes a truncated completion's completion_mask and tool_mask under mask_truncated_completions; ours
    # keeps them and leaves the row out of the loss (compared below, as the loss masks)
    kept = (~(rollout.truncated & settings["mask_truncated"]))[:, None].long()  # (N, 1)
    assert torch.equal(rollout.completion_mask * kept, batch["completion_mask"])
    for row, length in enumerate(lengths):
        assert rollout.completion_ids[row, :length].tolist() == plan.completion(row), row
        assert rollout.tool_mask[row, :length].tolist() == plan.tool_mask(row), row
        assert batch["tool_mask"][row, :length].tolist() == [m * kept[row, 0].item() for m in plan.tool_mask(row)], row
    assert rollout.tool_calls[:, 0].tolist() == [1, 0, 2, 2, 1, 0]  # calls made per rollout

    # What reward functions see: the same turns, calls and results (the assistant text of a turn that calls a
    # tool is not compared: see test_the_messages_of_a_turn_are_trls[text_of_a_calling_turn]).
    (trl_completions,), (our_completions,) = trl_seen, our_seen
    for row, (theirs, mine) in enumerate(zip(trl_completions, our_completions, strict=True)):
        assert [m["role"] for m in mine] == [m["role"] for m in theirs], row
        assert tool_calls_of(mine) == tool_calls_of(theirs), row
        assert [m for m in mine if m["role"] == "tool"] == [m for m in theirs if m["role"] == "tool"], row
        assert mine[-1]["content"] == theirs[-1]["content"], row

    # Rewards: both columns, by hand and as trl computed them (NaN-free: one environment for every row).
    (trl_rewards_per_func,) = trl_rewards
    assert rollout.rewards_per_func[:, 1].tolist() == pytest.approx(EXPECTED_VAULT, abs=1e-6)
    assert rollout.rewards_per_func[:, 0].tolist() == EXPECTED_ANSWER
    assert torch.equal(rollout.rewards_per_func, trl_rewards_per_func)

    # The update: advantages, log-probs, each micro-batch's loss, the gradient of every optimizer step.
    torch.testing.assert_close(last.advantages.squeeze(-1), batch["advantages"], rtol=1e-5, atol=1e-6)
    trl_mask = batch["completion_mask"] * batch["tool_mask"]
    assert torch.equal(rollout.loss_mask * kept, trl_mask)
    torch.testing.assert_close(last.ref_logps * trl_mask, batch["ref_per_token_logps"] * trl_mask, rtol=1e-5, atol=1e-6)
    if settings["iterations"] > 1:
        torch.testing.assert_close(last.old_logps * trl_mask, batch["old_per_token_logps"] * trl_mask,
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(last.micro_batch_losses), torch.tensor(trl_record["losses"]),
                               rtol=1e-5, atol=1e-6)
    assert len(our_grads) == len(trl_record["grads"]) == settings["iterations"]
    for update, (our_grad, trl_grad) in enumerate(zip(our_grads, trl_record["grads"], strict=True)):
        scale = max(g.abs().max().item() for g in trl_grad.values() if g is not None)
        atol = (1e-6 if update == 0 else 5e-5) * scale  # a later update starts from parameters AdamW moved apart
        for name, expected in trl_grad.items():
            torch.testing.assert_close(our_grad[name], expected, rtol=1e-5, atol=atol,
                                       msg=lambda m, name=name, update=update: f"{name}, update {update}: {m}")
    if settings["iterations"] > 1:  # the clip range of 1e-3 bites in the off-policy update
        assert any(stats.clip_region > 0 for stats in last.micro_batch_stats)

    # The logged metrics of the rollout, under trl's names: lengths count the model's own tokens, not the results.
    logged = {key: values[-1] for key, values in trl_trainer._metrics["train"].items()}
    for key in ("tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "rewards/answer/mean", "rewards/answer/std",
                "rewards/Vault/mean", "rewards/Vault/std"):
        assert last.metrics[key] == pytest.approx(logged[key], rel=1e-6, abs=1e-6), key
    assert last.metrics["tools/call_frequency"] == 1.0  # 6 calls over 6 rollouts


# ----------------------------------------------------------------------------- where we differ from trl (known)


def _strict_xfail(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


# One turn, parsed by trl (`parse_response` with the prompt's tools, as its `_generate` and `_tool_call_loop` do) and
# by our sampler's tool loop (the assistant message it records, grpo.multiturn.tools.ToolTurns); `part`: what is compared,
# the message's text or its calls. An XPASS means the difference is gone: drop the mark (and play the case in TURNS).
@pytest.mark.parametrize("text, part", [
    pytest.param("Let me guess: 42.", "content", id="text_of_a_plain_turn"),  # the same text
    pytest.param("Let me try. " + call_text("try_code", code=42), "calls", id="well_formed_call"),  # the same call
    # the text around the calls, stripped ('Let me try.'), as trl's message holds it
    pytest.param("Let me try. " + call_text("try_code", code=42), "content", id="text_of_a_calling_turn"),
    # arguments typed by the tool's schema ('42' -> 42 for `code: int`), as trl's parser does
    pytest.param("Let me try. " + call_text("try_code", code="42"), "calls", id="string_for_an_int_argument"),
    pytest.param("Let me <tool_call>{oops</tool_call>", "calls", id="malformed_call", marks=_strict_xfail(
        "trl reads a malformed block as text without calls (the rollout ends); ours makes it a failed call whose "
        "error the model reads, and the rollout goes on (grpo/multiturn/tools.py, parse_tool_calls)")),
])
def test_the_messages_of_a_turn_are_trls(tiny_model_and_tokenizer, text, part):
    from trl.chat_template_utils import add_response_schema, parse_response

    from grpo.algorithm.sampler import SamplingParams, sample_groups
    from grpo.multiturn.tools import ToolSet
    from grpo.tiny_model import build_tokenizer

    model, tokenizer = tiny_model_and_tokenizer
    vault = Vault()
    vault.reset(code=42)
    tools = [vault.peek, vault.try_code]
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Open the vault."}], tools=tools,
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    turn = encode(tokenizer, text) + [tokenizer.eos_token_id]
    params = SamplingParams(max_completion_length=len(turn) + 256, temperature=0.0,  # room for any result
                            eos_token_ids=(tokenizer.eos_token_id,))
    sample = sample_groups(Scripted(model, [turn], 1), [prompt], 1, params, tokenizer.pad_token_id,
                           tools=ToolSet(tools, tokenizer, tokenizer.eos_token_id))
    parser = add_response_schema(build_tokenizer())  # a tokenizer of its own: trl sets its response template on it
    ours, theirs = sample.messages[0][0], parse_response(parser, turn, prefix=prompt, tools=tools)

    def calls(message):
        return [(c["function"]["name"], c["function"]["arguments"], c.get("error"))
                for c in message.get("tool_calls") or []]

    if part == "content":
        assert ours["content"] == theirs["content"]
    else:
        assert calls(ours) == calls(theirs)
