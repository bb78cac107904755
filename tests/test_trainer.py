import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.config import GRPOConfig
from grpo.algorithm.loss import LossOptions
from grpo.core.metrics import read_jsonl
from grpo.generation.rollout import Rollout
from grpo.core.trainer import Trainer
from tests.conftest import batch_indices, record_updates

pytestmark = pytest.mark.usefixtures("both_kernels")  # every test under --kernels auto and plain (conftest.py)

BASE = dict(
    model="tiny", dataset="synthetic:64", prompts_per_step=2, num_generations=4, micro_batch_size=8,
    max_prompt_length=128, max_completion_length=8, learning_rate=1e-3, reward=["tags"], device="cpu",
    precision="fp32", save_steps=0, log_completions_steps=0, logging_steps=100, warmup_ratio=0.0,
)


def make_config(tmp_path, **overrides) -> GRPOConfig:
    return GRPOConfig(**{**BASE, "output_dir": str(tmp_path / "run"), **overrides})


def fixed_rollout(trainer: Trainer, seed: int = 0, num_prompts: int | None = None) -> Rollout:
    """A rollout with random completions and rewards, the same for every trainer given the same seed."""
    g = torch.Generator().manual_seed(seed)
    cfg = trainer.config
    vocab = len(trainer.data.tokenizer)
    prompts, completions = [], []
    for index in range(num_prompts or cfg.prompts_per_step):
        prompt = trainer.data.train_prompt_ids[index]
        for _ in range(cfg.num_generations):
            length = int(torch.randint(2, cfg.max_completion_length + 1, (1,), generator=g))
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    rewards = torch.rand(len(completions), generator=g)
    return Rollout.from_token_lists(prompts, completions, rewards, trainer.loop.sampling.eos_token_ids, trainer.data.tokenizer.pad_token_id)


def params_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def refresh_kernels(trainer: Trainer) -> None:
    """After a test changed trainer.kernels' flags: the functions the update calls, built again from them."""
    cfg = trainer.config
    trainer.functions = trainer.kernels.step_functions(cfg.loss_options(), cfg.temperature,
                                                       cfg.logprob_chunk_size, cfg.cast_lm_head_to_fp32)


def record_gradients(trainer: Trainer) -> list[dict]:
    """The gradients of every optimizer update the trainer makes from now on, one dict per update."""
    updates, step = [], trainer.optimizer.step

    def capture():
        updates.append({n: p.grad.clone() for n, p in trainer.policy.named_parameters()})
        return step()

    trainer.optimizer.step = capture
    return updates


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_gradient_accumulation_is_exact(tmp_path, loss_type):
    # Same rollout, one micro-batch of N = 8 vs four of N / 4 = 2 (shuffled): the accumulated gradient
    # equals the full-batch one to fp32 rounding, and so do the parameters after the AdamW step.
    grads, params = [], []
    for micro in (8, 2):
        trainer = Trainer(make_config(tmp_path / f"{micro}", micro_batch_size=micro, loss_type=loss_type, beta=0.04))
        before = params_of(trainer.policy)
        step = trainer.optimizer.step

        def capture(step=step, trainer=trainer):
            grads.append({n: p.grad.clone() for n, p in trainer.policy.named_parameters()})
            return step()

        trainer.optimizer.step = capture
        trainer.train_on_rollout(fixed_rollout(trainer))
        params.append(params_of(trainer.policy))
    assert any(not torch.equal(before[n], params[0][n]) for n in before), "the step changed nothing"
    for name, full in grads[0].items():
        # rtol 1e-5 of the tensor's largest gradient: sums of fp32 terms in another order differ by ~1e-7 of it.
        torch.testing.assert_close(grads[1][name], full, rtol=0, atol=1e-5 * full.abs().max().item(), msg=name)
    lr = trainer.config.learning_rate
    for name, full in params[0].items():
        # AdamW's first step moves a weight by lr * g / (|g| + 1e-8): for |g| near 1e-8 that amplifies a
        # 1e-10 rounding difference of g by ~1e7, so parameters agree to a small fraction of one step
        # (observed < 0.6% of lr), not to 1e-7. The gradients above are the exact check.
        torch.testing.assert_close(params[1][name], full, rtol=0, atol=0.02 * lr, msg=name)


# Every stateful option on at once: the adaptive entropy coefficient (grows: the target is above the tiny
# model's entropy), the TR-DPO reference (synced every 2 updates, saved in the checkpoint), two updates per
# generation, dynamic sampling (its extra rounds are seeded by the step) and overlong shaping.
STATEFUL = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.01, entropy_target=20.0,
                sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, steps_per_generation=2,
                dynamic_sampling=True, dynamic_sampling_max_rounds=3, overlong_buffer_len=4, num_iterations=2)


