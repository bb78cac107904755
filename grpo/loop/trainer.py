"""The GRPO training loop: one step per rollout, composed from the pure functions of grpo/.

    sample    B prompts x G completions                         grpo.loop.rollout.sample_rollout -> grpo.algorithm.sampler
              (k * B with steps_per_generation; more rounds with dynamic sampling)   grpo.loop.dynamic_sampling
    reward    K reward functions -> (N, K)                      rewards.score_rows
    update    advantages, ref/old log-probs, num_iterations x k optimizer updates    grpo.loop.update.train_on_rollout
              (-> grpo.algorithm.advantages, grpo.algorithm.logprobs, grpo.algorithm.loss)
    log       metrics.jsonl, samples.jsonl, console             grpo.loop.metrics
    save      atomic checkpoint every save_steps and at the end  grpo.loop.run_state, grpo.loop.checkpoint
A full disk at any write into the run folder stops the run with DiskFullError (grpo.loop.disk_full).

`train()` is the loop and `train_step()` one step of it; `__init__` sets up the run (grpo.loop.setup), which also
chooses the log-prob, loss and sampling functions once (--kernels). The Trainer holds what the run owns; the
functions it calls take what they read as arguments: the models (grpo.loop.update.Models), the optimizer, the
step's counters (grpo.loop.update.StepState) and the world.

Notation: B prompts, G group size, N = B * G completions, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from grpo.loop import run_state, setup
from grpo.loop.async_rollouts import (BackgroundRollouts, GenerationError, ProcessRollouts, generation_loop, is_stale,
                                      split_world, steps_ahead)
from grpo.loop.checkpoint import CHECKPOINTS, latest_checkpoint, load_trainer_state
from grpo.config import GRPOConfig
from grpo.loop.disk_full import DiskFullError, writing
from grpo.loop.distributed import World, gathered, init_world, resolve_mode, wrap_model
from grpo.loop.dynamic_sampling import FIRST_ROUND, keep_informative_groups
from grpo.loop.answers import CollapseWatch, answer_metrics, prompt_key
from grpo.loop.evaluation import evaluate, gold_answer, make_scorer, sample_answer, save_evaluation, scorer_kind
from grpo.algorithm.logprobs import check_plain_output_head
from grpo.loop.lora import AdaptersOff
from grpo.algorithm.loss import EntropyControl
from grpo.loop.metrics import MetricsLogger, group_samples
from grpo.models import eos_token_ids, load_tokenizer, resolve_device, resolve_precision
from grpo.loop.prompts import encode_prompts
from grpo.loop.threads import CpuThreads
from grpo.loop.rollout import Rollout, RowUniforms, make_generation_backend, sample_rollout, seeded, step_prompts
from grpo.algorithm.sampler import SamplingParams, sample_groups
from grpo.loop.update import Models, StepState, TrainingError, UpdateResult, train_on_rollout
from grpo.plugins import PluginError
from rewards.reward_model import load_reward_models
from rewards.scoring import RewardError, check_reward_columns

logger = logging.getLogger("grpo")


class StepOutput(NamedTuple):
    """One training step: its metrics, the rollout it trained on, and the prompts and texts of its rows."""

    metrics: dict
    rollout: Rollout
    prompts: list
    texts: list[str]


class Trainer:
    """Holds the models, optimizer, data and run folder of one GRPO run; `train()` runs it.

    `update(rollout)` is the update alone, for externally supplied rollouts: it returns every intermediate
    value (grpo.loop.update.UpdateResult); `train_on_rollout(rollout)` returns its metrics.
    """

    def train(self, until_step: int | None = None) -> dict:
        """Run until max_steps (or `until_step`, saving there: training in pieces).

        Returns {"status": "finished" | "paused" | "interrupted", "step", "first_reward", "last_reward", "signal"}.
        """
        cfg, main = self.config, self.world.is_main
        stop_at = min(until_step or self.total_steps, self.total_steps)
        if self.generating:  # a generation process under torchrun: sample until the training ranks stop it
            return self._generate(stop_at)
        handlers = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        first_reward = last_reward = metrics_logger = rollouts = None
        bar = tqdm(total=self.total_steps, initial=self.step, desc="GRPO", dynamic_ncols=True, disable=not main)
        stopping = False
        try:  # every write into the run folder runs in `writing`: a full disk stops the run with one error
            if main:  # rank 0 writes the run's files; every rank trains
                with writing(self.run_dir, "run_config.json, metrics.jsonl and samples.jsonl"):
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                    (self.run_dir / "run_config.json").write_text(json.dumps(self.run_record(), indent=2))
                    metrics_logger = MetricsLogger(self.run_dir, cfg.report_to, config=self.run_record(),
                                                   resume_step=self.step if self.resume_from else None)
            rollouts = self._start_rollouts(stop_at) if cfg.max_staleness is not None else None
            while self.step < stop_at and not stopping:
                threads = self.cpu_threads.adjust()  # the cores other processes left idle (grpo/loop/threads.py)
                # sample -> reward -> advantage -> reference/old log-probs -> loss and update
                metrics, rollout, prompts, texts = self.train_step(rollouts)
                if rollouts is not None and self.step < stop_at:  # the generator samples ahead from the new weights
                    rollouts.publish(self.step, self.state.updates, self.policy)
                metrics["cpu_threads"] = threads
                # answers/*: one answer to every question warns (under dynamic sampling, round 0's: every group)
                metrics.update(self.watch_answers(*metrics.pop(FIRST_ROUND, (prompts, texts))))
                first_reward = metrics["reward"] if first_reward is None else first_reward
                last_reward = metrics["reward"]
                # evaluate -> log -> checkpoint
                if cfg.eval_steps and (self.step % cfg.eval_steps == 0 or self.step == self.total_steps):
                    metrics.update(self.run_eval())
                if main:
                    with writing(self.run_dir, f"step {self.step}'s lines of metrics.jsonl and samples.jsonl"):
                        metrics_logger.log(self.step, metrics,
                                           console=self.step % cfg.logging_steps == 0 or self.step == self.total_steps)
                        if cfg.log_completions_steps and self.step % cfg.log_completions_steps == 0:
                            names = [spec.name for spec in self.rewards]
                            metrics_logger.log_samples(self.step, group_samples(
                                prompts, texts, rollout.rewards_per_func, names, cfg.num_generations))
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics.get('kl') or 0:.4f}",
                                len=f"{metrics['completions/mean_length']:.0f}")
                stopping = self.world.any(self._stop_signal is not None)  # every rank stops after the same step
                if stopping and self._stop_signal is None:
                    self._stop_signal = "a signal to another rank"
                if (cfg.save_steps and self.step % cfg.save_steps == 0) or self.step == stop_at or stopping:
                    self.save()
        except (TrainingError, PluginError, RewardError) as error:  # a DiskFullError stays one (train.py: how to resume)
            where = "" if isinstance(error, TrainingError) else f"step {self.step + 1}: "  # a plug-in's or reward's fault
            raise (type(error) if isinstance(error, TrainingError) else TrainingError)(
                f"{where}{error} The last good checkpoint is "
                f"{latest_checkpoint(self.run_dir) or 'none (none was saved yet)'}.") from error.__cause__ or error
        finally:
            if rollouts is not None:  # rollouts sampled ahead are discarded (resume samples them again)
                rollouts.close()
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

    def train_step(self, rollouts=None) -> StepOutput:
        """One step: sample and reward this rank's rollout, then update on it; the step counter moves on.
        `rollouts`: asynchronous generation (grpo.loop.async_rollouts) sampled it ahead."""
        started = time.perf_counter()
        rollout, prompts, texts, extra = self._sampled_ahead(rollouts) if rollouts else self.collect_rollout(self.step)
        sampled = time.perf_counter()  # sample -> reward done; extra: dynamic sampling's or the staleness metrics
        metrics = {**self.train_on_rollout(rollout), **extra}  # advantage -> ... -> optimizer -> metrics
        self.state.step += 1
        tokens = self.world.sum(rollout.completion_mask.sum().item())
        metrics.update(step_time=time.perf_counter() - started, sample_time=sampled - started,
                       tokens_per_second=tokens / max(sampled - started, 1e-9))
        return StepOutput(metrics, rollout, prompts, texts)

    def watch_answers(self, prompts: list, texts: list[str]) -> dict:
        """The step's answers/* metrics over every rank's completions, and the collapse check (grpo/loop/answers.py):
        each completion's answer as evaluation extracts it, beside its problem's gold answer."""
        rows = [self.rows_by_prompt.get(prompt_key(prompt), {}) for prompt in prompts]  # {}: an environment's prompt
        pairs = [(sample_answer(text, self.task, row), gold_answer(row)) for text, row in zip(texts, rows, strict=True)]
        answers, golds = zip(*[pair for part in self.world.gather_objects(pairs) for pair in part], strict=True)
        if self.world.is_main:
            self.collapse.update(self.step, list(answers), list(golds))
        return answer_metrics(list(answers), self.config.num_generations)

    # ------------------------------------------------------------------ sample + reward
    def collect_rollout(self, step: int, generation=None, world: World | None = None) -> tuple[Rollout, list, list, dict]:
        """This rank's part of the step's rollout: its slice of the step's prompts, sampled and scored; with
        dynamic sampling (grpo.loop.dynamic_sampling) round r > 0 samples prompts from a permutation seeded by
        (seed, step, r), so a resumed run samples the same ones. Returns (rollout, prompts, texts, metrics).
        `generation`: another backend than the run's (asynchronous rollouts' own copy of the policy); `world`:
        the training rank to sample for (a generation process samples for others)."""
        cfg, world = self.config, world or self.world
        indices = step_prompts(step, self.prompts_per_generation, len(self.train_rows), cfg.seed, cfg.shuffle_dataset)
        first = self._sample_round(step, 0, indices, generation, world)
        if not cfg.dynamic_sampling:
            return (*first, {})

        def another_round(round_: int):
            order = torch.randperm(len(self.train_rows), generator=seeded(cfg.seed, 7919, step, round_))
            return self._sample_round(step, round_, order[: self.prompts_per_generation].tolist(), generation, world)

        weights = torch.tensor([spec.weight for spec in self.rewards], dtype=torch.float32)
        rollout, prompts, texts, metrics = keep_informative_groups(
            first, another_round, self.prompts_per_generation // world.size, cfg.num_generations, weights,
            cfg.dynamic_sampling_max_rounds, self.tokenizer.pad_token_id, step, cfg.reward_clip_range)
        # the policy's own rewards and answers are round 0's (the step's prompts, no group dropped yet)
        means = first[0].rewards_per_func.nanmean(0).tolist()  # (K,)
        metrics.update({f"dynamic_sampling/sampled_rewards/{spec.name}": m for spec, m in zip(self.rewards, means)})
        metrics[FIRST_ROUND] = (first[1], first[2])  # popped by train() for the answer guards, never logged
        return rollout, prompts, texts, metrics

    def _sample_round(self, step: int, round_: int, indices: list[int], generation, world: World):
        """The rank's contiguous slice of a global prompt list, sampled and scored; each prompt's noise seeded
        by (seed, step, round, its position in the global list), so no world size changes its completions."""
        cfg = self.config
        size = len(indices) // world.size
        positions = range(world.rank * size, (world.rank + 1) * size)
        noise = RowUniforms.per_prompt([seeded(cfg.seed, 104729, step, round_, p) for p in positions],
                                       cfg.num_generations, cfg.max_completion_length)
        sample = partial(self.sample_rollout, tokenizer=self.tokenizer, reward_specs=self.rewards,
                         rows=[self.train_rows[indices[p]] for p in positions],
                         prompt_ids=[self.train_prompt_ids[indices[p]] for p in positions], group=cfg.num_generations,
                         params=self.sampling, noise=noise, return_logprobs=cfg.corrects_behaviour)
        if generation is not None:  # a copy of the policy, in eval mode, in its own thread or process
            with setup.autocast(self.models.device, self.precision):
                return sample(generation)
        self.models.policy.eval()
        with self.models.autocast, gathered(self.decode_weights):  # FSDP2: full weights for the decode loop
            result = sample(self.generation)
        self.models.policy.train()
        return result

    # ------------------------------------------------------------------ asynchronous rollouts (--max-staleness)
    def _start_rollouts(self, stop_at: int):
        """The generator of the steps self.step .. stop_at - 1: generation processes under torchrun, else a thread
        on a copy of the policy (grpo.loop.async_rollouts); it starts from the current weights."""
        cfg = self.config
        lag = steps_ahead(cfg.max_staleness, cfg.num_iterations * self.num_updates)
        if self.generators:
            rollouts = ProcessRollouts(self.world, self.generators, self.step, self.channel)
        else:
            def make_backend(model):
                sampler = self.kernels.sampler(cfg.max_prompt_length) if self.kernels is not None else None
                return make_generation_backend(cfg.generation_backend, model, self.tokenizer.pad_token_id,
                                               sampler or sample_groups, self.tool_set)

            rollouts = BackgroundRollouts(lambda step, backend: self.collect_rollout(step, backend), make_backend,
                                          self.policy, self.step, stop_at, lag)
        rollouts.begin(self.state.updates, self.policy)
        return rollouts

    def _sampled_ahead(self, rollouts) -> tuple[Rollout, list, list, dict]:
        """This step's rollout from the generator, with trl's staleness metrics; one past the bound is never
        trained on (grpo.loop.async_rollouts: its schedule makes one impossible unless the generator is broken)."""
        started = time.perf_counter()
        (rollout, prompts, texts, metrics), version = rollouts.get(self.step)
        if is_stale(version, self.state.updates, self.config.max_staleness):
            raise GenerationError(f"step {self.step + 1}'s rollout arrived staler than --max-staleness "
                                  f"({self.state.updates - version} > {self.config.max_staleness} updates): the "
                                  "generator ran further ahead than its schedule allows")
        rollout.policy_version = version
        staleness = float(self.state.updates - version)
        return rollout, prompts, texts, {**metrics, "sample/staleness_mean": staleness, "sample/staleness_max": staleness,
                                         "perf/rollout_wait_s": time.perf_counter() - started}

    def _generate(self, stop_at: int) -> dict:
        """A generation process: sample every step's rows for the training ranks it serves."""
        cfg = self.config
        lag = steps_ahead(cfg.max_staleness, cfg.num_iterations * self.num_updates)
        self.policy.eval()

        def collect(step: int, trainer_rank: int):
            rank_world = World(rank=trainer_rank, size=self.world.size)
            return self.collect_rollout(step, self.generation, rank_world)

        generation_loop(collect, self.policy, self.global_rank, self.generators, self.world.size, self.step, stop_at,
                        lag, self.channel, on_weights=self.generation.after_update)
        return {"status": "finished", "step": self.step, "first_reward": None, "last_reward": None, "signal": None}

    # ------------------------------------------------------------------ update, evaluation, state
    def update(self, rollout: Rollout) -> UpdateResult:
        """grpo.loop.update.train_on_rollout on this run's models and optimizer: the metrics and every intermediate
        value of the update (advantages, old and reference log-probs, each micro-batch's loss and statistics)."""
        return train_on_rollout(rollout, self.config, self.models, self.optimizer, self.scheduler, self.state,
                                self.world, self.functions, self.rewards, self.num_updates, self.generation.after_update)

    def train_on_rollout(self, rollout: Rollout) -> dict:
        """The update's metrics (`update` for its intermediate values too)."""
        return self.update(rollout).metrics

    def run_eval(self) -> dict:
        """The held-out slice, greedy and scored (every rank; FSDP2 gathers the weights), rank 0 writing
        eval/step-*.json and the samples. Returns the summary as eval/* metrics."""
        cfg = self.config
        with gathered(self.decode_weights):
            records, summary = evaluate(self.policy, self.tokenizer, self.eval_rows, self.eos_token_ids,
                                        cfg.max_prompt_length, cfg.eval_max_completion_length or cfg.max_completion_length,
                                        cfg.eval_batch_size, autocast=self.models.autocast, scorer=self.eval_scorer,
                                        backend=self.generation, progress=self.world.is_main,
                                        chat_template_kwargs=self.template_kwargs, environments=self.played,
                                        reward_specs=self.rewards)
        if self.world.is_main:
            with writing(self.run_dir, f"eval/step-{self.step:06d}.*"):
                save_evaluation(self.run_dir, self.step, records, summary)
        return {f"eval/{key}": value for key, value in summary.items()}

    def save(self) -> Path:
        """An atomic checkpoint of the run at its current step; returns its folder. A full disk raises
        DiskFullError and leaves the previous checkpoints as they were."""
        with writing(self.run_dir, f"checkpoint {CHECKPOINTS}/step-{self.step:06d}"):
            return run_state.save(self.run_dir, self.config, self.state, self.models, self.optimizer, self.scheduler,
                                  self.world, self.tokenizer, self.run_record())

    def run_record(self) -> dict:
        """The settings and what actually ran (run_config.json, and each checkpoint's)."""
        record = run_state.run_record(self.config, self.rewards, self.task, self.kernels,
                                      type(self.generation).__name__, self.world.size, self.models.distributed)
        return {**record, "changed_on_resume": self.resume_changes} if self.resume_changes else record

    @property
    def step(self) -> int:
        """Steps done."""
        return self.state.step

    @property
    def policy(self) -> torch.nn.Module:
        return self.models.policy

    def _request_stop(self, signum, frame):
        if self._stop_signal is not None:  # a second signal: abandon the step now
            raise KeyboardInterrupt
        self._stop_signal = signal.Signals(signum).name
        tqdm.write(f"{self._stop_signal} received: finishing step {self.step + 1}, then saving a checkpoint "
                   "(send it again to stop at once)")

    def close(self) -> None:
        """Shut the generation engine down (vLLM), then leave the process group."""
        if hasattr(self.generation, "close"):
            self.generation.close()
        self.world.close()

    # ------------------------------------------------------------------ set-up (grpo.loop.setup)
    def __init__(self, config: GRPOConfig, policy=None, tokenizer=None, reward_functions=None, train_rows=None,
                 eval_rows=None, tools=None, environment_factory=None, reward_processing_classes=None):
        setup.use_cpu_huge_pages()  # before the first large tensor (it is read once)
        if config.reward is None and environment_factory is not None:  # as --environment: its get_reward alone
            config.reward = []
        self.config = cfg = config.validate()
        self.environments = setup.environments(cfg, environment_factory)  # grpo/loop/environments.py, trl's name
        self.rewards = setup.reward_specs(cfg, reward_functions, self.environments,  # first: a sandbox is logged
                                          reward_processing_classes)
        # --- processes: world size one unless launched by torchrun (grpo.loop.distributed) ---
        self.world = init_world(cfg.device, cfg.distributed_timeout, cfg.distributed)
        self.global_rank, self.generators = self.world.rank, []  # generators: ranks that only generate
        self.channel = None  # the gloo group that carries the weights to them (grpo.loop.async_rollouts.split_world)
        if cfg.max_staleness is not None and self.world.size > 1:  # grpo.loop.async_rollouts
            self.world, self.generators, self.channel = split_world(self.world, cfg.generation_processes)
            if cfg.dynamic_sampling:
                raise ValueError("--dynamic-sampling with generation processes is not supported: its extra rounds "
                                 "need every training rank's groups (one process with --max-staleness runs it)")
        self.generating = self.global_rank in self.generators
        device = resolve_device(cfg.device)
        if device.type == "cuda" and torch.distributed.is_initialized():
            device = torch.device("cuda", self.world.local_rank)
        self.precision = precision = resolve_precision(cfg.precision, device)  # fp32, bf16 or bf16-pure
        setup.check_world(cfg, self.world)
        for note in cfg.advice():
            logger.warning(note)
        self.run_dir = Path(cfg.output_dir)
        self.resume_from = setup.find_resume_checkpoint(cfg)
        self.resume_changes = [] if self.resume_from is None else setup.resume_changes(cfg, self.resume_from,
                                                                                       self.rewards)

        # --- data: loaded and checked before any model ---
        source, setting = (str(self.resume_from), "--resume") if self.resume_from else (cfg.model, "--model")
        self.tokenizer = tokenizer or load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template, setting)
        # grpo/loop/tools.py; with environments, each batch's tools are its environments' (self.played)
        self.tool_set, self.template_kwargs, self.played = setup.tool_set(cfg, self.tokenizer, tools, self.environments)
        self.sample_rollout = sample_rollout if self.played is None else self.played.sample_rollout  # same arguments
        self.train_rows, self.task = setup.task_rows(cfg, train_rows, cfg.train_split, "train")
        supplied = ("environments",) if self.environments is not None else ()
        check_reward_columns(self.rewards, self.train_rows, f"{cfg.dataset}[{cfg.train_split}]", supplied)
        old_files = setup.old_run_files(self.run_dir, cfg, self.resume_from)  # refused here without --overwrite
        self.rows_by_prompt = {prompt_key(row["prompt"]): row for row in self.train_rows}  # a completion's problem
        self.collapse = CollapseWatch()
        self.train_prompt_ids, self.train_rows, _ = encode_prompts(
            self.tokenizer, self.train_rows, cfg.max_prompt_length, cfg.long_prompts,
            where=f"{cfg.dataset}[{cfg.train_split}]", chat_template_kwargs=self.template_kwargs)
        self.eval_rows = None
        if cfg.eval_steps:
            rows, eval_task = setup.task_rows(cfg, eval_rows, cfg.eval_split, "eval")
            self.eval_rows = rows[: cfg.eval_limit]
            if scorer_kind(cfg.eval_scorer, eval_task) == "rewards":  # not at the first evaluation
                check_reward_columns(self.rewards, self.eval_rows, f"{cfg.dataset}[{cfg.eval_split}]", supplied)
            self.eval_scorer = make_scorer(cfg.eval_scorer, eval_task, self.rewards, cfg.sandbox_isolation)

        # --- models: the policy, its frozen reference, both as the loop calls them (DDP / FSDP2 under torchrun) ---
        weight_dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
        policy_given = policy is not None
        policy, peft_model = setup.load_policy(cfg, device, weight_dtype, self.tokenizer, policy, self.resume_from,
                                               source, setting)
        check_plain_output_head(policy.config)  # before any sampling, not at the first update
        reference = None if self.generating else setup.load_reference(
            cfg, device, precision, self.tokenizer, policy, self.resume_from, policy_given=policy_given)
        load_reward_models(self.rewards, device)  # rewards/reward_model.py: a --reward model, on the run's device
        if cfg.gradient_checkpointing:
            setup.use_gradient_checkpointing(policy)
        policy.train()
        self.eos_token_ids = eos_token_ids(policy, self.tokenizer)
        # where the vLLM engine runs, and what it reads
        backend, engine = setup.vllm_engine(cfg, self.world, self.generators, self.generating, precision, policy)
        distributed = "none" if self.generating else resolve_mode(cfg.distributed, self.world)
        if cfg.use_peft and distributed == "fsdp":
            raise ValueError("--use-peft under FSDP2 is not supported yet: use --distributed ddp (the adapters are "
                             "small, every rank can hold them and the frozen base)")
        policy_call = wrap_model(policy, distributed, self.world, device, precision, cpu_offload=cfg.fsdp_cpu_offload)
        reference_call = None if reference is None else wrap_model(
            reference, distributed, self.world, device, precision, trainable=False, cpu_offload=cfg.fsdp_cpu_offload)
        if cfg.use_peft and cfg.beta != 0.0:  # the same weights, adapters off (or the starting adapter)
            reference_call = AdaptersOff(policy, peft_model)
        autocast = setup.autocast(device, precision)
        self.models = Models(policy, policy_call, reference, reference_call, device, autocast, peft_model, distributed)

        # --- the step's functions: the plain ones, or kernels that compute the same numbers (chosen once) ---
        entropy = EntropyControl.from_config(cfg)
        # self.kernels: the grpo.kernels.KernelChoice (which kernels apply, and why the others do not); None: plain
        self.functions, sampler, self.kernels = setup.step_functions(cfg, device, policy, distributed, entropy.enabled)
        self.generation = make_generation_backend(backend, policy, self.tokenizer.pad_token_id, sampler, self.tool_set,
                                                  engine)
        # what FSDP2 gathers for a decode loop: nothing for a backend with weights of its own (vLLM gathers one
        # parameter at a time as it loads them)
        self.decode_weights = None if getattr(self.generation, "own_weights", False) else policy_call

        # --- sizes, optimizer, schedule, sampling, the step's counters ---
        self.num_updates = cfg.updates_per_generation  # k optimizer updates per rollout and iteration
        self.prompts_per_generation = cfg.prompts_per_generation  # k * B prompts per rollout
        self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * len(self.train_rows) / self.prompts_per_generation)
        self.optimizer, self.scheduler = setup.optimizer_and_schedule(cfg, policy, device, self.total_steps)
        self.sampling = SamplingParams(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                       self.eos_token_ids)
        self.state = StepState(entropy=entropy)
        self.cpu_threads = CpuThreads(cfg.adapt_cpu_threads and device.type == "cpu")
        self._stop_signal = None
        if self.resume_from is not None and not self.generating:
            run_state.restore(self.resume_from, self.state, self.models, self.optimizer, self.scheduler, self.world,
                              cfg)
        elif self.resume_from is not None:  # a generation process: only where to start (the weights come from rank 0)
            self.state.step = load_trainer_state(self.resume_from)["step"]
        # only now, every check passed, may an old run in the output folder be replaced
        setup.replace_old_run(self.run_dir, old_files, replaces=self.global_rank == 0)
        if torch.distributed.is_initialized():  # no process writes there before rank 0 has replaced an old run
            torch.distributed.barrier()


__all__ = ["Trainer", "TrainingError", "DiskFullError", "Rollout"]
