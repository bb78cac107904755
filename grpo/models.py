"""Loading the policy, the reference model and the tokenizer, with the checks that save a wasted GPU hour.

`tiny` / `tiny:SHAPE` builds a random-init local model (grpo/tiny_model.py); anything else goes
through `from_pretrained` (a hub id or a local folder), safetensors only, remote code only on request.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grpo.tiny_model import build_tiny_model, build_tokenizer

logger = logging.getLogger("grpo")


class ModelError(ValueError):
    """A model or tokenizer that cannot be trained as it is; the message says how to fix it."""


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


def load_tokenizer(name: str, trust_remote_code: bool = False, chat_template_file: str | None = None):
    """The tokenizer, with a chat template and a pad token, or a ModelError that says what is missing."""
    if name == "tiny" or name.startswith("tiny:"):
        return build_tokenizer()  # the tiny models' tokenizer, without building a model for it
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if chat_template_file:
        tokenizer.chat_template = Path(chat_template_file).read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"the tokenizer of {name} has no chat template, so prompts cannot be built. Use an instruct/chat "
            "model, or pass --chat-template FILE with a Jinja template (e.g. the ChatML template in "
            "grpo/tiny_model.py, QWEN25_CHAT_TEMPLATE)."
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"the tokenizer of {name} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning("the tokenizer of %s has no pad token: using its EOS token %r for padding", name, tokenizer.eos_token)
    return tokenizer


def load_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False, tokenizer=None):
    """A causal LM in `dtype` on `device`. Local folders are checked for safetensors weights first."""
    if name == "tiny" or name.startswith("tiny:"):
        shape = name.split(":", 1)[1] if ":" in name else "tiny"
        model, _ = build_tiny_model(shape, seed=0, tokenizer=tokenizer)
    else:
        path = Path(name).expanduser()
        if path.exists():
            _check_local_folder(path)
        elif name.startswith((".", "/", "~")):
            raise ModelError(f"--model {name}: no such folder")
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    use_packed_decode_attention(model)
    return model.to(device=device, dtype=dtype)


PACKED_DECODE_SDPA = "grpo_sdpa"


def packed_decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, with one query token's grouped heads packed onto their shared key/value head.

    Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245): query head h = j G + g reads key/value
    head j, out_h = softmax(q_h K_j^T * scaling + mask) V_j. With one query token per row (a decode step),
    the G query heads of group j are G queries of the same attention problem, so
        (N, H, 1, D) -> (N, H_kv, G, D),  SDPA against K_j, V_j (N, H_kv, L, D)  -> (N, H_kv, G, D) -> (N, 1, H, D)
    computes every head without `repeat_kv`'s copies of K and V (G times the cache, per layer per step).
    transformers packs the same way in eager mode but not while torch.compile traces (its decode then
    copies K and V every step); this function packs in both. Every other call (several query tokens,
    position biases, per-head masks, dropout) is transformers' `sdpa_attention_forward` unchanged.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, _ = query.shape
    if (q_length != 1 or groups == 1 or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or (attention_mask is not None and attention_mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, heads // groups, groups, query.shape[-1])  # (N, H_kv, G, D)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)  # (N, H_kv, G, Dv)
    return out.reshape(out.shape[0], 1, heads, value.shape[-1]), None  # (N, 1, H, Dv), as sdpa_attention_forward


AttentionInterface.register(PACKED_DECODE_SDPA, packed_decode_sdpa)
AttentionMaskInterface.register(PACKED_DECODE_SDPA, sdpa_mask)


def use_packed_decode_attention(model) -> bool:
    """Switch a model that runs transformers' SDPA attention to `packed_decode_sdpa` (same results); True if switched.

    Only models whose attention goes through transformers' attention interface (`_supports_attention_backend`)
    are switched: others (older remote code, say) may test for the name "sdpa" themselves, and are left as they are.
    """
    if (getattr(model.config, "_attn_implementation", None) != "sdpa"
            or not getattr(model, "_supports_attention_backend", False)):
        return False
    try:
        model.set_attn_implementation(PACKED_DECODE_SDPA)
    except (ValueError, ImportError, AttributeError) as error:  # refused, or a transformers without the switch
        logger.info("keeping SDPA attention for %s: %s", type(model).__name__, error)
        return False
    return True


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
