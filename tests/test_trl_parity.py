"""Parity with trl 1.16's GRPOTrainer: the same model, prompts, completions and rewards in, the same numbers out.

Both trainers start from one tiny Qwen2 model saved to a folder, fp32 on CPU. trl gets its
completions from a `rollout_func` that returns fixed token ids; ours gets the same ids through
`Trainer.train_on_rollout`. trl is driven the way its `_prepare_inputs`/`training_step` drive it
(one generation batch split into gradient-accumulation chunks, `compute_loss`, backward, clip,
optimizer step), without its micro-batch shuffle; ours runs with shuffle=False, so both see the
same micro-batches. Compared: advantages, per-token log-probs of the policy and the reference,
each micro-batch's loss, the gradient, the logged kl and clip_ratio metrics, and the parameters
after three rollouts (three optimizer steps, six with num_iterations=2).

Tolerances: rtol 1e-5 / atol 1e-6 on fp32 values. Parameters after AdamW steps are compared with
atol 5e-3 * lr: AdamW moves a weight by lr * m / (sqrt(v) + eps), which amplifies the fp32 rounding
differences of gradients near eps by up to lr / eps (see test_trainer.test_gradient_accumulation_is_exact).
Both trainers use eps = 1e-6 here instead of the default 1e-8, which makes that amplification 100x
smaller: the parameters then agree to 0.5% of lr instead of 2%, except a weight whose gradient is itself
within rounding of 0, |g| << eps, where the lr / eps (100) remains: that weight's tolerance adds what AdamW makes
of the gradient differences measured at each update (`AdamRounding`). The gradients themselves are compared at
rtol 1e-5 and atol 1e-6 of the model's largest gradient entry (later updates of a rollout: see below).
vespo's losses: its weight phi = exp(lambda + k log w - lambda w) takes log w as a *sum* of T token
log-ratios, so phi's relative rounding is |k - lambda w| (about |k - lambda|) times that sum's; the loss
rtol is 1e-5 times max(1, |k - lambda|) of the configuration.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import types

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[parity]' (trl==1.16.0)")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM  # noqa: E402

from data import add_prompts, make_synthetic_gsm8k  # noqa: E402
import grpo.core.update  # noqa: E402
from grpo.config import GRPOConfig  # noqa: E402
from grpo.algorithm.loss import CLIPPED_LOSS_TYPES  # noqa: E402
from grpo.generation.prompts import encode_prompt  # noqa: E402
from grpo.generation.rollout import Rollout  # noqa: E402
from grpo.tiny_model import save_tiny_model  # noqa: E402
from grpo.core.trainer import Trainer  # noqa: E402
from rewards import RewardSpec, completion_text, score_completions  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.slow]
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

PROMPTS, GROUP, MAX_LEN, LR = 3, 4, 7, 1e-4
ADAM_EPS = 1e-6  # AdamW's epsilon on both sides, see the tolerances above
ADAM_BETAS = (0.9, 0.99)
MAX_UPDATES_PER_GENERATION = 2  # steps_per_generation = k * accumulation steps, k up to this
NUM_ROLLOUTS = 3


def reward_length(prompts, completions, **kwargs):
    """A reward that spreads: completion characters mod 7, scaled."""
    return [len(completion_text(c)) % 7 / 3.0 for c in completions]


def reward_sometimes_none(prompts, completions, completion_ids, **kwargs):
    """None (cannot score) for completions whose first token id is divisible by 5; 1.0 for even lengths."""
    return [None if ids[0] % 5 == 0 else float(len(ids) % 2 == 0) for ids in completion_ids]


def reward_none_for_one_row(prompts, completions, completion_ids, **kwargs):
    """None for exactly the completions that `reward_sometimes_none` also cannot score, on odd first ids."""
    return [None if ids[0] % 5 == 0 and ids[0] % 2 else 0.5 for ids in completion_ids]


REWARDS = [reward_length, reward_sometimes_none, reward_none_for_one_row]
WEIGHTS = [1.0, 2.0, 1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("parity_model"), "tiny", seed=5)


@pytest.fixture(scope="module")
def rows():
    return add_prompts(make_synthetic_gsm8k(PROMPTS * NUM_ROLLOUTS * MAX_UPDATES_PER_GENERATION, seed=3))


# The options beyond the base axes, and the values both trainers take when a configuration leaves them out.
EXTRA_DEFAULTS = dict(
    delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
    entropy_coef=0.0, use_adaptive_entropy=False, entropy_coef_min=0.0, entropy_coef_max=1.0, entropy_coef_delta=0.005,
    entropy_target=0.2, multi_objective_aggregation="sum_then_normalize", sync_ref_model=False,
    ref_model_mixup_alpha=0.6, ref_model_sync_steps=512,
)


def _trl_is_settings(settings):
    """trl's vllm_importance_sampling_* from a configuration's is_mode / is_min / is_max."""
    if "is_mode" not in settings:
        return {"vllm_importance_sampling_correction": False}
    return dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=settings["is_mode"],
                vllm_importance_sampling_clip_min=settings.get("is_min"),
                vllm_importance_sampling_clip_max=settings.get("is_max", 3.0))


def _our_is_settings(settings):
    if "is_mode" not in settings:
        return {}
    return dict(importance_sampling_correction=True, importance_sampling_mode=settings["is_mode"],
                importance_sampling_clip_min=settings.get("is_min"),
                importance_sampling_clip_max=settings.get("is_max", 3.0))


def _extras(settings):
    return {key: settings.get(key, default) for key, default in EXTRA_DEFAULTS.items()}


def _lora_settings(settings):
    if "lora" not in settings:
        return {}
    r, alpha, targets = settings["lora"]
    return dict(use_peft=True, lora_r=r, lora_alpha=alpha, lora_dropout=0.0, lora_target_modules=list(targets))


def _trl_name(name: str) -> str:
    """trl's parameter names under peft (PeftModel -> LoraModel -> the model) as ours (the model itself)."""
    return name.removeprefix("base_model.model.")


