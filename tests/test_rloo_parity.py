"""Parity with trl 1.16's RLOOTrainer: `--advantage-estimator rloo` computes what trl's RLOO computes.

The same harness as tests/test_trl_parity.py (one tiny Qwen2 model saved to a folder, fp32 on CPU, fixed completions,
micro-batches of consecutive rows on both sides, no shuffle). trl's RLOOTrainer has no rollout_func: its
`_generate_single_turn` returns the fixed token ids instead of sampling. It is driven as Trainer.training_step drives
it: `compute_loss` per micro-batch divided by the accumulation steps (transformers divides RLOO's loss, which is not
scaled for accumulation), backward, clip, AdamW. Compared: the prompt and completion tokens, the advantages (the
leave-one-out baseline over scorable siblings, the sequence-level KL penalty in the reward, reward_clip_range,
normalize_advantages), the old log-probs, each micro-batch's loss, the clipped gradient of every update, the logged
kl / entropy / clip ratios, and the parameters after all updates. Tolerances as in tests/test_trl_parity.py, but
for the micro-batch losses: RLOO's ratio is exp of a *sum* of token log-ratios (`loss_rounding` derives that bound).

Every configuration has three reward functions with weights ((1, 2, 1), or (0.5, 1, -1.5)) whose None rows make some
completions unscorable: they are left out of their siblings' baselines and get advantage 0.
"""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[parity]' (trl==1.16.0)")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM  # noqa: E402

from grpo.config import GRPOConfig  # noqa: E402
from grpo.core.trainer import Trainer  # noqa: E402
from rewards import RewardSpec  # noqa: E402
from tests.test_trl_parity import (ADAM_EPS, LR, MAX_LEN, PROMPTS, WEIGHTS, fixed_completions, model_dir,  # noqa: E402
                                   our_step, reward_none_for_one_row, reward_sometimes_none, rows)

pytestmark = [pytest.mark.parity, pytest.mark.slow]
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
NUM_ROLLOUTS = 3
__all__ = ["model_dir", "rows"]  # the fixtures, shared with the GRPO suite



def reward_length_unless_unscorable(prompts, completions, completion_ids, **kwargs):
    """Completion length mod 7 / 3, None exactly where both other rewards give None: those rows are unscorable."""
    return [None if ids[0] % 5 == 0 and ids[0] % 2 else len(ids) % 7 / 3.0 for ids in completion_ids]


REWARDS = [reward_length_unless_unscorable, reward_sometimes_none, reward_none_for_one_row]
BASE = dict(group=4, beta=0.05, normalize=False, clip=None, iterations=1, epsilon=0.2, epsilon_high=0.2, ga=2, k=1,
            mask_truncated=False, weights=WEIGHTS)
CONFIGURATIONS = [
    BASE,
    dict(BASE, beta=0.0),  # no KL, no reference model
    dict(BASE, normalize=True),  # normalize_advantages over the scorable rows
    dict(BASE, clip=(0.5, 1.5)),  # reward_clip_range before the KL penalty
    dict(BASE, group=2, ga=1),  # G = 2: a scorable row's baseline is its one sibling
    dict(BASE, iterations=2, epsilon=1e-3, epsilon_high=1e-3),  # the second update is off-policy and clips
    dict(BASE, iterations=2, epsilon=1e-3, epsilon_high=3e-3, normalize=True),  # asymmetric clip range
    dict(BASE, beta=0.2, clip=(0.0, 2.0), normalize=True, weights=[0.5, 1.0, -1.5]),  # other weights, all at once
    dict(BASE, k=2, mask_truncated=True),  # steps_per_generation = 2 x accumulation; truncated rows masked
    dict(BASE, beta=0.0, iterations=2, epsilon=1e-3, epsilon_high=2e-3, clip=(0.2, 1.0), ga=1),
]


# fp32's unit roundoff, and the bound on a completion's probability ratio rho_i in these runs (see loss_rounding)
UNIT_ROUNDOFF = 2.0 ** -24
MAX_RATIO = 2.0


