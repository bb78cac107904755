"""torchrun with 2 (and 4) CPU processes on gloo against one process: the same prompts, completions, advantages,
metrics, gradients and weights (tests/distributed_worker.py is each process).

Every launch uses a free port, torch.set_num_threads(1) in the workers, a 30 s collective timeout
(`distributed_timeout`) and a wall-clock limit, so a hang fails the test instead of stalling CI.
Tolerances: the gradients are sums of the same terms in another order (two ranks' halves averaged), so
they agree to fp32 rounding relative to the largest gradient entry (atol 1e-5 of it); weights after three
AdamW steps then agree to a small fraction of one step (atol 2e-2 * lr; see tests/test_trl_parity.py on
AdamW's amplification of rounding). A later step's gradient is taken at those weights: the worker's AdamW
epsilon (1e-6, tests/distributed_worker.py) keeps that amplification within the gradients' 1e-5.
Completions and prompt layouts are compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"
LR = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, processes: int, scenario: str = "train", timeout: float = 240, check: bool = True, **overrides):
    """Run the worker under torchrun (or alone for one process); returns (completed process, per-rank records)."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(WORKER), str(out), scenario, json.dumps(overrides)]
    if processes > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-addr", "127.0.0.1",
                "--master-port", str(_free_port()), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.time()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    done.elapsed = time.time() - started
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        return done, [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(processes)]
    return done, None


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("single"), 1)[1][0]


