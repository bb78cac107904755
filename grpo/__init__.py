"""GRPO from scratch: the algorithm's math as pure functions, and the loop that composes them.

    grpo/algorithm/   the math: group sampling (sampler), per-token log-probs (logprobs), advantages
                      (advantages), the per-token objectives, KL and aggregations (loss), the update's functions (step)
    grpo/core/        the core loop: Trainer.train (trainer) -> sample_rollout -> train_on_rollout (update) -> metrics;
                      the set-up (setup), checkpoints (run_state, checkpoint)
    grpo/generation/  the rollout, the generation seam and its backends (ours, transformers', vLLM), asynchronous
                      rollouts, dynamic sampling
    grpo/multiturn/, grpo/evaluation/, grpo/parallel/   tools and environments; evaluation; torchrun, DDP, FSDP2
    grpo/kernels/     fast paths that compute the same numbers, chosen once by --kernels (never imported
                      under --kernels plain)
    grpo/config.py    GRPOConfig, the single source of truth for every hyperparameter, and its validation
    grpo/cli.py       the command line, presets and config files, generated from GRPOConfig
    grpo/models.py    model loading and `python -m grpo.models fetch` (the offline real model)
    grpo/plot.py, grpo/tiny_model.py   a run's curves; tiny random-init models for offline runs and tests
    rewards/, data/   tasks and rewards (outside this package: they know nothing of the trainer)

docs/design.md has the layers and where a change goes.

The public names below are importable from `grpo` itself; each is loaded on first use, so `import grpo` loads
no model library and changes nothing in the process (no environment variable, no registration).

Notation used throughout: B prompts per step, G completions per prompt (the group), N = B * G rows,
P prompt tokens, T completion tokens, V vocabulary, H hidden size.
"""

import importlib

_PUBLIC = {
    "GRPOConfig": "grpo.config",
    "Trainer": "grpo.core.trainer",
    "train_on_rollout": "grpo.core.update",
    "UpdateResult": "grpo.core.update",
    "Rollout": "grpo.generation.rollout",
    "completion_logprobs": "grpo.algorithm.logprobs",
    "sample_groups": "grpo.algorithm.sampler",
    "score_completions": "rewards.scoring",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grpo' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
