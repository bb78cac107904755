"""Bad input fails early with a message that names the problem; faults lose nothing."""

import contextlib
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo.core.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from grpo.cli import config_from_args
from grpo.config import GRPOConfig
from grpo.core.metrics import read_jsonl
from grpo.models import ModelError, load_model, load_tokenizer
from grpo.core.trainer import Trainer, TrainingError
from tests.conftest import batch_indices
from tests.test_trainer import fixed_rollout, make_config

pytestmark = pytest.mark.usefixtures("both_kernels")  # in-process tests under --kernels auto and plain (conftest.py)

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompts-per-step", "3", "--num-generations", "4", "--micro-batch-size", "5"],
         r"3 \* 4 = 12 is not a multiple of micro_batch_size = 5"),
        (["--num-generations", "1", "--micro-batch-size", "4"], r"num_generations must be >= 2"),
        (["--reward", "correctnes"], r"unknown reward 'correctnes'"),
        (["--learning-rate=-1e-5"], r"learning_rate must be >= 0"),
        (["--beta", "nan"], r"beta must be a finite number"),
        (["--epsilon", "inf"], r"epsilon must be a finite number"),
        (["--max-completion-length", "0"], r"max_completion_length must be >= 1"),
        (["--top-entropy-quantile", "1.5"], r"top_entropy_quantile must be in \[0, 1\], got 1.5"),
        (["--sync-ref-model", "--beta", "0"], r"sync_ref_model needs beta > 0"),
        (["--steps-per-generation", "3", "--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "8"],
         r"steps_per_generation must be a positive multiple of the accumulation steps \(16 / 8 = 2\)"),
        (["--generation-batch-size", "24", "--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "8"],
         r"generation_batch_size must be a positive multiple of the completions of one optimizer update"),
        (["--overlong-buffer-len", "600"], r"overlong_buffer_len must be in \[0, max_completion_length = 512\)"),
        (["--adam-epsilon", "0"], r"adam_epsilon must be > 0"),
        (["--use-adaptive-entropy", "--entropy-coef-min", "0.5", "--entropy-coef-max", "0.1"],
         r"entropy_coef_min \(0.5\) must be <= entropy_coef_max \(0.1\)"),
        (["--dynamic-sampling-max-rounds", "0"], r"dynamic_sampling_max_rounds must be >= 1"),
    ],
)
def test_bad_settings_are_named(flags, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(flags)


def test_unknown_loss_type_is_named():
    with pytest.raises(ValueError, match=r"loss_type must be one of \('grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo', 'rloo', "
                                         r"'cispo', 'sapo', 'vespo'\) or a plug-in module:function / "
                                         r"path/to/file.py:function, got 'ppo'"):
        GRPOConfig(loss_type="ppo").validate()
    with pytest.raises(ValueError, match="got 'ppo'"):  # train.py prints it as one error: line
        config_from_args(["--loss-type", "ppo"])
    with pytest.raises(ValueError, match=r"advantage_estimator 'gae': not one of \['grpo', 'opo', "):
        GRPOConfig(advantage_estimator="gae").validate()


def test_unusual_objective_combinations_are_warned_about(tmp_path, caplog):
    # trl's warnings (luspo wants sequence-level ratios, vespo token-level, ...) and ours (cispo's cap below 1).
    assert any("luspo" in note for note in GRPOConfig(loss_type="luspo").advice())
    assert any("vespo" in note for note in GRPOConfig(loss_type="vespo", importance_sampling_level="sequence").advice())
    assert any("weighting each completion by its length" in note
               for note in GRPOConfig(loss_type="dapo", importance_sampling_level="sequence").advice())
    assert any("caps the ratio itself" in note for note in GRPOConfig(loss_type="cispo").advice())
    assert GRPOConfig(loss_type="cispo", epsilon_high=5.0).advice() == [] and GRPOConfig().advice() == []
    with caplog.at_level("WARNING", logger="grpo"):
        Trainer(make_config(tmp_path, loss_type="luspo"))
    assert "luspo" in caplog.text


def test_estimator_and_kl_combinations_are_checked():
    # The defaults an estimator brings, and what they leave: rloo is trl's RLOOTrainer (its loss, the KL in the reward).
    config = GRPOConfig(advantage_estimator="rloo").validate()
    assert (config.loss_type, config.kl_in_reward) == ("rloo", True)
    assert GRPOConfig(advantage_estimator="rloo", beta=0.0).validate().kl_in_reward is False  # no KL, nowhere
    assert (GRPOConfig().validate().loss_type, GRPOConfig().validate().kl_in_reward) == ("grpo", False)
    assert GRPOConfig(kl_in_reward=True).validate().loss_options().beta == 0.0  # not in the loss as well
    assert GRPOConfig().validate().loss_options().beta == 0.04
    refused = {
        "kl_in_reward needs beta > 0": dict(kl_in_reward=True, beta=0.0),
        "use_bias_correction_kl weighs the loss's k3 KL": dict(kl_in_reward=True, use_bias_correction_kl=True),
        r"reward_clip_range must be two numbers, min < max, got \[1.0, 0.0\]": dict(reward_clip_range=[1.0, 0.0]),
        r"reward_clip_range must be a list of 2 items \(a number, a number\) or null, got the list \[1.0\]":
            dict(reward_clip_range=[1.0]),
        "reinforce_plus_plus' gives one advantage per token": dict(loss_type="vespo",
                                                                   advantage_estimator="reinforce_plus_plus"),
        r"reward_clip_range must be two numbers, min < max, got \[1.0, 1.0\]": dict(reward_clip_range=[1.0, 1.0]),
        "a KL penalty in the reward or --reward-clip-range would not reach them": dict(
            multi_objective_aggregation="normalize_then_sum", kl_in_reward=True),
        "would not reach them; use --no-kl-in-reward": dict(multi_objective_aggregation="normalize_then_sum",
                                                            reward_clip_range=[0.0, 1.0]),
    }
    for message, settings in refused.items():
        with pytest.raises(ValueError, match=message):
            GRPOConfig(**settings).validate()
    advice = {
        "--importance-sampling-level is unused": dict(advantage_estimator="rloo", importance_sampling_level="sequence"),
        "--scale-rewards and --multi-objective-aggregation are grpo's": dict(advantage_estimator="opo",
                                                                             scale_rewards="batch"),
        "trl's RLOOTrainer takes the whole completion's ratio": dict(advantage_estimator="rloo", loss_type="dapo"),
        "normalize_advantages rescales grpo's already scaled advantages": dict(normalize_advantages=True),
    }
    for message, settings in advice.items():
        assert any(message in note for note in GRPOConfig(**settings).validate().advice()), message
    assert GRPOConfig(advantage_estimator="rloo").validate().advice() == []


def test_resume_folder_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"--resume .*holds no complete checkpoint"):
        Trainer(make_config(tmp_path, resume=str(tmp_path / "empty")))


