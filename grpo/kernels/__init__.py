"""Fast paths beside the plain code, and the one place that decides which of them run.

    module                        replaces (same numbers)                           applies
    grpo.kernels.sampling         algorithm.sampler.sample_groups (FastSampler)     every device
    grpo.kernels.lean_decode      the trunk's forward in a CPU decode step          Qwen2/Qwen3/Llama, SDPA, eager CPU
    grpo.kernels.compiled_decode  the decode step (static cache, CUDA graphs)       CUDA
    grpo.kernels.logprobs         algorithm.logprobs.completion_logprobs            every device
    grpo.kernels.fused_loss       log-probs -> per_token_loss -> aggregate_loss     token-level ratios
    grpo.kernels.batching         random micro-batches (similar lengths together)   not bnpo, entropy terms
    grpo.kernels.packing          the log-prob kernels' padded trunk pass           flash / flex attention
    grpo.kernels.prefix           the same, each distinct prompt once               not FSDP2, not checkpointed
    grpo.kernels.unpadded         the shared-prompt pass on real tokens only        with it; lean_decode's trunks
    grpo.kernels.buffers          reused CPU storage, owned by the kernels' objects

`--kernels plain` runs the plain path everywhere (the definition a reader checks against the paper);
`--kernels auto` (the default) takes each kernel where it applies. `select_kernels` is the only place
that decides. The `KernelChoice` it returns says which kernels apply (and why the others do not), and
hands the run the functions it calls: `step_functions()` for the update (grpo.algorithm.step.StepFunctions) and
`sampler()` for the generation seam; the loop never asks which. A run with `--kernels plain` never imports
this package (grpo.core.setup.step_functions hands it grpo/'s own functions). tests/test_kernels.py pins every
kernel to the plain path. Importing this package changes nothing outside it; `prepare_model` is an explicit
call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import torch

from grpo.config import KERNEL_CHOICES
from grpo.kernels.buffers import Buffers
from grpo.algorithm.step import StepFunctions, logprob_loss, plain_step_functions

logger = logging.getLogger("grpo")



@dataclass
class KernelChoice:
    """Which kernels a run uses, and why each one that does not apply does not."""

    fast_sampler: bool = False  # grpo.kernels.sampling.FastSampler instead of grpo.algorithm.sampler.sample_groups
    compile_decode: bool = False  # inside FastSampler: static cache + compiled decode step (CUDA)
    # grpo.kernels.logprobs instead of grpo.algorithm.logprobs (reference and old log-probs)
    fast_logprobs: bool = False
    update_logprobs: bool = False  # the same in the update pass, where the loss may differentiate the entropy
    fused_loss: bool = False  # grpo.kernels.fused_loss instead of log-probs -> per_token_loss -> aggregate_loss
    length_grouping: bool = False  # grpo.kernels.batching: update micro-batches of rows of similar length
    length_sorted_passes: bool = False  # the same for the reference and old-policy passes (no loss: always exact)
    packed_logprobs: bool = False  # grpo.kernels.packing: the log-prob kernels' trunk pass on packed real tokens
    shared_prompt_passes: bool = False  # grpo.kernels.prefix: the reference / old-policy passes run each prompt once
    shared_prompt_update: bool = False  # the same in the update pass (the kernels' log-probs or the fused loss)
    unpadded_trunk: bool = False  # grpo.kernels.unpadded: those shared-prompt passes on the real tokens only
    reasons: dict[str, str] = field(default_factory=dict)  # kernel -> why it is off
    buffers: Buffers = field(default_factory=Buffers, repr=False)  # the log-prob kernels' reused storage

    def log_reasons(self) -> None:
        for name, reason in self.reasons.items():
            logger.info("kernel %s is off: %s", name, reason)

    def used(self) -> dict[str, bool]:
        """Each kernel's on/off flag (run_config.json's `kernels_used`)."""
        return {name: value for name, value in vars(self).items() if isinstance(value, bool)}

    def step_functions(self, options=None, temperature: float = 1.0, chunk_size: int | None = None,
                       fp32_head: bool = False) -> StepFunctions:
        """The update's log-prob, loss and micro-batch functions: grpo.algorithm.step.plain_step_functions where no
        kernel applies, each kernel's same-number version where one does."""
        from grpo.kernels.batching import length_grouped, length_sorted
        from grpo.kernels.logprobs import completion_logprobs
        from grpo.algorithm.loss import LossOptions

        options = options or LossOptions()
        plain = plain_step_functions(options, temperature, chunk_size, fp32_head)

        def kernel_logprobs(shared: bool):
            return partial(completion_logprobs, temperature=temperature, chunk_size=chunk_size, buffers=self.buffers,
                           packed=self.packed_logprobs, shared_prompts=shared, unpadded=shared and self.unpadded_trunk)

        update_logprobs = kernel_logprobs(self.shared_prompt_update) if self.update_logprobs else plain.logprobs
        update_loss = logprob_loss(update_logprobs, options)
        if self.fused_loss:
            update_loss = partial(_fused_update_loss, options=options, temperature=temperature, chunk_size=chunk_size,
                                  buffers=self.buffers, packed=self.packed_logprobs,
                                  shared_prompts=self.shared_prompt_update,
                                  unpadded=self.shared_prompt_update and self.unpadded_trunk)
        return StepFunctions(
            logprobs=kernel_logprobs(self.shared_prompt_passes) if self.fast_logprobs else plain.logprobs,
            update_loss=update_loss,
            batches=length_sorted if self.length_sorted_passes else plain.batches,
            update_batches=length_grouped if self.length_grouping else plain.update_batches,
        )

    def sampler(self, max_prompt_length: int | None = None):
        """The group sampler, called as grpo.algorithm.sampler.sample_groups is: that function itself, or the kernel."""
        if not self.fast_sampler:
            from grpo.algorithm.sampler import sample_groups

            return sample_groups
        from grpo.kernels.sampling import FastSampler

        return FastSampler(compile_decode=self.compile_decode, max_prompt_length=max_prompt_length)

    def prepare_model(self, model) -> None:
        """What the chosen kernels need of the policy, done once where it is loaded: the compiled decode step
        reads K and V through its packed attention function (registered with transformers here, logged)."""
        if self.compile_decode:
            from grpo.kernels.compiled_decode import use_packed_decode_attention

            if use_packed_decode_attention(model):
                logger.info("attention: %s runs grpo.kernels.compiled_decode's packed SDPA (the same results; "
                            "the compiled decode step reads K and V without copying them per query head)",
                            type(model).__name__)


