"""Real tasks no one here wrote: reasoning-gym's rows and verifiers, math-verify's answer reward (parity with trl's
accuracy_reward), and pass@k / maj@k at a temperature in eval.py."""

import itertools
import json
import math
import random

import pytest

import eval as eval_cli
from grpo.evaluation.pass_at_k import majority_correct, mean_interval, pass_at_k, summarize_samples

reasoning_gym = pytest.importorskip("reasoning_gym")

from data import DataError, load_task_rows  # noqa: E402
from data.reasoning_gym import task_rows  # noqa: E402
from rewards.reasoning_gym import task_score  # noqa: E402

COLUMNS = ("question", "answer", "metadata", "task", "task_settings")
CHAIN = "reasoning-gym:chain_sum:300"
TWO_TERMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def score(rows, completions):  # as the trainer calls it: every column of the rows
    return task_score(None, completions, **{column: [row[column] for row in rows] for column in rows[0]})


# --------------------------------------------------------------------------------------------- reasoning-gym rows
def test_rows_carry_the_task_settings_and_splits_are_disjoint_and_seeded():
    train = task_rows(CHAIN, "train", TWO_TERMS, seed=3)
    held_out = task_rows(CHAIN, "test", TWO_TERMS, seed=3)
    assert len(train) == 300 and 0 < len(held_out) <= 300
    assert {row["metadata"]["num_terms"] for row in train + held_out} == {2}  # the settings reached the task
    assert not {row["question"] for row in train} & {row["question"] for row in held_out}
    assert train[0]["task"] == "chain_sum" and json.loads(train[0]["task_settings"]) == TWO_TERMS
    assert task_rows(CHAIN, "train", TWO_TERMS, seed=3) == train  # the seed decides the problems
    other = task_rows(CHAIN, "train", TWO_TERMS, seed=4)
    assert [row["question"] for row in other] != [row["question"] for row in train]
    # the held-out split of one seed never holds a train question of that seed, however small the problem space
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    small_train, small_test = task_rows(CHAIN, "train", tiny), task_rows(CHAIN, "test", tiny)
    assert len(small_test) < 300 and not {r["question"] for r in small_train} & {r["question"] for r in small_test}


def test_rows_get_the_chat_prompt_and_bad_names_settings_and_splits_are_named():
    rows, task = load_task_rows("reasoning-gym:gcd:5", "test", system_prompt="SYS", task_settings={"max_value": 50})
    assert task == "reasoning-gym" and len(rows) == 5
    assert rows[0]["prompt"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": rows[0]["question"]}]
    with pytest.raises(DataError, match="no task 'chain_summ'.*did you mean chain_sum"):
        task_rows("reasoning-gym:chain_summ", "train")
    with pytest.raises(DataError, match="refuses --task-settings.*min_terms"):
        task_rows("reasoning-gym:chain_sum:5", "train", {"min_termz": 2})
    with pytest.raises(DataError, match="split 'dev'"):
        task_rows("reasoning-gym:chain_sum:5", "dev")
    with pytest.raises(DataError, match="positive number"):
        task_rows("reasoning-gym:chain_sum:0", "train")
    for bad in ("reasoning-gym:chain_sum:", "reasoning-gym:chain_sum:\u00b2"):
        with pytest.raises(DataError, match="positive number"):
            task_rows(bad, "train")
    with pytest.raises(DataError, match="seed come from --task-seed"):
        task_rows("reasoning-gym:chain_sum:5", "train", {"seed": 3})
    with pytest.raises(DataError, match="refuses --task-settings"):  # passes the config, fails drawing a problem
        task_rows("reasoning-gym:chain_sum:5", "train", {"min_terms": 2.5, "max_terms": 3.5})
    with pytest.raises(DataError, match="'composite' refuses"):  # its settings are objects JSON cannot give
        task_rows("reasoning-gym:composite:5", "train", {"datasets": [{"name": "chain_sum", "weight": 1}]})
    with pytest.raises(DataError, match="every held-out problem is also a train problem"):
        task_rows("reasoning-gym:chain_sum:3000", "test", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})


