"""A run's set-up: the steps Trainer.__init__ takes, in order, each checking what it builds with a message that names
the bad setting, and the option objects each part of the loop reads (built here from GRPOConfig, once: below set-up no
function reads the config).

    checked_config     the settings, validated (and trl's environment_factory's default reward)
    processes          torchrun's ranks (some only generate, with --max-staleness), the device and the precision
    rewards            the reward functions and models (described, not loaded), the environments
    run_folder         the output folder, the checkpoint to resume and how its settings changed
    run_data           the tokenizer, the tools, the training and evaluation rows, each prompt tokenized
    models             the policy (LoRA), its frozen reference, the reward models, the DDP / FSDP2 wrappers
    step_functions     the update's log-prob, loss and micro-batch functions, the generation backend (--kernels)
    optimisation       AdamW and its schedule, the step's counters, restored on --resume
    replace_old_run    only now, every check passed, an old run in the output folder is removed

    loop_options, update_options, checkpoint_options, engine_settings, lora_settings: what each part reads.

Data is loaded and checked before any model, so a bad row fails in seconds, not after loading a model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from data import add_prompts, column_prompts, load_task_rows
from grpo.algorithm.advantages import resolve_estimator
from grpo.algorithm.logprobs import check_plain_output_head
from grpo.algorithm.sampler import SamplingParams, sample_groups
from grpo.algorithm.step import plain_step_functions
from grpo.config import MAY_CHANGE_ON_RESUME, GRPOConfig
from grpo.core.checkpoint import REFERENCE, latest_checkpoint, load_trainer_state
from grpo.core.run_state import CheckpointOptions, restore
from grpo.core.update import Models, StepState, UpdateOptions, make_scheduler
from grpo.evaluation.answers import prompt_key
from grpo.evaluation.evaluate import make_scorer, scorer_kind
from grpo.generation.async_rollouts import split_world
from grpo.generation.prompts import encode_prompts
from grpo.generation.rollout import make_generation_backend
from grpo.lora import AdaptersOff, LoraSettings, add_lora, adopt_peft_model
from grpo.models import (cast_head_to_fp32, disable_dropout, eos_token_ids, four_bit_config, is_quantized,
                         keep_4bit_layout_trainable, load_model,
                         load_tokenizer, make_optimizer, resolve_device, resolve_precision)
from grpo.multiturn.environments import EnvironmentRollouts, Environments, load_environments
from grpo.multiturn.tools import ToolSet, check_template_renders_tools, load_tools
from grpo.parallel.distributed import World, init_world, resolve_mode, wrap_model
from rewards import RewardSpec, describe_rewards, parse_reward_specs
from rewards.reward_model import load_reward_models, with_processing_classes
from rewards.sandbox import check_isolation
from rewards.scoring import check_reward_columns
from rewards.shaping import overlong_penalty

logger = logging.getLogger("grpo")

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "eval", "run_config.json", "tensorboard", "wandb",
             "wandb_run_id")


# ----------------------------------------------------------------------------- what set-up builds

@dataclass
class Processes:
    """Who does what under torchrun (world size one otherwise), on which device, in which precision."""

    world: World  # the training ranks (every rank without generation processes)
    global_rank: int
    generators: list[int]  # the ranks that only generate (--generation-processes with --max-staleness)
    channel: object | None  # the gloo group that carries the weights to them (grpo.generation.async_rollouts)
    device: torch.device
    precision: str  # fp32, bf16 or bf16-pure

    @property
    def generating(self) -> bool:
        """This process only generates, for the training ranks."""
        return self.global_rank in self.generators


@dataclass
class RunFolder:
    """The output folder, the checkpoint a resumed run goes on from, and what the run replaces."""

    path: Path
    resume_from: Path | None  # the newest complete checkpoint of --resume
    changed_on_resume: list[dict]  # the run's history of settings changed on resume (run_config.json)
    old_files: list[str]  # another run's files, removed by replace_old_run once every check passed


@dataclass
class RunData:
    """The data as the loop reads it: rows with their prompts tokenized, and how they are played and scored."""

    tokenizer: object
    task: str  # gsm8k, reasoning-gym or prompt (data/tasks.py)
    train_rows: list[dict]
    train_prompt_ids: list[list[int]]
    rows_by_prompt: dict  # a completion's problem, by its prompt (the answer guards)
    eval_rows: list[dict] | None
    eval_scorer: object | None  # grpo.evaluation.evaluate.make_scorer's
    tool_set: ToolSet | None
    template_kwargs: dict | None  # the chat template's keyword arguments (the tools' schemas among them)
    played: EnvironmentRollouts | None  # with environments: the rollouts they play


@dataclass(frozen=True)
class LoopOptions:
    """What the training loop reads of the run's settings (grpo.core.trainer), built once by `loop_options`."""

    total_steps: int
    prompts_per_generation: int  # k * B prompts of one rollout, over every rank
    num_updates: int  # k optimizer updates per rollout and iteration
    num_iterations: int
    group_size: int  # G
    seed: int
    shuffle: bool
    sampling: SamplingParams
    behaviour_logprobs: bool  # the rollouts keep the sampler's log-probs (the off-policy correction reads them)
    dynamic_sampling: bool
    dynamic_sampling_max_rounds: int
    reward_clip_range: tuple[float, float] | None
    max_staleness: int | None
    generation_backend: str  # what a background thread's copy of the policy samples with (--max-staleness)
    cache_implementation: str | None  # transformers' generate's KV cache (--generation-backend transformers)
    max_prompt_length: int  # the prompts the samplers hold (evaluation's too)
    logging_steps: int
    log_completions_steps: int
    save_steps: int
    eval_steps: int
    eval_max_completion_length: int
    eval_batch_size: int
    report_to: str
    checkpoints: CheckpointOptions