def _fused_update_loss(model, ids, attention_mask, loss_mask, advantages, old_logps, ref_logps, aggregation,
                       entropy_coef=None, behaviour_logps=None, is_weights=None, *, options, **kernel_args):
    """grpo.kernels.fused_loss with the aggregation's weights: the same loss and statistics as
    grpo.algorithm.step.logprob_loss (the weights are 0 on the tokens the loss mask leaves out, such as tool results).
    select_kernels leaves it off with an entropy bonus (entropy_coef is then None) and with the off-policy mask
    (the only reader of behaviour_logps besides the weights)."""
    from grpo.kernels.fused_loss import fused_completion_loss
    from grpo.algorithm.loss import aggregation_weights, loss_statistics

    with torch.autocast(loss_mask.device.type, enabled=False):
        weights = aggregation_weights(loss_mask, options.aggregation, **aggregation)  # (n, T)
    completion_mask = attention_mask[:, -loss_mask.shape[1]:]  # (n, T) the tokens the model reads
    loss, logps, entropy = fused_completion_loss(model, ids, attention_mask, completion_mask, advantages, old_logps,
                                                 ref_logps, weights, options, is_weights=is_weights, **kernel_args)
    detached = logps.detach()  # the statistics from the same terms, recomputed from the kernel's log-probs
    stats = loss_statistics(detached, detached if old_logps is None else old_logps, advantages, loss_mask,
                            ref_logps, options, entropy.detach())
    return loss, stats


def _holding(*pairs: tuple[bool, str]) -> list[str]:
    """The reasons of the (condition, reason) pairs whose condition holds, in order."""
    return [reason for condition, reason in pairs if condition]


