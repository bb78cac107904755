"""What a run needs before its first step, each piece checked early with a message that names the bad setting:
the rewards, the run folder and the checkpoint to resume, the data, the policy (dropout, fp32 head, LoRA), the
frozen reference, gradient checkpointing, and the optimizer with its schedule.

grpo.loop.trainer.Trainer calls these in order; data is loaded and checked before any model, so a bad row fails in
seconds, not after loading a model.
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
from pathlib import Path

import torch

from data import add_prompts, load_task_rows
from grpo.loop.checkpoint import REFERENCE, latest_checkpoint
from grpo.loop.lora import add_lora
from grpo.algorithm.advantages import resolve_estimator
from grpo.algorithm.loss import LossOptions
from grpo.algorithm.sampler import sample_groups
from grpo.loop.update import make_scheduler, plain_step_functions
from grpo.loop.environments import EnvironmentRollouts, Environments, load_environments
from grpo.loop.tools import ToolSet, check_template_renders_tools, load_tools
from grpo.models import cast_head_to_fp32, disable_dropout, load_model, make_optimizer
from rewards import RewardSpec, parse_reward_specs
from rewards.reward_model import with_processing_classes
from rewards.sandbox import check_isolation
from rewards.shaping import overlong_penalty

logger = logging.getLogger("grpo")

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "eval", "run_config.json", "tensorboard", "wandb",
             "wandb_run_id")


def environments(config, environment_factory=None) -> Environments | None:
    """--environment (or trl's `environment_factory` given from Python) probed (grpo.loop.environments); None
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
                        f"generation) must split evenly over the {size} processes: each prompt's group stays on one rank")
    elif (config.completions_per_generation // size) % (config.micro_batch_size * config.updates_per_generation):
        problems.append(f"each of the {size} processes holds {config.completions_per_generation // size} completions, "
                        f"not a multiple of micro_batch_size ({config.micro_batch_size}) x updates per generation "
                        f"({config.updates_per_generation}): lower --micro-batch-size")
    if config.dynamic_sampling and size > 1:
        logger.info("dynamic sampling under %d processes: each rank keeps its own informative groups", size)
    config.raise_problems(problems)


def resume_changes(config, checkpoint: Path, reward_specs) -> list[dict]:
    """The settings of this run that differ from the checkpoint's run_config.json, `name: old -> new` each, the
    rewards (also those given from Python) by name and weight, and the settings that may change on resume
    (grpo.config.MAY_CHANGE_ON_RESUME) left out. A setting the checkpoint does not record (saved by an older version)
    is not compared. Refused (ValueError listing them) unless config.resume_with_changed_settings; then the run's
    history of such changes (run_config.json's `changed_on_resume`), this resume's last."""
    from grpo.config import MAY_CHANGE_ON_RESUME

    record_file = checkpoint / "run_config.json"
    if not record_file.is_file():
        return []
    saved = json.loads(record_file.read_text())
    now = json.loads(json.dumps(config.to_dict()))  # as the checkpoint stored it (tuples as lists)
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
    with --resume). Nothing is removed here: `replace_old_run` does that, after every other check has passed."""
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not existing or resume_from is not None:
        return []
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
    """(rows with a `prompt`, task): loaded from --dataset, or the rows given, checked for their task (data/tasks.py)."""
    if rows is None:
        rows, task = load_task_rows(config.dataset, split, config.skip_bad_rows, config.system_prompt, config.one_shot,
                                    config.task_settings, config.task_seed, config.answer_extraction,
                                    config.trust_task_verifier)
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
    if policy is not None:
        policy = policy.to(device, dtype)
    elif config.use_peft and resume_from is not None:  # the base from --model, the adapter from the checkpoint
        policy = load_model(config.model, device, dtype, config.trust_remote_code, tokenizer)
    else:
        policy = load_model(source or config.model, device, dtype, config.trust_remote_code, tokenizer, setting)
    if config.disable_dropout:  # before LoRA: the adapters' dropout is --lora-dropout's
        dropped = disable_dropout(policy)
        if dropped:
            logger.info("disable_dropout: %d dropout rates of the policy set to 0 (%s%s)", len(dropped),
                        ", ".join(dropped[:3]), ", ..." if len(dropped) > 3 else "")
    if config.cast_lm_head_to_fp32:
        cast_head_to_fp32(policy)
    peft_model = None
    if config.use_peft:  # LoRA (grpo.loop.lora): the loop keeps calling the Hugging Face model, its projections adapted
        adapter = str(resume_from) if resume_from is not None else config.peft_adapter
        peft_model = add_lora(policy, config, adapter, reference_adapter=config.peft_adapter if config.beta != 0.0 else None)
        peft_model.peft_config["default"].base_model_name_or_path = config.model
        policy = peft_model.get_base_model()
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        logger.info("LoRA: %d trainable parameters of %d", trainable, sum(p.numel() for p in policy.parameters()))
    return policy, peft_model


def use_gradient_checkpointing(policy) -> None:
    """Recompute each layer's activations in backward (after the reference was copied: it keeps its cache)."""
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False