def _updates_per_generation(settings):
    return settings.get("updates_per_generation", 1)


def fixed_completions(rollout_index: int, vocab: int, eos: int, num_rows: int):
    """Deterministic completions: random tokens, most ending in EOS, every fourth truncated at the budget."""
    g = torch.Generator().manual_seed(1000 + rollout_index)
    completions = []
    for row in range(num_rows):
        if row % 4 == 1:  # truncated: the whole budget, no EOS
            completions.append(torch.randint(3, vocab, (MAX_LEN,), generator=g).tolist())
        else:
            length = int(torch.randint(1, MAX_LEN, (1,), generator=g))
            completions.append(torch.randint(3, vocab, (length,), generator=g).tolist() + [eos])
    return completions


def fixed_behaviour_logprobs(completions: list[list[int]], rollout_index: int) -> list[list[float]]:
    """The behaviour policy's per-token log-probs (what a generation backend hands back): around the tiny model's
    own (about -6.3 over its 460 tokens at temperature 0.7), so that w = pi_old / pi_b spreads on both sides of
    the clip bounds."""
    g = torch.Generator().manual_seed(2000 + rollout_index)
    return [(-6.3 + 1.6 * (torch.rand(len(c), generator=g) - 0.5)).tolist() for c in completions]


def fixed_tool_masks(completions: list[list[int]]) -> list[list[int]]:
    """0 on a stretch inside each completion of 4 tokens or more (a tool's result, as trl's env_mask marks it):
    tokens 1 and 2 of even rows, 2 to 4 of odd ones; never the last token."""
    masks = []
    for row, completion in enumerate(completions):
        mask = [1] * len(completion)
        if len(completion) >= 4:
            start, end = (1, 3) if row % 2 == 0 else (2, min(5, len(completion) - 1))
            mask[start:end] = [0] * (end - start)
        masks.append(mask)
    return masks


