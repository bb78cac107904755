"""The README is the front door and docs/ the reference: they must list every flag and keep their claims true."""

import dataclasses
import importlib
import re
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
    (extras,) = re.findall(r'-e "\.\[([\w,]+)\]"', ci)  # what CI installs is what the README's set-up says
    assert f'pip install torch==2.13.0 && pip install -e ".[{extras}]"' in README
    assert "torch==2.13.0" in ci and "test" in extras.split(",") and "pytest" in ci


def test_readme_links_and_code_references_are_true():
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link
    # Every dotted name the README points a reader to (`grpo.update.sync_reference`) exists there.
    references = set(re.findall(r"`((?:grpo|rewards|data)(?:\.\w+)+)`", README))
    assert len(references) >= 20, references
    for reference in sorted(references):
        assert _resolves(reference), f"README names `{reference}`, which does not exist"
    # The step table names files that exist.
    step = README.split("## One step, file by file", 1)[1].split("\n## ", 1)[0]
    files = re.findall(r"\| `([\w/]+\.py)` \|", step)
    assert len(files) == 8 and all((ROOT / name).is_file() for name in files), files


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