# ----------------------------------------------------------------------------- the steps, in order

def checked_config(config: GRPOConfig, environment_factory=None) -> GRPOConfig:
    """The settings, validated; trl's environment_factory given from Python makes its get_reward the default
    reward, as --environment does."""
    if config.reward is None and environment_factory is not None:
        config.reward = []
    config.validate()
    for note in config.advice():
        logger.warning(note)
    return config


def processes(config: GRPOConfig) -> Processes:
    """torchrun's ranks (grpo.parallel.distributed; world size one without it), the generation processes that
    --max-staleness takes from them (grpo.generation.async_rollouts), this rank's device and the precision; every
    rank must hold whole groups and micro-batches."""
    world = init_world(config.device, config.distributed_timeout, config.distributed)
    global_rank, generators, channel = world.rank, [], None
    if config.max_staleness is not None and world.size > 1:
        world, generators, channel = split_world(world, config.generation_processes)
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.distributed.is_initialized():
        device = torch.device("cuda", world.local_rank)
    check_world(config, world)
    return Processes(world, global_rank, generators, channel, device, resolve_precision(config.precision, device))


def rewards(config: GRPOConfig, reward_functions=None, environment_factory=None,
            reward_processing_classes=None) -> tuple[Environments | None, list[RewardSpec]]:
    """(the environments, probed, or None; the reward functions and models): --environment or trl's
    environment_factory (grpo.multiturn.environments), then --reward or the functions given from Python."""
    played = environments(config, environment_factory)
    return played, reward_specs(config, reward_functions, played, reward_processing_classes)


def run_folder(config: GRPOConfig, reward_specs: list[RewardSpec]) -> RunFolder:
    """The output folder; with --resume its newest complete checkpoint, whose settings this run must keep
    (`resume_changes`); without, the files of another run it would replace (refused without --overwrite)."""
    resume_from = find_resume_checkpoint(config)
    changed = [] if resume_from is None else resume_changes(config, resume_from, reward_specs)
    path = Path(config.output_dir)
    return RunFolder(path, resume_from, changed, old_run_files(path, config, resume_from))


def run_data(config: GRPOConfig, folder: RunFolder, reward_specs: list[RewardSpec], environments: Environments | None,
             tokenizer=None, train_rows=None, eval_rows=None, tools=None, sampled_columns: bool = False) -> RunData:
    """The tokenizer (the checkpoint's on resume), the tools, the training and evaluation rows checked for their
    task and the rewards' columns, and each training prompt tokenized: all before any model loads.
    `sampled_columns`: the sampling hands the rewards more arguments (trl's rollout_func), so a column the rows lack
    is not refused here; a reward still missing one fails at the first step, naming it."""
    source, setting = (str(folder.resume_from), "--resume") if folder.resume_from else (config.model, "--model")
    tokenizer = tokenizer or load_tokenizer(source, config.trust_remote_code, config.chat_template, setting)
    tools, template_kwargs, played = tool_set(config, tokenizer, tools, environments)
    rows, task = task_rows(config, train_rows, config.train_split, "train")
    supplied = ("environments",) if environments is not None else ()
    if not sampled_columns:
        check_reward_columns(reward_specs, rows, f"{config.dataset}[{config.train_split}]", supplied)
    prompt_ids, rows, _ = encode_prompts(tokenizer, rows, config.max_prompt_length, config.long_prompts,
                                         where=f"{config.dataset}[{config.train_split}]",
                                         chat_template_kwargs=template_kwargs)
    held_out, scorer = None, None
    if config.eval_steps:
        held_out, eval_task = task_rows(config, eval_rows, config.eval_split, "eval")
        held_out = held_out[: config.eval_limit or None]  # 0: every row of the split
        if scorer_kind(config.eval_scorer, eval_task) == "rewards" and not sampled_columns:  # not at the first eval
            check_reward_columns(reward_specs, held_out, f"{config.dataset}[{config.eval_split}]", supplied)
        scorer = make_scorer(config.eval_scorer, eval_task, reward_specs, config.sandbox_isolation)
    by_prompt = {prompt_key(row["prompt"]): row for row in rows}
    return RunData(tokenizer, task, rows, prompt_ids, by_prompt, held_out, scorer, tools, template_kwargs, played)