def _compare_steps(single, ranks):
    for step, expected in enumerate(single["steps"]):
        parts = [record["steps"][step] for record in ranks]
        # 1. disjoint prompts whose union, in rank order, is the single process's list; each group on one rank
        assert sum((part["indices"] for part in parts), []) == expected["indices"]
        assert len(set(expected["indices"])) == len(expected["indices"])
        # 2. each prompt's completions are token-identical
        for part in parts:
            assert set(part["completions"]) == set(part["indices"])
            for index, completions in part["completions"].items():
                assert completions == expected["completions"][index], (step, index)
        # 3. advantages over all ranks, and the logged metrics (token counts, rewards, kl, entropy, ...)
        for part in parts:
            torch.testing.assert_close(part["advantages"], expected["advantages"], rtol=1e-5, atol=1e-6)
            for key, value in expected["metrics"].items():
                if key in ("step_time", "sample_time", "reference_time", "tokens_per_second"):
                    continue
                assert part["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
        assert parts[0]["metrics"]["num_tokens"] == expected["metrics"]["num_tokens"]
        # 4. the averaged full gradient of the step's update, the same on both ranks
        scale = max(g.abs().max().item() for g in expected["grads"].values())
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(parts[0]["grads"][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
            assert all(torch.equal(parts[0]["grads"][name], part["grads"][name]) for part in parts[1:]), name
        # 5. reference log-probs: each rank's rows are its slice of the single process's
        width = expected["ref_logps"].shape[1]
        rows = torch.cat([torch.nn.functional.pad(p["ref_logps"], (0, width - p["ref_logps"].shape[1]))[:, :width]
                          for p in parts])
        torch.testing.assert_close(rows, expected["ref_logps"], rtol=1e-5, atol=1e-6)
    # 4. weights after the AdamW steps: close to one process's, identical across ranks; 5. the reference unchanged
    for name, value in single["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=2e-2 * LR, msg=name)
        assert all(torch.equal(ranks[0]["params"][name], record["params"][name]) for record in ranks[1:]), name
    assert all(record.get("ref_unchanged", True) for record in ranks)  # LoRA: no reference copy to change


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_compute_what_one_process_computes(single, tmp_path, mode):
    done, ranks = launch(tmp_path, 2, distributed=mode)
    assert [record["mode"] for record in ranks] == [mode, mode] and ranks[0]["world_size"] == 2
    _compare_steps(single, ranks)
    # 6. the rank-0 export loads with from_pretrained and holds the trained weights
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step-000003")
    for name, value in exported.named_parameters():
        torch.testing.assert_close(value, ranks[0]["params"][name], rtol=0, atol=0, msg=name)
    assert (tmp_path / "run" / "checkpoints" / "step-000003" / "sharded").is_dir()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3  # written once, by rank 0


def test_environments_under_two_ranks_compute_what_one_process_computes(tmp_path):
    # Each rank plays its own rows' environments; each environment's process is seeded from its completion's own
    # noise, so the reset texts (a seeded die roll here), completions and get_reward agree with one process's.
    settings = dict(environment=["tests.test_environments:Dice"], reward=["tags"], max_steps=2)
    _, (one,) = launch(tmp_path / "one", 1, **settings)
    _, ranks = launch(tmp_path / "two", 2, distributed="ddp", **settings)
    assert one["steps"][0]["metrics"]["rewards/Dice/std"] > 0  # the rolls differ between rollouts
    _compare_steps(one, ranks)


def test_four_ranks_compute_what_one_process_computes(single, tmp_path):
    # One prompt (its whole group) per rank: the same prompts, completions, advantages, metrics and gradients.
    done, ranks = launch(tmp_path, 4, distributed="fsdp")
    assert [record["world_size"] for record in ranks] == [4] * 4
    assert all(len(record["steps"][0]["indices"]) == 1 for record in ranks)
    _compare_steps(single, ranks)


def test_auto_means_fsdp_under_torchrun_and_dapo_counts_global_tokens(single, tmp_path):
    # dapo divides by the real tokens of the whole step over both ranks: the same gradient as one process.
    one, _ = launch(tmp_path / "one", 1, loss_type="dapo", scale_rewards="batch", max_steps=2)
    _, ranks = launch(tmp_path / "two", 2, loss_type="dapo", scale_rewards="batch", max_steps=2)
    expected = torch.load(tmp_path / "one" / "rank-0.pt", weights_only=False)
    assert ranks[0]["mode"] == "fsdp"
    _compare_steps(expected, ranks)


@pytest.mark.parametrize("estimator", [
    dict(advantage_estimator="rloo"),  # the KL in the reward (rloo's default), the rloo loss
    dict(advantage_estimator="rloo", kl_in_reward=False, normalize_advantages=True),  # a batch-wide mean and std
    dict(advantage_estimator="reinforce_plus_plus", kl_in_reward=True, loss_type="dapo"),  # per-token advantages
], ids=["rloo", "rloo-normalized", "reinforce_plus_plus"])
def test_estimators_under_two_ranks_compute_what_one_process_computes(tmp_path, estimator):
    # The estimators see every rank's rows (the masks and the KL penalty padded to the widest rank's completions), so
    # a batch-wide whitening or normalisation and the per-token returns are the single process's. (normalize with the
    # KL in the reward is left out: the ranks' log-prob passes batch rows differently, and dividing by the small std
    # of the tiny model's advantages turns that fp32 rounding of the penalty, ~1e-7, into ~2e-6.)
    one = launch(tmp_path / "one", 1, max_steps=2, **estimator)[1][0]
    _, ranks = launch(tmp_path / "two", 2, distributed="ddp", max_steps=2, **estimator)
    assert one["steps"][1]["advantages"].abs().max() > 0
    assert one["steps"][1]["metrics"].get("kl", 1.0) != 0  # the policy moved from the reference: a penalty
    _compare_steps(one, ranks)


def test_lora_under_ddp_computes_what_one_process_computes(tmp_path):
    pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[peft]'")
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8)
    expected = launch(tmp_path / "one", 1, **lora)[1][0]
    _, ranks = launch(tmp_path / "two", 2, distributed="ddp", **lora)
    _compare_steps(expected, ranks)
    assert all("lora_" in name for name in expected["steps"][0]["grads"])  # only the adapters train
    checkpoint = tmp_path / "two" / "run" / "checkpoints" / "step-000003"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "sharded").is_dir()


def test_sharded_checkpoint_resumes_exactly_and_across_world_sizes(tmp_path):
    straight = launch(tmp_path / "straight", 2, max_steps=4)[1]
    launch(tmp_path / "pieces", 2, max_steps=4, until=2, save_steps=2)
    shutil.copytree(tmp_path / "pieces" / "run", tmp_path / "to_one" / "run")  # the 2-rank checkpoint, resumed by 1 below
    resumed = launch(tmp_path / "pieces", 2, max_steps=4, resume=str(tmp_path / "pieces" / "run"))[1]
    metrics = [json.loads(line) for line in (tmp_path / "pieces" / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "straight" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("reward", "loss", "kl", "grad_norm", "learning_rate", "entropy"):
        assert [m[key] for m in metrics] == [m[key] for m in expected], key
    for name, value in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], value), name
    # Saved by 2 ranks, resumed by 1 (and the reverse): the optimizer state is resharded; the run continues as it
    # would have, to rounding (the reductions run in another order).
    one = launch(tmp_path / "to_one", 1, max_steps=4, resume=str(tmp_path / "to_one" / "run"))[1]
    launch(tmp_path / "to_two", 1, max_steps=4, until=2, save_steps=2)
    two = launch(tmp_path / "to_two", 2, max_steps=4, resume=str(tmp_path / "to_two" / "run"))[1]
    straight_step3 = {**straight[0]["steps"][2]["completions"], **straight[1]["steps"][2]["completions"]}
    for record in (one[0], two[0]):
        first = record["steps"][0]  # step 3: sampled from the checkpoint's weights, the same on any world size
        assert first["completions"] == {i: straight_step3[i] for i in first["completions"]}
        assert first["metrics"]["reward"] == pytest.approx(straight[0]["steps"][2]["metrics"]["reward"], rel=1e-6)
        for name, value in straight[0]["params"].items():
            torch.testing.assert_close(record["params"][name], value, rtol=0, atol=2e-2 * LR, msg=name)


@pytest.mark.parametrize("scenario", ["kill", "raise"])
def test_a_failing_rank_ends_every_rank_with_its_name(tmp_path, scenario):
    done, _ = launch(tmp_path, 2, scenario=scenario, check=False, timeout=120)
    assert done.returncode != 0
    assert done.elapsed < 60, done.elapsed
    log = done.stdout + done.stderr
    assert "rank      : 1" in log or "[rank1]" in log, log[-3000:]
    if scenario == "raise":
        assert "a deliberate failure on rank 1" in log


def test_sigterm_to_the_launcher_saves_a_checkpoint(tmp_path):
    import signal

    from grpo.core.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), str(ROOT / "train.py"), "--model", "tiny", "--dataset", "synthetic:64",
               "--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "4", "--max-steps", "5000",
               "--max-completion-length", "8", "--max-prompt-length", "128", "--reward", "tags", "--device", "cpu",
               "--save-steps", "0", "--log-completions-steps", "0", "--distributed-timeout", "30", "--output-dir", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.time() < deadline, process.stdout.read()[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    log = process.communicate(timeout=90)[0]
    assert process.returncode != 0
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None, log[-3000:]
    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert int(checkpoint.name.split("-")[1]) == last_logged  # the step that was running when the signal came
    assert (checkpoint / "sharded").is_dir() and (checkpoint / "model.safetensors").is_file()
    assert "checkpoint saved. Resume with" in log


# ----------------------------------------------------------------------------- asynchronous rollouts under torchrun

def _logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _compare_async(single, ranks, tolerance):
    """The training ranks' metrics and weights at --max-staleness 0: the single synchronous process's."""
    trainers = [record for record in ranks if not record["generating"]]
    assert trainers and len(trainers) < len(ranks)
    for step, expected in enumerate(single["steps"]):
        for record in trainers:
            got = record["steps"][step]["metrics"]
            for key, value in expected["metrics"].items():
                if key in ("step_time", "sample_time", "tokens_per_second", "cpu_threads"):
                    continue
                assert got[key] == pytest.approx(value, rel=tolerance, abs=tolerance / 10), (step, key)
    for name, value in single["params"].items():
        for record in trainers:
            torch.testing.assert_close(record["params"][name], value, rtol=0, atol=0 if tolerance == 0 else 2e-2 * LR,
                                       msg=name)


@pytest.mark.parametrize("processes", [2, 3])
def test_generation_processes_at_staleness_0_compute_what_one_synchronous_process_computes(single, tmp_path,
                                                                                          processes):
    """The last rank generates, the others train: 1 + 1 runs unwrapped (bit for bit the single process), 2 + 1
    under FSDP2 (the two-rank tolerances)."""
    done, ranks = launch(tmp_path, processes, max_staleness=0, importance_sampling_correction=False)
    assert [record["generating"] for record in ranks] == [False] * (processes - 1) + [True]
    _compare_async(single, ranks, 0.0 if processes == 2 else 1e-5)
    assert [row["sample/staleness_max"] for row in _logged(tmp_path / "run")] == [0.0, 0.0, 0.0]


def test_dynamic_sampling_on_a_generation_process_is_the_synchronous_runs(tmp_path):
    """--dynamic-sampling with one generator and one trainer at --max-staleness 0: the generator's extra rounds are
    the synchronous run's, so the metrics and weights are its own bit for bit; groups were dropped and rounds added."""
    settings = dict(dynamic_sampling=True, dynamic_sampling_max_rounds=4, reward=["tests.distributed_worker:long_completion"],
                    importance_sampling_correction=False)
    _, (alone,) = launch(tmp_path / "single", 1, **settings)
    _, ranks = launch(tmp_path / "split", 2, max_staleness=0, **settings)
    _compare_async(alone, ranks, 0.0)
    keys = ("dynamic_sampling/rounds", "dynamic_sampling/dropped_groups", "dynamic_sampling/filled")
    logged = [{key: row[key] for key in keys} for row in _logged(tmp_path / "single" / "run")]
    assert [{key: row[key] for key in keys} for row in _logged(tmp_path / "split" / "run")] == logged
    assert sum(row["dynamic_sampling/dropped_groups"] for row in logged) > 0, logged
    assert max(row["dynamic_sampling/rounds"] for row in logged) >= 2, logged


def test_generation_processes_run_ahead_within_max_staleness(tmp_path):
    """--max-staleness 1: every step after the first trains on rows sampled one update earlier, and the weights
    move (the run is not the synchronous one). The folder holds an older run, which --overwrite replaces: one
    process deletes its files while the others wait (every rank deleting them raced: FileNotFoundError)."""
    old = tmp_path / "run"
    (old / "checkpoints" / "step-000009").mkdir(parents=True)
    for name in ("metrics.jsonl", "samples.jsonl", "run_config.json", "wandb_run_id"):
        (old / name).write_text('{"step": 9}\n' * 9)
    done, ranks = launch(tmp_path, 2, max_staleness=1, max_steps=4, overwrite=True)
    assert not (old / "checkpoints" / "step-000009").exists() and not (old / "wandb_run_id").exists()
    logged = _logged(tmp_path / "run")
    assert [row["sample/staleness_max"] for row in logged] == [0.0, 1.0, 1.0, 1.0]
    assert all("sampling/importance_sampling_ratio/mean" in row for row in logged)


@pytest.mark.parametrize("scenario", ["gen_kill", "gen_raise"])
def test_a_generation_process_that_dies_ends_the_run_with_its_cause(tmp_path, scenario):
    done, _ = launch(tmp_path, 2, scenario=scenario, check=False, timeout=120, max_staleness=1, max_steps=4)
    assert done.returncode != 0
    assert done.elapsed < 60, done.elapsed
    log = done.stdout + done.stderr
    if scenario == "gen_kill":  # whoever sees it first names it: torchrun (the exit signal) or the trainer
        assert "generation process (rank 1)" in log or "(exitcode: -9) local_rank: 1" in log, log[-3000:]
    else:
        assert "generation process (rank 1) failed" in log, log[-3000:]
    if scenario == "gen_raise":
        assert "a deliberate failure in the generation process" in log, log[-3000:]
