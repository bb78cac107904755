"""The drop-in's numbers are trl's: one script, run with `from trl import GRPOConfig, GRPOTrainer` and with
`from grpo.trl_api import GRPOConfig, GRPOTrainer`, and trl 1.16's state.log_history against ours.

The two samplers draw different tokens from one seed, so both sides get their completions from one `rollout_func`
(trl's own argument) holding a fixed table: for each prompt a completion built from its gold answer in one of
several layouts (the R1 layout right or wrong, loose tags, none, text after the answer, truncated), chosen by a
generator seeded from the call's index. Everything downstream must then agree: the prompts of each generation
(trl's RepeatSampler), the rows of each micro-batch (trl's shuffle), rewards, advantages, the loss, the update,
and the logged means. Each test also checks that both sides saw the same prompts in the same order.

fp32 on CPU; logged values agree to the parity suite's tolerance (rtol 1e-5, atol 1e-6); wall-clock keys are
skipped.
"""

import functools
import sys
import json
import os
from pathlib import Path

import datasets
import pytest
import torch

from tests.conftest import gsm8k_dir

ROOT = Path(__file__).resolve().parents[1]
OURS_IMPORT = "from grpo.trl_api import GRPOConfig, GRPOTrainer\n"
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
           "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")
RTOL, ATOL = 1e-5, 1e-6

pytestmark = pytest.mark.slow


def _trl():
    return pytest.importorskip("trl", reason="trl is the parity extra")


def script_namespace(engine: str, tmp_path: Path, source_path: Path = ROOT / "examples" / "trl_seed_script.py"):
    """The example script's globals, its import line naming `engine` ("trl" or "ours")."""
    source = source_path.read_text()
    assert source.count(OURS_IMPORT) == 1
    if engine == "trl":
        _trl()
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func's warning
        source = source.replace(OURS_IMPORT, "from trl import GRPOConfig, GRPOTrainer\n")
    path = tmp_path / f"script_{engine}.py"
    path.write_text(source)
    namespace = {"__name__": f"script_{engine}"}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - the example file, as written
    return namespace


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def table_rollout(golds: dict[str, str], seen: list, truncate_at: int = 48):
    """A rollout_func with a fixed table: completion j of call c is prompt j's gold answer in layout
    randint(6) of a generator seeded by (c, j). `seen` gets each call's prompt texts."""
    calls = []

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        seen.append([_text(prompt) for prompt in prompts])
        prompt_ids, completion_ids = [], []
        for j, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt_ids.append(tokenizer.encode(prompt, add_special_tokens=False))
            else:
                prompt_ids.append(list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)))
            gold = golds.get(_text(prompt), "7")
            layout = int(torch.randint(6, (1,), generator=torch.Generator().manual_seed(len(calls) * 1000 + j)))
            text = [f"<reasoning>\nadd them\n</reasoning>\n<answer>\n{gold}\n</answer>\n",
                    f"<reasoning>\nguess\n</reasoning>\n<answer>\n{int(gold) + 1 if gold.isdigit() else 3}\n"
                    "</answer>\n",
                    f"<reasoning>it is</reasoning> <answer>{gold}</answer>",
                    f"The answer is {gold}.",
                    f"<reasoning>\nso\n</reasoning>\n<answer>\n{gold}\n</answer>\nand more words after it",
                    f"<reasoning>\nthis goes on and on and on and on and on and on and on and on {gold}"][layout]
            ids = tokenizer.encode(text, add_special_tokens=False)
            completion_ids.append(ids[:truncate_at] if layout == 5 else ids + [eos])
        calls.append(len(prompts))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout_func


def assert_same_log_history(ours: list[dict], trl: list[dict]):
    """Entry by entry the same keys and, but for wall-clock ones, the same values."""
    assert len(ours) == len(trl), (len(ours), len(trl), ours, trl)
    for index, (mine, theirs) in enumerate(zip(ours, trl)):
        assert sorted(mine) == sorted(theirs), (index, "ours only:", sorted(set(mine) - set(theirs)), "trl's only:",
                                                sorted(set(theirs) - set(mine)))
        for key, value in theirs.items():
            if key in TIMINGS:
                continue
            if value is None:  # trl logs None for a metric whose every value was NaN
                assert mine[key] is None, (index, key, mine[key])
                continue
            assert mine[key] == pytest.approx(value, rel=RTOL, abs=ATOL), (index, key, mine[key], value)


def gsm8k_golds(rows) -> dict[str, str]:
    return {_text(row["prompt"]): row["answer"] for row in rows}