class AdamRounding:
    """Per weight, how far AdamW can carry the two sides' weights apart from the gradient differences of the updates.

    Error model. Each AdamW update moves a weight by lr * d (after the decay lr * wd * w, a contraction of any
    difference), d = m^ / (s^ + eps), with m^ and s^^2 = v^ weighted means (weights summing to 1) of the gradients
    and of their squares so far (bias-corrected). If every gradient of one side differs from the other's by at most
    D (the largest measured difference of that weight up to this update, each taken at most as large as the gradient
    check lets it be: a larger one fails there, and the weights keep their own check), then |dm^| <= D and |ds^| <= D
    (a weighted L2 norm moves by at most D), so over the segment between the two sides, with s_ = max(s^ - D, 0),
        |dd| <= D / (s_ + eps) + (|m^| + D) D / (s_ + eps)^2,
    and the weights differ by at most lr * sum of that over the updates. m^ and s^ are trl's, from its clipped
    gradients. For a gradient far above eps this is ~2 lr D / |g|, nothing; for one within rounding of 0 it is
    ~lr D / eps: loss_type=dapo-...-is_mode=sequence_mask measured, at v_proj.weight[17, 58] of layer 1, a first
    gradient of -1.63e-7 (float64) that trl rounds 6.3e-9 off and ours 9e-10 (7.2e-9 apart, 6e-8 of the gradient
    scale): AdamW's first step, lr g / (|g| + eps), puts trl's weight 4.7e-7 and ours 0.7e-7 from the exact step's,
    5.3e-7 apart, where 5e-3 lr = 5e-7; this bound gives 7.1e-7 there."""

    def __init__(self, lr: float, betas=ADAM_BETAS, eps: float = ADAM_EPS):
        self.lr, self.betas, self.eps, self.steps = lr, betas, eps, 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, ours: dict, trl: dict, atol: float, rtol: float = 1e-5) -> None:
        """One optimizer update's clipped gradients: ours (our names) and trl's (its names; None: frozen), and the
        gradient check's tolerance (atol + rtol |g|), which caps each difference."""
        self.steps += 1
        beta1, beta2 = self.betas
        for name, expected in trl.items():
            if expected is None:
                continue
            g = expected.float()  # fp32 state: half of fp64's memory, on the real model too
            difference = torch.minimum((ours[_trl_name(name)].float() - g).abs(), atol + rtol * g.abs())
            state = self.state.setdefault(name, {key: torch.zeros_like(g) for key in ("m", "v", "D", "bound")})
            state["m"].mul_(beta1).add_(g, alpha=1 - beta1)
            state["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            state["D"] = torch.maximum(state["D"], difference)
            m_hat = state["m"] / (1 - beta1 ** self.steps)
            s_hat = (state["v"] / (1 - beta2 ** self.steps)).sqrt()
            low = (s_hat - state["D"]).clamp(min=0) + self.eps
            state["bound"] += state["D"] / low + (m_hat.abs() + state["D"]) * state["D"] / low ** 2

    def tolerance(self, name: str) -> torch.Tensor | float:
        """lr * the bound of trl's weight `name` (0.0 for one that never had a gradient)."""
        return self.lr * self.state[name]["bound"] if name in self.state else 0.0


def make_trl(model_dir, rows, settings, completions_for=fixed_completions, max_len=MAX_LEN, output_dir=None, lr=LR):
    """trl's trainer whose rollout_func returns `completions_for(rollout_index, vocabulary, eos, rows)`."""
    from trl import GRPOConfig as TrlConfig, GRPOTrainer

    ga, k = settings["ga"], _updates_per_generation(settings)
    args = TrlConfig(
        output_dir=str(output_dir or model_dir / f"trl_out_{os.getpid()}"), use_cpu=True, bf16=False, report_to="none",
        gradient_checkpointing=False, per_device_train_batch_size=PROMPTS * GROUP // ga,
        gradient_accumulation_steps=ga, num_generations=GROUP, max_completion_length=max_len,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1, adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=1.0, optim="adamw_torch", temperature=0.7,
        beta=settings["beta"], use_bias_correction_kl=settings["bias_kl"], epsilon=settings["epsilon"],
        epsilon_high=settings["epsilon_high"], loss_type=settings["loss_type"], scale_rewards=settings["scale"],
        num_iterations=settings["iterations"], importance_sampling_level=settings["level"],
        mask_truncated_completions=settings["mask_truncated"], reward_weights=WEIGHTS, seed=0, logging_steps=1,
        max_steps=NUM_ROLLOUTS * settings["iterations"] * k, shuffle_dataset=False, steps_per_generation=ga * k,
        **_extras(settings), **_trl_is_settings(settings),
    )
    state = {"rollout": 0, "completions": None}

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        completions = completions_for(state["rollout"], len(tokenizer), eos, len(prompts))
        state["completions"] = completions
        state["tool_masks"] = fixed_tool_masks(completions) if settings.get("tool_mask") else None
        extra = {"env_mask": state["tool_masks"]} if settings.get("tool_mask") else {}  # trl's tool_mask from a rollout
        state["behaviour"] = fixed_behaviour_logprobs(completions, state["rollout"]) if "is_mode" in settings else None
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": state["behaviour"], **extra}

    peft_config = None
    if "lora" in settings:  # trl's GRPOTrainer(peft_config=...): the reference is the model with adapters off
        from peft import LoraConfig

        r, alpha, targets = settings["lora"]
        peft_config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none",
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=REWARDS, args=args, peft_config=peft_config,
                          train_dataset=datasets.Dataset.from_list(rows), rollout_func=rollout_func)
    if "is_mode" in settings:  # trl corrects only when vLLM generates: the rollout_func stands in for it
        trainer.use_vllm, trainer._last_loaded_step = True, trainer.state.global_step
        trainer.vllm_generation = types.SimpleNamespace(sync_weights=lambda: None)
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    _BUILT.append(trainer)
    return trainer, state


_BUILT: list = []  # the trainers make_trl and make_ours built, for drop_trainers


def drop_trainers() -> None:
    """Free what every trainer built so far holds (weights, gradients, optimizer states). After a comparison
    something in trl's set-up keeps make_trl's frame, and with it both trainers, alive: on the real model ~7 GiB
    that a test worker would keep for the rest of the run (tests/test_real_model.py calls this)."""
    while _BUILT:
        trainer = _BUILT.pop()
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            accelerator.free_memory()
        trainer.__dict__.clear()


