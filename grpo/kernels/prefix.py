"""Same result as `grpo.algorithm.logprobs.completion_hidden`, with each distinct prompt's trunk pass run once: the rows
of a
GRPO group share their prompt, so the log-prob passes (reference, old policy, update) give it its keys and values
once.

    padded   (n, P' + T') every row's prompt and completion: a group's prompt runs through the trunk G times
    shared   (u, P') the u distinct prompts of the micro-batch once, with a KV cache; then (n, T') the completions,
             each row attending to its prompt's cached keys and values (cache rows repeated per row)

The hidden state that predicts a completion's first token is the prompt's last position's (left padding keeps the
real tokens at the end); the others come from the completion pass. Positions and masks are the padded pass's, so
the hidden states agree with it to fp32 rounding, and with grad so do the gradients (tests/test_kernels.py,
tests/test_trainer.py). The trunk work on prompts falls from n P' to u P' tokens (docs/benchmarks.md). Chosen by
grpo.kernels.select_kernels for the reference and old-policy passes and for the update's (not under gradient
checkpointing, where transformers turns the cache off when grad is on, nor FSDP2); needs a trunk that fills a
transformers DynamicCache, and says so if one does not.

Notation: n rows, u distinct prompts, P' prompt and T' completion positions, M real completion tokens, H hidden.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from grpo.algorithm.logprobs import plain_output_weight, position_ids_from_mask
from grpo.algorithm.sampler import cache_kwarg


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first (u,), inverse (n,)): the first row of each distinct prompt (its real tokens and padding alike), and
    for each row the index of its prompt among them."""
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)  # (n, P'): padding ids count as one value
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # (n,) in 0..u-1
    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    first = torch.full((int(inverse.max()) + 1,), prompt_ids.shape[0], dtype=torch.long, device=prompt_ids.device)
    return first.scatter_reduce_(0, inverse, rows, "amin"), inverse


def shared_prompt_hidden(model, input_ids, attention_mask, completion_mask, inputs_embeds=None):
    """`grpo.algorithm.logprobs.completion_hidden` with the distinct prompts' trunk pass run once (see the module
    docstring).

    input_ids, attention_mask (n, P' + T'), prompts left-padded; completion_mask (n, T'); `inputs_embeds` (n, P' + T',
    H), if given, replaces the embedding lookup (grpo.kernels.fused_loss). With grad, each prompt's activations get
    the gradients of all its rows (the cache's repeat is an index, summed in backward). Returns (hidden (M, H),
    targets (M,), keep (n, T') bool, output weight (V, H)).
    """
    total_len, completion_len = input_ids.shape[1], completion_mask.shape[1]
    assert attention_mask.shape == input_ids.shape and completion_len < total_len, \
        (input_ids.shape, completion_mask.shape)
    prompt_len = total_len - completion_len
    weight = plain_output_weight(model)  # before the trunk runs
    trunk = getattr(model, model.base_model_prefix)
    positions = position_ids_from_mask(attention_mask)  # (n, P' + T'), as the padded pass
    first, inverse = distinct_prompts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])  # (u,), (n,)
    cache, name = DynamicCache(config=model.config), cache_kwarg(trunk)
    key, inputs = ("input_ids", input_ids) if inputs_embeds is None else ("inputs_embeds", inputs_embeds)  # (n, L, ...)
    prompts = trunk(**{key: inputs[first, :prompt_len]}, attention_mask=attention_mask[first, :prompt_len],
                    position_ids=positions[first, :prompt_len], use_cache=True, **{name: cache}).last_hidden_state
    if cache.get_seq_length() != prompt_len:  # e.g. a trunk that drops its cache in some mode
        raise RuntimeError(f"{type(trunk).__name__} did not fill the KV cache of the prompts ({cache.get_seq_length()} "
                           f"of {prompt_len} positions): shared-prompt passes need one; --kernels plain runs without")
    cache.batch_select_indices(inverse)  # (u, ...) -> (n, ...): each row its prompt's keys and values
    completions = trunk(**{key: inputs[:, prompt_len:]}, attention_mask=attention_mask,
                        position_ids=positions[:, prompt_len:], use_cache=True, **{name: cache}).last_hidden_state
    # Position t - 1 predicts token t: the prompt's last position predicts the first completion token.
    hidden = torch.cat([prompts[inverse, -1:], completions[:, :-1]], dim=1)  # (n, T', H)
    keep = completion_mask.bool()  # (n, T')
    return hidden[keep], input_ids[:, prompt_len:][keep], keep, weight
