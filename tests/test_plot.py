"""grpo.plot: a PNG from a run's metrics.jsonl, continuous across a resume, and a clear refusal without metrics."""

import json

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -e '.[plot]'")

from grpo.plot import PlotError, main, plot_run, read_metrics, series  # noqa: E402
from grpo.core.trainer import Trainer  # noqa: E402
from tests.test_trainer import make_config  # noqa: E402


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_resumed_run_is_one_continuous_curve(tmp_path):
    overrides = dict(max_steps=4, save_steps=2, beta=0.04, eval_steps=2, eval_limit=4, eval_batch_size=4)
    Trainer(make_config(tmp_path, **overrides)).train(until_step=2)
    Trainer(make_config(tmp_path, resume=str(tmp_path / "run"), **overrides)).train()
    records = read_metrics(tmp_path / "run")
    assert series(records, "reward")[0] == [1, 2, 3, 4]  # every step once, in order
    assert series(records, "eval/strict_accuracy")[0] == [2, 4]  # GSM8K-shaped rows: the gsm8k scorer
    path = plot_run(tmp_path / "run")
    assert path == tmp_path / "run" / "curves.png" and _is_png(path) and path.stat().st_size > 10_000


def test_plot_refuses_a_folder_without_metrics(tmp_path, capsys):
    with pytest.raises(PlotError, match="no metrics.jsonl here"):
        plot_run(tmp_path)
    with pytest.raises(PlotError, match="no such folder"):
        plot_run(tmp_path / "missing")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="empty"):
        plot_run(tmp_path)
    assert main([str(tmp_path / "missing")]) == 2 and "error:" in capsys.readouterr().err


def test_plot_command_on_a_metrics_file(tmp_path, capsys):
    lines = [{"step": s, "reward": s / 10, "rewards/tags/mean": s / 20, "kl": 0.01 * s, "entropy": 6.0,
              "completions/mean_length": 8, "clip_ratio/region_mean": 0.0} for s in range(1, 30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 30, "rew')
    assert main([str(tmp_path), "--output", str(tmp_path / "out.png"), "--smooth", "5"]) == 0
    assert _is_png(tmp_path / "out.png") and "wrote" in capsys.readouterr().out
