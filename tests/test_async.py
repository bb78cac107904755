"""The behaviour policy's correction (grpo.algorithm.off_policy) against naive references, and asynchronous rollouts
in one process (grpo.generation.async_rollouts.BackgroundRollouts): exact at staleness 0, bounded above it, seeded runs
reproducible, stale rollouts dropped, failures named, SIGTERM resumable. Under torchrun: tests/test_distributed.py."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest
import torch

from grpo.algorithm.off_policy import IMPORTANCE_SAMPLING_MODES, behaviour_weights, mismatch_statistics
from grpo.config import GRPOConfig
from grpo.generation import async_rollouts
from grpo.generation.async_rollouts import GenerationError, steps_ahead
from grpo.core.checkpoint import latest_checkpoint
from grpo.core.trainer import Trainer
from tests.test_reliability import ROOT, _env, _wait_for_lines

BASE = dict(
    model="tiny", dataset="synthetic:64", prompts_per_step=2, num_generations=4, micro_batch_size=8,
    max_prompt_length=128, max_completion_length=8, learning_rate=1e-3, reward=["tags"], device="cpu",
    precision="fp32", save_steps=0, log_completions_steps=0, logging_steps=100, warmup_ratio=0.0, max_steps=4,
    adapt_cpu_threads=False,
)


def _run(tmp_path, name, **overrides):
    trainer = Trainer(GRPOConfig(**{**BASE, "output_dir": str(tmp_path / name), **overrides}))
    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return logged, {key: value.clone() for key, value in trainer.policy.state_dict().items()}


# ----------------------------------------------------------------------------- w = pi_old / pi_b, naively

def _naive_weights(old, behaviour, mask, mode, low, high):
    """One value at a time, in float64, as trl's docstring says it."""
    rows, width = old.shape
    out = []
    for i in range(rows):
        diffs = [0.0 if not mask[i, t] or math.isnan(behaviour[i, t]) else float(old[i, t] - behaviour[i, t])
                 for t in range(width)]
        values = [sum(diffs)] if mode.startswith("sequence") else diffs
        row = []
        for log_w in values:
            w = math.exp(log_w)
            if mode.endswith("truncate"):
                w = min(max(w, low if low is not None else -math.inf), high if high is not None else math.inf)
            elif (low is not None and w < low) or (high is not None and w > high):
                w = 0.0
            row.append(w)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_behaviour_weights_are_the_naive_ones(mode, bounds):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    behaviour = old + (torch.rand(5, 7, generator=g, dtype=torch.float64) - 0.5) * (0.6 if mode[0] == "s" else 3.0)
    behaviour[4] -= 0.5  # a completion far off on each side (sequence modes: w beyond both bounds)
    behaviour[2] += 0.3
    behaviour[1, 2] = float("nan")  # a token the backend could not score: w = 1 there
    mask = torch.ones(5, 7)
    mask[0, 5:] = 0
    mask[3, 1:3] = 0  # a tool result inside the completion
    weights = behaviour_weights(old, behaviour, mask, mode, *bounds)
    expected = _naive_weights(old, behaviour, mask, mode, *bounds)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0)
    real = expected.flatten() if mode[0] == "s" else expected[mask.bool()]
    low, high = bounds[0] or 0.0, bounds[1] or math.inf
    assert ((real > low) & (real < high)).any() and ((real <= low) | (real >= high)).any()  # the bounds bite


def test_mismatch_statistics_are_means_over_the_scored_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.5, -1.0, float("nan")], [-0.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    weights = behaviour_weights(old, behaviour, mask, "token_truncate", None, 10.0)
    stats = mismatch_statistics(old, behaviour, mask, weights)
    diffs = [0.5, -1.0, 0.0, 0.5]  # logp_old - logp_b over the 4 scored real tokens
    assert stats["tokens"].item() == 4
    assert stats["diff_sum"].item() == pytest.approx(sum(abs(d) for d in diffs))
    assert stats["diff_max"].item() == pytest.approx(1.0)
    assert stats["kl_sum"].item() == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs))
    assert stats["w_count"].item() == 5  # w over every real token (the unscored one has w = 1)
    assert stats["w_max"].item() == pytest.approx(math.exp(0.5))
    assert stats["w_min"].item() == pytest.approx(math.exp(-1.0))


