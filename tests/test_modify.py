"""docs/modify.md's worked examples, taken out of the page: each file written to a folder, its test run there, and the
plug-ins trained from the command line. Also the start-of-run checks of a plug-in: one `error:` before any model
loads, naming the plug-in and what is wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "modify.md"


def page_files() -> dict[str, str]:
    """{file name: source} of the page's ```python title=NAME blocks."""
    blocks = re.findall(r"```python title=(\S+)\n(.*?)```", PAGE.read_text(), flags=re.S)
    return {name: source for name, source in blocks}


def _env(folder: Path) -> dict:
    path = os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


@pytest.fixture
def examples(tmp_path) -> Path:
    for name, source in page_files().items():
        (tmp_path / name).write_text(source)
    return tmp_path


def test_the_page_has_an_example_and_a_test_for_each_seam():
    assert set(page_files()) == {"my_estimators.py", "test_my_estimators.py", "my_losses.py", "test_my_losses.py",
                                 "test_my_reward_model.py"}


def test_the_pages_tests_pass(examples):
    tests = sorted(str(path) for path in examples.glob("test_*.py"))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             *tests], cwd=examples, env=_env(examples), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.own_kernels  # a subprocess: train.py's own --kernels
def test_the_pages_plug_ins_train_from_the_command_line(examples):
    out = examples / "run"
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--preset", "smoke", "--max-steps", "2",
                             "--advantage-estimator", "my_estimators.py:median_baseline",
                             "--loss-type", "my_losses.py:dual_clip", "--num-iterations", "2",
                             "--save-steps", "0", "--eval-steps", "0", "--output-dir", str(out)],
                            cwd=examples, env=_env(examples), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert all(torch.isfinite(torch.tensor(line[key])) for key in ("loss", "grad_norm", "advantages/abs_mean"))
        assert "clip_ratio/region_mean" not in line  # a plug-in objective logs no clip ratios it does not define
    config = json.loads((out / "run_config.json").read_text())
    assert config["advantage_estimator"] == "my_estimators.py:median_baseline"
    assert config["loss_type"] == "my_losses.py:dual_clip"


BAD_PLUG_INS = {
    "two_arguments": ("def fn(batch, scale):\n    return batch.rewards * scale\n",
                      "--advantage-estimator", r"must take one argument, the AdvantageBatch .* takes 2"),
    "wrong_shape": ("def fn(batch):\n    return batch.rewards[:3]\n",
                    "--advantage-estimator", r"returned \(3,\); expected a tensor of shape \(N,\) = \(\d+,\)"),
    "raises": ("def fn(batch):\n    return batch.no_such_field\n",
               "--advantage-estimator",
               r"raised AttributeError at .*plug.py:4: .* \(on the start-of-run probe batch of \d+ rows\)"),
    "loss_shape": ("def fn(x):\n    return x.logps.sum()\n",
                   "--loss-type", r"returned \(\) on a probe micro-batch of 4 rows x 5 tokens"),
    "loss_no_grad": ("def fn(x):\n    return x.old_logps * x.advantages\n",
                     "--loss-type", r"not finite or has no gradient through x.logps"),
    "loss_aggregation": ("def fn(x):\n    return -x.advantages * x.logps\nfn.aggregation = 'token_mean'\n",
                         "--loss-type", r"its `aggregation` must be a built-in loss type .* got 'token_mean'"),
}


@pytest.mark.parametrize("case", BAD_PLUG_INS.values(), ids=BAD_PLUG_INS.keys())
def test_a_wrong_plug_in_is_one_error_before_any_model_loads(case, tmp_path, capsys):
    import train

    source, flag, message = case
    (tmp_path / "plug.py").write_text("import torch\n\n" + source)
    # The model folder does not exist either: both come from the configuration check, before anything loads.
    argv = ["--preset", "smoke", flag, f"{tmp_path / 'plug.py'}:fn", "--model", str(tmp_path / "no-model"),
            "--output-dir", str(tmp_path / "run")]
    assert train.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: invalid configuration:") and "no-model: no such folder" in error
    assert f"{tmp_path / 'plug.py'}:fn" in error and re.search(message, error), error
    assert not (tmp_path / "run").exists()  # no run folder was made