def trl_step(trainer, state, inputs, rollout_index, ga, iterations, k=1):
    """One generation through trl, as _prepare_inputs + training_step + its callbacks do it (no micro-batch shuffle):
    the generation batch split into k * ga micro-batches, each optimizer step taking ga of them in order, with
    accelerate's sync_gradients marking the last micro-batch of each step (the adaptive entropy control reads it)
    and SyncRefModelCallback's mix after the steps it fires on."""
    from trl.trainer.callbacks import SyncRefModelCallback
    from trl.trainer.utils import split_tensor_dict

    model, args = trainer.model, trainer.args
    model.train()
    state["rollout"] = rollout_index
    batch = trainer._generate_and_score_completions(inputs)
    chunks = split_tensor_dict(batch, ga * k)
    trainer.current_gradient_accumulation_steps = ga
    record = {"batch": batch, "losses": [], "grads": []}
    for _ in range(iterations):
        for update in range(k):
            for index, chunk in enumerate(chunks[update * ga : (update + 1) * ga]):
                trainer.accelerator.sync_gradients = index == ga - 1
                loss = trainer.compute_loss(model, chunk)
                loss.backward()
                record["losses"].append(loss.item())
            trainer.accelerator.sync_gradients = True
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            record["grads"].append({n: None if p.grad is None else p.grad.clone()  # clipped, as ours
                                for n, p in model.named_parameters()})
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad(set_to_none=True)
            trainer.state.global_step += 1
            if args.sync_ref_model and trainer.state.global_step % args.ref_model_sync_steps == 0:
                SyncRefModelCallback.sync_target_model(model, trainer.ref_model, args.ref_model_mixup_alpha)
    return record


