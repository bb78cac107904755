"""The GRPO training loop: one step per rollout, composed from the pure functions of grpo/algorithm.

    sample    B prompts x G completions                      grpo.generation.rollout.sample_rollout
              (k * B with steps_per_generation;              -> grpo.algorithm.sampler
              more rounds with dynamic sampling)             grpo.generation.dynamic_sampling
    reward    K reward functions -> (N, K)                   rewards.score_rows
    update    advantages, ref/old log-probs,                 grpo.core.update.train_on_rollout
              num_iterations x k optimizer updates           (-> grpo.algorithm.advantages, logprobs, loss)
    log       metrics.jsonl, samples.jsonl, console          grpo.core.metrics
    save      atomic checkpoint every save_steps, at the end grpo.core.run_state, grpo.core.checkpoint
A full disk at any write into the run folder stops the run with DiskFullError (grpo.core.disk_full).

`train()` is the loop and `train_step()` one step of it; `__init__` sets up the run, step by step
(grpo.core.setup), which also chooses the log-prob, loss and sampling functions once (--kernels) and builds what
each part reads of the settings (`LoopOptions` here, grpo.core.update.UpdateOptions for the update): after set-up
nothing reads GRPOConfig. The functions the loop calls take what they read as arguments: the models
(grpo.core.update.Models), the optimizer, the step's counters (grpo.core.update.StepState) and the world.

Notation: B prompts, G group size, N = B * G completions, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from grpo.config import GRPOConfig
from grpo.core import run_state, setup
from grpo.core.checkpoint import CHECKPOINTS, latest_checkpoint
from grpo.core.disk_full import DiskFullError, writing
from grpo.core.metrics import PER_UPDATE, ROW_ADVANTAGES, MetricsLogger, completion_records
from grpo.core.update import TrainingError, UpdateResult, train_on_rollout
from grpo.algorithm.sampler import sample_groups
from grpo.errors import PluginError
from grpo.evaluation.answers import CollapseWatch, answer_metrics, prompt_key
from grpo.evaluation.evaluate import evaluate, gold_answer, sample_answer, save_evaluation
from grpo.generation.async_rollouts import (BackgroundRollouts, GenerationError, ProcessRollouts, generation_loop,
                                            is_stale, steps_ahead)
from grpo.generation.dynamic_sampling import FIRST_ROUND, keep_informative_groups
from grpo.generation.prompts import encode_prompts
from grpo.generation.rollout import Rollout, RowUniforms, make_generation_backend, sample_rollout, seeded, step_prompts
from grpo.parallel.distributed import World, gathered
from grpo.parallel.threads import CpuThreads
from rewards.scoring import RewardError

logger = logging.getLogger("grpo")


class StepOutput(NamedTuple):
    """One training step: its metrics, the rollout it trained on, the prompts and texts of its rows, and their
    advantages ((N, 1), or (N, T) from a per-token estimator)."""

    metrics: dict
    rollout: Rollout
    prompts: list
    texts: list[str]
    advantages: torch.Tensor


class StepHooks(NamedTuple):
    """What `Trainer.train` calls for a caller that watches the run: `step_end(step, metrics, per_update) -> (save,
    stop)` after each step is logged (save a checkpoint now; stop after this step, saving; `per_update`: each
    optimizer update's own loss, grad_norm, learning_rate and loss statistics when the step made several, else
    None), and `saved(step, folder)` after each checkpoint."""

    step_end: Callable[[int, dict, list | None], tuple[bool, bool]]
    saved: Callable[[int, Path], None]
    completions: Callable[[int, list[dict]], None] | None = None  # after each step, on every rank: every rank's
    # completions of the step, their prompts whole (grpo.core.metrics.completion_records)


class DataOrder(NamedTuple):
    """The order the loop reads its data in: `prompts(step)`, the step's k * B prompt indices over every rank;
    `rows(step, num_rows)`, this rank's N rows in the order every iteration of the step cuts them into micro-batches,
    or None for a fresh seeded order per iteration (grpo.core.update.train_on_rollout). The run's own are
    grpo.generation.rollout.step_prompts and None; grpo.trl_api puts trl's here."""

    prompts: Callable[[int], list[int]]
    rows: Callable[[int, int], torch.Tensor | None]