def models(config: GRPOConfig, processes: Processes, folder: RunFolder, data: RunData, reward_specs, policy=None):
    """(Models, the backend this process samples with, what builds a vLLM backend or None): the policy (given, or
    --model, or the checkpoint resumed; LoRA under --use-peft), its frozen reference, the reward models on the
    run's device, gradient checkpointing, and the DDP / FSDP2 wrappers the loop calls them through."""
    device, precision = processes.device, processes.precision
    source, setting = (str(folder.resume_from), "--resume") if folder.resume_from else (config.model, "--model")
    weight_dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    policy_given = policy is not None
    policy, peft_model = load_policy(config, device, weight_dtype, data.tokenizer, policy, folder.resume_from, source,
                                     setting)
    check_plain_output_head(policy.config)  # before any sampling, not at the first update
    reference = None if processes.generating else load_reference(
        config, device, precision, data.tokenizer, policy, folder.resume_from, policy_given=policy_given)
    load_reward_models(reward_specs, device)  # rewards/reward_model.py: a --reward model, on the run's device
    if config.gradient_checkpointing:
        use_gradient_checkpointing(policy)
    policy.train()
    backend, engine = vllm_engine(config, processes, policy, data.tokenizer)  # where the vLLM engine runs, and what
    # it reads
    distributed = "none" if processes.generating else resolve_mode(config.distributed, processes.world)
    if config.use_peft and distributed == "fsdp":
        raise ValueError("--use-peft under FSDP2 is not supported yet: use --distributed ddp (the adapters are "
                         "small, every rank can hold them and the frozen base)")
    policy_call = wrap_model(policy, distributed, processes.world, device, precision,
                             cpu_offload=config.fsdp_cpu_offload)
    reference_call = None if reference is None else wrap_model(
        reference, distributed, processes.world, device, precision, trainable=False,
        cpu_offload=config.fsdp_cpu_offload)
    if config.use_peft and config.beta != 0.0:  # the same weights, adapters off (or the starting adapter)
        reference_call = AdaptersOff(policy, peft_model)
    held = Models(policy, policy_call, reference, reference_call, device, autocast(device, precision), peft_model,
                  distributed)
    return held, backend, engine


def step_functions(config: GRPOConfig, held: Models, data: RunData, backend: str, engine):
    """(StepFunctions, the generation backend, KernelChoice or None, what FSDP2 gathers for a decode loop): the
    calls the update and the generation seam make. `--kernels plain`: grpo/'s own functions, and grpo/kernels/ is
    never imported; `auto`: grpo.kernels.select_kernels decides, once, which kernels apply (and logs why the others
    do not)."""
    options = config.loss_options()
    estimator = resolve_estimator(config.advantage_estimator, config.multi_objective_aggregation)  # or the plug-in's
    policy = held.policy
    if config.kernels == "plain":
        functions = plain_step_functions(options, config.temperature, config.logprob_chunk_size,
                                         config.cast_lm_head_to_fp32)
        sampler, choice = sample_groups, None
    else:
        from grpo.kernels import select_kernels

        choice = select_kernels(config.kernels, held.device, options, policy,
                                entropy_bonus=config.entropy_control().enabled, fp32_head=config.cast_lm_head_to_fp32,
                                sharded=held.distributed == "fsdp",
                                gradient_checkpointing=config.gradient_checkpointing,
                                micro_batch_metrics=config.metrics_average == "micro_batch",
                                repetition_penalty=config.repetition_penalty != 1.0)
        choice.log_reasons()
        if config.generation_backend != "transformers":  # what our sampler's kernels need of the model
            choice.prepare_model(policy)
        functions = choice.step_functions(options, config.temperature, config.logprob_chunk_size,
                                          config.cast_lm_head_to_fp32)
        sampler = choice.sampler(config.max_prompt_length)
    functions = dataclasses.replace(functions, advantage_estimator=estimator)
    generation = make_generation_backend(backend, policy, data.tokenizer.pad_token_id, sampler, data.tool_set, engine,
                                         config.cache_implementation)
    # what FSDP2 gathers for a decode loop: nothing for a backend with weights of its own (vLLM gathers one parameter
    # at a time as it loads them)
    decode_weights = None if getattr(generation, "own_weights", False) else held.policy_call
    return functions, generation, choice, decode_weights


def optimisation(config: GRPOConfig, held: Models, processes: Processes, folder: RunFolder, total_steps: int):
    """(optimizer, schedule, StepState): AdamW over every optimizer update of the run, the step's counters; on
    --resume all three (and every random generator) as the checkpoint saved them."""
    optimizer, scheduler = optimizer_and_schedule(config, held.policy, held.device, total_steps)
    state = StepState(entropy=config.entropy_control())
    if folder.resume_from is not None and not processes.generating:
        restore(folder.resume_from, state, held, optimizer, scheduler, processes.world, config.sync_ref_model)
    elif folder.resume_from is not None:  # a generation process: only where to start (the weights come from rank 0)
        state.step = load_trainer_state(folder.resume_from)["step"]
    return optimizer, scheduler, state


