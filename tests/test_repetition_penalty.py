"""repetition_penalty (trl's field; CTRL's penalty as transformers and vLLM apply it): the rule against transformers'
own logits processor, the sampler's log-probs against the penalized distribution recomputed token by token, the
transformers backend's against generate's processed scores, and trl's generation_kwargs."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from grpo.algorithm.sampler import RowUniforms, SamplingParams, penalize_repetition, sample_groups, seen_tokens
from grpo.generation.rollout import TransformersGenerate
from grpo.tiny_model import build_tiny_model, build_tokenizer

PROMPTS = ["What is 2 + 3?", "Name a colour, then another one."]


@pytest.fixture(scope="module")
def model_and_prompts():
    tokenizer = build_tokenizer()
    model, _ = build_tiny_model("tiny", seed=3, tokenizer=tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # spread logits, so that the penalty moves the draws
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
    return model.eval(), prompts, tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_the_rule_is_transformers_logits_processor(penalty):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=generator) * 3  # (N, V) both signs
    ids = torch.randint(0, 50, (4, 12), generator=generator)  # (N, L) with repeats
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(penalize_repetition(logits, seen_tokens(ids, torch.ones_like(ids), 50), penalty),
                               expected, rtol=0, atol=0)


def naive_logprobs(model, prompt: list[int], completion: list[int], penalty: float, temperature: float) -> list[float]:
    """Each completion token's log-prob, recomputed from scratch: the full prefix through the model, the logits
    penalized for every token of the prefix, divided by the temperature."""
    values = []
    for t, token in enumerate(completion):
        prefix = torch.tensor([prompt + completion[:t]])
        with torch.no_grad():
            logits = model(input_ids=prefix).logits[0, -1].float()  # (V,)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prefix[0]] = True
        penalized = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        values.append(torch.log_softmax(penalized / temperature, -1)[token].item())
    return values


def test_the_sampler_samples_and_reports_the_penalized_distribution(model_and_prompts):
    model, prompts, eos = model_and_prompts
    noise = RowUniforms.per_prompt([torch.Generator().manual_seed(s) for s in range(2)], 3, 12)
    plain = sample_groups(model, prompts, 3, SamplingParams(12, 0.9, eos_token_ids=(eos,)), eos, noise)
    params = SamplingParams(12, 0.9, eos_token_ids=(eos,), repetition_penalty=1.8)
    sample = sample_groups(model, prompts, 3, params, eos, noise, return_logprobs=True)
    assert not torch.equal(plain.completion_ids, sample.completion_ids)  # same uniforms, another distribution
    for row in range(6):
        length = int(sample.completion_mask[row].sum())
        completion = sample.completion_ids[row, :length].tolist()
        expected = naive_logprobs(model, prompts[row // 3], completion, 1.8, 0.9)
        torch.testing.assert_close(sample.logprobs[row, :length], torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_a_strong_penalty_repeats_fewer_tokens(model_and_prompts):
    model, prompts, eos = model_and_prompts
    noise = RowUniforms.per_prompt([torch.Generator().manual_seed(s) for s in range(2)], 8, 24)

    def repeated_share(penalty: float) -> float:
        sample = sample_groups(model, prompts, 8, SamplingParams(24, 1.0, eos_token_ids=(eos,),
                                                                 repetition_penalty=penalty), eos, noise)
        repeats = total = 0
        for row in range(sample.completion_ids.shape[0]):
            tokens = sample.completion_ids[row, : int(sample.completion_mask[row].sum())].tolist()
            history = list(prompts[row // 8])
            for token in tokens:
                repeats, total, history = repeats + (token in history), total + 1, history + [token]
        return repeats / total

    assert repeated_share(20.0) < 0.5 * repeated_share(1.0)


def test_transformers_generate_reports_its_penalized_scores(model_and_prompts):
    """The transformers backend passes the penalty to generate; its log-probs are the tokens' under the penalty,
    then the temperature, as generate processes the scores it draws from. Prompts of one length: transformers also
    penalizes the left padding's token."""
    model, prompts, eos = model_and_prompts
    same_length = [prompts[0], prompts[1][: len(prompts[0])]]
    params = SamplingParams(10, 0.8, eos_token_ids=(eos,), repetition_penalty=1.5)
    backend = TransformersGenerate(model, eos)
    sample = backend.generate(same_length, 2, params, torch.Generator().manual_seed(0), return_logprobs=True)
    for row in range(4):
        length = int(sample.completion_mask[row].sum())
        completion = sample.completion_ids[row, :length].tolist()
        expected = naive_logprobs(model, same_length[row // 2], completion, 1.5, 0.8)
        torch.testing.assert_close(sample.logprobs[row, :length], torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_trls_repetition_penalty_and_generation_kwargs_reach_the_sampler():
    from grpo.trl_api import GRPOConfig

    settings = GRPOConfig(use_cpu=True, repetition_penalty=1.1, generation_kwargs={"top_k": 7, "temperature": 0.5,
                                                                                  "repetition_penalty": 1.3}
                          ).our_settings()
    assert (settings["repetition_penalty"], settings["top_k"], settings["temperature"]) == (1.3, 7, 0.5)
    assert GRPOConfig(use_cpu=True, generation_kwargs='{"min_p": 0.1}').our_settings()["min_p"] == 0.1
    with pytest.raises(ValueError, match=r"generation_kwargs=\{'num_beams': 2\} is not supported here: use the keys "
                                         "temperature, top_p, top_k, min_p, repetition_penalty"):
        GRPOConfig(use_cpu=True, generation_kwargs={"num_beams": 2})
