"""What one step trains on (`Rollout`), and how the loop makes one (`sample_rollout`: sample, then reward).

A Rollout is the seam between sampling and learning: the trainer builds one from its own sampler,
and tests or users can build one from any prompts, completions and rewards (`from_token_lists`)
and hand it to `Trainer.train_on_rollout`, skipping sampling. The trl parity suite does that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.prompts import encode_prompt, encode_prompts  # noqa: F401 (re-exported: their earlier home)
from rewards import score_rows


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
    tool_calls: torch.Tensor | None = None  # (N, 2) per row: tool calls made, and of those failed

    def __post_init__(self):
        num_rows = self.completion_ids.shape[0]
        assert self.prompt_ids.shape == self.prompt_mask.shape and self.prompt_ids.shape[0] == num_rows
        assert self.completion_mask.shape == self.completion_ids.shape
        assert self.truncated.shape == (num_rows,) and self.rewards_per_func.shape[0] == num_rows
        for per_token in (self.sampler_logprobs, self.tool_mask):
            assert per_token is None or per_token.shape == self.completion_ids.shape

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
    ) -> "Rollout":
        """Build from one prompt and one completion token list per row (N of each) and (N, K) rewards.

        The completion mask covers tokens up to and including the first EOS; a completion without
        EOS is marked truncated. Tokens after the first EOS are ignored. `tool_masks`: one 0/1 list per
        completion, 0 on the tool-result tokens; neither an EOS inside a result nor the EOS of a turn that a
        result follows ends the completion.
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
            for position, token in enumerate(completion):
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
                   params, noise) -> tuple[Rollout, list, list]:
    """G completions for each of the B rows' prompts from the generation backend (grpo.generation), decoded and
    scored by every reward function (rewards.score_rows). Returns (rollout, prompts, texts), N = B * G rows."""
    sample = generation.generate(prompt_ids, group, params, noise)  # rows [prompt 0 x G, prompt 1 x G, ...]
    completion_ids = [ids[mask].tolist() for ids, mask in
                      zip(sample.completion_ids.cpu(), sample.completion_mask.bool().cpu(), strict=True)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    # with tools, chat completions are the turns as messages (assistant, tool, ..., assistant), as trl's
    rewards_per_func = score_rows(reward_specs, rows, texts, completion_ids, group, sample.messages)  # (N, K)
    prompts = [row["prompt"] for row in rows for _ in range(group)]
    rollout = Rollout(
        prompt_ids=sample.prompt_ids.repeat_interleave(group, 0),  # (N, P)
        prompt_mask=sample.prompt_mask.repeat_interleave(group, 0),
        completion_ids=sample.completion_ids, completion_mask=sample.completion_mask,  # (N, T)
        truncated=sample.truncated, rewards_per_func=rewards_per_func, sampler_logprobs=sample.logprobs,
        tool_mask=sample.tool_mask, tool_calls=sample.tool_calls,
    )
    return rollout, prompts, texts
