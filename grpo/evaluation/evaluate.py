"""Evaluation: greedy completions from the generation backend, scored by the task's scorer; with `num_samples` k > 1,
also k sampled completions per problem at a temperature, reported as pass@1..k and maj@k (grpo/evaluation/pass_at_k.py).

Scorers (`--eval-scorer`), each giving numbers per completion whose means are the summary:
    gsm8k      strict_accuracy (the number in the last <answer> equals the gold number), lenient_accuracy (the
               last number anywhere does), format_compliance (the exact <reasoning>/<answer> layout).
               Most early GRPO gains on GSM8K are format learning, so the three are reported separately.
    rewards    the training reward functions: `rewards/<name>` per function and `reward` (their weighted sum)
    module:function or path/to/file.py:function    fn(completion: str, row: dict) -> dict of numbers
    auto       gsm8k for GSM8K data, rewards for other tasks

A sample counts as correct for pass@k when its `pass_key` score (default: strict_accuracy for gsm8k, the first
reward function's value for rewards) is at least `pass_threshold`; its vote for maj@k is the text of its last
<answer> (as a canonical number for GSM8K, as --answer-extraction finds it for reasoning-gym), a sample without one
casting none.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from data.answers import canonical_number, extract_last_number, gold_from_column
from grpo.config import ConfigMixin, option, shared
from grpo.config_types import type_problems
from grpo.errors import PluginError, guarded, source_file
from grpo.generation.prompts import encode_prompts
from grpo.algorithm.sampler import SamplingParams
from grpo.algorithm.advantages import weighted_rewards
from grpo.evaluation.pass_at_k import summarize_samples
from grpo.generation.rollout import GroupSampler
from rewards import load_function, score_rows
from rewards.gsm8k import extract_xml_answer, strict_format
from rewards.reasoning_gym import extract_answer as extract_task_answer
from rewards.sandbox import check_isolation


@dataclass
class EvalConfig(ConfigMixin):
    """Every setting of an evaluation run (the flags are generated from these fields)."""

    model: str = option("Qwen/Qwen2.5-0.5B-Instruct", "hub id, local folder, `tiny`, or a trained run: its folder "
                        "(its newest complete checkpoint) or a checkpoint folder, whose run_config.json gives every "
                        "evaluation setting not given here (printed at start)")
    compare: str | None = option(None, "a second model evaluated on the same problems under the same settings, "
                                 "printed side by side")
    dataset: str = shared("dataset")
    dataset_prompt_column: str | None = shared("dataset_prompt_column")
    split: str = option("test", "dataset split (a trained run's: its --eval-split)", from_run="eval_split")
    limit: int = option(0, "evaluate the first N problems (0 = all)")
    system_prompt: str | None = shared("system_prompt")
    one_shot: bool = shared("one_shot")
    chat_template: str | None = shared("chat_template", help="a Jinja chat template file, for tokenizers that have "
                                       "none (a checkpoint keeps the one it trained with); used for --model and "
                                       "--compare", from_run=None)
    chat_template_kwargs: dict | None = shared("chat_template_kwargs")
    task_settings: dict | None = shared("task_settings")
    task_seed: int = shared("task_seed")
    answer_extraction: str = shared("answer_extraction")
    trust_task_verifier: bool = shared("trust_task_verifier")
    tools: list[str] = shared("tools")
    max_tool_calling_iterations: int | None = shared("max_tool_calling_iterations")
    environment: list[str] = shared("environment")
    environment_timeout: float = shared("environment_timeout")
    scorer: str = option("auto", "gsm8k, rewards (the mean of each --reward function), module:function or "
                         "file.py:function (fn(completion, row) -> dict of numbers); auto = gsm8k for GSM8K data, "
                         "rewards otherwise (a trained run's: its --eval-scorer)", from_run="eval_scorer")
    reward: list[str] | None = shared("reward", help="reward functions for --scorer rewards (names, module:function "
                                      "or file.py:function, or a reward model: its folder or model:ORG/NAME), each "
                                      "with an optional weight; default: a trained run's own, else the data's, as "
                                      "train.py's (task_solved for reasoning-gym:NAME, the environment's get_reward "
                                      "alone with --environment, else correctness)")
    sandbox_isolation: str = shared("sandbox_isolation")
    max_prompt_length: int = shared("max_prompt_length", default=512)
    max_completion_length: int = option(512, "completion token budget (a trained run's: its "
                                        "--eval-max-completion-length, else its --max-completion-length)",
                                        from_run=("eval_max_completion_length", "max_completion_length"))
    batch_size: int = option(32, "prompts decoded together (greedy); with --num-samples, batch_size // k prompts of k "
                             "completions each (a trained run's: its --eval-batch-size)", from_run="eval_batch_size")
    num_samples: int = option(1, "k: completions sampled per problem at --temperature, beside the greedy one; k > 1 "
                              "reports pass@1..k (Chen et al.'s unbiased estimator) and maj@k, each with a 95% "
                              "interval over the problems")
    temperature: float = option(1.0, "sampling temperature of the --num-samples completions (the greedy scores do not "
                                "use it)")
    seed: int = option(0, "seed of the sampled completions")
    pass_key: str | None = option(None, "the score that makes a sample correct for pass@k and maj@k; default: "
                                  "strict_accuracy (gsm8k scorer) or the first --reward's value (rewards scorer); a "
                                  "custom scorer names one of its keys")
    pass_threshold: float = option(1.0, "a sample is correct when its --pass-key score is at least this")
    device: str = shared("device", from_run=None)
    kernels: str = shared("kernels", from_run=None)
    precision: str = shared("precision", from_run=None)
    trust_remote_code: bool = shared("trust_remote_code", from_run=None)
    skip_bad_rows: bool = shared("skip_bad_rows")
    output_dir: str = option("runs/eval", "where the per-sample JSONL and summary JSON go")

    def validate(self) -> "EvalConfig":
        self.raise_problems(type_problems(self))  # every value of its field's type before any check reads it
        self.resolve_defaults(["correctness"])
        problems = [f"{name} must be >= 1, got {getattr(self, name)}"
                    for name in ("max_prompt_length", "max_completion_length", "batch_size") if getattr(self, name) < 1]
        if self.limit < 0:
            problems.append(f"limit must be >= 0, got {self.limit}")
        if self.num_samples < 1:
            problems.append(f"num_samples must be >= 1, got {self.num_samples}")
        if not self.environment_timeout > 0:
            problems.append(f"environment_timeout must be > 0 seconds, got {self.environment_timeout}")
        if self.num_samples > 1 and not (self.temperature > 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be a finite number > 0 for --num-samples > 1, got {self.temperature}")
        problems += self.device_problems(self.device)
        for model in [self.model, self.compare]:
            problems += self.path_problems(model, self.output_dir, self.chat_template) if model else []
        problems += self.template_kwargs_problems(self.chat_template_kwargs)
        problems += self.task_problems()
        self.raise_problems(problems)
        return self


def unused_settings(config: EvalConfig, task: str) -> list[str]:
    """The settings given on the command line (config.given) that this evaluation would not read, each named with
    what would read it: a reward without the rewards scorer, a sampling setting without --num-samples > 1, a task's
    setting on another task's rows, a tool or environment setting without tools or environments."""
    scorer = "rewards" if config.environment else scorer_kind(config.scorer, task)
    how = f"--scorer {config.scorer}" + (f", which on {task} rows is {scorer}" if config.scorer == "auto" else "")
    rules = [
        ("reward", scorer == "rewards", f"the rewards scorer (--scorer rewards) reads it; this evaluation scores with "
                                        f"{how}: pass --scorer rewards, or leave it out"),
        ("temperature", config.num_samples > 1, "--num-samples > 1 reads it (the greedy evaluation does not sample)"),
        ("seed", config.num_samples > 1, "--num-samples > 1 reads it (the greedy evaluation does not sample)"),
        ("answer_extraction", task == "reasoning-gym", f"a reasoning-gym dataset reads it; these are {task} rows"),
        ("task_seed", task == "reasoning-gym", f"a reasoning-gym dataset reads it; these are {task} rows"),
        ("trust_task_verifier", task == "reasoning-gym", f"a reasoning-gym dataset reads it; these are {task} rows"),
        ("one_shot", task == "gsm8k", f"GSM8K-style rows (a question and an answer) read it; these are {task} rows"),
        ("system_prompt", task in ("gsm8k", "reasoning-gym"), "GSM8K-style rows and reasoning-gym tasks read it; rows "
                                                              "with a prompt column keep their own"),
        ("max_tool_calling_iterations", bool(config.tools or config.environment), "--tools or --environment reads it"),
        ("environment_timeout", bool(config.environment), "--environment reads it"),
    ]
    return [f"--{name.replace('_', '-')} does nothing here: {why}" for name, used, why in rules
            if name in config.given and not used]


