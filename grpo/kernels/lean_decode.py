"""Same result as the trunk of the model's forward in a decode step (the hidden states that
`grpo.algorithm.sampler.sample_groups` projects), faster on CPU because it calls the model's own modules on
(N, H) rows without transformers' per-call framework. A lean decode step for Qwen2, Qwen3 and Llama trunks.

Called for one token per row, transformers' decoder forward spends most of a small model's decode step
outside its arithmetic: each call builds the attention masks anew and passes (N, 1, H) hidden states
through keyword plumbing, output recording, dtype round trips and the cache's update protocol.
`LeanDecodeStep` calls the same modules in the same order on (N, H) rows:

    x = embed(token)                                         (N, H)
    cos, sin = rotary(x, position)                           (N, D): the model's own rotary module
    for each layer:
        h = input_norm(x)
        q, k = rope(q_proj(h), k_proj(h), cos, sin)          (N, Hq, D), (N, Hkv, D); Qwen3 RMS-normalises
                                                             each head of q and k first (q_norm, k_norm)
        K, V = cache.update(k, v_proj(h))                    (N, Hkv, L, D): the new position written in place
        x = x + o_proj(SDPA(q, K, V, mask))                  query heads packed onto their key/value head
        x = x + mlp(post_attention_norm(x))
    return norm(x)

with the attention mask (the prompts' left padding) built once per rollout instead of once per token.
Same modules and the same operations as transformers' forward (the decoder layer's two residual blocks,
`grpo.kernels.compiled_decode.packed_decode_sdpa`'s attention call), so its hidden states equal
transformers' (tests/test_lean_decode.py compares them to within fp32 rounding over 6 steps).

Chosen by `--kernels auto` through grpo.kernels.sampling.FastSampler for eager CPU decoding of the model classes in
`_FAMILIES`, with transformers' SDPA
attention (ours or theirs) and full attention in every layer; anything else (other architectures,
sliding-window layers, attention dropout in training mode, other attention implementations) decodes
with transformers' forward: `unsupported_reason` says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from grpo.kernels.compiled_decode import PACKED_DECODE_SDPA

# trunk class -> (its decoder layer class, its rotary function, whether q and k heads are RMS-normalised before
# the rotary): pre-norm layers with RMSNorm, rotary position embeddings, grouped-query attention and a gated MLP,
# as in these classes' forward.
_FAMILIES = {
    modeling_qwen2.Qwen2Model: (modeling_qwen2.Qwen2DecoderLayer, modeling_qwen2.apply_rotary_pos_emb, False),
    modeling_qwen3.Qwen3Model: (modeling_qwen3.Qwen3DecoderLayer, modeling_qwen3.apply_rotary_pos_emb, True),
    modeling_llama.LlamaModel: (modeling_llama.LlamaDecoderLayer, modeling_llama.apply_rotary_pos_emb, False),
}
_SDPA = ("sdpa", PACKED_DECODE_SDPA)


def unsupported_reason(trunk) -> str | None:
    """Why `LeanDecodeStep` cannot run this trunk (the model's base model), or None when it can."""
    family = _FAMILIES.get(type(trunk))
    if family is None:
        return f"{type(trunk).__name__} is not one of {', '.join(c.__name__ for c in _FAMILIES)}"
    config = trunk.config
    layers = trunk.layers[: config.num_hidden_layers]
    if any(type(layer) is not family[0] for layer in layers):
        return f"a decoder layer is not a {family[0].__name__}"
    if config._attn_implementation not in _SDPA:
        return f"attention implementation {config._attn_implementation!r} (supported: {', '.join(_SDPA)})"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if any(getattr(layer.self_attn, "sliding_window", None) is not None for layer in layers):
        return "sliding-window attention"
    if trunk.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    return None


class LeanDecodeStep:
    """Decode steps of a supported trunk into a filled KV cache: call with (N, 1) tokens and (N, 1) positions
    for the (N, H) hidden states after the final norm (the output projection's input).

    cache: the DynamicCache after the prefill, expanded to N rows (the sampler reserves room in it, so each
    step writes its position in place); prompt_mask: the (N, P) attention mask of its P positions (0 on left
    padding); max_new: how many positions the steps may add. Runs without grad (the sampler's inference mode).
    """

    def __init__(self, trunk, cache, prompt_mask: torch.Tensor, max_new: int):
        reason = unsupported_reason(trunk)
        if reason is not None:
            raise ValueError(f"LeanDecodeStep cannot run this model: {reason}")
        self.trunk, self.cache = trunk, cache
        self.layers = trunk.layers[: trunk.config.num_hidden_layers]
        _, self.apply_rotary, self.qk_norm = _FAMILIES[type(trunk)]
        attention = self.layers[0].self_attn
        self.heads, self.head_dim = trunk.config.num_attention_heads, attention.head_dim
        self.kv_heads = trunk.config.num_key_value_heads
        num_rows = prompt_mask.shape[0]
        # (N, 1, 1, P + max_new): a row attends to its prompt's real tokens and to every generated position
        # (the steps slice the positions written so far), as transformers' SDPA mask for these calls.
        allowed = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(num_rows, max_new, dtype=torch.bool)], dim=1)
        self.allowed = allowed[:, None, None, :]

    def keep_rows(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` of the attention mask (the sampler compacts the cache alike)."""
        self.allowed = self.allowed[indices]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        num_rows, heads, kv_heads, head_dim = input_ids.shape[0], self.heads, self.kv_heads, self.head_dim
        x = self.trunk.embed_tokens(input_ids[:, 0])  # (N, H)
        cos, sin = self.trunk.rotary_emb(x, position_ids)  # (N, 1, D) each
        cos, sin = cos[:, 0], sin[:, 0]  # (N, D): broadcast over heads by apply_rotary's unsqueeze(1)
        mask = None
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            h = layer.input_layernorm(x)  # (N, H)
            q = attention.q_proj(h).view(num_rows, heads, head_dim)  # (N, Hq, D)
            k = attention.k_proj(h).view(num_rows, kv_heads, head_dim)  # (N, Hkv, D)
            v = attention.v_proj(h).view(num_rows, kv_heads, head_dim)
            if self.qk_norm:  # Qwen3: over each head's D values
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = self.apply_rotary(q, k, cos, sin)
            keys, values = self.cache.update(k[:, :, None], v[:, :, None], index)  # (N, Hkv, L, D)
            if mask is None:
                mask = self.allowed[..., : keys.shape[-2]]  # (N, 1, 1, L)
            # query head j G + g reads key/value head j: (N, Hkv, G, D) against (N, Hkv, L, D), as packed_decode_sdpa
            out = F.scaled_dot_product_attention(q.view(num_rows, kv_heads, heads // kv_heads, head_dim), keys,
                                                 values, attn_mask=mask, scale=attention.scaling)
            x = x + attention.o_proj(out.reshape(num_rows, heads * head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.trunk.norm(x)  # (N, H)
