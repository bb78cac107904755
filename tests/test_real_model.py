"""A real pretrained instruct model: SmolLM2-135M-Instruct (Llama family, 30 layers, ChatML, tied embeddings,
pad == EOS == <|im_end|>), made offline by `python -m grpo.models fetch smollm2-135m-instruct` (.ci/run does).

What toy models hide and this checks on real GSM8K prompts: the real chat template and tokenizer, an EOS that
is also the pad token and also stands inside every prompt, rows of a group that end at different steps, a
30-layer trunk. Skipped, with the reason, when the model has not been fetched ($GRPO_MODELS_DIR or ./models)
or the GSM8K files are absent.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import gsm8k_dir, memory_heavy_section, release_memory
from data import add_prompts
from grpo.models import ModelError, eos_token_ids, resolve_model_name
from grpo.generation.prompts import encode_prompt

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"


def _model_folder() -> str:
    try:
        return resolve_model_name(NAME)
    except ModelError as error:
        pytest.skip(f"the real model is not fetched here: {error}")


@pytest.fixture(scope="module", autouse=True)
def _memory_back_at_the_end():
    """The model, its completions and the parity runs are freed when the module ends; hand their pages back (the
    other worker may run a vLLM server and two trainers next, tests/test_vllm_server.py)."""
    yield
    release_memory()


@pytest.fixture(scope="module")
def real_dir():
    if gsm8k_dir() is None:
        pytest.skip("the GSM8K files (../shared/data/gsm8k) are absent")
    return _model_folder()


@pytest.fixture(scope="module")
def real(real_dir):
    from grpo.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(real_dir)
    model = load_model(real_dir, torch.device("cpu"), torch.float32, tokenizer=tokenizer).eval()
    return model, tokenizer


def gsm8k_rows(split: str, count: int, start: int = 0, one_shot: bool = False) -> list[dict]:
    with open(gsm8k_dir() / f"{split}.jsonl") as file:
        rows = [json.loads(line) for _, line in zip(range(start + count), file)][start:]
    return add_prompts(rows, one_shot=one_shot)


def test_the_fetched_folder_is_smollm2_135m_instruct_with_pad_equal_to_eos(real):
    model, tokenizer = real
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert not hasattr(config, "quantization_config")  # a plain checkpoint, not a GGUF one
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == im_end  # pad == EOS
    assert eos_token_ids(model, tokenizer) == (im_end,)
    prompt = encode_prompt(tokenizer, gsm8k_rows("test", 1)[0]["prompt"])
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\nRespond in the following format:")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.count(im_end) == 2  # EOS stands inside the prompt too: masks must come from lengths, not ids


def _greedy_generate(model, prompts, pad, eos, max_new):
    """model.generate on the prompts left-padded here, the mask from each prompt's length (not from the ids: the
    pad id is also the EOS that stands inside every prompt)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, P)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         pad_token_id=pad, eos_token_id=list(eos))
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def test_prompts(real):
    _, tokenizer = real
    return [encode_prompt(tokenizer, row["prompt"]) for row in gsm8k_rows("test", 8)]


GREEDY_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def greedy_generated(real, test_prompts) -> dict:
    """model.generate's greedy completions of the test prompts for each EOS set, once for both samplers' tests:
    <|im_end|> alone, then also the newline token, so that rows of the batch end at different steps (the finished
    ones padded with the EOS id while the others decode on)."""
    model, tokenizer = real
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    return {eos: _greedy_generate(model, test_prompts, tokenizer.pad_token_id, eos, GREEDY_NEW_TOKENS)
            for eos in ((tokenizer.eos_token_id,), (tokenizer.eos_token_id, newline))}


@pytest.mark.parametrize("sampler", ["plain", "kernel"])
def test_greedy_sampler_equals_generate_on_real_prompts(real, test_prompts, greedy_generated, sampler):
    from grpo.kernels.sampling import FastSampler
    from grpo.algorithm.sampler import SamplingParams, sample_groups

    model, tokenizer = real
    pad, max_new = tokenizer.pad_token_id, GREEDY_NEW_TOKENS
    sample = {"plain": sample_groups, "kernel": FastSampler().sample_groups}[sampler]
    for eos, expected in greedy_generated.items():
        params = SamplingParams(max_completion_length=max_new, temperature=0.0, eos_token_ids=eos)
        got = sample(model, test_prompts, 1, params, pad)
        lengths = got.completion_mask.sum(-1)
        for row in range(len(test_prompts)):
            length = int(lengths[row])
            assert got.completion_ids[row, :length].tolist() == expected[row, :length].tolist(), row
            if length < max_new:  # ended: the row's last token is an EOS, as generate's
                assert int(got.completion_ids[row, length - 1]) in eos and not got.truncated[row]
        if len(eos) == 2:
            assert len(set(lengths.tolist())) > 2, "rows should end at several different steps"