def test_config_checks_the_task_before_any_model_loads():
    from grpo.config import GRPOConfig

    base = dict(dataset="reasoning-gym:chain_sum", reward=["task_score"])
    assert GRPOConfig(**base, task_settings=TWO_TERMS).validate().task_settings == TWO_TERMS
    with pytest.raises(ValueError, match="refuses --task-settings"):
        GRPOConfig(**base, task_settings={"max_termz": 3}).validate()
    with pytest.raises(ValueError, match="--reward task_score"):  # GSM8K's correctness would score nothing
        GRPOConfig(dataset="reasoning-gym:chain_sum", reward=["correctness", "int"]).validate()
    with pytest.raises(ValueError, match="--task-settings is for a reasoning-gym dataset"):
        GRPOConfig(dataset="synthetic", task_settings={"a": 1}).validate()
    with pytest.raises(ValueError, match=r"task_settings must be a mapping of names to values \(a JSON object\)"):
        GRPOConfig(**base, task_settings=[1]).validate()
    with pytest.raises(ValueError, match="refuses --task-settings"):
        eval_cli.EvalConfig(dataset="reasoning-gym:gcd", reward=["task_score"], task_settings={"x": 1}).validate()


# ------------------------------------------------------------------------------------------- the task_score reward
def test_task_score_scores_only_the_tagged_answer():
    rows = task_rows("reasoning-gym:chain_sum:4", "train", TWO_TERMS)
    right = [f"<reasoning>\nadd\n</reasoning>\n<answer>\n{row['answer']}\n</answer>" for row in rows]
    assert score(rows, right) == [1.0] * 4
    assert score(rows, [f"<answer>{int(row['answer']) + 1}</answer>" for row in rows]) == [0.0] * 4
    assert score(rows, [f"the answer is {row['answer']}" for row in rows]) == [0.0] * 4  # no tag: no answer
    # the last <answer> counts, not an earlier one
    assert score(rows, [f"<answer>{row['answer']}</answer> no, <answer>1000</answer>" for row in rows]) == [0.0] * 4


def test_a_partial_credit_verifier_cannot_be_paid_by_listing_candidates():
    rows = task_rows("reasoning-gym:spell_backward:4", "train")  # default score_answer: credit for containing it
    listing = ["<answer>" + " ".join(["zzz", row["answer"], "qqq"] * 5) + "</answer>" for row in rows]
    assert max(score(rows, listing)) < 0.2
    assert score(rows, [f"<answer>{row['answer']}</answer>" for row in rows]) == [1.0] * 4


def test_task_solved_pays_full_marks_only():
    from rewards.reasoning_gym import task_solved

    rows = [row for row in task_rows("reasoning-gym:letter_counting:60", "train") if row["answer"] == "1"][:3]
    columns = {column: [row[column] for row in rows] for column in COLUMNS}
    climbing = ["The letter appears <answer>10</answer> times"] * 3  # contains the oracle "1": half marks
    assert task_score(None, climbing, **columns) == [0.5] * 3
    assert task_solved(None, climbing, **columns) == [0.0] * 3
    assert task_solved(None, ["<answer>1</answer>"] * 3, **columns) == [1.0] * 3


def test_answer_extraction_falls_back_only_where_asked():
    from rewards.reasoning_gym import extract_answer

    text = "21 + 4 = 25\nSo the sum is 25."
    assert extract_answer(text, "tag") is None
    assert extract_answer(text, "tag-or-last-number") == "25"
    assert extract_answer(text, "tag-or-last-line") == "So the sum is 25."
    assert extract_answer("I think 3. <answer>4</answer> or 5", "tag-or-last-number") == "4"  # the tag comes first
    assert extract_answer("1,234 apples", "tag-or-last-number") == "1234"
    assert extract_answer("no digits", "tag-or-last-number") is None and extract_answer("", "tag-or-last-line") is None
    assert extract_answer("the list 1,2,3", "tag-or-last-number") == "3"
    assert extract_answer("about 2.5e3 pages", "tag-or-last-number") == "2.5e3"
    assert extract_answer("The answer is 42 <answer>", "tag-or-last-number") == "42"  # an empty tag falls back
    rows = task_rows("reasoning-gym:chain_sum:3", "train", TWO_TERMS, answer_extraction="tag-or-last-number")
    assert score(rows, [f"so it is {row['answer']}" for row in rows]) == [1.0] * 3
    with pytest.raises(DataError, match="answer extraction 'last'"):
        task_rows("reasoning-gym:chain_sum:3", "train", answer_extraction="last")