def make_ours(model_dir, rows, settings, tmp_path, kernels, max_len=MAX_LEN, lr=LR):
    config = GRPOConfig(
        model=str(model_dir), output_dir=str(tmp_path / "ours"), prompts_per_step=PROMPTS, num_generations=GROUP,
        micro_batch_size=PROMPTS * GROUP // settings["ga"], max_completion_length=max_len, max_prompt_length=512,
        learning_rate=lr, lr_scheduler_type="constant", warmup_ratio=0.0, weight_decay=0.1, adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=1.0, temperature=0.7, beta=settings["beta"],
        use_bias_correction_kl=settings["bias_kl"], epsilon=settings["epsilon"], epsilon_high=settings["epsilon_high"],
        loss_type=settings["loss_type"], scale_rewards=settings["scale"], num_iterations=settings["iterations"],
        importance_sampling_level=settings["level"], mask_truncated_completions=settings["mask_truncated"],
        device="cpu", precision="fp32", reward=["int"], max_steps=NUM_ROLLOUTS, kernels=kernels,
        steps_per_generation=settings["ga"] * _updates_per_generation(settings), **_extras(settings),
        **_lora_settings(settings), **_our_is_settings(settings),
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    specs = [RewardSpec(fn.__name__, fn, w) for fn, w in zip(REWARDS, WEIGHTS)]
    trainer = Trainer(config, policy=policy, reward_functions=specs, train_rows=rows)
    _BUILT.append(trainer)
    return trainer


def our_step(trainer, inputs, completions, grads_out, tool_masks=None, behaviour=None):
    tokenizer = trainer.data.tokenizer
    prompts = [row["prompt"] for row in inputs]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {"answer": [r["answer"] for r in inputs], "question": [r["question"] for r in inputs],
               "completion_ids": completions}
    rewards = score_completions(trainer.rewards, prompts, chat, columns)
    rollout = Rollout.from_token_lists([encode_prompt(tokenizer, p) for p in prompts], completions, rewards,
                                       trainer.loop.sampling.eos_token_ids, tokenizer.pad_token_id, tool_masks)
    if behaviour is not None:  # the behaviour policy's log-probs, as a backend hands them with its tokens
        rollout.sampler_logprobs = torch.zeros(rollout.completion_ids.shape)
        for row, values in enumerate(behaviour):
            width = min(len(values), rollout.completion_ids.shape[1])
            rollout.sampler_logprobs[row, :width] = torch.tensor(values[:width])
    return rollout, update_in_rollout_order(trainer, rollout, grads_out)


def update_in_rollout_order(trainer, rollout, grads_out):
    """trainer.update(rollout) on micro-batches of consecutive rows, as trl cuts them, appending each optimizer
    step's clipped gradient to `grads_out`."""
    step = trainer.optimizer.step

    def capture():
        grads_out.append({n: None if p.grad is None else p.grad.clone() for n, p in trainer.policy.named_parameters()})
        return step()

    # trl cuts each update's micro-batches from consecutive rows: ours takes the rows in rollout order too (no
    # seeded shuffle, no length grouping), then the public call that returns every intermediate value.
    order, functions = grpo.core.update.micro_batch_order, trainer.functions
    grpo.core.update.micro_batch_order = lambda num_rows, *seeds: torch.arange(num_rows)
    trainer.functions = dataclasses.replace(functions, update_batches=grpo.algorithm.step.plain_update_batches)
    trainer.optimizer.step = capture
    try:
        return trainer.update(rollout)
    finally:
        trainer.optimizer.step, grpo.core.update.micro_batch_order, trainer.functions = step, order, functions


BASE = dict(loss_type="grpo", scale="group", beta=0.04, bias_kl=True, iterations=1, epsilon=0.2, epsilon_high=0.2,
            ga=2, level="token", mask_truncated=False)

# Every loss_type x scale_rewards pair; the other settings cycle through their values alongside, so each
# value of each setting is exercised with several loss types. With num_iterations = 2 the second update
# is off-policy; the small clip ranges (1e-3) make the clipping really bite there, so a clip on the
# wrong side changes the numbers (the test checks that clipping happened).
_CYCLE = itertools.cycle([
    dict(beta=0.0, bias_kl=False, iterations=1, epsilon=0.2, epsilon_high=0.2, ga=1, level="token", mask_truncated=False),
    dict(beta=0.04, bias_kl=True, iterations=2, epsilon=1e-3, epsilon_high=2e-3, ga=2, level="sequence", mask_truncated=True),
    dict(beta=0.04, bias_kl=False, iterations=2, epsilon=1e-3, epsilon_high=1e-3, ga=2, level="token", mask_truncated=False),
    dict(beta=0.04, bias_kl=True, iterations=1, epsilon=0.2, epsilon_high=0.28, ga=1, level="token", mask_truncated=True),
    dict(beta=0.0, bias_kl=False, iterations=2, epsilon=1e-3, epsilon_high=2e-3, ga=2, level="token", mask_truncated=False),
])
MATRIX = [dict(loss_type=lt, scale=sc, **next(_CYCLE)) for lt in ("grpo", "bnpo", "dr_grpo", "dapo")
          for sc in ("group", "batch", "none")]
# And one axis at a time from the base, so a failure points at the setting that causes it.
AXES = [dict(BASE, **change) for change in (
    dict(beta=0.0), dict(bias_kl=False), dict(iterations=2), dict(epsilon_high=0.28), dict(ga=1),
    dict(level="sequence"), dict(mask_truncated=True), dict(iterations=2, epsilon=1e-3, epsilon_high=2e-3),
    # delta caps the ratio after trl multiplied the KL by it: with the bias-corrected KL, and with GSPO's ratios.
    dict(loss_type="dapo", iterations=2, epsilon=1e-3, epsilon_high=2e-3, delta=1.002),
    dict(level="sequence", iterations=2, epsilon=1e-3, epsilon_high=2e-3, delta=1.0005),
)]


# The objectives beyond the clipped surrogate, each with every scale_rewards and the same cycle of the other axes.
# cispo caps the ratio itself at epsilon_high (trl's meaning): 5.0 as ScaleRL on-policy, 1.0005 where the second
# update is off-policy so that the cap bites.
def _objective(loss_type, scale, axes):
    if loss_type == "cispo":
        axes = dict(axes, epsilon_high=1.0005 if axes["iterations"] > 1 else 5.0)
    return dict(loss_type=loss_type, scale=scale, **axes)


OBJECTIVES = [_objective(lt, sc, next(_CYCLE)) for lt in ("cispo", "sapo", "luspo", "vespo")
              for sc in ("group", "batch", "none")]
OFF = dict(iterations=2, epsilon=1e-3, epsilon_high=2e-3)  # an off-policy second update whose clipping bites
# Each option of the masks, the entropy bonus, GDPO, TR-DPO and generation reuse: alone from the base, then
# with other loss types and axes. The adaptive entropy target 10 nats is above the tiny model's entropy (about
# 6 at temperature 0.7), so the coefficient grows and applies; 1.0 is below it, so it shrinks and does not.
OPTIONS = [dict(BASE, **change) for change in (
    dict(top_entropy_quantile=0.2),
    dict(top_entropy_quantile=0.5, loss_type="dapo", ga=1, **OFF),
    dict(top_entropy_quantile=0.0, loss_type="sapo", level="sequence"),
    dict(entropy_coef=0.05),
    dict(entropy_coef=0.05, top_entropy_quantile=0.3, loss_type="bnpo", mask_truncated=True),
    dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0, entropy_coef_delta=0.02),
    dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=1.0, loss_type="dapo", **OFF),
    dict(off_policy_mask_threshold=1e-5, **OFF),
    dict(off_policy_mask_threshold=1e-5, loss_type="cispo", iterations=2, epsilon_high=1.0005, scale="none"),
    dict(off_policy_mask_threshold=0.5),  # on-policy: nothing is dropped
    dict(multi_objective_aggregation="normalize_then_sum"),
    dict(multi_objective_aggregation="normalize_then_sum", loss_type="dapo", beta=0.0, ga=1, **OFF),
    dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.6),
    dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.3, loss_type="sapo", **OFF),
    dict(updates_per_generation=2),
    dict(updates_per_generation=2, loss_type="dapo", ga=1, **OFF),
    dict(updates_per_generation=2, loss_type="cispo", epsilon_high=1.0005, scale="batch"),
    dict(updates_per_generation=2, sync_ref_model=True, ref_model_sync_steps=3, use_adaptive_entropy=True,
         entropy_coef=0.01, entropy_target=10.0, top_entropy_quantile=0.5, **OFF),
    dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, **OFF),
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.0, **OFF),
    dict(loss_type="luspo", level="sequence", delta=1.0005, **OFF),
    # Tool results in the completion (trl's tool_mask, from a rollout_func's env_mask): out of the loss, the KL,
    # the entropy and the token counts, still read by the model.
    dict(tool_mask=True),
    dict(tool_mask=True, loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.05, **OFF),
    dict(tool_mask=True, loss_type="dr_grpo", level="sequence", mask_truncated=True, **OFF),
    dict(tool_mask=True, loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0,
         updates_per_generation=2),
)]
# LoRA (trl's peft_config): the default targets with the base's KL, and two targets with dapo off-policy.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORAS = [dict(BASE, lora=(4, 8, LORA_TARGETS)),
         dict(BASE, lora=(8, 16, ("q_proj", "v_proj")), loss_type="dapo", ga=1, **OFF)]