@pytest.fixture(scope="module")
def seed_rows():
    if gsm8k_dir() is None:
        pytest.skip("the shared GSM8K copy is not here")
    return [json.loads(line) for line in (gsm8k_dir() / "train.jsonl").read_text().splitlines()]


def test_the_seed_script_gives_trls_numbers(tmp_path, tiny_model_dir, seed_rows):
    """examples/trl_seed_script.py as written, 3 optimizer steps in fp32, logging each: trl's log_history and ours
    agree on loss, rewards and their means and stds, grad_norm, lengths, clip ratios, entropy, num_tokens."""
    golds = {row["question"]: row["answer"].split("####")[-1].strip().replace(",", "") for row in seed_rows}
    histories, seen = {}, {}
    for engine in ("trl", "ours"):
        namespace = script_namespace(engine, tmp_path)
        seen[engine] = []
        namespace["GRPOTrainer"] = functools.partial(namespace["GRPOTrainer"],
                                                     rollout_func=table_rollout(golds, seen[engine]))
        trainer = namespace["main"](["--model", str(tiny_model_dir), "--data", str(gsm8k_dir()), "--cpu",
                                     "--max-steps", "3", "--logging-steps", "1",
                                     "--output-dir", str(tmp_path / engine)])
        histories[engine] = trainer.state.log_history
    assert seen["ours"] == seen["trl"] and len(seen["trl"]) == 3
    assert_same_log_history(histories["ours"], histories["trl"])
    assert any(entry.get("loss") for entry in histories["trl"][:-1])  # the table gives the update something


# ----------------------------------------------------------------------------- more script configurations

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 3}?"}], "answer": str(2 * i + 3)}
        for i in range(11)]  # 11 prompts: an epoch of 2-prompt generations drops one, as trl's sampler does


def correct(completions, answer, **kwargs):
    return [2.0 if gold in completion[0]["content"] else 0.0 for completion, gold in zip(completions, answer)]


def tagged(completions, **kwargs):
    return [0.5 * completion[0]["content"].count("<answer>") for completion in completions]


def length(completions, completion_ids, **kwargs):
    return [len(ids) / 40 for ids in completion_ids]


EVAL_ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {2 * i}?"}], "answer": str(3 * i)}
             for i in range(5)]  # 5 prompts: the last eval batch is a part one


def small_script(classes, model_dir, output_dir, settings: dict, rollout_func, reward_funcs=(correct, tagged),
                 callbacks=None, resume=None, eval_rows=None, eval_stream=False):
    """The same few lines under either engine: trl's GRPOConfig with `settings`, trl's GRPOTrainer, train()."""
    GRPOConfig, GRPOTrainer = classes
    base = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", logging_steps=1, seed=7,
                per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4, learning_rate=1e-4,
                max_steps=6, save_steps=2, gradient_checkpointing=False, lr_scheduler_type="linear",
                warmup_steps=1, max_completion_length=64)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=list(reward_funcs), args=GRPOConfig(**{**base, **settings}),
                          train_dataset=datasets.Dataset.from_list(ROWS), rollout_func=rollout_func,
                          callbacks=callbacks,
                          eval_dataset=None if eval_rows is None else _dataset(eval_rows, eval_stream))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _dataset(rows, stream: bool):
    """A Dataset of `rows`, or the IterableDataset that streams them."""
    dataset = datasets.Dataset.from_list(rows)
    return dataset.to_iterable_dataset() if stream else dataset


def _classes(engine: str):
    if engine == "trl":
        trl = _trl()
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        return trl.GRPOConfig, trl.GRPOTrainer
    from grpo.trl_api import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer


