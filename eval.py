"""Evaluate a model with greedy decoding: on GSM8K strict accuracy, lenient accuracy and format compliance; on
other tasks the mean of each reward function (--reward) or of your own scorer (--scorer module:function).

    python eval.py --model runs/smoke/checkpoints/step-000030 --dataset synthetic --limit 50
    python eval.py --model Qwen/Qwen2.5-0.5B-Instruct --split test
    python eval.py --model runs/grpo/checkpoints/step-000500 --compare Qwen/Qwen2.5-0.5B-Instruct

Writes <output-dir>/<model name>.samples.jsonl (one record per problem) and <model name>.summary.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from pathlib import Path

from grpo.cli import config_from_args
from grpo.loop.evaluation import EvalConfig


def output_stem(name: str) -> str:
    """The file-name stem of a model's outputs: <stem>.samples.jsonl and <stem>.summary.json."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip("/")) or "model"


def evaluate_model(config: EvalConfig, name: str, rows: list[dict], scorer) -> dict:
    import torch

    from grpo.loop.evaluation import evaluate
    from grpo.loop.rollout import GroupSampler
    from grpo.kernels import select_kernels
    from grpo.models import eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_precision
    from grpo.loop.setup import tool_set

    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    setting = "--compare" if name == config.compare and name != config.model else "--model"
    tokenizer = load_tokenizer(name, config.trust_remote_code, config.chat_template, setting)
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = load_model(name, device, dtype, config.trust_remote_code, tokenizer, setting).eval()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    kernels = select_kernels(config.kernels, device, model=model)
    kernels.prepare_model(model)
    tools, template_kwargs = tool_set(config, tokenizer)  # as in training: the tools' schemas in the prompt
    backend = GroupSampler(model, tokenizer.pad_token_id, kernels.sampler(config.max_prompt_length), tools)
    records, summary = evaluate(model, tokenizer, rows, eos_token_ids(model, tokenizer), config.max_prompt_length,
                                config.max_completion_length, config.batch_size, autocast=autocast, scorer=scorer,
                                backend=backend, chat_template_kwargs=template_kwargs)
    folder = Path(config.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = output_stem(name)
    with (folder / f"{stem}.samples.jsonl").open("w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    summary = {"model": name, "dataset": config.dataset, "split": config.split, **summary}
    (folder / f"{stem}.summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(argv, EvalConfig, description=__doc__)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from data import DataError, load_task_rows
    from grpo.loop.evaluation import make_scorer
    from grpo.models import ModelError
    from rewards import RewardError, parse_reward_specs

    try:
        rows, task = load_task_rows(config.dataset, config.split, config.skip_bad_rows, config.system_prompt,
                                    config.one_shot)
        rows = rows[: config.limit] if config.limit else rows
        scorer = make_scorer(config.scorer, task, parse_reward_specs(config.reward), config.sandbox_isolation)
        summaries = [evaluate_model(config, name, rows, scorer) for name in [config.model, config.compare] if name]
    except (ValueError, DataError, ModelError, RewardError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    keys = [key for key in summaries[0] if key not in ("model", "dataset", "split", "num_samples")]
    width = max(len(s["model"]) for s in summaries)
    print(f"{'model':{width}s}  " + "  ".join(f"{k:>17s}" for k in keys) + f"   ({len(rows)} problems)")
    for summary in summaries:
        print(f"{summary['model']:{width}s}  " + "  ".join(f"{summary[k]:17.4f}" for k in keys))
    print(f"per-sample records and summaries in {config.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
