"""Same result as `grpo.algorithm.sampler.sample_groups` (the same tokens from the same generator), faster: the
tuned group sampler. Chosen by `--kernels auto` (grpo.kernels.select) through `FastSampler`, which owns
its buffers and its static decoder. Pinned to the plain sampler by tests/test_kernels.py (same tokens,
log-probs and logits for the same seed) and to softmax sampling by tests/test_sampler.py.

What it does beyond the plain loop (docs/design.md has the why of each):
- CPU decode head: the output projection is W h^T written into one reused (V, N) buffer (for a few rows
  BLAS computes that orientation faster, and a fresh (N, V) tensor per token costs page faults); the
  prefill projects the B prompts only.
- Shifted base-2 sampling (CPU, fp32, no filters): the projection itself writes y = z log2(e) / T - c, c
  from the previous token's log-normaliser, so a step is one exp2 pass, block sums and a two-level
  inverse-CDF search; rows whose sum leaves a safe range are redone with their max (`_sample_base2`).
- Reserved KV room: each layer's cache has room for the whole completion, so a step writes its position
  in place instead of concatenating (`_ReservedLayer`).
- The lean CPU decode step of Qwen2/Qwen3/Llama trunks (grpo.kernels.lean_decode) and, on CUDA, the static
  cache + compiled decode step (grpo.kernels.compiled_decode).
- On CPU it runs in inference mode (autograd bookkeeping skipped; results are copied out).
- Compaction (eager decoding): finished rows leave the KV cache, the masks and the buffers once they are an
  eighth of the rows still decoding, so decode work follows the real tokens rather than the longest row. The
  static cache and compiled step (CUDA) keep their fixed shapes and decode every row to the end.

Notation: B prompts, G group size, N = B * G rows, P prompt tokens, T completion tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.kernels.buffers import Buffers
from grpo.kernels.compiled_decode import StaticDecoder
from grpo.kernels.lean_decode import LeanDecodeStep, unsupported_reason
from grpo.kernels.logprobs import _LN_2, _LOG2_E, _column_storage
from grpo.algorithm.logprobs import check_plain_output_head, logit_divisor, position_ids_from_mask
from grpo.algorithm.sampler import (GroupSample, SamplingParams, cache_kwarg, draw_uniform, ends_row, filter_logits,
                                    filters_apply, finish_sample, prepare_prompts, token_logprobs)

logger = logging.getLogger("grpo")


class _DecodeHead:
    """The decode step's logits: the trunk, then the output projection into one reused buffer.

    On CPU a fresh (N, V) logits tensor per token is page-faulted in every step (10 MB at N = 16 and
    Qwen's vocabulary), which costs about as much as the product itself; writing into one buffer
    (the sampler's `Buffers`, kept between calls) avoids it. `transposed`: the buffer is (V, N), W h^T,
    and the logits are its (N, V) transposed view: for a few rows the BLAS product in that orientation
    is faster than h W^T (docs/log.md).
    Models whose logits are not plain W h (soft-capping, scaling, a bias), other devices and mixed
    dtypes use the model's own forward.
    """

    def __init__(self, model, cache_kwarg: str, buffers: Buffers, transposed: bool = False):
        self.model, self.cache_kwarg, self.buffers, self.transposed = model, cache_kwarg, buffers, transposed
        head = model.get_output_embeddings()
        self.trunk = getattr(model, model.base_model_prefix, None)
        self.weight = getattr(head, "weight", None)
        try:
            check_plain_output_head(model.config)
            plain = getattr(head, "bias", None) is None and self.weight is not None
        except NotImplementedError:
            plain = False
        self.buffered = (plain and self.trunk is not None and self.weight.device.type == "cpu"
                         and self.weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))
        self.out = None

    def output(self, num_rows: int) -> torch.Tensor:
        """The (N, V) view of the reused buffer that the next call writes (buffered heads only)."""
        vocab = self.weight.shape[0]
        if self.transposed:
            self.out = self.buffers.get("decode_logits", vocab, num_rows, torch.float32, self.weight.device)  # (V, N)
            return self.out.T
        self.out = self.buffers.get("decode_logits", num_rows, vocab, torch.float32, self.weight.device)
        return self.out

    def expand(self, hidden: torch.Tensor, group_size: int) -> torch.Tensor:
        """(B * G, V) logits of (B, H) hidden states, each row repeated G times (the prefill's, one row per prompt),
        in the reused buffer. The product runs on the B rows (W h^T: for a few rows much faster than h W^T)."""
        shape = (self.weight.shape[0], hidden.shape[0])  # (V, B)
        logits = torch.mm(self.weight, hidden.T, out=self.buffers.get("prefill_logits", *shape, torch.float32,
                                                                      hidden.device))
        out = self.output(hidden.shape[0] * group_size)  # (N, V)
        out.view(hidden.shape[0], group_size, -1).copy_(logits.T[:, None, :])
        return out

    def __call__(self, cache, run_trunk=None, shift: torch.Tensor | None = None, scale: float = 1.0,
                 **inputs) -> torch.Tensor:
        """(N, V) fp32 logits z of each row's next token; the buffer is overwritten by the next call.
        `run_trunk(trunk, **inputs)`, if given, runs the trunk (the CPU's compiled decode step passes one).
        `shift` (N,) and `scale`, buffered heads only: returns scale * z - shift[:, None] instead, formed by the
        product itself (BLAS adds the broadcast shift as it writes: no pass of its own over the (N, V) values)."""
        if not self.buffered:
            if shift is not None or scale != 1.0:
                raise ValueError("a shift or scale needs the buffered decode head (CPU, fp32, logits = W h)")
            return self.model(**inputs, use_cache=True, **{self.cache_kwarg: cache}).logits[:, -1].float()
        inputs = {**inputs, "use_cache": True, self.cache_kwarg: cache}
        # (N, H)
        hidden = (run_trunk(self.trunk, **inputs) if run_trunk else self.trunk(**inputs)).last_hidden_state[:, -1]
        return self.project(hidden, shift, scale)

    def project(self, hidden: torch.Tensor, shift: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        """The buffered head's product for (N, H) final hidden states: (N, V) logits, as `__call__` returns."""
        out = self.output(hidden.shape[0])  # (N, V), a view of the (V, N) buffer when transposed
        if shift is None and scale != 1.0:
            hidden = hidden * scale  # (N, H)
        if shift is None and self.transposed:
            torch.mm(self.weight, hidden.T, out=self.out)  # (V, N)
        elif shift is None:
            torch.mm(hidden, self.weight.T, out=self.out)  # (N, V)
        elif self.transposed:  # (V, N) = -shift (1, N) + scale * W h^T
            torch.addmm(-shift[None, :], self.weight, hidden.T, alpha=scale, out=self.out)
        else:  # (N, V) = -shift (N, 1) + scale * h W^T
            torch.addmm(-shift[:, None], hidden, self.weight.T, alpha=scale, out=self.out)
        return out


class _ReservedLayer(DynamicLayer):
    """A filled DynamicLayer whose keys and values are views into buffers with room for `extra` more positions.

    DynamicLayer.update concatenates: every decode step copies the whole (N, heads, length, D) cache of
    every layer. Here a step writes its one
    position in place. Past the reserved room it falls back to concatenation.
    """

    def __init__(self, layer: DynamicLayer, extra: int):
        super().__init__()
        self.device, self.is_initialized = layer.keys.device, True
        length = layer.keys.shape[-2]
        self._room = []
        for source in (layer.keys, layer.values):  # (N, heads, length, D)
            room = source.new_empty(*source.shape[:-2], length + extra, source.shape[-1])
            room[..., :length, :] = source
            self._room.append(room)
        self.keys, self.values = (room[..., :length, :] for room in self._room)

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        keys_room, values_room = self._room
        if end > keys_room.shape[-2] or self.keys.data_ptr() != keys_room.data_ptr():
            return super().update(key_states, value_states, *args, **kwargs)
        keys_room[..., start:end, :] = key_states
        values_room[..., start:end, :] = value_states
        self.keys, self.values = keys_room[..., :end, :], values_room[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (the sampler's compaction), room included."""
        keys_room, values_room = self._room
        if self.keys.data_ptr() != keys_room.data_ptr():  # past the room: a plain layer now
            return super().batch_select_indices(indices)
        length = self.keys.shape[-2]
        self._room = [keys_room[indices], values_room[indices]]
        self.keys, self.values = (room[..., :length, :] for room in self._room)


def _reserve(cache: DynamicCache, extra: int) -> None:
    """Give each plain, filled DynamicLayer of `cache` room for `extra` more positions (others are left as they are)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            cache.layers[index] = _ReservedLayer(layer, extra)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as `grpo.algorithm.sampler.sample_next_token` (the same uniform per row), faster on CPU: exp2 instead
    of exp, a two-level search instead of a cumulative sum over the vocabulary, and column-layout reductions.

    `logits` may be the transposed view of a (V, N) tensor (the CPU decode head's layout).
    `out`, an fp32 tensor laid out like `logits`, is used as scratch space when given (the sampler
    reuses one per call).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    scale = _LOG2_E / logit_divisor(temperature)
    if filters_apply(top_k, top_p, min_p):
        logits, scale = filter_logits(logits / logit_divisor(temperature), top_k, top_p, min_p), _LOG2_E
    if out is not None and out.stride() != logits.stride():
        out = None
    # Unnormalised probabilities exp((z - max) / T) = 2^(z s - max s) with s = log2(e) / T: one pass, then torch's
    # exp2 (on CPU cheaper than its exp, as accurate); the division by their total moves to the uniform number.
    weights = torch.add(_row_max(logits) * -scale, logits, alpha=scale, out=out).exp2_()  # (N, V)
    if uniform is None:
        uniform = torch.rand(logits.shape[0], 1, device=logits.device, generator=generator)  # (N, 1)
    return _inverse_cdf(weights, uniform)


def _row_max(logits: torch.Tensor, slots: int = 64) -> torch.Tensor:
    """(N, V) -> (N, 1) row maxima. For the transposed view of a contiguous (V, N) tensor, torch's reduction over
    the outer dimension with N inner columns is slow; reducing (V / slots, slots * N) rows first, then the
    `slots` partial maxima per column, is much faster."""
    columns = _column_storage(logits)  # (V, N)
    if columns is None:
        return logits.amax(dim=-1, keepdim=True)
    vocab, rows = columns.shape
    body = vocab - vocab % slots
    if body == 0:
        return columns.amax(0)[:, None]
    partial = columns[:body].reshape(body // slots, slots * rows).amax(0).view(slots, rows).amax(0)  # (N,)
    if body < vocab:
        partial = torch.maximum(partial, columns[body:].amax(0))
    return partial[:, None]


def _below(limit: torch.Tensor) -> torch.Tensor:
    """The largest float below `limit`: a search key strictly under a total never lands past the last token."""
    return torch.nextafter(limit, torch.zeros_like(limit))


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Per row, the first index j with cumsum(weights)_j > u * sum(weights): token j with probability w_j / sum.

    Two levels, so no sequential cumulative sum runs over the whole vocabulary: the sums of blocks of
    `block` weights (one vectorised pass), their cumulative sum, the block the key falls in, then the
    cumulative sum inside that block only. Zero-weight tokens occupy empty intervals and are never
    chosen: keys are kept strictly below each level's total and at or above 0.
    weights (N, V) >= 0 with a positive sum per row; uniform (N, 1) in [0, 1). Returns (N,) int64.
    """
    return _draw(weights, _block_sums(weights, block), uniform, block)


def _block_sums(weights: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """(N, V) -> (N, ceil(V / block)) sums of consecutive blocks of `block` weights; the last may be partial."""
    rows, vocab = weights.shape
    full = vocab // block
    columns = _column_storage(weights)  # (V, N) or None
    if columns is not None:  # reduce the middle dimension of (nb, block, N)
        block_sums = columns[: full * block].view(full, block, rows).sum(1).T  # (N, full)
    else:
        block_sums = weights[:, : full * block].view(rows, full, block).sum(-1)  # (N, full)
    if vocab % block:
        block_sums = torch.cat([block_sums, weights[:, full * block :].sum(-1, keepdim=True)], dim=1)  # (N, nb)
    return block_sums


def _draw(weights: torch.Tensor, block_sums: torch.Tensor, uniform: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`_inverse_cdf` given the weights' block sums (N, nb) from `_block_sums`."""
    vocab = weights.shape[1]
    block_cdf = block_sums.cumsum(-1)  # (N, nb)
    key = torch.minimum(uniform * block_cdf[:, -1:], _below(block_cdf[:, -1:]))  # (N, 1)
    chosen = torch.searchsorted(block_cdf, key, right=True)  # (N, 1): first block whose cdf exceeds the key
    before = torch.where(chosen > 0, block_cdf.gather(-1, (chosen - 1).clamp(min=0)), 0.0)  # (N, 1) mass before it
    columns = chosen * block + torch.arange(block, device=weights.device)  # (N, block)
    inside = weights.gather(-1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0).cumsum(-1)
    key = torch.minimum((key - before).clamp(min=0.0), _below(inside[:, -1:]))  # (N, 1), within the block's mass
    position = torch.searchsorted(inside, key, right=True)  # (N, 1)
    return (chosen * block + position).squeeze(-1)


# The sampler's shifted steps (CPU, plain sampling): each step's base-2 logits y = z log2(e) / T - c come out of the
# projection already shifted by c, the row's previous log-normaliser less _SHIFT_MARGIN, so no pass looks for the
# max. Consecutive tokens' normalisers are close; a row whose sum of 2^y falls outside _TOTAL_RANGE (its max moved by
# more than ~60 in base 2 since the last token) is redone with its max. Inside the range the sums stay far from fp32's
# overflow, and the largest weight is at least 2^-60 / V, so only weights under ~2^-49 of it reach fp32's subnormals.
_SHIFT_MARGIN = 16.0
_TOTAL_RANGE = (2.0**-60, 2.0**110)

# Compaction: the finished rows leave the decode loop once they are at least 1 / _COMPACT_SHARE of the rows still in
# it (and at least one). Each compaction copies the KV cache of the rows that go on, so it waits for a share of them
# instead of running at every finished row; a finished row waits at most until the share is reached.
_COMPACT_SHARE = 8


def _sample_base2(y: torch.Tensor, uniform: torch.Tensor, out: torch.Tensor | None = None):
    """One token per row from p_j = 2^(y_j) / sum_k 2^(y_k), for base-2 logits y (N, V) with any per-row offset.

    Returns (tokens (N,), log2 sum_j 2^(y_j) (N,): the row's base-2 log-normaliser in y's frame). The weights 2^y
    go into `out` (laid out like y) when given. Rows whose sum is outside _TOTAL_RANGE are redone as 2^(y - max).
    """
    weights = torch.exp2(y, out=out)  # (N, V)
    sums = _block_sums(weights)  # (N, nb)
    total = sums.sum(-1)  # (N,)
    offset = None
    outside = ~((total >= _TOTAL_RANGE[0]) & (total <= _TOTAL_RANGE[1]))  # also inf and nan
    if bool(outside.any()):  # rare: a host sync on accelerators, but this path runs on CPU
        offset = torch.where(outside, _row_max(y).squeeze(-1), 0.0)  # (N,)
        weights = torch.exp2(y - offset[:, None], out=out)
        sums = _block_sums(weights)
        total = sums.sum(-1)
    tokens = _draw(weights, sums, uniform)
    log2_total = total.log2()
    return tokens, log2_total if offset is None else log2_total + offset


def _inference_mode_on_cpu(sample):
    """Run the sampler in inference mode on CPU, no_grad elsewhere, and copy inference tensors out of its result.

    In inference mode the decode loop's ~400 small operations a token skip autograd's bookkeeping (version
    counters, view tracking), a visible share of a small trunk's decode step on CPU. The tensors
    returned are copied out of it, so callers may use them with autograd. Accelerators keep no_grad: their
    decode step is compiled into CUDA graphs, where this overhead is gone.
    """

    @functools.wraps(sample)
    def run(self, model, *args, **kwargs) -> GroupSample:
        cpu = next(model.parameters()).device.type == "cpu"
        with torch.inference_mode() if cpu else torch.no_grad():
            result = sample(self, model, *args, **kwargs)
        inference = {name: value.clone() for name, value in vars(result).items()
                     if isinstance(value, torch.Tensor) and value.is_inference()}
        return dataclasses.replace(result, **inference)

    return run


class FastSampler:
    """The tuned group sampler. Holds the reused buffers of its decode steps and the static decoder of the
    last call (its cache and compiled graph), so a sampler kept for a run reuses both from step to step."""

    def __init__(self, compile_decode: bool = False, max_prompt_length: int | None = None):
        self.buffers = Buffers()
        self.decoder: StaticDecoder | None = None
        self.compile_decode, self.max_prompt_length = compile_decode, max_prompt_length

    def __call__(self, model, prompts, group_size, params, pad_token_id, generator=None,
                 return_logprobs=False) -> GroupSample:
        """`sample_groups` with this sampler's settings, called as grpo.algorithm.sampler.sample_groups is. If the
        compiled
        decode step fails, it says so once and decodes eagerly from then on."""
        try:
            return self.sample_groups(model, prompts, group_size, params, pad_token_id, generator, return_logprobs,
                                      compile_decode=self.compile_decode, max_prompt_length=self.max_prompt_length)
        except Exception as error:
            if not self.compile_decode:
                raise
            logger.warning("the compiled decode step failed (%s: %s); decoding eagerly from now on "
                           "(--kernels plain skips every kernel)", type(error).__name__, error)
            self.compile_decode = False
            return self(model, prompts, group_size, params, pad_token_id, generator, return_logprobs)

    def _static_decoder(self, model, num_rows: int, cache_len: int, compile_decode: bool) -> StaticDecoder:
        """The decoder kept from the last call if it fits this one, else a new one."""
        key = StaticDecoder.key_for(model, num_rows, cache_len, compile_decode)
        if self.decoder is None or not self.decoder.fits(model, key):
            self.decoder = StaticDecoder(model, key)
        return self.decoder

    @_inference_mode_on_cpu
    def sample_groups(
        self,
        model,
        prompts: list[list[int]],
        group_size: int,
        params: SamplingParams,
        pad_token_id: int,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
        static_cache: bool = False,
        compile_decode: bool = False,
        max_prompt_length: int | None = None,
        step_callback=None,
    ) -> GroupSample:
        """Sample `group_size` completions for each prompt (token id lists); see the module docstring.

        `max_prompt_length` fixes the static cache's length (prompt budget + completion budget), so a
        compiled decode step is captured once per run instead of once per prompt length.
        `step_callback(step, logits)`, if given, sees each step's (N, V) fp32 logits before sampling
        (tests use it to check that sharing the prefill changes no logit).
        Eager CPU decoding of the trunks `grpo.kernels.lean_decode` supports runs its LeanDecodeStep (the same hidden
        states bit for bit, fewer operations); other trunks decode through the model's own forward.
        On CPU it runs in inference mode (`_inference_mode_on_cpu`); the tensors it returns are ordinary ones.
        """
        prompt_ids, prompt_mask, num_rows = prepare_prompts(model, prompts, group_size, params, pad_token_id)  # (B, P)
        device, max_new = prompt_ids.device, params.max_completion_length

        cache, cache_name = DynamicCache(config=model.config), cache_kwarg(model)
        # (V, N) logits storage when the sampler reads it in place: unfiltered sampling (greedy argmax and the
        # filters' sorts prefer rows). return_logprobs reads it too, so turning it on changes no drawn token.
        plain_sampling = params.temperature > 0 and not filters_apply(params.top_k, params.top_p, params.min_p)
        head = _DecodeHead(model, cache_name, self.buffers, transposed=plain_sampling)
        # Shifted steps (CPU, fp32, plain sampling; see _sample_base2): `logits` holds base-2 logits y = z s - shift,
        # s = log2(e) / T, formed by the head's product; the first step's are the prefill's, scaled (shift 0).
        shifted = plain_sampling and head.buffered
        scale = _LOG2_E / logit_divisor(params.temperature) if shifted else 1.0
        shift = None  # (N,) c of the next step's logits, from the second step on

        # Prefill each distinct prompt once.
        prefill = dict(input_ids=prompt_ids, attention_mask=prompt_mask,
                       position_ids=position_ids_from_mask(prompt_mask), use_cache=True, **{cache_name: cache})
        if shifted:  # the trunk, then the head's product for the B prompts, copied to their groups' rows
            logits = head.expand(head.trunk(**prefill).last_hidden_state[:, -1] * scale, group_size)  # (N, V) y = z s
        else:
            logits = model(**prefill, logits_to_keep=1).logits[:, -1].float()  # (B, V)
            logits = logits.repeat_interleave(group_size, dim=0)  # (N, V)
        # Expand to the group: rows [prompt 0 x G, prompt 1 x G, ...].
        cache.batch_repeat_interleave(group_size)
        static = static_cache or compile_decode  # a StaticCache of fixed shapes; else the dynamic cache, with room
        if not static:
            _reserve(cache, max_new)
        attention_mask = prompt_mask.repeat_interleave(group_size, dim=0)  # (N, P)
        # Eager buffered decoding of a Qwen2/Qwen3/Llama trunk: the model's modules without transformers'
        # per-call framework.
        lean = None
        if head.buffered and not static and unsupported_reason(head.trunk) is None:
            lean = LeanDecodeStep(head.trunk, cache, attention_mask, max_new)
        positions = prompt_mask.sum(-1).repeat_interleave(group_size)[:, None]  # (N, 1) next position per row
        decoder = None
        if static:  # fixed shapes: the prompt budget (if given) + the completion budget
            cache_len = max(max_prompt_length or 0, prompt_ids.shape[1]) + max_new
            decoder = self._static_decoder(model, num_rows, cache_len, compile_decode)
            decoder.start(cache, attention_mask)
        # fp32 scratch for the sampling weights, laid out like the logits (shifted steps: reused between calls)
        scratch = self.buffers.get("decode_weights", logits.shape[1], num_rows, torch.float32,
                                   device).T if shifted else None

        eos = torch.tensor(sorted(set(params.eos_token_ids)), device=device)
        completion_ids = torch.full((num_rows, max_new), pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(num_rows, max_new, device=device) if return_logprobs else None
        done = torch.zeros(num_rows, dtype=torch.bool, device=device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=device)
        # Compaction (eager decoding): the loop runs on the n rows still decoding, `active` (n,) their indices in
        # the N rows; when enough of them have finished, they leave the cache, the masks and the buffers, so a
        # finished row costs no more decode work. The static (compiled) decoder keeps its fixed N rows.
        active = torch.arange(num_rows, device=device)  # (n,)
        live = torch.ones(num_rows, dtype=torch.bool, device=device)  # (n,) not finished yet
        for step in range(max_new):
            if step_callback is not None:  # the logits z, also in shifted steps; finished rows that left: NaN
                z = (logits if shift is None else logits + shift[:, None]) / scale
                step_callback(step, z if z.shape[0] == num_rows else
                              z.new_full((num_rows, z.shape[1]), float("nan")).index_copy_(0, active, z))
            uniform = draw_uniform(generator, num_rows, step, device) if params.temperature > 0 else None  # (N, 1)
            uniform = uniform if uniform is None or active.shape[0] == num_rows else uniform[active]  # (n, 1)
            if shifted:
                tokens, log2_total = _sample_base2(logits, uniform, out=scratch)  # log2_total (n,) in y's frame
            else:
                if scratch is None or scratch.stride() != logits.stride() or scratch.shape != logits.shape:
                    scratch = torch.empty_like(logits, dtype=torch.float32)
                tokens = sample_next_token(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                                           out=scratch, uniform=uniform)
            tokens = tokens.masked_fill(~live, pad_token_id)  # (n,) finished rows are padded
            completion_ids[active, step] = tokens
            if return_logprobs and shifted:  # log p = ln 2 (y_token - log2 sum_j 2^y_j)
                logprobs[active, step] = (logits.gather(-1, tokens[:, None]).squeeze(-1) - log2_total) * _LN_2 * live
            elif return_logprobs:
                logprobs[active, step] = token_logprobs(logits, tokens, params.temperature) * live
            hit_eos = ends_row(tokens, eos, live)  # (n,)
            lengths[active] = torch.where(hit_eos, step + 1, lengths[active])
            done[active] |= hit_eos
            live &= ~hit_eos
            remaining = int(live.sum())  # note: a CPU-GPU sync point, once per token
            if step == max_new - 1 or remaining == 0:
                break
            # The next step's shift: this step's log-normaliser (shift + log2_total) less a margin (see _SHIFT_MARGIN).
            if shifted:
                shift = (log2_total if shift is None else shift + log2_total) - _SHIFT_MARGIN  # (n,)
            if decoder is None and live.shape[0] - remaining >= max(1, live.shape[0] // _COMPACT_SHARE):
                keep = live.nonzero().squeeze(-1)  # (n',) rows of the active ones that go on
                active, live, tokens, positions = active[keep], live[keep], tokens[keep], positions[keep]
                shift = None if shift is None else shift[keep]
                attention_mask = attention_mask[keep]
                cache.batch_select_indices(keep)
                if lean is not None:
                    lean.keep_rows(keep)
                if shifted:
                    scratch = self.buffers.get("decode_weights", logits.shape[1], active.shape[0], torch.float32,
                                               device).T
            head_kwargs = {"shift": shift, "scale": scale} if shifted else {}
            if decoder is not None:
                logits = decoder(model, head, tokens[:, None], positions, step, **head_kwargs)
            elif lean is not None:
                logits = head.project(lean(tokens[:, None], positions), **head_kwargs)  # (n, V)
            else:
                # (n, P + t + 1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(active.shape[0], 1)], dim=1)
                logits = head(cache, input_ids=tokens[:, None], attention_mask=attention_mask,
                              position_ids=positions, **head_kwargs)  # (n, V)
            positions = positions + 1

        return finish_sample(prompt_ids, prompt_mask, completion_ids, lengths, done, logprobs, steps=step + 1)
