"""GRPO from scratch: the algorithm's pieces as pure functions, and the loop that composes them.

    grpo.trainer      the training loop: sample -> reward -> update -> log -> save (Trainer.train)
    grpo.update       one update: advantages -> ref/old log-probs -> micro-batch losses -> clip -> AdamW
    grpo.generation   the generation seam: our group sampler or transformers' generate behind one interface
    grpo.sampler      group sampling: prompt prefilled once, G completions decoded with a KV cache
    grpo.advantages   group-relative advantages and reward statistics
    grpo.logprobs     per-token log-probs of completions, chunked output projection (no (N, T, V) logits)
    grpo.loss         the clipped surrogate + k3 KL per token, and the loss_type aggregations
    grpo.rollout      what one step trains on, and sample_rollout (sample, then reward)
    grpo.config       GRPOConfig, the single source of truth for every hyperparameter, and its validation
    grpo.cli          the command line, presets and config files, generated from GRPOConfig
    grpo.kernels      fast paths that compute the same numbers, chosen by --kernels (grpo/kernels/__init__.py)
    grpo.tiny_model   tiny random-init Qwen2 models + ChatML tokenizer for offline runs and tests

Notation used throughout: B prompts per step, G completions per prompt (the group), N = B * G rows,
P prompt tokens, T completion tokens, V vocabulary, H hidden size.
"""
