"""trl's GRPOTrainer on this engine: trl 1.16's constructor and the calls scripts make afterwards.

    from grpo.trl_api import GRPOConfig, GRPOTrainer      # the one line that changes in a trl script
    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), train_dataset=...)
    trainer.train()

The settings become our GRPOConfig (grpo.trl_api.config), the rows a list, the reward functions RewardSpecs with
trl's weights, and grpo.core.trainer.Trainer runs the loop. What a trl script reads back is kept as trl keeps it:
`state` (transformers' TrainerState: global_step in optimizer steps, log_history with trl's metric names, one entry
every logging_steps holding the mean over those steps, as trl), `callbacks` (transformers' TrainerCallback, their
`control` honoured: should_training_stop, should_save, should_evaluate), and `output_dir/checkpoint-N` (N in
optimizer steps: a link to our atomic checkpoint, output_dir/checkpoints/step-S, which `from_pretrained` loads and
`train(resume_from_checkpoint=...)` resumes exactly). docs/trl.md is the guide.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpo.config import GRPOConfig as OurConfig
from grpo.core.checkpoint import latest_checkpoint
from grpo.core.trainer import DataOrder
from grpo.lora import trained_adapter_config
from grpo.trl_api.config import GRPOConfig
from grpo.trl_api.rollouts import RolloutFunction, TrlOrder
from rewards.registry import MODEL_PREFIX, RewardModel, RewardSpec

logger = logging.getLogger("grpo")
TRL_REWARD_ARGUMENTS = ("trainer_state", "log_metric", "log_extra")  # what trl passes a reward function too
TRL_PROMPT_COLUMNS = ("prompt", "image", "images")  # what remove_unused_columns=True keeps, as trl
TRAINER_STATE = "trainer_state.json"  # in each checkpoint, as transformers writes it
LAST_VALUE = ("learning_rate", "grad_norm", "num_tokens")  # logged as the last value; the others as the mean, as trl
# what transformers logs at logging steps only; trl's own metrics also go into the summary at the end
TRANSFORMERS_KEYS = ("loss", "learning_rate", "grad_norm")
OURS_ONLY = ("advantages/", "answers/", "cpu_threads", "sample_time", "skipped_updates", "tokens_per_second",
             "dynamic_sampling/")  # our metrics (metrics.jsonl keeps them) that trl does not log
LORA_DEFAULTS = dict(bias="none", modules_to_save=None, use_rslora=False, use_dora=False, init_lora_weights=True)


def _stream_rows(dataset, per_generation: int, generations: int, seed: int, shuffle: bool):
    """The rows an IterableDataset gives trl's sampler for `generations` generations of `per_generation` prompts, in
    trl's order: each pass over the stream shuffled by datasets' buffered shuffle seeded by `seed` (seed + the pass
    under set_epoch), cut into generations, an incomplete last one dropped. Returns (rows, the generation each pass
    starts at)."""
    rows, starts = [], []
    for epoch in itertools.count():
        source = dataset.shuffle(seed=seed) if shuffle else dataset
        source.set_epoch(epoch)
        starts.append(len(rows) // per_generation)
        chunk, complete = [], 0
        for row in source:
            chunk.append(dict(row))
            if len(chunk) == per_generation:
                rows, chunk, complete = rows + chunk, [], complete + 1
                if len(rows) >= per_generation * generations:
                    return rows, starts
        if not complete:
            raise ValueError(f"train_dataset (an IterableDataset) yields fewer prompts than one generation takes "
                             f"({per_generation})")


def _rows(dataset, name: str, remove_unused_columns: bool) -> list[dict] | None:
    """A datasets Dataset or IterableDataset (or a list of dicts) as rows."""
    if dataset is None:
        return None
    rows = [dict(row) for row in dataset]  # an IterableDataset (eval_dataset) read to its end, as trl evaluates
    if not rows:
        raise ValueError(f"{name} is empty")
    if "prompt" not in rows[0]:
        raise ValueError(f"{name} has no 'prompt' column (its columns: {', '.join(rows[0])}); map your rows to "
                         "{'prompt': ...} as trl expects")
    for index, row in enumerate(rows):
        prompt = row.get("prompt")
        chat = isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)
        if not (isinstance(prompt, str) and prompt) and not chat:
            raise ValueError(f"{name} row {index}: its prompt is {prompt!r}, neither a text nor chat messages "
                             "[{'role': ..., 'content': ...}]")
    if remove_unused_columns:
        rows = [{key: value for key, value in row.items() if key in TRL_PROMPT_COLUMNS} for row in rows]
    return rows


def _eval_set(dataset, seed: int, remove_unused_columns: bool) -> tuple[list[dict] | None, bool]:
    """(rows, streamed): an IterableDataset is read in trl's order, datasets' buffered shuffle seeded by `seed` (the
    same at every evaluation), and evaluated in that order; a Dataset's order is drawn at evaluation."""
    streamed = dataset is not None and not hasattr(dataset, "__len__")
    return _rows(dataset.shuffle(seed=seed) if streamed else dataset, "eval_dataset", remove_unused_columns), streamed


