"""The benchmarks are not unit tests: these only check that they run end to end with tiny settings."""

from bench import sampler


def test_sampler_benchmark_runs(capsys):
    times = sampler.main(["--shape", "tiny", "--prompts", "2", "--group-size", "2", "--new-tokens", "4", "--repeats", "1"])
    assert set(times) == {"model.generate", "ours (dynamic cache)"}
    assert "tokens/s" in capsys.readouterr().out