def select_kernels(kernels: str, device: torch.device, loss_options=None, model=None,
                   entropy_bonus: bool = False, fp32_head: bool = False, sharded: bool = False,
                   gradient_checkpointing: bool = False, micro_batch_metrics: bool = False,
                   repetition_penalty: bool = False) -> KernelChoice:
    """The kernels for a run: none with `plain`; with `auto` each one where it applies (see the module table).

    loss_options (grpo.algorithm.loss.LossOptions, default: the defaults) decides whether the fused loss applies: it
    needs
    a token's loss to depend on that token's log-prob only. entropy_bonus: the loss differentiates the entropy,
    which the log-prob kernels compute for the logs only, so the update pass takes the plain log-probs.
    fp32_head (cast_lm_head_to_fp32): the kernels run the output projection in the autocast dtype; the plain
    log-probs run it in fp32. sharded (FSDP2) or gradient_checkpointing: no shared-prompt passes.
    micro_batch_metrics (metrics_average micro_batch): the logged statistics are means of each micro-batch's, so the
    micro-batches stay as cut. repetition_penalty: the plain sampler applies it, the kernel sampler does not.
    """
    from grpo.algorithm.loss import LOSS_TYPES, LossOptions

    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "plain":
        return KernelChoice(reasons={"all": "--kernels plain"})
    options = loss_options or LossOptions()
    choice = KernelChoice(fast_sampler=True, fast_logprobs=True, fused_loss=True, update_logprobs=True,
                          length_grouping=True, length_sorted_passes=True)
    grouping_dependent = _holding(
        (options.aggregation == "bnpo", "bnpo divides each micro-batch's loss by that micro-batch's token count"),
        (options.top_entropy_quantile < 1.0, "the entropy mask's quantile is taken over each micro-batch"),
        (entropy_bonus, "the entropy bonus is a mean over each micro-batch's tokens"),
        (micro_batch_metrics, "metrics_average=micro_batch logs the mean of each micro-batch's statistics"),
    )
    if grouping_dependent:
        choice.length_grouping = False
        choice.reasons["length_grouping"] = "; ".join(grouping_dependent) + ": regrouping would change the loss or " \
            "its logs, so the update keeps the random micro-batches"
    coupled = _holding(
        (options.ratio_level != "token", "sequence-level ratios couple a completion's tokens"),
        (options.loss_type not in LOSS_TYPES, "a plug-in objective reads the (n, T) tensors"),
        (options.loss_type == "vespo", "vespo weighs each token by its completion's ratio"),
        (options.off_policy_mask_threshold is not None, "the off-policy mask reads a completion's mean log-ratio"),
        (options.top_entropy_quantile < 1.0, "the entropy mask needs every token's entropy before the loss"),
        (entropy_bonus, "the entropy bonus differentiates the entropy"),
    )
    if repetition_penalty:
        choice.fast_sampler = False
        choice.reasons["fast_sampler"] = "repetition_penalty: grpo.algorithm.sampler.sample_groups applies it"
    if fp32_head:
        choice.fast_logprobs = choice.update_logprobs = False
        choice.reasons["fast_logprobs"] = "cast_lm_head_to_fp32: the plain log-probs run the output projection in fp32"
        coupled.append("cast_lm_head_to_fp32 (an fp32 output projection)")
    if coupled:
        choice.fused_loss = False
        choice.reasons["fused_loss"] = "; ".join(coupled) + (": the plain log-probs -> per_token_loss -> "
                                                             "aggregate_loss path runs")
    plain_update = _holding(
        (entropy_bonus, "the entropy bonus differentiates the entropy, which the log-prob kernel computes for the "
                        "logs only"),
        (options.top_entropy_quantile < 1.0, "the entropy mask thresholds the entropies: the kernel's agree with the "
                                             "plain path's to rounding, which can move a near-tied token across the "
                                             "threshold, so the mask is taken from the plain path's"),
    )
    if plain_update:
        choice.update_logprobs = False
        choice.reasons["update_logprobs"] = "; ".join(plain_update) + ": the update pass takes grpo.algorithm.logprobs"
    from grpo.kernels.packing import packs_without_dense_mask

    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if packs_without_dense_mask(attention):
        choice.packed_logprobs = True
    else:
        choice.reasons["packed_logprobs"] = (f"attention implementation {attention!r} would take a packed row's dense "
                                             "block-diagonal mask; padded micro-batches of similar lengths run instead "
                                             "(flash attention and flex attention pack)")
    unshared = _holding(
        (not choice.fast_logprobs, "the log-prob kernels are off"),
        (choice.packed_logprobs, "the passes run packed rows (no padding) instead"),
        (sharded, "under FSDP2 each layer's parameters would be gathered twice a micro-batch"),
        (gradient_checkpointing, "gradient checkpointing turns the trunk's KV cache off in training mode (transformers "
                                 "before 5.2x: also without grad)"),
    )
    choice.shared_prompt_passes = not unshared
    if unshared:
        choice.reasons["shared_prompt_passes"] = "; ".join(unshared)
    unshared_update = unshared + _holding(
        (not (choice.fused_loss or choice.update_logprobs), "the update pass takes grpo.algorithm.logprobs"),
    )
    choice.shared_prompt_update = not unshared_update
    if unshared_update:
        choice.reasons["shared_prompt_update"] = "; ".join(unshared_update)
    from grpo.kernels.lean_decode import unsupported_reason

    trunk = None if model is None else getattr(model, model.base_model_prefix, model)
    trunk_reason = "no model to check" if trunk is None else unsupported_reason(trunk)
    padded_only = _holding(
        (not (choice.shared_prompt_passes or choice.shared_prompt_update), "no shared-prompt pass runs"),
        (trunk_reason is not None, f"{trunk_reason}: its layers run only through the model's own forward"),
    )
    choice.unpadded_trunk = not padded_only
    if padded_only:
        choice.reasons["unpadded_trunk"] = "; ".join(padded_only)
    if device.type == "cuda":
        choice.compile_decode = True
    else:
        choice.reasons["compile_decode"] = "CUDA graphs pay on CUDA only; CPU decoding stays eager"
        if model is not None:
            reason = unsupported_reason(trunk)
            if reason is not None:
                choice.reasons["lean_decode"] = reason
    return choice
