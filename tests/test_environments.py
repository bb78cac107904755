"""Multi-turn environments (grpo/multiturn/environments.py, trl's environment_factory): one fresh environment per rollout
in its own process, reset text in the prompt, the dict form, every fault a method can make, get_reward as a reward,
and token identity between what the sampler fed the model and what the update trains on, over several turns.

The sampler tests drive the tiny model with tests.test_tools.Scripted: each row writes a planned completion, None
where a tool result is fed in (its length computed from the result the environment must give, so a result that
differs in any token misaligns the rest of the plan and fails the test).
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import sys
import time

import pytest
import torch

from grpo.algorithm.sampler import SamplingParams
from grpo.config import GRPOConfig
from grpo.multiturn.environments import (EnvironmentRollouts, Environments, EnvironmentStartError, class_name,
                                    load_environments)
from grpo.generation.prompts import encode_prompt
from grpo.generation.rollout import GroupSampler
from grpo.multiturn.tools import ToolSet, tool_suffix_ids
from rewards import RewardSpec
from tests.test_tools import Scripted, call_text, encode

TIMEOUT = 4.0  # seconds: far above what a working call takes under load, far below a hang


class Tally:
    """Counts its own calls; class and module state would leak between rollouts sharing a process."""

    instances = 0  # a class attribute: every instance made in this process adds one

    def __init__(self):
        Tally.instances += 1
        self.total, self.calls = 0, 0

    def reset(self, **row):
        self.keys = sorted(row)
        return f" [pid {os.getpid()} instances {Tally.instances} draw {random.random():.6f}]"

    def add(self, n: int) -> str:
        """Add n to the tally.

        Args:
            n: How much to add.
        """
        self.total += n
        self.calls += 1
        return f"total {self.total}"

    def boom(self) -> str:
        """Fail."""
        raise RuntimeError("out of order")

    def nap(self) -> str:
        """Sleep for an hour."""
        time.sleep(3600)
        return "rested"

    def number(self) -> str:
        """Return a number instead of a string."""
        return 5

    def die(self) -> str:
        """End the process."""
        os._exit(3)

    def get_reward(self):
        return float(self.total)

    def _private(self) -> str:
        return "not a tool"


class Quiet:
    """reset returns None; one tool; no get_reward."""

    def reset(self, **row):
        self.keys = sorted(row)

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


class Dice:
    """A seeded roll in the prompt and as the reward (tests/test_distributed.py: the same under two ranks)."""

    def reset(self, **row):
        self.roll = random.randint(1, 6)
        return f" You rolled {self.roll}."

    def get_reward(self):
        return self.roll / 6


@pytest.fixture
def new_children():
    """The test's own children still running: this process's live children now, less those it had when the test
    began. A test worker that ran other tests first may keep helpers of its own for its whole life, which are not
    what these tests check."""
    before = set(live_children())
    return lambda: sorted(set(live_children()) - before)


def live_children() -> list[int]:
    """This process's children that are still running (not zombies), from /proc."""
    found = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append(int(stat))
    return found


def rows(count: int, **extra) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Question {i}"}], "level": i, **extra} for i in range(count)]


def played(tokenizer, factory, tools=(), max_prompt_length=4096, timeout=TIMEOUT, max_iterations=None):
    environments = Environments.from_factory(factory, timeout)
    toolset = ToolSet(list(tools), tokenizer, tokenizer.eos_token_id, max_iterations)
    return EnvironmentRollouts(environments, toolset, {}, max_prompt_length)


def result_ids(tokenizer, content: str, name: str) -> list[int]:
    return tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": content}], tokenizer.eos_token_id)


def error(message: str) -> str:
    return json.dumps({"error": message})