def loss_rounding(advantages: torch.Tensor, sequence_logps: torch.Tensor, rows: torch.Tensor, ga: int) -> float:
    """How far ours and trl's fp32 loss of the micro-batch `rows` may lie apart from rounding alone.

    Error model. The loss is -(1 / (n ga)) sum_i min(rho_i A_i, clip(rho_i) A_i) with rho_i = exp(S_i) and
    S_i = sum_t (logp_it - old_it) over the row's T_i <= 7 tokens: 2 T_i fp32 log-probs summed inside exp(), so each
    side's rho_i is off by the relative error |dS_i| <= sum_t (|d logp_it| + |d old_it|), and the loss by
    rho_i |A_i| |dS_i| / (n ga) per row (0 where the clip takes the row). An fp32 log-prob is within 4 u |logp| of
    its exact value (u = 2^-24): the harness's completions are uniform random tokens, so every |logp| is near
    ln V ~ 6.3 and the log-sum-exp and the subtraction round at that size (measured against a float64 recomputation
    over every token of k=2-mask_truncated: at most 1.84 u |logp| for trl's chunked kernel and for both of our kernel
    paths, ~1.5 ulp). The policy moves by lr = 1e-4 per update, so sum_t |logp_it| ~ sum_t |old_it| = |old_logps_i|
    (trl's sequence log-prob, the row's masked sum) and rho_i < MAX_RATIO = 2 (the log-ratios measured in
    k=2-mask_truncated stay below 0.11). exp, the product and the n-term mean round once more per row:
    (n + 3) u rho_i |A_i|. Per side
        |dL| <= sum_i rho_i |A_i| (8 |old_logps_i| + n + 3) u / (n ga),
    and the two sides differ by at most twice that: about 8e-5 mean|A| / ga at T_i ~ 6 tokens (|old_logps_i| ~ 40),
    where a token-level ratio's loss keeps to 1e-6. k=2-mask_truncated measured trl's loss 1.75e-6 from the float64
    value (ours 6.5e-7: 2.4e-6 apart) on a loss of 0.057, against 4.3e-5 allowed. A sign or divisor wrong moves the
    loss by a share of itself (the log-ratio's sign flipped: by 6e-4 and 1.6e-3, 30x the bound, in rollout 0).
    advantages, sequence_logps (N,): trl's; rows: the micro-batch's row indices."""
    a = advantages[rows].abs().double()
    s = sequence_logps[rows].abs().double()
    n = len(rows)
    per_side = (MAX_RATIO * a * (8 * s + n + 3) * UNIT_ROUNDOFF).sum().item() / n / ga
    return 2 * per_side


def _id(settings) -> str:
    changed = {key: value for key, value in settings.items() if BASE.get(key) != value}
    return "-".join(f"{key}={value}" for key, value in changed.items()) or "base"


def make_trl(model_dir, rows, settings, tmp_path):
    """trl's RLOOTrainer whose generation returns `fixed_completions` (state["completions"])."""
    from trl import RLOOConfig, RLOOTrainer

    group, ga, k = settings["group"], settings["ga"], settings["k"]
    args = RLOOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS * group // ga, gradient_accumulation_steps=ga, num_generations=group,
        max_completion_length=MAX_LEN, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=ADAM_EPS, max_grad_norm=1.0,
        optim="adamw_torch", temperature=0.7, beta=settings["beta"], epsilon=settings["epsilon"],
        epsilon_high=settings["epsilon_high"], num_iterations=settings["iterations"],
        normalize_advantages=settings["normalize"], reward_clip_range=settings["clip"],
        mask_truncated_completions=settings["mask_truncated"], reward_weights=list(settings["weights"]), seed=0,
        logging_steps=1, max_steps=NUM_ROLLOUTS * settings["iterations"] * k, shuffle_dataset=False,
        steps_per_generation=ga * k,
    )
    trainer = RLOOTrainer(model=str(model_dir), reward_funcs=REWARDS, args=args,
                          train_dataset=datasets.Dataset.from_list(rows))
    state = {"rollout": 0, "completions": None}
    tokenizer = trainer.processing_class
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(prompt_ids, images, multimodal_fields):  # stands in for sampling
        state["prompt_ids"] = prompt_ids
        state["completions"] = fixed_completions(state["rollout"], len(tokenizer), eos, len(prompt_ids))
        return state["completions"]

    trainer._generate_single_turn = generate
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    return trainer, state


