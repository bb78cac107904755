"""trl's GRPOConfig, read by this engine: the same keyword arguments and defaults as trl 1.16's (every field is in
grpo.trl_api.fields), turned into our GRPOConfig's settings by `our_settings`.

    from grpo.trl_api import GRPOConfig          # instead of: from trl import GRPOConfig
    args = GRPOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=4, ...)

A field this engine cannot honour at the value given is refused when the config is built, one line per field with
the reason (a ValueError); fields without effect here are listed by `left_fields()` (the trainer logs them once).
"""

from __future__ import annotations

import copy
import difflib
import json
import math

from grpo.config import ConfigMixin
from grpo.trl_api.batch import translate
from grpo.trl_api.fields import FIELDS

# trl's dict fields that also take a JSON string (transformers' _VALID_DICT_FIELDS and trl's own)
DICT_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "accelerator_config", "fsdp_config",
               "deepspeed", "model_init_kwargs", "generation_kwargs", "chat_template_kwargs",
               "transformers_continuous_batching_config")
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant"}
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
              "adamw_bnb_8bit": "adamw_8bit"}
DTYPES = {"float32": "fp32", "bfloat16": "bf16-pure"}  # model_init_kwargs' dtype: the weights' own precision
MODEL_INIT_KEYS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code")
# generation_kwargs' keys our samplers take, as trl passes them on (they override the fields of the same name)
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _text(value) -> str:
    return getattr(value, "value", value) if not isinstance(value, str) else value  # an enum's value


def _padding(value, check: bool = False):
    """trl's pad_to_multiple_of as ours: 'auto' (trl pads on Neuron only), None, 'none' -> None; a whole number (or its
    text, as trl's CLI passes it) -> int. `check`: whether the value is one of those."""
    if value is None or str(value).lower() in ("auto", "none", "null"):
        return True if check else None
    whole = str(value).isdigit() and int(value) >= 1 and not isinstance(value, float)
    return whole if check else int(value)