def test_output_folder_holding_another_run(tmp_path):
    Trainer(make_config(tmp_path, max_steps=1)).train()
    with pytest.raises(ValueError, match=r"holds another run .*--resume.*--overwrite"):
        Trainer(make_config(tmp_path, max_steps=1))
    Trainer(make_config(tmp_path, max_steps=1, overwrite=True)).train()  # allowed, and replaces it
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1


# ----------------------------------------------------------------------------- data
def test_long_prompts_are_truncated_or_skipped_with_a_count(tmp_path, caplog):
    trainer = Trainer(make_config(tmp_path / "t", max_prompt_length=50, long_prompts="truncate"))
    assert all(len(ids) <= 50 for ids in trainer.data.train_prompt_ids) and len(trainer.data.train_rows) == 64
    assert "prompts are longer than max_prompt_length=50 and were truncated" in caplog.text
    caplog.clear()
    lengths = [len(ids) for ids in Trainer(make_config(tmp_path / "x")).data.train_prompt_ids]
    limit = sorted(lengths)[len(lengths) // 2]
    trainer = Trainer(make_config(tmp_path / "s", max_prompt_length=limit, long_prompts="skip"))
    skipped = sum(length > limit for length in lengths)
    assert len(trainer.data.train_rows) == 64 - skipped
    assert f"{skipped} of 64 prompts are longer than max_prompt_length={limit} and were skipped" in caplog.text


def test_empty_dataset_after_filtering(tmp_path):
    with pytest.raises(ValueError, match=r"no prompts left after filtering \(64 rows, 64 longer than max_prompt_length=5\)"):
        Trainer(make_config(tmp_path, max_prompt_length=5, long_prompts="skip"))


def test_bad_gold_answer_is_named_with_row_and_file(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q", "answer": ""}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl: row 1 has an empty or missing answer"):
        Trainer(make_config(tmp_path, dataset=str(data)))


# ----------------------------------------------------------------------------- model and tokenizer
def test_model_folder_without_weights(tiny_model_dir, tmp_path):
    folder = tmp_path / "no_weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ModelError, match=r"no model weights \(\*.safetensors\)"):
        load_model(str(folder), torch.device("cpu"))
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match=r"convert them to safetensors"):
        load_model(str(folder), torch.device("cpu"))