def test_a_rank_without_loss_tokens_leaves_the_logged_extremes_alone():
    # Two ranks (a fake World that reduces over their statistics): one has every completion masked out
    # (mask_truncated_completions in a token mode); the logged min / max of w are the other rank's.
    from grpo.core.metrics import sampling_metrics

    class TwoRanks:
        def __init__(self, other):
            self.other = other

        def sum(self, value):
            return value + self.other["sum"].pop(0)

        def max(self, value):
            return max(value, self.other["max"].pop(0))

    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    full, empty = torch.ones(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    stats = [mismatch_statistics(old, behaviour, mask, behaviour_weights(old, behaviour, mask, "token_truncate",
                                                                          None, 10.0)) for mask in (full, empty)]
    assert stats[1]["w_count"].item() == 0 and stats[1]["w_min"].item() == math.inf
    sums = ("diff_sum", "tokens", "kl_sum", "w_sum", "w_count")
    other = {"sum": [stats[1][k].item() for k in sums], "max": [stats[1]["diff_max"].item(),
                                                                -stats[1]["w_min"].item(), stats[1]["w_max"].item()]}
    metrics = sampling_metrics(TwoRanks(other), stats[0])
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-1.0))
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))
    alone = sampling_metrics(TwoRanks({"sum": [0.0] * 5, "max": [0.0, -math.inf, 0.0]}), stats[1])
    assert alone["sampling/importance_sampling_ratio/min"] == alone["sampling/importance_sampling_ratio/max"] == 1.0


def test_trl_spellings_and_the_checks_of_the_correction():
    from grpo.cli import config_from_args

    config = config_from_args(["--vllm-importance-sampling-mode", "token_truncate", "--vllm_importance_sampling_cap",
                               "2.0", "--no-vllm-importance-sampling-correction", "--max-staleness", "1"])
    assert (config.importance_sampling_mode, config.importance_sampling_clip_max) == ("token_truncate", 2.0)
    assert config.importance_sampling_correction is False and not config.corrects_behaviour
    assert GRPOConfig(max_staleness=0).corrects_behaviour and not GRPOConfig().corrects_behaviour
    assert GRPOConfig.from_dict({"vllm_importance_sampling_clip_min": 0.1}).importance_sampling_clip_min == 0.1
    with pytest.raises(ValueError, match="given twice"):
        GRPOConfig.from_dict({"vllm_importance_sampling_mode": "token_mask", "importance_sampling_mode": "token_truncate"})
    for bad, message in [(dict(importance_sampling_clip_min=3.0), "must be less than"),
                         (dict(importance_sampling_mode="token_truncate", importance_sampling_clip_max=None),
                          "set importance_sampling_clip_min or importance_sampling_clip_max"),
                         (dict(loss_type="vespo"), "vespo"), (dict(max_staleness=-1), "max_staleness must be >= 0"),
                         (dict(generation_processes=0), "generation_processes")]:
        with pytest.raises(ValueError, match=message):
            GRPOConfig(**{**dict(max_staleness=1), **bad}).validate()


def test_a_rollout_without_behaviour_log_probs_is_refused_when_corrected(tmp_path):
    from tests.test_trainer import fixed_rollout

    trainer = Trainer(GRPOConfig(**{**BASE, "output_dir": str(tmp_path / "run"), "importance_sampling_correction": True}))
    with pytest.raises(ValueError, match="sampler_logprobs"):
        trainer.train_on_rollout(fixed_rollout(trainer))


# ----------------------------------------------------------------------------- one process: a background thread