class AnyGroupScripted(Scripted):
    """Scripted, whatever the prompts per prefill: rollouts whose reset texts differ each get their own prompt."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):
        if input_ids.shape[1] > 1:
            self.group = len(self.plans) // input_ids.shape[0]
        return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep)


def play(model, tokenizer, environments, batch, group, plans, budget=200, reward_specs=(), seeds_from=None):
    scripted = AnyGroupScripted(model, plans, group)
    params = SamplingParams(max_completion_length=budget, temperature=0.0, eos_token_ids=(tokenizer.eos_token_id,))
    generator = seeds_from or torch.Generator().manual_seed(0)
    return environments.sample_rollout(GroupSampler(scripted, tokenizer.pad_token_id), tokenizer, list(reward_specs),
                                       batch, None, group, params, generator)


# ----------------------------------------------------------------------------- instances and isolation


def test_every_rollout_gets_a_fresh_environment_in_its_own_process(tokenizer, new_children):
    environments = Environments.from_factory(Tally, TIMEOUT)
    assert [tool.__name__ for tool in environments.tools[None]] == ["add", "boom", "die", "nap", "number"]
    assert list(environments.reward_classes) == ["Tally"]
    before = Tally.instances  # the probe made one here
    episodes = environments.start(rows(2), 3, seeds=[11, 12, 13, 14, 15, 16])
    try:
        observations = [handle._observation for handle in episodes.handles]
        pids = {text.split()[1] for text in observations}
        assert len(pids) == 6 and str(os.getpid()) not in pids  # six processes, none of them the trainer
        # each process made one instance on top of the probe's: no class state is shared between rollouts
        assert all(f" instances {before + 1} " in text for text in observations)
        assert episodes.handles[0].keys == ["level", "prompt"]  # reset(**row) got the whole row
        handle = episodes.handles[4]
        assert handle._call("add", n=2) == "total 2" and handle._call("add", n=3) == "total 5"
        assert episodes.handles[5].total == 0  # its neighbour's calls never reached it
    finally:
        episodes.close()
    assert Tally.instances == before  # nothing was made in the trainer's process
    assert not new_children()


def test_seeds_make_resets_repeat_and_differ_between_rollouts():
    environments = Environments.from_factory(Tally, TIMEOUT)
    draws = []
    for _ in range(2):
        episodes = environments.start(rows(1), 3, seeds=[1, 2, 3])
        draws.append([handle._observation.split("draw ")[1] for handle in episodes.handles])
        episodes.close()
    assert draws[0] == draws[1] and len(set(draws[0])) == 3


# ----------------------------------------------------------------------------- reset text and the prompt


def test_reset_text_joins_the_last_user_message(tokenizer):
    rollouts = played(tokenizer, Tally)
    episodes, prompt_ids, per_prompt, prompts = rollouts.begin(rows(2), 2, seeds=[1, 2, 3, 4])
    try:
        assert per_prompt == 1 and len(prompt_ids) == 4  # every rollout's reset says something else: 4 prompts
        for rollout, prompt in enumerate(prompts):
            assert prompt[-1]["content"] == f"Question {rollout // 2}" + episodes.handles[rollout]._observation
            tools = [*episodes.environments.tools[None]]
            assert prompt_ids[rollout] == encode_prompt(tokenizer, prompt, {"tools": tools})
            assert "add" in tokenizer.decode(prompt_ids[rollout])  # the tiny template shows the tools
    finally:
        episodes.close()


def test_a_reset_that_says_nothing_keeps_the_prompt_and_one_prefill_per_group(tokenizer):
    rollouts = played(tokenizer, Quiet)
    batch = rows(2)
    episodes, prompt_ids, per_prompt, prompts = rollouts.begin(batch, 3, seeds=list(range(6)))
    episodes.close()
    assert per_prompt == 3 and len(prompt_ids) == 2
    assert prompts[0] == batch[0]["prompt"] and prompts[3] == batch[1]["prompt"]


def test_dict_form_routes_each_row_to_its_environment(tokenizer):
    rollouts = played(tokenizer, {"tally": Tally, "quiet": Quiet})
    batch = [{**rows(1)[0], "environment": "quiet"}, {**rows(1)[0], "environment": "tally"}]
    episodes, prompt_ids, per_prompt, _ = rollouts.begin(batch, 2, seeds=[1, 2, 3, 4])
    try:
        assert [class_name(handle) for handle in episodes.handles] == ["Quiet", "Quiet", "Tally", "Tally"]
        assert episodes.handles[0].keys == ["level", "prompt"]  # the routing column is not passed to reset
        assert per_prompt == 1  # the Tally rollouts differ
        quiet, tally = tokenizer.decode(prompt_ids[0]), tokenizer.decode(prompt_ids[2])
        assert '"ping"' in quiet and '"add"' not in quiet  # each prompt shows only its environment's tools
        assert '"add"' in tally and '"ping"' not in tally
    finally:
        episodes.close()
    with pytest.raises(ValueError, match="environment='loud' is not one of the environments given"):
        rollouts.begin([{**rows(1)[0], "environment": "loud"}], 2, seeds=[1, 2])
    with pytest.raises(ValueError, match="environment=None"):
        rollouts.begin(rows(1), 2, seeds=[1, 2])


def test_a_reset_that_fails_stops_the_step_naming_the_row_and_leaves_no_process(new_children):
    class BadReset(Quiet):
        def reset(self, **row):
            if row["level"] == 1:
                raise KeyError("no such level")

    class WrongType(Quiet):
        def reset(self, **row):
            return 42

    with pytest.raises(EnvironmentStartError, match=r"BadReset: reset\(\*\*row\) of row 1 failed: KeyError"):
        Environments.from_factory(BadReset, TIMEOUT).start(rows(2), 2, seeds=[1, 2, 3, 4])
    with pytest.raises(EnvironmentStartError, match="reset returned int, not None or a string"):
        Environments.from_factory(WrongType, TIMEOUT).start(rows(1), 1, seeds=[1])
    assert not new_children()


def test_factories_are_checked_when_the_run_starts():
    class NoReset:
        def act(self) -> str:
            """Act."""
            return ""

    def broken_factory():
        raise OSError("no display")

    with pytest.raises(ValueError, match="NoReset has no reset method"):
        Environments.from_factory(NoReset)
    with pytest.raises(ValueError, match="environment 'broken_factory': making one raised OSError: no display"):
        Environments.from_factory(broken_factory)
    with pytest.raises(ValueError, match="is not callable"):
        Environments.from_factory({"x": 3})


# ----------------------------------------------------------------------------- the rollout: faults, rewards, tokens


def test_every_fault_becomes_a_failed_call_the_model_reads_and_the_run_goes_on(tiny_model_and_tokenizer, new_children):
    """Row 0 calls add then boom; row 1 number; row 2 nap (past the timeout) then add (its environment is gone);
    row 3 die then add. Each failure's message is what the next tokens hold, every failure is counted, and each
    row still writes its final turn."""
    model, tokenizer = tiny_model_and_tokenizer
    rollouts = played(tokenizer, Tally, timeout=TIMEOUT)
    eos, done = tokenizer.eos_token_id, encode(tokenizer, "done")
    nap_gone = "add: the environment is gone (nap ran past the 4 s timeout)"
    turns = [
        [("add", {"n": 2}, "total 2"), ("boom", {}, error("RuntimeError: out of order"))],
        [("number", {}, error("TypeError: number returned int, not a string"))],
        [("nap", {}, error("nap: no answer within 4 s; the environment was stopped")),
         ("add", {"n": 1}, error(nap_gone))],
        [("die", {}, error("die: the environment's process died (its process exited with code 3)")),
         ("add", {"n": 1}, error("add: the environment is gone (its process exited with code 3)"))],
    ]
    plans = []
    for row_turns in turns:
        plan = []
        for name, arguments, result in row_turns:
            fed = result_ids(tokenizer, result, name)
            plan += encode(tokenizer, call_text(name, **arguments)) + [eos] + [None] * len(fed)
        plans.append(plan + done + [eos])
    started = time.perf_counter()
    rollout, _, texts = play(model, tokenizer, rollouts, rows(4), 1, plans, budget=400,
                             reward_specs=[RewardSpec("Tally", rollouts.environments.reward_functions()[0][1])])
    assert time.perf_counter() - started < 60  # the hang cost one timeout, not an hour
    assert rollout.tool_calls[:, :2].tolist() == [[2, 1], [1, 1], [2, 2], [2, 2]]  # (calls, failed) per row
    assert rollout.tool_calls[:, 2].tolist() == [3, 2, 3, 3]  # assistant turns
    for row, row_turns in enumerate(turns):
        ids = rollout.completion_ids[row, : int(rollout.completion_mask[row].sum())].tolist()
        assert ids[-len(done) - 1 :] == done + [eos], texts[row]  # every row finished its plan
        for _, _, result in row_turns:  # and read each result exactly as the template renders it
            fed = result_ids(tokenizer, result, "x")
            assert any(ids[i : i + len(fed)] == fed for i in range(len(ids))), (result, texts[row])
    # get_reward: the tally of rows whose environment still runs; None (NaN) where it is gone
    assert rollout.rewards_per_func[:2, 0].tolist() == [2.0, 0.0]
    assert torch.isnan(rollout.rewards_per_func[2:, 0]).all()
    assert not new_children()


def test_get_reward_is_a_reward_named_after_the_class_and_reward_functions_see_the_environments(
        tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    rollouts = played(tokenizer, {"tally": Tally, "quiet": Quiet})
    eos = tokenizer.eos_token_id
    seen = {}

    def reads_environments(prompts, completions, environments, **_):
        seen["calls"] = [handle.calls if class_name(handle) == "Tally" else None for handle in environments]
        seen["prompts"] = prompts
        return [1.0] * len(completions)

    specs = [RewardSpec("reads", reads_environments), *[RewardSpec(n, f) for n, f in
                                                         rollouts.environments.reward_functions()]]
    assert [spec.name for spec in specs] == ["reads", "Tally"]  # only the class that defines get_reward
    add = lambda n: encode(tokenizer, call_text("add", n=n)) + [eos] + [None] * len(  # noqa: E731
        result_ids(tokenizer, f"total {n}", "add"))
    plans = [add(3) + encode(tokenizer, "ok") + [eos], encode(tokenizer, "ok") + [eos],
             encode(tokenizer, "ok") + [eos], encode(tokenizer, "ok") + [eos]]
    batch = [{**rows(1)[0], "environment": "tally"}, {**rows(1)[0], "environment": "quiet"}]
    rollout, prompts, _ = play(model, tokenizer, rollouts, batch, 2, plans, reward_specs=specs)
    assert rollout.rewards_per_func[:, 0].tolist() == [1.0] * 4
    assert rollout.rewards_per_func[:2, 1].tolist() == [3.0, 0.0]  # each Tally's own total
    assert torch.isnan(rollout.rewards_per_func[2:, 1]).all()  # a Quiet rollout is not scored by Tally's reward
    assert seen["calls"] == [1, 0, None, None]  # attributes read from each rollout's own environment
    assert seen["prompts"][0][-1]["content"].startswith("Question 0 [pid")  # the prompts the rollouts played
    assert prompts == seen["prompts"]


def test_a_get_reward_that_fails_leaves_the_rollout_unscored(tiny_model_and_tokenizer, caplog):
    class BadReward(Quiet):
        def get_reward(self):
            return float("nan")

    model, tokenizer = tiny_model_and_tokenizer
    rollouts = played(tokenizer, BadReward)
    (name, fn), = rollouts.environments.reward_functions()
    eos = tokenizer.eos_token_id
    rollout, _, _ = play(model, tokenizer, rollouts, rows(1), 2, [[eos], [eos]], reward_specs=[RewardSpec(name, fn)])
    assert torch.isnan(rollout.rewards_per_func).all()
    assert "get_reward failed (TypeError: get_reward returned nan, not a finite number)" in caplog.text


@pytest.mark.slow
def test_the_update_trains_on_exactly_the_tokens_the_sampler_fed_over_several_turns(tmp_path):
    """A trainer with environment_factory, its policy scripted to make two tool calls before answering in one row
    of each group: every token the sampler fed the model (prefill and decode) is, in order, the token the update's
    forward pass reads, and the loss counts only the model's own tokens."""
    from grpo.core.trainer import Trainer

    config = GRPOConfig(model="tiny", dataset="synthetic:8", output_dir=str(tmp_path / "run"), max_steps=1,
                        prompts_per_step=2, num_generations=2, micro_batch_size=4, max_prompt_length=512,
                        max_completion_length=256, device="cpu", precision="fp32", save_steps=0, eval_steps=0,
                        log_completions_steps=0, reward=[], beta=0.04, kernels="plain")
    length = RewardSpec("length", lambda completions, **_: [float(len(c)) for c in completions])
    # reset says nothing: the rows' prompts, one prefill each
    trainer = Trainer(config, environment_factory=Quiet, reward_functions=[length])
    tokenizer, eos = trainer.data.tokenizer, trainer.data.tokenizer.eos_token_id
    ping = encode(tokenizer, call_text("ping"))
    pong = result_ids(tokenizer, "pong", "ping")
    answer = encode(tokenizer, "<answer>7</answer>")
    two_calls = ping + [eos] + [None] * len(pong) + ping + [eos] + [None] * len(pong) + answer + [eos]
    plans = [two_calls, ping[:1] + answer + [eos]] * 2  # a group's rows share the first token (one prefill)

    fed: list[torch.Tensor] = []  # (rows, tokens) of each forward call of the sampler

    class Recording(Scripted):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                    logits_to_keep=0):
            fed.append(input_ids.clone())
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep)

    trainer.generation.model = Recording(trainer.policy, plans, group=2)
    read: list[torch.Tensor] = []  # the update's forward passes over whole sequences (no KV cache)

    def reading(module, args, kwargs):
        if kwargs.get("use_cache") is False:
            read.append(kwargs["input_ids"].clone())

    trainer.policy.model.register_forward_pre_hook(reading, with_kwargs=True)
    records, update = [], trainer.update
    trainer.update = lambda rollout: records.append((rollout, update(rollout))) or records[-1][1]
    trainer.train()

    rollout, result = records[0]
    prompts = fed[0].repeat_interleave(2, 0)  # (N, P) the prefill, expanded to the groups
    decoded = torch.cat(fed[1:], dim=1)  # (N, T - 1) the tokens fed one step at a time
    lengths = rollout.completion_mask.sum(-1).tolist()
    assert lengths == [len(plan) for plan in plans]  # every row wrote its whole plan: row 0 in three turns
    update_input = torch.cat(read, dim=0) if len(read) > 1 else read[0]
    for row in range(4):
        prompt = prompts[row][rollout.prompt_mask[row].bool()]
        last = rollout.completion_ids[row, lengths[row] - 1 : lengths[row]]  # drawn, never fed back
        sampled = torch.cat([prompt, decoded[row, : lengths[row] - 1], last])
        trained = torch.cat([rollout.prompt_ids[row][rollout.prompt_mask[row].bool()],
                             rollout.completion_ids[row, : lengths[row]]])
        assert torch.equal(sampled, trained)  # the rollout holds exactly the fed tokens
        assert any(torch.equal(trained, seq[seq != tokenizer.pad_token_id][: len(trained)])
                   or torch.equal(trained, seq[-len(trained):]) for seq in update_input)  # and the update reads them
    assert read  # the update read whole sequences
    assert result.num_items_in_batch == sum(len(p) - p.count(None) for p in plans)  # results are not counted
    assert rollout.loss_mask.sum().item() == result.num_items_in_batch


