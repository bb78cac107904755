"""The algorithm's math, as pure functions over tensors (no model state, no config object, no globals).

    sampler      group sampling: each prompt prefilled once, G completions decoded with a KV cache
    logprobs     per-token log-probs of completions, chunked output projection (no (N, T, V) logits)
    advantages   weighted rewards, group-relative advantages (DeepSeekMath 4.1.2), reward statistics
    loss         the per-token objectives, masks, k3 KL, the loss_type aggregations, entropy terms, statistics
"""
