"""Same result as `grpo.algorithm.logprobs.completion_hidden`, without padding: a micro-batch's real tokens packed into
one row.

    padded   (n, P' + T') rows, prompts left-padded, completions right-padded: the trunk runs on every position
    packed   (1, R) the R real tokens of the n rows one after the other, position ids restarting at 0 for each row

transformers reads a packed row from its position ids (a position that does not follow the one before starts a
new sequence) when no attention mask is given and no cache is used, and keeps each sequence's attention to itself:
flash-attention implementations through variable-length kernels (no work on padding at all), flex attention
through a block-sparse mask. SDPA and eager attention are given a dense (R, R) block-diagonal mask instead, which
costs more than the padding it saves at these lengths, so grpo.kernels.select_kernels turns packing on only for
the former. tests/test_kernels.py pins the packed pass to the padded one on CPU with SDPA (same log-probs and
gradients to fp32 rounding).

Notation: n rows, L = P' + T' positions, R real tokens (attention_mask == 1), M real completion tokens, H hidden.
"""

from __future__ import annotations

import torch

from grpo.algorithm.logprobs import plain_output_weight, position_ids_from_mask

# Attention implementations that run a packed row without forming an (R, R) mask.
PACKING_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


def packs_without_dense_mask(attention_implementation: str | None) -> bool:
    """Whether packing pays with this attention implementation (a hub kernel such as kernels-community/flash-attn
    counts as flash attention)."""
    name = attention_implementation or ""
    return name in PACKING_ATTENTION or "flash" in name


def packed_completion_hidden(model, input_ids, attention_mask, completion_mask, inputs_embeds=None):
    """`grpo.algorithm.logprobs.completion_hidden` with the trunk run once over the packed real tokens.

    input_ids, attention_mask (n, L); completion_mask (n, T'). Returns (hidden (M, H), targets (M,), keep (n, T')
    bool, output weight (V, H)), in completion_hidden's order (row by row, token by token).
    """
    total_len, completion_len = input_ids.shape[1], completion_mask.shape[1]
    assert attention_mask.shape == input_ids.shape and completion_len < total_len, \
        (input_ids.shape, completion_mask.shape)
    weight = plain_output_weight(model)  # before the trunk runs
    trunk = getattr(model, model.base_model_prefix)
    real = attention_mask.bool()  # (n, L)
    positions = position_ids_from_mask(attention_mask)[real][None]  # (1, R): 0, 1, ... within each row
    inputs = {"input_ids": input_ids[real][None]} if inputs_embeds is None else \
        {"inputs_embeds": inputs_embeds[real][None]}
    packed = trunk(**inputs, position_ids=positions, use_cache=False).last_hidden_state[0]  # (R, H)
    keep = completion_mask.bool()  # (n, T')
    # Position t - 1 predicts token t: mark the positions before each real completion token, then find each one's
    # place in the packed row (the real positions are packed in row-major order).
    predicting = torch.zeros_like(real)
    predicting[:, total_len - completion_len - 1 : total_len - 1] = keep
    packed_index = real.flatten().cumsum(0).view_as(real) - 1  # (n, L): index in the packed row, where real
    targets = input_ids[:, total_len - completion_len :][keep]  # (M,)
    return packed[packed_index[predicting]], targets, keep, weight
