"""GSM8K evaluation with our sampler: greedy decoding, then strict / lenient accuracy and format compliance.

    strict   the number inside the last <answer> equals the gold number
    lenient  the last number anywhere in the completion equals the gold number
    format   the completion has exactly the required <reasoning>/<answer> layout (strict_format)

Most early GRPO gains on GSM8K are format learning, so the three are reported separately.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm

from data.answers import canonical_number, extract_last_number, gold_from_column
from grpo.rollout import encode_prompts
from grpo.sampler import SamplingParams, sample_groups
from rewards.gsm8k import extract_xml_answer, strict_format


def score_answer(completion: str, gold: str) -> dict:
    """Strict, lenient and format scores (booleans) of one completion against a gold answer column."""
    gold_number = gold_from_column(gold)
    tagged = extract_xml_answer(completion)
    return {
        "strict": tagged is not None and gold_number is not None and canonical_number(tagged) == gold_number,
        "lenient": gold_number is not None and extract_last_number(completion) == gold_number,
        "format": strict_format(None, [completion])[0] > 0,
    }


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
) -> tuple[list[dict], dict]:
    """Greedy completions for rows with a `prompt` column; returns (per-sample records, summary)."""
    was_training = model.training
    model.eval()
    prompt_ids, rows, _ = encode_prompts(tokenizer, rows, max_prompt_length, "truncate", where="eval", progress=progress)
    params = SamplingParams(max_completion_length=max_completion_length, temperature=0.0, eos_token_ids=eos_token_ids)
    records = []
    bar = tqdm(total=len(rows), desc="eval", disable=not progress, leave=False)
    for start in range(0, len(rows), batch_size):
        with autocast or contextlib.nullcontext():
            sample = sample_groups(model, prompt_ids[start : start + batch_size], 1, params, tokenizer.pad_token_id)
        for offset, (ids, mask) in enumerate(zip(sample.completion_ids, sample.completion_mask, strict=True)):
            row = rows[start + offset]
            text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            records.append({
                "question": row.get("question"), "gold": gold_from_column(row.get("answer")), "completion": text,
                "length": int(mask.sum()), **score_answer(text, row.get("answer")),
            })
        bar.update(len(sample.completion_ids))
    bar.close()
    model.train(was_training)
    count = max(len(records), 1)
    summary = {
        "num_samples": len(records),
        "strict_accuracy": sum(r["strict"] for r in records) / count,
        "lenient_accuracy": sum(r["lenient"] for r in records) / count,
        "format_compliance": sum(r["format"] for r in records) / count,
        "mean_length": sum(r["length"] for r in records) / count,
    }
    return records, summary