def test_a_verifier_that_raises_on_a_malformed_answer_scores_it_zero(caplog):
    rows = task_rows("reasoning-gym:prime_factorization:3", "train")
    assert score(rows, ["<answer>two times three</answer>"] * 3) == [0.0] * 3  # its int() raises; the step goes on
    assert "score_answer raised ValueError" in caplog.text
    assert score(rows, [f"<answer>{row['answer']}</answer>" for row in rows]) == [1.0] * 3


@pytest.mark.parametrize("seed", [0, 1])
def test_tasks_no_test_names_generate_rows_that_their_oracle_answer_wins(seed):
    """A random draw of reasoning-gym's tasks (default settings): rows generate, the oracle answer in tags scores 1
    and a wrong one less, through the same path as the benchmark's tasks; a task refused for its verifier is refused
    with the reason and the way out, and loads with it."""
    from reasoning_gym.factory import DATASETS

    # tasks whose oracle `answer` is None (many answers are right; the verifier checks them), that need settings the
    # JSON cannot give, or that take seconds a problem
    skip = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour", "composite", "knight_swap",
            "futoshiki", "arc_agi", "rearc", "codeio"}
    names = random.Random(seed).sample(sorted(set(DATASETS) - skip), 6)
    for name in names:
        try:
            rows = task_rows(f"reasoning-gym:{name}:3", "train", seed=seed)
        except DataError as error:
            assert "--trust-task-verifier" in str(error), name
            rows = task_rows(f"reasoning-gym:{name}:3", "train", seed=seed, trust_verifier=True)
        assert score(rows, [f"<answer>{row['answer']}</answer>" for row in rows]) == [1.0] * 3, name
        assert max(score(rows, ["<answer>\u2603 not it</answer>"] * 3)) < 1.0, name


def test_verifiers_that_run_answers_as_code_or_pay_a_constant_are_refused():
    from data.reasoning_gym import evaluates_answers, verifier_problems
    from grpo.config import GRPOConfig
    from reasoning_gym.factory import DATASETS

    for name in ("countdown", "puzzle24", "n_queens", "binary_matrix", "bitwise_arithmetic"):  # eval / sympy
        assert evaluates_answers(DATASETS[name][0]), name
    for name in ("chain_sum", "letter_counting", "gcd", "basic_arithmetic", "spell_backward"):
        assert not evaluates_answers(DATASETS[name][0]) and verifier_problems(name, None) == [], name
    for name, constant in [("game_of_life_halting", "'0'"), ("coin_flip", "'0'"), ("complex_arithmetic", "'nan'")]:
        (problem,) = verifier_problems(name, None)
        assert f"constant answer {constant}" in problem, (name, problem)
    with pytest.raises(ValueError, match="evaluates the answer as code.*--trust-task-verifier"):
        GRPOConfig(dataset="reasoning-gym:countdown", reward=["task_score"]).validate()
    with pytest.raises(DataError, match="evaluates the answer as code"):
        task_rows("reasoning-gym:countdown:3", "train")
    # the payload the refusal keeps out of the training process
    trusted = task_rows("reasoning-gym:countdown:2", "train", trust_verifier=True)
    assert GRPOConfig(dataset="reasoning-gym:countdown", reward=["task_score"], trust_task_verifier=True).validate()
    assert score(trusted, ["<answer>" + row["answer"] + "</answer>" for row in trusted]) == [1.0, 1.0]


