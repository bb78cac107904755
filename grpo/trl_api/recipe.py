"""trl and open-r1 recipes (`python train.py --config recipe.yaml`): a YAML of trl's ModelConfig, the script's data
and reward arguments and trl's GRPOConfig fields, as open-r1 publishes them, read into our settings.

    model      model_name_or_path, model_revision, torch_dtype / dtype, attn_implementation, trust_remote_code
    data       dataset_name, dataset_config(s), dataset_train_split, dataset_test_split, dataset_prompt_column
               (open-r1's default: problem), system_prompt
    rewards    reward_funcs by name (REWARD_NAMES), reward_weights
    training   every field of trl's GRPOConfig (grpo.trl_api.fields), and the older names recipes still use
               (max_prompt_length, warmup_ratio, overwrite_output_dir: LEGACY)

`recipe_settings` returns our settings and two lists the caller prints once: what was mapped, and what was left
without effect (with the reason). A key nobody reads is refused naming the closest known one, a reward we do not
have by name, and a value we cannot honour with the reason (ValueError, one line each).
"""

from __future__ import annotations

import difflib
import os

from grpo.trl_api.config import GRPOConfig
from grpo.trl_api.fields import FIELDS

RECIPE_MARKERS = ("model_name_or_path", "dataset_name", "reward_funcs", "per_device_train_batch_size")
# open-r1's reward names -> ours (rewards/): the same function, or refused
REWARD_NAMES = {"accuracy": "accuracy_reward", "format": "think_format", "tag_count": "tag_count"}
OPEN_R1_REWARDS = ("reasoning_steps", "cosine", "repetition_penalty", "length", "code", "binary_code", "ioi_code",
                   "cf_code", "code_format", "soft_overlong_punishment")
LEGACY = {  # fields of trl 0.18 / transformers 4 that open-r1's recipes set; trl 1.16 no longer has them
    "max_prompt_length": "max_prompt_length", "warmup_ratio": "warmup_ratio", "overwrite_output_dir": "overwrite"}
# keys read by open-r1's scripts for what is not built here: accepted, without effect, listed with the reason
LEFT = {
    **dict.fromkeys(("wandb_entity", "wandb_project", "wandb_run_group", "wandb_log_unique_prompts"),
                    "wandb run names are not set from recipes here"),
    **dict.fromkeys(("hub_model_revision", "overwrite_hub_revision", "push_to_hub_revision"),
                    "no model hub is reached from here"),
    "benchmarks": "open-r1's benchmark runs after training are not built here",
    "dataset_streaming": "the dataset is read whole",
    "gradient_checkpointing_use_reentrant": "checkpointing here is non-reentrant",
    "ignore_bias_buffers": "read by DDP scripts for buffers; our DDP wrapper has none to ignore",
    **dict.fromkeys(("cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
                     "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty",
                     "code_language", "code_eval_test_batch_size", "code_eval_scoring_mode",
                     "parallel_code_exec_per_proc", "e2b_router_url", "morph_router_url", "code_provider",
                     "ioi_provider", "max_completion_len", "soft_punish_cache"),
                    "read only by open-r1 rewards that are not among reward_funcs here"),
}
# trl's ModelConfig: the model, and its LoRA (peft) settings
LORA_KEYS = {"use_peft": "use_peft", "lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
             "lora_target_modules": "lora_target_modules", "load_in_4bit": "load_in_4bit",
             "bnb_4bit_quant_type": "bnb_4bit_quant_type", "use_bnb_nested_quant": "use_bnb_nested_quant"}
LORA_REFUSED = {"use_rslora": False, "use_dora": False, "load_in_8bit": False, "lora_modules_to_save": None,
                "lora_task_type": "CAUSAL_LM", "bnb_4bit_quant_storage": None}
MODEL_KEYS = ("model_name_or_path", "model_revision", "torch_dtype", "dtype", "attn_implementation",
              "trust_remote_code", *LORA_KEYS, *LORA_REFUSED)
DATA_KEYS = ("dataset_name", "dataset_config", "dataset_configs", "dataset_train_split", "dataset_test_split",
             "dataset_prompt_column", "system_prompt", "chat_template")
REWARD_KEYS = ("reward_funcs",)


def is_recipe(values: dict) -> bool:
    """A config file written for trl / open-r1 rather than for our CLI."""
    return any(key in values for key in RECIPE_MARKERS)