@pytest.mark.parametrize("kernels", ["plain", "auto"])
def test_staleness_0_is_the_synchronous_loop(tmp_path, kernels):
    """Bit for bit: without the correction against the plain loop, with it against the loop that corrects (one
    torch thread: the sampler's log-probs, which the correction reads, round with the thread count of the thread
    that samples)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _staleness_0_is_the_synchronous_loop(tmp_path, kernels)
    finally:
        torch.set_num_threads(threads)


def _staleness_0_is_the_synchronous_loop(tmp_path, kernels):
    sync, sync_weights = _run(tmp_path, "sync", kernels=kernels)
    ahead, ahead_weights = _run(tmp_path, "async", kernels=kernels, max_staleness=0, importance_sampling_correction=False)
    corrected, corrected_weights = _run(tmp_path, "sync_is", kernels=kernels, importance_sampling_correction=True)
    ahead_is, ahead_is_weights = _run(tmp_path, "async_is", kernels=kernels, max_staleness=0)
    for expected, got in ((sync, ahead), (corrected, ahead_is)):
        for row, other in zip(expected, got, strict=True):
            assert other["sample/staleness_max"] == 0.0
            for key in ("reward", "loss", "grad_norm", "kl", "completions/mean_length", "num_tokens"):
                assert other[key] == row[key], (key, expected is sync)
    assert "sampling/importance_sampling_ratio/mean" in ahead_is[0] and "sampling/mismatch_kl" not in ahead[0]
    for name, value in sync_weights.items():
        assert torch.equal(value, ahead_weights[name]) and torch.equal(corrected_weights[name], ahead_is_weights[name])


def test_staleness_1_samples_one_update_ahead_and_is_reproducible(tmp_path):
    first, first_weights = _run(tmp_path, "a", max_staleness=1)
    second, second_weights = _run(tmp_path, "b", max_staleness=1)
    sync, _ = _run(tmp_path, "sync")
    assert [row["sample/staleness_max"] for row in first] == [0.0, 1.0, 1.0, 1.0]
    assert [row["loss"] for row in first] == [row["loss"] for row in second]  # seeded: timing changes nothing
    assert all(torch.equal(value, second_weights[name]) for name, value in first_weights.items())
    assert first[0]["reward"] == sync[0]["reward"] and first[1]["reward"] != sync[1]["reward"]  # step 2 sampled earlier
    # two updates per step (num_iterations 2): --max-staleness 1 cannot sample a step ahead, 2 can
    assert steps_ahead(1, 2) == 0 and steps_ahead(2, 2) == 1
    two, _ = _run(tmp_path, "two", max_staleness=2, num_iterations=2, max_steps=3)
    assert [row["sample/staleness_max"] for row in two] == [0.0, 2.0, 2.0]


def test_a_rollout_past_the_bound_is_refused(tmp_path, monkeypatch):
    """A generator that ran two steps ahead under --max-staleness 1 is stopped, not trained on."""
    monkeypatch.setattr("grpo.core.trainer.steps_ahead", lambda max_staleness, updates: 2)
    with pytest.raises(GenerationError, match="staler than --max-staleness"):
        _run(tmp_path, "run", max_staleness=1)


def _failing_reward(prompts, completions, **kwargs):
    raise RuntimeError("a deliberate failure while scoring")


def test_a_failing_generator_ends_the_run_with_its_cause(tmp_path):
    from rewards import RewardSpec

    trainer = Trainer(GRPOConfig(**{**BASE, "output_dir": str(tmp_path / "run"), "max_staleness": 1}),
                      reward_functions=[RewardSpec("failing", _failing_reward)])
    with pytest.raises(GenerationError, match="a deliberate failure while scoring"):
        trainer.train()
    assert not any(thread.name == "grpo-rollouts" and thread.is_alive() for thread in __import__("threading").enumerate())


def _command(out, *extra):
    flags = ["--model", "tiny", "--dataset", "synthetic:64", "--prompts-per-step", "2", "--num-generations", "4",
             "--micro-batch-size", "4", "--max-completion-length", "8", "--max-prompt-length", "128",
             "--learning-rate", "1e-3", "--reward", "tags", "--device", "cpu", "--max-steps", "8",
             "--log-completions-steps", "0", "--save-steps", "2", "--max-staleness", "0", "--no-adapt-cpu-threads"]
    return [sys.executable, str(ROOT / "train.py"), *flags, "--output-dir", str(out), *extra]


@pytest.mark.slow
def test_sigterm_leaves_a_checkpoint_that_resumes_exactly_at_staleness_0(tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(_command(straight), check=True, env=_env(), capture_output=True)
    out = tmp_path / "run"
    process = subprocess.Popen(_command(out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_lines(out / "metrics.jsonl", 3, process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 143 and "checkpoint saved" in output, output[-3000:]
    stopped_at = int(latest_checkpoint(out).name.split("-")[1])
    assert 3 <= stopped_at < 8
    resumed = subprocess.run(_command(out, "--resume"), env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    expected = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in got] == list(range(1, 9))
    for key in ("reward", "loss", "grad_norm", "sampling/importance_sampling_ratio/mean"):
        assert [row[key] for row in got] == [row[key] for row in expected], key
    from safetensors.torch import load_file

    a, b = (load_file(latest_checkpoint(run) / "model.safetensors") for run in (straight, out))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_thread_samples_from_exactly_the_weights_its_step_allows():
    """weights_step: lag 0 is the previous step's weights; the first steps of a (resumed) run use its start."""
    assert [async_rollouts.weights_step(t, 0, 0) for t in range(4)] == [0, 1, 2, 3]
    assert [async_rollouts.weights_step(t, 2, 5) for t in range(5, 10)] == [5, 5, 5, 6, 7]
    assert async_rollouts.is_stale(3, 5, 1) and not async_rollouts.is_stale(4, 5, 1)