CONFIGURATIONS = {
    "grpo-beta": dict(loss_type="grpo", beta=0.04),
    "dr_grpo-beta-no-bias-correction": dict(loss_type="dr_grpo", beta=0.1, use_bias_correction_kl=False),
    "bnpo-two-sided-epsilon": dict(loss_type="bnpo", epsilon=0.1, epsilon_high=0.3),
    "num_iterations-2": dict(num_iterations=2, max_steps=8),
    "steps_per_generation-4": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                   steps_per_generation=4, max_steps=8),
    "scale_rewards-batch-mask-truncated": dict(scale_rewards="batch", mask_truncated_completions=True),
    "scale_rewards-none-sequence-level": dict(scale_rewards="none", importance_sampling_level="sequence",
                                              num_iterations=2, max_steps=6),
    "accumulation-3-per-device-not-a-multiple": dict(per_device_train_batch_size=4, num_generations=6,
                                                     gradient_accumulation_steps=3),
    "reward_weights": dict(reward_weights=[1.0, -0.5, 2.0]),
    "sapo": dict(loss_type="sapo", num_iterations=2),
    "logging_steps-3": dict(logging_steps=3, max_steps=7),  # windows of 3, num_tokens the last; a summary window
    "logging_strategy-no": dict(logging_strategy="no"),  # the summary holds the whole run's means
    "logging_first_step": dict(logging_steps=4, logging_first_step=True, num_iterations=2, max_steps=8),
    "num_train_epochs-2": dict(max_steps=-1, num_train_epochs=2, per_device_train_batch_size=8),  # 5 a pass
    "epoch-fraction": dict(max_steps=-1, num_train_epochs=1.4, steps_per_generation=2, per_device_train_batch_size=4),
}


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_script_configurations_give_trls_numbers(name, tmp_path, tiny_model_dir):
    """Each configuration under both engines from one table of completions: the same log_history."""
    settings = CONFIGURATIONS[name]
    reward_funcs = (correct, tagged, length) if "reward_weights" in settings else (correct, tagged)
    histories, seen = {}, {}
    for engine in ("trl", "ours"):
        seen[engine] = []
        trainer = small_script(_classes(engine), tiny_model_dir, tmp_path / engine, settings,
                               table_rollout(gsm8k_golds(ROWS), seen[engine]), reward_funcs)
        histories[engine] = trainer.state.log_history
    assert seen["ours"] == seen["trl"]
    assert_same_log_history(histories["ours"], histories["trl"])


def test_a_reward_model_among_the_rewards_gives_trls_numbers(tmp_path, tiny_model_dir):
    """reward_funcs with a reward model's folder beside a function, and reward_weights."""
    from tests.test_reward_model import build_reward_model
    from grpo.tiny_model import build_tokenizer

    folder = tmp_path / "my-rm"
    tokenizer = build_tokenizer()
    build_reward_model(tokenizer).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    histories, seen = {}, {}
    for engine in ("trl", "ours"):
        seen[engine] = []
        trainer = small_script(_classes(engine), tiny_model_dir, tmp_path / engine, dict(reward_weights=[1.0, 0.5]),
                               table_rollout(gsm8k_golds(ROWS), seen[engine]), (correct, str(folder)))
        histories[engine] = trainer.state.log_history
    assert seen["ours"] == seen["trl"]
    assert_same_log_history(histories["ours"], histories["trl"])
    assert any(key.startswith("rewards/") and key != "rewards/correct/mean" and key.endswith("/mean")
               for key in histories["ours"][0])