# ----------------------------------------------------------------------------- settings and the command line


def test_the_command_line_and_config_checks(tmp_path):
    from grpo.cli import config_from_args
    from grpo.core.setup import environments, reward_specs

    source = tmp_path / "games.py"
    source.write_text("class Game:\n    def reset(self, **row):\n        return None\n"
                      "    def get_reward(self):\n        return 1.0\n")
    config = config_from_args(["--environment", f"{source}:Game", "--reward"], GRPOConfig)
    assert config.reward == [] and config.environment == [f"{source}:Game"]
    assert config_from_args(["--reward", "int", "--reward", "tags:0.5"], GRPOConfig).reward == ["int", "tags:0.5"]
    loaded = environments(config)
    assert not loaded.multi and loaded.class_names == {None: "Game"}
    assert [spec.name for spec in reward_specs(config, None, loaded)] == ["Game"]
    named = environments(config_from_args(["--environment", f"easy={source}:Game", "--environment",
                                           f"hard={source}:Game", "--reward"], GRPOConfig))  # the flag twice
    assert named.multi and sorted(named.factories) == ["easy", "hard"]
    assert [name for name, _ in named.reward_functions()] == ["Game"]  # one column per class, as trl
    with pytest.raises(ValueError, match="a second environment named 'Game'"):
        load_environments([f"{source}:Game", f"{source}:Game"])
    with pytest.raises(ValueError, match="no reward source"):
        reward_specs(GRPOConfig(reward=[]), None, None)
    quiet = GRPOConfig(reward=[], environment=["tests.test_environments:Quiet"])
    with pytest.raises(ValueError, match="no reward source"):
        reward_specs(quiet, None, environments(quiet))
    with pytest.raises(ValueError, match="environment_timeout must be > 0"):
        GRPOConfig(environment=[f"{source}:Game"], environment_timeout=0).validate()
    with pytest.raises(ValueError, match="need --generation-backend sampler"):
        GRPOConfig(environment=[f"{source}:Game"], generation_backend="transformers").validate()
    with pytest.raises(ValueError, match="has no function 'Nope'"):
        load_environments([f"{source}:Nope"])


