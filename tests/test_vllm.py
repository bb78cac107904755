"""Generation on vLLM (grpo/generation/vllm.py), on the CPU build: both placements, weight sync checked through
the engine, staleness 0 against the synchronous run, tools token in and token out, and the faults.

The engine runs in subprocesses (tests/distributed_worker.py, train.py): an in-process engine joins a
torch.distributed world of its own, which a test process shares with the tests after it. The model is the tiny
Qwen2 with 64-wide heads (`tiny:tiny-vllm`), which vLLM's CPU attention runs. Under CI (GRPO_REQUIRE_VLLM=1,
set by .ci/run) a missing or broken vLLM fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from grpo.algorithm.sampler import SamplingParams
from grpo.config import GRPOConfig
from grpo.multiturn.tools import ToolSet
from tests.test_distributed import ROOT, launch
from tests.test_tools import add, broken, call_text, encode, suffix

REQUIRED = os.environ.get("GRPO_REQUIRE_VLLM") == "1"


def _vllm_error() -> str | None:
    try:
        from grpo.generation.vllm import import_vllm

        import_vllm()
    except ValueError as error:  # EngineError: not installed, or its torchvision breaks it
        return str(error)
    return None


VLLM_ERROR = _vllm_error()
needs_vllm = pytest.mark.skipif(VLLM_ERROR is not None and not REQUIRED, reason=f"vLLM unavailable: {VLLM_ERROR}")
VLLM = dict(model="tiny:tiny-vllm", generation_backend="vllm", max_steps=2, max_completion_length=12)
# fp32 engine against the trainer's fp32 forward on the same weights: what the two kernels' sums differ by
# (the 1,012 SmolLM2 tokens: max 3.5e-5); an update at lr 1e-3 moves these log-probs by ~1e-2
MISMATCH = 1e-4


def test_vllm_imports_in_this_environment():
    """The set-up (README, .ci/run) leaves a working vLLM: CI fails here if the install broke it."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    assert VLLM_ERROR is None, VLLM_ERROR


# ----------------------------------------------------------------------------- settings, checked once

def test_use_vllm_is_trls_switch_and_the_options_are_checked():
    config = GRPOConfig(use_vllm=True).validate()
    assert config.generation_backend == "vllm" and config.corrects_behaviour  # trl: on whenever vLLM samples
    assert not GRPOConfig(use_vllm=True, importance_sampling_correction=False).validate().corrects_behaviour
    assert not GRPOConfig().validate().corrects_behaviour  # our sampler's synchronous loop is unchanged
    cases = {
        "asks for the vllm backend": dict(use_vllm=True, generation_backend="transformers"),
        "--vllm-mode server with --vllm-enable-sleep-mode": dict(generation_backend="vllm", vllm_mode="server",
                                                                  vllm_enable_sleep_mode=True),
        "--vllm-mode server with another backend": dict(vllm_mode="server"),
        "vllm_server_timeout must be > 0": dict(generation_backend="vllm", vllm_mode="server", vllm_server_timeout=0),
        "vllm_gpu_memory_utilization must be in": dict(generation_backend="vllm", vllm_gpu_memory_utilization=1.5),
        "vllm_kv_cache_gib must be > 0": dict(generation_backend="vllm", vllm_kv_cache_gib=0.0),
        "--vllm-max-model-length 100 is below the longest request, --max-prompt-length 64 \\+ "
        "--max-completion-length 64 = 128": dict(generation_backend="vllm", vllm_max_model_length=100,
                                                     max_prompt_length=64, max_completion_length=64),
        "vllm_tensor_parallel_size must be >= 1": dict(generation_backend="vllm", vllm_tensor_parallel_size=0),
    }
    for message, fields in cases.items():
        with pytest.raises(ValueError, match=message):
            GRPOConfig(**fields).validate()
    GRPOConfig(generation_backend="vllm", vllm_mode="server", max_staleness=1).validate()  # a background thread
    GRPOConfig(generation_backend="vllm", tools=["data.calculator:calculator"]).validate()  # tools: our sampler and vLLM
    with pytest.raises(ValueError, match="sampler or vllm"):
        GRPOConfig(generation_backend="transformers", tools=["data.calculator:calculator"]).validate()


