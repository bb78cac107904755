"""GRPO from scratch: the algorithm's pieces as pure functions, and the loop that composes them.

    grpo.trainer      the training loop: sample -> reward -> update -> log -> save (Trainer.train)
    grpo.update       one update: advantages -> ref/old log-probs -> micro-batch losses -> clip -> AdamW
    grpo.rollout      what one step trains on, the step's prompts, the generation seam, sample_rollout
    grpo.sampler      group sampling: prompt prefilled once, G completions decoded with a KV cache
    grpo.advantages   group-relative advantages and reward statistics
    grpo.logprobs     per-token log-probs of completions, chunked output projection (no (N, T, V) logits)
    grpo.loss         the clipped surrogate + k3 KL per token, the loss_type aggregations, entropy terms, statistics
    grpo.config       GRPOConfig, the single source of truth for every hyperparameter, and its validation
    grpo.cli          the command line, presets and config files, generated from GRPOConfig
    grpo.setup        what a run needs before its first step, and the one choice of --kernels
    grpo.kernels      fast paths that compute the same numbers (grpo/kernels/__init__.py)
    grpo.tiny_model   tiny random-init Qwen2 models + ChatML tokenizer for offline runs and tests

The public names below are importable from `grpo` itself; each is loaded on first use, so `import grpo` loads
no model library and changes nothing in the process (no environment variable, no registration).

Notation used throughout: B prompts per step, G completions per prompt (the group), N = B * G rows,
P prompt tokens, T completion tokens, V vocabulary, H hidden size.
"""

import importlib

_PUBLIC = {
    "GRPOConfig": "grpo.config",
    "Trainer": "grpo.trainer",
    "train_on_rollout": "grpo.update",
    "UpdateResult": "grpo.update",
    "Rollout": "grpo.rollout",
    "completion_logprobs": "grpo.logprobs",
    "sample_groups": "grpo.sampler",
    "score_completions": "rewards.scoring",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grpo' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
