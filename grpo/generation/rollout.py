"""What one step trains on (`Rollout`), and how the loop makes one: the step's prompts (`step_prompts`), the
generation seam (`make_generation_backend`), then `sample_rollout` (sample, then reward).

A Rollout is the seam between sampling and learning: the trainer builds one from its own sampler,
and tests or users can build one from any prompts, completions and rewards (`from_token_lists`)
and hand it to `Trainer.train_on_rollout`, skipping sampling. The trl parity suite does that.

Seeds: the loop draws its data order, sampling noise and micro-batch shuffles from `seeded` generators whose
stream depends only on the numbers given (seed, step, position, ...), so a resumed run and a run on another
world size draw the same numbers as an uninterrupted single-process one.

The generation seam, the one way the trainer and evaluation get completions:
    backend.generate(prompt_ids, num_generations, params, generator) -> GroupSample
    backend.after_update()      called after every optimizer update (a backend that keeps its own copy of
                                the weights, such as an inference server, refreshes it there)
Backends (`--generation-backend`):
    sampler        ours: grpo.algorithm.sampler.sample_groups, or grpo.kernels.sampling.FastSampler with --kernels auto
                   (on CUDA with the compiled decode step; if compiling fails it says so once and decodes
                   eagerly from then on); grpo.core.setup.step_functions says which
    transformers   `model.generate`, for models our sampler does not support; the prompt is prefilled G
                   times, as trl does without vLLM
    vllm           a vLLM engine (grpo.generation.vllm), with its own copy of the weights, loaded from the
                   policy before the first generation after an update
All return rows grouped [prompt 0 x G, prompt 1 x G, ...], the completion mask up to and including the
first EOS, and (when asked) the sampler's per-token log-probs under softmax(logits / temperature) (vLLM's: after its
top-k, top-p and min-p filters too).

Notation: B prompts, G completions per prompt, N = B * G rows, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.algorithm.sampler import (GroupSample, RowUniforms, SamplingParams, left_pad, penalize_repetition,
                                    sample_groups, seen_tokens, token_logprobs)
from rewards import score_rows

logger = logging.getLogger("grpo")



# ----------------------------------------------------------------------------- seeds and the step's prompts

def seeded(*numbers: int) -> torch.Generator:
    """A CPU generator seeded by a hash of `numbers`."""
    seed = 0
    for number in numbers:
        seed = (seed * 1_000_003 + number) % (2**63)
    return torch.Generator().manual_seed(seed)


def step_prompts(step: int, count: int, dataset_size: int, seed: int, shuffle: bool = True) -> list[int]:
    """The `count` prompt indices of a step: the dataset read in a fresh seeded permutation per epoch (its own
    order without shuffle), `count` at a time, so any step's prompts follow from (seed, step) alone."""
    first, last = step * count, (step + 1) * count  # positions in the endless stream of epochs
    epochs = range(first // dataset_size, (last - 1) // dataset_size + 1)  # a step spans at most a few epochs
    stream = torch.cat([torch.randperm(dataset_size, generator=seeded(seed, epoch)) if shuffle
                        else torch.arange(dataset_size) for epoch in epochs])  # (len(epochs) * dataset_size,)
    return stream[first - epochs[0] * dataset_size : last - epochs[0] * dataset_size].tolist()



@dataclass
class Rollout:
    """N = B * G completions grouped [prompt 0 x G, prompt 1 x G, ...], with their rewards."""

    prompt_ids: torch.Tensor  # (N, P) left-padded, the prompt of each completion
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool: no EOS within the budget
    rewards_per_func: torch.Tensor  # (N, K) fp32, NaN where a function returned None
    sampler_logprobs: torch.Tensor | None = None  # (N, T) the generation backend's log-probs, when it gives them
    tool_mask: torch.Tensor | None = None  # (N, T) 0 on tool-result tokens (trl's name); None: no tools
    tool_calls: torch.Tensor | None = None  # (N, 3) per row: tool calls made, of those failed, assistant turns
    policy_version: int | None = None  # optimizer updates the sampling weights had seen (asynchronous rollouts)

    def __post_init__(self):
        num_rows = self.completion_ids.shape[0]
        assert self.prompt_ids.shape == self.prompt_mask.shape and self.prompt_ids.shape[0] == num_rows
        assert self.completion_mask.shape == self.completion_ids.shape
        assert self.truncated.shape == (num_rows,) and self.rewards_per_func.shape[0] == num_rows
        assert all(t is None or t.shape == self.completion_ids.shape for t in (self.sampler_logprobs, self.tool_mask))

    @property
    def loss_mask(self) -> torch.Tensor:
        """(N, T) the tokens the loss, the KL and the entropy count: the model's own (tool results are not)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    @classmethod
    def from_token_lists(
        cls,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        rewards_per_func,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int,
        tool_masks: list[list[int]] | None = None,
        cut_at_eos: bool = True,
    ) -> "Rollout":
        """Build from one prompt and one completion token list per row (N of each) and (N, K) rewards.

        The completion mask covers tokens up to and including the first EOS; a completion without
        EOS is marked truncated. Tokens after the first EOS are ignored. `tool_masks`: one 0/1 list per
        completion, 0 on the tool-result tokens; neither an EOS inside a result nor the EOS of a turn that a
        result follows ends the completion. `cut_at_eos=False`: each list is the whole completion, as trl takes a
        rollout_func's (every token counts; truncated when the last token is neither EOS nor `pad_token_id`).
        """
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(completion_ids)} completions")
        if tool_masks is not None and [len(m) for m in tool_masks] != [len(c) for c in completion_ids]:
            raise ValueError("tool_masks need one 0/1 value per completion token, row by row")
        num_rows, eos = len(completion_ids), set(eos_token_ids)
        prompt_len = max(len(p) for p in prompt_ids)
        completion_len = max(1, max(len(c) for c in completion_ids))
        prompts = torch.full((num_rows, prompt_len), pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros(num_rows, prompt_len, dtype=torch.long)
        completions = torch.full((num_rows, completion_len), pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros(num_rows, completion_len, dtype=torch.long)
        truncated = torch.ones(num_rows, dtype=torch.bool)
        for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            prompts[row, prompt_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[row, prompt_len - len(prompt) :] = 1
            length, own = len(completion), [1] * len(completion) if tool_masks is None else tool_masks[row]
            if not cut_at_eos:
                truncated[row] = not completion or completion[-1] not in eos | {pad_token_id}
            for position, token in enumerate(completion if cut_at_eos else ()):
                goes_on = position + 1 < len(completion) and not own[position + 1]  # a tool result follows
                if token in eos and own[position] and not goes_on:
                    length, truncated[row] = position + 1, False
                    break
            completions[row, :length] = torch.tensor(completion[:length], dtype=torch.long)
            completion_mask[row, :length] = 1
        rewards = torch.as_tensor(rewards_per_func, dtype=torch.float32)
        if rewards.dim() == 1:
            rewards = rewards[:, None]
        tool_mask = None
        if tool_masks is not None:
            tool_mask = torch.ones(num_rows, completion_len, dtype=torch.long)
            for row, own in enumerate(tool_masks):
                tool_mask[row, : len(own)] = torch.tensor(own, dtype=torch.long)
        return cls(prompts, prompt_mask, completions, completion_mask, truncated, rewards, tool_mask=tool_mask)


def sample_rollout(generation, tokenizer, reward_specs, rows: list[dict], prompt_ids: list[list[int]], group: int,
                   params, noise, return_logprobs: bool = False) -> tuple[Rollout, list, list]:
    """G completions for each of the B rows' prompts from the generation backend (grpo.generation.rollout), decoded and
    scored by every reward function (rewards.score_rows). Returns (rollout, prompts, texts), N = B * G rows;
    return_logprobs: the rollout keeps the sampler's log-probs (the behaviour policy's, grpo.algorithm.off_policy).
    With environments, grpo.multiturn.environments.EnvironmentRollouts.sample_rollout takes the same arguments."""
    sample = generation.generate(prompt_ids, group, params, noise, return_logprobs=return_logprobs)
    return rollout_from_sample(sample, tokenizer, reward_specs, rows, group)


def rollout_from_sample(sample, tokenizer, reward_specs, rows: list[dict], group: int, prompts: list | None = None,
                        columns: dict | None = None, per_prompt: int | None = None) -> tuple[Rollout, list, list]:
    """A GroupSample's completions decoded and scored, as a Rollout; (rollout, prompts, texts). `prompts`: each
    completion's own (default its row's); `columns`: more keyword lists for the reward functions; `per_prompt`:
    completions per sampled prompt (default G; 1 where every completion had its own)."""
    completion_ids = [ids[mask].tolist() for ids, mask in
                      zip(sample.completion_ids.cpu(), sample.completion_mask.bool().cpu(), strict=True)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = prompts or [row["prompt"] for row in rows for _ in range(group)]  # rows [prompt 0 x G, ...]
    # (N, K); with tools, chat completions are the turns as messages (assistant, tool, ..., assistant), as trl's
    rewards_per_func = score_rows(reward_specs, rows, texts, completion_ids, group, sample.messages, prompts, columns)
    return Rollout(
        prompt_ids=sample.prompt_ids.repeat_interleave(per_prompt or group, 0),  # (N, P)
        prompt_mask=sample.prompt_mask.repeat_interleave(per_prompt or group, 0),
        completion_ids=sample.completion_ids, completion_mask=sample.completion_mask,  # (N, T)
        truncated=sample.truncated, rewards_per_func=rewards_per_func, sampler_logprobs=sample.logprobs,
        tool_mask=sample.tool_mask, tool_calls=sample.tool_calls), prompts, texts


# ----------------------------------------------------------------------------- the generation seam

class GenerationBackend(Protocol):
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 generator: torch.Generator | None = None, return_logprobs: bool = False) -> GroupSample: ...

    def after_update(self) -> None: ...


class GroupSampler:
    """Our group sampler (one prefill per prompt): `sample` is grpo.algorithm.sampler.sample_groups, or the kernel the
    run's KernelChoice hands over (grpo.kernels.sampling.FastSampler), called the same way. With `tools`
    (grpo.multiturn.tools.ToolSet) it is sample_groups, whose loop feeds tool results to the rows that call one."""

    def __init__(self, model, pad_token_id: int, sample=sample_groups, tools=None):
        self.model, self.pad_token_id, self.sample, self.tools = model, pad_token_id, sample, tools

    def generate(self, prompt_ids, num_generations, params, generator=None, return_logprobs=False,
                 tools=None) -> GroupSample:
        """`tools`: this call's own (an environment batch's, grpo.multiturn.environments), instead of the run's."""
        tools = tools if tools is not None else self.tools
        if tools is not None:
            return sample_groups(self.model, prompt_ids, num_generations, params, self.pad_token_id, generator,
                                 return_logprobs, tools=tools)
        return self.sample(self.model, prompt_ids, num_generations, params, self.pad_token_id, generator,
                           return_logprobs)

    def after_update(self) -> None:
        """Nothing to refresh: the sampler reads the live model."""