@pytest.mark.slow
def test_eval_plays_the_environment_and_reports_its_reward(tmp_path, capsys):
    import eval as eval_script

    source = tmp_path / "games.py"
    source.write_text("class Game:\n    def reset(self, **row):\n        self.level = row['level']\n"
                      "        return ' go'\n    def get_reward(self):\n        return float(self.level)\n")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows(3)))
    code = eval_script.main(["--model", "tiny", "--dataset", str(data), "--split", "train", "--environment",
                             f"{source}:Game", "--reward", "--max-completion-length", "8", "--device", "cpu",
                             "--output-dir", str(tmp_path / "eval"), "--num-samples", "2", "--pass-threshold", "1"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(next((tmp_path / "eval").glob("*.summary.json")).read_text())
    assert summary["rewards/Game"] == pytest.approx(1.0)  # levels 0, 1, 2: the mean of get_reward
    assert summary["sampling"]["pass_key"] == "rewards/Game"
    assert summary["sampling"]["pass@1"]["mean"] == pytest.approx(2 / 3)  # levels 1 and 2 pass a threshold of 1


# ----------------------------------------------------------------------------- a real environment: textarena


def test_textarena_guess_the_number_in_its_own_process():
    """data.games.GuessTheNumber wraps textarena's game unchanged: a group's rollouts play the row's secret, a
    binary search through the tool solves it, textarena's own messages come back, and get_reward is its score."""
    pytest.importorskip("textarena")  # the `games` extra, which CI installs
    from data.games import GuessTheNumber, game_rows

    environments = Environments.from_factory(GuessTheNumber, 30.0)
    assert [tool.__name__ for tool in environments.tools[None]] == ["guess"]
    batch = game_rows(2, seed=3)
    episodes = environments.start(batch, 2, seeds=[1, 2, 3, 4])
    try:
        assert "from 1 to 20; you have 10 guesses" in episodes.handles[0]._observation
        secrets = [handle.secret for handle in episodes.handles]
        assert secrets[0] == secrets[1] and secrets[2] == secrets[3]  # the row's seed, not the process's
        low, high, handle, messages = 1, 20, episodes.handles[0], []
        while True:
            middle = (low + high) // 2
            messages.append(handle._call("guess", number=middle))
            if "higher" in messages[-1]:
                low = middle + 1
            elif "lower" in messages[-1]:
                high = middle - 1
            else:
                break
        assert messages[-1] == "Congratulations! You guessed the correct number." and len(messages) <= 5
        assert handle._reward() == 1.0 and handle._call("guess", number=1) == "The game is over."
        unplayed, wrong = episodes.handles[1], episodes.handles[2]
        assert unplayed._reward() == 0.0  # no valid guess: textarena's partial credit has nothing to measure
        far = 20 if secrets[2] <= 10 else 1
        wrong._call("guess", number=far)
        assert wrong._reward() == pytest.approx(1 - abs(far - secrets[2]) / 19)  # textarena's partial credit
        with pytest.raises(Exception, match="number must be a whole number"):
            wrong._call("guess", number="7")
    finally:
        episodes.close()


def test_stopping_an_environment_stops_the_programs_it_started_and_a_hung_reset_fails(tmp_path, new_children):
    marker = tmp_path / "alive"

    class Spawner(Quiet):
        def reset(self, **row):
            import subprocess

            # a grandchild that would write the marker after 3 s unless it is killed with its group
            subprocess.Popen(["sh", "-c", f"sleep 3; touch {marker}"])
            return None

    class Stuck(Quiet):
        def reset(self, **row):
            time.sleep(3600)

    episodes = Environments.from_factory(Spawner, TIMEOUT).start(rows(1), 1, seeds=[1])
    episodes.close()
    time.sleep(4)
    assert not marker.exists()
    with pytest.raises(EnvironmentStartError, match="reset: no answer within 1 s"):
        Environments.from_factory(Stuck, 1.0).start(rows(1), 1, seeds=[1])
    assert not new_children()


def test_get_reward_may_return_a_bool_or_a_numpy_scalar_as_trl_takes_them():
    import numpy

    class Solved(Quiet):
        def get_reward(self):
            return [True, numpy.float32(0.25), numpy.bool_(False), 3][self.keys.count("prompt") + self.level - 1]

        def reset(self, **row):
            self.keys, self.level = sorted(row), row["level"]

    environments = Environments.from_factory(Solved, TIMEOUT)
    episodes = environments.start(rows(4), 1, seeds=[1, 2, 3, 4])
    try:
        assert [handle._reward() for handle in episodes.handles] == [1.0, 0.25, 0.0, 3.0]
    finally:
        episodes.close()


@pytest.mark.slow
def test_the_textarena_benchmark_runs_train_py_with_an_environment_and_no_reward(tmp_path, capsys):
    """bench/environment_learning.py end to end on the tiny model: train.py --environment data.games:GuessTheNumber
    --reward, one step, its metrics printed and plotted."""
    pytest.importorskip("textarena")
    pytest.importorskip("matplotlib")
    from bench.environment_learning import main

    assert main(["--model", "tiny", "--steps", "1", "--out", str(tmp_path), "--figure", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "--environment data.games:GuessTheNumber --reward --max-steps 1" in out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/GuessTheNumber/mean" in metrics and "rollout/turns_mean" in metrics
    assert (tmp_path / "f.png").stat().st_size > 0


# ----------------------------------------------------------------------------- attacks (an adversarial review's)


class Tricky(Quiet):
    """Methods that attack the transport and the trainer's process."""

    def reset(self, **row):
        import pathlib

        self.moves, self.level, self.place = 0, row.get("level", 0), pathlib.Path("/tmp")

    def launch(self) -> str:
        """Fork a worker that ends with sys.exit."""
        if os.fork() == 0:
            time.sleep(0.2)
            sys.exit(0)  # caught by the environment's loop in the copy: the copy must not answer anything
        return "launched"

    def move(self) -> str:
        """Move."""
        self.moves += 1
        return f"move {self.moves}"

    def stall(self) -> str:
        """Write the start of a reply on the environment's socket, then hang."""
        frame = sys._getframe()
        while "sock" not in frame.f_locals:
            frame = frame.f_back
        frame.f_locals["sock"].sendall(struct.pack("!Q", 1000) + b"\x80")
        time.sleep(3600)
        return "never"

    def escape(self) -> str:
        """Leave the process group, ignore SIGTERM, hang."""
        os.setpgid(0, os.getpgid(os.getppid()))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
        return "never"

    def shout(self) -> str:
        """A str subclass whose __str__ would run in the trainer."""

        class Loud(str):
            def __str__(self):
                return "ran in the trainer"

        return Loud("plain text")

    def draws(self) -> str:
        """The torch draw of this process."""
        return f"{torch.rand(1).item():.6f}"

    def get_reward(self):
        return [float(self.moves), 1e39, None][self.level % 3]


def test_a_forked_copy_never_answers_so_replies_stay_in_order():
    episodes = Environments.from_factory(Tricky, TIMEOUT).start(rows(1), 1, seeds=[1])
    try:
        handle = episodes.handles[0]
        assert handle._call("launch") == "launched"
        time.sleep(0.5)  # the copy has exited by now
        assert [handle._call("move"), handle._call("move"), handle._reward()] == ["move 1", "move 2", 2.0]
    finally:
        episodes.close()


def test_a_reply_that_starts_and_stalls_times_out_and_an_escaped_process_is_still_killed(new_children):
    episodes = Environments.from_factory(Tricky, 1.0).start(rows(1), 2, seeds=[1, 2])
    try:
        started = time.monotonic()
        with pytest.raises(Exception, match="stall: no answer within 1 s"):
            episodes.handles[0]._call("stall")
        with pytest.raises(Exception, match="escape: no answer within 1 s"):
            episodes.handles[1]._call("escape")
        assert time.monotonic() - started < 30
        assert not new_children()  # the escaped one too: killed by its pid, not only its group
    finally:
        episodes.close()


def test_what_reaches_the_trainer_is_plain_data_and_torch_is_reseeded():
    episodes = Environments.from_factory(Tricky, TIMEOUT).start(rows(1), 2, seeds=[1, 2])
    try:
        result = episodes.handles[0]._call("shout")
        assert type(result) is str and str(result) == "plain text"
        assert episodes.handles[0]._call("draws") != episodes.handles[1]._call("draws")
        assert episodes.handles[0].level == 0  # plain data is read as it is
        with pytest.raises(Exception, match="a PosixPath, not plain data"):
            episodes.handles[0].place  # an object would be unpickled, running its code, in the trainer
    finally:
        episodes.close()


def test_reward_functions_reading_a_gone_or_missing_attribute_score_none_or_fall_back(tiny_model_and_tokenizer):
    """getattr(env, name, default) and hasattr work; an environment stopped by a timeout scores None in every reward
    that reads it, and the step goes on; get_reward past fp32's range scores None."""
    from rewards.scoring import score_completions

    episodes = Environments.from_factory(Tricky, 1.0).start(rows(3), 1, seeds=[1, 2, 3])
    try:
        with pytest.raises(Exception, match="no answer within 1 s"):
            episodes.handles[1]._call("stall")
        handles = episodes.handles
        assert getattr(handles[0], "won", False) is False and not hasattr(handles[0], "won")
        assert hasattr(handles[0], "moves") and handles[0].moves == 0

        def moves(completions, environments, **_):
            return [float(env.moves) for env in environments]

        (name, owned), = Environments.from_factory(Tricky).reward_functions()
        rewards = score_completions([RewardSpec("moves", moves), RewardSpec(name, owned)], ["q"] * 3, ["a"] * 3,
                                    {"environments": handles})
        assert rewards[0].tolist() == [0.0, 0.0]
        assert torch.isnan(rewards[1]).all()  # gone: both rewards leave it out
        assert rewards[2, 0].item() == 0.0 and torch.isnan(rewards[2, 1])  # get_reward gave None
    finally:
        episodes.close()


def test_environments_die_with_a_trainer_that_is_killed(tmp_path):
    import subprocess

    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[1])!r})\n"
        "from tests.test_environments import Quiet, rows\n"
        "from grpo.multiturn.environments import Environments\n"
        "episodes = Environments.from_factory(Quiet).start(rows(1), 3, seeds=[1, 2, 3])\n"
        "print(' '.join(str(handle._pid) for handle in episodes.handles), flush=True)\n"
        "time.sleep(3600)\n")
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(pids) == 3
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