def _window_means(window: dict[str, list[float]], last: tuple[str, ...]) -> dict:
    """Each key's values over a logging window as trl logs them: the last value for `last`'s keys, else the mean of
    those not NaN (None when all are)."""
    means = {}
    for key, values in window.items():
        kept = [value for value in values if not math.isnan(value)]
        means[key] = values[-1] if key in last else (sum(kept) / len(kept) if kept else None)
    return means


def _with_trainer_arguments(fn, arguments: Callable[[], dict]):
    """`fn` called as trl calls a reward function: with trainer_state (transformers' TrainerState), log_metric(name,
    value) (logged in log_history as the mean over the logging window, as trl) and log_extra(column, values) (trl's
    completions table; not logged here), which `arguments()` gives at each call. Its signature without those three,
    so that the run's column check does not take them for dataset columns."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **kwargs, **arguments())

    signature = inspect.signature(fn)
    call.__signature__ = signature.replace(parameters=[parameter for parameter in signature.parameters.values()
                                                      if parameter.name not in TRL_REWARD_ARGUMENTS])
    return call


def _reward_specs(reward_funcs, reward_weights, arguments: Callable[[], dict]) -> list[RewardSpec]:
    """trl's reward_funcs (a function, a model id or folder, a loaded model, or a list of them) and reward_weights."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(reward_weights)} entries for {len(funcs)} reward functions")
    weights = reward_weights if reward_weights is not None else [1.0] * len(funcs)
    specs = []
    for fn, weight in zip(funcs, weights):
        if isinstance(fn, str):  # trl: a string is a reward model's id or folder
            model = RewardModel(fn.removeprefix(MODEL_PREFIX))
            specs.append(RewardSpec(model.name, model, float(weight)))
        elif isinstance(fn, torch.nn.Module):
            model = RewardModel(fn)
            specs.append(RewardSpec(model.name, model, float(weight)))
        elif callable(fn):
            specs.append(RewardSpec(getattr(fn, "__name__", "reward"), _with_trainer_arguments(fn, arguments),
                                    float(weight)))
        else:
            raise ValueError(f"reward_funcs: {fn!r} is neither a function, a model id nor a model")
    return specs


def _lora_settings(peft_config, where: str = "peft_config") -> dict:
    """peft's LoraConfig as our LoRA settings; options not built here are refused. `where`: "model" for the config of
    a PeftModel given, whose adapter is already initialized (any init_lora_weights)."""
    if peft_config is None:
        return {}
    defaults = {key: value for key, value in LORA_DEFAULTS.items() if where != "model" or key != "init_lora_weights"}
    different = [f"{key}={getattr(peft_config, key, value)!r}" for key, value in defaults.items()
                 if getattr(peft_config, key, value) != value]
    if type(peft_config).__name__ != "LoraConfig" or different:
        raise ValueError(f"{where}: only a LoraConfig with {defaults} is supported here"
                         + (f" (got {', '.join(different)})" if different else ""))
    targets = peft_config.target_modules
    return dict(use_peft=True, lora_r=peft_config.r, lora_alpha=peft_config.lora_alpha,
                lora_dropout=peft_config.lora_dropout,
                **({"lora_target_modules": sorted(targets)} if targets and not isinstance(targets, str) else {}))


