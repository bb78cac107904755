"""--vllm-mode server (grpo/generation/vllm_server.py, vllm_transfer.py): a `vllm serve` process of the CPU build on
localhost, started as docs/vllm.md says (`python -m grpo.generation.vllm_server`), and trainers that push their
weights to it over the `grpo_gloo` weight-transfer engine.

The real model (SmolLM2-135M-Instruct, fp32, lr 1e-4): after each push the server's log-probs of a fixed sequence
are the trained policy's within 1e-4, and they moved by more than 1e-3. One trainer, two trainer ranks sharing the
server, and LoRA (its weights merged out of place). Then the faults: no server, a server of another model, and a
server killed mid-run (the checkpoint stays whole and --resume goes on once a server is back). Under CI
(GRPO_REQUIRE_VLLM=1) a missing vLLM fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import gsm8k_dir
from tests.test_distributed import ROOT, launch
from tests.test_vllm import REQUIRED, VLLM_ERROR

pytestmark = pytest.mark.slow
MISMATCH, MOVED = 1e-4, 1e-3  # the server's log-probs against the policy's; how far an update at lr 1e-4 moves them
START_TIMEOUT = 600  # seconds for the server to load the model and answer (two cores, busy with other tests)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def real_model() -> str:
    from grpo.models import resolve_model_name

    try:
        return resolve_model_name("smollm2-135m-instruct", "--model")
    except Exception as error:  # noqa: BLE001 - the offline copy is fetched by .ci/run
        pytest.skip(f"the real model is not fetched here: {error}")


def start_server(model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m grpo.generation.vllm_server --model M --port P` as docs/vllm.md shows; returns (process, URL)
    once /v1/models answers."""
    port = _free_port()
    handle = log.open("w")
    process = subprocess.Popen([sys.executable, "-m", "grpo.generation.vllm_server", "--model", model, "--host",
                                "127.0.0.1", "--port", str(port), "--max-model-len", "1024"], cwd=ROOT,
                               stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the vLLM server exited ({process.returncode}): {log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return process, url
        except OSError:
            time.sleep(2)
    stop_server(process)
    raise AssertionError(f"the vLLM server did not answer in {START_TIMEOUT} s: {log.read_text()[-4000:]}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(60)


def server_run(model: str, url: str, **overrides) -> dict:
    """The distributed tests' worker settings on the real model, sampling on the server."""
    settings = dict(model=model, generation_backend="vllm", vllm_mode="server", vllm_server_base_url=url,
                    vllm_group_port=_free_port(), learning_rate=1e-4, max_steps=3, max_completion_length=16,
                    prompts_per_step=2, num_generations=4, micro_batch_size=4, max_prompt_length=256,
                    dataset=str(gsm8k_dir() or "synthetic:64"),
                    reward=["tests.distributed_worker:completion_length"],
                    record_each_push=True)
    return {**settings, **overrides}


def check_pushes(record, what: str) -> None:
    """After each push the server's log-probs of the fixed sequence are the policy's, and they moved."""
    pushes = record["pushes"]
    assert len(pushes) == 4, what  # the start, then after each of the 3 steps
    for index, (served, policy) in enumerate(pushes):
        gap = (served - policy).abs().max().item()
        assert gap < MISMATCH, (what, index, gap)
    for index in range(1, len(pushes)):
        moved = (pushes[index][0] - pushes[index - 1][0]).abs().max().item()
        assert moved > MOVED, (what, index, moved)


def _train(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _errors(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.usefixtures("memory_heavy")  # a server and two trainers on the real model: not beside another such test
def test_the_server_mode_end_to_end(tmp_path):
    """One server for every scenario (a server takes a minute to start on two cores), in order:
    1. one trainer: the server follows each update; 2. two trainer ranks (DDP, gloo) share it; 3. LoRA, merged out of
    place; 4. a seeded server run samples what a seeded colocated run samples, token for token, at every step;
    5. a trainer of another model is one error line; 6. the server killed before step 2: the run stops naming
    --resume, its checkpoint of step 1 whole; a new server, and --resume goes on to the end."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    model = real_model()
    process, url = start_server(model, tmp_path / "server-1.log")
    try:
        _, (single,) = launch(tmp_path / "single", 1, timeout=900, **server_run(model, url))
        assert single["result"]["status"] == "finished"
        check_pushes(single, "one trainer")

        _, ranks = launch(tmp_path / "two", 2, timeout=900, **server_run(model, url, distributed="ddp"))
        check_pushes(ranks[0], "two trainer ranks")
        assert all(record["result"]["status"] == "finished" and record["steps"] for record in ranks)

        _, (lora,) = launch(tmp_path / "lora", 1, timeout=900, **server_run(
            model, url, use_peft=True, lora_r=8, lora_alpha=16, learning_rate=1e-3))
        check_pushes(lora, "LoRA")

        colocated_settings = {key: value for key, value in server_run(model, url).items()
                              if not key.startswith(("vllm_server", "vllm_group")) and key != "vllm_mode"}
        _, (colocated,) = launch(tmp_path / "colocate", 1, timeout=900, **colocated_settings)
        for step, (ours, theirs) in enumerate(zip(single["steps"], colocated["steps"], strict=True)):
            assert ours["completions"] == theirs["completions"], ("server against colocate", step)

        done = _train(["--model", "tiny:tiny-vllm", "--dataset", "synthetic:16", "--use-vllm", "--vllm-mode",
                       "server", "--vllm-server-base-url", url, "--max-steps", "1", "--output-dir",
                       str(tmp_path / "tiny"), "--device", "cpu"], timeout=300)
        errors = _errors(done)
        assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
        assert "serves another model" in errors[0] and "vocab_size 49152 (the policy's: 460)" in errors[0], errors
        assert "num_hidden_layers 30 (the policy's: 2)" in errors[0], errors

        overrides = server_run(model, url, save_steps=1, kill_server_at_step=2, server_pid=process.pid)
        done, _ = launch(tmp_path / "first", 1, check=False, timeout=900, output_dir=str(tmp_path / "run"),
                         **overrides)
        assert done.returncode != 0
        assert "stopped answering" in done.stderr and "--resume" in done.stderr, done.stderr[-3000:]
        checkpoints = sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir())
        assert checkpoints == ["step-000001"], checkpoints  # whole, and nothing half-written after it
    finally:
        stop_server(process)
    process, url = start_server(model, tmp_path / "server-2.log")
    try:
        _, (resumed,) = launch(tmp_path / "second", 1, timeout=900, output_dir=str(tmp_path / "run"),
                               resume=str(tmp_path / "run"), **server_run(model, url, save_steps=1))
        assert resumed["result"]["status"] == "finished" and len(resumed["steps"]) == 2  # steps 2 and 3
        served, policy = resumed["pushes"][-1]
        assert (served - policy).abs().max().item() < MISMATCH
    finally:
        stop_server(process)


def test_no_server_is_one_error_naming_the_command(tmp_path):
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    done = _train(["--model", "tiny:tiny-vllm", "--dataset", "synthetic:16", "--use-vllm", "--vllm-mode", "server",
                   "--vllm-server-port", str(_free_port()), "--vllm-server-timeout", "3", "--max-steps", "1",
                   "--output-dir", str(tmp_path / "run"), "--device", "cpu"], timeout=300)
    assert done.returncode == 1
    errors = _errors(done)
    assert len(errors) == 1 and "no vLLM server answers at http://0.0.0.0:" in errors[0], done.stderr[-3000:]
    assert "python -m grpo.generation.vllm_server --model tiny:tiny-vllm" in errors[0]


def test_the_serve_command_is_printed_with_what_the_trainer_needs():
    done = subprocess.run([sys.executable, "-m", "grpo.generation.vllm_server", "--model", "some/model", "--port",
                           "8123", "--print-only"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 vllm serve some/model ")
    for flag in ("--port 8123", "--weight-transfer-config", "grpo_gloo", "--logprobs-mode processed_logprobs",
                 "--enable-prefix-caching"):
        assert flag in line, (flag, line)
    assert json.loads(line.split("--weight-transfer-config ")[1].split(" --")[0].strip("'")) == {"backend": "grpo_gloo"}
    assert torch.cuda.is_available() or "--no-enable-chunked-prefill" in line  # seeded requests on a CPU engine

