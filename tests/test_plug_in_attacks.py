"""What an adversarial review of the estimator and objective seams found, pinned: the start-of-run probe uses the
run's own reward columns and loss options, a plug-in cannot corrupt the rollout or the logged rewards by changing its
batch in place, a plug-in objective's wrong shape at a step names it, combinations that would silently drop the KL
penalty or the clip are refused, and dynamic sampling sees the rewards clipped as the advantages do."""

from __future__ import annotations


import pytest
import torch

from grpo.algorithm.loss import LossOptions, per_token_loss
from grpo.config import GRPOConfig
from grpo.generation.dynamic_sampling import keep_informative_groups
from grpo.generation.rollout import Rollout
from grpo.core.trainer import Trainer


def plug(tmp_path, source: str) -> str:
    path = tmp_path / "plug.py"
    path.write_text("import torch\n\n" + source)
    return f"{path}:fn"


def test_the_probe_has_the_runs_reward_columns(tmp_path):
    # Three reward functions: an estimator reading column 2 is valid; with one function, reading column 1 is not.
    fn = plug(tmp_path, "def fn(batch):\n    return batch.rewards_per_func[:, 2] - batch.rewards_per_func[:, 2].nanmean()\n")
    GRPOConfig(advantage_estimator=fn, reward=["tags", "int", "xmlcount"]).validate()
    with pytest.raises(ValueError, match=r"raised IndexError at .*plug.py:\d+: .* \(on the start-of-run probe batch of 32 rows\)"):
        GRPOConfig(advantage_estimator=fn, reward=["tags"]).validate()


def test_the_objective_probe_has_the_runs_options(tmp_path):
    # epsilon_high is None unless the run sets it: the probe sees the run's value, not LossOptions()'s default.
    fn = plug(tmp_path, "def fn(x):\n    return -torch.clamp(torch.exp(x.log_ratio), max=1 + x.options.epsilon_high) "
                        "* x.advantages\n")
    GRPOConfig(loss_type=fn, epsilon_high=0.28).validate()
    with pytest.raises(ValueError, match=r"raised TypeError at .*plug.py:\d+: .* \(on the start-of-run probe micro-batch"):
        GRPOConfig(loss_type=fn).validate()


def test_a_plug_in_objectives_wrong_shape_at_a_step_names_it(tmp_path):
    # Right on the 4 x 5 probe, wrong on a micro-batch of another width: one error that names the loss type.
    fn = plug(tmp_path, "def fn(x):\n    return -x.logps[:, :5] * x.advantages\n")
    options = LossOptions(loss_type=fn)
    logps = torch.zeros(2, 7, requires_grad=True)
    with pytest.raises(ValueError, match=rf"loss_type '{fn}' returned \(2, 5\) on a micro-batch of 2 rows x 7 tokens"):
        per_token_loss(logps, logps.detach(), torch.ones(2), torch.ones(2, 7), options=options)


def test_vespo_is_refused_with_a_per_token_plug_in_estimator(tmp_path):
    fn = plug(tmp_path, "def fn(batch):\n    return batch.completion_mask.clone()\n")  # (N, T)
    with pytest.raises(ValueError, match="gives one advantage per token"):
        GRPOConfig(loss_type="vespo", advantage_estimator=fn).validate()
    GRPOConfig(loss_type="dapo", advantage_estimator=fn).validate()  # any other objective takes them


def test_a_plug_in_that_changes_its_batch_changes_nothing_else(tmp_path):
    # The estimator multiplies the batch's rewards in place: the rollout, samples.jsonl and the logged per-function
    # rewards are the reward functions' own values.
    fn = plug(tmp_path, "def fn(batch):\n    batch.rewards_per_func.mul_(100)\n    batch.completion_mask.zero_()\n"
                        "    return torch.zeros(len(batch.rewards))\n")
    config = GRPOConfig(model="tiny", dataset="synthetic:16", output_dir=str(tmp_path / "run"), max_steps=1,
                        prompts_per_step=2, num_generations=4, micro_batch_size=8, max_completion_length=8,
                        reward=["tags"], device="cpu", precision="fp32", save_steps=0, eval_steps=0,
                        advantage_estimator=fn, log_completions_steps=1, kernels="plain")
    trainer = Trainer(config)
    output = trainer.train_step()
    rewards = output.rollout.rewards_per_func[:, 0]  # the rollout's own values: tags scores in [0, 1]
    assert 0 <= rewards.min() and rewards.max() <= 1
    assert output.metrics["rewards/tags/mean"] == pytest.approx(rewards.mean().item(), rel=1e-6)
    assert output.metrics["reward"] == pytest.approx(rewards.mean().item(), rel=1e-6)  # the estimator had a copy
    assert output.metrics["num_tokens"] > 0  # the loss still trained on the real tokens


@pytest.mark.parametrize("settings", [dict(kl_in_reward=True), dict(reward_clip_range=[0.0, 1.0])])
def test_gdpo_refuses_what_would_not_reach_its_rewards(settings):
    with pytest.raises(ValueError, match="would not reach them"):
        GRPOConfig(multi_objective_aggregation="normalize_then_sum", **settings).validate()


def _round(rewards: list[float]):
    """A rollout of one group per prompt (G = 2) with these rewards (one function), and its prompts and texts."""
    rows = len(rewards)
    rollout = Rollout(prompt_ids=torch.ones(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1, dtype=torch.long),
                      completion_ids=torch.ones(rows, 2, dtype=torch.long),
                      completion_mask=torch.ones(rows, 2, dtype=torch.long),
                      truncated=torch.zeros(rows, dtype=torch.bool), rewards_per_func=torch.tensor(rewards)[:, None])
    return rollout, ["p"] * rows, ["t"] * rows


def test_dynamic_sampling_sees_the_clipped_rewards():
    # Group 0's rewards [2, 3] differ, but clipped to [0, 1] they tie: it is not informative; group 1's [0, 1] is.
    first = _round([2.0, 3.0, 0.0, 1.0])
    rounds = {1: _round([0.5, 0.0, 5.0, 6.0])}
    kept = keep_informative_groups(first, lambda r: rounds[r], 2, 2, torch.tensor([1.0]), 2, 0, 0, clip_range=[0.0, 1.0])
    rollout = kept[0]
    assert rollout.rewards_per_func[:, 0].tolist() == [0.0, 1.0, 0.5, 0.0]  # the two informative groups, clipped view
    unclipped = keep_informative_groups(first, lambda r: rounds[r], 2, 2, torch.tensor([1.0]), 2, 0, 0)
    assert unclipped[0].rewards_per_func[:, 0].tolist() == [2.0, 3.0, 0.0, 1.0]  # without the clip: round 0 is enough