def test_a_callback_that_stops_and_resume_from_checkpoint_give_trls_numbers(tmp_path, tiny_model_dir):
    """A TrainerCallback stops training after optimizer step 3 (checkpoints every 2); a new trainer resumes from
    checkpoint-2 to the end. Both runs' log_history are trl's (the resumed one begins with the checkpoint's)."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True
            return control

    histories = {}
    for engine in ("trl", "ours"):
        stopped = small_script(_classes(engine), tiny_model_dir, tmp_path / engine, {},
                               table_rollout(gsm8k_golds(ROWS), []), callbacks=[StopAfter()])
        assert stopped.state.global_step == 3
        resumed = small_script(_classes(engine), tiny_model_dir, tmp_path / engine, {},
                               table_rollout(gsm8k_golds(ROWS), []), resume=str(tmp_path / engine / "checkpoint-2"))
        histories[engine] = (stopped.state.log_history, resumed.state.log_history)
    assert_same_log_history(histories["ours"][0], histories["trl"][0])
    assert_same_log_history(histories["ours"][1], histories["trl"][1])


def test_a_rollout_func_that_returns_too_little_is_one_clear_error(tmp_path, tiny_model_dir):
    """A rollout_func without a required key, or with fewer completions than prompts x G, is named in one line; so
    is a stream without max_steps, or one shorter than a generation."""
    GRPOConfig, GRPOTrainer = _classes("ours")
    stream = datasets.Dataset.from_list(ROWS[:1]).to_iterable_dataset()
    for settings, message in ((dict(max_steps=-1), "train_dataset is an IterableDataset: set max_steps"),
                              (dict(max_steps=2), r"yields fewer prompts than one generation takes \(2\)")):
        with pytest.raises(ValueError, match=message):
            GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[correct], train_dataset=stream,
                        args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8,
                                        num_generations=4, **settings))
    with pytest.raises(ValueError, match=r"rollout_func must return a dict with the keys .*missing \['logprobs'\]"):
        small_script(_classes("ours"), tiny_model_dir, tmp_path / "a", {},
                     lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]})
    with pytest.raises(ValueError, match=r"rollout_func returned 1 prompt_ids and 1 completion_ids for 4 prompts "
                                         r"\(each of the 1 prompts 4 times\)"):
        small_script(_classes("ours"), tiny_model_dir, tmp_path / "b", {},
                     lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": None})


@pytest.mark.parametrize("settings", [dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8, max_steps=8,
                                           num_generations_eval=4, beta=0.04),
                                      dict(eval_strategy="steps", eval_steps=4, num_iterations=2, max_steps=8,
                                           per_device_eval_batch_size=4),
                                      dict(eval_strategy="steps", eval_steps=3, max_steps=8, per_device_eval_batch_size=8,
                                           num_generations_eval=4),
                                      dict(eval_strategy="steps", eval_steps=4, max_steps=8, per_device_eval_batch_size=8,
                                           num_generations_eval=4, stream=True)],
                         ids=["eval-every-2", "eval-iterations-2", "eval-every-3-and-at-the-end", "eval-stream"])
def test_an_eval_dataset_gives_trls_numbers(settings, tmp_path, tiny_model_dir):
    """eval_dataset evaluated every eval_steps as trl does (sampled completions, here the table's, their loss and
    metrics without an update), between training steps whose numbers stay trl's (each evaluation draws from the
    stream that orders the micro-batches)."""
    histories, seen = {}, {}
    golds = gsm8k_golds(ROWS + EVAL_ROWS)
    settings = dict(settings)
    stream = settings.pop("stream", False)  # the eval set an IterableDataset
    for engine in ("trl", "ours"):
        seen[engine] = []
        trainer = small_script(_classes(engine), tiny_model_dir, tmp_path / engine, settings,
                               table_rollout(golds, seen[engine]), eval_rows=EVAL_ROWS, eval_stream=stream)
        histories[engine] = trainer.state.log_history
    assert seen["ours"] == seen["trl"]
    assert sum("eval_loss" in entry for entry in histories["trl"]) == -(-8 // settings["eval_steps"])
    assert_same_log_history(histories["ours"], histories["trl"])


def test_the_seed_script_learns_under_either_import(tmp_path):
    """examples/trl_seed_script.py as written, real sampling, 300 steps on the learning experiment's warm-started
    tiny model (bench/trl_learning.py): under trl and under ours the training reward of the last 60 steps is above
    the first 60's, and so is the correctness reward. Measured: trl 2.17 -> 2.56 (correctness 0.69 -> 1.07), ours
    1.94 -> 2.58 (0.49 -> 1.08); docs/trl.md shows the curves."""
    _trl()
    sys.path.insert(0, str(ROOT / "bench"))
    import trl_learning

    results = trl_learning.main(["--out", str(tmp_path)])
    for engine in ("trl", "ours"):
        result = results[engine]
        assert result["last"] >= result["first"] + 0.15, (engine, result["first"], result["last"])
        assert result["correct_last"] >= result["correct_first"] + 0.15, engine


def half_none(completions, **kwargs):
    """None (cannot score) for every completion of a call whose first completion mentions 3, else their lengths."""
    if "3" in completions[0][0]["content"]:
        return [None] * len(completions)
    return [len(completion[0]["content"]) / 50 for completion in completions]


def test_callbacks_evaluate_before_training_log_metric_and_unscorable_rewards_give_trls_numbers(tmp_path,
                                                                                                tiny_model_dir):
    """What a script does around training: evaluate() before train() (its eval DataLoader draws from the stream that
    orders micro-batches; train() then starts a fresh state, as transformers), a callback asking for an evaluation
    and a log off the schedule,
    a reward function that logs a metric of its own (log_metric, in training and in evaluation), and one that cannot
    score some generations (trl logs None where every value is NaN)."""
    from transformers import TrainerCallback

    class Asks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:  # a rollout's last update (num_iterations 2): trl acts there too
                control.should_evaluate = control.should_log = True
            return control

    def logging_reward(completions, log_metric=None, **kwargs):
        log_metric("mean_words", sum(len(c[0]["content"].split()) for c in completions) / len(completions))
        return [0.1 * len(c[0]["content"].split()) for c in completions]

    histories = {}
    for engine in ("trl", "ours"):
        GRPOConfig, GRPOTrainer = _classes(engine)
        args = GRPOConfig(output_dir=str(tmp_path / engine), use_cpu=True, bf16=False, report_to="none", seed=5,
                          logging_steps=3, per_device_train_batch_size=4, num_generations=4, learning_rate=1e-4,
                          max_steps=6, num_iterations=2, save_strategy="no", gradient_checkpointing=False,
                          max_completion_length=64, per_device_eval_batch_size=8, steps_per_generation=1)
        trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[correct, logging_reward, half_none], args=args,
                              train_dataset=datasets.Dataset.from_list(ROWS),
                              eval_dataset=datasets.Dataset.from_list(EVAL_ROWS),
                              rollout_func=table_rollout(gsm8k_golds(ROWS + EVAL_ROWS), []), callbacks=[Asks()])
        trainer.evaluate()
        trainer.train()
        histories[engine] = trainer.state.log_history
    assert any(entry.get("rewards/half_none/mean", 0) is None for entry in histories["trl"])
    assert any("eval_mean_words" in entry for entry in histories["trl"])
    assert_same_log_history(histories["ours"], histories["trl"])


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_an_iterable_dataset_gives_trls_numbers(shuffle, tmp_path, tiny_model_dir):
    """A streaming train_dataset (an IterableDataset, max_steps set): trl reads it through datasets' buffered
    shuffle and its repeat transform, and goes round it again (set_epoch) when it ends; the drop-in reads the same
    rows in the same order. 11 rows, 2 prompts a generation, 8 steps: a second pass."""
    histories, seen = {}, {}
    for engine in ("trl", "ours"):
        seen[engine] = []
        GRPOConfig, GRPOTrainer = _classes(engine)
        args = GRPOConfig(output_dir=str(tmp_path / engine), use_cpu=True, bf16=False, report_to="none", seed=3,
                          logging_steps=1, per_device_train_batch_size=8, num_generations=4, learning_rate=1e-4,
                          max_steps=8, save_strategy="no", gradient_checkpointing=False, max_completion_length=64,
                          shuffle_dataset=shuffle)
        stream = datasets.Dataset.from_list(ROWS).to_iterable_dataset()
        trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[correct, tagged], args=args,
                              train_dataset=stream, rollout_func=table_rollout(gsm8k_golds(ROWS), seen[engine]))
        trainer.train()
        histories[engine] = trainer.state.log_history
    assert seen["ours"] == seen["trl"] and len(seen["trl"]) == 8
    assert_same_log_history(histories["ours"], histories["trl"])


def _peft_model(model_dir, seed: int = 11):
    """The tiny model with a LoRA adapter whose B is not zero: a pretrained adapter, as a user would pass one (A and
    B drawn from `seed`: peft draws A from the global generator)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), _lora_config())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def _lora_config():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                           task_type="CAUSAL_LM")


