"""The GRPO training loop: one step per rollout, composed from the pure functions of grpo/.

    sample    B prompts x G completions                       grpo.generation -> grpo.sampler.sample_groups
              (k * B with steps_per_generation; more rounds with dynamic sampling, tied groups dropped)
    reward    K reward functions -> (N, K)                    rewards.score_completions
    advantage group-relative, scaled (or GDPO's per reward)   grpo.advantages
    ref/old   log-probs without grad (ref if beta != 0,       grpo.logprobs.completion_logprobs
              old if the rollout feeds more than one update)
    update    num_iterations x (shuffle N rows into micro-batches; k updates over disjoint slices, each:
              per micro-batch log-probs -> per-token loss     grpo.logprobs, grpo.loss
              -> aggregation (- entropy bonus) -> backward; clip, AdamW, LR step,
              entropy coefficient, reference sync)
    log       metrics.jsonl, samples.jsonl, console           grpo.metrics
    save      atomic checkpoint every save_steps and at the end   grpo.checkpoint

With --kernels auto some calls go to a kernel that computes the same numbers faster (grpo.kernels);
`self.kernels` says which, and each call site has the one `if` that picks it.

Notation: B prompts, G group size, N = B * G completions, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import shutil
import signal
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from tqdm import tqdm

from data import add_prompts, load_task_rows
from grpo.advantages import (decoupled_advantages, group_advantages, reward_function_stats, tied_groups,
                              weighted_rewards)
from grpo.checkpoint import (REFERENCE, SHARDED, latest_checkpoint, load_sharded_optimizer, load_trainer_state,
                             save_checkpoint, save_distributed_checkpoint)
from grpo.config import GRPOConfig
from grpo.evaluation import evaluate, make_scorer
from grpo.distributed import gathered, init_world, resolve_mode, wrap_model
from grpo.generation import make_generation_backend
from grpo.kernels import select_kernels, use_cpu_huge_pages
from grpo.kernels.batching import length_grouped, length_sorted
from grpo.kernels.buffers import Buffers
from grpo.kernels.fused_loss import fused_completion_loss
from grpo.kernels.logprobs import completion_logprobs as fast_completion_logprobs
from grpo.logprobs import check_plain_output_head, completion_logprobs
from grpo.lora import AdaptersOff, add_lora, merged_model
from grpo.loss import (EntropyControl, LossOptions, aggregate_loss, aggregation_weights, entropy_bonus,
                       high_entropy_mask, loss_statistics, per_token_loss, policy_loss_value)
from grpo.metrics import MetricsLogger
from grpo.models import (cast_head_to_fp32, disable_dropout, eos_token_ids, load_model, load_tokenizer, make_optimizer,
                         make_scheduler, resolve_device, resolve_precision)
from grpo.rollout import Rollout, encode_prompts
from grpo.sampler import RowUniforms, SamplingParams
from rewards import RewardSpec, describe_rewards, parse_reward_specs, score_rows
from rewards.shaping import overlong_penalty

logger = logging.getLogger("grpo")

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "eval", "run_config.json", "tensorboard", "wandb",
             "wandb_run_id")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps); the last good checkpoint is kept."""


def _seeded(*numbers: int) -> torch.Generator:
    """A CPU generator whose stream depends only on the numbers given (seed, step, ...)."""
    seed = 0
    for number in numbers:
        seed = (seed * 1_000_003 + number) % (2**63)
    return torch.Generator().manual_seed(seed)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's gradient norm), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _micro_batch(rollout_tensors, completion_mask, rows):
    """The rows' (n, P' + T') sequences, attention mask and (n, T') completion mask, trimmed of the columns
    that are padding in every one of these rows (left of prompts, right of completions)."""
    prompt_ids, prompt_mask, completion_ids = (tensor[rows] for tensor in rollout_tensors)
    completion_mask = completion_mask[rows]
    prompt_len = int(prompt_mask.sum(-1).max())
    completion_len = max(1, int(completion_mask.sum(-1).max()))
    completion_mask = completion_mask[:, :completion_len]  # (n, T')
    ids = torch.cat([prompt_ids[:, -prompt_len:], completion_ids[:, :completion_len]], 1)  # (n, P' + T')
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], completion_mask], 1)
    return ids, attention_mask, completion_mask


