"""GRPO from scratch: the algorithm's pieces as pure functions, and the loop that composes them.

    grpo.logprobs     per-token log-probs of completions, chunked output projection (no (N, T, V) logits)
    grpo.advantages   group-relative advantages and reward statistics
    grpo.loss         the clipped surrogate + k3 KL per token, and the loss_type aggregations
    grpo.sampler      group sampling: prompt prefilled once, G completions decoded with a KV cache
    grpo.lean_decode  the CPU decode step of Qwen2/Llama trunks from the model's own modules, minus transformers' framework
    grpo.config       GRPOConfig, the single source of truth for every hyperparameter (and the CLI)
    grpo.trainer      the training loop
    grpo.tiny_model   tiny random-init Qwen2 models + ChatML tokenizer for offline runs and tests

Notation used throughout: B prompts per step, G completions per prompt (the group), N = B * G rows,
P prompt tokens, T completion tokens, V vocabulary, H hidden size.
"""

import os

# PyTorch's CPU allocator backs tensors of 2 MiB and more with transparent huge pages when this is set
# (read once, at the first such allocation). The trainer allocates vocabulary-sized gradients every
# micro-batch; with 4 KiB pages their page faults cost more than the arithmetic (see bench/trainer.py).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