@pytest.mark.parametrize("options", [{}, STATEFUL], ids=["default", "stateful"])
def test_resume_is_exact(tmp_path, options):
    overrides = dict(max_steps=6, save_steps=3, lr_scheduler_type="cosine", warmup_ratio=0.2, beta=0.04, **options)
    straight = Trainer(make_config(tmp_path / "a", **overrides))
    straight.train()
    first = Trainer(make_config(tmp_path / "b", **overrides))
    assert first.train(until_step=3)["status"] == "paused"
    resumed = Trainer(make_config(tmp_path / "b", resume=str(tmp_path / "b" / "run"), **overrides))
    assert resumed.step == 3
    resumed.train()
    a = read_jsonl(tmp_path / "a" / "run" / "metrics.jsonl")
    b = read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    keys = ["reward", "loss", "kl", "learning_rate", "grad_norm"]
    if options:
        keys += ["entropy_coef", "policy_loss", "rewards/overlong/mean", "dynamic_sampling/rounds"]
        assert a[-1]["entropy_coef"] > options["entropy_coef"]  # the controller moved
        assert straight.state.updates == 6 * 2 * 2 == resumed.state.updates  # steps x num_iterations x updates per generation
    for key in keys:
        assert [m[key] for m in a] == [m[key] for m in b], key
    for name, value in params_of(straight.policy).items():
        assert torch.equal(value, dict(resumed.policy.named_parameters())[name]), name
    if options:  # the mixed reference was saved and resumed, not reloaded from --model
        start = Trainer(make_config(tmp_path / "c", **overrides)).models.reference
        for name, value in straight.models.reference.named_parameters():
            assert torch.equal(value, dict(resumed.models.reference.named_parameters())[name]), name
        assert any(not torch.equal(value, dict(start.named_parameters())[name])
                   for name, value in straight.models.reference.named_parameters()), "the reference never synced"