def trl_step(trainer, state, inputs, rollout_index, ga, iterations, k):
    """One generation through trl's RLOOTrainer, micro-batches in order (see the module docstring)."""
    from trl.trainer.utils import split_tensor_dict

    model = trainer.model
    model.train()
    state["rollout"] = rollout_index
    batch = trainer._generate_and_score_completions(inputs)
    chunks = split_tensor_dict(batch, ga * k)
    record = {"batch": batch, "losses": [], "grads": []}
    for _ in range(iterations):
        for update in range(k):
            for chunk in chunks[update * ga : (update + 1) * ga]:
                loss = trainer.compute_loss(model, chunk) / ga  # transformers' Trainer.training_step
                loss.backward()
                record["losses"].append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
            record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad(set_to_none=True)
            trainer.state.global_step += 1
    return record


def make_ours(model_dir, rows, settings, tmp_path, kernels):
    group = settings["group"]
    config = GRPOConfig(
        model=str(model_dir), output_dir=str(tmp_path / "ours"), prompts_per_step=PROMPTS, num_generations=group,
        micro_batch_size=PROMPTS * group // settings["ga"], max_completion_length=MAX_LEN, max_prompt_length=512,
        learning_rate=LR, lr_scheduler_type="constant", warmup_ratio=0.0, weight_decay=0.1, adam_beta1=0.9,
        adam_beta2=0.99, adam_epsilon=ADAM_EPS, max_grad_norm=1.0, temperature=0.7, beta=settings["beta"],
        epsilon=settings["epsilon"], epsilon_high=settings["epsilon_high"], num_iterations=settings["iterations"],
        advantage_estimator="rloo", normalize_advantages=settings["normalize"],
        reward_clip_range=None if settings["clip"] is None else list(settings["clip"]),
        mask_truncated_completions=settings["mask_truncated"], device="cpu", precision="fp32", reward=["int"],
        max_steps=NUM_ROLLOUTS, kernels=kernels, steps_per_generation=settings["ga"] * settings["k"],
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    specs = [RewardSpec(fn.__name__, fn, weight) for fn, weight in zip(REWARDS, settings["weights"])]
    return Trainer(config, policy=policy, reward_functions=specs, train_rows=rows)


@pytest.mark.parametrize("kernels", ["auto", "plain"])
@pytest.mark.parametrize("settings", CONFIGURATIONS, ids=_id)
def test_same_numbers_as_trl_rloo(model_dir, rows, settings, tmp_path, kernels):
    torch.manual_seed(0)
    trl_trainer, state = make_trl(model_dir, rows, settings, tmp_path)
    ours = make_ours(model_dir, rows, settings, tmp_path, kernels)
    assert ours.config.loss_type == "rloo" and ours.config.kl_in_reward == (settings["beta"] > 0)  # the defaults
    ours_params = dict(ours.policy.named_parameters())
    for name, param in trl_trainer.model.named_parameters():
        assert torch.equal(param, ours_params[name])
    group, ga, k, iterations = settings["group"], settings["ga"], settings["k"], settings["iterations"]
    clipped, unscorable_rows = [], 0
    for index in range(NUM_ROLLOUTS):
        prompts = rows[index * PROMPTS * k : (index + 1) * PROMPTS * k]
        inputs = [row for row in prompts for _ in range(group)]
        metrics_before = {key: len(values) for key, values in trl_trainer._metrics["train"].items()}
        record = trl_step(trl_trainer, state, inputs, index, ga, iterations, k)
        trl_metrics = {key: values[metrics_before.get(key, 0):] for key, values in trl_trainer._metrics["train"].items()}
        our_grads = []
        rollout, last = our_step(ours, inputs, state["completions"], our_grads)
        batch = record["batch"]
        # The same tokens in: trl tokenized the prompts itself.
        assert [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)] == \
            [list(ids) for ids in state["prompt_ids"]]
        width = rollout.completion_ids.shape[1]
        mask = batch["completion_mask"][:, :width].float()
        kept = ~rollout.truncated[:, None] if settings["mask_truncated"] else torch.ones_like(rollout.truncated)[:, None]
        assert torch.equal((rollout.completion_mask * kept).to(mask.dtype), mask)  # the same tokens count
        assert not batch["completion_mask"][:, width:].any()
        # Advantages: leave-one-out over scorable siblings, minus beta * sum_t k1 in the reward, clipped, normalised.
        torch.testing.assert_close(last.advantages.squeeze(-1), batch["advantages"], rtol=1e-5, atol=1e-6)
        unscorable_rows += int(torch.isnan(rollout.rewards_per_func).all(1).sum())
        # The sequence log-probs of the policy that sampled (the KL penalty's and the ratio's old_logps).
        if settings["beta"] or iterations * k > 1:
            torch.testing.assert_close((last.old_logps * mask).sum(-1), batch["old_logps"], rtol=1e-5, atol=1e-5)
        # Each micro-batch's loss and each update's clipped gradient. A row that mask_truncated_completions drops keeps
        # trl's loss term -min(1 * A, clip(1) * A) = -A (its log-probs sum to 0 over no token, so its ratio is 1), a
        # constant without gradient that ours leaves out (0): trl's micro-batch loss = ours - sum_dropped A / n / ga.
        dropped = (mask.sum(-1) == 0).float()  # (N,)
        chunks = torch.arange(len(dropped)).chunk(ga * k)
        constant = [-(batch["advantages"] * dropped)[rows].sum().item() / len(rows) / ga
                    for rows in chunks] * iterations
        # rtol 1e-5 / atol 1e-6 as for every loss, plus the rounding of rho = exp(sum_t log-ratio) (loss_rounding)
        rounding = torch.tensor([loss_rounding(batch["advantages"], batch["old_logps"], rows, ga)
                                 for rows in chunks] * iterations, dtype=torch.float64)
        ours_losses = torch.tensor(last.micro_batch_losses, dtype=torch.float64) + torch.tensor(constant,
                                                                                                dtype=torch.float64)
        trl_losses = torch.tensor(record["losses"], dtype=torch.float64)
        allowed = 1e-6 + 1e-5 * trl_losses.abs() + rounding
        assert ((ours_losses - trl_losses).abs() <= allowed).all(), \
            f"micro-batch losses: ours {ours_losses.tolist()}, trl {trl_losses.tolist()}, allowed {allowed.tolist()}"
        assert len(our_grads) == len(record["grads"]) == iterations * k
        for update, (ours_grad, trl_grad) in enumerate(zip(our_grads, record["grads"])):
            scale = max(g.abs().max().item() for g in trl_grad.values())
            atol = (1e-6 if update == 0 and index == 0 else 5e-5) * scale  # see tests/test_trl_parity.py
            for name, expected in trl_grad.items():
                torch.testing.assert_close(ours_grad[name], expected, rtol=1e-5, atol=atol,
                                           msg=lambda m, name=name, at=(index, update): f"{name} at {at}: {m}")
        # Logged: kl (the penalty's mean k1 per token) once per generation; entropy and clip ratios per micro-batch.
        if settings["beta"]:
            torch.testing.assert_close(last.metrics["kl"], trl_metrics["kl"][-1], rtol=1e-5, atol=1e-7)
        stats = last.micro_batch_stats
        for ours_key, trl_key in [("entropy", "entropy"), ("clip_low", "clip_ratio/low_mean"),
                                  ("clip_high", "clip_ratio/high_mean"), ("clip_region", "clip_ratio/region_mean")]:
            torch.testing.assert_close(torch.tensor([getattr(s, ours_key) for s in stats], dtype=torch.float64),
                                       torch.tensor(trl_metrics[trl_key], dtype=torch.float64), rtol=1e-5, atol=1e-6,
                                       msg=trl_key)
        clipped.append(any(s.clip_region > 0 for s in stats))
    assert unscorable_rows > 0  # the None rows were there: left out of their siblings' baselines, advantage 0
    if iterations > 1 and settings["epsilon"] < 0.01:
        assert any(clipped), "the off-policy update should clip some sequence ratios"
    ours_params = dict(ours.policy.named_parameters())
    for name, param in trl_trainer.model.named_parameters():
        torch.testing.assert_close(ours_params[name], param, rtol=0, atol=5e-3 * LR, msg=name)
