"""What one step trains on (`Rollout`), and turning chat prompts into token ids.

A Rollout is the seam between sampling and learning: the trainer builds one from its own sampler,
and tests or users can build one from any prompts, completions and rewards (`from_token_lists`)
and hand it to `Trainer.train_on_rollout`, skipping sampling. The trl parity suite does that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

logger = logging.getLogger("grpo")


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

    def __post_init__(self):
        num_rows = self.completion_ids.shape[0]
        assert self.prompt_ids.shape == self.prompt_mask.shape and self.prompt_ids.shape[0] == num_rows
        assert self.completion_mask.shape == self.completion_ids.shape
        assert self.truncated.shape == (num_rows,) and self.rewards_per_func.shape[0] == num_rows
        assert self.sampler_logprobs is None or self.sampler_logprobs.shape == self.completion_ids.shape

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    def select_groups(self, groups: list[int], group_size: int) -> "Rollout":
        """The rows of the given groups (group g = rows g*G .. g*G + G - 1), in that order."""
        rows = torch.tensor([g * group_size + j for g in groups for j in range(group_size)], dtype=torch.long)
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
                       self.completion_mask[rows], self.truncated[rows], self.rewards_per_func[rows],
                       None if self.sampler_logprobs is None else self.sampler_logprobs[rows])

    @classmethod
    def concat(cls, rollouts: list["Rollout"], pad_token_id: int) -> "Rollout":
        """Rows of several rollouts in order; prompts left-padded and completions right-padded to common widths."""
        prompt_len = max(r.prompt_ids.shape[1] for r in rollouts)
        completion_len = max(r.completion_ids.shape[1] for r in rollouts)

        def left(t, value):
            return torch.nn.functional.pad(t, (prompt_len - t.shape[1], 0), value=value)

        def right(t, value):
            return torch.nn.functional.pad(t, (0, completion_len - t.shape[1]), value=value)

        logprobs = None
        if all(r.sampler_logprobs is not None for r in rollouts):
            logprobs = torch.cat([right(r.sampler_logprobs, 0.0) for r in rollouts])
        return cls(torch.cat([left(r.prompt_ids, pad_token_id) for r in rollouts]),
                   torch.cat([left(r.prompt_mask, 0) for r in rollouts]),
                   torch.cat([right(r.completion_ids, pad_token_id) for r in rollouts]),
                   torch.cat([right(r.completion_mask, 0) for r in rollouts]),
                   torch.cat([r.truncated for r in rollouts]), torch.cat([r.rewards_per_func for r in rollouts]),
                   logprobs)

    @classmethod
    def from_token_lists(
        cls,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        rewards_per_func,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int,
    ) -> "Rollout":
        """Build from one prompt and one completion token list per row (N of each) and (N, K) rewards.

        The completion mask covers tokens up to and including the first EOS; a completion without
        EOS is marked truncated. Tokens after the first EOS are ignored.
        """
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(completion_ids)} completions")
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
            length = len(completion)
            for position, token in enumerate(completion):
                if token in eos:
                    length, truncated[row] = position + 1, False
                    break
            completions[row, :length] = torch.tensor(completion[:length], dtype=torch.long)
            completion_mask[row, :length] = 1
        rewards = torch.as_tensor(rewards_per_func, dtype=torch.float32)
        if rewards.dim() == 1:
            rewards = rewards[:, None]
        return cls(prompts, prompt_mask, completions, completion_mask, truncated, rewards)


def encode_prompt(tokenizer, messages: list[dict] | str, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat prompt with the assistant header appended (`add_generation_prompt`).

    A plain-string prompt (trl's "standard" format) is tokenized as it is, without a chat template.
    `chat_template_kwargs` reach the template (e.g. Qwen3's `enable_thinking`), as trl's option of that name.
    """
    if isinstance(messages, str):
        return list(tokenizer(messages, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **(chat_template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_prompts(tokenizer, rows: list[dict], max_prompt_length: int, long_prompts: str = "truncate", where: str = "dataset",
                   progress: bool = True, chat_template_kwargs: dict | None = None):
    """Token ids for each row's `prompt`; long prompts are truncated from the left or skipped (counted).

    Returns (token id lists, the rows kept, number of prompts truncated or skipped). Raises
    ValueError when nothing is left.
    """
    encoded, kept, too_long = [], [], 0
    for row in tqdm(rows, desc=f"tokenizing {where}", disable=not progress or len(rows) < 500, leave=False):
        ids = encode_prompt(tokenizer, row["prompt"], chat_template_kwargs)
        if len(ids) > max_prompt_length:
            too_long += 1
            if long_prompts == "skip":
                continue
            ids = ids[-max_prompt_length:]  # keep the end: the question and the assistant header (as trl)
        encoded.append(ids)
        kept.append(row)
    if too_long:
        action = "skipped" if long_prompts == "skip" else "truncated from the left"
        logger.warning("%s: %d of %d prompts are longer than max_prompt_length=%d and were %s",
                       where, too_long, len(rows), max_prompt_length, action)
    if not encoded:
        raise ValueError(
            f"{where}: no prompts left after filtering ({len(rows)} rows, {too_long} longer than "
            f"max_prompt_length={max_prompt_length}); raise --max-prompt-length or use --long-prompts truncate"
        )
    return encoded, kept, too_long
