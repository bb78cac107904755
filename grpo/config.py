"""GRPOConfig: the single source of truth for every hyperparameter. The command line is generated from it.

Batch sizes are counted in prompts and completions, not in trl's per-device completions:
    prompts_per_step (B) x num_generations (G) = N completions per step,
    split into N / micro_batch_size micro-batches (gradient accumulation steps).
One step = one rollout of N completions, followed by `num_iterations` optimizer updates on it; with
steps_per_generation = k x the accumulation steps, one rollout of k * B prompts feeds k updates over
disjoint slices, num_iterations times (trl's generation reuse).

Precedence when the CLI builds a config: field defaults < --preset < --config FILE < explicit flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from data.prompts import SYSTEM_PROMPT

from grpo.advantages import MULTI_OBJECTIVE_AGGREGATIONS
from grpo.loss import CLIPPED_LOSS_TYPES, LOSS_TYPES

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIMIZERS = ("adamw", "adamw_8bit")
GSM8K_RECIPE_REWARDS = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]
KERNEL_CHOICES = ("auto", "plain")  # grpo.kernels.select_kernels
GENERATION_BACKENDS = ("sampler", "transformers")  # grpo.generation


def _f(default, help: str, **kwargs):
    """A field with its help text, shown by --help and kept next to the value it documents."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


# Settings that earlier versions had, and what replaced them: the old name fails with this message.
REPLACED = {
    "fused_loss": "--kernels (auto uses the fused log-prob + loss pass for token-level ratios; plain does not)",
    "compile_decode": "--kernels (auto compiles the decode step on CUDA; plain decodes eagerly)",
    "static_cache": "--kernels (auto decodes into a static cache on CUDA, with the compiled step)",
}