class TransformersGenerate:
    """`model.generate` behind the same seam: each prompt repeated G times, sampled with transformers.
    `cache_implementation`: generate's KV cache (transformers' name: static, offloaded, ...; None: its default)."""

    def __init__(self, model, pad_token_id: int, cache_implementation: str | None = None):
        self.model, self.pad_token_id, self.cache_implementation = model, pad_token_id, cache_implementation

    @torch.no_grad()
    def generate(self, prompt_ids, num_generations, params, generator=None, return_logprobs=False) -> GroupSample:
        device = next(self.model.parameters()).device
        prompt, prompt_mask = left_pad(prompt_ids, self.pad_token_id, device)  # (B, P)
        # every sampling setting given, so that none comes from the model's generation_config.json (Qwen2.5's sets
        # repetition_penalty 1.05, top_k 20, ...); compiling is off, as trl: prompt lengths change every step
        options = dict(do_sample=params.temperature > 0, max_new_tokens=params.max_completion_length,
                       eos_token_id=list(params.eos_token_ids), pad_token_id=self.pad_token_id,
                       output_logits=return_logprobs, return_dict_in_generate=True,
                       repetition_penalty=params.repetition_penalty, disable_compile=True)
        if self.cache_implementation is not None:
            options.update(cache_implementation=self.cache_implementation)
        if params.temperature > 0:
            options.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
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
            seen = seen_tokens(prompt, prompt_mask, logits.shape[-1]).repeat_interleave(num_generations, 0) \
                if params.repetition_penalty != 1.0 else None  # (N, V) each row's tokens so far
            rows = []
            for t in range(completion_ids.shape[1]):  # the distribution sampled: with the repetition penalty
                step_logits = logits[:, t]
                if seen is not None:
                    step_logits = penalize_repetition(step_logits, seen, params.repetition_penalty)
                    seen[torch.arange(seen.shape[0], device=device), completion_ids[:, t]] = True
                rows.append(token_logprobs(step_logits, completion_ids[:, t], params.temperature))
            logprobs = torch.stack(rows, dim=1) * completion_mask  # (N, T)
        return GroupSample(prompt_ids=prompt, prompt_mask=prompt_mask, completion_ids=completion_ids,
                           completion_mask=completion_mask, truncated=truncated,
                           num_generated_tokens=int(completion_mask.sum()), logprobs=logprobs)

    def after_update(self) -> None:
        """Nothing to refresh: generate reads the live model."""


def make_generation_backend(name: str, model, pad_token_id: int, sample=sample_groups,
                            tools=None, engine=None, cache_implementation: str | None = None) -> GenerationBackend:
    """`sample`: the group sampler our backend calls (grpo.core.setup.step_functions says which); `tools`:
    grpo.multiturn.tools.ToolSet, which our sampler and vLLM can feed (GRPOConfig.validate checks that); `engine`:
    vllm's backend with its placement and settings, given the model (grpo.core.setup.vllm_engine);
    `cache_implementation`: transformers' generate's (GRPOConfig.validate refuses it with the others)."""
    if name == "transformers":
        return TransformersGenerate(model, pad_token_id, cache_implementation)
    if name == "vllm":
        return engine(model, pad_token_id, tools=tools)
    return GroupSampler(model, pad_token_id, sample, tools)
