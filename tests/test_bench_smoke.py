"""The benchmarks are not unit tests: these only check that they run end to end with tiny settings."""

import pytest

from bench import sampler


def test_sampler_benchmark_runs(capsys):
    times = sampler.main(["--shape", "tiny", "--prompts", "2", "--group-size", "2", "--new-tokens", "4", "--repeats", "1"])
    assert set(times) == {"model.generate", "ours, plain", "ours, kernel (eager)"}
    assert "tokens/s" in capsys.readouterr().out


def test_sampler_cost_table_runs():
    costs = sampler.sampler_costs(vocab_size=1000, rows=4, repeats=1)
    assert len(costs) == 7 and all(ms > 0 for ms in costs.values())


@pytest.mark.slow
def test_trainer_benchmark_runs(capsys):
    pytest.importorskip("trl")
    from bench import trainer

    result = trainer.main(["--shape", "tiny", "--steps", "2", "--repeats", "1", "--prompts", "2", "--group-size", "2",
                           "--new-tokens", "8", "--micro-batch", "4"])
    assert set(result["summary"]) == {"ours", "trl"} and result["floor"]["total"] > 0
    floor = result["floor"]  # each product's fastest timing, and its median (never below the fastest)
    assert all(floor[f"{part}_median"] >= floor[part] for part in ("sample", "reference", "update", "total"))
    assert result["summary"]["ours"]["floor_median_ratio"] <= result["summary"]["ours"]["floor_ratio"]
    assert "ours/trl" in capsys.readouterr().out


def test_trainer_benchmark_reports_a_stopped_side_and_goes_on(capsys):
    from bench import trainer

    result = trainer.main(["--shape", "tiny", "--steps", "1", "--untimed", "0", "--repeats", "1", "--prompts", "2",
                           "--group-size", "2", "--new-tokens", "4", "--micro-batch", "4", "--sides", "ours",
                           "--side-timeout", "0.01"])
    assert result["summary"] == {}
    assert "ours run stopped after 0.01 s" in capsys.readouterr().out


def test_trainer_benchmark_names_an_unknown_side():
    from bench import trainer

    with pytest.raises(SystemExit):
        trainer.main(["--sides", "ours,vllm"])