def run_record(config: GRPOConfig, reward_specs, task: str, kernels, generation, world_size: int,
               distributed: str, changed_on_resume: list[dict]) -> dict:
    """run_config.json (and each checkpoint's): the settings and what actually ran: the reward functions (also those
    passed from Python), the task, the kernels (a grpo.kernels.KernelChoice, None under --kernels plain) and the
    generation backend, and the settings changed on resume."""
    used, off = (kernels.used(), kernels.reasons) if kernels is not None else ({}, {"all": "--kernels plain"})
    record = {**config.to_dict(), "reward_functions": describe_rewards(reward_specs), "task": task,
              "kernels_used": used, "kernels_off": off, "generation": type(generation).__name__,
              "world_size": world_size, "distributed_mode": distributed}
    return {**record, "changed_on_resume": changed_on_resume} if changed_on_resume else record


def total_steps(config: GRPOConfig, data: RunData) -> int:
    """--max-steps, or the steps that take --epochs passes over the training prompts."""
    return config.max_steps or math.ceil(config.epochs * len(data.train_rows) / config.prompts_per_generation)


# ----------------------------------------------------------------------------- what each part reads

def loop_options(config: GRPOConfig, policy, tokenizer, steps: int) -> LoopOptions:
    """The training loop's settings (grpo.core.trainer); the sampler stops at the policy's and tokenizer's EOS ids."""
    sampling = SamplingParams(config.max_completion_length, config.temperature, config.top_p, config.top_k,
                              config.min_p, eos_token_ids(policy, tokenizer), config.repetition_penalty)
    return LoopOptions(
        total_steps=steps, prompts_per_generation=config.prompts_per_generation,
        num_updates=config.updates_per_generation, num_iterations=config.num_iterations,
        group_size=config.num_generations, seed=config.seed, shuffle=config.shuffle_dataset, sampling=sampling,
        behaviour_logprobs=config.corrects_behaviour, dynamic_sampling=config.dynamic_sampling,
        dynamic_sampling_max_rounds=config.dynamic_sampling_max_rounds, reward_clip_range=config.reward_clip_range,
        max_staleness=config.max_staleness, generation_backend=config.generation_backend,
        cache_implementation=config.cache_implementation,
        max_prompt_length=config.max_prompt_length, logging_steps=config.logging_steps,
        log_completions_steps=config.log_completions_steps, save_steps=config.save_steps,
        eval_steps=config.eval_steps,
        eval_max_completion_length=config.eval_max_completion_length or config.max_completion_length,
        eval_batch_size=config.eval_batch_size, report_to=config.report_to,
        checkpoints=checkpoint_options(config))


def update_options(config: GRPOConfig) -> UpdateOptions:
    """The update's settings (grpo.core.update.train_on_rollout)."""
    return UpdateOptions(
        prompts_per_step=config.prompts_per_step, group_size=config.num_generations,
        micro_batch_size=config.micro_batch_size, num_iterations=config.num_iterations,
        max_completion_length=config.max_completion_length, seed=config.seed, beta=config.beta,
        kl_in_reward=bool(config.kl_in_reward), reward_clip_range=config.reward_clip_range,
        scale_rewards=config.scale_rewards, normalize_advantages=config.normalize_advantages,
        mask_truncated_completions=config.mask_truncated_completions, corrects_behaviour=config.corrects_behaviour,
        importance_sampling_mode=config.importance_sampling_mode,
        importance_sampling_clip_min=config.importance_sampling_clip_min,
        importance_sampling_clip_max=config.importance_sampling_clip_max, max_grad_norm=config.max_grad_norm,
        max_bad_steps=config.max_bad_steps, sync_ref_model=config.sync_ref_model,
        ref_model_sync_steps=config.ref_model_sync_steps, ref_model_mixup_alpha=config.ref_model_mixup_alpha,
        metrics_average=config.metrics_average, pad_to_multiple_of=config.pad_to_multiple_of or 1)


def checkpoint_options(config: GRPOConfig) -> CheckpointOptions:
    """What a checkpoint holds and how many are kept (grpo.core.run_state.save)."""
    return CheckpointOptions(keep=config.save_total_limit, merged=config.save_merged,
                             reference=config.sync_ref_model)


def lora_settings(config: GRPOConfig) -> LoraSettings:
    """A fresh adapter's shape and seed (grpo.lora.add_lora)."""
    return LoraSettings(config.lora_r, config.lora_alpha, config.lora_dropout, tuple(config.lora_target_modules),
                        config.seed)