def test_placement_refusals():
    from grpo.core.setup import Processes, vllm_engine

    def processes(generators=()):  # one training process, with the generation ranks given
        return Processes(SimpleNamespace(size=1, rank=0), 0, list(generators), None, torch.device("cpu"), "fp32")

    with pytest.raises(ValueError, match="needs generation processes"):
        vllm_engine(GRPOConfig(generation_backend="vllm", max_staleness=1).validate(), processes(), None)
    with pytest.raises(ValueError, match="tensor-parallel-size > 1 needs generation processes"):
        vllm_engine(GRPOConfig(generation_backend="vllm", vllm_tensor_parallel_size=2).validate(), processes(), None)
    # a training process beside generation processes holds no engine: it evaluates with our sampler
    assert vllm_engine(GRPOConfig(generation_backend="vllm", max_staleness=0).validate(), processes([1]),
                       None) == ("sampler", None)
    assert vllm_engine(GRPOConfig().validate(), processes(), None) == ("sampler", None)
    # a server: one process with --max-staleness samples on it from a background thread and evaluates with ours;
    # under torchrun the generation processes --max-staleness takes would have nothing to do
    server = GRPOConfig(generation_backend="vllm", vllm_mode="server", max_staleness=1).validate()
    backend, builder = vllm_engine(server, processes(), None)
    assert backend == "sampler" and builder.func.__name__ == "VLLMServerGenerate"
    with pytest.raises(ValueError, match="server with --max-staleness under torchrun"):
        vllm_engine(server, processes([1]), None)


@needs_vllm
def test_an_architecture_vllm_does_not_implement_is_refused_naming_it():
    from transformers import Qwen2Config

    from grpo.generation.vllm import EngineError, check_architecture

    config = Qwen2Config(architectures=["NoSuchModelForCausalLM"])
    with pytest.raises(EngineError, match="NoSuchModelForCausalLM.*--vllm-model-impl transformers"):
        check_architecture(config, "auto")
    check_architecture(config, "transformers")  # vLLM's transformers backend is asked to try it
    check_architecture(Qwen2Config(architectures=["Qwen2ForCausalLM"]), "auto")


def test_inference_weights_are_the_checkpoint_names_with_lora_merged_in(tiny_model_and_tokenizer):
    """The names vLLM reads are derived from the model: its own parameter names, a LoRA layer standing for its base
    layer with the adapter merged in out of place (the model's own weights untouched), tied weights once."""
    import copy

    from grpo.core.setup import lora_settings
    from grpo.lora import add_lora
    from grpo.generation.vllm import inference_weights

    model = copy.deepcopy(tiny_model_and_tokenizer[0])
    plain = {name: tensor.clone() for name, tensor in inference_weights(model)}
    assert list(plain) == [name for name, _ in model.named_parameters()]  # tied output head: once
    peft_model = add_lora(model, lora_settings(GRPOConfig(use_peft=True, lora_r=2).validate()))
    with torch.no_grad():  # an adapter that changes the weights
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {name: p.clone() for name, p in peft_model.named_parameters()}
    sent = {name: tensor.clone() for name, tensor in inference_weights(peft_model.get_base_model())}
    assert all(torch.equal(p, before[name]) for name, p in peft_model.named_parameters())  # nothing merged in place
    assert list(sent) == list(plain)
    peft_model.merge_adapter()  # peft's own merge gives the same weights
    merged = dict(inference_weights(peft_model.get_base_model()))
    changed = [name for name in plain if not torch.equal(plain[name], sent[name])]
    assert changed and all(name.endswith("proj.weight") for name in changed)
    for name in plain:
        torch.testing.assert_close(sent[name], merged[name], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- tools: token in, token out

class PlannedEngine:
    """Stands in for vLLM's LLM: each request continues its row's planned completion up to the next EOS (or its
    max_tokens), and every request's prompt must be the row's prompt and its tokens so far, exactly: nothing is
    re-tokenized between a tool's result and the next turn."""

    def __init__(self, prompt: list[int], plans: list[list[int]], eos: int):
        self.prompt, self.plans, self.eos, self.so_far, self.requests = prompt, plans, eos, {}, 0

    def generate(self, requests, options, use_tqdm=False):
        outputs = []
        for request, option in zip(requests, options, strict=True):
            ids = request["prompt_token_ids"]
            assert ids[: len(self.prompt)] == self.prompt
            done = ids[len(self.prompt):]
            row = next(r for r, plan in enumerate(self.plans) if plan[: len(done)] == done and (
                r not in self.so_far if not done else len(self.so_far.get(r, [])) < len(done)))
            plan, tokens = self.plans[row], []
            for token in plan[len(done):]:
                tokens.append(token)
                if token == self.eos or len(tokens) == option.max_tokens:
                    break
            self.so_far[row] = done + tokens
            self.requests += 1
            logprobs = [{token: SimpleNamespace(logprob=-1.0)} for token in tokens]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)]))
        return outputs