# Learning: a random tiny policy writes a format tag in ~1% of its tokens (4 tags in a ~520-token
# vocabulary), so the `tags` reward starts near 0.03 (8 tokens x 1% x 0.125 x ...); a policy that
# learned to emit tags gets up to 1.0. A rise of 0.15 between the first and the last five steps is
# several times the step-to-step noise of the mean reward (std over 8 completions ~ 0.05) and far
# below what 40 steps reach in practice (0.4 to 0.9), so the margin fails only if learning is broken.
@pytest.mark.slow
@pytest.mark.parametrize("loss_type, beta, options", [
    ("grpo", 0.0, {}), ("grpo", 0.04, {}), ("dapo", 0.0, {}), ("dapo", 0.04, {}),
    ("cispo", 0.0, dict(epsilon_high=5.0)), ("sapo", 0.04, {}),
])
def test_the_loop_learns_a_toy_reward(tmp_path, loss_type, beta, options):
    config = make_config(tmp_path, loss_type=loss_type, beta=beta, **options, max_steps=40, learning_rate=3e-3,
                         max_grad_norm=1.0, weight_decay=0.0, warmup_ratio=0.0, lr_scheduler_type="constant",
                         max_completion_length=16, num_generations=8, prompts_per_step=2, micro_batch_size=16)
    Trainer(config).train()
    rewards = [m["reward"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert late > early + 0.15, (early, late, rewards)


def test_bf16_autocast_tracks_fp32(tmp_path):
    # Same three rollouts into an fp32 and a bf16-autocast trainer (fp32 master weights).
    # On-policy, the surrogate term of the loss is exactly -mean(A) in both; what differs is the KL to
    # the bf16 reference and the log-probs, which carry bf16's ~3 significant digits (about 1e-2 on
    # log-probs of -6, see test_logprobs). The step losses are O(1e-2) here, so they must agree to 1e-3.
    losses = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(make_config(tmp_path / precision, precision=precision, beta=0.04, learning_rate=1e-3))
        losses[precision] = [trainer.train_on_rollout(fixed_rollout(trainer, seed))["loss"] for seed in range(3)]
        if precision == "bf16":
            assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())  # master weights
            assert next(trainer.models.reference.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(torch.tensor(losses["bf16"]), torch.tensor(losses["fp32"]), rtol=0, atol=1e-3)
    assert losses["fp32"] != losses["bf16"]  # the bf16 path really ran in bf16


def test_beta_zero_loads_no_reference_model(tmp_path):
    trainer = Trainer(make_config(tmp_path, beta=0.0))
    assert trainer.models.reference is None
    metrics = trainer.train_on_rollout(fixed_rollout(trainer))
    assert "kl" not in metrics


def test_external_rollout_metrics(tmp_path):
    trainer = Trainer(make_config(tmp_path, beta=0.04))
    rollout = fixed_rollout(trainer)
    metrics = trainer.train_on_rollout(rollout)
    assert metrics["reward"] == pytest.approx(rollout.rewards_per_func.mean().item())
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert metrics["completions/mean_length"] == rollout.completion_mask.sum(-1).float().mean().item()
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "clip_ratio/region_mean", "rewards/tags/mean",
                "frac_reward_zero_std", "completions/clipped_ratio"):
        assert key in metrics, key


def test_rollout_from_token_lists_masks_after_first_eos():
    rollout = Rollout.from_token_lists([[5, 6], [7]], [[1, 9, 2, 4], [3, 3]], [1.0, 0.0], eos_token_ids=(2,), pad_token_id=0)
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert rollout.completion_ids.tolist() == [[1, 9, 2, 0], [3, 3, 0, 0]]
    assert rollout.truncated.tolist() == [False, True]
    assert rollout.prompt_ids.tolist() == [[5, 6], [0, 7]] and rollout.prompt_mask.tolist() == [[1, 1], [0, 1]]


@pytest.mark.slow
def test_smoke_preset_end_to_end(tmp_path, capsys):
    import train

    out = tmp_path / "smoke"
    assert train.main(["--preset", "smoke", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean reward: first step" in printed
    metrics = read_jsonl(out / "metrics.jsonl")
    rewards = [m["reward"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    # The preset's promise: the tiny model learns the tags, from near 0 to near 1 over 30 seeded steps (observed
    # 0.02 -> 1.0; first five steps about 0.04, last five about 0.95), not one noisy step above another.
    assert sum(rewards[:5]) / 5 < 0.15 and sum(rewards[-5:]) / 5 > 0.6, rewards
    assert all(later >= earlier - 0.15 for earlier, later in zip(rewards, rewards[1:])), rewards  # no collapse
    assert f"mean reward: first step {rewards[0]:.4f} -> last step {rewards[-1]:.4f}" in printed
    assert read_jsonl(out / "samples.jsonl")
    summary = json.loads((out / "eval" / "step-000030.json").read_text())
    assert set(summary) >= {"strict_accuracy", "lenient_accuracy", "format_compliance", "mean_length"}
    assert all(0.0 <= summary[key] <= 1.0 for key in ("strict_accuracy", "lenient_accuracy", "format_compliance"))
    assert summary["num_samples"] == 16 and 0 < summary["mean_length"] <= 24
    # The last checkpoint holds the trained weights, not the initial ones.
    from grpo.tiny_model import build_tiny_model

    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-000030").state_dict()
    initial = build_tiny_model("tiny", seed=0)[0].state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[name], initial[name]) for name in initial)


def test_plain_string_prompts_get_string_completions(tmp_path):
    # trl's "standard" (non-chat) format: the prompt is text, tokenized without a template.
    seen = {}

    def spy(prompts, completions, answer, **kwargs):
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        return [0.0] * len(completions)

    rows = [{"prompt": f"Question {i}: 2 + {i} =", "question": f"2 + {i}", "answer": f"#### {2 + i}"} for i in range(4)]
    trainer = Trainer(make_config(tmp_path, max_steps=1), reward_functions=[spy], train_rows=rows)
    assert trainer.data.train_prompt_ids[0] == trainer.data.tokenizer("Question 0: 2 + 0 =", add_special_tokens=False)["input_ids"]
    trainer.train()
    assert isinstance(seen["prompt"], str) and isinstance(seen["completion"], str)


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    params = []
    for checkpointing in (False, True):
        trainer = Trainer(make_config(tmp_path / str(checkpointing), gradient_checkpointing=checkpointing, beta=0.04))
        # Under checkpointing no pass shares its prompts (select_kernels): both runs take the same kernels,
        # so only checkpointing differs (k_proj's bias has a gradient of 0 up to rounding, which AdamW's first step
        # turns into +-lr: another order of sums would move it).
        if trainer.kernels is not None:  # auto (plain: no kernels at all)
            assert not (trainer.kernels.shared_prompt_passes or trainer.kernels.shared_prompt_update) or not checkpointing
            trainer.kernels.shared_prompt_passes = trainer.kernels.shared_prompt_update = False
            trainer.kernels.unpadded_trunk = False  # it runs inside the shared-prompt passes
            refresh_kernels(trainer)
        trainer.train_on_rollout(fixed_rollout(trainer))
        params.append(params_of(trainer.policy))
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_pure_bf16_weights_take_the_fp32_step(tmp_path):
    """bf16-pure keeps every weight (and the reference) in bf16, and its update is the fp32 run's update to bf16's
    precision: on the same rollout, the same gradient norm (observed to 0.1%) and a parameter change pointing the
    same way (cosine of the two changes observed 0.994), with almost every weight moved."""
    changes, norms = {}, {}
    for precision in ("fp32", "bf16-pure"):
        trainer = Trainer(make_config(tmp_path / precision, precision=precision, beta=0.04))
        before = params_of(trainer.policy)
        norms[precision] = trainer.update(fixed_rollout(trainer)).grad_norms
        changes[precision] = torch.cat([(p.detach().float() - before[n].float()).flatten()
                                        for n, p in trainer.policy.named_parameters()])
    assert all(p.dtype == torch.bfloat16 for p in trainer.policy.parameters())
    assert all(p.dtype == torch.bfloat16 for p in trainer.models.reference.parameters())
    assert norms["bf16-pure"] == pytest.approx(norms["fp32"], rel=0.02)
    cosine = torch.nn.functional.cosine_similarity(changes["bf16-pure"], changes["fp32"], dim=0).item()
    assert cosine > 0.95, cosine
    assert (changes["bf16-pure"] != 0).float().mean() > 0.9  # the steps are not lost to bf16's rounding
    # and the loop runs to the end on bf16 weights
    assert Trainer(make_config(tmp_path / "loop", precision="bf16-pure", max_steps=2)).train()["status"] == "finished"


def test_tensorboard_backend_when_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="optional: pip install -e '.[tensorboard]'")
    Trainer(make_config(tmp_path, max_steps=1, report_to="tensorboard")).train()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.own_kernels
def test_wandb_backend_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="optional: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = dict(max_steps=2, save_steps=1, report_to="wandb")
    Trainer(make_config(tmp_path, **overrides)).train(until_step=1)
    run_id = (tmp_path / "run" / "wandb_run_id").read_text()
    Trainer(make_config(tmp_path, resume=str(tmp_path / "run"), **overrides)).train()  # the same wandb run continues
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, and -<id>-1 when the resumed part starts within the same second
    assert runs and all(f"-{run_id}" in run.name for run in runs)
    assert all(list(run.glob("run-*.wandb")) for run in runs)  # the logged history, for `wandb sync`


@pytest.mark.parametrize("options", [
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="bnpo", beta=0.0),
    dict(loss_type="dr_grpo", beta=0.04, use_bias_correction_kl=True),
    dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, delta=1.5, micro_batch_size=2),
    dict(loss_type="grpo", beta=0.04, num_iterations=2, epsilon=1e-3, micro_batch_size=4),  # off-policy 2nd pass, clips
    dict(loss_type="grpo", beta=0.04, mask_truncated_completions=True, temperature=0.7),
    dict(loss_type="dapo", beta=0.04, num_iterations=2, epsilon=1e-3, importance_sampling_level="sequence",
         delta=1.0005, use_bias_correction_kl=True),  # GSPO: the fused pass steps aside, the log-prob kernel runs
])
@pytest.mark.own_kernels
def test_kernels_give_the_plain_gradients(tmp_path, options):
    # --kernels auto (the fused log-prob + loss pass, the CPU log-prob layouts) against --kernels plain (log-probs
    # -> per_token_loss -> aggregate_loss through autograd): the same loss, statistics and gradient at every update.
    # AdamW's epsilon 1e-6 (as the parity suite): the first update moves each weight by about lr * g / (|g| + eps),
    # so at eps 1e-8 a gradient entry near 1e-8 turns a 1e-10 rounding difference into a 1e-5 * lr weight difference,
    # which the second pass (num_iterations 2) would see as a kernel error; at 1e-6 it is 100x smaller.
    grads, metrics = {}, {}
    for kernels in ("auto", "plain"):
        trainer = Trainer(make_config(tmp_path / kernels, kernels=kernels, adam_epsilon=1e-6, **options))
        expected_fused = kernels == "auto" and options.get("importance_sampling_level", "token") == "token"
        if kernels == "auto":  # plain: no KernelChoice at all
            assert trainer.kernels.fused_loss == expected_fused and trainer.kernels.fast_logprobs
        else:
            assert trainer.kernels is None
        grads[kernels] = record_gradients(trainer)
        metrics[kernels] = trainer.train_on_rollout(fixed_rollout(trainer))
    assert len(grads["auto"]) == len(grads["plain"]) == options.get("num_iterations", 1)
    for kernel_step, plain_step in zip(grads["auto"], grads["plain"], strict=True):
        for name, plain in plain_step.items():
            torch.testing.assert_close(kernel_step[name], plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item(), msg=name)
    for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"):
        if metrics["plain"].get(key) is not None:
            # abs 1e-6: the on-policy loss is a sum of +-A terms of size ~1 that cancel to ~1e-7.
            assert metrics["auto"][key] == pytest.approx(metrics["plain"][key], rel=1e-5, abs=1e-6), key
    if options.get("num_iterations"):
        assert metrics["auto"]["clip_ratio/region_mean"] > 0  # the second pass is off-policy and clips


