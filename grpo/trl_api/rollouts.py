"""trl's order of the data and its `rollout_func`, on our loop.

trl 1.16 reads the data in an order of its own, and a drop-in that gives trl's numbers must read it the same way:

- **prompts** (trl's RepeatSampler): each epoch one permutation of the dataset from a generator seeded by
  `args.seed`, the next permutation from the same generator each epoch, cut into chunks of one generation's
  prompts; an incomplete last chunk is dropped.
- **rows** (trl's `_prepare_inputs`): each generation's completions shuffled once by `torch.randperm` on the
  global generator, which transformers seeds from `args.seed`; the DataLoader draws one number from it when an
  epoch starts, and the evaluation's DataLoader one at each evaluation. The same order serves every iteration
  (num_iterations) of that generation.

`TrlOrder` computes both from (seed, step) alone, on generators of its own, so a resumed run reads what the
first would have (grpo.core.trainer.DataOrder is where the loop takes them).

`RolloutFunction` puts trl's `rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ...}`
where our loop samples (grpo.core.trainer.Trainer.sample_rollout): the prompts each G times, the completions
taken as given (trl does not cut them at an EOS), the other keys passed to the reward functions, and `env_mask`
the tool mask, as trl.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from grpo.generation.rollout import Rollout
from rewards import score_rows

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")  # what a rollout_func must return, as trl


class TrlOrder:
    """trl's prompt and row orders (module docstring) for `dataset_size` prompts, `per_generation` a generation."""

    def __init__(self, dataset_size: int, per_generation: int, seed: int, shuffle: bool,
                 evaluates_after: Callable[[int], bool] = lambda generation: False, rank: int = 0,
                 stream_starts: list[int] | None = None):
        """`evaluates_after(g)`: whether the run evaluates after generation g's updates (trl's eval_steps); `rank`:
        this process's index, whose global generator trl seeds with seed + rank (set_seed(device_specific=True));
        `stream_starts`: an IterableDataset's rows, already in trl's order, one pass of it starting at each of these
        generations (grpo.trl_api.trainer._stream_rows)."""
        self.stream_starts = None if stream_starts is None else set(stream_starts)
        self.dataset_size, self.per_generation, self.shuffle = dataset_size, per_generation, shuffle
        self.evaluates_after = evaluates_after
        self.generations_per_epoch = dataset_size // per_generation
        if self.generations_per_epoch == 0:
            raise ValueError(f"train_dataset has {dataset_size} prompts, fewer than one generation takes "
                             f"({per_generation}: generation_batch_size / num_generations)")
        self.sampler = torch.Generator().manual_seed(seed)  # RepeatSampler's own
        self.global_rng = torch.Generator().manual_seed(seed + rank)  # the global generator after trl's set_seed
        self.epochs: list[list[int]] = []
        self.shuffles: list[torch.Tensor] = []
        self.unscheduled: dict[int, int] = {}  # generation -> evaluations outside the schedule before its shuffle

    def prompts(self, step: int) -> list[int]:
        """The prompt indices of generation `step` (every rank's)."""
        if self.stream_starts is not None:  # the rows are the stream's, in order
            return list(range(step * self.per_generation, (step + 1) * self.per_generation))
        epoch, chunk = divmod(step, self.generations_per_epoch)
        while len(self.epochs) <= epoch:
            self.epochs.append(torch.randperm(self.dataset_size, generator=self.sampler).tolist() if self.shuffle
                               else list(range(self.dataset_size)))
        return self.epochs[epoch][chunk * self.per_generation : (chunk + 1) * self.per_generation]

    def note_evaluation(self, step: int) -> None:
        """An evaluation outside the schedule (a script's evaluate(), a callback's should_evaluate) before generation
        `step`: its DataLoader's draw comes before that generation's shuffle."""
        self.unscheduled[step] = self.unscheduled.get(step, 0) + 1

    def rows(self, step: int, num_rows: int) -> torch.Tensor:
        """(N,) the order generation `step`'s rows of this rank are cut into micro-batches, every iteration."""
        while len(self.shuffles) <= step:
            generation = len(self.shuffles)
            starts = generation in self.stream_starts if self.stream_starts is not None \
                else generation % self.generations_per_epoch == 0
            draws = starts + (generation > 0 and self.evaluates_after(
                generation - 1)) + self.unscheduled.get(generation, 0)  # the epoch's and each evaluation's
            # DataLoader iterator draw their seeds
            for _ in range(draws):
                torch.empty((), dtype=torch.int64).random_(generator=self.global_rng)
            self.shuffles.append(torch.randperm(num_rows, generator=self.global_rng))
        return self.shuffles[step]