@pytest.mark.parametrize("given", ["peft_config", "peft_model"])
def test_lora_gives_trls_numbers(given, tmp_path, tiny_model_dir):
    """LoRA two ways, with beta > 0: a peft_config (the reference is the model with its adapter off), and a
    PeftModel holding a trained adapter (the reference is a frozen copy of that adapter, as trl's `ref`)."""
    histories, seen = {}, {}
    for engine in ("trl", "ours"):
        seen[engine] = []
        GRPOConfig, GRPOTrainer = _classes(engine)
        args = GRPOConfig(output_dir=str(tmp_path / engine), use_cpu=True, bf16=False, report_to="none", seed=7,
                          logging_steps=1, per_device_train_batch_size=4, num_generations=4, learning_rate=1e-2,
                          max_steps=4, save_strategy="no", gradient_checkpointing=False, max_completion_length=64,
                          beta=0.04, loss_type="grpo")
        model, peft_config = ((str(tiny_model_dir), _lora_config()) if given == "peft_config"
                              else (_peft_model(tiny_model_dir), None))
        trainer = GRPOTrainer(model=model, reward_funcs=[correct, tagged], args=args, peft_config=peft_config,
                              train_dataset=datasets.Dataset.from_list(ROWS),
                              rollout_func=table_rollout(gsm8k_golds(ROWS), seen[engine]))
        trainer.train()
        histories[engine] = trainer.state.log_history
    assert seen["ours"] == seen["trl"]
    assert all(entry["kl"] > 0 for entry in histories["trl"][1:-1])  # the adapter moved away from the reference
    assert_same_log_history(histories["ours"], histories["trl"])
