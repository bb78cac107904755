"""The functions one update calls, chosen once at set-up (`StepFunctions`), and grpo's own (`plain_step_functions`):
log-probs -> the per-token loss -> its aggregation (logprob_loss), micro-batches of consecutive rows. `--kernels auto`
hands the update grpo.kernels' versions of the same functions, which compute the same numbers.

Notation: N rows, n of a micro-batch, T completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from grpo.algorithm.advantages import grpo
from grpo.algorithm.logprobs import completion_logprobs
from grpo.algorithm.loss import (LossOptions, aggregate_loss, entropy_bonus, loss_terms, policy_loss_value,
                                 terms_statistics)


@dataclass
class StepFunctions:
    """What the update calls to get log-probs, a micro-batch's loss and the micro-batches (chosen once)."""

    logprobs: Callable  # (model, ids, attention_mask, completion_mask) -> ((n, T) logps, None); no grad passes
    update_loss: Callable  # (model, ids, attention_mask, loss_mask, advantages (n, 1) or (n, T), old, ref, aggregation,
    #                        entropy_coef, behaviour, is_weights) -> (loss, LossStats); old None when on-policy;
    #                        entropy_coef None: no bonus; behaviour / is_weights None: no correction
    #                        (grpo.algorithm.off_policy); the completion is attention_mask's last T columns
    batches: Callable  # (lengths (N,), micro_batch_size) -> [rows]: the reference / old passes' micro-batches
    update_batches: Callable  # (rows (N/k,), lengths (N,), micro_batch_size) -> [rows]: one update's micro-batches
    advantage_estimator: Callable = grpo  # (AdvantageBatch) -> (N,) or (N, T) advantages (grpo.algorithm.advantages)


def plain_batches(lengths: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Consecutive rows."""
    return list(torch.arange(lengths.shape[0], device=lengths.device).split(micro_batch_size))


def plain_update_batches(rows: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """One update's rows, in their random order, cut into consecutive micro-batches (`lengths`: for kernels that
    group rows by length, grpo.kernels.batching)."""
    return list(rows.split(micro_batch_size))


def logprob_loss(logprobs: Callable, options: LossOptions) -> Callable:
    """The update loss as the paper writes it: log-probs -> per-token loss -> aggregation (- entropy bonus)."""

    def update_loss(model, ids, attention_mask, loss_mask, advantages, old_logps, ref_logps, aggregation,
                    entropy_coef=None, behaviour_logps=None, is_weights=None):
        completion_mask = attention_mask[:, -loss_mask.shape[1]:]  # (n, T) tool results included
        logps, entropy = logprobs(model, ids, attention_mask, completion_mask, with_entropy=True)  # (n, T)
        old = logps.detach() if old_logps is None else old_logps  # on-policy: rho = 1
        mask = loss_mask.to(logps.dtype)  # (n, T)
        terms = loss_terms(logps, old, advantages, mask, ref_logps, options, entropy, behaviour_logps, is_weights)
        loss = aggregate_loss(terms.loss, mask, options.aggregation, **aggregation)
        stats = terms_statistics(terms, advantages, mask, options, entropy)
        if entropy_coef is not None:  # loss - coef * mean entropy over the tokens the policy loss keeps
            num_micro = aggregation["num_micro_batches"]
            stats.policy_loss = policy_loss_value(loss.item(), options.aggregation, num_micro)
            acting = mask if terms.entropy_mask is None else mask * terms.entropy_mask
            loss = loss - entropy_coef * entropy_bonus(entropy, acting, num_micro)
        return loss, stats

    return update_loss


def plain_step_functions(options: LossOptions, temperature: float, chunk_size: int | None = None,
                         fp32_head: bool = False) -> StepFunctions:
    """grpo/'s own functions (`--kernels plain`)."""
    logprobs = partial(completion_logprobs, temperature=temperature, chunk_size=chunk_size, fp32_head=fp32_head)
    return StepFunctions(logprobs, logprob_loss(logprobs, options), plain_batches, plain_update_batches)


