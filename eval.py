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
from dataclasses import dataclass
from pathlib import Path

from data.prompts import SYSTEM_PROMPT
from grpo.config import KERNEL_CHOICES, ConfigMixin, _f, config_from_args


@dataclass
class EvalConfig(ConfigMixin):
    """Every setting of an evaluation run (the flags are generated from these fields)."""

    model: str = _f("Qwen/Qwen2.5-0.5B-Instruct", "hub id, local folder or checkpoint, or `tiny`")
    compare: str | None = _f(None, "a second model evaluated on the same problems, printed side by side")
    dataset: str = _f("openai/gsm8k", "hub id, local .jsonl/.json/.parquet file or folder, or `synthetic[:N]`; rows with a `prompt` column, or GSM8K's question/answer")
    split: str = _f("test", "dataset split")
    limit: int = _f(0, "evaluate the first N problems (0 = all)")
    system_prompt: str = _f(SYSTEM_PROMPT, "system prompt of GSM8K-style rows (the same as training)")
    one_shot: bool = _f(False, "GSM8K-style rows: a worked example before the question (the same as training)")
    chat_template: str | None = _f(None, "a Jinja chat template file for tokenizers that have none (as train.py's; a checkpoint keeps the one it trained with), used for --model and --compare")
    chat_template_kwargs: dict | None = _f(None, "extra keyword arguments of the chat template, a JSON object (the same as training), e.g. '{\"enable_thinking\": false}'")
    scorer: str = _f("auto", "gsm8k, rewards (the mean of each --reward function), module:function or file.py:function (fn(completion, row) -> dict of numbers); auto = gsm8k for GSM8K data, rewards otherwise")
    reward: list[str] = _f(["correctness"], "reward functions for --scorer rewards (names, module:function or file.py:function)")
    max_prompt_length: int = _f(512, "prompt tokens kept (truncated from the left)")
    max_completion_length: int = _f(512, "completion token budget")
    batch_size: int = _f(32, "prompts decoded together")
    device: str = _f("auto", "cuda, cpu, or auto")
    kernels: str = _f("auto", "fast paths (as train.py): auto or plain", choices=KERNEL_CHOICES)
    precision: str = _f("auto", "fp32, bf16 (autocast) or bf16-pure; auto = bf16 on CUDA", choices=("auto", "fp32", "bf16", "bf16-pure"))
    trust_remote_code: bool = _f(False, "run model/tokenizer code from the hub")
    skip_bad_rows: bool = _f(False, "drop rows without a prompt (or a question and a parseable gold answer)")
    output_dir: str = _f("runs/eval", "where the per-sample JSONL and summary JSON go")

    def validate(self) -> "EvalConfig":
        problems = [f"{name} must be >= 1, got {getattr(self, name)}"
                    for name in ("max_prompt_length", "max_completion_length", "batch_size") if getattr(self, name) < 1]
        if self.limit < 0:
            problems.append(f"limit must be >= 0, got {self.limit}")
        for model in [self.model, self.compare]:
            problems += self.path_problems(model, self.output_dir, self.chat_template) if model else []
        problems += self.template_kwargs_problems(self.chat_template_kwargs)
        self.raise_problems(problems)
        return self


def output_stem(name: str) -> str:
    """The file-name stem of a model's outputs: <stem>.samples.jsonl and <stem>.summary.json."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip("/")) or "model"


def evaluate_model(config: EvalConfig, name: str, rows: list[dict], scorer) -> dict:
    import torch

    from grpo.evaluation import evaluate
    from grpo.generation import GroupSampler
    from grpo.kernels import select_kernels
    from grpo.models import eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_precision

    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    setting = "--compare" if name == config.compare and name != config.model else "--model"
    tokenizer = load_tokenizer(name, config.trust_remote_code, config.chat_template, setting)
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = load_model(name, device, dtype, config.trust_remote_code, tokenizer, setting).eval()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    backend = GroupSampler(model, tokenizer.pad_token_id, select_kernels(config.kernels, device, model=model))
    records, summary = evaluate(model, tokenizer, rows, eos_token_ids(model, tokenizer), config.max_prompt_length,
                                config.max_completion_length, config.batch_size, autocast=autocast, scorer=scorer,
                                backend=backend, chat_template_kwargs=config.chat_template_kwargs)
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
    from grpo.evaluation import make_scorer
    from grpo.models import ModelError
    from rewards import RewardError, parse_reward_specs

    try:
        rows, task = load_task_rows(config.dataset, config.split, config.skip_bad_rows, config.system_prompt,
                                    config.one_shot)
        rows = rows[: config.limit] if config.limit else rows
        scorer = make_scorer(config.scorer, task, parse_reward_specs(config.reward))
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