def engine_settings(config: GRPOConfig, precision: str, tokenizer=None):
    """The vLLM engine's settings (grpo.generation.vllm.EngineSettings) for a run in `precision`, each length with
    the flags it adds up from (for messages); with guided decoding, a folder holding the run's `tokenizer` (vLLM's
    structured outputs read the vocabulary from it)."""
    from grpo.generation.vllm import EngineSettings, tokenizer_folder

    longest, terms = config.longest_request()
    group_tokens = config.max_prompt_length + config.num_generations * config.max_completion_length
    return EngineSettings(
        max_model_length=config.vllm_max_model_length or longest,
        max_model_length_from=f"--vllm-max-model-length {config.vllm_max_model_length}"
        if config.vllm_max_model_length else f"the longest request, {terms}",
        group_tokens=group_tokens,
        group_tokens_from=f"--max-prompt-length {config.max_prompt_length} + --num-generations "
        f"{config.num_generations} x --max-completion-length {config.max_completion_length} = {group_tokens} tokens",
        dtype="float32" if precision == "fp32" else "bfloat16",
        gpu_memory_utilization=config.vllm_gpu_memory_utilization, kv_cache_gib=config.vllm_kv_cache_gib,
        enable_sleep_mode=config.vllm_enable_sleep_mode, tensor_parallel_size=config.vllm_tensor_parallel_size,
        model_impl=config.vllm_model_impl, seed=config.seed,
        structured_outputs_regex=config.vllm_structured_outputs_regex,
        tokenizer=tokenizer_folder(tokenizer) if config.vllm_structured_outputs_regex and tokenizer else None)


# ----------------------------------------------------------------------------- the pieces the steps use

def environments(config, environment_factory=None) -> Environments | None:
    """--environment (or trl's `environment_factory` given from Python) probed (grpo.multiturn.environments); None
    without. One --environment is a single factory; several, or one named `name=...`, a dict chosen by rows."""
    if environment_factory is None and not config.environment:
        return None
    if environment_factory is None:
        factories = load_environments(config.environment)
        single = len(factories) == 1 and not any("=" in spec.split(":")[0] for spec in config.environment)
        environment_factory = next(iter(factories.values())) if single else factories
    return Environments.from_factory(environment_factory, config.environment_timeout)


def reward_specs(config, reward_functions=None, environments: Environments | None = None,
                 reward_processing_classes=None) -> list[RewardSpec]:
    """--reward (or the functions given from Python), each environment class's get_reward (weight 1, named after the
    class, as trl), plus DAPO's overlong shaping as one more reward; for rewards that run the model's programs, the
    sandbox's isolation is logged (or, short of --sandbox-isolation full, refused). Reward models are described, not
    loaded (rewards/reward_model.py); `reward_processing_classes` (trl's) gives them tokenizers."""
    model_options = dict(trust_remote_code=config.trust_remote_code, chat_template_kwargs=config.chat_template_kwargs)
    specs = parse_reward_specs(reward_functions if reward_functions is not None else config.reward, **model_options)
    specs = with_processing_classes(specs, reward_processing_classes)  # aligned with the functions given, as trl
    if environments is not None:
        specs += [RewardSpec(name, fn, 1.0) for name, fn in environments.reward_functions()]
        names = [spec.name for spec in specs]
        if len(set(names)) < len(names):
            raise ValueError(f"rewards {names}: an environment's get_reward is logged under its class name, which a "
                             "--reward function has too; rename one")
    if not specs:
        raise ValueError("no reward source: give --reward functions, or an --environment whose class defines "
                         "get_reward")
    check_isolation([spec.fn for spec in specs], config.sandbox_isolation)
    if getattr(config, "overlong_buffer_len", 0) > 0:  # rewards/shaping.py (training's option, not eval.py's)
        shaping = overlong_penalty(config.max_completion_length, config.overlong_buffer_len,
                                   config.overlong_penalty_factor)
        specs = [*specs, RewardSpec("overlong", shaping, 1.0)]
    return specs