def score_answer(completion: str, gold: str) -> dict:
    """Strict, lenient and format scores (booleans) of one completion against a gold answer column."""
    gold_number = gold_from_column(gold)
    tagged = extract_xml_answer(completion)
    return {
        "strict": tagged is not None and gold_number is not None and canonical_number(tagged) == gold_number,
        "lenient": gold_number is not None and extract_last_number(completion) == gold_number,
        "format": strict_format(None, [completion])[0] > 0,
    }


def gsm8k_scores(completions: list[str], rows: list[dict], completion_ids=None) -> list[dict]:
    scores = [score_answer(text, row.get("answer")) for text, row in zip(completions, rows, strict=True)]
    return [{"strict_accuracy": float(s["strict"]), "lenient_accuracy": float(s["lenient"]),
             "format_compliance": float(s["format"])} for s in scores]


def reward_scores(reward_specs):
    """A scorer from the training rewards: each function's value and the weighted sum `reward` (None rows left out)."""
    def score(completions: list[str], rows: list[dict], completion_ids: list[list[int]]) -> list[dict]:
        return reward_records(score_rows(reward_specs, rows, completions, completion_ids), reward_specs)
    return score


def reward_records(per_func: torch.Tensor, reward_specs) -> list[dict]:
    """(n, K) rewards as the rewards scorer's records: each function's value and the weighted sum `reward` (NaN
    where no function scored the row)."""
    weights = torch.tensor([spec.weight for spec in reward_specs], dtype=torch.float32)
    totals = weighted_rewards(per_func, weights).tolist()  # (n,)
    return [{**{f"rewards/{spec.name}": value for spec, value in zip(reward_specs, values, strict=True)},
             "reward": total} for values, total in zip(per_func.tolist(), totals, strict=True)]