@pytest.mark.parametrize("sampler", ["plain", "kernel"])
def test_sampled_logprobs_equal_a_full_forward(real, test_prompts, real_floor, sampler):
    from grpo.kernels.sampling import FastSampler
    from grpo.algorithm.logprobs import completion_logprobs
    from grpo.algorithm.sampler import SamplingParams, sample_groups

    model, tokenizer = real
    sample = {"plain": sample_groups, "kernel": FastSampler().sample_groups}[sampler]
    params = SamplingParams(max_completion_length=24, temperature=0.9, eos_token_ids=(tokenizer.eos_token_id,))
    out = sample(model, test_prompts[:2], 4, params, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(3),
                 return_logprobs=True)
    prompt_ids = out.prompt_ids.repeat_interleave(4, 0)  # (N, P)
    prompt_mask = out.prompt_mask.repeat_interleave(4, 0)
    input_ids = torch.cat([prompt_ids, out.completion_ids], 1)  # (N, P + T)
    attention_mask = torch.cat([prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        full, _ = completion_logprobs(model, input_ids, attention_mask, out.completion_mask, temperature=0.9)
    mask = out.completion_mask.bool()
    assert len(set(out.completion_ids[:, 0].tolist())) > 1  # the rows of a group differ
    # two fp32 computations of each log-prob (the sampler's decode steps, one full forward): the rounding floor
    torch.testing.assert_close(out.logprobs[mask], full[mask], rtol=1e-5, atol=1e-6 * real_floor)


def test_train_two_steps_then_evaluate_the_checkpoint(real_dir, tmp_path, capsys):
    import eval as eval_program
    import train

    data = str(gsm8k_dir())
    run = tmp_path / "run"
    code = train.main(["--model", real_dir, "--dataset", data, "--one-shot", "--output-dir", str(run), "--max-steps", "2",
                       "--prompts-per-step", "1", "--num-generations", "4", "--micro-batch-size", "4",
                       "--max-completion-length", "24", "--learning-rate", "1e-5", "--save-steps", "0",
                       "--device", "cpu", "--seed", "1"])
    assert code == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 < m["completions/mean_length"] <= 24 for m in metrics)
    (checkpoint,) = sorted((run / "checkpoints").iterdir())
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "chat_template.jinja").exists()

    out = tmp_path / "eval"
    code = eval_program.main(["--model", str(checkpoint), "--compare", real_dir, "--dataset", data, "--one-shot",
                              "--limit", "4", "--max-completion-length", "24", "--device", "cpu",
                              "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    summaries = sorted(out.glob("*.summary.json"))
    assert len(summaries) == 2
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["num_samples"] == 4
        assert {"strict_accuracy", "lenient_accuracy", "format_compliance", "mean_length"} <= set(summary)



# ------------------------------------------------------------------------------------ trl parity on the real model
# The parity suite (tests/test_trl_parity.py) on this model, its real tokenizer, real GSM8K prompts and the model's
# own completions, for one rollout. Its absolute tolerances are multiplied by a floor measured on this machine
# (the `real_floor` fixture): this model's residual stream carries activations of about 25,000 (the tiny model's:
# about 1), so fp32 rounding moves its log-probs by about 1e-5 where the tiny model's move by 1e-7, and by how much
# depends on the CPU's kernels (1.4-1.9e-5 on the machines this ran on). Two fp32 computations of one log-prob, each
# within eps of the exact (fp64) value, agree within the sum of their eps: the floor is eps_trl + eps_ours in units of
# the suite's 1e-6, each measured against fp64 on the parity rollout's rows.
# One rollout: after an AdamW step the two models differ by AdamW's amplification of those rounding differences
# (the suite's docstring), which the same activations turn into logit differences a later rollout would compare.
REAL_MAX_LEN = 12
REAL_ROLLOUTS = 1
REAL_LR = 1e-6  # a real model's GRPO rate: the suite's 1e-4 moves this model so far that the next update's KL is e^20
# An update of 1e-6 is below one fp32 step of a weight near 1 (1.2e-7 is 2**-23 of it): parameters are compared to
# within one such step of their value, on top of the suite's 5e-3 of the learning rate.
REAL_PARAM_RTOL = 2.0**-23
GSPO = dict(level="sequence", iterations=2, epsilon=3e-4, epsilon_high=4e-4)  # GSPO's ranges, an off-policy update
# (settings on top of the parity suite's BASE, kernels): each kernel path on a real model, and three losses. grpo with
# the kernels is left to the tiny model's suite, which pins every loss to both paths at 1e-6
REAL_CONFIGURATIONS = [
    (dict(), "plain"),  # grpo, beta 0.04
    (dict(loss_type="dapo", beta=0.0, epsilon_high=0.28, mask_truncated=True), "auto"),  # DAPO, trl's default loss
    (GSPO, "auto"),
]


@pytest.fixture(scope="module")
def rollout_rows(real):
    from tests import test_trl_parity as parity

    return gsm8k_rows("train", parity.PROMPTS * REAL_ROLLOUTS * parity.MAX_UPDATES_PER_GENERATION, start=200)


@pytest.fixture(scope="module")
def parity_rows(rollout_rows):
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[parity]' (trl==1.16.0)")
    return rollout_rows


@pytest.fixture(scope="module")
def real_completions(real, rollout_rows):
    """The model's own completions of each rollout's prompts (temperature 0.7, seeded), cut as the parity suite
    cuts its random ones: every fourth row runs to the budget without EOS, the others end with <|im_end|> after
    1 to REAL_MAX_LEN - 1 of their tokens, so a group's rows end at different positions."""
    from tests import test_trl_parity as parity
    from grpo.algorithm.sampler import SamplingParams, sample_groups

    model, tokenizer = real
    params = SamplingParams(max_completion_length=REAL_MAX_LEN, temperature=0.7, eos_token_ids=(tokenizer.eos_token_id,))
    per_rollout = []
    for index in range(REAL_ROLLOUTS):
        rows = rollout_rows[index * parity.PROMPTS : (index + 1) * parity.PROMPTS]
        prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
        sample = sample_groups(model, prompts, parity.GROUP, params, tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(index))
        lengths = torch.randint(1, REAL_MAX_LEN, (sample.completion_ids.shape[0],), generator=torch.Generator().manual_seed(9))
        completions = []
        for row, ids in enumerate(sample.completion_ids.tolist()):
            if row % 4 == 1:
                completions.append(ids[:REAL_MAX_LEN])
            else:
                completions.append(ids[: int(lengths[row])] + [tokenizer.eos_token_id])
        per_rollout.append(completions)

    def completions_for(rollout_index, vocabulary, eos, num_rows):
        assert eos == tokenizer.eos_token_id and num_rows == len(per_rollout[rollout_index])
        return per_rollout[rollout_index]

    return completions_for


@pytest.fixture(scope="module")
def rounding(real, rollout_rows, real_completions) -> dict:
    with memory_heavy_section():  # an fp64 copy of the model and its full logits: GiBs
        return fp32_rounding(real, rollout_rows, real_completions)


def fp32_rounding(real, rollout_rows, real_completions) -> dict:
    """The largest |fp32 - fp64| of a completion token's log-prob on the first rollout's rows: `trl`, trl's way (one
    padded forward, full logits, log-softmax); `ours`, the worst of grpo.algorithm.logprobs and grpo.kernels.logprobs (with and
    without the shared-prompt, unpadded passes); `batching`, trl's way batched against one row at a time."""
    from grpo.kernels.buffers import Buffers
    from grpo.kernels.logprobs import completion_logprobs as kernel_logprobs
    from grpo.algorithm.logprobs import completion_logprobs
    from grpo.algorithm.sampler import left_pad

    from tests import test_trl_parity as parity

    model, tokenizer = real
    exact = copy.deepcopy(model).double()
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rollout_rows[: parity.PROMPTS]]
    completions = real_completions(0, len(tokenizer), tokenizer.eos_token_id, parity.PROMPTS * parity.GROUP)
    rows = range(len(completions))
    # trl's layout: prompt and completion left-padded together; the completion's tokens are each row's last ones
    ids, mask = left_pad([prompts[row // parity.GROUP] + completions[row] for row in rows], tokenizer.pad_token_id, "cpu")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = max(map(len, completions))
    last = torch.zeros(len(completions), width, dtype=torch.bool)  # (N, width): the completion tokens
    for row in rows:
        last[row, width - len(completions[row]):] = True

    def trl_way(net, select=slice(None)):
        with torch.no_grad():
            logits = net(input_ids=ids[select], attention_mask=mask[select], position_ids=positions[select]).logits
        logps = torch.log_softmax(logits[:, -width - 1:-1], -1)  # in the logits' dtype, as trl's selective_log_softmax
        return logps.gather(-1, ids[select, -width:, None]).squeeze(-1).double()  # (n, width)

    # our layout: left-padded prompts, right-padded completions
    prompt_ids, prompt_mask = left_pad([prompts[row // parity.GROUP] for row in rows], tokenizer.pad_token_id, "cpu")
    completion_mask = torch.zeros(len(completions), width, dtype=torch.long)
    completion_ids = torch.full((len(completions), width), tokenizer.pad_token_id)
    for row in rows:
        completion_ids[row, : len(completions[row])] = torch.tensor(completions[row])
        completion_mask[row, : len(completions[row])] = 1
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        reference = completion_logprobs(exact, input_ids, attention_mask, completion_mask)[0]
        ours = [completion_logprobs(model, input_ids, attention_mask, completion_mask)[0]]
        ours += [kernel_logprobs(model, input_ids, attention_mask, completion_mask, buffers=Buffers(), **kernels)[0]
                 for kernels in (dict(), dict(shared_prompts=True, unpadded=True))]
    valid = completion_mask.bool()
    batched = trl_way(model)
    return {"trl": (batched - trl_way(exact))[last].abs().max().item(),
            "ours": max((logps.double() - reference.double())[valid].abs().max().item() for logps in ours),
            "batching": (batched - torch.cat([trl_way(model, slice(row, row + 1)) for row in rows]))[last].abs().max().item()}


@pytest.fixture(scope="module")
def real_floor(rounding) -> float:
    """The parity tolerances' multiplier on this machine: (eps_trl + eps_ours) / 1e-6 (see the comment above)."""
    return (rounding["trl"] + rounding["ours"]) / 1e-6


@pytest.mark.parity
@pytest.mark.usefixtures("memory_heavy")
@pytest.mark.parametrize("change,kernels", REAL_CONFIGURATIONS, ids=["grpo-plain", "dapo-auto", "gspo-auto"])
def test_same_numbers_as_trl_on_the_real_model(real_dir, parity_rows, real_completions, real_floor, change, kernels,
                                               tmp_path):
    from tests import test_trl_parity as parity

    settings = dict(parity.BASE, **change)
    try:
        parity.assert_same_numbers_as_trl(Path(real_dir), parity_rows, settings, tmp_path, kernels, real_completions,
                                          max_len=REAL_MAX_LEN, num_rollouts=REAL_ROLLOUTS, floor=real_floor,
                                          lr=REAL_LR, param_rtol=REAL_PARAM_RTOL)
    finally:
        parity.drop_trainers()


def test_fp32_rounding_floor_of_the_real_model(rounding):
    """What the real-model tolerances rest on (`real_floor`): this model's fp32 rounding of a log-prob, against fp64,
    is above the tiny model's tolerance of 1e-6 (so the parity suite's 1e-6 cannot hold here), and our log-prob code
    (plain and kernels) rounds no worse than twice trl's way of computing them; trl's own log-probs batched and one
    row at a time differ by no more than the floor."""
    assert 1e-6 < rounding["trl"] < 1e-4, rounding
    assert rounding["ours"] < 2 * rounding["trl"], rounding
    assert rounding["batching"] <= rounding["trl"] + rounding["ours"], rounding


@pytest.mark.parity
@pytest.mark.usefixtures("memory_heavy")
def test_the_real_gsm8k_benchmark_runs_end_to_end(real_dir, tmp_path, monkeypatch):
    """bench/real_gsm8k.py with tiny settings: cold start, evaluation, one step of each side, the report."""
    from bench import real_gsm8k

    monkeypatch.setenv("GRPO_MODELS_DIR", str(Path(real_dir).parent))  # the children resolve the name the same way
    out = tmp_path / "bench"
    assert real_gsm8k.main(["--out", str(out), "--seeds", "0", "--trl-seeds", "0", "--steps", "1", "--heldout", "2",
                            "--max-completion-length", "8", "--warm-start-steps", "1", "--prompts-per-step", "1",
                            "--micro-batch-size", "8"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [(run["side"], run["seed"]) for run in results["runs"]] == [("ours", 0), ("trl", 0)]
    for run in results["runs"]:
        (step,) = run["steps"]
        assert 0 < step["sample"] < step["time"] and 0 < step["reference"] < step["time"] and step["length"] <= 8
        assert {"xmlcount", "soft_format", "strict_format", "int", "correctness"} <= set(step)  # trl's int_answer too
        assert run["after"]["num_samples"] == 2 and run["peak_rss_mib"] > 0
    assert results["ratios"][0]["step"] > 0 and (out / "real_gsm8k.png").is_file()
