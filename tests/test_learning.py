"""The learning experiment (bench/learning.py): its warm-start data, its held-out split, and a reduced run."""

import json
import sys
from pathlib import Path

import pytest

from data import KINDS, make_synthetic_gsm8k, make_synthetic_problems, r1_completion
from grpo.core.metrics import read_jsonl
from rewards.gsm8k import strict_format

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import learning  # noqa: E402


def test_r1_completion_is_the_strict_format_with_the_solution_steps():
    solution = "The apples cost 3 * 4 = <<3*4=12>>12 dollars.\nThe change is 20 - 12 = <<20-12=8>>8 dollars.\n#### 8"
    text = r1_completion(solution)
    assert text == ("<reasoning>\nThe apples cost 3 * 4 = 12 dollars.\nThe change is 20 - 12 = 8 dollars.\n</reasoning>\n"
                    "<answer>\n8\n</answer>")
    assert strict_format(None, [text]) == [0.5]
    assert r1_completion(solution, final_answer="12").endswith("<answer>\n12\n</answer>")
    with pytest.raises(ValueError, match="####"):
        r1_completion("no final line")


def test_problems_carry_their_kind_and_the_standard_rows_are_unchanged():
    rows = make_synthetic_problems(200, seed=5)
    assert {row["kind"] for row in rows} == set(KINDS)
    assert [{"question": r["question"], "answer": r["answer"]} for r in rows] == make_synthetic_gsm8k(200, seed=5)
    easy = make_synthetic_problems(200, seed=5, scale="easy")
    assert max(int(r["answer"].rsplit("####", 1)[1]) for r in easy) <= 25  # 5 x 5
    with pytest.raises(ValueError, match="scale"):
        make_synthetic_problems(1, scale="huge")


def test_the_slip_is_the_last_steps_second_operand_in_the_slip_kinds_only():
    rows = make_synthetic_problems(400, seed=1, scale="easy")
    by_kind = {kind: next(r for r in rows if r["kind"] == kind) for kind in KINDS}
    subtract = by_kind["subtract"]  # "a - b = c": the slip answers b
    given_away = subtract["question"].split("gave away ")[1].split(".")[0]
    assert learning.slipped_answer(subtract) == given_away
    two_step = by_kind["two_step"]  # "20 - cost = change": the slip answers the cost
    cost = two_step["answer"].split(" = <<")[1].split("=")[1].split(">>")[0]
    assert learning.slipped_answer(two_step) == cost
    always = learning.warm_start_completions(rows, slip_rate=1.0, seed=0)
    never = learning.warm_start_completions(rows, slip_rate=0.0, seed=0)
    for row, slipped, right in zip(rows, always, never, strict=True):
        gold = row["answer"].rsplit("####", 1)[1].strip()
        assert right.endswith(f"<answer>\n{gold}\n</answer>")
        expected = learning.slipped_answer(row) if row["kind"] in learning.SLIP_KINDS else gold
        assert slipped.endswith(f"<answer>\n{expected}\n</answer>")
    half = learning.warm_start_completions(rows, slip_rate=0.5, seed=0)
    differing = [i for i in range(len(rows)) if always[i] != never[i]]  # slip kinds whose slip is not the answer
    assert {rows[i]["kind"] for i in differing} == set(learning.SLIP_KINDS)
    share = sum(half[i] == always[i] for i in differing) / len(differing)
    assert 0.38 < share < 0.62  # binomial, ~170 rows: 3.5 standard deviations


def test_heldout_problems_were_not_seen(tmp_path):
    seen = {row["question"] for row in make_synthetic_problems(2000, seed=0, scale="easy")}
    info = learning.make_task(tmp_path, seed=0, num_train=500, num_heldout=100, seen=seen, scale="easy")
    train, heldout = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "test.jsonl")
    assert (info["train"], info["heldout"], len(heldout)) == (500, 100, 100)
    assert not {row["question"] for row in heldout} & (seen | {row["question"] for row in train})
    assert sum(info["heldout_kinds"].values()) == 100


@pytest.mark.slow
def test_the_experiment_runs_end_to_end(tmp_path, capsys):
    # The pipeline at a few steps (the learning itself is measured by the full run, docs/benchmarks.md): the
    # warm start is saved as a model folder, train.py and eval.py run on it, the table and the figure are written.
    out = tmp_path / "learning"
    assert learning.main(["--out", str(out), "--warm-start-steps", "3", "--warm-start-rows", "100", "--grpo-steps", "2",
                          "--prompts-per-step", "2", "--num-generations", "4", "--micro-batch-size", "8",
                          "--heldout", "12", "--train-rows", "40", "--eval-steps", "1",
                          "--max-completion-length", "16"]) == 0
    (result,) = json.loads((out / "results.json").read_text())
    assert (result["seed"], result["loss_type"], result["beta"]) == (0, "grpo", 0.04)
    for side in ("before", "after"):
        assert set(result[side]["strict_by_kind"]) == set(KINDS)
        assert 0.0 <= result[side]["strict_accuracy"] <= 1.0 and result[side]["mean_length"] > 0
    assert result["lift"] == pytest.approx(result["after"]["strict_accuracy"] - result["before"]["strict_accuracy"])
    assert (out / "seed0" / "warm_start" / "model.safetensors").is_file()
    assert (out / "seed0" / "grpo-grpo-beta0.04" / "checkpoints" / "step-000002").is_dir()
    assert (out / "learning.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "$ python train.py --model" in printed and "lift in held-out strict accuracy" in printed


# The reduced experiment: the add and subtract kinds only (subtract slipped), 60 GRPO steps, 100 held-out problems.
# Three seeds of it lifted held-out strict accuracy by 17, 13 and 16 points (0.55 -> 0.72, 0.54 -> 0.67,
# 0.48 -> 0.64; docs/log.md): the test asks for 5, eight points under the lowest seed. A flipped advantage
# sign or a zeroed loss leaves 0 or less (the zeroed loss changes no weight, so exactly 0).
REDUCED = ["--kinds", "add", "subtract", "--grpo-steps", "60", "--heldout", "100", "--train-rows", "600",
           "--eval-steps", "30"]


@pytest.mark.slow
def test_grpo_lifts_heldout_accuracy_of_the_reduced_experiment(tmp_path):
    out = tmp_path / "learning"
    assert learning.main(["--out", str(out), *REDUCED]) == 0
    (result,) = json.loads((out / "results.json").read_text())
    before, after = result["before"], result["after"]
    assert 0.3 <= before["strict_accuracy"] <= 0.8, before  # competent, with room: the slip is there to fix
    assert before["strict_by_kind"]["subtract"] <= 0.2, before  # greedy decoding repeats the slip
    assert before["format_compliance"] >= 0.9 and after["format_compliance"] >= 0.9
    assert result["lift"] >= 0.05, (before, after)
    assert after["strict_by_kind"]["subtract"] >= before["strict_by_kind"]["subtract"] + 0.1, (before, after)