# The behaviour policy's log-probs from the rollout_func (trl corrects them when vLLM generates): every mode of
# vllm_importance_sampling_mode, with the loss types and options it combines with.
IMPORTANCE_SAMPLING = [dict(BASE, **change) for change in (
    dict(is_mode="token_truncate"),
    dict(is_mode="token_mask", is_min=0.5, is_max=2.0),
    dict(is_mode="sequence_mask", is_min=0.05, is_max=20.0, loss_type="dapo", **OFF),
    dict(is_mode="sequence_truncate", is_min=0.1, is_max=5.0, level="sequence", **OFF),
    dict(is_mode="token_mask", is_min=0.7, is_max=None, loss_type="bnpo", scale="batch"),
    dict(is_mode="token_truncate", is_max=1.5, loss_type="cispo", iterations=2, epsilon_high=1.0005),
    dict(is_mode="sequence_mask", is_max=20.0, loss_type="sapo", mask_truncated=True),
    dict(is_mode="token_mask", is_max=2.0, loss_type="vespo", **OFF),
    dict(is_mode="token_truncate", is_min=0.5, is_max=2.0, off_policy_mask_threshold=0.1, **OFF),
    dict(is_mode="token_truncate", is_max=2.0, tool_mask=True, loss_type="dr_grpo", updates_per_generation=2),
    dict(is_mode="sequence_truncate", is_min=0.2, is_max=4.0, loss_type="luspo", level="sequence", beta=0.0),
)]
CONFIGURATIONS = MATRIX + AXES + OBJECTIVES + OPTIONS + LORAS + IMPORTANCE_SAMPLING


def _loss_rtol(settings):
    """1e-5; vespo's: times its weight's sensitivity |k - lambda| to log w (the module docstring)."""
    if settings["loss_type"] != "vespo":
        return 1e-5
    extras = _extras(settings)
    return 1e-5 * max(1.0, abs(extras["vespo_k_pos"] - extras["vespo_lambda_pos"]),
                      abs(extras["vespo_k_neg"] - extras["vespo_lambda_neg"]))


def _id(settings):
    return "-".join(f"{k}={v}" for k, v in settings.items())


@pytest.mark.parametrize("kernels", ["auto", "plain"])
@pytest.mark.parametrize("settings", CONFIGURATIONS, ids=_id)
def test_same_numbers_as_trl(model_dir, rows, settings, tmp_path, kernels):
    assert_same_numbers_as_trl(model_dir, rows, settings, tmp_path, kernels)


# Where the suite's tolerance for the first update of a later rollout comes from: that update's gradient is taken
# at parameters the earlier rollouts' rounding moved apart. From the same parameters it agrees to the first
# rollout's 1e-6 of the gradient's scale, on configurations whose kernel choices differ (fused loss, log-prob
# kernel for vespo's coupled tokens, GSPO's sequence ratios).
@pytest.mark.parametrize("settings", [BASE, dict(BASE, level="sequence", iterations=2, epsilon=1e-3, epsilon_high=2e-3),
                                      next(s for s in CONFIGURATIONS if s["loss_type"] == "vespo" and "vespo_k_pos" in s)],
                         ids=_id)
def test_the_first_update_of_every_rollout_agrees_to_fp32_rounding_from_the_same_parameters(model_dir, rows, settings,
                                                                                             tmp_path):
    assert_same_numbers_as_trl(model_dir, rows, settings, tmp_path, "auto", same_start=True)


