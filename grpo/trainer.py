"""The GRPO training loop: one step per rollout, composed from the pure functions of grpo/.

    sample    B prompts x G completions                         grpo.rollout.sample_rollout -> grpo.generation
              (k * B with steps_per_generation; more rounds with dynamic sampling)   grpo.dynamic_sampling
    reward    K reward functions -> (N, K)                      rewards.score_rows
    update    advantages, ref/old log-probs, num_iterations x k optimizer updates    grpo.update.train_on_rollout
              (-> grpo.advantages, grpo.logprobs, grpo.loss)
    log       metrics.jsonl, samples.jsonl, console             grpo.metrics
    save      atomic checkpoint every save_steps and at the end  grpo.run_state, grpo.checkpoint

`train()` is the loop; `__init__` sets up the run (grpo.setup) and chooses the kernels once
(grpo.kernels.select_kernels), which hand the update and the sampler the functions they call.

Notation: B prompts, G group size, N = B * G completions, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from pathlib import Path

import torch
from tqdm import tqdm

from grpo import run_state, setup
from grpo.config import GRPOConfig
from grpo.distributed import gathered, init_world, resolve_mode, wrap_model
from grpo.dynamic_sampling import keep_informative_groups
from grpo.entropy import EntropyControl
from grpo.evaluation import evaluate_run, make_scorer
from grpo.generation import make_generation_backend
from grpo.kernels import select_kernels, use_cpu_huge_pages
from grpo.logprobs import check_plain_output_head
from grpo.lora import AdaptersOff
from grpo.loss import LossOptions
from grpo.metrics import MetricsLogger, group_samples
from grpo.models import eos_token_ids, load_tokenizer, resolve_device, resolve_precision
from grpo.prompts import encode_prompts
from grpo.rollout import Rollout, sample_rollout
from grpo.sampler import RowUniforms, SamplingParams
from grpo.seeding import seeded, step_prompts
from grpo.update import TrainingError, train_on_rollout

logger = logging.getLogger("grpo")


class Trainer:
    """Holds the models, optimizer, data and run folder of one GRPO run; `train()` runs it.

    `train_on_rollout(rollout)` is the update alone, for externally supplied rollouts. `observers`: functions
    called with each update's intermediate values (grpo.update.train_on_rollout says which).
    """

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
                metrics.update({"step_time": time.perf_counter() - started, "sample_time": sampled - started,
                                "tokens_per_second": self.world.sum(rollout.completion_mask.sum().item())
                                / max(sampled - started, 1e-9)})
                first_reward = metrics["reward"] if first_reward is None else first_reward
                last_reward = metrics["reward"]
                # evaluate -> log -> checkpoint
                if cfg.eval_steps and (self.step % cfg.eval_steps == 0 or self.step == self.total_steps):
                    metrics.update(self.run_eval())
                if main:
                    metrics_logger.log(self.step, metrics,
                                       console=self.step % cfg.logging_steps == 0 or self.step == self.total_steps)
                    if cfg.log_completions_steps and self.step % cfg.log_completions_steps == 0:
                        names = [spec.name for spec in self.rewards]
                        metrics_logger.log_samples(self.step, group_samples(prompts, texts, rollout.rewards_per_func,
                                                                            names, cfg.num_generations))
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

    # ------------------------------------------------------------------ sample + reward
    def collect_rollout(self, step: int) -> tuple[Rollout, list, list, dict]:
        """This rank's part of the step's rollout: its slice of the step's prompts, sampled and scored; with
        dynamic sampling (grpo.dynamic_sampling) round r > 0 samples prompts from a permutation seeded by
        (seed, step, r), so a resumed run samples the same ones. Returns (rollout, prompts, texts, metrics)."""
        cfg = self.config
        first = self._sample_round(step, 0, self.batch_indices(step))
        if not cfg.dynamic_sampling:
            return (*first, {})

        def another_round(round_: int):
            order = torch.randperm(len(self.train_rows), generator=seeded(cfg.seed, 7919, step, round_))
            return self._sample_round(step, round_, order[: cfg.prompts_per_generation].tolist())

        return keep_informative_groups(first, another_round, self.local_prompts, cfg.num_generations,
                                       self.reward_weights, cfg.dynamic_sampling_max_rounds,
                                       self.tokenizer.pad_token_id, step)

    def _sample_round(self, step: int, round_: int, indices: list[int]):
        """make_rollout on this rank's slice of a global prompt list, seeded by (step, round, global position)."""
        local, positions = self.local_slice(indices)
        return self.make_rollout(local, [(step, round_, position) for position in positions])

    def make_rollout(self, indices: list[int], noise_keys: list[tuple[int, ...]] | None = None) -> tuple[Rollout, list, list]:
        """Sample G completions for each prompt, decode and score them. Returns (rollout, prompts, texts).

        noise_keys: one tuple of numbers per prompt that seeds its sampling noise (grpo.sampler.RowUniforms);
        the loop uses (step, round, position in the step's global prompt list). None: the run's generator.
        """
        cfg = self.config
        noise = self.sample_generator
        if noise_keys is not None:
            noise = RowUniforms.per_prompt([seeded(cfg.seed, 104729, *key) for key in noise_keys],
                                           cfg.num_generations, cfg.max_completion_length)
        self.policy.eval()
        with self.autocast, gathered(self.policy_call):  # FSDP2: full weights for the whole decode loop
            result = sample_rollout(self.generation, self.tokenizer, self.rewards, [self.train_rows[i] for i in indices],
                                    [self.train_prompt_ids[i] for i in indices], cfg.num_generations, self.sampling,
                                    noise)
        self.policy.train()
        return result

    def batch_indices(self, step: int) -> list[int]:
        """The step's k * B prompt indices (grpo.seeding.step_prompts: a seeded permutation per epoch)."""
        cfg = self.config
        return step_prompts(step, cfg.prompts_per_generation, len(self.train_rows), cfg.seed, cfg.shuffle_dataset)

    def local_slice(self, indices: list[int]) -> tuple[list[int], range]:
        """This rank's contiguous slice of a step's global prompt list, and the slice's positions in it."""
        size = len(indices) // self.world.size
        positions = range(self.world.rank * size, (self.world.rank + 1) * size)
        return [indices[p] for p in positions], positions

    # ------------------------------------------------------------------ update, evaluation, state
    def train_on_rollout(self, rollout: Rollout, shuffle: bool = True) -> dict:
        """grpo.update.train_on_rollout on this run's models and optimizer."""
        return train_on_rollout(self, rollout, shuffle)

    def run_eval(self) -> dict:
        """The held-out slice, greedy and scored (grpo.evaluation.evaluate_run); eval/* metrics."""
        return evaluate_run(self)

    def save(self) -> Path:
        return run_state.save(self)

    def state_dict(self, with_optimizer: bool = True) -> dict:
        return run_state.trainer_state(self, with_optimizer)

    def run_record(self) -> dict:
        return run_state.run_record(self)

    def _request_stop(self, signum, frame):
        if self._stop_signal is not None:  # a second signal: abandon the step now
            raise KeyboardInterrupt
        self._stop_signal = signal.Signals(signum).name
        tqdm.write(f"{self._stop_signal} received: finishing step {self.step + 1}, then saving a checkpoint "
                   "(send it again to stop at once)")

    @property
    def local_prompts(self) -> int:
        """Prompts this rank samples per generation."""
        return self.config.prompts_per_generation // self.world.size

    @property
    def local_micro_batches(self) -> int:
        """Micro-batches of one optimizer update on this rank."""
        cfg = self.config
        return self.local_prompts * cfg.num_generations // cfg.updates_per_generation // cfg.micro_batch_size

    # ------------------------------------------------------------------ set-up (grpo.setup)
    def __init__(self, config: GRPOConfig, policy=None, tokenizer=None, reward_functions=None, train_rows=None,
                 eval_rows=None, tools=None):
        use_cpu_huge_pages()  # before the first large tensor (it is read once)
        self.config = cfg = config.validate()
        self.rewards = setup.reward_specs(cfg, reward_functions)  # first: a code reward's sandbox is logged
        # --- processes: world size one unless launched by torchrun (grpo.distributed) ---
        self.world = init_world(cfg.device, cfg.distributed_timeout, cfg.distributed)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and torch.distributed.is_initialized():
            self.device = torch.device("cuda", self.world.local_rank)
        self.precision = resolve_precision(cfg.precision, self.device)
        setup.check_world(cfg, self.world)
        for note in cfg.advice():
            logger.warning(note)
        self.reward_weights = torch.tensor([spec.weight for spec in self.rewards], dtype=torch.float32)
        self.run_dir = Path(cfg.output_dir)
        self.resume_from = setup.find_resume_checkpoint(cfg)
        setup.check_run_dir(self.run_dir, cfg, self.resume_from)

        # --- data: loaded and checked before any model ---
        source, setting = (str(self.resume_from), "--resume") if self.resume_from else (cfg.model, "--model")
        self.tokenizer = tokenizer or load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template, setting)
        self.tools, self.template_kwargs = setup.tool_set(cfg, self.tokenizer, tools)  # grpo/tools.py
        self.train_rows, self.task = setup.task_rows(cfg, train_rows, cfg.train_split, "train")
        self.train_prompt_ids, self.train_rows, _ = encode_prompts(
            self.tokenizer, self.train_rows, cfg.max_prompt_length, cfg.long_prompts,
            where=f"{cfg.dataset}[{cfg.train_split}]", chat_template_kwargs=self.template_kwargs)
        self.eval_rows = None
        if cfg.eval_steps:
            rows, eval_task = setup.task_rows(cfg, eval_rows, cfg.eval_split, "eval")
            self.eval_rows = rows[: cfg.eval_limit]
            self.eval_scorer = make_scorer(cfg.eval_scorer, eval_task, self.rewards, cfg.sandbox_isolation)

        # --- models: the policy, its frozen reference, both as the loop calls them (DDP / FSDP2 under torchrun) ---
        weight_dtype = torch.bfloat16 if self.precision == "bf16-pure" else torch.float32
        self.policy, self.peft_model = setup.load_policy(cfg, self.device, weight_dtype, self.tokenizer, policy,
                                                         self.resume_from, source, setting)
        check_plain_output_head(self.policy.config)  # before any sampling, not at the first update
        self.ref_model = setup.load_reference(cfg, self.device, self.precision, self.tokenizer, self.policy,
                                              self.resume_from, policy_given=policy is not None)
        if cfg.gradient_checkpointing:
            setup.use_gradient_checkpointing(self.policy)
        self.policy.train()
        self.eos_token_ids = eos_token_ids(self.policy, self.tokenizer)
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

        # --- kernels (grpo/kernels/): chosen once, here; they hand the update and the sampler their functions ---
        self.loss_options = LossOptions.from_config(cfg)
        self.entropy_control = EntropyControl.from_config(cfg)
        self.kernels = select_kernels(cfg.kernels, self.device, self.loss_options, self.policy,
                                      entropy_bonus=self.entropy_control.enabled, fp32_head=cfg.cast_lm_head_to_fp32,
                                      sharded=self.distributed == "fsdp", gradient_checkpointing=cfg.gradient_checkpointing)
        self.kernels.log_reasons()
        if cfg.generation_backend == "sampler":  # what our sampler's kernels need of the model (model.generate: nothing)
            self.kernels.prepare_model(self.policy)
        self.step_functions = self.kernels.step_functions(self.loss_options, cfg.temperature, cfg.logprob_chunk_size,
                                                          cfg.cast_lm_head_to_fp32)
        self.generation = make_generation_backend(cfg.generation_backend, self.policy, self.tokenizer.pad_token_id,
                                                  self.kernels.sampler(cfg.max_prompt_length), self.tools)

        # --- optimizer, schedule, sampling, counters ---
        self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * len(self.train_rows) / cfg.prompts_per_generation)
        self.optimizer, self.scheduler = setup.optimizer_and_schedule(cfg, self.policy, self.device, self.total_steps)
        self.sampling = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                       self.eos_token_ids)
        self.sample_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.step = 0
        self.updates = 0  # optimizer updates applied (the reference syncs count them, as trl's global_step)
        self.consecutive_bad_steps = 0
        self.skipped_updates = 0
        self.observers = []
        self._stop_signal = None
        if self.resume_from is not None:
            run_state.restore(self, self.resume_from)


__all__ = ["Trainer", "TrainingError", "Rollout"]