@pytest.mark.parametrize("options", [
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="dapo", beta=0.0, num_iterations=2, epsilon=1e-3),  # the second pass regroups its own shuffle
    dict(loss_type="dr_grpo", beta=0.04, steps_per_generation=16),  # two updates (8 micro-batches each), own rows
    dict(loss_type="luspo", beta=0.0, importance_sampling_level="sequence"),
    dict(loss_type="cispo", beta=0.04, epsilon_high=5.0),
    dict(loss_type="sapo", beta=0.0),
])
@pytest.mark.own_kernels
def test_length_grouped_micro_batches_give_the_random_micro_batches_gradients(tmp_path, options, monkeypatch):
    # grpo.kernels.batching: each update's rows sorted by completion length before the split into micro-batches.
    # Against the random micro-batches of the same rows (everything else the same kernels): the same loss and
    # gradient at every update, other micro-batches, and fewer padded positions.
    import grpo.core.update as update_module

    cells, grads, metrics, losses = {}, {}, {}, {}
    original = update_module.micro_batch
    for grouping in (True, False):
        trainer = Trainer(make_config(tmp_path / str(grouping), micro_batch_size=2, prompts_per_step=4,
                                      max_completion_length=16, adam_epsilon=1e-6, **options))
        assert trainer.kernels.length_grouping
        trainer.kernels.length_grouping = grouping
        refresh_kernels(trainer)
        cells[grouping] = []

        def recording(tensors, rows, multiple=1, out=cells[grouping]):
            ids, attention_mask, loss_mask = original(tensors, rows, multiple)
            out.append(ids.numel())
            return ids, attention_mask, loss_mask

        monkeypatch.setattr(update_module, "micro_batch", recording)
        grads[grouping] = record_gradients(trainer)
        rollout = fixed_rollout(trainer, num_prompts=trainer.config.prompts_per_generation)
        records = record_updates(trainer)
        metrics[grouping] = trainer.train_on_rollout(rollout)
        losses[grouping] = records[-1].micro_batch_losses
    assert len(grads[True]) == len(grads[False]) == options.get("num_iterations", 1) * options.get("steps_per_generation", 8) // 8
    for grouped_step, random_step in zip(grads[True], grads[False], strict=True):
        for name, random_grad in random_step.items():
            torch.testing.assert_close(grouped_step[name], random_grad, rtol=1e-5,
                                       atol=1e-5 * random_grad.abs().max().item(), msg=name)
    for key in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean", "policy_loss"):
        if metrics[False].get(key) is not None:
            assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5, abs=1e-6), key
    assert sorted(losses[True]) != pytest.approx(sorted(losses[False]))  # other micro-batches, the same sum
    assert sum(cells[True]) < sum(cells[False])  # and less padding (the reference pass is sorted in both runs)


