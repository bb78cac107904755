"""The CUDA decode step: a preallocated StaticCache and the step captured by torch.compile as CUDA graphs,
with grouped-query attention packed so the compiled step does not copy the keys and values per head.

Same result as the decode step of `grpo.algorithm.sampler.sample_groups` (the model's forward on one token per row
with a DynamicCache), faster on GPUs because a small model's decode step is bound by kernel launches,
which a CUDA graph replays without Python. Chosen by `--kernels auto` on CUDA (grpo.kernels.select),
through `grpo.kernels.sampling.FastSampler`; a compile failure is reported once and decoding continues
eagerly (grpo.generation.rollout). Pinned to the plain path by tests/test_kernels.py and tests/test_sampler.py
(the static and compiled steps give the same tokens and logits as the dynamic cache; on CPU the compile
runs the trunk only) and tests/test_gpu.py on a GPU.

`use_packed_decode_attention(model)` is the one explicit call that registers `packed_decode_sdpa` with
transformers and switches a model to it; importing this module changes nothing.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grpo.algorithm.sampler import cache_kwarg

logger = logging.getLogger("grpo")

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
    # (N, H_kv, G, Dv)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(out.shape[0], 1, heads, value.shape[-1]), None  # (N, 1, H, Dv), as sdpa_attention_forward


def use_packed_decode_attention(model) -> bool:
    """Register `packed_decode_sdpa` and switch a model that runs transformers' SDPA attention to it (same
    results); True if switched. Only models whose attention goes through transformers' attention interface
    (`_supports_attention_backend`) are switched: others (older remote code, say) may test for the name "sdpa"
    themselves, and are left as they are."""
    if (getattr(model.config, "_attn_implementation", None) != "sdpa"
            or not getattr(model, "_supports_attention_backend", False)):
        return False
    AttentionInterface.register(PACKED_DECODE_SDPA, packed_decode_sdpa)
    AttentionMaskInterface.register(PACKED_DECODE_SDPA, sdpa_mask)
    try:
        model.set_attn_implementation(PACKED_DECODE_SDPA)
    except (ValueError, ImportError, AttributeError) as error:  # refused, or a transformers without the switch
        logger.info("keeping SDPA attention for %s: %s", type(model).__name__, error)
        return False
    return True


def _run_trunk(trunk, **inputs):
    return trunk(**inputs)


class StaticDecoder:
    """Decode steps into a preallocated StaticCache, optionally captured with torch.compile (CUDA graphs).

    Every shape it sees is fixed (N rows, a cache of `cache_len` positions), so one compilation serves
    the whole run: the trainer passes cache_len = max_prompt_length + max_completion_length.
    On CUDA the whole step (trunk and projection) is compiled and replayed as CUDA graphs. On CPU only
    the trunk is: the projection stays W h^T into the decode head's reused buffer (inductor's own
    projection writes a fresh (N, V) tensor every token, which made the whole compiled step slower
    than eager decoding there).
    The sampler keeps its decoder between calls (its cache and compiled graph); the decoder refers to its
    model weakly: it never keeps a model alive, and a new model gets a new decoder (`fits`).
    """

    @staticmethod
    def key_for(model, num_rows: int, cache_len: int, compile_decode: bool) -> tuple:
        """What a decoder is built for: rows, cache length, compile setting and autocast dtype (the cache holds
        keys and values in the dtype the first call wrote). A decoder serves a call whose key and model match."""
        device_type = next(model.parameters()).device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        return (num_rows, cache_len, compile_decode, autocast)

    def fits(self, model, key: tuple) -> bool:
        return self.model_ref() is model and self.key == key

    def __init__(self, model, key: tuple):
        num_rows, cache_len, compile_decode, _ = key
        self.model_ref, self.key = weakref.ref(model), key
        self.cache_len, self.cache_kwarg = cache_len, cache_kwarg(model)
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        device_type = next(model.parameters()).device.type
        self.compiled_step = self.run_trunk = None  # torch.compile is lazy: nothing compiles before a first call
        if compile_decode and device_type == "cuda":
            self.compiled_step = torch.compile(self._step, mode="reduce-overhead", dynamic=False)
        elif compile_decode:  # the trunk is passed in, so the decoder holds no reference to the model
            self.compiled_step = torch.compile(self._step, dynamic=False)  # for heads that are not buffered
            self.run_trunk = torch.compile(_run_trunk, dynamic=False)

    def start(self, prefilled: DynamicCache, attention_mask: torch.Tensor) -> None:
        """Copy the expanded prefill cache (N rows, P positions) into the static cache."""
        num_rows, prompt_len = attention_mask.shape
        if prompt_len >= self.cache_len:
            raise ValueError(f"prompt length {prompt_len} does not fit the static cache of {self.cache_len} positions")
        for layer, source in zip(self.cache.layers, prefilled.layers, strict=True):
            if layer.is_initialized:
                layer.cumulative_length.zero_()  # positions past the new prompt are stale: the causal mask hides them
            layer.update(source.keys, source.values)  # writes positions [0, P)
        self.prompt_len = prompt_len
        # Static shapes: the mask covers the whole cache; the causal mask hides positions not yet written.
        self.attention_mask = torch.cat(
            [attention_mask, attention_mask.new_ones(num_rows, self.cache_len - prompt_len)], dim=1
        )

    def _step(self, model, head, tokens, position_ids, cache_position, attention_mask, **head_kwargs):
        inputs = dict(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                      cache_position=cache_position)
        if head is not None:  # the trunk, then the projection into a reused buffer
            return head(self.cache, run_trunk=self.run_trunk, **head_kwargs, **inputs)
        return model(**inputs, use_cache=True, **{self.cache_kwarg: self.cache}).logits[:, -1]

    def __call__(self, model, head, tokens, position_ids, step: int, **head_kwargs):
        """(N, V) fp32 logits of the next token (`head_kwargs`, the buffered head's shift and scale: see
        grpo.kernels.sampling._DecodeHead)."""
        cache_position = torch.tensor([self.prompt_len + step], device=tokens.device)
        # eager, or CPU's compiled trunk
        if self.compiled_step is None or (self.run_trunk is not None and head.buffered):
            return self._step(model, head, tokens, position_ids, cache_position, self.attention_mask, **head_kwargs)
        if head_kwargs:
            raise ValueError("the compiled decode step computes plain logits: no shift or scale")
        return self.compiled_step(model, None, tokens, position_ids, cache_position, self.attention_mask).float()
