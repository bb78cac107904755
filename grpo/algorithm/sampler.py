"""Group sampling: each prompt is prefilled once, then its G completions are decoded together from a KV cache.

    prefill   B distinct prompts, left-padded (B, P), positions skip the padding   -> KV cache of B rows
    expand    the cache's rows repeated G times: [prompt 0 x G, prompt 1 x G, ...] -> N = B * G rows
    decode    one token for all N rows per step; a row that drew EOS is done (padding after it);
              the loop ends when every row is done or T = max_completion_length tokens were drawn

`model.generate` prefills every prompt G times (N rows of P tokens); sharing the prefill saves
(G - 1) / G of that work and of the prompt's KV cache writes (DeepSeekMath arXiv 2402.03300 samples
G outputs per question; nanochat's engine shares the prefill the same way).

Each next token is drawn by inverse-CDF sampling with one uniform number per row: the first token
whose cumulative probability exceeds u. Temperature 0 is greedy; top-k, top-p (nucleus) and min-p
filters apply when set. `grpo.kernels.sampling` draws the same tokens from the same uniforms, faster
(--kernels auto); this file is the definition.

Notation: B prompts, G completions per prompt, N = B * G rows, P prompt tokens, T completion tokens, V vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from grpo.algorithm.logprobs import logit_divisor, position_ids_from_mask


@dataclass
class SamplingParams:
    """How to pick each next token. Names and defaults as trl's GRPOConfig."""

    max_completion_length: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0.0 = off
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 makes the tokens already in a row less likely

    def __post_init__(self):
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class GroupSample:
    """The sampler's output. Rows are grouped: [prompt 0 x G, prompt 1 x G, ...]."""

    prompt_ids: torch.Tensor  # (B, P) left-padded with pad_token_id
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (N, T) right-padded with pad_token_id
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool: no EOS within max_completion_length
    num_generated_tokens: int  # real completion tokens (sum of completion_mask)
    logprobs: torch.Tensor | None = None  # (N, T) the chosen tokens' log-probs: softmax(penalized logits / temperature)
    tool_mask: torch.Tensor | None = None  # (N, T) with tools (grpo.multiturn.tools): 0 on the tool results fed in
    tool_calls: torch.Tensor | None = None  # (N, 3) with tools: calls made, calls failed, assistant turns
    messages: list[list[dict]] | None = None  # with tools: each row's turns as chat messages


def cache_kwarg(model) -> str:
    """transformers >= 5.x names the KV-cache argument `cache`; earlier releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def left_pad(sequences: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (B, P) ids left-padded with pad_token_id, and the (B, P) attention mask."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every prompt needs at least one token")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        ids[row, length - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
        mask[row, length - len(tokens) :] = 1
    return ids.to(device), mask.to(device)


def filters_apply(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> bool:
    """Whether these settings filter the distribution (filter_logits); without, the kernel sampler takes its
    unfiltered fast path (grpo.kernels.sampling)."""
    return bool(top_k) or top_p < 1.0 or min_p > 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside top-k, the top-p nucleus, or below min_p * max prob. (N, V) -> (N, V).

    top_p keeps the smallest set of most likely tokens whose probability reaches top_p (ties at the
    boundary broken by sort order); min_p keeps tokens with p >= min_p * p_max (arXiv 2407.01082).
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (N, V)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of strictly better tokens
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class RowUniforms:
    """Uniform numbers drawn in advance, (N, T): row n's t-th token is sampled with values[n, t].

    Drawn per prompt from the prompt's own seed (`per_prompt`), a prompt's completions do not depend on which
    other prompts share the batch, so not on how many processes split the step (grpo.parallel.distributed). The
    samplers accept one of these or a torch.Generator (one stream for the whole batch) as `generator`.
    """

    def __init__(self, values: torch.Tensor, seed: int = 0):
        self.values, self.seed = values, seed  # (N, T) fp32; seed: for backends that take one number

    @classmethod
    def per_prompt(cls, generators: list[torch.Generator], group_size: int, steps: int) -> "RowUniforms":
        """G rows of `steps` uniforms from each prompt's generator, in prompt order: (B * G, steps)."""
        values = torch.cat([torch.rand(group_size, steps, generator=g) for g in generators])
        return cls(values, seed=int(values[0, 0].item() * 2**31) if values.numel() else 0)

    def to(self, device) -> "RowUniforms":
        return RowUniforms(self.values.to(device), self.seed)