_OFF_POLICY = dict(loss_type="grpo", beta=0.04, num_iterations=2, epsilon=1e-3)  # a reference and an old-policy pass


@pytest.mark.parametrize("trunk_pass, options", [
    ("packed", _OFF_POLICY), ("packed", dict(loss_type="dapo", beta=0.0, importance_sampling_level="sequence")),
    ("shared prompts", _OFF_POLICY), ("shared prompts", dict(loss_type="dr_grpo", beta=0.1)),
    ("shared prompts", dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence")),
    ("unpadded", _OFF_POLICY), ("unpadded", dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence"))])
@pytest.mark.own_kernels
def test_packed_or_shared_prompt_passes_give_the_padded_steps_gradients(tmp_path, monkeypatch, trunk_pass, options):
    # grpo.kernels.packing in the reference, old-policy and update passes (forced on: on CPU with SDPA it is exact
    # but not chosen, see select_kernels), grpo.kernels.prefix in the same passes (the update through the fused
    # loss, or GSPO's through the log-prob kernel) and grpo.kernels.unpadded (both chosen here), each against the
    # padded passes: the same gradients and metrics.
    import grpo.kernels.logprobs as kernel_module

    calls = {"shared prompts": [], "unpadded": []}  # whether grad was on, at each call of that trunk pass
    for name, attribute in (("shared prompts", "shared_prompt_hidden"), ("unpadded", "unpadded_shared_prompt_hidden")):
        original = getattr(kernel_module, attribute)
        monkeypatch.setattr(kernel_module, attribute, lambda model, ids, *args, _name=name, _run=original:
                            (calls[_name].append(torch.is_grad_enabled()), _run(model, ids, *args))[1])
    grads, metrics = {}, {}
    for on in (True, False):
        trainer = Trainer(make_config(tmp_path / str(on), micro_batch_size=4, max_completion_length=12,
                                      adam_epsilon=1e-6, **options))
        assert not trainer.kernels.packed_logprobs and "sdpa" in trainer.kernels.reasons["packed_logprobs"]
        assert trainer.kernels.shared_prompt_passes and trainer.kernels.shared_prompt_update  # chosen on CPU, SDPA
        assert trainer.kernels.unpadded_trunk
        trainer.kernels.packed_logprobs = on and trunk_pass == "packed"
        trainer.kernels.shared_prompt_passes = trainer.kernels.shared_prompt_update = on and trunk_pass != "packed"
        trainer.kernels.unpadded_trunk = on and trunk_pass == "unpadded"
        refresh_kernels(trainer)
        grads[on] = record_gradients(trainer)
        metrics[on] = trainer.train_on_rollout(fixed_rollout(trainer))
    if trunk_pass != "packed":  # the passes without grad (if any) and the update's ran through this one, only
        ran = calls[trunk_pass]
        assert True in ran and (False in ran) == (options.get("beta", 0.04) != 0.0)
        assert not calls["unpadded" if trunk_pass == "shared prompts" else "shared prompts"]
    for on_step, padded_step in zip(grads[True], grads[False], strict=True):
        for name, padded in padded_step.items():
            torch.testing.assert_close(on_step[name], padded, rtol=1e-5, atol=1e-5 * padded.abs().max().item(), msg=name)
    for key in ("loss", "kl", "entropy", "grad_norm"):
        if metrics[False].get(key) is not None:
            assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5, abs=1e-6), key


def test_length_grouping_steps_aside_where_the_grouping_changes_the_loss(tmp_path):
    from grpo.kernels import select_kernels

    cpu = torch.device("cpu")
    assert select_kernels("auto", cpu, LossOptions(loss_type="grpo")).length_grouping
    for options, entropy_bonus, reason in [(LossOptions(loss_type="bnpo"), False, "bnpo"),
                                           (LossOptions(top_entropy_quantile=0.2), False, "quantile"),
                                           (LossOptions(), True, "entropy bonus")]:
        choice = select_kernels("auto", cpu, options, entropy_bonus=entropy_bonus)
        assert not choice.length_grouping and reason in choice.reasons["length_grouping"]
        assert choice.length_sorted_passes  # the passes without a loss sort their rows whatever the loss
    plain = select_kernels("plain", cpu)
    assert not (plain.length_grouping or plain.length_sorted_passes)


@pytest.mark.own_kernels
def test_kernels_setting_and_the_options_it_replaced(tmp_path):
    from grpo.cli import config_from_args
    from grpo.generation.rollout import GroupSampler
    from grpo.kernels.sampling import FastSampler
    from grpo.algorithm.sampler import sample_groups
    from grpo.algorithm.step import plain_step_functions

    trainer = Trainer(make_config(tmp_path))  # the default: auto
    assert isinstance(trainer.generation, GroupSampler) and isinstance(trainer.generation.sample, FastSampler)
    assert trainer.kernels.fused_loss and trainer.kernels.fast_logprobs
    assert not trainer.kernels.compile_decode and "CUDA" in trainer.kernels.reasons["compile_decode"]  # CPU: eager
    plain = Trainer(make_config(tmp_path, kernels="plain", overwrite=True))
    assert plain.generation.sample is sample_groups and plain.kernels is None
    # under plain the update calls grpo/'s own functions
    own = plain_step_functions(plain.config.loss_options(), plain.config.temperature)
    assert plain.functions.batches is own.batches and plain.functions.update_batches is own.update_batches
    assert plain.functions.logprobs.func is own.logprobs.func  # grpo.algorithm.logprobs.completion_logprobs
    assert trainer.functions.logprobs.func is not own.logprobs.func  # auto: the kernel's
    with pytest.raises(ValueError, match="kernels must be one of"):
        make_config(tmp_path, kernels="fast").validate()
    with pytest.raises(ValueError, match=r"unknown setting\(s\) fused_loss"):  # a config file with a key we lack
        GRPOConfig.from_dict({"fused_loss": True})
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        config_from_args(["--preset", "smoke", "--static-cache"])


@pytest.mark.own_kernels
def test_failing_compiled_decode_falls_back_to_eager(tmp_path, monkeypatch, caplog):
    from grpo.kernels.sampling import FastSampler

    real = FastSampler.sample_groups
    calls = []

    def compile_fails(self, *args, compile_decode=False, **kwargs):
        calls.append(compile_decode)
        if compile_decode:
            raise RuntimeError("no C compiler")
        return real(self, *args, compile_decode=compile_decode, **kwargs)

    monkeypatch.setattr(FastSampler, "sample_groups", compile_fails)
    trainer = Trainer(make_config(tmp_path, max_steps=2))
    trainer.generation.sample.compile_decode = True  # as --kernels auto chooses on a CUDA machine
    with caplog.at_level("WARNING", logger="grpo"):
        assert trainer.train()["status"] == "finished"
    assert calls == [True, False, False]  # one failed attempt, then eager for the rest of the run
    assert "compiled decode step failed (RuntimeError: no C compiler)" in caplog.text


def test_one_generation_feeds_several_updates(tmp_path):
    # steps_per_generation = 2 x the accumulation steps: one rollout of 2 * B prompts, two optimizer updates per
    # iteration over disjoint halves, old log-probs taken before the first; epochs count rollouts of 2 * B prompts.
    config = make_config(tmp_path, steps_per_generation=2, num_iterations=1, max_steps=0, epochs=1.0)
    trainer = Trainer(config)
    assert (config.updates_per_generation, config.prompts_per_generation) == (2, 4)
    assert trainer.loop.total_steps == 64 // 4 and len(batch_indices(trainer, 0)) == 4
    with pytest.raises(ValueError, match="a rollout needs 4 prompts x num_generations = 16 rows"):
        trainer.train_on_rollout(fixed_rollout(trainer))
    records = record_updates(trainer)
    metrics = trainer.train()
    assert trainer.state.updates == 2 * trainer.loop.total_steps and metrics["status"] == "finished"
    assert records[-1].old_logps is not None  # the second update is off-policy
    with pytest.raises(ValueError, match="steps_per_generation must be a positive multiple of the accumulation steps"):
        make_config(tmp_path, steps_per_generation=3, micro_batch_size=4).validate()
    with pytest.raises(ValueError, match="set steps_per_generation or generation_batch_size, not both"):
        make_config(tmp_path, steps_per_generation=2, generation_batch_size=16).validate()
    assert make_config(tmp_path, generation_batch_size=24).updates_per_generation == 3


@pytest.mark.own_kernels
def test_data_order_is_a_seeded_permutation_per_epoch_or_the_datasets_own(tmp_path):
    # 64 prompts, 2 a step: an epoch is 32 steps. Shuffled: every prompt once an epoch, in a new order each epoch.
    shuffled = Trainer(make_config(tmp_path / "a"))
    epochs = [sum((batch_indices(shuffled, step) for step in range(e * 32, (e + 1) * 32)), []) for e in (0, 1)]
    assert all(sorted(order) == list(range(64)) for order in epochs)
    assert epochs[0] != list(range(64)) and epochs[0] != epochs[1]
    in_order = Trainer(make_config(tmp_path / "b", shuffle_dataset=False, steps_per_generation=2))  # 4 prompts a step
    assert [batch_indices(in_order, step) for step in (0, 1, 16)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert [in_order.data.train_rows[i]["prompt"] for i in batch_indices(in_order, 1)] == \
        [shuffled.data.train_rows[i]["prompt"] for i in range(4, 8)]  # the dataset's rows in its order


def _rewards_tied_for_some_prompts(prompts, completions, **kwargs):
    """Ties (0.5 for every completion) for prompts whose characters' code points sum to an even number;
    a spread of completion lengths otherwise."""
    return [0.5 if _tied_prompt(p) else float(len(str(c)) % 3) for p, c in zip(prompts, completions)]


def _tied_prompt(prompt) -> bool:
    return sum(map(ord, str(prompt))) % 2 == 0


@pytest.mark.own_kernels
def test_dynamic_sampling_keeps_informative_groups(tmp_path):
    from grpo.generation.dynamic_sampling import FIRST_ROUND
    from rewards import RewardSpec

    spec = [RewardSpec("tied_sometimes", _rewards_tied_for_some_prompts)]
    config = make_config(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=6, prompts_per_step=4,
                         micro_batch_size=16, max_steps=1)
    trainer = Trainer(config, reward_functions=spec)
    rollout, prompts, texts, metrics = trainer.collect_rollout(0)
    rewards = rollout.rewards_per_func[:, 0].view(4, 4)
    first = [trainer.data.train_rows[i]["prompt"] for i in batch_indices(trainer, 0)]
    tied_first = sum(_tied_prompt(p) for p in first)
    assert 0 < tied_first < 4  # the first round has tied groups to drop (else this test checks nothing)
    assert metrics["dynamic_sampling/rounds"] >= 2
    # Only the groups that filled the step after the last round may be tied: every other kept group has a spread
    # of rewards, and no group of a tied prompt is kept except as a fill.
    tied_groups = int((rewards.std(dim=1) == 0).sum())
    assert tied_groups == metrics["dynamic_sampling/filled"], (rewards, metrics)
    assert sum(_tied_prompt(p) for p in prompts[::4]) <= metrics["dynamic_sampling/filled"], prompts
    assert len(prompts) == len(texts) == rollout.num_rows == 16
    assert metrics["dynamic_sampling/dropped_groups"] >= tied_first
    # The same step samples the same prompts again (resume), and plain sampling is untouched.
    again = Trainer(make_config(tmp_path / "again", dynamic_sampling=True, dynamic_sampling_max_rounds=6,
                                prompts_per_step=4, micro_batch_size=16, max_steps=1), reward_functions=spec)
    assert again.collect_rollout(0)[1] == prompts
    # One round only: tied groups fill the step and are counted.
    capped = Trainer(make_config(tmp_path / "capped", dynamic_sampling=True, dynamic_sampling_max_rounds=1,
                                 prompts_per_step=4, micro_batch_size=16, max_steps=1), reward_functions=spec)
    capped_rollout, kept, _, metrics = capped.collect_rollout(0)
    first_prompts, _ = metrics.pop(FIRST_ROUND)  # round 0 for the answer guards: every group, kept or not
    assert sorted(map(str, first_prompts)) == sorted(map(str, kept))  # one round: all of them are kept
    # the policy's reward before any group is dropped: round 0's mean, the weighted sum and per function
    first_mean = capped_rollout.rewards_per_func[:, 0].mean().item()
    assert metrics.pop("dynamic_sampling/sampled_reward") == pytest.approx(first_mean)
    assert metrics.pop("dynamic_sampling/sampled_rewards/tied_sometimes") == pytest.approx(first_mean)
    assert metrics == {"dynamic_sampling/rounds": 1, "dynamic_sampling/dropped_groups": 0,
                       "dynamic_sampling/filled": tied_first}


def test_overlong_shaping_is_a_reward(tmp_path):
    trainer = Trainer(make_config(tmp_path, overlong_buffer_len=4, overlong_penalty_factor=0.5, max_steps=1))
    assert [spec.name for spec in trainer.rewards] == ["tags", "overlong"]
    rollout, _, _, _ = trainer.collect_rollout(0)
    lengths = rollout.completion_mask.sum(-1).float()  # budget 8, buffer 4: -0.5 * (len - 4) / 4 beyond 4 tokens
    expected = (-0.5 * (lengths - 4).clamp(min=0) / 4).mean().item()
    metrics = trainer.train_on_rollout(rollout)
    assert metrics["rewards/overlong/mean"] == pytest.approx(expected) and expected < 0


@pytest.mark.own_kernels
@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_schedules_are_the_ones_transformers_computes(name):
    # grpo.models.make_scheduler is written out (importing transformers' trainer utilities pulls in peft and
    # bitsandbytes when they are installed); it must give get_scheduler's factors step for step.
    from transformers import get_scheduler

    from grpo.core.update import make_scheduler

    for warmup, total in [(0, 10), (3, 17), (5, 5), (2, 3)]:
        ours = make_scheduler(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), warmup, total)
        theirs = get_scheduler(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                               num_warmup_steps=warmup, num_training_steps=total)
        for _ in range(total + 2):
            assert ours.get_last_lr()[0] == pytest.approx(theirs.get_last_lr()[0], abs=1e-12), (warmup, total)
            ours.optimizer.step(), theirs.optimizer.step()
            ours.step(), theirs.step()


def _always_tied(prompts, completions, **kwargs):
    return [0.5 for _ in completions]


@pytest.mark.own_kernels
def test_dynamic_sampling_rounds_draw_other_prompts_per_step_and_round(tmp_path):
    from rewards import RewardSpec

    drawn = {}

    def spy(trainer):
        sample = trainer._sample_round

        def recording(step, round_, indices, *backend_and_world):
            drawn.setdefault(id(trainer), {})[(step, round_)] = list(indices)
            return sample(step, round_, indices, *backend_and_world)

        trainer._sample_round = recording
        return trainer

    runs = []
    for name in ("a", "b"):
        trainer = spy(Trainer(make_config(tmp_path / name, dynamic_sampling=True, dynamic_sampling_max_rounds=3,
                                          max_steps=2), reward_functions=[RewardSpec("tied", _always_tied)]))
        metrics = [trainer.collect_rollout(step)[3] for step in (0, 1)]
        counts = [{k: m[k] for k in ("dynamic_sampling/rounds", "dynamic_sampling/dropped_groups",
                                     "dynamic_sampling/filled")} for m in metrics]
        assert all(c == {"dynamic_sampling/rounds": 3, "dynamic_sampling/dropped_groups": 4,
                         "dynamic_sampling/filled": 2} for c in counts), metrics  # every group ties: all rounds run
        runs.append(drawn[id(trainer)])
    first = runs[0]
    assert first[(0, 1)] != first[(0, 2)] and first[(0, 1)] != first[(1, 1)]  # seeded by step and round
    assert runs[0] == runs[1]  # and the same in another run (resume samples what the run would have)


def test_reference_sync_mixes_the_policy_in_every_sync_steps_updates(tmp_path):
    # TR-DPO: every ref_model_sync_steps optimizer updates, ref <- alpha * policy + (1 - alpha) * ref.
    trainer = Trainer(make_config(tmp_path, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2,
                                  ref_model_mixup_alpha=0.6))
    start = params_of(trainer.models.reference)
    trainer.train_on_rollout(fixed_rollout(trainer, seed=0))  # update 1: no sync yet
    for name, value in params_of(trainer.models.reference).items():
        torch.testing.assert_close(value, start[name], rtol=0, atol=0)
    trainer.train_on_rollout(fixed_rollout(trainer, seed=1))  # update 2: the sync
    policy = params_of(trainer.policy)
    moved = 0
    for name, value in params_of(trainer.models.reference).items():
        torch.testing.assert_close(value, 0.6 * policy[name] + 0.4 * start[name], rtol=1e-6, atol=1e-7, msg=name)
        moved += not torch.equal(value, start[name])
    assert moved > 0


def test_generation_reuse_updates_on_disjoint_slices(tmp_path):

    # steps_per_generation 2: the rollout's rows are split between the two updates, each row trained on once.
    trainer = Trainer(make_config(tmp_path, steps_per_generation=4, micro_batch_size=4))  # 2 micro-batches an update
    pad = trainer.data.tokenizer.pad_token_id
    updates, trained = [], []
    original_loss, original_step = trainer.functions.update_loss, trainer.optimizer.step

    def spy_loss(model, ids, *args, **kwargs):
        trained.extend(tuple(row[row != pad].tolist()) for row in ids)
        return original_loss(model, ids, *args, **kwargs)

    def spy_step(*args, **kwargs):
        updates.append(list(trained))
        trained.clear()
        return original_step(*args, **kwargs)

    trainer.functions = dataclasses.replace(trainer.functions, update_loss=spy_loss)
    trainer.optimizer.step = spy_step
    rollout = fixed_rollout(trainer, num_prompts=trainer.config.prompts_per_generation)
    trainer.train_on_rollout(rollout)
    rows = [tuple(torch.cat([p[m.bool()], c[cm.bool()]]).tolist()) for p, m, c, cm in
            zip(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask, strict=True)]
    assert len(updates) == 2 and all(len(rows_of) == len(rows) // 2 for rows_of in updates)
    assert sorted(updates[0] + updates[1]) == sorted(rows)


def _dropout_models():
    """A GPT-2 (dropout layers: embeddings, attention, residual) and a Qwen2 whose attention dropout is a rate the
    attention call reads in training mode (no dropout layer), both over the tiny tokenizer's vocabulary."""
    import transformers

    from grpo.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256, **ids))
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.3, pad_token_id=tokenizer.pad_token_id, **ids))
    return tokenizer, {"gpt2": gpt2, "qwen2": qwen2}


