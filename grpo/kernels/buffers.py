"""Reused CPU storage for the kernels' large temporaries, owned by the object that runs a kernel.

On CPU a freshly allocated 100+ MiB tensor is page-faulted in on first write, which costs more than
the arithmetic that fills it (the exp() of a logit chunk, a vocabulary-sized gradient). A kernel
therefore writes its (rows, V) logits and (V, H) gradients into storages it keeps between calls.
CUDA's caching allocator already reuses memory, so on accelerators `get` allocates as usual.

Each sampler or trainer holds its own `Buffers`; nothing is kept at module level, so two models, two
trainers or two threads never share a storage.
"""

from __future__ import annotations

import torch


class Buffers:
    """Named, growable CPU storages (`get`) and a stock of (V, H) fp32 gradient tensors (`take_grad`)."""

    def __init__(self):
        self._storages: dict[tuple, torch.Tensor] = {}
        self._grads: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A (rows, cols) tensor; on CPU a view of one reused storage per (name, dtype), grown when too small."""
        if device.type != "cpu":
            return torch.empty(rows, cols, dtype=dtype, device=device)
        key, size = (name, dtype), rows * cols
        storage = self._storages.get(key)
        if storage is None or storage.numel() < size:
            # A normal tensor even when first asked for in inference mode (the CPU sampler runs in it),
            # so it stays writable outside it.
            with torch.inference_mode(False):
                storage = self._storages[key] = torch.empty(size, dtype=dtype, device=device)
        return storage[:size].view(rows, cols)

    def take_grad(self, weight: torch.Tensor) -> torch.Tensor:
        """An fp32 tensor shaped like `weight` for its gradient: a stocked one on CPU (two pending forwards
        never share one: a taken buffer is out of stock until `give_back_grad`), else a new one."""
        buffer = self._grads.pop((tuple(weight.shape), weight.device), None) if weight.device.type == "cpu" else None
        return torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if buffer is None else buffer

    def give_back_grad(self, buffer: torch.Tensor) -> None:
        if buffer.device.type == "cpu":
            self._grads[(tuple(buffer.shape), buffer.device)] = buffer