def assert_same_numbers_as_trl(model_dir, rows, settings, tmp_path, kernels, completions_for=fixed_completions,
                               max_len=MAX_LEN, num_rollouts=NUM_ROLLOUTS, floor=1.0, lr=LR, param_rtol=0.0,
                               same_start=False):
    """Both trainers from `model_dir` on `rows`, `num_rollouts` rollouts of the completions `completions_for`
    gives (see make_trl): every number compared (the module docstring says which, at which tolerance).
    `floor` multiplies the absolute tolerance of every value computed through the model (log-probs, losses,
    gradients, metrics, parameters): the fp32 rounding of a model whose activations are much larger than the
    tiny one's (tests/test_real_model.py measures it). `param_rtol`: parameters also to within that share of their
    value, for a learning rate whose updates are below one fp32 step of the weights (one ulp: 2**-23).
    same_start: ours starts every rollout from trl's parameters, so no update's rounding carries into the next
    rollout (AdamW's state is still each side's own)."""
    torch.manual_seed(0)
    trl_trainer, trl_state = make_trl(model_dir, rows, settings, completions_for, max_len, tmp_path / "trl", lr)
    ours = make_ours(model_dir, rows, settings, tmp_path, kernels, max_len, lr)
    ours_named = dict(ours.policy.named_parameters())
    if "lora" in settings:  # the adapters' random init differs: start ours from trl's A and B
        with torch.no_grad():
            for name, param in trl_trainer.model.named_parameters():
                if "lora_" in name:
                    ours_named[_trl_name(name)].copy_(param)
    for name, param in trl_trainer.model.named_parameters():  # same start
        assert torch.equal(param, ours_named[_trl_name(name)])

    k = _updates_per_generation(settings)
    adam = AdamRounding(lr)  # the weights' tolerance beyond 5e-3 lr, from the gradient differences of every update
    within, bounded = [], []  # importance sampling: whether some weights were kept, and some clamped or masked
    for index in range(num_rollouts):
        inputs = [row for row in rows[index * PROMPTS * k : (index + 1) * PROMPTS * k] for _ in range(GROUP)]
        if same_start:
            with torch.no_grad():
                for name, param in trl_trainer.model.named_parameters():
                    ours_named[_trl_name(name)].copy_(param)
        trl_record = trl_step(trl_trainer, trl_state, inputs, index, settings["ga"], settings["iterations"], k)
        metrics_before = {key: list(values) for key, values in trl_trainer._metrics["train"].items()}
        our_grads = []
        rollout, last = our_step(ours, inputs, trl_state["completions"], our_grads, trl_state["tool_masks"],
                                 trl_state["behaviour"])
        batch = trl_record["batch"]

        # Advantages (weighted rewards with None rows, group/batch/none scaling, or GDPO's per-reward normalisation).
        torch.testing.assert_close(last.advantages.squeeze(-1), batch["advantages"], rtol=1e-5, atol=1e-6)
        # Masks: the same completion tokens count (truncation masking included).
        width = rollout.completion_ids.shape[1]
        trl_mask = batch["completion_mask"][:, :width]
        kept = ~rollout.truncated[:, None] if settings["mask_truncated"] else torch.ones_like(rollout.truncated)[:, None]
        assert torch.equal((rollout.completion_mask * kept).to(trl_mask.dtype), trl_mask)
        assert not batch["completion_mask"][:, width:].any()  # trl's wider padding counts no token
        # Reference (after any TR-DPO sync) and old-policy per-token log-probs.
        if settings["beta"]:
            torch.testing.assert_close(last.ref_logps * trl_mask, batch["ref_per_token_logps"][:, :width] * trl_mask,
                                       rtol=1e-5, atol=1e-6 * floor)
        if settings["iterations"] * k > 1 or "is_mode" in settings:
            torch.testing.assert_close(last.old_logps * trl_mask, batch["old_per_token_logps"][:, :width] * trl_mask,
                                       rtol=1e-5, atol=1e-6 * floor)
        if "is_mode" in settings:  # w = pi_old / pi_b (per token or per completion), truncated or masked
            expected = batch["importance_sampling_ratio"]
            expected = expected if expected.shape[1] == 1 else expected[:, :width]
            assert last.is_weights.shape == expected.shape
            torch.testing.assert_close(last.is_weights, expected, rtol=1e-5, atol=1e-6 * floor)
            for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                        "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                        "sampling/importance_sampling_ratio/max"):
                torch.testing.assert_close(last.metrics[key], metrics_before[key][-1], rtol=1e-5, atol=1e-6 * floor,
                                           msg=key)
            bounds = _trl_is_settings(settings)
            low = bounds["vllm_importance_sampling_clip_min"] or 0.0
            high = bounds["vllm_importance_sampling_clip_max"] or float("inf")
            real = expected.flatten() if expected.shape[1] == 1 else expected[trl_mask.bool()]
            within.append(((real > low) & (real < high)).any().item())
            bounded.append(((real <= low) | (real >= high)).any().item())
        # The loss of every micro-batch (already divided for accumulation) and the accumulated gradient.
        torch.testing.assert_close(torch.tensor(last.micro_batch_losses), torch.tensor(trl_record["losses"]),
                                   rtol=_loss_rtol(settings), atol=1e-6 * floor)
        assert len(our_grads) == len(trl_record["grads"]) == settings["iterations"] * k
        for update, (ours_grad, trl_grad) in enumerate(zip(our_grads, trl_record["grads"])):
            # Yardstick: the largest gradient entry of the model. A parameter whose gradient is small gets it
            # as a difference of much larger terms, so its fp32 rounding is relative to those, not to itself.
            # A later update of a rollout (num_iterations = 2 or steps_per_generation) starts from parameters
            # that already differ by the AdamW amplification described at the top (~0.5% of lr); its log-ratios
            # logp - logp_old are themselves ~lr-sized, so they carry that 0.5% and the gradient ~1e-5 of its
            # scale: 5e-5 there. So does the first update of a later rollout, the gradient at parameters that
            # differ alike: 5e-5 too, unless both sides start each rollout from the same parameters (same_start,
            # test_the_first_update_of_every_rollout_agrees_to_fp32_rounding_from_the_same_parameters): 1e-6.
            scale = max(g.abs().max().item() for g in trl_grad.values() if g is not None)
            same_parameters = update == 0 and (index == 0 or same_start)
            atol = (1e-6 if same_parameters else 5e-5) * scale * floor
            for name, expected in trl_grad.items():
                if expected is None:  # a frozen base weight (LoRA)
                    assert ours_grad[_trl_name(name)] is None, name
                    continue
                torch.testing.assert_close(ours_grad[_trl_name(name)], expected, rtol=1e-5, atol=atol,
                                           msg=lambda m, name=name, at=(index, update): f"{name}, rollout and update {at}: {m}")
            adam.add(ours_grad, trl_grad, atol)
        # Logged metrics, one value per micro-batch as trl appends them (entropy_coef: one per optimizer step).
        stats = last.micro_batch_stats
        count = len(stats)
        pairs = [("entropy", "entropy")] + ([("kl", "kl")] if settings["beta"] else [])
        if settings["loss_type"] in CLIPPED_LOSS_TYPES:
            pairs += [("clip_low", "clip_ratio/low_mean"), ("clip_high", "clip_ratio/high_mean"),
                      ("clip_region", "clip_ratio/region_mean")]
        pairs += {"cispo": [("cispo_clip", "cispo_clip_ratio")], "vespo": [("vespo_phi", "vespo/phi_seq_mean")]}.get(
            settings["loss_type"], [])
        if settings.get("entropy_coef") or settings.get("use_adaptive_entropy"):
            pairs.append(("policy_loss", "policy_loss"))
            expected = metrics_before["entropy_coef"][-len(last.entropy_coefs):]
            torch.testing.assert_close(torch.tensor(last.entropy_coefs, dtype=torch.float64),
                                       torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-9)
        for ours_key, trl_key in pairs:
            expected = metrics_before[trl_key][-count:]
            torch.testing.assert_close(torch.tensor([getattr(s, ours_key) for s in stats], dtype=torch.float64),
                                       torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6 * floor,
                                       msg=trl_key)

        # (LoRA's first update moves the policy far less than 1e-3: B starts at 0, so nothing clips there.)
        if (settings["iterations"] > 1 and settings["epsilon"] < 0.01 and settings["loss_type"] in CLIPPED_LOSS_TYPES
                and "lora" not in settings):
            assert any(s.clip_region > 0 for s in stats), "the off-policy update should clip some ratios"

    if "is_mode" in settings:  # the bounds bite: some weights kept as they are, some clamped or masked
        assert any(within) and any(bounded), (within, bounded)
    if settings.get("sync_ref_model"):  # the mixed reference itself, after every sync of the run
        ours_ref = dict(ours.models.reference.named_parameters())
        for name, param in trl_trainer.ref_model.named_parameters():
            torch.testing.assert_close(ours_ref[name], param, rtol=0, atol=5e-3 * lr * floor, msg=name)
    # Parameters after all the optimizer steps: 5e-3 lr, plus AdamW's propagation of the gradient differences (a
    # weight whose gradient was within rounding of 0; AdamRounding).
    ours_params = dict(ours.policy.named_parameters())
    for name, param in trl_trainer.model.named_parameters():
        ours_param, expected = ours_params[_trl_name(name)].detach().double(), param.detach().double()
        allowed = 5e-3 * lr * floor + adam.tolerance(name) + param_rtol * expected.abs()
        excess = (ours_param - expected).abs() - allowed
        if (excess > 0).any():
            index = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
            raise AssertionError(f"{name}: {int((excess > 0).sum())} of {excess.numel()} elements differ beyond the "
                                 f"tolerance; the worst at {index}: ours {ours_param[index].item():.9g}, trl "
                                 f"{expected[index].item():.9g}, {abs(ours_param[index] - expected[index]).item():.3g} "
                                 f"apart, {allowed[index].item():.3g} allowed")
