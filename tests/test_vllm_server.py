"""--vllm-mode server (grpo/generation/vllm_server.py, vllm_transfer.py): a `vllm serve` process of the CPU build on
localhost, started as docs/vllm.md says (`python -m grpo.generation.vllm_server`), and trainers that push their
weights to it over the `grpo_gloo` weight-transfer engine.

The real model (SmolLM2-135M-Instruct, fp32, lr 1e-4): after each push the server's log-probs of a fixed sequence
are the trained policy's within 1e-4, and they moved by more than 1e-3. One trainer, two trainer ranks sharing the
server, and LoRA (its weights merged out of place); --max-staleness 0 logs the synchronous run's numbers; and
examples/server_multiturn.py, a multi-turn environment on the server's OpenAI endpoint. Then the faults: no
server, a server of another model, and a server killed mid-run (the checkpoint stays whole and --resume goes on once
a server is back). Under CI (GRPO_REQUIRE_VLLM=1) a missing vLLM fails these tests instead of skipping them.
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

from tests.distributed_worker import FIXED_SEQUENCE
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
                    dataset="synthetic:64",  # GSM8K-shaped, with shorter prompts than GSM8K's: the step's cost
                    reward=["tests.distributed_worker:completion_length"], beta=0.0,  # trl's: no reference copy
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


def load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("server_multiturn", ROOT / "examples" / "server_multiturn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """The runs of equal values in `mask`: (value, start, end)."""
    runs, start = [], 0
    for index in range(1, len(mask) + 1):
        if index == len(mask) or mask[index] != mask[start]:
            runs.append((mask[start], start, index))
            start = index
    return runs


@torch.no_grad()
def check_example_episodes(example, model: str, url: str) -> None:
    """examples/server_multiturn.py's episodes on the server as it started (the model's own weights): the token
    sequence is the chat as our tokenizer renders it, the environment's tokens masked, and the log-probs of the
    model's tokens the policy's within MISMATCH."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    served = example.post(url, "v1/models")["data"][0]["id"]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as pool:  # in flight together, as the example's rollout_func plays them
        episodes = list(pool.map(lambda item: example.play(url, served, item[1], 96, 1.0, item[0]),
                                 enumerate(example.games(8)["prompt"])))
    assert sum(episode["turns"] > 1 for episode in episodes) >= 2, [episode["turns"] for episode in episodes]
    for episode in episodes:
        prompt, completion, mask = episode["prompt_ids"], episode["completion_ids"], episode["env_mask"]
        assert len(completion) == len(mask) == len(episode["logprobs"]) <= 96
        runs = segments(mask)
        assert [value for value, _, _ in runs] == [1, 0] * (episode["turns"] - 1) + [1], runs  # model, environment
        last = runs[-1][1]
        chat = tokenizer.apply_chat_template(episode["messages"][:-1], add_generation_prompt=True, tokenize=False)
        assert prompt + completion[:last] == tokenizer(chat, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(completion[last:], skip_special_tokens=True) == episode["messages"][-1]["content"]
        for value, start, end in runs:
            if value == 0:
                assert any(word in tokenizer.decode(completion[start:end]) for word in ("Higher.", "Lower.", "Reply"))
        ids = torch.tensor([prompt + completion])
        logps = torch.log_softmax(policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        logps = logps.gather(-1, ids[0, len(prompt):, None])[:, 0]  # (T,) the policy's, each completion token
        model_tokens = torch.tensor(mask, dtype=torch.bool)
        gap = (logps[model_tokens] - torch.tensor(episode["logprobs"])[model_tokens]).abs().max().item()
        assert gap < MISMATCH, gap


def served_logps(url: str, token_ids: list[int]) -> torch.Tensor:
    """The server's log-probs of `token_ids` (each token after the first), as it holds its weights now."""
    request = urllib.request.Request(f"{url}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
                                                      "prompt_logprobs": 0}).encode())
    with urllib.request.urlopen(request, timeout=300) as answer:
        choice = json.loads(answer.read())["choices"][0]
    return torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(choice["prompt_logprobs"][1:],
                                                                                token_ids[1:])])