def scorer_kind(name: str, task: str) -> str:
    """`--eval-scorer auto` resolved for the task: gsm8k for GSM8K data, rewards otherwise; any other name as given."""
    if name == "auto":
        return "gsm8k" if task == "gsm8k" else "rewards"
    return name


def make_scorer(name: str, task: str, reward_specs=None, sandbox_isolation: str = "available"):
    """The batch scorer `fn(completions, rows, completion_ids) -> list of dicts` that `--eval-scorer name` means;
    `sandbox_isolation` as rewards.sandbox.check_isolation takes it, for a scorer that runs the model's programs."""
    name = scorer_kind(name, task)
    if name == "gsm8k":
        return gsm8k_scores
    if name == "rewards":
        if not reward_specs:
            raise ValueError("--eval-scorer rewards needs the training reward functions")
        check_isolation([spec.fn for spec in reward_specs], sandbox_isolation)
        return reward_scores(reward_specs)
    function = guarded(load_function(name, what="eval scorer"), "eval scorer", name)  # its faults name it
    check_isolation([function], sandbox_isolation)

    def score(completions, rows, completion_ids=None):
        records = []
        for text, row in zip(completions, rows, strict=True):
            value = function(text, row)
            numbers = isinstance(value, dict) and all(isinstance(key, str) and isinstance(v, (int, float))
                                                      and not isinstance(v, bool) for key, v in value.items())
            if not numbers:  # a plug-in's wrong output: named as its exceptions are (grpo.errors.guarded)
                raise PluginError(f"eval scorer {name!r} ({source_file(function)}) returned {value!r:.200}, expected "
                                  "a dict of names to numbers")
            records.append({key: float(v) for key, v in value.items()})
        return records
    return score


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    eos_token_ids: tuple[int, ...],
    max_prompt_length: int,
    max_completion_length: int,
    batch_size: int = 32,
    autocast=None,
    progress: bool = True,
    scorer=gsm8k_scores,
    backend=None,
    chat_template_kwargs: dict | None = None,
    environments=None,
    reward_specs=None,
) -> tuple[list[dict], dict]:
    """Greedy completions for rows with a `prompt` column; returns (per-sample records, summary of means).

    `backend`: a grpo.generation.rollout backend (default: our plain sampler); `scorer`: as `make_scorer` returns;
    `chat_template_kwargs`: as in training (grpo.generation.prompts.encode_prompt); `environments`
    (grpo.multiturn.environments.EnvironmentRollouts): each completion plays its own, and is scored by `reward_specs`
    (the environments' get_reward among them) instead of `scorer`.
    """
    backend = backend or GroupSampler(model, tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    prompt_ids, rows, _ = encode_prompts(tokenizer, rows, max_prompt_length, "truncate", where="eval",
                                         progress=progress, chat_template_kwargs=chat_template_kwargs)
    params = SamplingParams(max_completion_length=max_completion_length, temperature=0.0, eos_token_ids=eos_token_ids)
    records = []
    bar = tqdm(total=len(rows), desc="eval", disable=not progress, leave=False)
    for start in range(0, len(rows), batch_size):
        batch_rows = rows[start : start + batch_size]
        with autocast or contextlib.nullcontext():
            texts, completion_ids, batch_scores = complete_and_score(
                backend, tokenizer, batch_rows, prompt_ids[start : start + batch_size], 1, params, scorer,
                environments, reward_specs)
        for row, text, ids, scores in zip(batch_rows, texts, completion_ids, batch_scores, strict=True):
            question = row.get("question") or _prompt_text(row["prompt"])
            records.append({"question": question, "gold": gold_answer(row), "completion": text, "length": len(ids),
                            **scores})
        bar.update(len(batch_rows))
    bar.close()
    model.train(was_training)
    return records, summarize(records)


def sample_answer(text: str, task: str, row: dict) -> str | None:
    """A sample's vote for maj@k: the text of its last <answer> (GSM8K: as a canonical number; reasoning-gym: as the
    row's --answer-extraction finds it), or None."""
    if task == "reasoning-gym":
        return extract_task_answer(text, row.get("answer_extraction", "tag")) or None
    answer = extract_xml_answer(text)
    if task == "gsm8k":
        return canonical_number(answer)
    return answer or None


def default_pass_key(scorer_name: str, task: str, reward_specs=None) -> str | None:
    """The score that makes a sample correct when --pass-key is not given (None: a custom scorer must name one)."""
    scorer_name = scorer_kind(scorer_name, task)
    if scorer_name == "gsm8k":
        return "strict_accuracy"
    if scorer_name == "rewards" and reward_specs:
        return f"rewards/{reward_specs[0].name}"
    return None


@torch.no_grad()
def evaluate_samples(model, tokenizer, rows: list[dict], eos_token_ids: tuple[int, ...], max_prompt_length: int,
                     max_completion_length: int, num_samples: int, temperature: float, pass_key: str,
                     pass_threshold: float = 1.0, task: str = "prompt", batch_size: int = 32, autocast=None,
                     progress: bool = True, scorer=gsm8k_scores, backend=None,
                     chat_template_kwargs: dict | None = None, environments=None,
                     reward_specs=None) -> tuple[list[dict], dict]:
    """k = `num_samples` completions per row at `temperature` (seed the global RNG first), scored by `scorer`;
    returns (one record per problem: its completions, scores, votes and correct count; pass@1..k and maj@k with
    95% intervals, grpo.evaluation.pass_at_k). `environments`, `reward_specs`: as `evaluate`'s."""
    backend = backend or GroupSampler(model, tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    prompt_ids, rows, _ = encode_prompts(tokenizer, rows, max_prompt_length, "truncate", where="eval", progress=False,
                                         chat_template_kwargs=chat_template_kwargs)
    params = SamplingParams(max_completion_length=max_completion_length, temperature=temperature,
                            eos_token_ids=eos_token_ids)
    prompts_per_batch = max(1, batch_size // num_samples)
    records = []
    bar = tqdm(total=len(rows), desc=f"eval {num_samples} samples", disable=not progress, leave=False)
    for start in range(0, len(rows), prompts_per_batch):
        batch_rows = rows[start : start + prompts_per_batch]
        with autocast or contextlib.nullcontext():  # grouped by prompt: rows [i*k, (i+1)*k) belong to prompt i
            texts, completion_ids, scores = complete_and_score(
                backend, tokenizer, batch_rows, prompt_ids[start : start + prompts_per_batch], num_samples, params,
                scorer, environments, reward_specs)
        if scores and pass_key not in scores[0]:
            raise ValueError(f"--pass-key {pass_key!r} is not a score of this scorer; its scores: {sorted(scores[0])}")
        for index, row in enumerate(batch_rows):
            group = slice(index * num_samples, (index + 1) * num_samples)
            correct = [score[pass_key] >= pass_threshold for score in scores[group]]  # NaN: not correct
            records.append({"question": row.get("question") or _prompt_text(row["prompt"]),
                            "gold": gold_answer(row),
                            "completions": texts[group], "answers": [sample_answer(t, task, row) for t in texts[group]],
                            "correct": correct, "num_correct": sum(correct), "scores": scores[group]})
        bar.update(len(batch_rows))
    bar.close()
    model.train(was_training)
    summary = {"num_samples": num_samples, "temperature": temperature, "pass_key": pass_key,
               "pass_threshold": pass_threshold,
               **summarize_samples([r["correct"] for r in records], [r["answers"] for r in records])}
    return records, summary


def complete_and_score(backend, tokenizer, rows: list[dict], prompt_ids: list[list[int]], per_row: int, params,
                       scorer, environments=None, reward_specs=None) -> tuple[list[str], list[list[int]], list[dict]]:
    """`per_row` completions of each row, grouped by row: (texts, token ids, a dict of scores each). With
    environments they are played and scored as in training (grpo.generation.rollout.sample_rollout), with the rewards
    scorer's records."""
    if environments is not None:
        rollout, _, texts = environments.sample_rollout(backend, tokenizer, reward_specs, rows, prompt_ids, per_row,
                                                        params, None)
        completion_ids = [ids[mask.bool()].tolist() for ids, mask in
                          zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu(), strict=True)]
        return texts, completion_ids, reward_records(rollout.rewards_per_func, reward_specs)
    sample = backend.generate(prompt_ids, per_row, params)
    completion_ids = [ids[mask.bool()].tolist() for ids, mask in
                      zip(sample.completion_ids.cpu(), sample.completion_mask.cpu(), strict=True)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return texts, completion_ids, scorer(texts, [row for row in rows for _ in range(per_row)], completion_ids)


def gold_answer(row: dict) -> str | None:
    """A record's gold: the row's `answer` as a canonical number when it is one (GSM8K), else as the task's text."""
    gold = row.get("answer")
    return (gold_from_column(str(gold)) or str(gold)) if gold is not None else None


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))


def summarize(records: list[dict]) -> dict:
    """num_samples, the mean of every score (NaN values left out) and the mean completion length."""
    described = ("question", "gold", "completion", "length")  # what a record says besides its scores
    score_keys = [key for key in (records[0] if records else {}) if key not in described]
    summary = {"num_samples": len(records)}
    for key in score_keys:
        values = [r[key] for r in records if isinstance(r[key], (int, float)) and not math.isnan(r[key])]
        summary[key] = sum(values) / len(values) if values else math.nan
    summary["mean_length"] = sum(r["length"] for r in records) / max(len(records), 1)
    return summary


def save_evaluation(run_dir, step: int, records: list[dict], summary: dict) -> None:
    """A training run's evaluation at `step`: eval/step-*.json (the summary) and eval/step-*.samples.jsonl."""
    folder = Path(run_dir) / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"step-{step:06d}.json").write_text(json.dumps(summary, indent=2))
    with (folder / f"step-{step:06d}.samples.jsonl").open("w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