def recipe_settings(values: dict, where: str = "recipe") -> tuple[dict, list[str], list[str]]:
    """(our settings, the lines saying what was mapped, the lines saying what was left and why); module docstring."""
    known = (*MODEL_KEYS, *DATA_KEYS, *REWARD_KEYS, *LEGACY, *LEFT, *FIELDS)
    problems = []
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            problems.append(f"{where}: {key!r} is not a trl, open-r1 or transformers setting"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
    mapped, left = [], [f"{key}: {LEFT[key]}" for key in values if key in LEFT]
    trl_values = {key: value for key, value in values.items() if key in FIELDS}
    # trl's ModelConfig, which its scripts put into model_init_kwargs over what the recipe has there
    model_init = dict(trl_values.get("model_init_kwargs") or {})
    if values.get("torch_dtype", values.get("dtype")) is not None:
        model_init["dtype"] = values.get("torch_dtype", values.get("dtype"))
    if values.get("attn_implementation") is not None:  # GRPOConfig lists a choice other than sdpa as left
        model_init["attn_implementation"] = values["attn_implementation"]
    if model_init:
        trl_values["model_init_kwargs"] = model_init
    lora = {ours: values[key] for key, ours in LORA_KEYS.items() if key in values}
    for key, accepted in LORA_REFUSED.items():
        if values.get(key, accepted) not in (accepted, *(("uint8",) if key == "bnb_4bit_quant_storage" else ())):
            problems.append(f"{where}: {key}={values[key]!r} is not supported here (LoRA here: r, alpha, dropout and "
                            "target modules, over a 4-bit base with load_in_4bit)")
    if values.get("model_revision") not in (None, "main"):
        problems.append(f"{where}: model_revision={values['model_revision']!r} is not supported here: models load "
                        "at their main revision (point model_name_or_path at a folder of that revision)")
    for key in ("dataset_config", "dataset_configs"):
        value = values.get(key)
        if value in ("default", ["default"]):
            left.append(f"{key}={value!r}: the dataset's default configuration is the one read")
        elif value is not None:
            problems.append(f"{where}: {key}={value!r} is not supported here: the dataset's default configuration is "
                            "read (point dataset_name at a folder of the one you want)")
    names = values.get("reward_funcs") or []
    names = [names] if isinstance(names, str) else names
    weights = values.get("reward_weights") or [1.0] * len(names)
    rewards = []
    for name in names:
        if name in REWARD_NAMES or name not in OPEN_R1_REWARDS:
            rewards.append(REWARD_NAMES.get(name, name))
        else:
            problems.append(f"{where}: reward {name!r} (open-r1's) is not built here; the rewards with the same "
                            f"definition are {', '.join(sorted(REWARD_NAMES))}, or give a file.py:function")
    if len(weights) != len(names):
        problems.append(f"{where}: reward_weights has {len(weights)} entries for {len(names)} reward_funcs")
    if problems:
        raise ValueError("\n".join(problems))
    args = GRPOConfig(**trl_values)  # refuses what cannot be honoured, one line each
    settings = args.our_settings(int(os.environ.get("WORLD_SIZE", "1")))  # trl's batch is per process
    settings.update(lora)
    left += args.left_fields()
    if "model_name_or_path" in values:
        settings["model"] = values["model_name_or_path"]
    settings["trust_remote_code"] = bool(values.get("trust_remote_code", settings["trust_remote_code"]))
    data = {"dataset_name": "dataset", "dataset_train_split": "train_split", "dataset_test_split": "eval_split",
            "system_prompt": "system_prompt", "chat_template": "chat_template"}
    settings.update({ours: values[key] for key, ours in data.items() if key in values})
    if "dataset_name" in values or "dataset_prompt_column" in values:  # open-r1: from a column, `problem` unless told
        settings["dataset_prompt_column"] = values.get("dataset_prompt_column", "problem")
        settings.setdefault("system_prompt", "")  # open-r1: no system message unless given
    settings.update({ours: values[key] for key, ours in LEGACY.items() if key in values})
    if rewards:
        settings["reward"] = [f"{name}:{weight:g}" for name, weight in zip(rewards, weights)]
    for key in values:
        if key == "reward_weights":
            continue
        if key in FIELDS and FIELDS[key].kind == "honoured" and FIELDS[key].ours:
            mapped.append(f"{key} -> {FIELDS[key].ours}")
        elif key in FIELDS and FIELDS[key].kind == "refused":  # accepted at this value: it is what happens here
            mapped.append(f"{key}={values[key]!r}: as here")
        elif key in LEGACY:
            mapped.append(f"{key} -> {LEGACY[key]} (an older trl / transformers field)")
        elif key in LORA_KEYS:
            mapped.append(f"{key} -> {LORA_KEYS[key]}")
        elif key in data or key in ("model_name_or_path", "dataset_prompt_column"):
            mapped.append(f"{key} -> {data.get(key, 'model' if key == 'model_name_or_path' else key)}")
    if rewards:
        mapped.append(f"reward_funcs, reward_weights -> reward {settings['reward']}")
    return settings, mapped, left
