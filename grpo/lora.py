"""LoRA through peft (the `[peft]` extra): low-rank adapters, and the reference model for free.

    W x  ->  W x + (alpha / r) B A x        A (r, in), B (out, r); B starts at 0 (Hu et al., arXiv 2106.09685)

`add_lora` wraps the policy in a peft model whose targeted projections (default: the attention and MLP
ones) carry the adapters; only A and B train. The trainer keeps calling the Hugging Face model inside
(`peft_model.get_base_model()`, its projections replaced in place), so the log-prob code, the samplers
and the kernels run unchanged. With beta > 0 the reference log-probs come from the same weights with the
adapters switched off (`AdaptersOff`), as trl does: no reference copy is loaded. A run that starts from
an existing adapter (`--peft-adapter`) keeps that adapter, frozen, as the reference (`ref`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.parallel.distributed import ModelCall

REFERENCE_ADAPTER = "ref"


def _peft():
    try:
        import peft
    except ImportError as error:  # an optional extra
        raise ImportError("--use-peft needs peft: pip install -e '.[peft]'") from error
    return peft


@dataclass(frozen=True)
class LoraSettings:
    """A fresh adapter's shape (the run's lora_* settings) and the seed of its random init."""

    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]
    seed: int


def add_lora(model, settings: LoraSettings, adapter: str | None = None, reference_adapter: str | None = None):
    """The peft model around `model`: a fresh LoRA adapter of `settings`, or `adapter` (a peft folder or hub id) to
    keep training. `reference_adapter`: loaded frozen as `ref` (the reference of a run that started from an
    adapter)."""
    peft = _peft()
    targets = list(settings.target_modules)
    if adapter is not None:
        wrapped = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    else:
        lora = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                               target_modules=targets, bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):  # A's random init from the run's seed, the caller's stream untouched
            torch.manual_seed(settings.seed)
            try:
                wrapped = peft.get_peft_model(model, lora)
            except ValueError as error:
                raise ValueError(f"--lora-target-modules {targets} match no module of the model (peft: {error})") \
                    from error
    if reference_adapter is not None:
        wrapped.load_adapter(reference_adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        wrapped.set_adapter("default")
    targeted = [name for name, module in wrapped.named_modules() if hasattr(module, "lora_A")]
    if not targeted:
        raise ValueError(f"lora_target_modules {targets} match no module of the model")
    return wrapped


def trained_adapter_config(peft_model):
    """The LoraConfig of a peft model given whole: its one adapter, named 'default' (besides `ref`, which adopting
    it adds)."""
    adapters = [name for name in peft_model.peft_config if name != REFERENCE_ADAPTER]
    if adapters != ["default"]:
        raise ValueError(f"model: a PeftModel whose one adapter is named 'default' is supported here, got "
                         f"{adapters} (peft names the adapter of get_peft_model(model, config) 'default')")
    return peft_model.peft_config["default"]


def adopt_peft_model(peft_model, keep_reference: bool, resume_from: str | Path | None = None):
    """A peft model given whole (trl's GRPOTrainer takes one): its adapter `default` trains. With `keep_reference`
    its starting weights are copied, frozen, into the adapter `ref`, the reference (as trl); a model adopted before
    (a trainer that builds its run again, to resume) keeps the `ref` it got then. A checkpoint resumed then replaces
    the trained adapter's weights."""
    peft = _peft()
    trained_adapter_config(peft_model)
    if keep_reference and REFERENCE_ADAPTER not in peft_model.peft_config:
        peft_model.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(peft_model.peft_config["default"]))
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if f".{REFERENCE_ADAPTER}." in name:
                    parameter.copy_(peft_model.get_parameter(name.replace(f".{REFERENCE_ADAPTER}.", ".default.")))
        peft_model.set_adapter("default")
    if resume_from is not None:
        from safetensors.torch import load_file

        saved = load_file(str(Path(resume_from) / "adapter_model.safetensors"))
        peft.set_peft_model_state_dict(peft_model, saved, adapter_name="default")
    for name, parameter in peft_model.named_parameters():  # the adapter trains, everything else is frozen
        parameter.requires_grad_(".default." in name and "lora_" in name)
    return peft_model


@contextlib.contextmanager
def reference_weights(peft_model):
    """The reference: the adapters off, or the frozen starting adapter `ref` when there is one."""
    if REFERENCE_ADAPTER not in peft_model.peft_config:
        with peft_model.disable_adapter():
            yield
        return
    trainable = {name: p.requires_grad for name, p in peft_model.named_parameters()}
    peft_model.set_adapter(REFERENCE_ADAPTER)
    try:
        yield
    finally:
        peft_model.set_adapter("default")
        for name, p in peft_model.named_parameters():  # set_adapter moves requires_grad with the active adapter
            p.requires_grad_(trainable[name])


class AdaptersOff(ModelCall):
    """ModelCall whose calls see the reference weights (grpo.parallel.distributed.ModelCall's `fn(model, *args)`)."""

    def __init__(self, model, peft_model):
        super().__init__(model)
        self.peft_model = [peft_model]  # a list: not registered as a submodule (its parameters are the policy's)

    def forward(self, fn, *args, **kwargs):
        with torch.no_grad(), reference_weights(self.peft_model[0]):
            return fn(self.model, *args, **kwargs)


def merged_model(peft_model):
    """A plain Hugging Face model with the adapter folded into the base weights (a copy; the run is untouched)."""
    return copy.deepcopy(peft_model).merge_and_unload()


def is_adapter_folder(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return (path / "adapter_config.json").is_file()


def load_merged(path: str | Path, load_base):
    """The model an adapter folder describes, merged: `load_base(base name)` loads the base it names."""
    peft = _peft()
    config = peft.PeftConfig.from_pretrained(str(path))
    base = load_base(config.base_model_name_or_path)
    return peft.PeftModel.from_pretrained(base, str(path)).merge_and_unload()
