import pytest
import torch

from grpo.logprobs import completion_logprobs, naive_completion_logprobs


def _batch(vocab_size, generator):
    """3 rows: prompts of lengths 5, 3, 6 left-padded to 6; completions of 4, 2, 0+... right-padded to 4."""
    prompt_lengths, completion_lengths = [5, 3, 6], [4, 2, 3]
    P, T = 6, 4
    input_ids = torch.randint(3, vocab_size, (3, P + T), generator=generator)
    attention_mask = torch.zeros(3, P + T, dtype=torch.long)
    completion_mask = torch.zeros(3, T, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        attention_mask[row, P - p : P + c] = 1
        completion_mask[row, :c] = 1
        input_ids[row, : P - p] = 0  # pad
        input_ids[row, P + c :] = 0
    return input_ids, attention_mask, completion_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_matches_naive_values_and_gradients(tiny_model_and_tokenizer, temperature, chunk_size):
    model, _ = tiny_model_and_tokenizer
    model = model.float().train()
    generator = torch.Generator().manual_seed(1)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    weights = torch.randn(completion_mask.shape, generator=generator)

    model.zero_grad()
    fast, entropy = completion_logprobs(
        model, input_ids, attention_mask, completion_mask, temperature, with_entropy=True, chunk_size=chunk_size
    )
    (fast * weights).sum().backward()
    fast_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature)
    (naive * weights).sum().backward()

    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(fast_grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (fast[completion_mask == 0] == 0).all()

    # Entropy against the full softmax: H = -sum p log p of the tempered distribution.
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -5:-1] / temperature
        logp = torch.log_softmax(logits.float(), -1)
        expected = -(logp.exp() * logp).sum(-1) * completion_mask
    torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=1e-5)
    model.eval()


def test_bf16_autocast_is_close_to_fp32(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    generator = torch.Generator().manual_seed(2)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, input_ids, attention_mask, completion_mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16, _ = completion_logprobs(model, input_ids, attention_mask, completion_mask)
    assert bf16.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: log-probs around -6 are off by a few 1e-2 at most.
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=0.1)


def test_zero_temperature_is_rejected(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        completion_logprobs(model, ids, torch.ones_like(ids), torch.ones(1, 2), temperature=0.0)


def test_models_with_transformed_logits_are_refused(tiny_model_and_tokenizer):
    from grpo.logprobs import check_plain_output_head

    model, _ = tiny_model_and_tokenizer
    check_plain_output_head(model.config)  # Qwen2: plain W h
    config = type(model.config)(**{**model.config.to_dict(), "final_logit_softcapping": 30.0})
    with pytest.raises(NotImplementedError, match="final_logit_softcapping=30.0"):
        check_plain_output_head(config)


def test_untied_output_head_matches_naive(tokenizer):
    from grpo.tiny_model import build_tiny_model

    model, _ = build_tiny_model("tiny", seed=2, tokenizer=tokenizer)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    model.train()
    generator = torch.Generator().manual_seed(4)
    input_ids, attention_mask, completion_mask = _batch(model.config.vocab_size, generator)
    fast, _ = completion_logprobs(model, input_ids, attention_mask, completion_mask, 1.3)
    fast.sum().backward()
    fast_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    naive = naive_completion_logprobs(model, input_ids, attention_mask, completion_mask, 1.3)
    naive.sum().backward()
    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_grad, model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)