class ConfigMixin:
    """What the config dataclasses of train.py and eval.py share: a dict round-trip that names unknown
    keys, and one way to report every invalid setting at once."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "config"):
        known = {f.name for f in dataclasses.fields(cls)}
        replaced = sorted(set(values) & set(REPLACED) - known)
        if replaced:
            raise ValueError(f"{where}: " + "; ".join(f"{key} was replaced by {REPLACED[key]}" for key in replaced))
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys are the flag names with underscores")
        return cls(**values)

    @staticmethod
    def path_problems(model: str, output_dir: str, chat_template: str | None = None) -> list[str]:
        """Paths that cannot work, found before anything loads: a model path that does not exist, an output
        folder that is a file, a chat template file that is missing."""
        problems = []
        looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1  # a hub id is `org/name`
        if looks_local and not Path(model).expanduser().exists():
            problems.append(f"model {model}: no such folder (a local model folder, a hub id org/name, or `tiny`)")
        if Path(output_dir).expanduser().exists() and not Path(output_dir).expanduser().is_dir():
            problems.append(f"output_dir {output_dir} is a file, not a folder: pass a folder for the run's files")
        if chat_template is not None and not Path(chat_template).expanduser().is_file():
            problems.append(f"chat_template {chat_template}: no such file")
        return problems

    @staticmethod
    def template_kwargs_problems(kwargs) -> list[str]:
        """chat_template_kwargs must be a mapping of names (from a config file it could be anything)."""
        if kwargs is None or (isinstance(kwargs, dict) and all(isinstance(key, str) for key in kwargs)):
            return []
        return [f"chat_template_kwargs must be a JSON object of names to values, got {kwargs!r}"]

    @staticmethod
    def raise_problems(problems: list[str]) -> None:
        if problems:
            raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass
class GRPOConfig(ConfigMixin):
    """Every knob of a run. Names follow trl's GRPOConfig where the concept is the same."""

    # --- model and data ---
    model: str = _f("Qwen/Qwen2.5-0.5B-Instruct", "hub id or local folder; `tiny` or `tiny:SHAPE` builds a random-init local model (grpo/tiny_model.py)")
    dataset: str = _f("openai/gsm8k", "hub id, local .jsonl/.json/.parquet file or folder, or `synthetic[:N]` (seeded GSM8K-shaped problems). Rows with a `prompt` column (a string or chat messages) train as they are, every other column reaching the rewards; rows with GSM8K's `question` and `answer` are checked and get --system-prompt")
    train_split: str = _f("train", "dataset split to train on")
    eval_split: str = _f("test", "dataset split to evaluate on (--eval-steps)")
    system_prompt: str = _f(SYSTEM_PROMPT, "system prompt of GSM8K-style rows (question/answer), asking for <reasoning>/<answer> tags")
    one_shot: bool = _f(False, "GSM8K-style rows: one worked example (a train problem answered in the format) as a user/assistant exchange before the question; for small instruct models that ignore the system prompt's format (docs/real-model.md)")
    chat_template: str | None = _f(None, "a Jinja chat template file, for tokenizers that have none")
    chat_template_kwargs: dict | None = _f(None, "extra keyword arguments of the chat template for chat prompts (training and evaluation), a JSON object, e.g. '{\"enable_thinking\": false}' for Qwen3; trl's option")
    skip_bad_rows: bool = _f(False, "drop dataset rows without a prompt (or a question and a parseable gold answer) with a counted warning instead of stopping")
    long_prompts: str = _f("truncate", "prompts longer than max_prompt_length: `truncate` (keep the last tokens, as trl) or `skip`", choices=("truncate", "skip"))
    trust_remote_code: bool = _f(False, "run model/tokenizer code from the hub (off: safe default)")
    disable_dropout: bool = _f(True, "set the policy's dropout rates to 0 (its dropout layers and attention dropout; --lora-dropout stays as given): sampling runs in eval mode, so the trained log-probs are then the sampling policy's. trl's option; its default is False")
    output_dir: str = _f("runs/grpo", "run folder: metrics.jsonl, samples.jsonl, checkpoints/, eval/")
    overwrite: bool = _f(False, "allow writing into an output folder that holds another run")
    resume: str | None = _f(None, "continue a run: a run folder or a checkpoint folder; `--resume` alone means --output-dir")

    # --- batch sizes (prompts and completions, not trl's per-device count) ---
    max_steps: int = _f(0, "optimisation steps (rollouts); 0 = derive from --epochs")
    epochs: float = _f(1.0, "passes over the training prompts when --max-steps is 0")
    shuffle_dataset: bool = _f(True, "a fresh seeded order of the training prompts each epoch; off: the dataset's own order every epoch (a curriculum; dynamic sampling's extra rounds still draw at random). trl's option")
    prompts_per_step: int = _f(4, "B: distinct prompts sampled per step")
    num_generations: int = _f(16, "G: completions per prompt (the group); >= 2")
    micro_batch_size: int = _f(16, "completions per forward/backward; B*G must be a multiple")
    max_prompt_length: int = _f(256, "prompt tokens kept (see --long-prompts)")
    max_completion_length: int = _f(512, "T: completion token budget")
    steps_per_generation: int | None = _f(None, "micro-batches each generation feeds, as trl: a multiple k of the accumulation steps makes one rollout of k * prompts_per_step prompts feed k optimizer updates over disjoint slices (old log-probs taken at generation time); default: the accumulation steps (k = 1)")
    generation_batch_size: int | None = _f(None, "completions per generation, as trl (micro_batch_size * steps_per_generation); set this or --steps-per-generation, not both")

    # --- sampling ---
    temperature: float = _f(1.0, "sampling temperature; log-probs use logits / temperature, as trl")
    top_p: float = _f(1.0, "nucleus sampling mass (1.0 = off)")
    top_k: int = _f(0, "top-k sampling (0 = off)")
    min_p: float = _f(0.0, "min-p sampling (0.0 = off)")
    generation_backend: str = _f("sampler", "how completions are made: `sampler` (ours: one prefill per prompt) or `transformers` (model.generate, for models our sampler does not support)", choices=GENERATION_BACKENDS)

    # --- the objective ---
    reward: list[str] = _f(GSM8K_RECIPE_REWARDS, "reward functions, each with an optional weight (correctness:2): a name from rewards/ (correctness, int, strict_format, soft_format, xmlcount, tags), module:function or path/to/file.py:function, with trl's signature fn(prompts, completions, **columns)")
    scale_rewards: str = _f("group", "advantage scaling: group std, batch std, or none (Dr. GRPO)", choices=("group", "batch", "none"))
    loss_type: str = _f("grpo", "the objective and its token aggregation (grpo/loss.py): grpo, bnpo, dr_grpo, dapo, luspo (the clipped surrogate), cispo (clipped detached weights), sapo (soft gate), vespo (Gamma-weighted sequence ratios)", choices=LOSS_TYPES)
    multi_objective_aggregation: str = _f("sum_then_normalize", "several rewards: sum with weights, then normalise (as --scale-rewards says); or normalize_then_sum (GDPO: each reward normalised in its group, the weighted sum normalised over the batch)", choices=MULTI_OBJECTIVE_AGGREGATIONS)
    beta: float = _f(0.04, "KL coefficient; 0 loads no reference model")
    use_bias_correction_kl: bool = _f(False, "multiply the k3 KL by the importance ratio (trl 1.16's default; ours is the paper's plain k3)")
    epsilon: float = _f(0.2, "lower clip range: ratio >= 1 - epsilon")
    epsilon_high: float | None = _f(None, "upper clip range (DAPO clip-higher, e.g. 0.28); default: epsilon")
    delta: float | None = _f(None, "cap on the unclipped ratio (two-sided clipping); default: off")
    importance_sampling_level: str = _f("token", "ratio per token, or one per completion (GSPO)", choices=("token", "sequence"))
    num_iterations: int = _f(1, "optimizer updates per rollout (old log-probs are computed when > 1)")
    mask_truncated_completions: bool = _f(False, "exclude completions without EOS from the loss")
    sapo_temperature_pos: float = _f(1.0, "sapo: gate temperature for tokens with a positive advantage")
    sapo_temperature_neg: float = _f(1.05, "sapo: gate temperature for tokens with a non-positive advantage")
    vespo_k_pos: float = _f(2.0, "vespo: power k of the Gamma weight for A >= 0 (down-weights ratios < 1)")
    vespo_lambda_pos: float = _f(3.0, "vespo: decay lambda of the Gamma weight for A >= 0 (down-weights ratios > 1)")
    vespo_k_neg: float = _f(3.0, "vespo: power k for A < 0")
    vespo_lambda_neg: float = _f(2.0, "vespo: decay lambda for A < 0")
    top_entropy_quantile: float = _f(1.0, "keep the policy loss only on the top quantile of tokens by entropy, per micro-batch (0.2 in 'Beyond the 80/20 rule'); 1.0 = every token")
    off_policy_mask_threshold: float | None = _f(None, "drop completions with a negative advantage whose mean log-ratio log(pi_old / pi) exceeds this (DeepSeek-V3.2; e.g. 0.5); default: off")
    entropy_coef: float = _f(0.0, "entropy bonus: loss - coef * mean token entropy (the same meaning for every loss type); the starting value with --use-adaptive-entropy")
    use_adaptive_entropy: bool = _f(False, "Skywork-OR1 adaptive entropy: after each optimizer update, raise the coefficient by --entropy-coef-delta when the entropy is <= --entropy-target, lower it otherwise; the bonus applies only while the entropy is <= the target")
    entropy_coef_min: float = _f(0.0, "adaptive entropy: lowest coefficient")
    entropy_coef_max: float = _f(1.0, "adaptive entropy: highest coefficient")
    entropy_coef_delta: float = _f(0.005, "adaptive entropy: change of the coefficient per optimizer update")
    entropy_target: float = _f(0.2, "adaptive entropy: target mean token entropy (nats), over the tokens the policy loss keeps")
    sync_ref_model: bool = _f(False, "TR-DPO: every --ref-model-sync-steps optimizer updates, ref = alpha * policy + (1 - alpha) * ref (needs beta > 0)")
    ref_model_mixup_alpha: float = _f(0.6, "TR-DPO's alpha: the policy's share in the mixed reference")
    ref_model_sync_steps: int = _f(512, "TR-DPO's tau: optimizer updates between reference syncs")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards all tie and sample more prompts until the step has prompts_per_step informative groups")
    dynamic_sampling_max_rounds: int = _f(4, "dynamic sampling: most sampling rounds per step (the first included); when they do not find enough informative groups, tied ones fill the step (counted in dynamic_sampling/filled)")
    overlong_buffer_len: int = _f(0, "DAPO overlong reward shaping: a linear penalty from 0 to -overlong_penalty_factor over the last N tokens of the budget (a reward named `overlong`); 0 = off")
    overlong_penalty_factor: float = _f(1.0, "overlong reward shaping: the penalty at the full budget")

    # --- LoRA (peft, the [peft] extra; trl's names) ---
    use_peft: bool = _f(False, "train LoRA adapters instead of every weight (peft); with beta > 0 the reference is the same model with its adapters off, so no second copy is held")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = _f(0.0, "dropout on the LoRA branch's input (training only; trl's default is 0.05): 0 keeps the training log-probs those of the sampling policy and saves a copy of every adapted input")
    lora_target_modules: list[str] = _f(LORA_TARGETS, "module names that get adapters (default: the attention and MLP projections); the output head cannot (our log-probs read its weight)")
    peft_adapter: str | None = _f(None, "start from this LoRA adapter (a peft folder or hub id) instead of a fresh one; the reference is the model with this starting adapter")
    save_merged: bool = _f(False, "with --use-peft, checkpoints also hold merged/: the base weights with the adapter folded in, loadable by AutoModelForCausalLM.from_pretrained")

    # --- optimisation ---
    optim: str = _f("adamw", "optimizer: adamw (torch's fused AdamW) or adamw_8bit (bitsandbytes' AdamW8bit: 8-bit moments, runs on CPU and CUDA; the [bnb] extra)", choices=OPTIMIZERS)
    learning_rate: float = _f(5e-6, "AdamW peak learning rate")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.99, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon (the denominator's floor)")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    max_grad_norm: float = _f(0.1, "gradient norm clip (0 = off)")
    lr_scheduler_type: str = _f("cosine", "learning-rate schedule after warmup", choices=("cosine", "constant", "linear"))
    warmup_ratio: float = _f(0.1, "fraction of the optimizer updates spent warming up linearly")
    max_bad_steps: int = _f(3, "stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)")

    # --- hardware and precision ---
    device: str = _f("auto", "cuda, cpu, or auto (cuda when available)")
    precision: str = _f("auto", "fp32; bf16 (autocast, fp32 master weights and optimizer state); bf16-pure (bf16 weights); auto = bf16 on CUDA, fp32 on CPU", choices=("auto", "fp32", "bf16", "bf16-pure"))
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    cast_lm_head_to_fp32: bool = _f(False, "run the output projection (policy and reference) in fp32 outside autocast, as trl (ScaleRL); needs an untied output head")
    logprob_chunk_size: int | None = _f(None, "rows of logits per chunk in the log-prob projection (default: up to 128 MiB worth, a multiple of 64 rows: 192 at a 151,936-token vocabulary)")
    kernels: str = _f("auto", "fast paths (grpo/kernels/, docs/design.md): auto = each kernel where it applies (the tuned sampler, which drops finished rows, compiled decoding on CUDA, the fused log-prob + loss pass for token-level ratios, CPU log-prob layouts, micro-batches of rows of similar length, log-prob passes that run each group's prompt once, packed log-prob passes with flash or flex attention); plain = the readable path everywhere (the same numbers)", choices=KERNEL_CHOICES)
    distributed: str = _f("auto", "under torchrun (docs/distributed.md): fsdp (FSDP2, fully_shard per decoder layer), ddp, or auto = fsdp when there is more than one process; a single process trains unwrapped", choices=("auto", "ddp", "fsdp"))
    fsdp_cpu_offload: bool = _f(False, "FSDP2: keep the sharded parameters, gradients and optimizer state in CPU memory")
    distributed_timeout: float = _f(600.0, "seconds any collective may wait for the other ranks before the run stops with an error (a dead or hung rank)")
    seed: int = _f(42, "seeds sampling, data order and micro-batch shuffling")

    # --- logging, checkpoints, evaluation ---
    logging_steps: int = _f(1, "console line every N steps (metrics.jsonl gets every step)")
    log_completions_steps: int = _f(10, "append sample completions with rewards to samples.jsonl every N steps (0 = off)")
    report_to: str = _f("none", "extra metrics back end: tensorboard (RUN_DIR/tensorboard) or wandb (offline into RUN_DIR/wandb unless an API key is configured; WANDB_MODE and WANDB_PROJECT are read)", choices=("none", "tensorboard", "wandb"))
    save_steps: int = _f(100, "checkpoint every N steps (and at the end); 0 = only at the end")
    save_total_limit: int = _f(2, "checkpoints kept (oldest deleted first); 0 = keep all")
    eval_steps: int = _f(0, "evaluate on a held-out slice every N steps and at the end (0 = off)")
    eval_limit: int = _f(100, "problems in the held-out evaluation slice")
    eval_batch_size: int = _f(32, "prompts decoded together during evaluation")
    eval_max_completion_length: int | None = _f(None, "token budget for evaluation (default: max_completion_length)")
    eval_scorer: str = _f("auto", "how evaluation scores greedy completions: gsm8k (strict/lenient accuracy, format), rewards (the mean of each training reward), module:function or file.py:function (fn(completion, row) -> dict of numbers); auto = gsm8k for GSM8K data, rewards otherwise")

    # ----- derived sizes, computed once and checked -----
    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.completions_per_step // self.micro_batch_size

    @property
    def updates_per_generation(self) -> int:
        """k: optimizer updates one rollout feeds per iteration (steps_per_generation / accumulation steps)."""
        accumulation = max(self.gradient_accumulation_steps, 1)
        if self.generation_batch_size is not None:
            return max(self.generation_batch_size // max(self.micro_batch_size, 1) // accumulation, 1)
        if self.steps_per_generation is not None:
            return max(self.steps_per_generation // accumulation, 1)
        return 1

    @property
    def prompts_per_generation(self) -> int:
        """Prompts one rollout samples: k * prompts_per_step."""
        return self.prompts_per_step * self.updates_per_generation

    @property
    def completions_per_generation(self) -> int:
        return self.prompts_per_generation * self.num_generations

    def advice(self) -> list[str]:
        """Valid but unusual combinations, as trl warns about them (logged when training starts)."""
        notes = []
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            notes.append("loss_type='luspo' is defined with --importance-sampling-level sequence (the LUSPO paper)")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            notes.append("loss_type='vespo' forms its own sequence weights: --importance-sampling-level token is meant")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            notes.append(f"sequence-level ratios with loss_type={self.loss_type!r} sum per-token terms, weighting each "
                         "completion by its length; GSPO's setting is loss_type='grpo'")
        if self.loss_type == "cispo" and (self.epsilon_high is None or self.epsilon_high < 1):
            notes.append(f"cispo caps the ratio itself at epsilon_high = {self.epsilon_high or self.epsilon} (not "
                         "1 + epsilon_high): a value below 1 caps even on-policy ratios; ScaleRL uses 5.0")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            notes.append("normalize_then_sum normalises per reward and over the batch itself: --scale-rewards is unused")
        return notes

    def validate(self) -> "GRPOConfig":
        """Reject impossible settings with a message that names the field; returns self."""
        from rewards.registry import parse_reward_specs

        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{f.name} must be a finite number, got {value}")
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                problems.append(f"{f.name} must be one of {list(f.metadata['choices'])}, got {value!r}")
        positive = ["prompts_per_step", "micro_batch_size", "max_prompt_length", "max_completion_length",
                    "num_iterations", "logging_steps", "eval_batch_size", "max_bad_steps"]
        problems += [f"{name} must be >= 1, got {getattr(self, name)}" for name in positive if getattr(self, name) < 1]
        non_negative = ["max_steps", "epochs", "beta", "learning_rate", "weight_decay", "max_grad_norm", "temperature",
                        "top_k", "min_p", "save_steps", "save_total_limit", "eval_steps", "eval_limit", "log_completions_steps"]
        problems += [f"{name} must be >= 0, got {getattr(self, name)}" for name in non_negative
                     if isinstance(getattr(self, name), (int, float)) and getattr(self, name) < 0]
        if self.num_generations < 2:
            problems.append(f"num_generations must be >= 2 (a group of one has no baseline), got {self.num_generations}")
        if self.max_steps == 0 and self.epochs <= 0:
            problems.append("set --max-steps or a positive --epochs")
        if self.micro_batch_size > 0 and self.completions_per_step % self.micro_batch_size:
            problems.append(
                f"prompts_per_step * num_generations = {self.prompts_per_step} * {self.num_generations} = "
                f"{self.completions_per_step} is not a multiple of micro_batch_size = {self.micro_batch_size}"
            )
        if self.temperature == 0:
            problems.append("temperature must be > 0 for training (GRPO needs different completions per group)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.epsilon < 1:
            problems.append(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and not (self.epsilon_high >= 0 and math.isfinite(self.epsilon_high)):
            problems.append(f"epsilon_high must be a finite number >= 0, got {self.epsilon_high}")
        if self.delta is not None and not (self.delta > 1 and math.isfinite(self.delta)):
            problems.append(f"delta must be a finite number > 1, got {self.delta}")
        if not 0 <= self.warmup_ratio <= 1:
            problems.append(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            problems.append(f"adam betas must be in [0, 1), got ({self.adam_beta1}, {self.adam_beta2})")
        if not self.adam_epsilon > 0:
            problems.append(f"adam_epsilon must be > 0, got {self.adam_epsilon}")
        problems += self._objective_problems()
        if self.use_peft:
            if self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
                problems.append(f"LoRA needs lora_r >= 1, lora_alpha > 0 and lora_dropout in [0, 1), got "
                                f"({self.lora_r}, {self.lora_alpha}, {self.lora_dropout})")
            if any(name in ("lm_head", "embed_tokens") for name in self.lora_target_modules):
                problems.append("lora_target_modules: lm_head / embed_tokens cannot take an adapter (the log-probs "
                                "read the output matrix directly, as trl refuses it too)")
            if self.sync_ref_model:
                problems.append("sync_ref_model with use_peft: the reference is the model with its adapters off, "
                                "there is no reference copy to sync (as trl)")
        elif self.peft_adapter or self.save_merged:
            problems.append("peft_adapter and save_merged need --use-peft")
        if not self.distributed_timeout > 0:
            problems.append(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            problems.append(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        problems += self.path_problems(self.model, self.output_dir, self.chat_template)
        problems += self.template_kwargs_problems(self.chat_template_kwargs)
        try:
            parse_reward_specs(self.reward)
        except (ValueError, TypeError) as error:
            problems.append(str(error))
        self.raise_problems(problems)
        return self

    def _objective_problems(self) -> list[str]:
        """The checks of the objective's options, generation reuse and DAPO's pieces (trl's where trl has them)."""
        problems = []
        if not 0 <= self.top_entropy_quantile <= 1:
            problems.append(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            problems.append(f"off_policy_mask_threshold must be >= 0, got {self.off_policy_mask_threshold}")
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            problems.append(f"sapo temperatures must be > 0, got ({self.sapo_temperature_pos}, {self.sapo_temperature_neg})")
        if self.entropy_coef < 0 or self.entropy_coef_delta < 0 or self.entropy_coef_min < 0:
            problems.append("entropy_coef, entropy_coef_min and entropy_coef_delta must be >= 0")
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef_max:
            problems.append(f"entropy_coef_min ({self.entropy_coef_min}) must be <= entropy_coef_max ({self.entropy_coef_max})")
        if self.sync_ref_model and self.beta == 0:
            problems.append("sync_ref_model needs beta > 0: with beta = 0 no reference model is loaded to sync (as trl)")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            problems.append(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            problems.append(f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
        problems += self._generation_problems()
        if self.dynamic_sampling_max_rounds < 1:
            problems.append(f"dynamic_sampling_max_rounds must be >= 1, got {self.dynamic_sampling_max_rounds}")
        if not 0 <= self.overlong_buffer_len < max(self.max_completion_length, 1):
            problems.append(f"overlong_buffer_len must be in [0, max_completion_length = {self.max_completion_length}), "
                            f"got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            problems.append(f"overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")
        return problems

    def _generation_problems(self) -> list[str]:
        if self.micro_batch_size < 1 or self.completions_per_step % self.micro_batch_size:
            return []  # reported above
        accumulation = self.gradient_accumulation_steps
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            return ["set steps_per_generation or generation_batch_size, not both (as trl)"]
        if self.generation_batch_size is not None:
            if self.generation_batch_size < 1 or self.generation_batch_size % self.completions_per_step:
                return [f"generation_batch_size must be a positive multiple of the completions of one optimizer update "
                        f"(prompts_per_step * num_generations = {self.completions_per_step}), got {self.generation_batch_size}"]
        elif self.steps_per_generation is not None:
            if self.steps_per_generation < 1 or self.steps_per_generation % accumulation:
                return [f"steps_per_generation must be a positive multiple of the accumulation steps "
                        f"({self.completions_per_step} / {self.micro_batch_size} = {accumulation}): each optimizer update "
                        f"takes whole micro-batches of one rollout; got {self.steps_per_generation}"]
        return []


# Presets: named sets of overrides, applied before --config and the flags.
PRESETS: dict[str, dict] = {
    # The whole loop on CPU in about a minute: a tiny random-init model learns to write the format tags
    # (single tokens of the tiny tokenizer) that the dense `tags` reward pays for; reward rises visibly.
    "smoke": dict(
        model="tiny", dataset="synthetic:256", output_dir="runs/smoke", overwrite=True, max_steps=30, prompts_per_step=4,
        num_generations=8, micro_batch_size=16, max_prompt_length=128, max_completion_length=24,
        learning_rate=3e-3, warmup_ratio=0.0, lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.04,
        weight_decay=0.0, reward=["tags"], save_steps=15, eval_steps=30, eval_limit=16, eval_batch_size=16,
        log_completions_steps=5, logging_steps=5, device="cpu", precision="fp32",
    ),
}


def _flag_type(annotation):
    """(python type, is_list) for a field annotation such as `float | None` or `list[str]`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _flag_type(inner)
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def json_object(text: str) -> dict:
    """A flag's JSON object; argparse reports an error with the flag's name."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": true}}', got {text!r}")
    return value


def build_parser(config_cls=GRPOConfig, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (`--micro-batch-size` for `micro_batch_size`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    if config_cls is GRPOConfig:
        parser.add_argument("--preset", choices=sorted(PRESETS), help="a named set of settings (e.g. smoke: tiny model, CPU, ~1 min)")
    parser.add_argument("--config", help="a YAML or JSON file whose keys are the field names; flags override it")
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        kind, is_list = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "") + f" (default: {default!r})"
        help_text = help_text.replace("%", "%%")
        if f.name == "resume":
            parser.add_argument(flag, nargs="?", const="", help=help_text)
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif is_list:
            parser.add_argument(flag, nargs="+", type=kind, help=help_text)
        elif kind is dict:  # `none` clears it, as for the other optional flags
            parser.add_argument(flag, type=_optional(json_object), help=help_text)
        else:
            optional = type(None) in typing.get_args(hints[f.name])
            parser.add_argument(flag, type=_optional(kind) if optional else kind, choices=f.metadata.get("choices"), help=help_text)
    return parser


def load_config_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = file.read_text()
    if file.suffix in (".yaml", ".yml"):
        import yaml

        values = yaml.safe_load(text) or {}
    else:
        values = json.loads(text)
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of field names to values")
    return {key.replace("-", "_"): value for key, value in values.items()}


def config_from_args(argv=None, config_cls=GRPOConfig, description: str | None = None) -> GRPOConfig:
    """Parse flags into a validated config: defaults < --preset < --config FILE < explicit flags."""
    for arg in sys.argv[1:] if argv is None else argv:
        name = arg.split("=", 1)[0].removeprefix("--").removeprefix("no-").replace("-", "_")
        if arg.startswith("--") and name in REPLACED:
            raise ValueError(f"{arg.split('=', 1)[0]} was replaced by {REPLACED[name]}")
    args = vars(build_parser(config_cls, description).parse_args(argv))
    values = dict(PRESETS[args.pop("preset")]) if "preset" in args else {}
    if "config" in args:
        values.update(load_config_file(args.pop("config")))
    values.update(args)
    config = config_cls.from_dict(values, where="settings")
    if getattr(config, "resume", None) == "":  # `--resume` without a folder: this run's own output folder
        config.resume = config.output_dir
    return config.validate()


def cli_reference() -> str:
    """docs/cli.md: every flag of train.py with its default and help, in the config's order (`python -m grpo.config`)."""
    import eval as eval_program  # the evaluation program's settings, generated the same way

    def table(config_cls) -> list[str]:
        lines = ["| flag | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(config_cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            shown = "(R1 format prompt, data/prompts.py)" if f.name == "system_prompt" else repr(default)
            help_text = f.metadata.get("help", "").replace("|", "\\|")
            lines.append(f"| `--{f.name.replace('_', '-')}` | `{shown}` | {help_text} |")
        return lines

    smoke = " ".join(f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
                     for k, v in PRESETS["smoke"].items())
    return "\n".join([
        "# Command-line reference",
        "",
        "Generated from `grpo/config.py` by `python -m grpo.config > docs/cli.md` (tests/test_docs.py keeps it",
        "current). `python train.py --help` prints the same list. Flags can also come from `--config FILE` (YAML or",
        "JSON, keys are the field names); precedence: defaults < `--preset` < `--config` < flags. A boolean flag `--x`",
        "has its `--no-x`. Batch sizes count prompts and completions, not trl's per-device completions (README).",
        "",
        f"`--preset smoke` sets: `{smoke}`.",
        "",
        "## train.py",
        "",
        *table(GRPOConfig),
        "",
        "Replaced options (they fail with a message that names their replacement): "
        + "; ".join(f"`--{k.replace('_', '-')}` by {v}" for k, v in REPLACED.items()) + ".",
        "",
        "## eval.py",
        "",
        *table(eval_program.EvalConfig),
        "",
    ])


if __name__ == "__main__":
    print(cli_reference())