@needs_vllm
def test_tool_results_continue_the_same_token_sequence(tiny_model_and_tokenizer):
    """The tools path of tests/test_tools.py through the vllm backend: the same completions, masks and calls."""
    from grpo.generation.vllm import VLLMGenerate

    model, tokenizer = tiny_model_and_tokenizer
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tools=[add, broken],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    eos = tokenizer.eos_token_id
    first, answer = encode(tokenizer, "Let me use the tool. "), encode(tokenizer, "<answer>5</answer>")
    call_23, call_broken = encode(tokenizer, call_text("add", a=2, b=3)), encode(tokenizer, call_text("broken", x=1))
    s5 = suffix(tokenizer, "5")
    s_err = suffix(tokenizer, json.dumps({"error": "RuntimeError: out of order"}), name="broken")
    expected = [first[:1] + call_23 + [eos] + s5 + answer + [eos], first + answer + [eos],
                first + first + call_23 + [eos] + s5 + answer + [eos], first + call_broken + [eos] + s_err + answer + [eos]]
    engine = PlannedEngine(prompt, expected, eos)
    backend = object.__new__(VLLMGenerate)  # the backend around a planned engine (no vLLM process)
    backend.__dict__.update(model=model, pad_token_id=tokenizer.pad_token_id, in_process=True, processes=[],
                            tools=ToolSet([add, broken], tokenizer, eos), llm=engine, sleeping=False, stale=False,
                            settings=SimpleNamespace(enable_sleep_mode=False, structured_outputs_regex=None))
    params = SamplingParams(max_completion_length=200, temperature=1.0, eos_token_ids=(eos,))
    sample = backend.generate([prompt], 4, params, torch.Generator().manual_seed(0), return_logprobs=True)

    lengths = sample.completion_mask.sum(-1).tolist()
    assert lengths == [len(e) for e in expected]
    results = [s5, None, s5, s_err]
    for row, tokens in enumerate(expected):
        assert sample.completion_ids[row, : lengths[row]].tolist() == tokens, row
        turn = len(tokens) - (len(results[row]) + len(answer) + 1 if results[row] else 0)
        mask = [1] * turn + ([0] * len(results[row]) + [1] * (len(answer) + 1) if results[row] else [])
        assert sample.tool_mask[row, : lengths[row]].tolist() == mask, row
        assert sample.logprobs[row, : lengths[row]].tolist() == [-1.0 * m for m in mask]  # results carry none
    assert not sample.truncated.any()
    assert sample.tool_calls.tolist() == [[1, 0, 2], [0, 0, 1], [1, 0, 2], [1, 1, 2]]
    assert sample.messages[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert engine.requests == 7  # four first turns, then one request per row that had a result to go on from

    # a result that does not fit the budget ends the row after its call, as our sampler does
    engine = PlannedEngine(prompt, expected[:1], eos)
    backend.llm = engine
    budget = len(first[:1] + call_23) + 1 + len(s5) - 1
    sample = backend.generate([prompt], 1, SamplingParams(budget, 1.0, eos_token_ids=(eos,)), None)
    assert sample.completion_mask.sum().item() == len(first[:1] + call_23) + 1 and not sample.truncated[0]
    assert engine.requests == 1


# ----------------------------------------------------------------------------- the real engine, both placements

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, the engine colocated: the reference the other placements are compared with."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    return launch(tmp_path_factory.mktemp("vllm_single"), 1, **VLLM)[1][0]


def _check_engine_follows_the_policy(record):
    """After the updates, the engine's log-probs of a fixed sequence are the trained policy's, and they moved."""
    gap = (record["engine_end"] - record["policy_logps"]).abs().max().item()
    moved = (record["engine_end"] - record["engine_start"]).abs().max().item()
    assert gap < MISMATCH and moved > 10 * MISMATCH, (gap, moved)


@pytest.mark.slow
def test_weight_sync_through_the_engine_single_process(single):
    _check_engine_follows_the_policy(single)
    assert single["result"]["status"] == "finished"
    for step in single["steps"]:  # the behaviour policy is vLLM's: the correction's metrics are logged every step
        metrics = step["metrics"]
        assert 0 <= metrics["sampling/sampling_logp_difference/mean"] < MISMATCH
        assert metrics["sampling/importance_sampling_ratio/min"] > 0.99


@pytest.mark.slow
def test_vllm_samples_with_the_repetition_penalty_and_returns_its_log_probs(tmp_path):
    """repetition_penalty reaches vLLM's SamplingParams; its processed log-probs of the first rollout are the
    penalized distribution's, recomputed from the policy (tests/distributed_worker.py), and not the plain one's."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    step = launch(tmp_path, 1, **{**VLLM, "max_steps": 1, "repetition_penalty": 1.5})[1][0]["steps"][0]
    assert (step["sampled_logprobs"] - step["penalized"]).abs().max().item() < MISMATCH
    assert (step["sampled_logprobs"] - step["unpenalized"]).abs().max().item() > 100 * MISMATCH


@pytest.mark.slow
def test_vllm_guided_decoding_makes_every_completion_match_the_regex(tmp_path):
    """vllm_structured_outputs_regex (trl's field): every training completion vLLM samples matches it, the EOS after
    it; the options are refused where they cannot work."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    from grpo.tiny_model import build_tokenizer

    regex = r"<answer>[0-9]{1,3}</answer>"
    # a budget the longest match fits in, spelt a character a token (the regex does not follow the tokenizer)
    step = launch(tmp_path, 1, **{**VLLM, "max_steps": 1, "max_completion_length": 24,
                                  "vllm_structured_outputs_regex": regex})[1][0]["steps"][0]
    tokenizer = build_tokenizer()
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for group in step["completions"].values()
             for ids in group]
    assert texts and all(re.fullmatch(regex, text) for text in texts), texts
    for settings, message in ((dict(vllm_structured_outputs_regex=regex), "needs --use-vllm"),
                              (dict(use_vllm=True, vllm_structured_outputs_regex="(unclosed"),
                               "is not a regular expression")):
        with pytest.raises(ValueError, match=message):
            GRPOConfig(**settings).validate()


@pytest.mark.slow
def test_colocate_under_torchrun_fsdp2(single, tmp_path):
    """Two ranks, an engine in each (external_launcher), FSDP2 gathering one parameter at a time for the sync; each
    prompt's completions are the one-process run's (per-row seeds: no world size changes them)."""
    _, ranks = launch(tmp_path, 2, **VLLM)
    assert ranks[0]["mode"] == "fsdp"
    for record in ranks:
        _check_engine_follows_the_policy(record)
    for step, reference in enumerate(single["steps"]):
        completions = {**ranks[0]["steps"][step]["completions"], **ranks[1]["steps"][step]["completions"]}
        assert completions == reference["completions"], step


@pytest.mark.slow
def test_lora_merge_load_unmerge_with_more_prompt_tokens_than_one_engine_step(tmp_path):
    """LoRA merged for the copy; and 128 rows whose prompts hold more tokens than one engine step takes (4,096), so
    vLLM prefills them over several steps: a prompt it split would rewind its seeded CPU generator, which fails."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    settings = dict(VLLM, max_steps=1, prompts_per_step=8, num_generations=16, micro_batch_size=32)
    _, (record,) = launch(tmp_path, 1, **settings, use_peft=True, lora_r=4, lora_alpha=8, learning_rate=2e-2)
    _check_engine_follows_the_policy(record)
    assert any("lora_B" in name for name in record["params"])  # the adapters trained, the engine saw them merged
    assert sum(len(c) for c in record["steps"][0]["completions"].values()) == 128


@pytest.mark.slow
def test_generation_rank_at_staleness_0_is_the_synchronous_run(single, tmp_path):
    """The engine on a generation rank (a child process fed through shared memory), one training rank: at
    --max-staleness 0 the weights are the synchronous run's, to the bit."""
    _, ranks = launch(tmp_path, 2, **VLLM, max_staleness=0)
    trainer, generator = ranks
    assert generator["generating"] and not trainer["generating"]
    for name, value in single["params"].items():
        assert torch.equal(trainer["params"][name], value), name
    assert [s["metrics"]["reward"] for s in trainer["steps"]] == [s["metrics"]["reward"] for s in single["steps"]]


@pytest.mark.slow
def test_a_generation_ranks_engine_that_dies_ends_the_run_naming_it(tmp_path):
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    done, _ = launch(tmp_path, 2, "engine_kill", check=False, timeout=180,
                     **{**VLLM, "max_staleness": 0, "max_steps": 3})
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "generation process (rank 1)" in output and "the vLLM engine's process" in output, output[-3000:]
    assert "died" in output


@pytest.mark.slow
def test_an_engine_that_fails_mid_run_keeps_the_checkpoint_and_resume_goes_on(tmp_path):
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    settings = dict(VLLM, max_steps=3, save_steps=1)
    done, _ = launch(tmp_path / "first", 1, "engine_raise", check=False, output_dir=str(tmp_path / "run"), **settings)
    assert done.returncode != 0
    assert "the vLLM engine failed: RuntimeError: a deliberate engine failure" in done.stderr
    assert "The last good checkpoint is" in done.stderr and "step-000001" in done.stderr
    _, (record,) = launch(tmp_path / "second", 1, output_dir=str(tmp_path / "run"), resume=str(tmp_path / "run"),
                          **settings)
    assert record["result"]["status"] == "finished" and record["result"]["step"] == 3
    assert len(record["steps"]) == 2  # steps 2 and 3, from the checkpoint of step 1
    _check_engine_follows_the_policy(record)


@pytest.mark.slow
@pytest.mark.parametrize("flags, named", [
    (["--vllm-kv-cache-gib", "0.00001"], "--vllm-kv-cache-gib"),  # vLLM's own refusal: no block at all
    (["--vllm-kv-cache-gib", "0.001", "--num-generations", "16", "--micro-batch-size", "32",
      "--max-completion-length", "128"], "less than one group's"),  # ~1,000 tokens: one request fits, a group not
    (["--max-prompt-length", "40000"], "--max-prompt-length 40000 + --max-completion-length 8"),  # > 32,768 positions
])
def test_an_engine_that_cannot_serve_the_run_stops_it_before_step_1(tmp_path, flags, named):
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    command = [sys.executable, str(ROOT / "train.py"), "--model", "tiny:tiny-vllm", "--dataset", "synthetic:16",
               "--generation-backend", "vllm", "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
               "--micro-batch-size", "4", "--max-completion-length", "8", "--output-dir", str(tmp_path / "run"),
               "--device", "cpu", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], done.stderr[-3000:]
    assert "step 1:" not in done.stdout
