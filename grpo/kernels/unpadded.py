"""Same result as `grpo.kernels.prefix.shared_prompt_hidden`, with the trunk's per-token work done on the real
tokens only: a GRPO micro-batch's completions end at very different lengths, and the padding that fills each row
to the longest one costs as much as real tokens in every projection and MLP.

    shared (prefix)   the trunk on (u, P') prompts and (n, T') completions: every projection, norm and MLP runs
                      on every position, padding included (T' is the micro-batch's longest completion)
    unpadded (here)   the same two passes with every per-token module run on the R real tokens, (R, H); only the
                      attention takes the padded layout: q, k, v scattered into (rows, heads, positions, D)
                      with zeros at padding, which the mask keeps every real query from reading

    x = embed(real tokens)                                     (R, H)
    cos, sin = rotary(x, their positions)                      (R, D): the model's own rotary module
    for each layer:
        h = input_norm(x)
        q, k = rope(q_proj(h), k_proj(h), cos, sin)            (R, Hq, D), (R, Hkv, D); Qwen3 RMS-normalises
                                                               each head of q and k first (q_norm, k_norm)
        K, V = [prompt cache, grid(k)], [.., grid(v)]          (n, Hkv, P' + T', D): the prompt's keys and values
                                                               (the completion pass) before the rows' own
        x = x + o_proj(SDPA(grid(q), K, V, mask)[real])        grid: (R, h, D) -> (n, h, L, D), zeros at padding
        x = x + mlp(post_attention_norm(x))
    return norm(x)                                             (R, H)

The same modules in the same order as the decoder layers' forward (as grpo.kernels.lean_decode does for a decode
step), so the hidden states equal the padded pass's to fp32 rounding, and with grad so do the gradients
(tests/test_kernels.py). The mask lets a query read the real keys at or before it (and its prompt's); a
padding query of a left-padded prompt reads none, which SDPA turns into a zero output (torch >= 2.5, as for
transformers' own masks), and its output is dropped.

Chosen by grpo.kernels.select_kernels wherever the shared-prompt passes run and the trunk is one that
lean_decode runs (Qwen2, Qwen3 and Llama decoder layers, SDPA, full attention, no attention dropout in
training); completions must be masked as the sampler masks them, real tokens first in every row.

Notation: n rows, u distinct prompts, P' prompt and T' completion positions, R real tokens of a pass,
M real completion tokens, H hidden, D head dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.kernels.lean_decode import _FAMILIES
from grpo.kernels.prefix import distinct_prompts
from grpo.algorithm.logprobs import plain_output_weight, position_ids_from_mask

__all__ = ["real_token_layers", "unpadded_shared_prompt_hidden"]


def _grid(values: torch.Tensor, index: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """(R, h, D) values of the real positions `index` (into the row-major (rows * length) grid) -> (rows, h,
    length, D), zeros at padding."""
    full = values.new_zeros(rows * length, *values.shape[1:]).index_copy(0, index, values)
    return full.view(rows, length, *values.shape[1:]).transpose(1, 2)


def real_token_layers(trunk, x: torch.Tensor, real: torch.Tensor, positions: torch.Tensor,
                      past: list | None = None, past_mask: torch.Tensor | None = None, keep_cache: bool = False):
    """The decoder layers and final norm on the real tokens of (n, L) rows (see the module docstring).

    x (R, H): the embeddings of the real positions of `real` (n, L) bool, in row-major order; positions (R,)
    their position ids. past: per layer the (keys, values) (n, Hkv, P, D) the rows attend to before their own
    positions, past_mask (n, P) bool which of those are real. Returns (hidden (R, H) after the final norm, and
    with keep_cache per layer the (keys, values) (n, Hkv, L, D) of these positions, else None).
    """
    _, apply_rotary, qk_norm = _FAMILIES[type(trunk)]
    layers = trunk.layers[: trunk.config.num_hidden_layers]
    rows, length = real.shape
    num_real = x.shape[0]
    index = real.flatten().nonzero().squeeze(1)  # (R,)
    cos, sin = trunk.rotary_emb(x[None], positions[None])  # (1, R, D) each
    cos, sin = cos[0], sin[0]  # (R, D): broadcast over heads by apply_rotary's unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()  # (L, L): key <= query
    allowed = causal[None] & real[:, None, :]  # (n, L, L)
    if past is not None:
        allowed = torch.cat([past_mask.bool()[:, None, :].expand(rows, length, -1), allowed], dim=2)  # (n, L, P + L)
    mask = allowed[:, None]  # (n, 1, L, P + L)
    attention = layers[0].self_attn
    heads, kv_heads, head_dim = trunk.config.num_attention_heads, trunk.config.num_key_value_heads, attention.head_dim
    cache = [] if keep_cache else None
    for number, layer in enumerate(layers):
        attention = layer.self_attn
        h = layer.input_layernorm(x)  # (R, H)
        q = attention.q_proj(h).view(num_real, heads, head_dim)  # (R, Hq, D)
        k = attention.k_proj(h).view(num_real, kv_heads, head_dim)  # (R, Hkv, D)
        v = attention.v_proj(h).view(num_real, kv_heads, head_dim)
        if qk_norm:  # Qwen3: over each head's D values
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        keys, values = _grid(k, index, rows, length), _grid(v, index, rows, length)  # (n, Hkv, L, D)
        if keep_cache:
            cache.append((keys, values))
        if past is not None:
            keys, values = torch.cat([past[number][0], keys], dim=2), torch.cat([past[number][1], values], dim=2)
        # query head j G + g reads key/value head j (transformers' repeat_kv, without the copies)
        out = F.scaled_dot_product_attention(_grid(q, index, rows, length), keys, values, attn_mask=mask,
                                             scale=attention.scaling, enable_gqa=heads != kv_heads)  # (n, Hq, L, D)
        out = out.transpose(1, 2).reshape(rows * length, heads * head_dim).index_select(0, index)  # (R, Hq D)
        x = x + attention.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return trunk.norm(x), cache


def unpadded_shared_prompt_hidden(model, input_ids, attention_mask, completion_mask, inputs_embeds=None):
    """`grpo.kernels.prefix.shared_prompt_hidden` with each pass on its real tokens only.

    input_ids, attention_mask (n, P' + T'), prompts left-padded; completion_mask (n, T'), each row's real tokens
    first (as sampled: up to and with its EOS); `inputs_embeds` (n, P' + T', H), if given, replaces the embedding
    lookup. Returns (hidden (M, H), targets (M,), keep (n, T') bool, output weight (V, H)).
    """
    total_len, completion_len = input_ids.shape[1], completion_mask.shape[1]
    assert attention_mask.shape == input_ids.shape and completion_len < total_len, \
        (input_ids.shape, completion_mask.shape)
    prompt_len = total_len - completion_len
    keep = completion_mask.bool()  # (n, T')
    if not torch.equal(attention_mask[:, prompt_len:].bool(), keep) or bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError("the unpadded trunk pass needs each completion's real tokens first and attended as masked "
                         "(a sampled completion is); --kernels plain runs any mask")
    weight = plain_output_weight(model)  # before the trunk runs
    trunk = getattr(model, model.base_model_prefix)
    real = attention_mask.bool()  # (n, P' + T')
    positions = position_ids_from_mask(attention_mask)  # (n, P' + T'), as the padded pass
    first, inverse = distinct_prompts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])  # (u,), (n,)

    def embed(rows, columns, where):  # the real positions `where` of input_ids[rows, columns] -> (R, H)
        if inputs_embeds is None:
            return trunk.embed_tokens(input_ids[rows, columns][where])
        return inputs_embeds[rows, columns][where]

    prompt_real = real[first, :prompt_len]  # (u, P')
    prompts, cache = real_token_layers(trunk, embed(first, slice(None, prompt_len), prompt_real), prompt_real,
                                       positions[first, :prompt_len][prompt_real], keep_cache=True)  # (Rp, H)
    # (n, Hkv, P', D)
    past = [(keys.index_select(0, inverse), values.index_select(0, inverse)) for keys, values in cache]
    completions, _ = real_token_layers(trunk, embed(slice(None), slice(prompt_len, None), keep), keep,
                                       positions[:, prompt_len:][keep], past, real[:, :prompt_len])  # (Rc, H)
    # Position t - 1 predicts token t: the prompt's last position predicts the first completion token, a
    # completion's position j - 1 (real, since its real tokens come first) the token j.
    prompt_last = prompt_real.flatten().cumsum(0).view_as(prompt_real)[:, -1] - 1  # (u,) index into `prompts`
    completion_index = keep.flatten().cumsum(0).view_as(keep) - 1 + prompts.shape[0]  # (n, T') index into both
    source = torch.cat([prompt_last[inverse][:, None], completion_index[:, :-1]], dim=1)  # (n, T')
    hidden = torch.cat([prompts, completions]).index_select(0, source[keep])  # (M, H)
    return hidden, input_ids[:, prompt_len:][keep], keep, weight