def test_non_finite_answers_and_float_overshoot_earn_nothing():
    from rewards.reasoning_gym import task_solved

    rows = task_rows("reasoning-gym:complex_arithmetic:3", "train", trust_verifier=True)
    assert score(rows, ["<answer>nan</answer>", "<answer>inf</answer>", "<answer>NaN + nan i</answer>"]) == [0.0] * 3
    words = [row for row in task_rows("reasoning-gym:spell_backward:200", "train") if len(row["answer"]) == 9][:2]
    overshoot = [f"<answer>{row['answer']} is my guess, or maybe not</answer>" for row in words]
    columns = {column: [row[column] for row in words] for column in words[0]}
    assert all(value <= 1.0 for value in task_score(None, overshoot, **columns))  # clipped
    assert task_solved(None, overshoot, **columns) == [0.0, 0.0]  # the verifier's 1.0000000000000002 is not solved
    assert task_solved(None, [f"<answer>{r['answer']}</answer>" for r in words], **columns) == [1.0, 1.0]


def test_a_row_naming_an_unknown_task_stops_the_step_instead_of_scoring_zero():
    rows = task_rows("reasoning-gym:chain_sum:2", "train")
    broken = [{**row, "task": "chainsum"} for row in rows]
    with pytest.raises(DataError, match="no task 'chainsum'"):
        score(broken, ["<answer>1</answer>"] * 2)


# ---------------------------------------------------------------------------------- math-verify: trl's semantics
ANSWERS = [  # (completion, solution)
    (r"My answer is \boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"My answer is \boxed{\frac{1}{2}}", r"\frac{1}{3}"),
    (r"so $x = 0.5$", "1/2"),
    (r"\boxed{2} and later \boxed{3}", "3"),  # the boxed answer tried first, first match
    ("The answer is 42", "42"),  # no LaTeX anchor: not an answer
    (r"$\boxed{42}$", "42"),
    (r"\boxed{10\%}", "0.1"),
    (r"The final answer is $\frac{\sqrt{8}}{2}$", r"\sqrt{2}"),
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2"),
    (r"\boxed{5 \text{ meters}}", "5"),  # units normalised
    (r"\boxed{(1, 2)}", "(1,2)"),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}"),
    ("no math here", "7"),
    (r"\boxed{7}", "not a number at all"),  # the gold does not parse: None
    (r"\boxed{7}", ""),
    (r"$\boxed{\infty}$", r"\infty"),
    (r"\boxed{-3}", "-3"),
    (r"\boxed{3}", "-3"),
    (r"\boxed{42}", 42),  # a gold that is not text does not parse, as in trl
]


def test_accuracy_reward_matches_trl_on_a_set_of_answers():
    pytest.importorskip("math_verify")
    trl_rewards = pytest.importorskip("trl.rewards")
    from rewards.math_answers import accuracy_reward

    completions = [[{"role": "assistant", "content": text}] for text, _ in ANSWERS]
    solutions = [solution for _, solution in ANSWERS]
    ours = accuracy_reward(prompts=None, completions=completions, solution=solutions)
    theirs = trl_rewards.accuracy_reward(completions=completions, solution=solutions)
    assert ours == theirs
    assert ours[0] == 1.0 and ours[1] == 0.0 and ours[4] == 0.0 and ours[13] is None  # the cases cover each outcome
    # plain-string completions (our other completion shape) score as their message form does
    assert accuracy_reward(completions=[text for text, _ in ANSWERS], solution=solutions) == theirs
    with pytest.raises(ValueError, match="needs a `solution` column"):
        accuracy_reward(completions=completions[:1], answer=["1/3"])


def test_accuracy_reward_is_registered_under_trls_name():
    from rewards import parse_reward_specs

    assert parse_reward_specs(["accuracy_reward:2"])[0].weight == 2.0


# ---------------------------------------------------------------------------------------------------- pass@k
def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                formula = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(formula, abs=1e-12)
    # as a mean over every k-subset of the samples: the definition the estimator is unbiased for
    correct = [True, False, False, True, False, False]
    for k in range(1, 7):
        subsets = list(itertools.combinations(correct, k))
        assert pass_at_k(6, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-9)
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_majority_vote_ties_share_credit_and_no_answer_scores_zero():
    assert majority_correct(["7", "7", "8"], [True, True, False]) == 1.0
    assert majority_correct(["8", "7", "8"], [False, True, False]) == 0.0
    assert majority_correct(["7", "8", None, None], [True, False, False, False]) == 0.5  # tie; None casts no vote
    assert majority_correct([None, None], [False, False]) == 0.0
    # one answer scored both ways (a correctness key that also scores something else): no order decides it
    assert majority_correct(["x", "x"], [False, True]) == majority_correct(["x", "x"], [True, False]) == 0.5
    with pytest.raises(ValueError, match="at least one problem"):
        summarize_samples([], [])


