"""The README is the front door and docs/ the reference: they must list every flag and keep their claims true."""

import dataclasses
import re
from pathlib import Path

from grpo.config import GRPOConfig, cli_reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_cli_reference_is_generated_from_the_config():
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert cli.strip() == cli_reference().strip(), "docs/cli.md is stale: run `python -m grpo.config > docs/cli.md`"
    missing = [f.name for f in dataclasses.fields(GRPOConfig) if f"`--{f.name.replace('_', '-')}`" not in cli]
    assert not missing, f"docs/cli.md lacks {missing}"


def test_readme_commands_match_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    (extras,) = re.findall(r'-e "\.\[([\w,]+)\]"', ci)  # what CI installs is what the README's set-up says
    assert f'pip install torch==2.13.0 && pip install -e ".[{extras}]"' in README
    assert "torch==2.13.0" in ci and "test" in extras.split(",") and "pytest" in ci


def test_readme_links_and_line_counts_are_true():
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link
    counts = re.findall(r"`([\w/]+\.py)` \((\d+)(?: lines)?\)", README)
    assert len(counts) >= 8, counts
    for path, claimed in counts:
        actual = len((ROOT / path).read_text().splitlines())
        assert actual == int(claimed), f"README says {path} has {claimed} lines; it has {actual}"
    total = re.search(r"\): ([\d,]+) lines, docstrings", README).group(1)
    assert int(total.replace(",", "")) == sum(int(c) for _, c in counts)