class Trainer:
    """Holds the models, optimizer, data and run folder of one GRPO run; `train()` runs it.

    `update(rollout)` is the update alone, for externally supplied rollouts: it returns every intermediate
    value (grpo.core.update.UpdateResult); `train_on_rollout(rollout)` returns its metrics.
    """

    def train(self, until_step: int | None = None, hooks: StepHooks | None = None) -> dict:
        """Run until max_steps (or `until_step`, saving there: training in pieces). `hooks`: a caller that watches
        the steps and may save or stop the run after one (grpo.trl_api's callbacks).

        Returns {"status": "finished" | "paused" | "interrupted", "step", "first_reward", "last_reward", "signal"}:
        paused at `until_step` or by a hook, interrupted by a signal.
        """
        loop, main = self.loop, self.world.is_main
        stop_at = min(until_step or loop.total_steps, loop.total_steps)
        if self.processes.generating:  # a generation process under torchrun: sample until the training ranks stop it
            return self._generate(stop_at)
        handlers = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        first_reward = last_reward = metrics_logger = rollouts = None
        bar = tqdm(total=loop.total_steps, initial=self.step, desc="GRPO", dynamic_ncols=True, disable=not main)
        stopping, stop_now, run_dir = False, False, self.run.path
        try:  # every write into the run folder runs in `writing`: a full disk stops the run with one error
            if main:  # rank 0 writes the run's files; every rank trains
                with writing(run_dir, "run_config.json, metrics.jsonl and samples.jsonl"):
                    run_dir.mkdir(parents=True, exist_ok=True)
                    (run_dir / "run_config.json").write_text(json.dumps(self.record, indent=2))
                    metrics_logger = MetricsLogger(run_dir, loop.report_to, config=self.record,
                                                   resume_step=self.step if self.run.resume_from else None)
            rollouts = self._start_rollouts(stop_at) if loop.max_staleness is not None else None
            while self.step < stop_at and not stopping:
                threads = self.cpu_threads.adjust()  # the cores other processes left idle (grpo/parallel/threads.py)
                # sample -> reward -> advantage -> reference/old log-probs -> loss and update
                metrics, rollout, prompts, texts, advantages = self.train_step(rollouts)
                per_update = metrics.pop(PER_UPDATE, None)  # for the hooks: each update's own, when several
                if rollouts is not None and self.step < stop_at:  # the generator samples ahead from the new weights
                    rollouts.publish(self.step, self.state.updates, self.policy)
                metrics["cpu_threads"] = threads
                # answers/*: one answer to every question warns (under dynamic sampling, round 0's: every group)
                metrics.update(self.watch_answers(*metrics.pop(FIRST_ROUND, (prompts, texts))))
                first_reward = metrics["reward"] if first_reward is None else first_reward
                last_reward = metrics["reward"]
                # evaluate -> log -> checkpoint
                if loop.eval_steps and (self.step % loop.eval_steps == 0 or self.step == loop.total_steps):
                    metrics.update(self.run_eval())
                samples = None
                if loop.log_completions_steps and self.step % loop.log_completions_steps == 0:
                    samples = self.completion_records(rollout, prompts, texts, advantages)
                if hooks is not None and hooks.completions is not None:  # a collective: every rank's records
                    hooks.completions(self.step, [record for part in self.world.gather_objects(
                        self.completion_records(rollout, prompts, texts, advantages, True)) for record in part])
                if main:
                    with writing(run_dir, f"step {self.step}'s lines of metrics.jsonl and samples.jsonl"):
                        console = self.step % loop.logging_steps == 0 or self.step == loop.total_steps
                        metrics_logger.log(self.step, metrics, console=console)
                        if samples is not None:  # the first group's
                            metrics_logger.log_samples(self.step, samples[: loop.group_size])
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics.get('kl') or 0:.4f}",
                                len=f"{metrics['completions/mean_length']:.0f}")
                save_now, stop_now = (hooks.step_end(self.step, metrics, per_update) if hooks is not None
                                      else (False, False))
                stopping = self.world.any(self._stop_signal is not None or stop_now)  # all ranks stop after one step
                if stopping and self._stop_signal is None and not stop_now:
                    self._stop_signal = "a signal to another rank"
                if (stopping or save_now or self.step == stop_at
                        or (loop.save_steps and self.step % loop.save_steps == 0)):
                    folder = self.save()
                    if hooks is not None:
                        hooks.saved(self.step, folder)
        except (TrainingError, PluginError, RewardError) as error:  # a DiskFullError stays one (train.py: resume)
            where = "" if isinstance(error, TrainingError) else f"step {self.step + 1}: "  # a plug-in's or reward's
            raise (type(error) if isinstance(error, TrainingError) else TrainingError)(
                f"{where}{error} The last good checkpoint is "
                f"{latest_checkpoint(run_dir) or 'none (none was saved yet)'}.") from error.__cause__ or error
        finally:
            if rollouts is not None:  # rollouts sampled ahead are discarded (resume samples them again)
                rollouts.close()
            bar.close()
            if metrics_logger is not None:
                metrics_logger.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        status = "finished" if self.step >= loop.total_steps else "interrupted" if self._stop_signal else "paused"
        if status == "interrupted" and main:
            tqdm.write(f"stopped by {self._stop_signal} after step {self.step}; checkpoint saved. "
                       f"Resume with: python train.py --resume {run_dir} (and the same settings)")
        return {"status": status, "step": self.step, "first_reward": first_reward, "last_reward": last_reward,
                "signal": self._stop_signal}

    def train_step(self, rollouts=None) -> StepOutput:
        """One step: sample and reward this rank's rollout, then update on it; the step counter moves on.
        `rollouts`: asynchronous generation (grpo.generation.async_rollouts) sampled it ahead."""
        started = time.perf_counter()
        rollout, prompts, texts, extra = self._sampled_ahead(rollouts) if rollouts else self.collect_rollout(self.step)
        sampled = time.perf_counter()  # sample -> reward done; extra: dynamic sampling's or the staleness metrics
        metrics = {**self.train_on_rollout(rollout), **extra}  # advantage -> ... -> optimizer -> metrics
        advantages = metrics.pop(ROW_ADVANTAGES)
        self.state.step += 1
        tokens = self.world.sum(rollout.completion_mask.sum().item())
        metrics.update(step_time=time.perf_counter() - started, sample_time=sampled - started,
                       tokens_per_second=tokens / max(sampled - started, 1e-9))
        return StepOutput(metrics, rollout, prompts, texts, advantages)

    def completion_records(self, rollout: Rollout, prompts: list, texts: list[str], advantages: torch.Tensor,
                           whole_prompts: bool = False) -> list[dict]:
        """This rank's completions of a step as records (grpo.core.metrics.completion_records)."""
        return completion_records(prompts, texts, rollout.rewards_per_func, [spec.name for spec in self.rewards],
                                  advantages, rollout.loss_mask.to(advantages.device), whole_prompts)

    def watch_answers(self, prompts: list, texts: list[str]) -> dict:
        """The step's answers/* metrics over every rank's completions, and the collapse check
        (grpo/evaluation/answers.py): each completion's answer as evaluation extracts it, beside its problem's gold
        answer."""
        rows = [self.data.rows_by_prompt.get(prompt_key(prompt), {}) for prompt in prompts]  # {}: an environment's
        pairs = [(sample_answer(text, self.data.task, row), gold_answer(row))
                 for text, row in zip(texts, rows, strict=True)]
        answers, golds = zip(*[pair for part in self.world.gather_objects(pairs) for pair in part], strict=True)
        if self.world.is_main:
            self.collapse.update(self.step, list(answers), list(golds))
        return answer_metrics(list(answers), self.loop.group_size)

    # ------------------------------------------------------------------ sample + reward
    def collect_rollout(self, step: int, generation=None,
                        world: World | None = None) -> tuple[Rollout, list, list, dict]:
        """This rank's part of the step's rollout: its slice of the step's prompts, sampled and scored; with
        dynamic sampling (grpo.generation.dynamic_sampling) round r > 0 samples prompts from a permutation seeded by
        (seed, step, r), so a resumed run samples the same ones. Returns (rollout, prompts, texts, metrics).
        `generation`: another backend than the run's (asynchronous rollouts' own copy of the policy); `world`:
        the training rank to sample for (a generation process samples for others)."""
        loop, world, rows = self.loop, world or self.world, len(self.data.train_rows)
        indices = self.order.prompts(step)
        first = self._sample_round(step, 0, indices, generation, world)
        if not loop.dynamic_sampling:
            return (*first, {})

        def another_round(round_: int):
            order = torch.randperm(rows, generator=seeded(loop.seed, 7919, step, round_))
            return self._sample_round(step, round_, order[: loop.prompts_per_generation].tolist(), generation, world)

        weights = torch.tensor([spec.weight for spec in self.rewards], dtype=torch.float32)
        rollout, prompts, texts, metrics = keep_informative_groups(
            first, another_round, loop.prompts_per_generation // world.size, loop.group_size, weights,
            loop.dynamic_sampling_max_rounds, self.data.tokenizer.pad_token_id, step, loop.reward_clip_range)
        # the policy's own rewards and answers are round 0's (the step's prompts, no group dropped yet)
        means = first[0].rewards_per_func.nanmean(0).tolist()  # (K,)
        metrics.update({f"dynamic_sampling/sampled_rewards/{spec.name}": m for spec, m in zip(self.rewards, means)})
        metrics[FIRST_ROUND] = (first[1], first[2])  # popped by train() for the answer guards, never logged
        return rollout, prompts, texts, metrics

    def _sample_round(self, step: int, round_: int, indices: list[int], generation, world: World):
        """The rank's contiguous slice of a global prompt list, sampled and scored; each prompt's noise seeded
        by (seed, step, round, its position in the global list), so no world size changes its completions."""
        loop, data = self.loop, self.data
        size = len(indices) // world.size
        positions = range(world.rank * size, (world.rank + 1) * size)
        noise = RowUniforms.per_prompt([seeded(loop.seed, 104729, step, round_, p) for p in positions],
                                       loop.group_size, loop.sampling.max_completion_length)
        return self._sample([data.train_rows[indices[p]] for p in positions],
                            [data.train_prompt_ids[indices[p]] for p in positions], loop.group_size, noise, generation)

    def sample_rows(self, rows: list[dict], group: int, seed: tuple[int, ...]) -> tuple[Rollout, list, list]:
        """`group` completions of each of `rows`' prompts, sampled and scored as a step's are, each prompt's noise
        seeded by (*seed, its position): (rollout, prompts, texts). grpo.trl_api's evaluation samples this way."""
        prompt_ids, _, _ = encode_prompts(self.data.tokenizer, rows, 10**9, where="rows", progress=False,
                                          chat_template_kwargs=self.data.template_kwargs)
        noise = RowUniforms.per_prompt([seeded(*seed, p) for p in range(len(rows))], group,
                                       self.loop.sampling.max_completion_length)
        return self._sample(rows, prompt_ids, group, noise, None)

    def _sample(self, rows: list[dict], prompt_ids: list[list[int]], group: int, noise, generation):
        """The rows sampled by `generation` (None: the run's backend, on the live policy) and scored."""
        sample = partial(self.sample_rollout, tokenizer=self.data.tokenizer, reward_specs=self.rewards, rows=rows,
                         prompt_ids=prompt_ids, group=group, params=self.loop.sampling, noise=noise,
                         return_logprobs=self.loop.behaviour_logprobs)
        if generation is not None:  # a copy of the policy, in eval mode, in its own thread or process
            with setup.autocast(self.models.device, self.processes.precision):
                return sample(generation)
        self.models.policy.eval()
        with self.models.autocast, gathered(self.decode_weights):  # FSDP2: full weights for the decode loop
            result = sample(self.generation)
        self.models.policy.train()
        return result

    # ------------------------------------------------------------------ asynchronous rollouts (--max-staleness)
    def _start_rollouts(self, stop_at: int):
        """The generator of the steps self.step .. stop_at - 1: generation processes under torchrun, else a thread
        on a copy of the policy (grpo.generation.async_rollouts); it starts from the current weights."""
        loop, processes = self.loop, self.processes
        lag = steps_ahead(loop.max_staleness, loop.num_iterations * loop.num_updates)
        if processes.generators:
            rollouts = ProcessRollouts(self.world, processes.generators, self.step, processes.channel)
        else:
            def make_backend(model):
                sampler = self.kernels.sampler(loop.max_prompt_length) if self.kernels is not None else sample_groups
                return make_generation_backend(loop.generation_backend, model, self.data.tokenizer.pad_token_id,
                                               sampler, self.data.tool_set, self.engine_builder,
                                               loop.cache_implementation)

            rollouts = BackgroundRollouts(lambda step, backend: self.collect_rollout(step, backend), make_backend,
                                          self.policy, self.step, stop_at, lag)
        rollouts.begin(self.state.updates, self.policy)
        return rollouts

    def _sampled_ahead(self, rollouts) -> tuple[Rollout, list, list, dict]:
        """This step's rollout from the generator, with trl's staleness metrics; one past the bound is never
        trained on (grpo.generation.async_rollouts: its schedule makes one impossible unless the generator is
        broken)."""
        started = time.perf_counter()
        (rollout, prompts, texts, metrics), version = rollouts.get(self.step)
        if is_stale(version, self.state.updates, self.loop.max_staleness):
            raise GenerationError(f"step {self.step + 1}'s rollout arrived staler than --max-staleness "
                                  f"({self.state.updates - version} > {self.loop.max_staleness} updates): the "
                                  "generator ran further ahead than its schedule allows")
        rollout.policy_version = version
        staleness = float(self.state.updates - version)
        return rollout, prompts, texts, {**metrics, "sample/staleness_mean": staleness,
                                         "sample/staleness_max": staleness,
                                         "perf/rollout_wait_s": time.perf_counter() - started}

    def _generate(self, stop_at: int) -> dict:
        """A generation process: sample every step's rows for the training ranks it serves."""
        loop, processes = self.loop, self.processes
        lag = steps_ahead(loop.max_staleness, loop.num_iterations * loop.num_updates)
        self.policy.eval()

        def collect(step: int, trainer_rank: int):
            rank_world = World(rank=trainer_rank, size=self.world.size)
            return self.collect_rollout(step, self.generation, rank_world)

        generation_loop(collect, self.policy, processes.global_rank, processes.generators, self.world.size,
                        self.step, stop_at, lag, processes.channel, on_weights=self.generation.after_update)
        return {"status": "finished", "step": self.step, "first_reward": None, "last_reward": None, "signal": None}

    # ------------------------------------------------------------------ update, evaluation, state
    def update(self, rollout: Rollout) -> UpdateResult:
        """grpo.core.update.train_on_rollout on this run's models and optimizer: the metrics and every intermediate
        value of the update (advantages, old and reference log-probs, each micro-batch's loss and statistics)."""
        return train_on_rollout(rollout, self.update_options, self.models, self.optimizer, self.scheduler,
                                self.state, self.world, self.functions, self.rewards, self.loop.num_updates,
                                self.generation.after_update, self.order.rows(self.state.step, rollout.num_rows))

    def train_on_rollout(self, rollout: Rollout) -> dict:
        """The update's metrics (`update` for its intermediate values too), and the rows' advantages under
        ROW_ADVANTAGES (never logged: train_step takes them)."""
        result = self.update(rollout)
        return {**result.metrics, ROW_ADVANTAGES: result.advantages}

    def run_eval(self) -> dict:
        """The held-out slice, greedy and scored (every rank; FSDP2 gathers the weights), rank 0 writing
        eval/step-*.json and the samples. Returns the summary as eval/* metrics."""
        loop, data = self.loop, self.data
        try:
            with gathered(self.decode_weights):
                records, summary = evaluate(self.policy, data.tokenizer, data.eval_rows, loop.sampling.eos_token_ids,
                                            loop.max_prompt_length, loop.eval_max_completion_length,
                                            loop.eval_batch_size, autocast=self.models.autocast,
                                            scorer=data.eval_scorer, backend=self.generation,
                                            progress=self.world.is_main, chat_template_kwargs=data.template_kwargs,
                                            environments=data.played, reward_specs=self.rewards)
        except (PluginError, RewardError) as error:  # the step whose evaluation failed (its update is not saved)
            raise TrainingError(f"step {self.step}'s evaluation: {error}") from error
        if self.world.is_main:
            with writing(self.run.path, f"eval/step-{self.step:06d}.*"):
                save_evaluation(self.run.path, self.step, records, summary)
        return {f"eval/{key}": value for key, value in summary.items()}

    def save(self) -> Path:
        """An atomic checkpoint of the run at its current step; returns its folder. A full disk raises
        DiskFullError and leaves the previous checkpoints as they were."""
        with writing(self.run.path, f"checkpoint {CHECKPOINTS}/step-{self.step:06d}"):
            return run_state.save(self.run.path, self.loop.checkpoints, self.state, self.models, self.optimizer,
                                  self.scheduler, self.world, self.data.tokenizer, self.record)

    @property
    def step(self) -> int:
        """Steps done."""
        return self.state.step

    @property
    def policy(self) -> torch.nn.Module:
        return self.models.policy

    @property
    def world(self) -> World:
        """The training ranks' collectives (world size one without torchrun)."""
        return self.processes.world

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

    # ------------------------------------------------------------------ set-up (grpo.core.setup)
    def __init__(self, config: GRPOConfig, policy=None, tokenizer=None, reward_functions=None, train_rows=None,
                 eval_rows=None, tools=None, environment_factory=None, reward_processing_classes=None,
                 sampled_columns: bool = False):
        """Set a run up, step by step (grpo.core.setup), the cheap checks first: the settings, the processes, the
        rewards, the run folder, the data (all before any model loads), the models, the step's functions, the
        optimizer. An old run in the output folder is replaced only once every step has passed."""
        setup.use_cpu_huge_pages()  # before the first large tensor (it is read once)
        self.config = cfg = setup.checked_config(config, environment_factory)
        self.processes = setup.processes(cfg)
        self.environments, self.rewards = setup.rewards(cfg, reward_functions, environment_factory,
                                                        reward_processing_classes)
        self.run = setup.run_folder(cfg, self.rewards)
        self.data = setup.run_data(cfg, self.run, self.rewards, self.environments, tokenizer, train_rows, eval_rows,
                                   tools, sampled_columns)
        self.models, backend, engine = setup.models(cfg, self.processes, self.run, self.data, self.rewards, policy)
        self.engine_builder = engine  # what builds vLLM's backend on a model: a background thread's, with a server
        self.functions, self.generation, self.kernels, self.decode_weights = setup.step_functions(
            cfg, self.models, self.data, backend, engine)
        steps = setup.total_steps(cfg, self.data)
        self.optimizer, self.scheduler, self.state = setup.optimisation(cfg, self.models, self.processes,
                                                                        self.run, steps)
        # what each part reads of the settings, and the run's record (run_config.json): nothing reads cfg after this
        self.loop = setup.loop_options(cfg, self.policy, self.data.tokenizer, steps)
        self.update_options = setup.update_options(cfg)
        self.record = setup.run_record(cfg, self.rewards, self.data.task, self.kernels, self.generation,
                                       self.world.size, self.models.distributed, self.run.changed_on_resume)
        self.sample_rollout = sample_rollout if self.data.played is None else self.data.played.sample_rollout
        self.order = DataOrder(partial(step_prompts, count=self.loop.prompts_per_generation,
                                       dataset_size=len(self.data.train_rows), seed=cfg.seed,
                                       shuffle=cfg.shuffle_dataset), lambda step, num_rows: None)
        self.collapse, self._stop_signal = CollapseWatch(), None
        self.cpu_threads = CpuThreads(cfg.adapt_cpu_threads and self.processes.device.type == "cpu")
        # only now, every check passed, may an old run in the output folder be replaced
        setup.replace_old_run(self.run.path, self.run.old_files, replaces=self.processes.global_rank == 0)
        # no training rank writes there before rank 0 has replaced an old run (the generation processes write
        # nothing there, and their engine may still be starting: they are not in the training ranks' group)
        self.world.barrier()


__all__ = ["DataOrder", "StepHooks", "Trainer", "TrainingError", "DiskFullError", "Rollout"]