class RolloutFunction:
    """trl's `rollout_func`, sampling and scoring where our loop's sampler would (module docstring). `call(prompts)`:
    the function with its second argument, grpo.trl_api.GRPOTrainer, bound."""

    def __init__(self, call: Callable[[list], dict]):
        self.call = call

    def sample_rollout(self, generation, tokenizer, reward_specs, rows: list[dict], prompt_ids, group: int, params,
                       noise, return_logprobs: bool = False) -> tuple[Rollout, list, list]:
        """grpo.generation.rollout.sample_rollout's arguments and result; `prompt_ids` and `noise` are the loop's and
        unused: the function tokenizes and samples. A vLLM engine or server (`generation.prepare`) first gets the
        current policy's weights, as trl moves the model to vLLM before calling the function, so a function that
        samples from it (examples/server_multiturn.py) samples the policy being trained."""
        prepare = getattr(generation, "prepare", None)
        if prepare is not None:
            prepare()
        prompts = [copy.deepcopy(row["prompt"]) for row in rows for _ in range(group)]  # (N,) trl's prompt list
        output = self.call(prompts)
        missing = [key for key in ROLLOUT_KEYS if not isinstance(output, dict) or key not in output]
        if missing:
            raise ValueError(f"rollout_func must return a dict with the keys {list(ROLLOUT_KEYS)}; missing {missing}")
        completion_ids = [[int(token) for token in ids] for ids in output["completion_ids"]]
        if len(output["prompt_ids"]) != len(prompts) or len(completion_ids) != len(prompts):
            raise ValueError(f"rollout_func returned {len(output['prompt_ids'])} prompt_ids and {len(completion_ids)} "
                             f"completion_ids for {len(prompts)} prompts (each of the {len(rows)} prompts "
                             f"{group} times)")
        extra = {key: value for key, value in output.items() if key not in ROLLOUT_KEYS}
        tool_masks = extra.pop("env_mask", None)  # trl: 0 on the tokens the environment wrote
        columns = {}
        for key, values in extra.items():  # trl: a list holds a value per completion, anything else is for all
            if isinstance(values, list) and len(values) != len(prompts):
                raise ValueError(f"rollout_func's {key!r} has {len(values)} values for {len(prompts)} completions")
            columns[key] = values if isinstance(values, list) else [values] * len(prompts)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        rewards = score_rows(reward_specs, rows, texts, completion_ids, group, extra_columns=columns)  # (N, K)
        rollout = Rollout.from_token_lists([list(ids) for ids in output["prompt_ids"]], completion_ids, rewards,
                                           params.eos_token_ids, tokenizer.pad_token_id, tool_masks, cut_at_eos=False)
        if return_logprobs:  # the behaviour policy's, for the importance-sampling correction
            if output["logprobs"] is None:
                raise ValueError("rollout_func returned logprobs=None, but the importance-sampling correction needs "
                                 "the sampler's log-probs (or set vllm_importance_sampling_correction=False)")
            rollout.sampler_logprobs = torch.zeros(rollout.completion_ids.shape)  # (N, T)
            for row, values in enumerate(output["logprobs"]):
                rollout.sampler_logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return rollout, prompts, texts