@torch.no_grad()
def model_logps(path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([token_ids])
    logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0]


def _train(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _errors(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.usefixtures("memory_heavy")  # a server and two trainers on the real model: not beside another such test
def test_the_server_mode_end_to_end(tmp_path):
    """One server for every scenario (a server takes a minute to start on two cores), in order:
    1. examples/server_multiturn.py: its episodes on the fresh server, then two steps of its training;
    2. one trainer: the server follows each update; 3. --max-staleness 0 (a background thread samples on the
    server) logs the synchronous run's numbers; 4. two trainer ranks (DDP, gloo) share it; 5. LoRA, merged out of
    place; 6. a seeded server run samples what a seeded colocated run samples, token for token, at every step;
    7. a trainer of another model is one error line; 8. the server killed before step 2: the run stops naming
    --resume, its checkpoint of step 1 whole; a new server, and --resume goes on to the end."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    model = real_model()
    process, url = start_server(model, tmp_path / "server-1.log")
    try:
        example = load_example()
        check_example_episodes(example, model, url)
        run = tmp_path / "multiturn"
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "server_multiturn.py"), "--model", model,
                               "--url", url, "--group-port", str(_free_port()), "--output-dir", str(run),
                               "--max-steps", "2", "--save-steps", "1", "--learning-rate", "1e-4", "--cpu"],
                              capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-4000:]
        # the server holds what was pushed before step 2 sampled: checkpoint-1's weights, moved from the model's
        served, pushed = served_logps(url, FIXED_SEQUENCE), model_logps(run / "checkpoint-1", FIXED_SEQUENCE)
        assert (served - pushed).abs().max().item() < MISMATCH
        assert (served - model_logps(model, FIXED_SEQUENCE)).abs().max().item() > MOVED

        _, (single,) = launch(tmp_path / "single", 1, timeout=900, **server_run(model, url))
        assert single["result"]["status"] == "finished"
        check_pushes(single, "one trainer")

        # --max-staleness 0: a background thread pushes its copy's weights and samples each step ahead, which the
        # schedule makes the synchronous run's rollout, so every logged number is the synchronous run's
        # (2 of the 3 steps, so that the learning-rate schedule is the 3-step run's)
        _, (ahead,) = launch(tmp_path / "ahead", 1, timeout=900, **server_run(model, url, max_staleness=0,
                                                                               record_each_push=False, until=2))
        assert ahead["result"]["status"] == "paused" and len(ahead["steps"]) == 2
        for step, (ours, theirs) in enumerate(zip(single["steps"][:2], ahead["steps"], strict=True)):
            for key, value in ours["metrics"].items():
                if not key.endswith(("time", "_s", "tokens_per_second")):
                    assert theirs["metrics"][key] == value, (step, key)

        _, ranks = launch(tmp_path / "two", 2, timeout=900, **server_run(model, url, distributed="ddp"))
        check_pushes(ranks[0], "two trainer ranks")
        assert all(record["result"]["status"] == "finished" and record["steps"] for record in ranks)

        _, (lora,) = launch(tmp_path / "lora", 1, timeout=900, **server_run(
            model, url, use_peft=True, lora_r=8, lora_alpha=16, learning_rate=1e-3))
        check_pushes(lora, "LoRA")

        colocated_settings = {key: value for key, value in server_run(model, url, until=2).items()
                              if not key.startswith(("vllm_server", "vllm_group")) and key != "vllm_mode"}
        _, (colocated,) = launch(tmp_path / "colocate", 1, timeout=900, **colocated_settings)
        for step, (ours, theirs) in enumerate(zip(single["steps"][:2], colocated["steps"], strict=True)):
            assert ours["completions"] == theirs["completions"], ("server against colocate", step)

        done = _train(["--model", "tiny:tiny-vllm", "--dataset", "synthetic:16", "--use-vllm", "--vllm-mode",
                       "server", "--vllm-server-base-url", url, "--max-steps", "1", "--output-dir",
                       str(tmp_path / "tiny"), "--device", "cpu"], timeout=300)
        errors = _errors(done)
        assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
        assert "serves another model" in errors[0] and "vocab_size 49152 (the policy's: 460)" in errors[0], errors
        assert "num_hidden_layers 30 (the policy's: 2)" in errors[0], errors

        overrides = server_run(model, url, save_steps=1, kill_server_at_step=2, server_pid=process.pid, max_steps=2)
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
                               resume=str(tmp_path / "run"), **server_run(model, url, save_steps=1, max_steps=2))
        assert resumed["result"]["status"] == "finished" and len(resumed["steps"]) == 1  # step 2
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



class FakeServer:
    """Just enough of a vLLM server's routes, in this process, for the faults a real server is slow to show: its
    weight-transfer backend is `transfer` (None: none configured); it serves `info` (grpo_model_info's answer); it
    joins the trainer's weight-transfer group (grpo_gloo), then never finishes /update_weights (`stuck`). `calls`:
    the routes called, in order, with their bodies."""

    def __init__(self, transfer, info: dict, stuck: bool = True):
        import http.server
        import threading

        from grpo.generation.vllm_transfer import open_group

        fake = self
        self.groups, self.calls = [], []  # the routes called, in order, with their bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.do_POST()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                path = self.path.lstrip("/").split("?")[0]
                fake.calls.append((path, body))
                if path == "update_weights" and stuck:
                    time.sleep(3600)  # a server stuck in the push
                if path == "init_weight_transfer_engine" and transfer == "grpo_gloo":
                    info = body["init_info"]
                    fake.groups.append(open_group(info["master_address"], info["master_port"], 1, 2, 30))
                answer = {"v1/models": {"data": [{"id": "fake"}]},
                          "server_info": {"vllm_config": {"weight_transfer_config": None if transfer is None
                                                          else {"backend": transfer}}},
                          "collective_rpc": {"results": [info_answer]}, "get_world_size": {"world_size": 1},
                          }.get(path, {})
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        info_answer = info
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def test_a_server_without_the_weight_transfer_and_a_push_that_times_out_are_one_error_each():
    """The faults a real server is slow to show, against FakeServer: no weight-transfer config (or another
    backend) names the flag and the command; a push the server never finishes ends within --vllm-server-timeout,
    naming it."""
    from grpo.generation.vllm_server import ServerError, ServerSettings, VLLMServerGenerate
    from grpo.tiny_model import build_tiny_model

    model, tokenizer = build_tiny_model("tiny-vllm", seed=0)
    text = model.config.get_text_config()
    info = {"vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "num_hidden_layers": text.num_hidden_layers, "architectures": ["Qwen2ForCausalLM"]}
    for transfer, expected in ((None, "has no weight transfer"), ("sparse_nccl", "the weight transfer 'sparse_nccl'"),
                               ("nccl", "takes weights over nccl, which needs a GPU in this process")):
        fake = FakeServer(transfer, info)
        try:
            with pytest.raises(ServerError, match=expected) as raised:
                VLLMServerGenerate(model, tokenizer.pad_token_id, ServerSettings(fake.url, 5.0, _free_port(),
                                                                                 "tiny:tiny-vllm"), sender=True)
            if transfer == "nccl":
                assert "--weight-transfer grpo_gloo" in str(raised.value), raised.value
            else:
                assert "--weight-transfer-config" in str(raised.value) and "python -m grpo.generation.vllm_server" in (
                    str(raised.value))
        finally:
            fake.close()
    fake = FakeServer("grpo_gloo", info)
    try:
        backend = VLLMServerGenerate(model, tokenizer.pad_token_id, ServerSettings(fake.url, 3.0, _free_port(),
                                                                                   "tiny:tiny-vllm"), sender=True)
        started = time.monotonic()
        with pytest.raises(ServerError, match=r"--vllm-server-timeout") as raised:
            backend.sync_weights()
        assert time.monotonic() - started < 30, time.monotonic() - started
        assert "update_weights" in str(raised.value) or "weight transfer" in str(raised.value), raised.value
    finally:
        fake.close()


@pytest.mark.parametrize("transfer", ["nccl", "ipc"])
def test_vllms_own_transfers_are_driven_by_vllms_trainer_engine_over_our_client(monkeypatch, transfer):
    """A server with vLLM's NCCL or IPC engine (GPUs; here FakeServer and a trainer that reports a GPU): the trainer
    builds vLLM's trainer-side engine through WeightTransferTrainerFactory with the init info that engine needs
    (NCCL: this machine's address, the group port, the server's workers + 1 ranks; both: rank 0 sends), over a client
    that reaches the server's routes; its WeightSource declares exactly what it then yields (the checkpoint names,
    dtypes and shapes vLLM sizes its buffers from, LoRA merged out of place); after the push the prefix cache is
    reset. A stand-in for vLLM's engine runs NCCL's sequence of calls, since the real one needs CUDA."""
    if VLLM_ERROR is not None and not REQUIRED:
        pytest.skip(f"vLLM unavailable: {VLLM_ERROR}")
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from grpo.generation.vllm import inference_weights
    from grpo.generation.vllm_server import ServerSettings, VLLMServerGenerate
    from grpo.lora import LoraSettings, add_lora
    from grpo.tiny_model import build_tiny_model

    model, tokenizer = build_tiny_model("tiny-vllm", seed=0)
    model = add_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"), seed=0))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; a trained adapter has moved it
            torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(0))
    text = model.config.get_text_config()
    info = {"vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "num_hidden_layers": text.num_hidden_layers, "architectures": ["Qwen2ForCausalLM"]}
    built = {}

    class Engine:
        def __init__(self, client, source):
            self.client, self.source, self.sent = client, source, []

        def send_weights(self):
            meta = self.source.metadata()
            self.client.start_weight_update()
            self.client.update_weights({"names": [m.name for m in meta], "dtype_names": [str(m.dtype) for m in meta],
                                        "shapes": [list(m.shape) for m in meta]})
            self.sent = list(self.source)
            self.client.finish_weight_update()

        def shutdown(self):
            built["shut"] = True

    def trainer_init(init_info, client, source):
        built.update(info=init_info, engine=Engine(client, source))
        return built["engine"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", classmethod(
        lambda cls, init_info, *, client, source=None: trainer_init(init_info, client, source)))
    fake, port = FakeServer(transfer, info, stuck=False), _free_port()
    try:
        backend = VLLMServerGenerate(model, tokenizer.pad_token_id, ServerSettings(fake.url, 5.0, port,
                                                                                   "tiny:tiny-vllm"), sender=True)
        assert built["info"].backend == transfer and built["info"].is_sender
        if transfer == "nccl":
            assert asdict(built["info"]) == {"rank": 0, "master_address": "127.0.0.1", "master_port": port,
                                             "world_size": 2, **{key: value for key, value in asdict(
                                                 built["info"]).items() if key.startswith("packed")}}
        fake.calls.clear()
        backend.sync_weights()
        assert [path for path, _ in fake.calls] == ["start_weight_update", "update_weights", "finish_weight_update",
                                                    "reset_prefix_cache"]
        expected = list(inference_weights(model))
        announced = fake.calls[1][1]["update_info"]
        assert announced["names"] == [name for name, _ in expected] == [name for name, _ in built["engine"].sent]
        assert announced["shapes"] == [list(tensor.shape) for _, tensor in expected]
        assert not any("lora" in name for name in announced["names"]), announced["names"]
        for (name, sent), (_, merged) in zip(built["engine"].sent, expected, strict=True):
            assert torch.equal(sent, merged), name
        assert backend.stale is False
        backend.close()
        assert built["shut"]
    finally:
        fake.close()
    if transfer == "nccl":  # a server on the trainer's own GPU: NCCL cannot put two ranks on one device
        from grpo.generation import vllm_server
        from grpo.generation.vllm_server import ServerError

        monkeypatch.setattr(vllm_server, "_this_gpu", lambda model: "GPU-same")
        fake = FakeServer(transfer, {**info, "gpu": "GPU-same"}, stuck=False)
        try:
            with pytest.raises(ServerError, match="runs on this trainer's GPU.*--weight-transfer ipc"):
                VLLMServerGenerate(model, tokenizer.pad_token_id, ServerSettings(fake.url, 5.0, _free_port(),
                                                                                 "tiny:tiny-vllm"), sender=True)
        finally:
            fake.close()
