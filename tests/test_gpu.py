"""Checks that need a CUDA GPU (skipped elsewhere). Run on a GPU machine with bench/gpu_check.sh."""

import copy

import pytest
import torch

from grpo.kernels.buffers import Buffers
from grpo.kernels.compiled_decode import use_packed_decode_attention
from grpo.kernels.sampling import FastSampler
from grpo.algorithm.sampler import SamplingParams, sample_groups
from grpo.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts(tokenizer):
    questions = ["What is 2 + 3?", "Ava has 4 apples and buys 9 more. How many now?", "Hi"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
            for q in questions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_gives_the_eager_greedy_tokens(dtype):
    model, tokenizer = build_tiny_model("tiny", seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model = model.to("cuda", dtype)
    params = SamplingParams(max_completion_length=24, temperature=0.0, eos_token_ids=(tokenizer.eos_token_id,))
    eager = sample_groups(model, _prompts(tokenizer), 2, params, tokenizer.pad_token_id)
    sampler = FastSampler()
    static = sampler.sample_groups(model, _prompts(tokenizer), 2, params, tokenizer.pad_token_id, static_cache=True)
    compiled = sampler.sample_groups(model, _prompts(tokenizer), 2, params, tokenizer.pad_token_id, compile_decode=True)
    assert torch.equal(static.completion_ids, eager.completion_ids)
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    switched = copy.deepcopy(model)  # a new model: a new compiled decoder
    assert use_packed_decode_attention(switched)  # as the sampler does on CUDA: grouped heads packed when compiled
    packed = sampler.sample_groups(switched, _prompts(tokenizer), 2, params, tokenizer.pad_token_id, compile_decode=True)
    assert torch.equal(packed.completion_ids, eager.completion_ids)


def test_bf16_training_step_on_cuda(tmp_path):
    from grpo.config import GRPOConfig
    from grpo.core.trainer import Trainer

    config = GRPOConfig(model="tiny", dataset="synthetic:32", output_dir=str(tmp_path / "run"), max_steps=2,
                        prompts_per_step=2, num_generations=4, micro_batch_size=4, max_completion_length=16,
                        reward=["tags"], device="cuda", precision="auto", save_steps=0)
    trainer = Trainer(config)
    assert trainer.processes.precision == "bf16" and next(trainer.policy.parameters()).dtype == torch.float32
    assert trainer.kernels.compile_decode  # auto: the compiled decode step on CUDA
    assert trainer.train()["status"] == "finished"


def test_log_probs_on_cuda_match_float64():
    # On CUDA the log-probs shift by each row's max and store (c, V) rows (CPU: the target's logit, (V, c) columns):
    # values and gradients of both Functions against float64, on logits of ~100 nats with far targets.
    from grpo.kernels.fused_loss import _FusedTokenLoss
    from grpo.kernels.logprobs import _ChunkedTokenLogProbs, _shift_by_target
    from tests.test_logprobs import _close_to, _far_targets, _float64_reference

    assert not _shift_by_target(torch.device("cuda"))
    generator = torch.Generator().manual_seed(7)
    states, weight, targets = _far_targets(generator)
    scale = torch.rand(targets.shape, generator=generator)
    ref_states, ref_weight, ref_logps, _ = _float64_reference(states, weight, targets, 0.9)
    (ref_logps * scale.double()).sum().backward()
    expected = {"logps": ref_logps, "d hidden": ref_states.grad, "d weight": ref_weight.grad}
    for fused in (False, True):
        hidden = states.cuda().requires_grad_()
        w = weight.cuda().requires_grad_()
        cuda_targets, cuda_scale = targets.cuda(), scale.cuda()
        if fused:
            loss, logps, _ = _FusedTokenLoss.apply(hidden, w, cuda_targets, 0.9, 5, False,
                                                   lambda chunk, index: (chunk * cuda_scale[index]).sum(), None,
                                                   Buffers())
        else:
            logps, _ = _ChunkedTokenLogProbs.apply(hidden, w, cuda_targets, 0.9, 5, False, Buffers())
            loss = (logps * cuda_scale).sum()
        loss.backward()
        for name, got in (("logps", logps), ("d hidden", hidden.grad), ("d weight", w.grad)):
            _close_to(got.detach().cpu(), expected[name], f"{name}, fused={fused}")
