"""Evaluate a model with greedy decoding: on GSM8K strict accuracy, lenient accuracy and format compliance; on
other tasks the mean of each reward function (--reward) or of your own scorer (--scorer module:function). With
--num-samples k > 1, also k completions per problem at --temperature: pass@1..k and maj@k with 95% intervals.

    python eval.py --model runs/smoke/checkpoints/step-000030 --dataset synthetic --limit 50
    python eval.py --model Qwen/Qwen2.5-0.5B-Instruct --split test
    python eval.py --model runs/grpo/checkpoints/step-000500 --compare Qwen/Qwen2.5-0.5B-Instruct
    python eval.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset reasoning-gym:chain_sum \
        --task-settings '{"min_terms": 2, "max_terms": 2}' --reward task_score --num-samples 8 --temperature 1.0

Writes <output-dir>/<model name>.samples.jsonl (one record per problem), <model name>.summary.json and, with
--num-samples, <model name>.pass_at_k.jsonl (each problem's k completions, votes and correct count).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from textwrap import shorten
from pathlib import Path

from grpo.cli import make_config, run_settings, settings_from_args
from grpo.evaluation.evaluate import EvalConfig, unused_settings


def output_stem(name: str) -> str:
    """The file-name stem of a model's outputs: <stem>.samples.jsonl and <stem>.summary.json."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip("/")) or "model"


def is_correct(record: dict, pass_key: str | None, threshold: float) -> bool:
    value = record.get(pass_key) if pass_key else None
    return isinstance(value, (int, float)) and value >= threshold


def constant_scorer(rows: list[dict], scorer, pass_key: str | None, threshold: float, task: str, environments):
    """`answer -> [correct per problem]`: the completion `<answer>ANSWER</answer>` for every problem, scored as the
    model's are; None where there is no gold answer to compare (rows of other tasks, environments' episodes)."""
    if task not in ("gsm8k", "reasoning-gym") or environments or not pass_key:
        return None

    def score(answer: str) -> list[bool]:
        records = scorer([f"<answer>{answer}</answer>"] * len(rows), rows, [[] for _ in rows])
        return [is_correct(record, pass_key, threshold) for record in records]
    return score


