"""The README is the front door: it must list every flag and keep its commands true."""

import dataclasses
from pathlib import Path

from grpo.config import GRPOConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_flag_is_in_the_readme():
    missing = [f.name for f in dataclasses.fields(GRPOConfig) if f"`--{f.name.replace('_', '-')}`" not in README]
    assert not missing, f"README's CLI reference lacks {missing}"


def test_readme_commands_match_ci():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 && pip install -e ".[test,parity]"' in README
    assert "torch==2.13.0" in ci and '-e ".[test,parity]"' in ci and "pytest" in ci