def tool_set(config, tokenizer, tools=None, environments: Environments | None = None):
    """--tools (or the functions given from Python) as the sampler's ToolSet (None without tools), the chat
    template's keyword arguments for prompts (the config's, with the tools whose schemas the template shows), and
    with environments the EnvironmentRollouts that sample_rollout plays (else None)."""
    tools = load_tools(config.tools) if tools is None else list(tools)
    if environments is not None:
        every = tools + [tool for methods in environments.tools.values() for tool in methods]
        if every and not check_template_renders_tools(tokenizer, every):
            logger.warning("the chat template does not show tools in the prompt: the task's system prompt must tell "
                           "the model how to call %s", ", ".join(sorted({tool.__name__ for tool in every})))
        toolset = ToolSet(tools, tokenizer, tokenizer.eos_token_id, config.max_tool_calling_iterations,
                          config.chat_template_kwargs or {})
        played = EnvironmentRollouts(environments, toolset, config.chat_template_kwargs or {},
                                     config.max_prompt_length)
        return None, {**(config.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}, played
    if not tools:
        return None, config.chat_template_kwargs, None
    if not check_template_renders_tools(tokenizer, tools):
        logger.warning("the chat template does not show tools in the prompt: the task's system prompt must tell "
                       "the model how to call %s", ", ".join(tool.__name__ for tool in tools))
    toolset = ToolSet(tools, tokenizer, tokenizer.eos_token_id, config.max_tool_calling_iterations,
                      config.chat_template_kwargs or {})
    return toolset, {**(config.chat_template_kwargs or {}), "tools": tools}, None


def check_world(config, world) -> None:
    """Every rank holds whole groups and whole micro-batches: B (of a generation) splits evenly over ranks."""
    size, problems = world.size, []
    if config.prompts_per_generation % size:
        problems.append(f"prompts_per_step ({config.prompts_per_step}, x {config.updates_per_generation} per "
                        f"generation) must split evenly over the {size} processes: each prompt's group stays on one "
                        "rank")
    elif (config.completions_per_generation // size) % (config.micro_batch_size * config.updates_per_generation):
        problems.append(f"each of the {size} processes holds {config.completions_per_generation // size} "
                        f"completions, not a multiple of micro_batch_size ({config.micro_batch_size}) x updates per "
                        f"generation "
                        f"({config.updates_per_generation}): lower --micro-batch-size")
    if config.dynamic_sampling and size > 1:
        logger.info("dynamic sampling under %d processes: each rank keeps its own informative groups", size)
    config.raise_problems(problems)


def resume_changes(config, checkpoint: Path, reward_specs) -> list[dict]:
    """The settings of this run that differ from the checkpoint's run_config.json, `name: old -> new` each, the
    rewards (also those given from Python) by name and weight, and the settings that may change on resume
    (grpo.config.MAY_CHANGE_ON_RESUME) left out. A setting the checkpoint does not record (saved by an older version)
    cannot be compared: a warning names each. Refused (ValueError listing the changes) unless
    config.resume_with_changed_settings; then the run's history of such changes (run_config.json's
    `changed_on_resume`), this resume's last."""
    record_file = checkpoint / "run_config.json"
    if not record_file.is_file():
        logger.warning("--resume %s: the checkpoint records no settings (no run_config.json): nothing checks that "
                       "this run goes on with the settings it started with", checkpoint)
        return []
    saved = json.loads(record_file.read_text())
    now = json.loads(json.dumps(config.to_dict()))  # as the checkpoint stored it (tuples as lists)
    unrecorded = sorted(name for name in now if name not in MAY_CHANGE_ON_RESUME and name not in saved)
    if unrecorded:
        logger.warning("--resume %s: the checkpoint does not record %s (an older run_config.json): they are taken "
                       "as given now, unchecked", checkpoint, ", ".join(unrecorded))
    changes = [f"{name}: {saved[name]!r} -> {value!r}" for name, value in now.items()
               if name not in MAY_CHANGE_ON_RESUME and name in saved and saved[name] != value]
    saved_rewards = [(r["name"], r["weight"]) for r in saved.get("reward_functions", [])]
    rewards = [(spec.name, spec.weight) for spec in reward_specs]
    if "reward_functions" in saved and saved_rewards != rewards:
        changes.append(f"reward functions (name, weight): {saved_rewards} -> {rewards}")
    if changes and not config.resume_with_changed_settings:
        raise ValueError(f"--resume {checkpoint}: these settings differ from the run's ({record_file}):\n  - "
                         + "\n  - ".join(changes) + "\nresume with the run's own settings, or pass "
                         "--resume-with-changed-settings to go on with these (docs/cli.md lists the settings that "
                         "may change on resume)")
    for change in changes:
        logger.warning("resumed with a changed setting (--resume-with-changed-settings): %s", change)
    step = int(checkpoint.name.rpartition("-")[2]) if checkpoint.name.rpartition("-")[2].isdigit() else None
    return saved.get("changed_on_resume", []) + ([{"at_step": step, "changes": changes}] if changes else [])


def find_resume_checkpoint(config) -> Path | None:
    if not config.resume:
        return None
    checkpoint = latest_checkpoint(config.resume)
    if checkpoint is None:
        raise ValueError(f"--resume {config.resume}: holds no complete checkpoint "
                         f"(looked for {Path(config.resume) / 'checkpoints'}/step-*/COMPLETE)")
    return checkpoint


def old_run_files(run_dir: Path, config, resume_from) -> list[str]:
    """The files of another run in the output folder, which this run replaces: refused without --overwrite (kept
    when --resume continues this folder's own run; a checkpoint of another folder resumed into this one replaces
    what it holds). Nothing is removed here: `replace_old_run` does that, after every other check has passed."""
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    own = resume_from is not None and run_dir.resolve() in resume_from.resolve().parents
    if not existing or own:
        return []
    if not config.overwrite and resume_from is not None:
        raise ValueError(f"--output-dir {run_dir} holds another run ({', '.join(existing)}) than the checkpoint "
                         f"resumed ({resume_from}): pass --overwrite to replace it, or resume into another folder")
    if not config.overwrite:
        raise ValueError(f"--output-dir {run_dir} holds another run ({', '.join(existing)}); "
                         "pass --resume to continue it or --overwrite to replace it")
    return existing


def replace_old_run(run_dir: Path, old_files: list[str], replaces: bool = True) -> None:
    """Remove the old run's files (`old_run_files`): the last step of set-up, so that a refused run (a bad model,
    reward, engine setting or row) leaves the earlier run as it was. `replaces`: this process deletes them (under
    torchrun only global rank 0 does, or the ranks would race on them)."""
    for name in old_files if replaces else ():
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def task_rows(config, rows, split: str, purpose: str) -> tuple[list[dict], str]:
    """(rows with a `prompt`, task): loaded from --dataset, or the rows given, checked for their task
    (data/tasks.py)."""
    if rows is None:
        rows, task = load_task_rows(config.dataset, split, config.skip_bad_rows, config.system_prompt,
                                    config.one_shot, config.task_settings, config.task_seed, config.answer_extraction,
                                    config.trust_task_verifier, config.dataset_prompt_column)
    elif config.dataset_prompt_column:  # rows given from Python, their prompts from that column
        rows, task = column_prompts(rows, config.dataset_prompt_column, config.system_prompt, purpose), "prompt"
    elif rows and "prompt" not in rows[0]:  # GSM8K rows given from Python get their chat prompts
        rows, task = add_prompts(rows, config.system_prompt, config.one_shot), "gsm8k"
    else:
        task = "prompt"
    if not rows:
        raise ValueError(f"{config.dataset}[{split}]: the {purpose} dataset is empty")
    return rows, task


def load_policy(config, device, dtype, tokenizer, policy=None, resume_from=None, source=None, setting="--model"):
    """(policy, peft model or None): the model given, or loaded from --model (or the checkpoint resumed), its
    dropout off, its head in fp32 if asked, with LoRA adapters under --use-peft."""
    compute_dtype = torch.float32 if resolve_precision(config.precision, device) == "fp32" else torch.bfloat16
    quantization = four_bit_config(config.bnb_4bit_quant_type, config.use_bnb_nested_quant, compute_dtype) \
        if config.load_in_4bit else None
    given_adapter = policy is not None and hasattr(policy, "peft_config")  # a PeftModel (grpo.trl_api takes one)
    if given_adapter and not config.use_peft:
        raise ValueError("the model given is a PeftModel: set use_peft (its adapter trains)")
    if policy is not None:
        if quantization is not None and not is_quantized(policy):
            raise ValueError("load_in_4bit: the model given was loaded in full precision; load it with a "
                             "BitsAndBytesConfig (or pass its name) to train LoRA over a 4-bit base")
        policy = policy if is_quantized(policy) else policy.to(device, dtype)
        for parameter in policy.parameters():  # a model trained before (a trainer built again to resume) holds
            parameter.grad = None  # gradients, which would make the optimizer's restore skip setting up its state
    elif config.use_peft and resume_from is not None:  # the base from --model, the adapter from the checkpoint
        policy = load_model(config.model, device, dtype, config.trust_remote_code, tokenizer,
                            quantization=quantization)
    else:
        policy = load_model(source or config.model, device, dtype, config.trust_remote_code, tokenizer, setting,
                            quantization)
    if is_quantized(policy) and not config.use_peft:
        raise ValueError("the model given is quantized (4 or 8 bits): its weights cannot train; set use_peft "
                         "(LoRA adapters over the quantized base, QLoRA)")
    if is_quantized(policy):
        keep_4bit_layout_trainable(policy)
    if config.disable_dropout:  # before LoRA: the adapters' dropout is --lora-dropout's
        dropped = disable_dropout(policy)
        if dropped:
            logger.info("disable_dropout: %d dropout rates of the policy set to 0 (%s%s)", len(dropped),
                        ", ".join(dropped[:3]), ", ..." if len(dropped) > 3 else "")
    if config.cast_lm_head_to_fp32:
        cast_head_to_fp32(policy)
    peft_model = None
    if given_adapter:
        peft_model = adopt_peft_model(policy, config.beta != 0.0, resume_from)
        policy = peft_model.get_base_model()
    elif config.use_peft:  # LoRA (grpo.lora): the loop keeps calling the Hugging Face model, its projections adapted
        adapter = str(resume_from) if resume_from is not None else config.peft_adapter
        reference_adapter = config.peft_adapter if config.beta != 0.0 else None
        peft_model = add_lora(policy, lora_settings(config), adapter, reference_adapter=reference_adapter)
        peft_model.peft_config["default"].base_model_name_or_path = config.model
        policy = peft_model.get_base_model()
    if peft_model is not None:
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        logger.info("LoRA: %d trainable parameters of %d", trainable, sum(p.numel() for p in policy.parameters()))
    return policy, peft_model


def use_gradient_checkpointing(policy) -> None:
    """Recompute each layer's activations in backward (after the reference was copied: it keeps its cache)."""
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False


def load_reference(config, device, precision: str, tokenizer, policy, resume_from=None, policy_given=False):
    """The frozen reference model, or None: with beta = 0 there is none; under LoRA the policy with its adapters
    off is the reference (grpo.lora.AdaptersOff). Otherwise a copy of the starting policy; on resume the run's
    mixed reference (sync_ref_model) or --model again."""
    if config.beta == 0.0 or config.use_peft:
        return None
    synced = None if resume_from is None else resume_from / REFERENCE
    if synced is not None and config.sync_ref_model and synced.is_dir():  # the mixed reference of the run
        reference = load_model(str(synced), device, torch.float32, False, tokenizer, "--resume")
    elif resume_from is not None and not policy_given:
        reference = load_model(config.model, device, torch.float32, config.trust_remote_code, tokenizer)
    else:
        reference = copy.deepcopy(policy)
    ref_dtype = torch.bfloat16 if precision != "fp32" else torch.float32
    reference = reference.to(device, ref_dtype).eval().requires_grad_(False)
    if config.cast_lm_head_to_fp32:
        cast_head_to_fp32(reference)
    return reference


def optimizer_and_schedule(config, policy, device, total_steps: int):
    """AdamW (or 8-bit AdamW) with weight decay on matrices only (not norms and biases, as HF Trainer), and the
    LR schedule over every optimizer update of the run."""
    decay = [p for p in policy.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in policy.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = make_optimizer(config.optim, groups, device, config.learning_rate,
                               (config.adam_beta1, config.adam_beta2), config.adam_epsilon)
    total_updates = total_steps * config.num_iterations * config.updates_per_generation
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_updates)
    scheduler = make_scheduler(config.lr_scheduler_type, optimizer, warmup, total_updates)
    return optimizer, scheduler


def autocast(device: torch.device, precision: str):
    """bf16 autocast (precision `bf16`) or nothing; a new context each call (one per thread that samples)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def use_cpu_huge_pages() -> None:
    """Ask PyTorch's CPU allocator to back tensors of 2 MiB and more with transparent huge pages.

    A training step allocates vocabulary-sized tensors; with 4 KiB pages their page faults cost more than
    the arithmetic. PyTorch reads THP_MEM_ALLOC_ENABLE once, at its first such allocation, so this must be
    called before any large tensor exists (train.py and Trainer call it first). A value the user set wins.
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def vllm_engine(config, processes: Processes, policy, tokenizer=None) -> tuple[str, object]:
    """(the backend this process samples with, what builds vLLM's backend given the model, or None), placing the
    engine (docs/vllm.md): colocate, in every training process; with generation processes, in those only (the
    training processes then evaluate with our sampler); a server with --max-staleness, in the background thread
    that samples ahead (this process evaluates with our sampler). Called before the policy is wrapped (FSDP2).
    `tokenizer`: the run's, which guided decoding needs the engine to read."""
    generators, generating, world = processes.generators, processes.generating, processes.world
    if config.generation_backend != "vllm":
        return config.generation_backend, None
    if config.vllm_mode == "server":  # vLLM's own server, apart from the run (GRPOConfig refuses what cannot go)
        from grpo.generation.vllm_server import ServerSettings, VLLMServerGenerate, base_url

        settings = ServerSettings(base_url(config), config.vllm_server_timeout, config.vllm_group_port,
                                  config.model, config.vllm_structured_outputs_regex)
        server = functools.partial(VLLMServerGenerate, settings=settings, sender=world.rank == 0, world=world)
        if config.max_staleness is None:
            return "vllm", server
        if generators or generating:
            raise ValueError("--vllm-mode server with --max-staleness under torchrun: the server is the generator, so "
                             "no rank needs to be one; run the training ranks without --max-staleness, or one "
                             "process with it")
        return "sampler", server  # the background thread samples on the server; this process evaluates with ours
    if config.max_staleness is not None and not generators and not generating:
        raise ValueError("--max-staleness with --generation-backend vllm needs generation processes: launch with "
                         "torchrun and --generation-processes, so that the engine has ranks of its own (a background "
                         "thread would need a second engine in the trainer's process)")
    if generators and not generating:
        return "sampler", None
    if not generating and config.vllm_tensor_parallel_size > 1:
        raise ValueError("--vllm-tensor-parallel-size > 1 needs generation processes (the engine then starts its own "
                         "workers); a colocated engine spans its own process only")
    from grpo.generation.vllm import VLLMGenerate, engine_source

    return "vllm", functools.partial(VLLMGenerate, source=engine_source(policy),
                                     settings=engine_settings(config, processes.precision, tokenizer),
                                     rows=config.completions_per_generation // max(world.size, 1),  # this rank's
                                     in_process=not generating, distributed=not generating and world.size > 1)