def evaluate_model(config: EvalConfig, name: str, rows: list[dict], scorer, task: str, pass_key: str | None,
                   reward_specs=None, environments=None) -> dict:
    import torch

    from grpo.evaluation.answers import prior_summary
    from grpo.evaluation.evaluate import evaluate, evaluate_samples, sample_answer
    from grpo.generation.rollout import GroupSampler
    from grpo.kernels import select_kernels
    from grpo.models import eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_precision
    from grpo.core.setup import tool_set

    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    setting = "--compare" if name == config.compare and name != config.model else "--model"
    tokenizer = load_tokenizer(name, config.trust_remote_code, config.chat_template, setting)
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = load_model(name, device, dtype, config.trust_remote_code, tokenizer, setting).eval()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    kernels = select_kernels(config.kernels, device, model=model)
    kernels.prepare_model(model)
    # as in training: the tools' schemas in the prompt; environments played and scored by the rewards
    tools, template_kwargs, played = tool_set(config, tokenizer, environments=environments)
    backend = GroupSampler(model, tokenizer.pad_token_id, kernels.sampler(config.max_prompt_length), tools)
    played_with = dict(environments=played, reward_specs=reward_specs)
    records, summary = evaluate(model, tokenizer, rows, eos_token_ids(model, tokenizer), config.max_prompt_length,
                                config.max_completion_length, config.batch_size, autocast=autocast, scorer=scorer,
                                backend=backend, chat_template_kwargs=template_kwargs, **played_with)
    # guards against the prior (grpo/evaluation/answers.py): the model's most common answer, the best constant answer
    answers = [sample_answer(record["completion"], task, row) for record, row in zip(records, rows, strict=True)]
    for record, answer in zip(records, answers, strict=True):
        record["answer"] = answer
    try:  # a scorer that cannot score a bare `<answer>X</answer>` loses the guard, not the evaluation
        correct = [is_correct(record, pass_key, config.pass_threshold) for record in records]
        constant = constant_scorer(rows, scorer, pass_key, config.pass_threshold, task, environments)
        summary.update(prior_summary(answers, [record["gold"] for record in records], correct, constant))
    except Exception as error:  # noqa: BLE001 - reported, and the evaluation goes on
        logging.getLogger("grpo").warning("the best constant answer was not scored: %s: %s", type(error).__name__,
                                          error)
        summary.update(prior_summary(answers, [None] * len(answers), [], None))
    folder = Path(config.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = output_stem(name)
    with (folder / f"{stem}.samples.jsonl").open("w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    summary = {"model": name, "dataset": config.dataset, "split": config.split, **summary}
    if config.num_samples > 1:
        torch.manual_seed(config.seed)
        sampled, summary["sampling"] = evaluate_samples(
            model, tokenizer, rows, eos_token_ids(model, tokenizer), config.max_prompt_length,
            config.max_completion_length, config.num_samples, config.temperature, pass_key, config.pass_threshold,
            task, config.batch_size, autocast=autocast, scorer=scorer, backend=backend,
            chat_template_kwargs=template_kwargs, **played_with)
        with (folder / f"{stem}.pass_at_k.jsonl").open("w") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in sampled)
    (folder / f"{stem}.summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def prior_line(summary: dict) -> str:
    """One line on the prior: the model's most common answer, and the best constant answer's accuracy."""
    line = (f"{summary['model']}: its most common answer {summary['answers/most_common']!r} is "
            f"{summary['answers/most_common_share']:.1%} of the answers it gave")
    if "best_constant_answer" in summary:
        line += (f"; always answering {summary['best_constant_answer']!r} would score "
                 f"{summary['best_constant_accuracy']:.1%}, and on the problems it misses the model scores "
                 f"{summary['accuracy_beyond_constant']:.1%}")
    return line


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:  # a trained run's own settings for every evaluation setting not given here
        given = settings_from_args(argv, EvalConfig, description=__doc__)
        values, taken, record = run_settings(given)
        config = make_config(values, EvalConfig, given=given)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if record is not None:
        print(f"evaluating {config.model} as it was trained: settings from {record} (not given here): "
              + (", ".join(f"{name}={shorten(repr(value), 70)}" for name, value in taken.items())
                 or "none differ from eval.py's"))
    from data import DataError, load_task_rows
    from grpo.evaluation.evaluate import default_pass_key, make_scorer, scorer_kind
    from grpo.models import ModelError, resolve_device
    from grpo.errors import PluginError
    from grpo.core.setup import environments as load_environments, reward_specs as reward_specs_of
    from rewards import RewardError
    from rewards.reward_model import load_reward_models
    from rewards.scoring import check_reward_columns

    try:
        rows, task = load_task_rows(config.dataset, config.split, config.skip_bad_rows, config.system_prompt,
                                    config.one_shot, config.task_settings, config.task_seed, config.answer_extraction,
                                    config.trust_task_verifier, config.dataset_prompt_column)
        config.raise_problems(unused_settings(config, task))  # a flag that would do nothing is refused, not ignored
        rows = rows[: config.limit] if config.limit else rows
        environments = load_environments(config)  # their get_reward scores join the rewards, as in training
        reward_specs = reward_specs_of(config, environments=environments)
        scorer_name = "rewards" if environments else config.scorer
        if scorer_kind(scorer_name, task) == "rewards" and not environments:  # refused here, not mid-evaluation
            check_reward_columns(reward_specs, rows, f"{config.dataset}[{config.split}]")
        scorer = make_scorer(scorer_name, task, reward_specs, config.sandbox_isolation)
        if scorer_kind(scorer_name, task) == "rewards":  # a --reward model scores on the evaluation's device
            load_reward_models(reward_specs, resolve_device(config.device))
        pass_key = config.pass_key or default_pass_key(scorer_name, task, reward_specs)
        if config.num_samples > 1 and pass_key is None:
            raise ValueError(f"--scorer {config.scorer} with --num-samples: name the score that makes a sample correct "
                             "with --pass-key")
        summaries = [evaluate_model(config, name, rows, scorer, task, pass_key, reward_specs, environments)
                     for name in [config.model, config.compare] if name]
    except (ValueError, DataError, ModelError, RewardError, PluginError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    keys = [key for key in summaries[0] if key not in ("model", "dataset", "split", "num_samples", "sampling")
            and isinstance(summaries[0][key], (int, float))]
    width = max(len(s["model"]) for s in summaries)
    print(f"{'model':{width}s}  " + "  ".join(f"{k:>17s}" for k in keys) + f"   ({len(rows)} problems, greedy)")
    for summary in summaries:
        print(f"{summary['model']:{width}s}  " + "  ".join(f"{summary[k]:17.4f}" for k in keys))
    for summary in summaries:
        print(prior_line(summary))
    if config.num_samples > 1:
        names = [key for key in summaries[0]["sampling"] if key.startswith(("pass@", "maj@"))]
        print(f"\n{config.num_samples} samples per problem at temperature {config.temperature} (correct: "
              f"{summaries[0]['sampling']['pass_key']} >= {config.pass_threshold}), mean [95% interval]:")
        print(f"{'model':{width}s}  " + "  ".join(f"{k:>21s}" for k in names))
        for summary in summaries:
            cells = [summary["sampling"][k] for k in names]
            print(f"{summary['model']:{width}s}  " + "  ".join(
                f"{c['mean']:.3f} [{c['low']:.3f},{c['high']:.3f}]".rjust(21) for c in cells))
    print(f"per-sample records and summaries in {config.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
