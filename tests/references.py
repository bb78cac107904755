"""Naive reference implementations the tests (and bench/logprob_memory.py) compare the product against."""

from __future__ import annotations

import torch

from grpo.algorithm.logprobs import position_ids_from_mask


def naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """Reference: full logits, log_softmax, gather. Materialises (N, T, V); for tests and bench/logprob_memory.py."""
    completion_len = completion_mask.shape[1]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits  # (N, L, V)
    logits = logits[:, -completion_len - 1 : -1].float() / temperature  # (N, T, V)
    targets = input_ids[:, -completion_len:]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)  # (N, T)
    return logps * completion_mask