def test_mean_interval_and_summary():
    values = [1.0] * 3 + [0.0] * 7
    interval = mean_interval(values)
    half = 1.96 * math.sqrt(sum((v - 0.3) ** 2 for v in values) / 9 / 10)  # 1.96 standard errors of the mean
    assert interval == pytest.approx({"mean": 0.3, "low": 0.3 - half, "high": 0.3 + half})
    assert mean_interval([1.0, 0.0, 1.0, 0.0])["low"] == 0.0  # clipped to [0, 1]
    assert mean_interval([1.0]) == {"mean": 1.0, "low": 1.0, "high": 1.0}
    summary = summarize_samples([[True, False, False, False], [False, False, False, False]],
                                [["1", "2", "2", None], [None] * 4])
    assert summary["pass@1"]["mean"] == pytest.approx(0.125) and summary["pass@4"]["mean"] == 0.5
    assert summary["maj@4"]["mean"] == 0.0  # "2" wins the first problem's vote, and it is wrong


def test_eval_reports_pass_at_k_and_maj_at_k_beside_the_unchanged_greedy_scores(tmp_path, capsys):
    common = ["--model", "tiny", "--dataset", "reasoning-gym:basic_arithmetic:6", "--reward", "task_score",
              "--max-completion-length", "6", "--batch-size", "8", "--device", "cpu", "--output-dir", str(tmp_path)]
    assert eval_cli.main(common) == 0
    greedy = json.loads((tmp_path / "tiny.summary.json").read_text())
    assert eval_cli.main(common + ["--num-samples", "4", "--temperature", "1.5", "--seed", "1"]) == 0
    summary = json.loads((tmp_path / "tiny.summary.json").read_text())
    assert {k: v for k, v in summary.items() if k != "sampling"} == greedy  # greedy stays as it is
    sampling = summary["sampling"]
    assert sampling["num_samples"] == 4 and sampling["pass_key"] == "rewards/task_score"
    assert [f"pass@{k}" for k in range(1, 5)] + ["maj@4"] == [k for k in sampling if k[:5] in ("pass@", "maj@4")]
    records = [json.loads(line) for line in (tmp_path / "tiny.pass_at_k.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(len(r["completions"]) == 4 for r in records)
    assert sampling["pass@1"]["mean"] == pytest.approx(sum(r["num_correct"] for r in records) / 24)
    assert all(r["correct"] == [s["rewards/task_score"] >= 1.0 for s in r["scores"]] for r in records)
    assert "pass@4" in capsys.readouterr().out
    assert eval_cli.main(common + ["--num-samples", "2", "--pass-key", "nope"]) == 1
    assert "--pass-key 'nope' is not a score" in capsys.readouterr().err
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        eval_cli.EvalConfig(num_samples=2, temperature=0.0).validate()


def test_pass_at_k_counts_what_the_scorer_says_is_correct(tmp_path):
    """Scores planted through a custom scorer: pass@k and maj@k follow from them by the formula."""
    scorer = tmp_path / "plant.py"
    scorer.write_text("def score(completion, row):\n    return {'ok': float(len(completion) % 2 == 0)}\n")
    out = tmp_path / "out"
    assert eval_cli.main(["--model", "tiny", "--dataset", "synthetic:5", "--scorer", f"{scorer}:score",
                          "--pass-key", "ok", "--num-samples", "3", "--max-completion-length", "5", "--device", "cpu",
                          "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "tiny.pass_at_k.jsonl").read_text().splitlines()]
    sampling = json.loads((out / "tiny.summary.json").read_text())["sampling"]
    for k in (1, 2, 3):
        expected = sum(pass_at_k(3, sum(len(t) % 2 == 0 for t in r["completions"]), k) for r in records) / 5
        assert sampling[f"pass@{k}"]["mean"] == pytest.approx(expected)