class GRPOConfig:
    """trl 1.16's GRPOConfig on this engine (module docstring): every trl field is an attribute, at trl's default
    unless given."""

    def __init__(self, output_dir: str | None = None, **values):
        unknown = [name for name in values if name not in FIELDS]
        if unknown:
            lines = []
            for name in unknown:
                close = difflib.get_close_matches(name, FIELDS, n=1)
                lines.append(f"GRPOConfig: trl 1.16 has no field {name!r}"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
            ConfigMixin.raise_problems(lines)
        values["output_dir"] = output_dir
        self.given = set(values) - {"output_dir"} | ({"output_dir"} if output_dir is not None else set())
        for name, spec in FIELDS.items():
            value = values.get(name, spec.default)
            if name in DICT_FIELDS and isinstance(value, str) and value.strip().startswith("{"):
                value = json.loads(value)
            setattr(self, name, copy.deepcopy(value))
        self._post_init()
        ConfigMixin.raise_problems(self.refusals())

    def _post_init(self) -> None:
        """trl's and transformers' own conversions (GRPOConfig.__post_init__, TrainingArguments.__post_init__)."""
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if _text(self.eval_strategy) == "steps" and not self.eval_steps:
            self.eval_steps = self.logging_steps
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        self.report_to = [name for name in self.report_to or [] if name != "none"]
        if isinstance(self.fsdp, (list, tuple)):  # transformers takes the options as a list too
            self.fsdp = " ".join(str(option) for option in self.fsdp)

    def refusals(self) -> list[str]:
        """One line per field whose value this engine cannot honour, with the reason."""
        lines = []
        for name, spec in FIELDS.items():
            value = getattr(self, name)
            if spec.kind == "refused" and value != spec.default and value not in spec.accepted:
                lines.append(f"{name}={value!r} is not supported here: {spec.note}")
        checks = [
            ("lr_scheduler_type", _text(self.lr_scheduler_type) in SCHEDULERS, "linear, cosine or constant"),
            ("optim", _text(self.optim) in OPTIMIZERS, ", ".join(OPTIMIZERS)),
            ("logging_strategy", _text(self.logging_strategy) in ("steps", "no"), "'steps' or 'no'"),
            ("save_strategy", _text(self.save_strategy) in ("steps", "no") or self._one_epoch_saves(),
             "'steps' or 'no' ('epoch' saves at the end, so only for a run of one epoch)"),
            ("eval_strategy", _text(self.eval_strategy) in ("steps", "no"), "'steps' or 'no'"),
            ("report_to", len(self.report_to) <= 1 and all(r in ("tensorboard", "wandb") for r in self.report_to),
             "'none', 'tensorboard' or 'wandb' (one)"),
            ("fp16", not self.fp16 or not self.bf16, "fp16 and bf16 both set"),
            ("pad_to_multiple_of", _padding(self.pad_to_multiple_of, check=True),
             "a whole number >= 1, 'auto' or None"),
            ("fsdp", not self.fsdp or set(str(self.fsdp).split()) <= {"full_shard", "auto_wrap", "offload"},
             "'full_shard', with 'auto_wrap' and 'offload'"),
            ("model_init_kwargs", set(self.model_init_kwargs or {}) <= set(MODEL_INIT_KEYS),
             f"the keys {', '.join(MODEL_INIT_KEYS)}"),
            ("generation_kwargs", set(self.generation_kwargs or {}) <= set(GENERATION_KEYS),
             f"the keys {', '.join(GENERATION_KEYS)} (the others of GenerationConfig and vLLM's SamplingParams are "
             "not built; max_completion_length sets the length)"),
        ]
        lines += [f"{name}={getattr(self, name)!r} is not supported here: use {what}"
                  for name, ok, what in checks if not ok]
        dtype = (self.model_init_kwargs or {}).get("dtype", (self.model_init_kwargs or {}).get("torch_dtype"))
        if dtype is not None and str(dtype).removeprefix("torch.") not in (*DTYPES, "auto"):
            lines.append(f"model_init_kwargs dtype={dtype!r} is not supported here: use float32 or bfloat16")
        for name in ("logging_steps", "save_steps", "eval_steps"):
            value = getattr(self, name)
            if value is not None and value >= 1 and value != int(value):
                lines.append(f"{name}={value!r}: a value >= 1 counts steps and must be whole (as transformers)")
        return lines

    def _one_epoch_saves(self) -> bool:
        """save_strategy='epoch' on a run of one epoch: our save at the end is that epoch's."""
        return _text(self.save_strategy) == "epoch" and self.max_steps <= 0 and self.num_train_epochs <= 1

    def left_fields(self) -> list[str]:
        """The fields given a value other than trl's default that have no effect here, each with the reason."""
        lines = [f"{name}={getattr(self, name)!r}: {spec.note}" for name, spec in FIELDS.items()
                 if spec.kind == "left" and name in self.given and getattr(self, name) != spec.default]
        attention = (self.model_init_kwargs or {}).get("attn_implementation", "sdpa")
        if attention != "sdpa":
            lines.append(f"model_init_kwargs attn_implementation={attention!r}: models load with sdpa here; the "
                         "kernels choose flash or flex attention where they are installed and pay (the same numbers)")
        return lines

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}

    def our_settings(self, world_size: int = 1) -> dict:
        """Our GRPOConfig's settings for this trl configuration (grpo.trl_api.fields says where each comes from)."""
        batch = translate(self.per_device_train_batch_size, self.gradient_accumulation_steps, self.num_generations,
                          world_size, self.steps_per_generation, self.generation_batch_size, self.max_steps,
                          self.num_iterations)
        model_init = self.model_init_kwargs or {}
        dtype = str(model_init.get("dtype", model_init.get("torch_dtype", "auto"))).removeprefix("torch.")
        precision = DTYPES.get(dtype) or ("bf16" if self.bf16 else "fp32")
        # the fields trl and we spell and mean alike (fields.py names each one's setting) pass as they are
        settings = {name: getattr(self, name) for name, spec in FIELDS.items()
                    if spec.kind == "honoured" and spec.ours == name}
        settings.update(  # the others: another name, another unit, or trl's conversions
            prompts_per_step=batch.prompts_per_step, micro_batch_size=batch.micro_batch_size,
            steps_per_generation=batch.steps_per_generation, max_steps=batch.max_steps, epochs=self.num_train_epochs,
            lr_scheduler_type=SCHEDULERS[_text(self.lr_scheduler_type)],
            warmup_ratio=self.warmup_steps if self.warmup_steps < 1 else 0.0,
            warmup_steps=int(self.warmup_steps) if self.warmup_steps >= 1 else 0,
            optim=OPTIMIZERS[_text(self.optim)], precision=precision, device="cpu" if self.use_cpu else "auto",
            report_to=self.report_to[0] if self.report_to else "none",
            logging_steps=self._steps("logging_steps", batch.updates_per_step, exact=False),
            save_steps=self._steps("save_steps", batch.updates_per_step) if _text(self.save_strategy) == "steps" else 0,
            save_total_limit=self.save_total_limit or 0,
            eval_steps=self._steps("eval_steps", batch.updates_per_step) if _text(self.eval_strategy) == "steps" else 0,
            eval_batch_size=self.per_device_eval_batch_size, distributed_timeout=float(self.ddp_timeout),
            trust_remote_code=bool(model_init.get("trust_remote_code", self.trust_remote_code)),
            min_p=self.min_p or 0.0,
            importance_sampling_correction=None if self.vllm_importance_sampling_correction else False,
            importance_sampling_mode=self.vllm_importance_sampling_mode,
            importance_sampling_clip_max=self.vllm_importance_sampling_clip_max,
            importance_sampling_clip_min=self.vllm_importance_sampling_clip_min,
            log_completions_steps=(self._steps("logging_steps", batch.updates_per_step, exact=False)
                                   if self.log_completions else 0),
            pad_to_multiple_of=_padding(self.pad_to_multiple_of),
            vllm_mode=self.vllm_mode if self.use_vllm else "colocate",  # trl reads it only with use_vllm
        )
        if self.cache_implementation is not None and not self.use_vllm:  # trl's generate path, with that cache
            settings["generation_backend"] = "transformers"
        settings.update(self.generation_kwargs or {})  # trl: they override the sampling fields
        if self.fsdp:
            settings.update(distributed="fsdp", fsdp_cpu_offload="offload" in str(self.fsdp).split())
        return settings

    def _steps(self, name: str, updates_per_step: int, exact: bool = True) -> int:
        """An interval of logging / saving / evaluation in our steps: trl's counts optimizer steps (a value < 1 is a
        share of max_steps, as transformers), and each of our steps makes `updates_per_step` of them, so a value given
        must be a multiple of that (trl's default is taken to the next one; `exact=False`: any is, rounded up: the
        drop-in logs each optimizer step itself, our steps only pace the console)."""
        value = getattr(self, name)
        if value is None or value <= 0:
            raise ValueError(f"{name}={value!r}: the 'steps' strategy needs a positive {name} (as transformers)")
        if value < 1:
            if self.max_steps <= 0:
                raise ValueError(f"{name}={value!r} is a share of max_steps, which is not set: give whole steps")
            value = math.ceil(self.max_steps * value)
        if value % updates_per_step and (name not in self.given or not exact):  # trl's default: the next multiple
            return math.ceil(value / updates_per_step)
        if value % updates_per_step:
            raise ValueError(f"{name}={value!r} counts optimizer steps, and each generation here makes "
                             f"{updates_per_step} of them (num_iterations x steps_per_generation / "
                             f"gradient_accumulation_steps): use a multiple of {updates_per_step}")
        return int(value) // updates_per_step