def test_tokenizer_without_chat_template(tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "no_template"
    folder.mkdir()
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (folder / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    with pytest.raises(ModelError, match=r"has no chat template.*--chat-template FILE"):
        load_tokenizer(str(folder))
    template = tmp_path / "chatml.jinja"
    template.write_text((tiny_model_dir / "chat_template.jinja").read_text())
    assert load_tokenizer(str(folder), chat_template_file=str(template)).chat_template
    # eval.py takes the same file for a base model without a template (e.g. one trained with --chat-template)
    import eval as eval_cli

    (folder / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    assert eval_cli.main(["--model", str(folder), "--dataset", "synthetic:4", "--max-completion-length", "4",
                          "--device", "cpu", "--chat-template", str(template), "--output-dir", str(tmp_path / "eval")]) == 0
    assert eval_cli.main(["--model", str(folder), "--dataset", "synthetic:4", "--device", "cpu",
                          "--output-dir", str(tmp_path / "eval")]) != 0
    assert "has no chat template" in capsys.readouterr().err


def test_tokenizer_without_pad_token_uses_eos(tiny_model_dir, tmp_path, caplog):
    folder = tmp_path / "no_pad"
    folder.mkdir()
    for file in tiny_model_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert "has no pad token: using its EOS token" in caplog.text


# ----------------------------------------------------------------------------- rewards and non-finite steps
def test_reward_raising_on_one_row_stops_before_any_update(tmp_path):
    rows = [{"question": "fine", "answer": "#### 1"}, {"question": "boom", "answer": "#### 2"}]

    def fragile(prompts, completions, question, **kwargs):
        if "boom" in question:
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)

    trainer = Trainer(make_config(tmp_path, max_steps=2), reward_functions=[fragile], train_rows=rows)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    boom_row = [trainer.data.train_rows[i]["question"] for i in batch_indices(trainer, 0)].index("boom") * 4
    with pytest.raises(TrainingError, match=rf"step 1: reward 'fragile' raised ZeroDivisionError on row {boom_row}: "
                                            r".* The last good checkpoint is none"):
        trainer.train()
    assert trainer.step == 0 and not trainer.optimizer.state  # no optimizer step was taken
    for name, param in trainer.policy.named_parameters():
        assert torch.equal(param, before[name])


def test_non_finite_steps_are_skipped_then_stop(tmp_path, caplog):
    trainer = Trainer(make_config(tmp_path, max_bad_steps=2, beta=0.0))
    poison = {"on": True}

    def hook(module, args, output):  # NaN hidden states in training forwards only (sampling runs in eval)
        return output * float("nan") if module.training and poison["on"] else output

    trainer.policy.model.norm.register_forward_hook(hook)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    metrics = trainer.train_on_rollout(fixed_rollout(trainer, 0))
    assert metrics["skipped_updates"] == 1 and "update skipped (1 in a row, limit 2)" in caplog.text
    for name, param in trainer.policy.named_parameters():
        assert torch.equal(param, before[name])
    poison["on"] = False
    assert trainer.train_on_rollout(fixed_rollout(trainer, 1))["skipped_updates"] == 1  # a good step resets the count
    assert trainer.state.consecutive_bad_steps == 0
    poison["on"] = True
    trainer.train_on_rollout(fixed_rollout(trainer, 2))
    with pytest.raises(TrainingError, match=r"2 consecutive updates were skipped \(a non-finite loss or gradient"):
        trainer.train_on_rollout(fixed_rollout(trainer, 3))


# ----------------------------------------------------------------------------- faults in a real process
def _train_command(out: Path, *extra: str) -> list[str]:
    flags = ["--model", "tiny", "--dataset", "synthetic:64", "--prompts-per-step", "2", "--num-generations", "4",
             "--micro-batch-size", "4", "--max-completion-length", "8", "--max-prompt-length", "128",
             "--learning-rate", "1e-3", "--reward", "tags", "--device", "cpu", "--max-steps", "8",
             "--log-completions-steps", "1", "--lr-scheduler-type", "cosine", "--warmup-ratio", "0.25"]
    return [sys.executable, str(ROOT / "train.py"), *flags, "--output-dir", str(out), *extra]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _wait_for_lines(path: Path, count: int, process, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, "the run ended before the signal"
        time.sleep(0.02)
    raise TimeoutError(path)


def _final_weights(out: Path) -> dict:
    return load_file(latest_checkpoint(out) / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "straight"
    subprocess.run(_train_command(out, "--save-steps", "2"), check=True, env=_env(), capture_output=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_to_the_same_result(uninterrupted, tmp_path, how):
    out = tmp_path / "run"
    process = subprocess.Popen(_train_command(out, "--save-steps", "2"), env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_lines(out / "metrics.jsonl", 3, process)  # mid-run: step 3 logged, checkpoint 2 written
    process.send_signal(getattr(signal, how))
    output = process.communicate(timeout=120)[0]
    if how == "SIGTERM":
        assert process.returncode == 143, output
        assert "checkpoint saved. Resume with: python train.py --resume" in output
    else:
        assert process.returncode == -signal.SIGKILL
    stopped_at = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))  # the newest saved
    assert 2 <= stopped_at < 8
    resumed = subprocess.run(_train_command(out, "--save-steps", "2", "--resume"), env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # It resumed from the newest checkpoint the killed run wrote, and kept only the newest two (save_total_limit).
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:06d}'} at step {stopped_at}" in (
        resumed.stdout + resumed.stderr)
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-000006", "step-000008"]
    expected, got = read_jsonl(uninterrupted / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, 9))  # no step twice, none missing
    for key in ("reward", "loss", "kl", "grad_norm", "learning_rate"):
        assert [m[key] for m in got] == [m[key] for m in expected], key
    assert [s["step"] for s in read_jsonl(out / "samples.jsonl")] == [s["step"] for s in read_jsonl(uninterrupted / "samples.jsonl")]
    straight, result = _final_weights(uninterrupted), _final_weights(out)
    for name in straight:
        assert torch.equal(straight[name], result[name]), name


class _Saved:
    """Stands in for a model or tokenizer: save_pretrained writes one small file."""

    def save_pretrained(self, folder, **_):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "weights.txt").write_text("w")


@pytest.mark.parametrize("keep", [0, 1, 2, 3])
def test_save_total_limit_deletes_the_oldest_checkpoints(tmp_path, keep):
    """save_total_limit = keep: after every save the newest `keep` complete checkpoints remain (0: all of them),
    also past step 9 -> 10 (where a name sort and a number sort agree only by the zero padding) and when the
    newest step is saved again (a final save right after a periodic one)."""
    steps, done = [3, 6, 9, 10, 12, 100], []
    for step in steps + [100]:
        save_checkpoint(tmp_path, step, _Saved(), _Saved(), {"step": step}, {}, *([keep] if keep else []))  # 0: the default
        done = sorted(set(done + [step]))
        expected = done if keep == 0 else done[-keep:]
        folders = sorted((tmp_path / "checkpoints").iterdir())
        assert [int(p.name.split("-")[1]) for p in folders] == expected, (keep, step)
        assert [load_trainer_state(p)["step"] for p in folders] == expected
        assert latest_checkpoint(tmp_path).name == f"step-{done[-1]:06d}"


def test_trainer_passes_save_total_limit(tmp_path):
    Trainer(make_config(tmp_path, max_steps=4, save_steps=1, save_total_limit=2)).train()
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == ["step-000003", "step-000004"]


def test_a_checkpoint_holds_the_merged_and_reference_models_and_counts_only_when_complete(tmp_path):
    from grpo.core.checkpoint import list_checkpoints

    folder = save_checkpoint(tmp_path, 4, _Saved(), _Saved(), {"step": 4}, {"model": "tiny"},
                             reference=_Saved(), merged=_Saved())
    assert (folder / "reference" / "weights.txt").is_file() and (folder / "merged" / "weights.txt").is_file()
    assert json.loads((folder / "run_config.json").read_text()) == {"model": "tiny"}
    # A folder missing the completion marker or the trainer state is not a checkpoint (a torn copy, say).
    for missing in ("trainer_state.pt", "COMPLETE"):
        torn = tmp_path / "checkpoints" / f"step-00000{9 if missing == 'COMPLETE' else 8}"
        shutil.copytree(folder, torn)
        (torn / missing).unlink()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004"]


_SAVE_SCRIPT = """
import sys
from grpo.core.checkpoint import save_checkpoint
from grpo.tiny_model import build_tiny_model
model, tokenizer = build_tiny_model("small")
print("saving", flush=True)
save_checkpoint(sys.argv[1], 2, model, tokenizer, {"step": 2}, {})
"""


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_the_previous_one(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    run = tmp_path / "run"
    save_checkpoint(run, 1, model, tokenizer, {"step": 1, "note": "good"}, {"model": "tiny"})
    killed_mid_write = False
    for _ in range(3):  # the kill must land while the (78 MB) weights are being written
        process = subprocess.Popen([sys.executable, "-c", _SAVE_SCRIPT, str(run)], cwd=ROOT, env=_env(),
                                   stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "saving"
        while process.poll() is None and not list((run / "checkpoints").glob(".tmp-*")):
            time.sleep(0.001)
        process.kill()
        process.wait()
        if list((run / "checkpoints").glob(".tmp-*")) and not (run / "checkpoints" / "step-000002").exists():
            killed_mid_write = True
            break
    assert killed_mid_write, "the writer finished before it could be killed three times"
    checkpoint = latest_checkpoint(run)
    assert checkpoint.name == "step-000001"
    assert load_trainer_state(checkpoint) == {"step": 1, "note": "good"}
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.vocab_size == model.config.vocab_size
    save_checkpoint(run, 3, model, tokenizer, {"step": 3}, {})  # the next save clears the torn folder
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert latest_checkpoint(run).name == "step-000003"


def test_trainer_state_is_loaded_without_unpickling(tmp_path, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    run = tmp_path / "run"
    checkpoint = save_checkpoint(run, 1, model, tokenizer, {"step": 1}, {})

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"step": 1, "payload": Evil()}, checkpoint / "trainer_state.pt")
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load_trainer_state(checkpoint)


def test_safe_defaults():
    config = GRPOConfig()
    assert config.trust_remote_code is False
    assert math.isfinite(config.beta) and config.max_bad_steps >= 1


def test_cpu_threads_follow_the_other_processes_load(monkeypatch):
    # grpo/parallel/threads.py: over each step, (machine busy - own CPU) / wall = the cores others kept busy; the next
    # step gets the rest (at least one, at most the count torch started with), and gets them back when they leave.
    import grpo.parallel.threads as threads_module

    clock = {"busy": 0.0, "own": 0.0, "wall": 0.0}
    monkeypatch.setattr(threads_module, "cpu_times", lambda: (clock["busy"], clock["own"], clock["wall"]))
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: {0, 1})
    set_to = []
    monkeypatch.setattr(threads_module.torch, "get_num_threads", lambda: set_to[-1] if set_to else 2)
    monkeypatch.setattr(threads_module.torch, "set_num_threads", set_to.append)
    control = threads_module.CpuThreads(enabled=True)

    def step(own_cores: float, other_cores: float, seconds: float = 2.0) -> int:
        clock["own"] += own_cores * seconds
        clock["busy"] += (own_cores + other_cores) * seconds
        clock["wall"] += seconds
        return control.adjust()

    assert control.enabled and control.most == 2
    assert step(own_cores=2.0, other_cores=0.05) == 2 and set_to == []  # quiet: nothing changes
    assert step(own_cores=1.2, other_cores=0.95) == 1 and set_to == [1]  # a busy neighbour: one thread
    assert step(own_cores=1.0, other_cores=1.0) == 1 and set_to == [1]  # it stays while the neighbour does
    assert step(own_cores=1.0, other_cores=0.0) == 2 and set_to == [1, 2]  # the neighbour left
    assert step(own_cores=0.5, other_cores=3.0) == 1  # never below one
    assert not threads_module.CpuThreads(enabled=False).enabled


@pytest.mark.own_kernels
def test_every_file_and_folder_of_a_checkpoint_is_fsynced_before_it_counts(tmp_path, monkeypatch):
    """Atomic means durable too: each file (also inside reference/ and merged/), the checkpoint folder and
    checkpoints/ itself are fsynced, so a power cut after the rename cannot leave a complete-looking folder of
    empty files."""
    import grpo.core.checkpoint as checkpoint

    synced, real = [], os.fsync

    def fsync(descriptor):
        synced.append(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        real(descriptor)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    folder = save_checkpoint(tmp_path, 4, _Saved(), _Saved(), {"step": 4}, {}, reference=_Saved(), merged=_Saved())
    root = tmp_path / "checkpoints"
    inside = [p.relative_to(root).parts for p in synced if p.is_relative_to(root) and p != root]
    tmp_names = {Path(*parts[1:]) for parts in inside if parts[0].startswith(".tmp-step-000004")}  # in the tmp folder
    files = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
    assert files == {Path("weights.txt"), Path("reference/weights.txt"), Path("merged/weights.txt"),
                     Path("trainer_state.pt"), Path("run_config.json"), Path("COMPLETE")}
    assert files <= tmp_names, files - tmp_names  # every file, fsynced (under its temporary folder's name)
    for sub in ("reference", "merged"):
        assert Path(sub) in tmp_names
    assert Path() in tmp_names and root in synced  # the folder itself, and checkpoints/ after the rename


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in this process: the torchrun code paths (FSDP2, torch.distributed.checkpoint)
    run where coverage and the mutation run can see them; tests/test_distributed.py runs several ranks."""
    import torch.distributed as dist

    from grpo.parallel.distributed import World

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield World()
    finally:
        dist.destroy_process_group()


@pytest.mark.own_kernels
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_distributed_checkpoint_saves_every_part_and_reloads_the_optimizer(one_rank_group, tmp_path, mode):
    from grpo.core.checkpoint import list_checkpoints, load_sharded_optimizer, save_distributed_checkpoint
    from grpo.parallel.distributed import full_tensor, wrap_model
    from grpo.tiny_model import build_tiny_model

    world, cpu = one_rank_group, torch.device("cpu")
    model, tokenizer = build_tiny_model("tiny", seed=0)
    reference, _ = build_tiny_model("tiny", seed=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_ref = {k: v.clone() for k, v in reference.state_dict().items()}
    call = wrap_model(model, mode, world, cpu, "fp32")
    reference_call = wrap_model(reference, "fsdp" if mode == "fsdp" else "none", world, cpu, "fp32", trainable=False)
    optimizer = torch.optim.AdamW(call.parameters(), lr=0.0)  # lr 0: the weights stay `expected`
    ids = torch.tensor([[1, 2, 3, 4]])
    call(lambda m: m(ids).logits.sum()).backward()
    optimizer.step()

    def state_of(opt):  # each parameter's moments, in parameter order (not the state dict's insertion order)
        states = [opt.state[p] for group in opt.param_groups for p in group["params"] if p in opt.state]
        return [(full_tensor(s["exp_avg"]).clone(), full_tensor(s["exp_avg_sq"]).clone()) for s in states]

    saved_moments = state_of(optimizer)
    assert saved_moments and any(m.abs().sum() > 0 for m, _ in saved_moments)
    run = tmp_path / "outputs" / "run"  # not there yet: the first save makes it
    torn = run / "checkpoints" / ".tmp-step-000005-world"  # a save killed half-way, cleared by the next one
    for step in (5, 6, 7):
        if step == 6:
            (torn / "sharded").mkdir(parents=True)
        folder = save_distributed_checkpoint(run, step, world, call, optimizer, model, tokenizer,
                                             {"step": step}, {"rng": step}, {"model": "tiny"},
                                             **({"keep": 2} if step == 7 else {}),
                                             reference_call=reference_call, merged=_Saved())
        assert folder.name == f"step-{step:06d}" and not torn.exists()
        # keep left at its default (0): every checkpoint stays until the save that asks for 2
        kept = {5: [5], 6: [5, 6], 7: [6, 7]}[step]
        assert [p.name for p in list_checkpoints(run)] == [f"step-{s:06d}" for s in kept]
    assert load_trainer_state(folder) == {"step": 7}
    assert torch.load(folder / "rank-00000.pt", weights_only=True) == {"rng": 7}
    assert json.loads((folder / "run_config.json").read_text()) == {"model": "tiny"}
    assert (folder / "merged" / "weights.txt").is_file() and (folder / "merged" / "tokenizer_config.json").is_file()
    assert (folder / "tokenizer_config.json").is_file() and (folder / "sharded").is_dir()
    for path, want in ((folder, expected), (folder / "reference", expected_ref)):
        loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
        assert loaded.keys() == want.keys(), path
        for key, value in want.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=f"{path.name}: {key}")
    optimizer.zero_grad(set_to_none=True)  # as a resumed run's fresh optimizer: no moments, no gradients
    optimizer.state.clear()
    load_sharded_optimizer(folder, call, optimizer, world.group)
    for (m, v), (m0, v0) in zip(state_of(optimizer), saved_moments, strict=True):
        torch.testing.assert_close(m, m0, rtol=0, atol=0)
        torch.testing.assert_close(v, v0, rtol=0, atol=0)


# ----------------------------------------------------------------------------- a full disk
PAGE = 4096  # tmpfs counts space in pages


def _pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


@contextlib.contextmanager
def _tmpfs(folder: Path, size: str):
    """A tmpfs of `size` ("4m") mounted at `folder`: a file system that really fills up. Mounting needs root (and a
    container that allows it); the test is skipped where it may not."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True) if shutil.which("mount") else None
    if mounted is None or mounted.returncode != 0:
        pytest.skip("a full-disk test mounts a small tmpfs, which needs root: "
                    + (mounted.stderr.strip() if mounted else "no mount command"))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


def _fill(disk: Path, leave: int) -> Path:
    """Write a file that leaves `leave` bytes (a whole number of pages) free on `disk`; deleting it frees the space."""
    filler = disk / "filler"
    filler.write_bytes(bytes(shutil.disk_usage(disk).free - leave))
    assert shutil.disk_usage(disk).free == leave
    return filler


# Where the disk fills during the step-4 save: (--distributed, the file being written, whether every file but
# trainer_state.pt, run_config.json and COMPLETE was written before it, how its writer reports it).
FULL_AT = {
    "weights": ("none", "model.safetensors", False, "SafetensorError: Error while serializing: I/O error: No space "
                "left on device (os error 28)"),  # Rust's io::Error
    "trainer_state": ("none", "trainer_state.pt", True,
                      "RuntimeError: [enforce fail at inline_container.cc:"),  # torch's zip writer, no errno (the issue's)
    "sharded_optimizer": ("ddp", "sharded/__0_0.distcp", False,
                          "RuntimeError: [enforce fail at inline_container.cc:"),  # the same, in a CheckpointException
}


@pytest.mark.own_kernels
@pytest.mark.parametrize("full_at", FULL_AT)
def test_a_disk_full_during_a_checkpoint_stops_with_the_last_good_one_and_resumes_exactly(
        small_disk, tmp_path, monkeypatch, request, full_at):
    """The plain save and the distributed one (world size 1 in this process: torch.distributed.checkpoint's
    sharded/ and rank files, as under torchrun) on a disk that fills up half-way through one of the step-4
    checkpoint's files: DiskFullError names the disk, the checkpoint, the run folder, what the writer said and the
    last good checkpoint (step 2), which stays intact; with the space freed, --resume clears the torn .tmp- folder
    and ends where an uninterrupted run ends, bit for bit."""
    from grpo.core import run_state
    from grpo.core.trainer import DiskFullError

    mode, target, after_the_rest, writer_error = FULL_AT[full_at]
    if mode != "none":  # a one-process group, as `torchrun --nproc-per-node 1` makes
        for name in ("RANK", "LOCAL_RANK"):
            monkeypatch.setenv(name, "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        request.getfixturevalue("one_rank_group")
    settings = dict(max_steps=4, save_steps=2, log_completions_steps=1, distributed="auto" if mode == "none" else mode)
    Trainer(make_config(tmp_path / "straight", **settings)).train()
    run, straight = small_disk / "run", tmp_path / "straight" / "run"
    real_save, filled = run_state.save, []

    def save_on_a_filling_disk(run_dir, config, state, *args):
        if state.step == 4 and not filled:  # the disk fills up half-way through `target` (step 2's sizes)
            last = run / "checkpoints" / "step-000002"
            sizes = {p.relative_to(last).as_posix(): p.stat().st_size for p in last.rglob("*") if p.is_file()}
            before = [name for name in sizes if name not in (target, "run_config.json", "COMPLETE")]
            leave = sum(_pages(sizes[name]) for name in before) if after_the_rest else 0
            filled.append(_fill(small_disk, leave + _pages(sizes[target]) // 2 // PAGE * PAGE))
        return real_save(run_dir, config, state, *args)

    monkeypatch.setattr(run_state, "save", save_on_a_filling_disk)
    with pytest.raises(DiskFullError) as stopped:
        Trainer(make_config(small_disk, **settings)).train()
    message = str(stopped.value)
    assert message.startswith("the disk is full (No space left on device): could not write checkpoint "
                              f"checkpoints/step-000004 in the run folder {run} [{writer_error}"), message
    assert message.endswith(f"]. The last good checkpoint is {run / 'checkpoints' / 'step-000002'}."), message
    assert "\n" not in message
    torn = list((run / "checkpoints").glob(".tmp-step-000004-*"))
    assert len(torn) == 1 and not (torn[0] / "COMPLETE").exists()
    assert latest_checkpoint(run).name == "step-000002" and load_trainer_state(latest_checkpoint(run))["step"] == 2

    filled[0].unlink()  # space freed
    Trainer(make_config(small_disk, **settings, resume=str(run))).train()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]  # torn one gone
    expected, got = read_jsonl(straight / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for key in ("reward", "loss", "kl", "grad_norm", "learning_rate"):
        assert [m[key] for m in got] == [m[key] for m in expected], key
    assert read_jsonl(run / "samples.jsonl") == read_jsonl(straight / "samples.jsonl")
    weights, want = _final_weights(run), _final_weights(straight)
    for name in want:
        assert torch.equal(weights[name], want[name]), name


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.own_kernels
@pytest.mark.parametrize("writes, step", [("metrics.jsonl", 1), ("samples.jsonl", 2), ("eval", 2)])
def test_a_disk_full_at_the_logs_or_the_evaluation_ends_in_one_error_line(tmp_path, capsys, monkeypatch, writes, step):
    """ENOSPC (injected) from metrics.jsonl's, samples.jsonl's or eval/'s write: train.py prints one `error:` line
    naming the disk, what it was writing, the run folder, the last good checkpoint (none before the first save)
    and the command that resumes (before the first save: that runs it again over the half-written folder); no
    traceback."""
    import grpo.core.trainer
    import train
    from grpo.core.metrics import MetricsLogger
    from tests.test_load_errors import _run

    run = tmp_path / "run"
    refused = run / "eval" / "step-000002.json" if writes == "eval" else run / writes
    owner, method = {"eval": (grpo.core.trainer, "save_evaluation"), "metrics.jsonl": (MetricsLogger, "log"),
                     "samples.jsonl": (MetricsLogger, "log_samples")}[writes]
    real = getattr(owner, method)

    def write(*args, **kwargs):  # (self,) step, ... for the logger; run_dir, step, ... for save_evaluation
        if args[1] == step:
            raise _enospc(refused)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, write)
    argv = ["--model", "tiny", "--dataset", "synthetic:8", "--max-steps", "3", "--prompts-per-step", "2",
            "--num-generations", "2", "--micro-batch-size", "4", "--max-completion-length", "4", "--device", "cpu",
            "--save-steps", "1", "--log-completions-steps", "1", "--eval-steps", "2", "--eval-limit", "2",
            "--output-dir", str(run)]
    err = _run(train.main, argv, capsys)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    what = {"eval": "eval/step-000002.*"}.get(writes, f"step {step}'s lines of metrics.jsonl and samples.jsonl")
    last = run / "checkpoints" / "step-000001" if step == 2 else "none (none was saved yet)"
    advice = (f"resume with: python train.py {' '.join(argv)} --resume {run}" if step == 2 else  # a checkpoint
              f"run it again (no checkpoint was saved yet) with: python train.py {' '.join(argv)} --overwrite")
    assert line == (f"error: the disk is full (No space left on device): could not write {what} in the run folder "
                    f"{run} [OSError: [Errno 28] No space left on device: '{refused}']. The last good checkpoint is "
                    f"{last}. Free some space, then {advice}")


def test_only_a_full_disk_becomes_a_disk_full_error(tmp_path, monkeypatch):
    """Each way a writer says the disk is full (grpo/core/disk_full.py), and errors that are something else."""
    import grpo.core.disk_full as disk_full
    from torch.distributed.checkpoint import CheckpointException

    # the nearest folder that exists: the run folder's file system before the run made it
    assert disk_full.free_bytes(tmp_path / "not" / "made" / "yet") == shutil.disk_usage(tmp_path).free

    def raised(error: BaseException, free: int = 10 << 20) -> BaseException:
        monkeypatch.setattr(disk_full, "free_bytes", lambda folder: free)
        try:
            with disk_full.writing(tmp_path, "a file"):
                raise error
        except BaseException as caught:  # noqa: BLE001 - what writing() let through or raised
            return caught

    def chained(outer: Exception, inner: BaseException) -> Exception:
        outer.__cause__ = inner
        return outer

    torch_short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 17280 vs 17172")
    full = {
        "ENOSPC": _enospc(tmp_path / "a"),
        "EDQUOT (a quota)": OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
        "ENOSPC as the cause": chained(RuntimeError("could not save"), _enospc(tmp_path / "a")),
        "Rust's io::Error": Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
        "a rank's ENOSPC in torch.distributed.checkpoint": CheckpointException("save", {1: (_enospc(tmp_path), None)}),
    }
    for name, error in full.items():
        assert isinstance(raised(error), disk_full.DiskFullError), name
    assert "(Disk quota exceeded)" in str(raised(full["EDQUOT (a quota)"]))
    # torch's zip writer keeps no errno: a full disk only when the folder's file system is (nearly) out of space
    assert isinstance(raised(torch_short_write, free=0), disk_full.DiskFullError)
    assert raised(torch_short_write) is torch_short_write
    dcp_short = CheckpointException("save", {0: (torch_short_write, None)})
    stopped = raised(dcp_short, free=0)
    assert f"[RuntimeError: {torch_short_write}]" in str(stopped) and stopped.__cause__ is dcp_short
    for other in (PermissionError(errno.EACCES, "Permission denied"), RuntimeError("unexpected pos 1 vs 0"),
                  ValueError("no"), CheckpointException("save", {0: (PermissionError(errno.EACCES, "no"), None)})):
        assert raised(other) is other, other
    denied = PermissionError(errno.EACCES, "Permission denied")  # an errno that says what it is, on a full disk
    assert raised(denied, free=0) is denied
    # on a nearly full disk, only torch's short write counts: another error without an errno stays itself
    for other in (ValueError("no"), KeyError("step"), RuntimeError("NCCL error"), ConnectionError("wandb")):
        assert raised(other, free=0) is other, other
    # an OSError handled earlier (the __context__ of the short write) does not hide the full disk
    handled = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 17280 vs 17172")
    handled.__context__ = FileNotFoundError(errno.ENOENT, "an old checkpoint")
    assert isinstance(raised(handled, free=0), disk_full.DiskFullError)

    def unreadable(folder):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disk_full, "free_bytes", unreadable)  # a folder the free-space check cannot look at
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with disk_full.writing(tmp_path, "a file"):
            raise torch_short_write


def test_the_resume_command_keeps_the_flags_and_resumes_the_run_folder():
    from grpo.cli import resume_command

    assert resume_command(["--preset", "smoke", "--output-dir", "/mnt/x"], "/mnt/x") == (
        "python train.py --preset smoke --output-dir /mnt/x --resume /mnt/x")
    for given in (["--resume"], ["--resume", "runs/a/checkpoints/step-000002"], ["--resume=runs/a"]):  # replaced
        assert resume_command(["--model", "tiny", *given, "--max-steps", "4"], "runs/a") == (
            "python train.py --model tiny --max-steps 4 --resume runs/a")
    assert resume_command(["--output-dir", "my runs/a"], "my runs/a", torchrun=True) == (
        "torchrun [the same torchrun options] train.py --output-dir 'my runs/a' --resume 'my runs/a'")


@pytest.mark.slow
@pytest.mark.own_kernels  # a subprocess: train.py's own --kernels
def test_the_smoke_preset_on_a_full_disk_says_so_in_one_line_and_resumes(tmp_path):
    """The issue's case: `train.py --preset smoke` on a 1.8 MB tmpfs fills it at a checkpoint. One `error:` line,
    no traceback; the command it prints, run once space is freed, redoes the steps past the last good checkpoint
    exactly as they first ran (the same metrics lines) and clears the torn .tmp- folder."""
    import shlex

    with _tmpfs(tmp_path / "disk", "1800k") as disk:
        run = disk / "run"
        first = subprocess.run([sys.executable, str(ROOT / "train.py"), "--preset", "smoke", "--output-dir", str(run)],
                               env=_env(), capture_output=True, text=True, cwd=ROOT, timeout=300)
        errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
        assert first.returncode == 1 and len(errors) == 1 and "Traceback" not in first.stderr, first.stderr[-3000:]
        last_good = latest_checkpoint(run)
        assert last_good is not None and list((run / "checkpoints").glob(".tmp-*"))
        assert "error: the disk is full (No space left on device): could not write checkpoint" in errors[0]
        assert f"in the run folder {run} [" in errors[0]
        assert f"The last good checkpoint is {last_good}. Free some space, then resume with: " in errors[0]
        command = shlex.split(errors[0].split("resume with: ")[1])
        assert command == ["python", "train.py", "--preset", "smoke", "--output-dir", str(run), "--resume", str(run)]
        first_lines = read_jsonl(run / "metrics.jsonl")
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)  # space freed
        resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *command[2:]], env=_env(),
                                 capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert not list((run / "checkpoints").glob(".tmp-*"))
        lines = read_jsonl(run / "metrics.jsonl")
        assert [m["step"] for m in lines] == list(range(1, 31))
        for key in ("reward", "loss", "kl", "grad_norm"):  # the steps redone after the last good checkpoint
            assert [m[key] for m in lines] == [m[key] for m in first_lines], key


def test_logs_on_a_full_disk_raise_once_and_a_resume_rewrites_them_whole(small_disk):
    """metrics.jsonl on a disk that fills up: log() raises ENOSPC, close() does not raise it again (the trainer's
    error stays the one reported); a resumed logger's truncation, on the still-full disk, fails with the file as it
    was, and once there is space keeps exactly the lines up to the checkpoint's step (the torn last one dropped)."""
    from grpo.core.metrics import MetricsLogger

    run = small_disk / "run"
    logger = MetricsLogger(run)
    for step in (1, 2, 3):
        logger.log(step, {"reward": 0.5, "note": "x" * 500}, console=False)
    filler = _fill(small_disk, 0)
    with pytest.raises(OSError) as refused:
        for step in range(4, 100):
            logger.log(step, {"reward": 0.5, "note": "x" * 500}, console=False)
    assert refused.value.errno == errno.ENOSPC
    logger.close()
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(OSError):  # dropping step 3 needs a new copy of the file: no space for it
        MetricsLogger(run, resume_step=2)
    assert (run / "metrics.jsonl").read_bytes() == before and not list(run.glob("*.tmp"))
    filler.unlink()
    MetricsLogger(run, resume_step=2).close()
    assert [record["step"] for record in read_jsonl(run / "metrics.jsonl")] == [1, 2]