def _quantization_settings(quantization_config, model) -> dict:
    """transformers' BitsAndBytesConfig as our 4-bit settings (QLoRA); for a model given loaded, ignored (as trl)."""
    if quantization_config is None:
        return {}
    if not isinstance(model, str):
        logger.warning("quantization_config is ignored: the model is already loaded (as trl)")
        return {}
    get = functools.partial(getattr, quantization_config)
    refused = [(not get("load_in_4bit", False), "only 4-bit weights (load_in_4bit=True) train here, under LoRA"),
               (str(get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.") != "uint8",
                "bnb_4bit_quant_storage: the 4-bit blocks are stored as uint8 here"),
               (get("llm_int8_skip_modules", None) is not None, "llm_int8_skip_modules: every linear layer but the "
                                                                "output head is quantized here")]
    problems = [f"quantization_config: {why}" for bad, why in refused if bad]
    OurConfig.raise_problems(problems)
    compute = str(get("bnb_4bit_compute_dtype", "float32")).removeprefix("torch.")
    logger.info("quantization_config: the 4-bit weights are computed in the run's precision (bf16 or fp32), "
                "bnb_4bit_compute_dtype=%s aside", compute)
    return dict(load_in_4bit=True, bnb_4bit_quant_type=get("bnb_4bit_quant_type", "nf4"),
                use_bnb_nested_quant=bool(get("bnb_4bit_use_double_quant", False)))


class GRPOTrainer:
    """trl 1.16's GRPOTrainer, run by grpo.core.trainer.Trainer (module docstring)."""

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None, tools=None, environment_factory=None, rollout_func=None, quantization_config=None):
        from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        self.args = args if args is not None else GRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        refused = [(optimizers is not None and tuple(optimizers) != (None, None),
                    "optimizers: the optimizer and schedule are built from args (optim, lr_scheduler_type)"),
                   (rollout_func is not None and (tools or environment_factory),
                    "rollout_func with tools or environment_factory: the function samples whole rollouts here"),
                   (self.args.cache_implementation is not None and (tools or environment_factory),
                    "cache_implementation with tools or environment_factory: tool calls run in our sampler (or "
                    "vLLM), which keep their own KV cache; leave cache_implementation unset"),
                   (hasattr(model, "peft_config") and peft_config is not None,
                    "model is a PeftModel and peft_config is given: merge and unload its adapter first, as trl asks")]
        problems = [why for bad, why in refused if bad]
        if isinstance(eval_dataset, dict):
            if len(eval_dataset) != 1:
                problems.append("eval_dataset: one evaluation set is supported here, got a dict of "
                                f"{len(eval_dataset)}")
            eval_dataset = next(iter(eval_dataset.values()), None)
        OurConfig.raise_problems(problems)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        settings = self.args.our_settings(world_size)
        settings.update(model=str(name) if isinstance(model, str) else (str(name) or "given"),
                        dataset="train_dataset", overwrite=True, metrics_average="micro_batch",
                        **(_lora_settings(trained_adapter_config(model), "model") if hasattr(model, "peft_config")
                           else _lora_settings(peft_config)),
                        **_quantization_settings(quantization_config, model))
        self.stream_starts = None  # an IterableDataset's: the generation each pass over it starts at
        if train_dataset is not None and not hasattr(train_dataset, "__len__"):
            if self.args.max_steps <= 0:
                raise ValueError("train_dataset is an IterableDataset: set max_steps (its length is unknown), as trl")
            train_dataset, self.stream_starts = _stream_rows(
                train_dataset, OurConfig(**settings).prompts_per_generation, settings["max_steps"], self.args.seed,
                self.args.shuffle_dataset)
        self.train_rows = _rows(train_dataset, "train_dataset", self.args.remove_unused_columns)
        self.eval_rows, self.eval_streamed = _eval_set(eval_dataset, self.args.seed, self.args.remove_unused_columns)
        if self.train_rows is None:
            raise ValueError("train_dataset is required")
        if settings["eval_steps"] and self.eval_rows is None:
            raise ValueError(f"eval_strategy={self.args.eval_strategy!r} needs an eval_dataset")
        # evaluation is trl's (grpo.trl_api.evaluation), run here every eval_every of our steps, not by the loop
        self.eval_every, settings["eval_steps"] = settings["eval_steps"], 0
        self.num_generations_eval = self.args.num_generations_eval or self.args.num_generations
        if self.eval_rows is not None and self.args.per_device_eval_batch_size % self.num_generations_eval:
            raise ValueError(f"per_device_eval_batch_size={self.args.per_device_eval_batch_size} must be a multiple of "
                             f"num_generations_eval={self.num_generations_eval} here (trl lets a group span "
                             "processes in evaluation; this evaluation keeps each group on one)")
        settings["max_prompt_length"] = self._longest_prompt(processing_class, settings, tools)
        self.settings = settings
        if self.args.max_steps <= 0:  # transformers: epochs x the optimizer steps of one pass over the sampler's
            # generations (an epoch's incomplete last one dropped), rounded up; here to whole generations
            generations = len(self.train_rows) // OurConfig(**settings).prompts_per_generation
            settings["max_steps"] = max(1, math.ceil(math.ceil(self.args.num_train_epochs * generations
                                                               * self.updates_per_step) / self.updates_per_step))
        self.rewards = _reward_specs(reward_funcs, self.args.reward_weights, lambda: dict(
            trainer_state=self.state, log_metric=self._log_metric, log_extra=self._log_extra))
        self.logged_metrics: dict[str, list[float]] = {}  # the reward functions' log_metric, until the next step
        self.extra_columns: dict[str, list] = {}  # the reward functions' log_extra, the last values of each column
        self.last_completions = None  # (records, extra columns) of the last generation, for log_completions
        self.policy, self.processing_class = (None if isinstance(model, str) else model), processing_class
        self.reward_processing_classes, self.tools, self.environment_factory = (reward_processing_classes, tools,
                                                                                environment_factory)
        self.rollout_func = rollout_func
        self.num_generations = self.args.num_generations  # what a rollout_func reads
        OurConfig(**settings).validate()  # every setting checked now, before any model loads
        for line in self.args.left_fields():
            logger.warning("trl setting without effect here: %s", line)
        self.state, self.control = TrainerState(), TrainerControl()
        # transformers advises adding its DefaultFlowCallback; here the loop schedules logging and saving itself
        quiet = logging.getLogger("transformers.trainer_callback")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        self.callback_handler = CallbackHandler(list(callbacks or []), model, processing_class, None, None)
        quiet.setLevel(level)
        self.engine = None  # grpo.core.trainer.Trainer, built by train() or evaluate() (it may resume)
        self.order, self._in_schedule = None, False  # trl's data order (grpo.trl_api.rollouts.TrlOrder)
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def _longest_prompt(self, tokenizer, settings: dict, tools) -> int:
        """trl does not cut prompts: the longest prompt of the datasets in tokens, as the chat template renders it
        (our max_prompt_length, so that none is cut)."""
        from grpo.generation.prompts import encode_prompts
        from grpo.models import load_tokenizer

        tokenizer = tokenizer or load_tokenizer(settings["model"], settings["trust_remote_code"])
        kwargs = {**(settings["chat_template_kwargs"] or {}), **({"tools": list(tools)} if tools else {})}
        ids, _, _ = encode_prompts(tokenizer, self.train_rows + (self.eval_rows or []), 10 ** 9, progress=False,
                                   where="train_dataset", chat_template_kwargs=kwargs)
        return max(len(prompt) for prompt in ids)

    # ---- the engine
    def _build(self, resume: str | None = None):
        from grpo.core.trainer import Trainer

        if self.engine is not None:
            self.engine.close()
        config = OurConfig(**{**self.settings, "resume": resume, "overwrite": resume is None})
        if self.args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.args.tf32)
        self.engine = Trainer(config, policy=self.policy, tokenizer=self.processing_class,
                              reward_functions=self.rewards, train_rows=self.train_rows, eval_rows=self.eval_rows,
                              tools=self.tools, environment_factory=self.environment_factory,
                              reward_processing_classes=self.reward_processing_classes,
                              sampled_columns=self.rollout_func is not None)  # its keys reach the rewards
        self.processing_class = self.engine.data.tokenizer
        # trl's order of prompts and of micro-batch rows, and its rollout_func where our sampler would run
        order = TrlOrder(len(self.train_rows), self.engine.loop.prompts_per_generation, self.args.seed,
                         self.args.shuffle_dataset, self._evaluates_after, self.engine.world.rank, self.stream_starts)
        self.engine.order, self.order = DataOrder(order.prompts, order.rows), order
        if self.rollout_func is not None:
            call = RolloutFunction(lambda prompts: self.rollout_func(prompts, self))
            self.engine.sample_rollout = call.sample_rollout
        handler = self.callback_handler
        handler.model, handler.processing_class = self.engine.policy, self.processing_class
        handler.optimizer, handler.lr_scheduler = self.engine.optimizer, self.engine.scheduler
        return self.engine

    def _evaluates_after(self, step: int) -> bool:
        """Whether the schedule evaluates after our step `step` (0-based): every eval_every steps."""
        return bool(self.eval_every) and (step + 1) % self.eval_every == 0

    @property
    def model(self):
        """The policy as trl's trainer holds it: the peft model under LoRA (its adapters are what trains)."""
        if self.engine is None:
            return self.policy
        return self.engine.models.peft_model if self.engine.models.peft_model is not None else self.engine.policy

    @property
    def updates_per_step(self) -> int:
        return self.settings["num_iterations"] * max(1, (self.settings["steps_per_generation"] or 1)
                                                     // self._accumulation())

    def _accumulation(self) -> int:
        return self.args.gradient_accumulation_steps

    # ---- what scripts call
    def train(self, resume_from_checkpoint: str | bool | None = None, **unused):
        """Train to max_steps (or num_train_epochs); resume_from_checkpoint: a checkpoint-N folder, or True for the
        latest in output_dir (as transformers)."""
        if unused:
            raise TypeError(f"train() got unexpected arguments {sorted(unused)}")
        resume = resume_from_checkpoint  # as transformers: args.resume_from_checkpoint is for the script to pass
        if resume is True:
            resume = self.args.output_dir
            if latest_checkpoint(resume) is None:
                raise ValueError(f"No valid checkpoint found in output directory ({resume})")
        from transformers.trainer_callback import TrainerState

        # the engine evaluate() built is the one train() would build; resuming builds it from the checkpoint
        if resume:
            engine = self._build(str(Path(resume).resolve()))
        else:
            engine = self.engine or self._build(None)

        args, updates = self.args, self.updates_per_step
        self.state = state = TrainerState()  # as transformers: each train() starts a fresh state (log_history too)
        if resume and (engine.run.resume_from / TRAINER_STATE).exists():
            self.state = state = TrainerState.load_from_json(str(engine.run.resume_from / TRAINER_STATE))
        state.max_steps = engine.loop.total_steps * updates
        state.global_step = engine.step * updates
        state.eval_steps = self.eval_every * updates
        state.num_train_epochs = math.ceil(args.num_train_epochs) if args.max_steps <= 0 else 1
        # trl's epoch: optimizer steps over those of one pass, whose last incomplete generation is dropped
        generations_per_epoch = max(len(self.train_rows) // engine.loop.prompts_per_generation, 1)
        window: dict[str, list[float]] = {}
        losses: list[float] = []
        started = time.time()
        handler = self.callback_handler
        self.control = handler.on_train_begin(args, state, self.control)
        self.control = handler.on_epoch_begin(args, state, self.control)
        self.control = handler.on_step_begin(args, state, self.control)
        link_root = Path(args.output_dir)

        log_every = math.ceil(state.max_steps * args.logging_steps) if args.logging_steps < 1 \
            else int(args.logging_steps)  # in optimizer steps, as transformers
        state.logging_steps, state.save_steps = log_every, self.settings["save_steps"] * updates
        evaluated_last = False  # an evaluation at the last step leaves trl's model in eval mode (see the summary)

        def step_end(step: int, metrics: dict, per_update: list | None):
            """After each of our steps: trl's events and log entries for each optimizer update it made."""
            nonlocal evaluated_last
            numbers = {key: float(value) for key, value in metrics.items()
                       if isinstance(value, (int, float)) and not isinstance(value, bool)
                       and not key.startswith(OURS_ONLY)}
            numbers.update(self._take_logged_metrics())
            save = evaluate = stop = False  # each update's callbacks may ask; the next on_step_begin clears them
            timing = {key: numbers[key] / len(per_update or [{}]) for key in ("step_time",) if key in numbers}
            # the generation's metrics go with its first update; each update's loss statistics with that update
            for index, own in enumerate(per_update or [{}]):
                if index:
                    self.control = handler.on_step_begin(args, state, self.control)
                state.global_step = (step - 1) * updates + index + 1
                epoch = state.epoch or 0.0
                if self.stream_starts is None:
                    state.epoch = state.global_step / (generations_per_epoch * updates)
                else:  # the pass over the stream, and its steps over max_steps
                    passes = [start for start in self.stream_starts if start < step]
                    state.epoch = len(passes) - 1 + (state.global_step - passes[-1] * updates) / state.max_steps
                self.control = handler.on_step_end(args, state, self.control)
                if math.floor(state.epoch) > math.floor(epoch) and state.global_step < state.max_steps:
                    self.control = handler.on_epoch_end(args, state, self.control)  # a pass over the prompts ended
                    self.control = handler.on_epoch_begin(args, state, self.control)
                for key, value in ({**numbers, **own} if index == 0 else {**own, **timing}).items():
                    window.setdefault(key, []).append(float(value))
                losses.append(own.get("loss", numbers.get("loss", 0.0)))
                due = state.global_step % log_every == 0 or self.control.should_log or (
                    args.logging_first_step and state.global_step == 1)
                if args.logging_strategy != "no" and due:
                    self.log(_window_means(window, LAST_VALUE))
                    window.clear()
                    self.control.should_log = False
                save, evaluate = save or self.control.should_save, evaluate or self.control.should_evaluate
                stop = stop or self.control.should_training_stop
            last = step * updates >= state.max_steps
            # transformers evaluates every eval_steps, and at the last step when that is not one of them
            scheduled = bool(self.eval_every) and step % self.eval_every == 0  # TrlOrder counts these draws
            if scheduled or (self.eval_every and last) or evaluate:
                self._in_schedule = scheduled
                self.evaluate()
                self._in_schedule, evaluated_last = False, last
            self.control.should_save = self.control.should_evaluate = False
            if not stop and step < engine.loop.total_steps:  # nothing runs between this step's end and the next
                self.control = handler.on_step_begin(args, state, self.control)
            return save, stop

        def saved(step: int, folder: Path):
            state.save_to_json(str(folder / TRAINER_STATE))  # transformers' file: log_history, read back on resume
            link = link_root / f"checkpoint-{step * updates}"
            if not link.exists():
                link.symlink_to(os.path.relpath(folder, link_root), target_is_directory=True)
            for old in link_root.glob("checkpoint-*"):  # save_total_limit removed its checkpoint
                if old.is_symlink() and not old.exists():
                    old.unlink()
            self.control = handler.on_save(args, state, self.control)

        from grpo.core.trainer import StepHooks
        from transformers.trainer_utils import TrainOutput

        result = engine.train(hooks=StepHooks(step_end, saved, self._completions if args.log_completions else None))
        runtime = time.time() - started
        steps_run = max(state.global_step, 1)
        summary = {"train_runtime": runtime, "train_samples_per_second": steps_run * args.per_device_train_batch_size
                   * args.gradient_accumulation_steps / max(runtime, 1e-9),
                   "train_steps_per_second": steps_run / max(runtime, 1e-9), "total_flos": 0.0,
                   "train_loss": sum(losses) / len(losses) if losses else 0.0}
        if not evaluated_last:  # trl's metrics since the last entry join the summary (the whole run's with
            # logging_strategy "no"), unless an evaluation at the last step left trl's model in eval mode
            summary.update(_window_means({key: values for key, values in window.items()
                                          if key not in TRANSFORMERS_KEYS}, LAST_VALUE))
        self.log(summary)
        self.control = handler.on_epoch_end(args, state, self.control)
        self.control = handler.on_train_end(args, state, self.control)
        status = "stopped" if result["status"] == "paused" and self.control.should_training_stop else result["status"]
        return TrainOutput(state.global_step, summary["train_loss"], {**summary, "status": status})

    def _log_metric(self, name: str, value: float) -> None:
        self.logged_metrics.setdefault(name, []).append(float(value))

    def _take_logged_metrics(self) -> dict:
        """The reward functions' log_metric values since the last call, each name's mean (NaN-aware, as trl)."""
        taken = _window_means(self.logged_metrics, ())
        self.logged_metrics.clear()
        return taken

    def _log_extra(self, column: str, values: list) -> None:
        """A column of the completions table (log_completions), one value per completion the reward function saw."""
        self.extra_columns[column] = list(values)

    def _completions(self, step: int, records: list[dict]) -> None:
        """The step's completions (every rank's), kept for the logs to come (log_completions), with the log_extra
        columns of every rank (a collective: every rank is here)."""
        parts = self.engine.world.gather_objects(self.extra_columns)
        extra = {name: [value for part in parts for value in part.get(name, [])] for name in parts[0]}
        self.last_completions = records, extra

    def _log_completions(self) -> None:
        """trl's log_completions at each training log: the last generation's completions written to
        completions/completions_<global step>.parquet and printed as a table (num_completions_to_print of them)."""
        from grpo.trl_api.completions import completions_frame, format_completions, write_completions

        records, extra = self.last_completions
        frame = completions_frame(records, self.state.global_step, extra)
        write_completions(self.args.output_dir, frame, self.state.global_step)
        print(format_completions(frame, self.state.global_step, self.args.num_completions_to_print), flush=True)

    def log(self, logs: dict) -> None:
        """One entry of state.log_history (with epoch and step, as transformers), and the callbacks' on_log."""
        entry = {**logs, **({"epoch": self.state.epoch} if self.state.epoch is not None else {}),
                 "step": self.state.global_step}
        self.state.log_history.append(entry)
        # trl writes the completions at every log; an evaluation's own completions are not kept here
        if self.args.log_completions and self.last_completions and not any(key.startswith("eval_") for key in logs) \
                and self.engine.world.is_main:
            self._log_completions()
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """trl's evaluation of eval_dataset (grpo.trl_api.evaluation): num_generations_eval sampled completions of
        each prompt (or the rollout_func's), scored, their loss and metrics without an update."""
        from grpo.trl_api.evaluation import evaluate_like_trl

        rows, streamed = (self.eval_rows, self.eval_streamed) if eval_dataset is None else _eval_set(
            eval_dataset, self.args.seed, self.args.remove_unused_columns)
        if rows is None:
            raise ValueError("evaluate() needs an eval_dataset")
        if self.engine is None:  # transformers then logs the preparation's time with every later evaluation
            started = time.time()
            self._build(None)
            self.model_preparation_time = round(time.time() - started, 4)
        engine = self.engine
        if not self._in_schedule:  # trl's eval DataLoader draws from the stream that orders micro-batches
            self.order.note_evaluation(engine.step)
        pending = self._take_logged_metrics()  # a training step's; the evaluation's reward calls log their own
        metrics = evaluate_like_trl(engine, rows, self.args.seed, self.num_generations_eval,
                                    self.args.per_device_eval_batch_size, in_order=streamed)
        metrics.update(self._take_logged_metrics())
        if hasattr(self, "model_preparation_time"):
            metrics["model_preparation_time"] = self.model_preparation_time
        self.logged_metrics.update({name: [value] for name, value in pending.items()})
        return self._evaluated({f"{metric_key_prefix}_{key}": value for key, value in metrics.items()
                                if not key.startswith(OURS_ONLY)})

    def _evaluated(self, metrics: dict) -> dict:
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def save_model(self, output_dir: str | None = None) -> None:
        """The policy and tokenizer, from_pretrained-loadable (safetensors), in output_dir (default args.output_dir);
        under LoRA the adapter in peft's format (adapter_config.json, adapter_model.safetensors), as trl."""
        folder = Path(output_dir or self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        model = self.model
        if model is None:
            raise ValueError("save_model(): nothing trained yet (call train() first)")
        model.save_pretrained(folder, safe_serialization=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)