def load_reference(config, device, precision: str, tokenizer, policy, resume_from=None, policy_given=False):
    """The frozen reference model, or None: with beta = 0 there is none; under LoRA the policy with its adapters
    off is the reference (grpo.loop.lora.AdaptersOff). Otherwise a copy of the starting policy; on resume the run's
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
    optimizer = make_optimizer(config.optim, groups, config, device)
    total_updates = total_steps * config.num_iterations * config.updates_per_generation
    scheduler = make_scheduler(config.lr_scheduler_type, optimizer, math.ceil(config.warmup_ratio * total_updates),
                               total_updates)
    return optimizer, scheduler


def step_functions(config, device, policy, distributed: str, entropy_bonus: bool):
    """(StepFunctions, group sampler, KernelChoice or None): the calls the update and the generation seam make.
    `--kernels plain`: grpo/'s own functions, no KernelChoice, and grpo/kernels/ is never imported; `auto`:
    grpo.kernels.select_kernels decides, once, which kernels apply (and logs why the others do not)."""
    options = LossOptions.from_config(config)
    estimator = resolve_estimator(config.advantage_estimator, config.multi_objective_aggregation)  # or the plug-in's
    if config.kernels == "plain":
        functions = plain_step_functions(options, config.temperature, config.logprob_chunk_size,
                                         config.cast_lm_head_to_fp32)
        return dataclasses.replace(functions, advantage_estimator=estimator), sample_groups, None
    from grpo.kernels import select_kernels

    choice = select_kernels(config.kernels, device, options, policy, entropy_bonus=entropy_bonus,
                            fp32_head=config.cast_lm_head_to_fp32, sharded=distributed == "fsdp",
                            gradient_checkpointing=config.gradient_checkpointing)
    choice.log_reasons()
    if config.generation_backend != "transformers":  # what our sampler's kernels need of the model (generate: nothing)
        choice.prepare_model(policy)
    functions = choice.step_functions(options, config.temperature, config.logprob_chunk_size,
                                      config.cast_lm_head_to_fp32)
    return (dataclasses.replace(functions, advantage_estimator=estimator), choice.sampler(config.max_prompt_length),
            choice)


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


def vllm_engine(config, world, generators: list[int], generating: bool, precision: str,
                policy) -> tuple[str, object]:
    """(the backend this process samples with, what builds vLLM's backend given the model, or None), placing the engine
    (docs/vllm.md): colocate, in every training process; with generation processes, in those only (the
    training processes then evaluate with our sampler). Called before the policy is wrapped (FSDP2)."""
    if config.generation_backend != "vllm":
        return config.generation_backend, None
    if config.max_staleness is not None and not generators and not generating:
        raise ValueError("--max-staleness with --generation-backend vllm needs generation processes: launch with "
                         "torchrun and --generation-processes, so that the engine has ranks of its own (a background "
                         "thread would need a second engine in the trainer's process)")
    if generators and not generating:
        return "sampler", None
    if not generating and config.vllm_tensor_parallel_size > 1:
        raise ValueError("--vllm-tensor-parallel-size > 1 needs generation processes (the engine then starts its own "
                         "workers); a colocated engine spans its own process only")
    from grpo.loop.vllm_generation import VLLMGenerate, engine_source

    return "vllm", functools.partial(VLLMGenerate, source=engine_source(policy),
                                     settings=config.engine_settings(precision),
                                     rows=config.completions_per_generation // max(world.size, 1),  # this rank's
                                     in_process=not generating, distributed=not generating and world.size > 1)
