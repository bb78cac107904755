"""Kernels change how, never what (issue #62): every rule that decides a number lives once, in grpo/algorithm/, and
`--kernels auto` calls it, so a deliberate change to one changes an auto run's numbers as much as a plain run's.

Each change below is a real edit of the rule's source (one expression replaced), compiled and swapped into the
function object as an edited file would be, so every caller sees it. For each: an auto run before the change, then an
auto and a plain run after it (one step of a tiny model, fp32, one thread). The auto run's numbers must move, and move
to the plain run's. Where a kernel keeps its own copy of a rule (the inverse-CDF draw, the log-prob softmax), the
rule's docstring names the copy and tests/test_kernels.py pins the two together.
"""

from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch

import grpo.algorithm.advantages
import grpo.algorithm.logprobs
import grpo.algorithm.loss
import grpo.algorithm.sampler
from grpo.config import GRPOConfig
from grpo.core.trainer import Trainer
from grpo.tiny_model import save_tiny_model

pytestmark = pytest.mark.slow
COMPARED = ("reward", "reward_std", "loss", "grad_norm", "completions/mean_length", "kl", "entropy")

# (what is changed, module, function, the expression, what it becomes, the run's settings that make the rule act)
CHANGES = [
    ("top-k keeps a quarter of k", grpo.algorithm.sampler, "filter_logits",
     "torch.topk(logits, top_k, dim=-1)", "torch.topk(logits, max(top_k // 4, 1), dim=-1)", dict(top_k=200)),
    ("top-p's nucleus is half as heavy", grpo.algorithm.sampler, "filter_logits",
     "mass_before >= top_p", "mass_before >= top_p / 2", dict(top_p=0.5)),
    ("min-p's floor doubles", grpo.algorithm.sampler, "filter_logits",
     "probs < min_p * probs.max(dim=-1, keepdim=True).values",
     "probs < 2 * min_p * probs.max(dim=-1, keepdim=True).values", dict(min_p=0.008)),
    ("EOS no longer ends a row", grpo.algorithm.sampler, "ends_row",
     "torch.isin(tokens, eos) & live", "torch.isin(tokens, eos) & live & False", {}),
    ("the temperature's divisor doubles", grpo.algorithm.logprobs, "logit_divisor",
     "return temperature if temperature > 0 else 1.0", "return 2 * temperature if temperature > 0 else 1.0", {}),
    ("the clipped surrogate is scaled", grpo.algorithm.loss, "clipped_objective",
     "return -torch.min(ratio * x.advantages, clipped_ratio * x.advantages)",
     "return -1.5 * torch.min(ratio * x.advantages, clipped_ratio * x.advantages)", {}),
    ("k1 instead of k3 for the KL", grpo.algorithm.loss, "k3_kl",
     "return torch.exp(delta) - delta - 1", "return -delta", {}),
    ("the advantages' std floor is 1", grpo.algorithm.advantages, "group_advantages",
     "advantages / (std + 1e-4)", "advantages / (std + 1.0)", {}),
    ("grpo's aggregation sums the rows", grpo.algorithm.loss, "aggregate_loss",
     "return per_row.mean() / num_micro_batches", "return per_row.sum() / num_micro_batches", {}),
]


def edited(module, name: str, old: str, new: str):
    """The code of `module.name` with `old` replaced by `new` in its source (which must hold `old` once)."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    assert source.count(old) == 1, (name, old)
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), inspect.getsourcefile(module), "exec"), namespace)
    return namespace[name].__code__


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model whose completions end at about one token in five, so that EOS and lengths matter."""
    return save_tiny_model(tmp_path_factory.mktemp("rules") / "model", "tiny", seed=0, eos_rate=0.2)


def spread(prompts, completions, completion_ids, **columns):
    """A reward that differs within every group: the completion's length in tokens, mod 5."""
    return [len(ids) % 5 / 4 for ids in completion_ids]


def run(model_dir, folder, kernels: str, settings: dict) -> dict:
    """One step's metrics: the same starting weights on both paths, so the same tokens drawn and the same update
    (a second step would start from weights that differ by fp32 rounding, and sample from them)."""
    config = GRPOConfig(model=str(model_dir), dataset="synthetic:32", prompts_per_step=2, num_generations=4,
                        micro_batch_size=4, max_prompt_length=160, max_completion_length=12, device="cpu",
                        precision="fp32", max_steps=1, beta=0.04, kernels=kernels, adapt_cpu_threads=False,
                        save_steps=0, log_completions_steps=0, output_dir=str(folder), **settings)
    trainer = Trainer(config, reward_functions=[spread])
    metrics = trainer.train_step().metrics
    trainer.close()
    return metrics


@pytest.mark.parametrize("what, module, name, old, new, settings", CHANGES, ids=[change[0] for change in CHANGES])
def test_a_changed_rule_changes_the_auto_run_as_the_plain_one(model_dir, tmp_path, what, module, name, old, new,
                                                              settings):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    function = getattr(module, name)
    original = function.__code__
    try:
        before = run(model_dir, tmp_path / "before", "auto", settings)
        function.__code__ = edited(module, name, old, new)
        auto = run(model_dir, tmp_path / "auto", "auto", settings)
        plain = run(model_dir, tmp_path / "plain", "plain", settings)
    finally:
        function.__code__ = original
        torch.set_num_threads(threads)
    moved = [key for key in COMPARED if not math.isclose(before[key], auto[key], rel_tol=1e-4, abs_tol=1e-6)]
    assert moved, f"{what}: the auto run's numbers did not change"
    for key in COMPARED:  # the kernels' fp32 rounding differs from the plain path's by about 1e-6 relative
        assert auto[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), (what, key, auto[key], plain[key])
