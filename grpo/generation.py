"""The generation seam: the one way the trainer and evaluation get completions.

    backend.generate(prompt_ids, num_generations, params, generator) -> GroupSample
    backend.after_update()      called after every optimizer update (a backend that keeps its own copy of
                                the weights, such as an inference server, refreshes it there)

Backends (`--generation-backend`):
    sampler        ours: grpo.sampler.sample_groups, or grpo.kernels.sampling.FastSampler with --kernels auto
                   (on CUDA with the compiled decode step; if compiling fails it says so once and decodes
                   eagerly from then on); grpo.kernels.KernelChoice.sampler() says which
    transformers   `model.generate`, for models our sampler does not support; the prompt is prefilled G
                   times, as trl does without vLLM

Both return rows grouped [prompt 0 x G, prompt 1 x G, ...], the completion mask up to and including the
first EOS, and (when asked) the sampler's per-token log-probs under softmax(logits / temperature).
Notation: B prompts, G completions per prompt, N = B * G rows, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from grpo.sampler import GroupSample, RowUniforms, SamplingParams, left_pad, sample_groups, token_logprobs

logger = logging.getLogger("grpo")

GENERATION_BACKENDS = ("sampler", "transformers")


class GenerationBackend(Protocol):
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 generator: torch.Generator | None = None, return_logprobs: bool = False) -> GroupSample: ...

    def after_update(self) -> None: ...


class GroupSampler:
    """Our group sampler (one prefill per prompt): `sample` is grpo.sampler.sample_groups, or the kernel the
    run's KernelChoice hands over (grpo.kernels.sampling.FastSampler), called the same way. With `tools`
    (grpo.tools.ToolSet) it is sample_groups, whose loop feeds tool results to the rows that call one."""

    def __init__(self, model, pad_token_id: int, sample=sample_groups, tools=None):
        self.model, self.pad_token_id, self.sample, self.tools = model, pad_token_id, sample, tools

    def generate(self, prompt_ids, num_generations, params, generator=None, return_logprobs=False) -> GroupSample:
        if self.tools is not None:
            return sample_groups(self.model, prompt_ids, num_generations, params, self.pad_token_id, generator,
                                 return_logprobs, tools=self.tools)
        return self.sample(self.model, prompt_ids, num_generations, params, self.pad_token_id, generator,
                           return_logprobs)

    def after_update(self) -> None:
        """Nothing to refresh: the sampler reads the live model."""


class TransformersGenerate:
    """`model.generate` behind the same seam: each prompt repeated G times, sampled with transformers."""

    def __init__(self, model, pad_token_id: int):
        self.model, self.pad_token_id = model, pad_token_id

    @torch.no_grad()
    def generate(self, prompt_ids, num_generations, params, generator=None, return_logprobs=False) -> GroupSample:
        device = next(self.model.parameters()).device
        prompt, prompt_mask = left_pad(prompt_ids, self.pad_token_id, device)  # (B, P)
        options = dict(do_sample=params.temperature > 0, max_new_tokens=params.max_completion_length,
                       eos_token_id=list(params.eos_token_ids), pad_token_id=self.pad_token_id,
                       output_logits=return_logprobs, return_dict_in_generate=True)
        if params.temperature > 0:
            options.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None,
                           min_p=params.min_p or None)
        # generate draws from the global RNG: seed it from `generator`, and leave the caller's state as it was.
        if isinstance(generator, RowUniforms):  # model.generate takes no per-row noise: one seed from it
            seed = generator.seed
        else:
            seed = int(torch.randint(2**62, (1,), generator=generator)) if generator is not None else None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=prompt.repeat_interleave(num_generations, 0),  # (N, P)
                                      attention_mask=prompt_mask.repeat_interleave(num_generations, 0), **options)
        completion_ids = out.sequences[:, prompt.shape[1]:]  # (N, T)
        is_eos = torch.isin(completion_ids, torch.tensor(list(params.eos_token_ids), device=device))  # (N, T)
        truncated = ~is_eos.any(-1)  # (N,)
        first_eos = torch.where(truncated, completion_ids.shape[1] - 1, is_eos.int().argmax(-1))  # (N,)
        positions = torch.arange(completion_ids.shape[1], device=device)
        completion_mask = (positions[None, :] <= first_eos[:, None]).long()  # (N, T)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.pad_token_id)
        logprobs = None
        if return_logprobs:
            logits = torch.stack(out.logits, dim=1).float()  # (N, T, V) the model's raw logits per step
            rows = [token_logprobs(logits[:, t], completion_ids[:, t], params.temperature)
                    for t in range(completion_ids.shape[1])]
            logprobs = torch.stack(rows, dim=1) * completion_mask  # (N, T)
        return GroupSample(prompt_ids=prompt, prompt_mask=prompt_mask, completion_ids=completion_ids,
                           completion_mask=completion_mask, truncated=truncated,
                           num_generated_tokens=int(completion_mask.sum()), logprobs=logprobs)

    def after_update(self) -> None:
        """Nothing to refresh: generate reads the live model."""


def make_generation_backend(name: str, model, pad_token_id: int, sample=sample_groups,
                            tools=None) -> GenerationBackend:
    """`sample`: the group sampler our backend calls (KernelChoice.sampler()); `tools`: grpo.tools.ToolSet."""
    if name == "sampler":
        return GroupSampler(model, pad_token_id, sample, tools)
    if tools is not None:
        raise ValueError(f"tools need --generation-backend sampler (the {name!r} backend cannot pause a row for a "
                         "tool result)")
    if name == "transformers":
        return TransformersGenerate(model, pad_token_id)
    raise ValueError(f"generation_backend must be one of {GENERATION_BACKENDS}, got {name!r}")