def _train_mode_logits_differ(model) -> bool:
    model.train()
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        return not torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.own_kernels
def test_disable_dropout_sets_every_rate_to_zero_and_is_the_default(tmp_path):
    # trl's disable_dropout_in_model zeroes nn.Dropout modules only; transformers' Llama/Qwen2-style attention keeps
    # its rate as a number (attention_dropout), which must go to 0 too, or the training log-probs stay noisy.
    from grpo.models import disable_dropout

    tokenizer, models = _dropout_models()
    for name, model in models.items():
        assert _train_mode_logits_differ(model), name  # dropout on: two passes of the same input differ
        dropped = disable_dropout(model)
        assert dropped and not _train_mode_logits_differ(model), name
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
        assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())
    for disable in (True, False):
        _, models = _dropout_models()
        trainer = Trainer(make_config(tmp_path / str(disable), disable_dropout=disable), policy=models["qwen2"],
                          tokenizer=tokenizer)
        assert _train_mode_logits_differ(trainer.policy) != disable
        assert models["qwen2"].config.attention_dropout == 0.3  # the config (and so an export) is untouched


@pytest.mark.own_kernels
def test_with_dropout_off_both_kernel_paths_train_a_dropout_model_alike(tmp_path):
    # GPT-2 (learned positions, dropout layers) through the whole loop, two updates a rollout so the old-policy pass
    # runs: with its dropout off, --kernels auto (shared-prompt passes, fused loss, ...) and --kernels plain give
    # the same metrics. With dropout on they would not: the paths draw different dropout masks.
    metrics = {}
    for kernels in ("auto", "plain"):
        tokenizer, models = _dropout_models()
        trainer = Trainer(make_config(tmp_path / kernels, kernels=kernels, max_steps=2, num_iterations=2,
                                      micro_batch_size=4, max_completion_length=12, beta=0.04),
                          policy=models["gpt2"], tokenizer=tokenizer)
        trainer.train()
        metrics[kernels] = read_jsonl(tmp_path / kernels / "run" / "metrics.jsonl")
    for auto, plain in zip(metrics["auto"], metrics["plain"], strict=True):
        for key in ("reward", "loss", "kl", "grad_norm", "entropy"):
            assert auto[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