def row_seeds(noise, num_rows: int) -> list[int]:
    """A seed per completion, for what samples it outside this loop (an environment's process, vLLM's request): from
    the completion's own pre-drawn uniforms (their first and last columns), so a resumed run or another world size
    seeds each completion the same; from the generator otherwise."""
    if isinstance(noise, RowUniforms):  # fp32 uniforms have 2^24 values: two columns make 48 bits
        if noise.values.shape[0] != num_rows:
            raise ValueError(f"RowUniforms hold {noise.values.shape[0]} rows' noise for {num_rows} rows")
        return [int(last * 2**24) << 24 | int(first * 2**24) for first, last in noise.values[:, [0, -1]].tolist()]
    return torch.randint(2**48, (num_rows,), generator=noise).tolist()


def draw_uniform(source, num_rows: int, step: int, device) -> torch.Tensor:
    """(N, 1) uniforms for decode step `step`: the pre-drawn column of a RowUniforms, or fresh from a generator."""
    if isinstance(source, RowUniforms):
        if source.values.shape[0] != num_rows or source.values.shape[1] <= step:
            raise ValueError(f"RowUniforms of shape {tuple(source.values.shape)} for {num_rows} rows at step {step}")
        return source.values[:, step, None].to(device)
    return torch.rand(num_rows, 1, device=device, generator=source)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from softmax(filtered logits / temperature); (N, V) -> (N,). Exact inverse-CDF sampling.

    Draws one uniform u per row (N, 1) (or takes `uniform`) and returns the first token whose cumulative
    probability exceeds u times the total. A token of probability 0 occupies an empty interval and is never drawn.
    The kernel sampler keeps its own copy of this draw (grpo.kernels.sampling: `_inverse_cdf`, `_sample_base2`, a
    two-level search in base 2); tests/test_kernels.py and tests/test_sampler.py fail when the two draw different
    tokens from the same uniforms. Temperature (logit_divisor), filters and EOS are shared.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / logit_divisor(temperature), top_k, top_p, min_p)  # (N, V)
    # float64 sums: in fp32 a cumulative sum over 151,936 probabilities drifts by more than one token's share
    cdf = torch.softmax(logits, dim=-1).double().cumsum(dim=-1)  # (N, V)
    if uniform is None:
        uniform = torch.rand(logits.shape[0], 1, device=logits.device, generator=generator)
    uniform = uniform.double()  # (N, 1)
    total = cdf[:, -1:]  # (N, 1), 1 up to rounding
    key = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the total
    return torch.searchsorted(cdf, key, right=True).squeeze(-1)  # (N,)


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of CTRL (arXiv 1909.05858), as transformers and vLLM apply it before the temperature:
    the logit of every token already in the row (prompt or completion) divided by `penalty` where positive, multiplied
    where negative. logits (N, V), seen (N, V) bool -> (N, V)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, V) bool: which tokens each row of `ids` (N, L) holds where `mask` (N, L) is 1."""
    seen = torch.zeros(ids.shape[0], vocab_size, dtype=torch.int8, device=ids.device)
    return seen.scatter_(1, ids, mask.to(torch.int8)).bool() if ids.shape[1] else seen.bool()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N,) log-probs of `tokens` under softmax(logits / temperature), unfiltered (the log-probs training uses)."""
    scaled = logits.float() / logit_divisor(temperature)  # (N, V)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def prepare_prompts(model, prompts: list[list[int]], group_size: int, params: SamplingParams, pad_token_id: int):
    """The sampler's checked inputs: (B, P) left-padded prompt ids and mask on the model's device, and N = B * G."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not params.eos_token_ids:
        raise ValueError("SamplingParams.eos_token_ids is empty: the sampler needs at least one EOS id")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, next(model.parameters()).device)  # (B, P)
    return prompt_ids, prompt_mask, len(prompts) * group_size


@torch.no_grad()
def sample_groups(
    model,
    prompts: list[list[int]],
    group_size: int,
    params: SamplingParams,
    pad_token_id: int,
    generator: "torch.Generator | RowUniforms | None" = None,
    return_logprobs: bool = False,
    tools=None,
) -> GroupSample:
    """Sample `group_size` completions for each prompt (token id lists); see the module docstring.

    `tools` (a grpo.multiturn.tools.ToolSet): a row
    whose turn calls a tool takes the result as its next tokens, then samples on (grpo.multiturn.tools).
    """
    prompt_ids, prompt_mask, num_rows = prepare_prompts(model, prompts, group_size, params, pad_token_id)  # (B, P)
    device, max_new = prompt_ids.device, params.max_completion_length
    cache, cache_name = DynamicCache(config=model.config), cache_kwarg(model)

    # --- prefill each distinct prompt once, then expand the cache to the group ---
    logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                   use_cache=True, logits_to_keep=1, **{cache_name: cache}).logits[:, -1].float()  # (B, V)
    logits = logits.repeat_interleave(group_size, dim=0)  # (N, V)
    cache.batch_repeat_interleave(group_size)  # every layer's keys and values: (B, ...) -> (N, ...)
    attention_mask = prompt_mask.repeat_interleave(group_size, dim=0)  # (N, P)
    positions = prompt_mask.sum(-1).repeat_interleave(group_size)[:, None]  # (N, 1) next position per row

    # --- decode: one token for every row per step ---
    eos = torch.tensor(sorted(set(params.eos_token_ids)), device=device)
    completion_ids = torch.full((num_rows, max_new), pad_token_id, dtype=torch.long, device=device)  # (N, T)
    logprobs = torch.zeros(num_rows, max_new, device=device) if return_logprobs else None  # (N, T)
    done = torch.zeros(num_rows, dtype=torch.bool, device=device)  # (N,)
    lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=device)  # (N,)
    turns = tools.start(num_rows, max_new, device) if tools is not None else None
    seen = seen_tokens(prompt_ids, prompt_mask, logits.shape[-1]).repeat_interleave(group_size, 0) \
        if params.repetition_penalty != 1.0 else None  # (N, V) the tokens of each row so far
    for step in range(max_new):
        if seen is not None:  # the distribution sampled, and whose log-probs are returned
            logits = penalize_repetition(logits, seen, params.repetition_penalty)
        uniform = draw_uniform(generator, num_rows, step, device) if params.temperature > 0 else None  # (N, 1)
        tokens = sample_next_token(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                                   uniform=uniform)
        tokens = tokens.masked_fill(done, pad_token_id)  # (N,) finished rows are padded
        if turns is not None:  # a row waiting on a tool result takes its next token instead
            tokens = turns.feed(step, tokens)
        completion_ids[:, step] = tokens
        if return_logprobs:
            logprobs[:, step] = token_logprobs(logits, tokens, params.temperature) * ~done
        if seen is not None:
            seen[torch.arange(num_rows, device=device), tokens] = True
        hit_eos = ends_row(tokens, eos, ~done)
        if turns is not None:  # a turn that called a tool does not end its row
            hit_eos = turns.end_turns(step, completion_ids, hit_eos)
        lengths = torch.where(hit_eos, step + 1, lengths)
        done |= hit_eos
        if step == max_new - 1 or bool(done.all()):  # note: a CPU-GPU sync point, once per token
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(num_rows, 1)], dim=1)  # (N, P + t + 1)
        logits = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=positions,
                       use_cache=True, **{cache_name: cache}).logits[:, -1].float()  # (N, V)
        positions = positions + 1

    sample = finish_sample(prompt_ids, prompt_mask, completion_ids, lengths, done, logprobs, steps=step + 1)
    return sample if turns is None else turns.finish(sample)


def ends_row(tokens: torch.Tensor, eos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the rows the drawn tokens end, an EOS id drawn by a row still decoding (the EOS counts in the
    completion; finish_sample's mask includes it). The kernel sampler ends its rows by this rule too."""
    return torch.isin(tokens, eos) & live


def finish_sample(prompt_ids, prompt_mask, completion_ids, lengths, done, logprobs, steps: int) -> GroupSample:
    """The GroupSample of a decode loop that ran `steps` steps: (N, T_max) buffers trimmed to the longest row,
    the completion mask from each row's length (up to and including its EOS), truncated = no EOS drawn."""
    completion_mask = (torch.arange(steps, device=lengths.device)[None, :] < lengths[:, None]).long()  # (N, T)
    return GroupSample(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids[:, :steps],
                       completion_mask=completion_mask, truncated=~done,
                       num_generated_tokens=int(completion_mask.sum()),
                       logprobs=None if logprobs is None else logprobs[:, :steps])