class Trainer:
    """Holds the models, optimizer, data and run folder of one GRPO run; `train()` runs it.

    `train_on_rollout(rollout)` is the update alone, for externally supplied rollouts.
    """

    def __init__(self, config: GRPOConfig, policy=None, tokenizer=None, reward_functions=None, train_rows=None, eval_rows=None):
        use_cpu_huge_pages()  # before the first large tensor (it is read once)
        self.config = config.validate()
        cfg = self.config
        # --- processes: world size one unless launched by torchrun (grpo.distributed) ---
        self.world = init_world(cfg.device, cfg.distributed_timeout, cfg.distributed)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and torch.distributed.is_initialized():
            self.device = torch.device("cuda", self.world.local_rank)
        self.precision = resolve_precision(cfg.precision, self.device)
        self._check_world()
        for note in cfg.advice():
            logger.warning(note)
        self.rewards = parse_reward_specs(reward_functions if reward_functions is not None else cfg.reward)
        if cfg.overlong_buffer_len > 0:  # DAPO's overlong shaping, a reward like the others (rewards/shaping.py)
            shaping = overlong_penalty(cfg.max_completion_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
            self.rewards = [*self.rewards, RewardSpec("overlong", shaping, 1.0)]
        self.reward_weights = torch.tensor([spec.weight for spec in self.rewards], dtype=torch.float32)
        self.run_dir = Path(cfg.output_dir)
        self.resume_from = self._find_resume_checkpoint()
        self._check_run_dir()

        # --- data: loaded and checked before any model (a bad row fails in seconds, not after loading 1 GB) ---
        source, setting = (str(self.resume_from), "--resume") if self.resume_from else (cfg.model, "--model")
        self.tokenizer = tokenizer or load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template, setting)
        self.train_rows, self.task = self._prepare_rows(train_rows, cfg.train_split, "train")
        self.train_prompt_ids, self.train_rows, _ = encode_prompts(
            self.tokenizer, self.train_rows, cfg.max_prompt_length, cfg.long_prompts, where=f"{cfg.dataset}[{cfg.train_split}]",
            chat_template_kwargs=cfg.chat_template_kwargs,
        )
        self.eval_rows = None
        if cfg.eval_steps:
            rows, eval_task = self._prepare_rows(eval_rows, cfg.eval_split, "eval")
            self.eval_rows = rows[: cfg.eval_limit]
            self.eval_scorer = make_scorer(cfg.eval_scorer, eval_task, self.rewards)

        # --- models ---
        weight_dtype = torch.bfloat16 if self.precision == "bf16-pure" else torch.float32
        if policy is not None:
            self.policy = policy.to(self.device, weight_dtype)
        elif cfg.use_peft and self.resume_from is not None:  # the base from --model, the adapter from the checkpoint
            self.policy = load_model(cfg.model, self.device, weight_dtype, cfg.trust_remote_code, self.tokenizer)
        else:
            self.policy = load_model(source, self.device, weight_dtype, cfg.trust_remote_code, self.tokenizer, setting)
        check_plain_output_head(self.policy.config)  # before any sampling, not at the first update
        if cfg.disable_dropout:  # before LoRA: the adapters' dropout is --lora-dropout's
            dropped = disable_dropout(self.policy)
            if dropped:
                logger.info("disable_dropout: %d dropout rates of the policy set to 0 (%s%s)", len(dropped),
                            ", ".join(dropped[:3]), ", ..." if len(dropped) > 3 else "")
        if cfg.cast_lm_head_to_fp32:
            cast_head_to_fp32(self.policy)
        self.peft_model = None
        if cfg.use_peft:  # LoRA (grpo.lora): the loop keeps calling the Hugging Face model, its projections adapted
            adapter = str(self.resume_from) if self.resume_from is not None else cfg.peft_adapter
            self.peft_model = add_lora(self.policy, cfg, adapter,
                                       reference_adapter=cfg.peft_adapter if cfg.beta != 0.0 else None)
            self.peft_model.peft_config["default"].base_model_name_or_path = cfg.model
            self.policy = self.peft_model.get_base_model()
            trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
            logger.info("LoRA: %d trainable parameters of %d", trainable, sum(p.numel() for p in self.policy.parameters()))
        self.ref_model = None
        if cfg.beta != 0.0 and not cfg.use_peft:  # beta = 0: no reference model at all; LoRA: adapters off
            synced = None if self.resume_from is None else self.resume_from / REFERENCE
            if synced is not None and cfg.sync_ref_model and synced.is_dir():  # the mixed reference of the run
                reference = load_model(str(synced), self.device, torch.float32, False, self.tokenizer, "--resume")
            elif self.resume_from is not None and policy is None:
                reference = load_model(cfg.model, self.device, torch.float32, cfg.trust_remote_code, self.tokenizer)
            else:
                reference = copy.deepcopy(self.policy)
            ref_dtype = torch.bfloat16 if self.precision != "fp32" else torch.float32
            self.ref_model = reference.to(self.device, ref_dtype).eval().requires_grad_(False)
            if cfg.cast_lm_head_to_fp32:
                cast_head_to_fp32(self.ref_model)
        if cfg.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.policy.config.use_cache = False
        self.policy.train()
        self.eos_token_ids = eos_token_ids(self.policy, self.tokenizer)
        # --- the models as the loop calls them: ModelCall, in DDP or FSDP2 under torchrun (grpo.distributed) ---
        self.distributed = resolve_mode(cfg.distributed, self.world)
        if cfg.use_peft and self.distributed == "fsdp":
            raise ValueError("--use-peft under FSDP2 is not supported yet: use --distributed ddp (the adapters are "
                             "small, every rank can hold them and the frozen base)")
        self.policy_call = wrap_model(self.policy, self.distributed, self.world, self.device, self.precision,
                                      cpu_offload=cfg.fsdp_cpu_offload)
        self.ref_call = None if self.ref_model is None else wrap_model(
            self.ref_model, self.distributed, self.world, self.device, self.precision, trainable=False,
            cpu_offload=cfg.fsdp_cpu_offload)
        if cfg.use_peft and cfg.beta != 0.0:  # the same weights, adapters off (or the starting adapter)
            self.ref_call = AdaptersOff(self.policy, self.peft_model)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.precision == "bf16"
                         else contextlib.nullcontext())
        # --- kernels (grpo/kernels/): chosen once, here; the call sites below ask self.kernels ---
        self.loss_options = LossOptions.from_config(cfg)
        self.entropy_control = EntropyControl.from_config(cfg)
        self.kernels = select_kernels(cfg.kernels, self.device, self.loss_options, self.policy,
                                      entropy_bonus=self.entropy_control.enabled, fp32_head=cfg.cast_lm_head_to_fp32,
                                      sharded=self.distributed == "fsdp", gradient_checkpointing=cfg.gradient_checkpointing)
        self.kernels.log_reasons()
        self.logprob_buffers = Buffers()  # the log-prob kernels' reused storage, kept for the run
        self.generation = make_generation_backend(cfg.generation_backend, self.policy, self.tokenizer.pad_token_id,
                                                  self.kernels, cfg.max_prompt_length)

        # --- optimizer and schedule: weight decay on matrices only (not on norms and biases, as HF Trainer) ---
        decay = [p for p in self.policy.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.policy.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = make_optimizer(cfg.optim, groups, cfg, self.device)
        self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * len(self.train_rows) / cfg.prompts_per_generation)
        total_updates = self.total_steps * cfg.num_iterations * cfg.updates_per_generation
        self.scheduler = make_scheduler(cfg.lr_scheduler_type, self.optimizer,
                                        math.ceil(cfg.warmup_ratio * total_updates), total_updates)
        self.sampling = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                       self.eos_token_ids)
        self.sample_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.step = 0
        self.updates = 0  # optimizer updates applied (the reference syncs count them, as trl's global_step)
        self.consecutive_bad_steps = 0
        self.skipped_updates = 0
        self._stop_signal = None
        if self.resume_from is not None:
            self._load_state(self.resume_from)

    # ------------------------------------------------------------------ set-up helpers
    def _check_world(self):
        """Every rank holds whole groups and whole micro-batches: B (of a generation) splits evenly over ranks."""
        cfg, size = self.config, self.world.size
        problems = []
        if cfg.prompts_per_generation % size:
            problems.append(f"prompts_per_step ({cfg.prompts_per_step}, x {cfg.updates_per_generation} per generation) "
                            f"must split evenly over the {size} processes: each prompt's group stays on one rank")
        elif (cfg.completions_per_generation // size) % (cfg.micro_batch_size * cfg.updates_per_generation):
            problems.append(f"each of the {size} processes holds {cfg.completions_per_generation // size} completions, "
                            f"not a multiple of micro_batch_size ({cfg.micro_batch_size}) x updates per generation "
                            f"({cfg.updates_per_generation}): lower --micro-batch-size")
        if cfg.dynamic_sampling and size > 1:
            logger.info("dynamic sampling under %d processes: each rank keeps its own informative groups", size)
        cfg.raise_problems(problems)

    @property
    def local_prompts(self) -> int:
        """Prompts this rank samples per generation."""
        return self.config.prompts_per_generation // self.world.size

    @property
    def local_micro_batches(self) -> int:
        """Micro-batches of one optimizer update on this rank."""
        return self.local_prompts * self.config.num_generations // self.config.updates_per_generation // self.config.micro_batch_size

    def _find_resume_checkpoint(self):
        if not self.config.resume:
            return None
        checkpoint = latest_checkpoint(self.config.resume)
        if checkpoint is None:
            raise ValueError(f"--resume {self.config.resume}: holds no complete checkpoint "
                             f"(looked for {Path(self.config.resume) / 'checkpoints'}/step-*/COMPLETE)")
        return checkpoint

    def _check_run_dir(self):
        existing = [name for name in RUN_FILES if (self.run_dir / name).exists()]
        if not existing or self.resume_from is not None:
            return
        if not self.config.overwrite:
            raise ValueError(f"--output-dir {self.run_dir} holds another run ({', '.join(existing)}); "
                             "pass --resume to continue it or --overwrite to replace it")
        for name in existing:
            path = self.run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    def _prepare_rows(self, rows, split, purpose) -> tuple[list[dict], str]:
        """(rows with a `prompt`, task): loaded from --dataset, or the rows given, checked for their task (data/tasks.py)."""
        cfg = self.config
        if rows is None:
            rows, task = load_task_rows(cfg.dataset, split, cfg.skip_bad_rows, cfg.system_prompt, cfg.one_shot)
        elif rows and "prompt" not in rows[0]:  # GSM8K rows given from Python get their chat prompts
            rows, task = add_prompts(rows, cfg.system_prompt, cfg.one_shot), "gsm8k"
        else:
            task = "prompt"
        if not rows:
            raise ValueError(f"{cfg.dataset}[{split}]: the {purpose} dataset is empty")
        return rows, task

    # ------------------------------------------------------------------ state
    def rng_state(self) -> dict:
        return {
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
        }

    def state_dict(self, with_optimizer: bool = True) -> dict:
        """Everything but the weights. The optimizer state is keyed by parameter names (as
        torch.distributed.checkpoint.state_dict gives it), so any world size can load it."""
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            **self.rng_state(),
            "sample_generator": self.sample_generator.get_state(),
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "skipped_updates": self.skipped_updates,
            "updates": self.updates,
            "entropy_control": self.entropy_control.state_dict(),
            "world_size": self.world.size,
        }
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(self.policy_call, self.optimizer)
        return state

    def _load_state(self, checkpoint: Path):
        state = load_trainer_state(checkpoint)
        self.step = state["step"]
        if (checkpoint / SHARDED).is_dir():  # saved under torchrun: resharded for this world
            load_sharded_optimizer(checkpoint, self.policy_call, self.optimizer)
        elif all(isinstance(key, int) for key in state["optimizer"]["state"]):  # older checkpoints
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            set_optimizer_state_dict(self.policy_call, self.optimizer, optim_state_dict=state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        rank_file = checkpoint / f"rank-{self.world.rank:05d}.pt"
        rng = torch.load(rank_file, weights_only=True) if rank_file.exists() else state
        torch.set_rng_state(rng["torch_rng"])
        if rng["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda_rng"])
        random.setstate(rng["python_rng"])
        self.sample_generator.set_state(state["sample_generator"])
        self.consecutive_bad_steps = state["consecutive_bad_steps"]
        self.skipped_updates = state["skipped_updates"]
        self.updates = state.get("updates", self.step * self.config.num_iterations * self.config.updates_per_generation)
        if "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])
        if self.config.sync_ref_model and not (checkpoint / REFERENCE).is_dir():
            logger.warning("%s holds no synced reference model (%s/): the reference restarts from --model",
                           checkpoint, REFERENCE)
        saved_world = state.get("world_size", 1)
        if saved_world != self.world.size:
            logger.info("checkpoint saved by %d process(es), resumed by %d: the optimizer state is resharded; "
                        "sampling is seeded per prompt, so the run continues as it would have", saved_world,
                        self.world.size)
        logger.info("resumed from %s at step %d", checkpoint, self.step)

    def save(self) -> Path:
        cfg = self.config
        sync = cfg.sync_ref_model  # TR-DPO's mixed reference is state
        model = self.peft_model if self.peft_model is not None else self.policy  # LoRA: the adapter, peft's format
        merged = merged_model(self.peft_model) if cfg.save_merged and self.world.is_main else None
        if self.distributed != "none":  # DDP / FSDP2 (also at one process): sharded state, gathered weights
            return save_distributed_checkpoint(
                self.run_dir, self.step, self.world, self.policy_call, self.optimizer, model, self.tokenizer,
                self.state_dict(with_optimizer=False), self.rng_state(), self.run_record(), cfg.save_total_limit,
                reference_call=self.ref_call if sync else None, merged=merged)
        return save_checkpoint(self.run_dir, self.step, model, self.tokenizer, self.state_dict(),
                               self.run_record(), cfg.save_total_limit, reference=self.ref_model if sync else None,
                               merged=merged)

    # ------------------------------------------------------------------ data order
    def batch_indices(self, step: int) -> list[int]:
        """Prompt indices of a step: a fresh seeded permutation per epoch (or the dataset's order without
        shuffle_dataset), read k * B at a time (resumable from `step`)."""
        size, count = len(self.train_rows), self.config.prompts_per_generation
        permutations = {}  # epoch -> its permutation; a step spans at most a few epochs
        indices = []
        for position in range(step * count, (step + 1) * count):
            epoch, offset = divmod(position, size)
            if epoch not in permutations:
                permutations[epoch] = (torch.randperm(size, generator=_seeded(self.config.seed, epoch))
                                       if self.config.shuffle_dataset else range(size))
            indices.append(int(permutations[epoch][offset]))
        return indices

    # ------------------------------------------------------------------ sample + reward
    def local_slice(self, indices: list[int]) -> tuple[list[int], range]:
        """This rank's contiguous slice of a step's global prompt list, and the slice's positions in it."""
        size = len(indices) // self.world.size
        positions = range(self.world.rank * size, (self.world.rank + 1) * size)
        return [indices[p] for p in positions], positions

    def make_rollout(self, indices: list[int], noise_keys: list[tuple[int, ...]] | None = None) -> tuple[Rollout, list, list]:
        """Sample G completions for each prompt, decode and score them. Returns (rollout, prompts, texts).

        noise_keys: one tuple of numbers per prompt that seeds its sampling noise (grpo.sampler.RowUniforms);
        the loop uses (step, round, position in the step's global prompt list). None: the run's generator.
        """
        cfg, group = self.config, self.config.num_generations
        rows = [self.train_rows[i] for i in indices]
        noise = self.sample_generator
        if noise_keys is not None:
            noise = RowUniforms.per_prompt([_seeded(cfg.seed, 104729, *key) for key in noise_keys], group,
                                           cfg.max_completion_length)
        self.policy.eval()
        with self.autocast, gathered(self.policy_call):  # FSDP2: full weights for the whole decode loop
            sample = self.generation.generate([self.train_prompt_ids[i] for i in indices], group, self.sampling, noise)
        self.policy.train()
        completion_ids = [ids[mask].tolist() for ids, mask in
                          zip(sample.completion_ids.cpu(), sample.completion_mask.bool().cpu(), strict=True)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        rewards_per_func = score_rows(self.rewards, rows, texts, completion_ids, group)  # (N, K)
        prompts = [row["prompt"] for row in rows for _ in range(group)]
        rollout = Rollout(
            prompt_ids=sample.prompt_ids.repeat_interleave(group, 0),
            prompt_mask=sample.prompt_mask.repeat_interleave(group, 0),
            completion_ids=sample.completion_ids, completion_mask=sample.completion_mask,
            truncated=sample.truncated, rewards_per_func=rewards_per_func, sampler_logprobs=sample.logprobs,
        )
        return rollout, prompts, texts

    def _sample_round(self, step: int, round_: int, indices: list[int]):
        """make_rollout on this rank's slice of a global prompt list, seeded by (step, round, global position)."""
        local, positions = self.local_slice(indices)
        return self.make_rollout(local, [(step, round_, position) for position in positions])

    def collect_rollout(self, step: int) -> tuple[Rollout, list, list, dict]:
        """This rank's part of the step's rollout: make_rollout on its slice of the step's prompts; with dynamic
        sampling (DAPO), groups whose rewards all tie are dropped and further rounds sample other prompts until
        the rank has its share of the k * B informative groups.

        Round r > 0 draws its prompts from a permutation seeded by (seed, step, r), so a resumed run samples
        the same ones. After dynamic_sampling_max_rounds rounds, tied groups fill what is missing (their
        advantages are 0: only the KL term and the loss's normaliser see them). Returns (rollout, prompts,
        texts, metrics of the rounds).
        """
        cfg = self.config
        rollout, prompts, texts = self._sample_round(step, 0, self.batch_indices(step))
        if not cfg.dynamic_sampling:
            return rollout, prompts, texts, {}
        group, wanted = cfg.num_generations, self.local_prompts
        pool = [(rollout, prompts, texts)]
        informative, tied = [], []  # (round, group) of each group sampled so far
        rounds = 0
        while True:
            rewards = weighted_rewards(pool[rounds][0].rewards_per_func, self.reward_weights)
            for index, is_tied in enumerate(tied_groups(rewards, group).tolist()):
                (tied if is_tied else informative).append((rounds, index))
            rounds += 1
            if len(informative) >= wanted or rounds >= cfg.dynamic_sampling_max_rounds:
                break
            order = torch.randperm(len(self.train_rows), generator=_seeded(cfg.seed, 7919, step, rounds))
            pool.append(self._sample_round(step, rounds, order[: cfg.prompts_per_generation].tolist()))
        chosen = (informative + tied)[:wanted]  # informative first, in the order they were sampled
        filled = max(wanted - len(informative), 0)
        if filled:
            logger.warning("step %d: %d of %d groups are tied after %d sampling rounds; tied groups fill the step",
                           step + 1, filled, wanted, rounds)
        offsets = [0]
        for part in pool:
            offsets.append(offsets[-1] + part[0].num_rows // group)
        merged = Rollout.concat([part[0] for part in pool], self.tokenizer.pad_token_id)
        all_prompts = [p for part in pool for p in part[1]]
        all_texts = [t for part in pool for t in part[2]]
        groups = [offsets[r] + g for r, g in chosen]
        rows = [g * group + j for g in groups for j in range(group)]
        metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/dropped_groups": len(tied) - filled,
                   "dynamic_sampling/filled": filled}
        return (merged.select_groups(groups, group), [all_prompts[r] for r in rows], [all_texts[r] for r in rows],
                metrics)

    # ------------------------------------------------------------------ the update
    def _logprobs(self, call, ids, attention_mask, completion_mask, with_entropy=False, update=False):
        """(n, t) log-probs (and entropies) of the completion tokens, grpo.logprobs.completion_logprobs, run through
        `call` (a grpo.distributed.ModelCall, wrapped in DDP / FSDP2 under torchrun).

        update: the pass whose loss is differentiated (its kernel may step aside, see select_kernels)."""
        args = (ids, attention_mask, completion_mask, self.config.temperature, with_entropy,
                self.config.logprob_chunk_size)
        shared = self.kernels.shared_prompt_update if update else self.kernels.shared_prompt_passes
        with self.autocast:
            if self.kernels.update_logprobs if update else self.kernels.fast_logprobs:  # the same numbers, faster
                return call(fast_completion_logprobs, *args, buffers=self.logprob_buffers,
                            packed=self.kernels.packed_logprobs,
                            shared_prompts=shared, unpadded=shared and self.kernels.unpadded_trunk)
            return call(completion_logprobs, *args, fp32_head=self.config.cast_lm_head_to_fp32)

    @torch.no_grad()
    def _logprobs_no_grad(self, call, rollout_tensors, completion_mask) -> torch.Tensor:
        """(N, T) log-probs computed micro-batch by micro-batch, without grad (reference or old policy)."""
        out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=self.device)
        if self.kernels.length_sorted_passes:  # grpo.kernels.batching: less padding, each row's log-probs the same
            batches = length_sorted(completion_mask.sum(-1), self.config.micro_batch_size)
        else:
            batches = torch.arange(completion_mask.shape[0], device=completion_mask.device).split(self.config.micro_batch_size)
        for rows in batches:
            ids, attention_mask, cm = _micro_batch(rollout_tensors, completion_mask, rows)
            logps, _ = self._logprobs(call, ids, attention_mask, cm)
            out[rows, : cm.shape[1]] = logps
        return out

    def _micro_batch_loss(self, ids, attention_mask, cm, advantages, old_logps, ref_logps, num_micro, num_items_in_batch,
                          entropy_coef=0.0):
        """One micro-batch's aggregated loss (grad attached) and its statistics; old_logps None when on-policy.

        log-probs -> per-token loss -> aggregation (grpo.logprobs, grpo.loss), minus the entropy bonus when it is
        on. With the fused kernel the three run as one pass over the output projection that also forms the
        gradient: the same loss and gradient.
        """
        cfg, options = self.config, self.loss_options
        aggregation = dict(num_micro_batches=num_micro, max_completion_length=cfg.max_completion_length,
                           num_items_in_batch=num_items_in_batch)
        if self.kernels.fused_loss:  # grpo.kernels.fused_loss: sum(w * l), w = the aggregation's weights
            weights = aggregation_weights(cm, cfg.loss_type, **aggregation)  # (n, t)
            with self.autocast:
                loss, logps, entropy = self.policy_call(
                    fused_completion_loss, ids, attention_mask, cm, advantages, old_logps, ref_logps, weights, options,
                    cfg.temperature, cfg.logprob_chunk_size, self.logprob_buffers, packed=self.kernels.packed_logprobs,
                    shared_prompts=self.kernels.shared_prompt_update,
                    unpadded=self.kernels.shared_prompt_update and self.kernels.unpadded_trunk)
        else:
            logps, entropy = self._logprobs(self.policy_call, ids, attention_mask, cm, with_entropy=True, update=True)
            old = logps.detach() if old_logps is None else old_logps  # on-policy: rho = 1
            token_losses = per_token_loss(logps, old, advantages, cm, ref_logps, options, entropy)  # (n, t) or (n, 1)
            loss = aggregate_loss(token_losses, cm, cfg.loss_type, **aggregation)
        detached = logps.detach()
        stats = loss_statistics(detached, detached if old_logps is None else old_logps, advantages, cm, ref_logps,
                                options, entropy.detach())
        if self.entropy_control.enabled:  # loss - coef * mean entropy over the tokens the policy loss keeps
            stats.policy_loss = policy_loss_value(loss.item(), cfg.loss_type, num_micro)
            acting = cm if options.top_entropy_quantile >= 1.0 else cm * high_entropy_mask(entropy, cm, options.top_entropy_quantile)
            loss = loss - entropy_coef * entropy_bonus(entropy, acting, num_micro)
        return loss, stats

    def compute_advantages(self, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(N,) advantages and the reward statistics of (N, K) rewards, by multi_objective_aggregation."""
        cfg = self.config
        if cfg.multi_objective_aggregation == "normalize_then_sum":
            return decoupled_advantages(rewards_per_func, self.reward_weights, cfg.num_generations)
        rewards = weighted_rewards(rewards_per_func, self.reward_weights)  # (N,)
        return group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)

    def _sync_reference(self) -> None:
        """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref, every ref_model_sync_steps optimizer updates."""
        alpha = self.config.ref_model_mixup_alpha
        with torch.no_grad():  # FSDP2: both are sharded alike, each rank mixes its shards
            for ref_param, param in zip(self.ref_model.parameters(), self.policy.parameters(), strict=True):
                ref_param.mul_(1.0 - alpha).add_(param.to(ref_param.dtype), alpha=alpha)

    def _accumulating(self, last: bool):
        """DDP: no gradient all-reduce until the update's last micro-batch (the same sum, one all-reduce)."""
        if self.distributed == "ddp" and not last:
            return self.policy_call.no_sync()
        return contextlib.nullcontext()

    def train_on_rollout(self, rollout: Rollout, shuffle: bool = True) -> dict:
        """Advantages, reference/old log-probs, then num_iterations x k optimizer updates on one rollout.

        `rollout` holds this rank's rows (all of them at world size one). k = updates_per_generation: the
        rollout's micro-batches are split into k disjoint slices, one per update. Returns the step's metrics
        (over every rank). Micro-batch losses are summed into the accumulated gradient, so each update equals
        the full-slice one (grpo.loss.aggregate_loss says exactly when); DDP / FSDP2 average it over ranks.
        shuffle=False: micro-batches of consecutive rows in rollout order, never regrouped (the parity tests).
        """
        cfg, device, world = self.config, self.device, self.world
        num_rows, updates_per_rollout = rollout.num_rows, cfg.updates_per_generation
        expected = cfg.completions_per_generation // world.size
        if num_rows != expected or num_rows % cfg.num_generations:
            where = f" on each of {world.size} processes" if world.size > 1 else ""
            raise ValueError(f"a rollout needs {cfg.prompts_per_generation // world.size} prompts x num_generations = "
                             f"{expected} rows{where} grouped by {cfg.num_generations}, got {num_rows}")
        prompt_ids, prompt_mask = rollout.prompt_ids.to(device), rollout.prompt_mask.to(device)
        completion_ids = rollout.completion_ids.to(device)
        completion_mask = rollout.completion_mask.to(device)
        truncated = rollout.truncated.to(device)

        # --- advantages (DeepSeekMath 4.1.2): group-relative, scaled; over every rank's rows, as one process ---
        all_rewards = world.gather_rows(rollout.rewards_per_func)  # (N_all, K)
        all_advantages, reward_stats = self.compute_advantages(all_rewards)
        advantages = all_advantages[world.rank * num_rows : (world.rank + 1) * num_rows].to(device)  # (N,)
        if cfg.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated)[:, None]  # drops them from attention and loss, as trl
        # dapo / cispo / vespo divide by the real tokens of one update over all ranks (the rollout's / k, as trl),
        # / world size because DDP and FSDP2 average the ranks' gradients
        step_tokens = world.sum(completion_mask.sum().item())
        num_items_in_batch = step_tokens / updates_per_rollout / world.size
        tensors = (prompt_ids, prompt_mask, completion_ids)

        # --- reference and old log-probs, without grad ---
        started = time.perf_counter()
        ref_logps = self._logprobs_no_grad(self.ref_call, tensors, completion_mask) if cfg.beta != 0.0 else None
        off_policy = cfg.num_iterations * updates_per_rollout > 1  # some update runs after the policy moved
        old_logps = self._logprobs_no_grad(self.policy_call, tensors, completion_mask) if off_policy else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        reference_time = time.perf_counter() - started

        # --- num_iterations x k x (micro-batches -> loss -> backward; clip; AdamW; LR; entropy; reference) ---
        micro_stats, step_losses, grad_norms, micro_batch_losses, entropy_coefs = [], [], [], [], []
        num_micro = self.local_micro_batches
        for iteration in range(cfg.num_iterations):
            order = (torch.randperm(num_rows, generator=_seeded(cfg.seed, self.step, iteration, world.rank))
                     if shuffle else torch.arange(num_rows))
            if shuffle and self.kernels.length_grouping:  # grpo.kernels.batching: each update's rows, less padding
                micro_batches = length_grouped(order, completion_mask.sum(-1).cpu(), cfg.micro_batch_size,
                                               updates_per_rollout)
            else:
                micro_batches = order.split(cfg.micro_batch_size)  # k * num_micro of them
            for update in range(updates_per_rollout):
                step_loss, finite, update_stats = 0.0, True, []
                coef = self.entropy_control.applied()  # the same for every micro-batch of this update
                batches = micro_batches[update * num_micro : (update + 1) * num_micro]
                for index, rows in enumerate(batches):
                    rows = rows.to(device)
                    ids, attention_mask, cm = _micro_batch(tensors, completion_mask, rows)
                    ref = None if ref_logps is None else ref_logps[rows, : cm.shape[1]]
                    old = None if old_logps is None else old_logps[rows, : cm.shape[1]]
                    with self._accumulating(last=index == len(batches) - 1):
                        loss, stats = self._micro_batch_loss(ids, attention_mask, cm, advantages[rows], old, ref,
                                                             num_micro, num_items_in_batch, coef)
                        finite = finite and bool(torch.isfinite(loss))
                        loss.backward()  # also when not finite: every rank takes part in each gradient sync
                    step_loss += loss.item()
                    micro_batch_losses.append(loss.item())
                    update_stats.append(stats)
                finite = not world.any(not finite)  # a non-finite loss on any rank skips the update everywhere
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                grad_norm = _full(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)).item()
                if not finite or not math.isfinite(grad_norm):
                    self._skip_update(grad_norm if finite else float("nan"))
                else:
                    self.optimizer.step()
                    self.scheduler.step()
                    self.updates += 1
                    self.generation.after_update()  # a backend with its own copy of the weights refreshes it
                    self.consecutive_bad_steps = 0
                    if cfg.sync_ref_model and self.updates % cfg.ref_model_sync_steps == 0:
                        self._sync_reference()
                    if self.entropy_control.adaptive:  # the update's entropy over every rank's tokens
                        self.entropy_control.update(world.sum(sum(s.entropy_sum for s in update_stats)),
                                                    world.sum(sum(s.entropy_count for s in update_stats)))
                if self.entropy_control.enabled:
                    entropy_coefs.append(self.entropy_control.coef)
                # Kept allocated: the vocabulary-sized gradients are then added into .grad in place each
                # micro-batch (grpo.logprobs reuses its own buffers) instead of being copied into new tensors.
                self.optimizer.zero_grad(set_to_none=False)
                step_losses.append(world.sum(step_loss) / world.size)  # the loss whose gradient was applied
                grad_norms.append(grad_norm)
                micro_stats += update_stats

        # --- metrics, with trl's names, over every rank ---
        lengths = world.gather_rows(completion_mask.sum(-1).float())  # after mask_truncated_completions
        raw_lengths = world.gather_rows(rollout.completion_mask.sum(-1).float().to(device))
        names = [spec.name for spec in self.rewards]

        def mean_of(name):
            """Over the step's tokens (or rows) on every rank, whatever the micro-batches held."""
            pairs = [(getattr(s, name), s.weights()[name]) for s in micro_stats if getattr(s, name) is not None]
            total = world.sum(sum(value * weight for value, weight in pairs))
            count = world.sum(sum(weight for _, weight in pairs))
            return total / count if count > 0 else None

        metrics = {
            **reward_stats,
            **reward_function_stats(all_rewards, names),
            "advantages/abs_mean": all_advantages.abs().mean().item(),
            "loss": sum(step_losses) / len(step_losses),
            "grad_norm": grad_norms[-1],
            "learning_rate": self.scheduler.get_last_lr()[0],
            "entropy": mean_of("entropy"),
            "clip_ratio/low_mean": mean_of("clip_low"),
            "clip_ratio/high_mean": mean_of("clip_high"),
            "clip_ratio/region_mean": mean_of("clip_region"),
            "cispo_clip_ratio": mean_of("cispo_clip"),
            "vespo/phi_seq_mean": mean_of("vespo_phi"),
            "policy_loss": mean_of("policy_loss"),
            "entropy_coef": entropy_coefs[-1] if entropy_coefs else None,
            "completions/mean_length": raw_lengths.mean().item(),
            "completions/min_length": raw_lengths.min().item(),
            "completions/max_length": raw_lengths.max().item(),
            "completions/clipped_ratio": world.gather_rows(rollout.truncated.float().to(device)).mean().item(),
            "num_tokens": int(lengths.sum().item()),
            "skipped_updates": self.skipped_updates,
            "reference_time": reference_time,
        }
        if cfg.beta != 0.0:
            metrics["kl"] = mean_of("kl")
        metrics = {key: value for key, value in metrics.items() if value is not None}  # what this loss type logs
        # The step's intermediate values, kept for inspection (the trl parity tests read them).
        self.last_step = {"advantages": advantages, "ref_logps": ref_logps, "old_logps": old_logps,
                          "micro_batch_losses": micro_batch_losses, "micro_batch_stats": micro_stats,
                          "entropy_coefs": entropy_coefs, "num_items_in_batch": num_items_in_batch * world.size}
        return metrics

    def _skip_update(self, grad_norm: float):
        self.consecutive_bad_steps += 1
        self.skipped_updates += 1
        logger.warning("step %d: non-finite loss or gradient (grad_norm=%s): update skipped (%d in a row, limit %d)",
                       self.step + 1, grad_norm, self.consecutive_bad_steps, self.config.max_bad_steps)
        if self.consecutive_bad_steps >= self.config.max_bad_steps:
            last = latest_checkpoint(self.run_dir)
            raise TrainingError(
                f"{self.consecutive_bad_steps} consecutive steps had a non-finite loss or gradient; stopping. "
                f"The last good checkpoint is {last or 'none (no checkpoint was saved yet)'}. Lower the learning "
                "rate, check the reward functions, or use --precision fp32."
            )

    # ------------------------------------------------------------------ evaluation
    def run_eval(self) -> dict:
        """Greedy completions of the held-out slice, scored; every rank evaluates it (FSDP2 gathers the weights
        for it), rank 0 writes the files."""
        cfg = self.config
        with gathered(self.policy_call):
            records, summary = evaluate(self.policy, self.tokenizer, self.eval_rows, self.eos_token_ids,
                                        cfg.max_prompt_length, cfg.eval_max_completion_length or cfg.max_completion_length,
                                        cfg.eval_batch_size, autocast=self.autocast, scorer=self.eval_scorer,
                                        backend=self.generation, progress=self.world.is_main,
                                        chat_template_kwargs=cfg.chat_template_kwargs)
        if self.world.is_main:
            folder = self.run_dir / "eval"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"step-{self.step:06d}.json").write_text(json.dumps(summary, indent=2))
            with (folder / f"step-{self.step:06d}.samples.jsonl").open("w") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in records)
        return {f"eval/{key}": value for key, value in summary.items()}

    # ------------------------------------------------------------------ the loop
    def run_record(self) -> dict:
        """The settings and what actually ran: the reward functions (also those passed from Python), the task,
        the kernels and the generation backend."""
        kernels = {name: value for name, value in vars(self.kernels).items() if name != "reasons"}
        return {**self.config.to_dict(), "reward_functions": describe_rewards(self.rewards), "task": self.task,
                "kernels_used": kernels, "kernels_off": self.kernels.reasons,
                "generation": type(self.generation).__name__, "world_size": self.world.size,
                "distributed_mode": self.distributed}

    def _request_stop(self, signum, frame):
        if self._stop_signal is not None:  # a second signal: abandon the step now
            raise KeyboardInterrupt
        self._stop_signal = signal.Signals(signum).name
        tqdm.write(f"{self._stop_signal} received: finishing step {self.step + 1}, then saving a checkpoint "
                   "(send it again to stop at once)")

    def train(self, until_step: int | None = None) -> dict:
        """Run until max_steps (or `until_step`, saving there: training in pieces).

        Returns {"status": "finished" | "paused" | "interrupted", "step", "first_reward", "last_reward", "signal"}.
        """
        cfg, main = self.config, self.world.is_main
        stop_at = min(until_step or self.total_steps, self.total_steps)
        if main:  # rank 0 writes the run's files; every rank trains
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "run_config.json").write_text(json.dumps(self.run_record(), indent=2))
        metrics_logger = (MetricsLogger(self.run_dir, cfg.report_to, resume_step=self.step if self.resume_from else None,
                                        config=self.run_record()) if main else None)
        handlers = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        first_reward = last_reward = None
        bar = tqdm(total=self.total_steps, initial=self.step, desc="GRPO", dynamic_ncols=True, disable=not main)
        stopping = False
        try:
            while self.step < stop_at and not stopping:
                started = time.perf_counter()
                # sample -> reward
                rollout, prompts, texts, sampling_metrics = self.collect_rollout(self.step)
                sampled = time.perf_counter()
                # advantage -> reference/old log-probs -> loss and update
                metrics = {**self.train_on_rollout(rollout), **sampling_metrics}
                self.step += 1
                elapsed = time.perf_counter() - started
                metrics.update({"step_time": elapsed, "sample_time": sampled - started,
                                "tokens_per_second": self.world.sum(rollout.completion_mask.sum().item())
                                / max(sampled - started, 1e-9)})
                first_reward = metrics["reward"] if first_reward is None else first_reward
                last_reward = metrics["reward"]
                # evaluate -> log -> checkpoint
                if cfg.eval_steps and (self.step % cfg.eval_steps == 0 or self.step == self.total_steps):
                    metrics.update(self.run_eval())
                console = self.step % cfg.logging_steps == 0 or self.step == self.total_steps
                if main:
                    metrics_logger.log(self.step, metrics, console=console)
                    if cfg.log_completions_steps and self.step % cfg.log_completions_steps == 0:
                        metrics_logger.log_samples(self.step, self._samples(prompts, texts, rollout))
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics.get('kl') or 0:.4f}",
                                len=f"{metrics['completions/mean_length']:.0f}")
                stopping = self.world.any(self._stop_signal is not None)  # every rank stops after the same step
                if stopping and self._stop_signal is None:
                    self._stop_signal = "a signal to another rank"
                if (cfg.save_steps and self.step % cfg.save_steps == 0) or self.step == stop_at or stopping:
                    self.save()
        finally:
            bar.close()
            if metrics_logger is not None:
                metrics_logger.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        status = "finished" if self.step >= self.total_steps else "interrupted" if self._stop_signal else "paused"
        if status == "interrupted" and main:
            tqdm.write(f"stopped by {self._stop_signal} after step {self.step}; checkpoint saved. "
                       f"Resume with: python train.py --resume {self.run_dir} (and the same settings)")
        return {"status": status, "step": self.step, "first_reward": first_reward, "last_reward": last_reward,
                "signal": self._stop_signal}

    def _samples(self, prompts, texts, rollout) -> list[dict]:
        """The first group of the step: its prompt, each completion and its rewards."""
        group = self.config.num_generations
        question = prompts[0][-1]["content"] if isinstance(prompts[0], list) else str(prompts[0])
        names = [spec.name for spec in self.rewards]
        return [{"prompt": question, "completion": texts[row],
                 "rewards": {name: (None if math.isnan(v) else v) for name, v in zip(names, rollout.rewards_per_func[row].tolist(), strict=True)}}
                for row in range(group)]


__all__ = ["Trainer", "TrainingError", "Rollout"]
