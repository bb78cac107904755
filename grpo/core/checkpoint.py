"""Atomic checkpoints: written to a temporary folder, marked complete, then renamed into place.

    <output_dir>/checkpoints/step-000010/
        model.safetensors, config.json, generation_config.json   the policy, `from_pretrained`-loadable
        tokenizer files + chat template
        trainer_state.pt     optimizer, scheduler, RNG states, step, counters, the entropy controller
                             (loaded with weights_only=True)
        reference/           with sync_ref_model: the mixed reference model (safetensors), resumed as it is
    With LoRA (use_peft) the weights are the adapter in peft's format (adapter_model.safetensors,
    adapter_config.json: PeftModel.from_pretrained loads it), and with save_merged
        merged/              the base weights with the adapter folded in (from_pretrained-loadable)
        run_config.json      the GRPOConfig of the run
        COMPLETE             written last, before the rename

Under torchrun (more than one process) the folder also holds
        sharded/             torch.distributed.checkpoint: the optimizer state as the ranks hold it (FSDP2 shards)
        rank-00001.pt ...    each rank's RNG states
and model.safetensors is gathered on rank 0 (`save_distributed_checkpoint`). The weights are always resumed
from model.safetensors and the optimizer from trainer_state.pt or sharded/, so a checkpoint saved by any
number of processes resumes on any other number (the optimizer state is resharded by torch.distributed.checkpoint).

A kill at any moment leaves either the previous checkpoints untouched or the new one complete:
a half-written folder keeps its `.tmp-` name and is ignored (and cleaned up by the next save). A save that a full
disk refused ends the same way; the trainer reports it as one error (grpo.core.disk_full).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

CHECKPOINTS = "checkpoints"
SHARDED = "sharded"
MARKER = "COMPLETE"
REFERENCE = "reference"
MERGED = "merged"


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        if file.is_dir() and file.name in (REFERENCE, SHARDED, MERGED):
            _fsync_tree(file)
        elif file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_checkpoint(run_dir: str | Path, step: int, model, tokenizer, trainer_state: dict, run_config: dict,
                    keep: int = 0, reference=None, merged=None) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` (0 = all). Returns its folder.

    `reference`: a reference model that changes during the run (sync_ref_model), saved in `reference/`;
    `merged`: a LoRA run's merged model, saved in `merged/`."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if reference is not None:
        reference.save_pretrained(tmp / REFERENCE, safe_serialization=True)
    if merged is not None:
        merged.save_pretrained(tmp / MERGED, safe_serialization=True)
        tokenizer.save_pretrained(tmp / MERGED)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "run_config.json").write_text(json.dumps(run_config, indent=2))
    return _finish(root, tmp, step, run_dir, keep)


def _finish(root: Path, tmp: Path, step: int, run_dir, keep: int) -> Path:
    """Mark `tmp` complete, rename it into place (replacing a checkpoint of the same step), prune old ones."""
    (tmp / MARKER).write_text(str(step))
    _fsync_tree(tmp)
    final = root / f"step-{step:06d}"
    if final.exists():  # the same step saved again (e.g. final save right after a periodic one)
        old = root / f".tmp-old-{step:06d}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_tree(root)
    if keep > 0:
        for stale in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def save_distributed_checkpoint(run_dir: str | Path, step: int, world, call, optimizer, model, tokenizer,
                                trainer_state: dict, rank_state: dict, run_config: dict, keep: int = 0,
                                reference_call=None, merged=None) -> Path:
    """Every rank: the sharded optimizer state (torch.distributed.checkpoint) and its RNG states; rank 0: the
    full weights gathered into model.safetensors (what from_pretrained loads), the tokenizer, trainer_state.pt
    and run_config.json. The folder is renamed into place by rank 0 after every rank wrote its part."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    root = Path(run_dir) / CHECKPOINTS
    tmp = root / f".tmp-step-{step:06d}-world"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    world.barrier()
    dcp.save({"optimizer": get_optimizer_state_dict(call, optimizer)}, checkpoint_id=str(tmp / SHARDED),
             process_group=world.group)
    torch.save(rank_state, tmp / f"rank-{world.rank:05d}.pt")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    adapter = hasattr(model, "peft_config")  # LoRA under DDP: every rank holds the same adapter, rank 0 saves it
    weights = None if adapter else _strip_call_prefix(get_model_state_dict(call, options=full))  # a collective
    ref_weights = None
    if reference_call is not None:
        ref_weights = _strip_call_prefix(get_model_state_dict(reference_call, options=full))
    final = root / f"step-{step:06d}"
    if world.is_main:
        if adapter:
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        if merged is not None:
            merged.save_pretrained(tmp / MERGED, safe_serialization=True)
            tokenizer.save_pretrained(tmp / MERGED)
        if ref_weights is not None:
            model.save_pretrained(tmp / REFERENCE, state_dict=ref_weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "run_config.json").write_text(json.dumps(run_config, indent=2))
        final = _finish(root, tmp, step, run_dir, keep)
    world.barrier()
    return final


def _strip_call_prefix(state: dict) -> dict:
    """`model.` (grpo.parallel.distributed.ModelCall) removed from the keys: the Hugging Face model's own names."""
    return {key.removeprefix("model."): value for key, value in state.items()}


def load_sharded_optimizer(checkpoint: Path, call, optimizer, group=None) -> None:
    """The optimizer state of a checkpoint saved under torchrun, resharded for this world (any size); `group`:
    the training ranks' process group (grpo.parallel.distributed.World.group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(call, optimizer)}
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / SHARDED), process_group=group)
    set_optimizer_state_dict(call, optimizer, optim_state_dict=state["optimizer"])


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / MARKER).exists() and (p / "trainer_state.pt").exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or the folder itself if it is a complete checkpoint."""
    path = Path(path)
    if (path / MARKER).exists():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None


def load_trainer_state(checkpoint: str | Path) -> dict:
    """The trainer state, loaded without unpickling arbitrary objects (weights_only=True)."""
    return torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=True, map_location="cpu")
