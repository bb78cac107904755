"""A weight-transfer engine for vLLM's server on CPU: gloo in the place of NCCL (`--vllm-mode server`).

vLLM's server (`vllm serve ... --weight-transfer-config '{"backend": ...}'`) takes new weights from a trainer
through a weight-transfer engine: the trainer calls `/init_weight_transfer_engine` once, then for each update
`/start_weight_update`, `/update_weights` (the names, dtypes and shapes of what it is about to send) and
`/finish_weight_update`, and sends the tensors over a process group the two sides share. vLLM ships NCCL engines
(GPUs only). This module registers `grpo_gloo`, the same protocol over a gloo group, so that the whole path runs on
a CPU (and on a GPU without NCCL between the two sides, slower).

    the group   the trainer's rank 0 (the sender) is rank 0, the server's workers ranks 1..W; they meet at a TCP
                store on the trainer's host and `vllm_group_port`, which the trainer opens
    one update  each tensor broadcast from rank 0 in the announced order, one at a time (never the whole model in
                one buffer), and loaded by its checkpoint name with vLLM's layerwise reload, as the colocated
                engine loads them (grpo.generation.vllm_worker)

vLLM finds this engine through the `vllm.general_plugins` entry point in pyproject.toml, which it loads in each of
its processes; so the server must run where this project is installed.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import torch

BACKEND = "grpo_gloo"
STORE_PREFIX = "grpo-weights"


def register() -> None:
    """vLLM's plugin hook (pyproject's `vllm.general_plugins`): the engine under the name `grpo_gloo`."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group of `world_size` ranks meeting at a TCP store on host:port, which rank 0 opens; it stays apart
    from any default process group either side already has."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                       wait_for_workers=False)
    group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(STORE_PREFIX, store), rank, world_size,
                                               timeout)
    return store, group


def send(group, tensor: torch.Tensor) -> None:
    """Rank 0's side of one tensor: a broadcast to every worker."""
    group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()


def receive(group, shape, dtype: torch.dtype) -> torch.Tensor:
    """A worker's side of one tensor."""
    tensor = torch.empty(shape, dtype=dtype)
    group.broadcast(tensor, 0).wait()
    return tensor


@dataclass
class GlooInitInfo:
    """What `/init_weight_transfer_engine` carries: where the trainer's store is, the group's size, the first
    worker's rank, and how long a transfer may wait."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 240.0


@dataclass
class GlooUpdateInfo:
    """What `/update_weights` carries: the tensors about to be broadcast, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes")


@functools.cache
def _engine_class():
    """The engine class, built on vLLM's base (imported only in a process that has vLLM)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class GlooWeightTransferEngine(WeightTransferEngine):
        """vLLM's worker side: joins the trainer's gloo group, receives each announced tensor and loads it."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group, self.store, self.loaded = None, None, set()

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            parallel = self.parallel_config  # each worker's own rank, over data-parallel groups too (as vLLM's NCCL)
            rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
            self.store, self.group = open_group(init_info.master_address, init_info.master_port, rank,
                                                init_info.world_size, init_info.timeout_s)

        def start_weight_update(self) -> None:
            self.loaded = set()
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("the grpo_gloo weight transfer was not initialized (/init_weight_transfer_engine)")

            def weights():
                for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                                   strict=True):
                    yield name, receive(self.group, shape, getattr(torch, dtype_name)).to(self.device)

            with set_current_vllm_config(self.vllm_config):
                self.loaded |= set(self.model.load_weights(weights()) or ())

        def update_weights(self, update_info) -> None:  # the base synchronizes an accelerator a CPU lacks
            self.receive_weights(self.parse_update_info(update_info))

        def finish_weight_update(self) -> None:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model, self.model_config)
                reprocess_tied_layers(self.model, self.loaded)
            missing = sorted({name for name, _ in self.model.named_parameters()} - self.loaded)
            if missing:
                raise RuntimeError(f"the weights sent did not reach the engine's {', '.join(missing[:5])}: the "
                                   "trainer's checkpoint names do not match what vLLM loads for this architecture")

        def shutdown(self) -> None:
            self.group = self.store = None

    return GlooWeightTransferEngine


def reprocess_tied_layers(model, loaded: set[str]) -> None:
    """A layer whose weight is another's (a tied output head) loads nothing of its own, so a reload keeps what the
    engine derived from the old weight (a CPU engine's packed copy): derive it again from the new one."""
    for prefix, layer in model.named_modules():
        own = [f"{prefix}.{name}" for name, _ in layer.named_parameters(recurse=False)]
        method = getattr(layer, "quant_method", None)
        if own and not loaded.intersection(own) and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(layer)


def __getattr__(name: str):
    if name == "GlooWeightTransferEngine":  # the factory's lazy import reaches the class by name
        return _engine_class()
    raise AttributeError(name)
