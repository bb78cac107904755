"""Many processes on torchrun: the process group, the model wrappers, and the few collectives the loop uses.

    torchrun --nproc-per-node N train.py ...      (multi-node: --nnodes M --rdzv-backend c10d --rdzv-endpoint H:P)

torchrun starts the processes and sets RANK, WORLD_SIZE and LOCAL_RANK; `init_world` joins them with
torch.distributed (NCCL on CUDA, gloo on CPU). A single process is world size one: the same loop, whose
collectives return their input. Layout of a step (docs/distributed.md):
    - every rank builds the step's global prompt list the same way; rank r takes the r-th contiguous slice,
      so each prompt's whole group is sampled on one rank (its prompt prefilled once there);
    - sampling noise is seeded per prompt (seed, step, position in the global list): a prompt's completions
      do not depend on the world size;
    - rewards are gathered, so advantages (and `scale_rewards=batch`'s std) are the single-process ones;
      normalisers that span the step (dapo's token count) are global; logged metrics are reduced.
The policy is wrapped by `wrap_model` in DDP or FSDP2 (`fully_shard` per decoder layer and at the root).
`ModelCall` runs our log-prob code inside the wrapper's forward, so DDP's and FSDP2's hooks see it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo.config import DISTRIBUTED_CHOICES

logger = logging.getLogger("grpo")



@dataclass
class World:
    """This process's place among the ranks, and the collectives the loop needs (identity at size 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    group: object = None  # the training ranks' process group (None: every process; generation processes are not in it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Leave the process group, once the run is done: PyTorch asks for destroy_process_group before exit, and
        without it a rank's communication threads can be torn down while the interpreter exits, which aborts that
        rank (`terminate called without an active exception`) and makes torchrun report a finished run as failed."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (a copy; the input is unchanged)."""
        tensor = tensor.clone()
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def sum(self, value: float) -> float:
        if self.size == 1:  # no collective: the value itself
            return float(value)
        return float(self.all_sum(torch.tensor(float(value), dtype=torch.float64, device=self.device)).item())

    def max(self, value: float) -> float:
        if self.size == 1:  # no collective: the value itself
            return float(value)
        tensor = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return float(tensor.item())

    def any(self, flag: bool) -> bool:
        return self.sum(1.0 if flag else 0.0) > 0

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's (n, ...) tensor along dim 0, in rank order (equal n on every rank; an (n, T)
        tensor is padded with zeros on the right to the widest rank's T)."""
        if self.size == 1:
            return tensor
        if tensor.dim() == 2:
            tensor = torch.nn.functional.pad(tensor, (0, int(self.max(tensor.shape[1])) - tensor.shape[1]))
        parts = [torch.empty_like(tensor, device=self.device) for _ in range(self.size)]
        dist.all_gather(parts, tensor.to(self.device).contiguous(), group=self.group)
        return torch.cat(parts).to(tensor.device)

    def gather_objects(self, value) -> list:
        """Every rank's picklable `value`, in rank order ([value] at size 1)."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's equal share of rows gathered by `gather_rows` (all of them at size 1)."""
        rows = tensor.shape[0] // self.size
        return tensor[self.rank * rows : (self.rank + 1) * rows]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    @property
    def device(self) -> torch.device:
        """Where collectives' tensors live: the rank's GPU with NCCL, the CPU with gloo."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def init_world(device: str = "auto", timeout_s: float = 600.0, mode: str = "auto") -> World:
    """Join the torchrun process group (once per process); world size one when not launched by torchrun.

    timeout_s bounds every collective: a rank that died or hangs ends the others with an error naming the
    collective instead of waiting for PyTorch's 30-minute default. At one process a group is made only when
    `mode` asks for a wrapper (ddp / fsdp need one: `torchrun --nproc-per-node 1`).
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 and mode == "auto":
        return World()
    if "RANK" not in os.environ:
        raise ValueError(f"--distributed {mode} needs a process group: launch with torchrun (--nproc-per-node 1 for "
                         "one process), or use --distributed auto")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return World(rank=rank, size=size, local_rank=local_rank)


def resolve_mode(mode: str, world: World) -> str:
    """`auto`: FSDP2 when the world is larger than one, else no wrapper; `ddp` / `fsdp` as asked."""
    if mode not in DISTRIBUTED_CHOICES:
        raise ValueError(f"distributed must be one of {DISTRIBUTED_CHOICES}, got {mode!r}")
    if mode == "auto":
        return "fsdp" if world.size > 1 else "none"
    return mode


class ModelCall(torch.nn.Module):
    """`call(fn, *args)` = fn(model, *args) run inside this module's forward.

    Our log-probs call the model's trunk and its output matrix directly (grpo.algorithm.logprobs); inside this forward,
    DDP's gradient hooks and FSDP2's all-gathers and reduce-scatters of the root's parameters (embeddings,
    final norm, output head) run around them as they would around `model(...)`.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def accumulating(call, last: bool):
    """DDP: no gradient all-reduce until an update's last micro-batch (the same sum, one all-reduce); other
    wrappers reduce in their own hooks."""
    if isinstance(call, torch.nn.parallel.DistributedDataParallel) and not last:
        return call.no_sync()
    return contextlib.nullcontext()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's gradient norm), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks (Qwen2 / Llama style `model.model.layers`)."""
    trunk = getattr(model, model.base_model_prefix, model)
    layers = getattr(trunk, "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__}: no decoder layers found at "
                                  f"{model.base_model_prefix}.layers")
    return list(layers)


def wrap_model(model, mode: str, world: World, device: torch.device, precision: str, trainable: bool = True,
               cpu_offload: bool = False) -> torch.nn.Module:
    """ModelCall(model), wrapped for `mode` ("none", "ddp", "fsdp").

    fsdp: `fully_shard` on each decoder layer, then on the root; on CUDA with bf16, MixedPrecisionPolicy(bf16
    parameters, fp32 gradient reduction). The reference (trainable=False) is sharded the same way and
    reshards after its forward; it has no gradients. ddp: the trained policy only (a frozen reference needs
    no gradient sync and stays a plain module on every rank).
    """
    call = ModelCall(model)
    if mode == "none" or (mode == "ddp" and not trainable):
        return call
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        # broadcast_buffers=False: buffers (rotary frequencies) are computed the same on every rank, and a
        # broadcast would be a collective inside every forward, generation included.
        return DistributedDataParallel(call, device_ids=ids, broadcast_buffers=False, process_group=world.group)
    if mode != "fsdp":
        raise ValueError(f"unknown distributed mode {mode!r}")
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {}
    if device.type == "cuda" and precision in ("bf16", "auto"):
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if world.group is not None:  # the training ranks only (generation processes hold their own full copy)
        from torch.distributed.device_mesh import DeviceMesh

        options["mesh"] = DeviceMesh.from_group(world.group, device.type)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(call, **options)
    with torch.no_grad():
        call(_nothing)  # FSDP2 sets up its root at the root's first forward; generation calls the layers directly
    call.reshard()  # the root keeps its parameters gathered after a forward: shard them before the optimizer sees them
    return call


def _nothing(model):
    return None


def fsdp_modules(module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in (module.modules() if module is not None else ()) if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(module):
    """Full parameters for a whole decode loop: FSDP2 modules unsharded once and kept so (no all-gather per
    token, and so no collective inside the loop: a rank whose completions end early does not wait for the
    others), resharded afterwards. A no-op for DDP and single-process models."""
    modules = fsdp_modules(module)
    if not modules:  # a single process or DDP: the weights are whole already
        yield
        return
    for m in modules:
        m.unshard()
    layers = modules[1:]  # the root is never run here (generation calls the model inside it); only layers are
    for m in layers:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in layers:
            m.set_reshard_after_forward(True, recurse=False)
        for m in modules:
            m.reshard()


def unwrap(module) -> torch.nn.Module:
    """The Hugging Face model inside ModelCall / DDP."""
    module = getattr(module, "module", module)  # DDP
    return module.model if isinstance(module, ModelCall) else module
