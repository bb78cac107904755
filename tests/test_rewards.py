import math

import pytest

from rewards import (
    RewardError,
    correctness,
    int_answer,
    parse_reward_specs,
    score_completions,
    soft_format,
    strict_format,
    xmlcount,
)
from rewards.toy import tags

GOOD = "<reasoning>\nline one\nline two\n</reasoning>\n<answer>\n18\n</answer>"


def chat(text):
    return [{"role": "assistant", "content": text}]


def one(fn, text, **columns):
    return fn(prompts=[None], completions=[chat(text)], **{k: [v] for k, v in columns.items()})[0]


@pytest.mark.parametrize(
    "answer_text, gold, expected",
    [
        ("18", "#### 18", 2.0),
        ("18.0", "#### 18", 2.0),  # numbers, not strings
        ("$18", "x\n#### 18", 2.0),
        ("1,000", "#### 1000", 2.0),
        ("$1,000", "#### 1,000", 2.0),
        ("-5", "#### -5", 2.0),
        ("17", "#### 18", 0.0),
        ("eighteen", "#### 18", 0.0),
        ("18", "18", 2.0),  # a bare-number gold column works too
    ],
)
def test_correctness(answer_text, gold, expected):
    text = f"<reasoning>\nr\n</reasoning>\n<answer>\n{answer_text}\n</answer>"
    assert one(correctness, text, answer=gold) == expected


def test_correctness_needs_an_answer_tag_and_takes_the_last():
    assert one(correctness, "18", answer="#### 18") == 0.0  # no <answer>: not scored as correct
    assert one(correctness, "", answer="#### 18") == 0.0  # empty completion
    # Duplicated tags: the last <answer> is the answer.
    assert one(correctness, "<answer>3</answer> then <answer>18</answer>", answer="#### 18") == 2.0
    # Plain strings work as completions too.
    assert correctness(prompts=[None], completions=[GOOD], answer=["#### 18"]) == [2.0]


@pytest.mark.parametrize(
    "answer_text, expected",
    [("18", 0.5), ("-3", 0.5), ("18.0", 0.5), ("1,000", 0.5), ("2.5", 0.0), ("x", 0.0)],
)
def test_int(answer_text, expected):
    assert one(int_answer, f"<answer>\n{answer_text}\n</answer>") == expected


def test_int_without_answer_tag_is_zero():
    assert one(int_answer, "18") == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD, 0.5),  # multi-line reasoning: the copied regex (no DOTALL) gives 0 here
        (GOOD + "\n", 0.5),  # one final newline allowed
        (GOOD + "\nextra", 0.0),  # trailing text
        ("<reasoning>\nr\n</reasoning><answer>\n1\n</answer>", 0.0),  # missing newline between blocks
        ("<reasoning>\nr\n</reasoning>\n<answer>\n1\n</answer>\n<answer>\n2\n</answer>", 0.0),  # duplicated tag
        ("<answer>\n1\n</answer>", 0.0),  # missing reasoning
        ("", 0.0),
    ],
)
def test_strict_format(text, expected):
    assert one(strict_format, text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD, 0.5),
        ("<reasoning>a\nb</reasoning> <answer>1</answer>", 0.5),  # multi-line, no newlines around tags
        ("intro <reasoning>a</reasoning>\n\n<answer>1</answer> outro", 0.5),
        ("<answer>1</answer><reasoning>a</reasoning>", 0.0),  # wrong order
        ("<reasoning>a</reasoning>", 0.0),  # missing answer
        ("", 0.0),
    ],
)
def test_soft_format(text, expected):
    assert one(soft_format, text) == expected


def test_xmlcount_hand_derived():
    # Four tags each on its own line: 4 * 0.125 = 0.5, nothing after </answer>.
    assert one(xmlcount, GOOD) == pytest.approx(0.5)
    # A final newline is free.
    assert one(xmlcount, GOOD + "\n") == pytest.approx(0.5)
    # "\nabc" after </answer>: the newline is free, 3 characters cost 0.003 -> 0.497.
    assert one(xmlcount, GOOD + "\nabc") == pytest.approx(0.497)
    # Only the reasoning pair: 0.25.
    assert one(xmlcount, "<reasoning>\nx\n</reasoning>\n") == pytest.approx(0.25)
    # Duplicated <reasoning>\n: that tag does not count -> 0.375.
    assert one(xmlcount, "<reasoning>\n<reasoning>\nx\n</reasoning>\n<answer>\n1\n</answer>") == pytest.approx(0.375)
    assert one(xmlcount, "") == 0.0


def test_toy_tags_reward():
    assert one(tags, "") == 0.0
    assert one(tags, "<answer><answer>") == 0.25  # two tags * 0.125
    assert one(tags, "<answer>" * 20) == 1.0  # capped at eight tags


def test_parse_reward_specs():
    specs = parse_reward_specs(["correctness:2", "int", xmlcount])
    assert [(s.name, s.weight) for s in specs] == [("correctness", 2.0), ("int", 1.0), ("xmlcount", 1.0)]
    with pytest.raises(ValueError, match="unknown reward 'corectness'.*correctness"):
        parse_reward_specs(["corectness"])
    with pytest.raises(ValueError, match="weight 'x' is not a number"):
        parse_reward_specs(["int:x"])
    with pytest.raises(ValueError, match="given twice"):
        parse_reward_specs(["int", "int:2"])


def test_score_completions_matrix_and_none():
    def sometimes_none(prompts, completions, **kw):
        return [None if i == 1 else 1.0 for i in range(len(completions))]

    specs = parse_reward_specs(["int", sometimes_none])
    rewards = score_completions(specs, [None] * 2, [chat("<answer>3</answer>"), chat("x")], {})
    assert rewards.shape == (2, 2)
    assert rewards[0].tolist() == [0.5, 1.0]
    assert rewards[1, 0] == 0.0 and math.isnan(rewards[1, 1])


def test_reward_that_raises_names_function_and_row():
    def fragile(prompts, completions, **kw):
        for c in completions:
            if "boom" in c:
                raise KeyError("boom")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward 'fragile' raised KeyError on row 2"):
        score_completions(parse_reward_specs([fragile]), [None] * 3, ["a", "b", "boom"], {})


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, float("nan")], "returned nan, not a finite fp32 number, for row 1"),
        ([float("inf"), 1.0], "returned inf, not a finite fp32 number, for row 0"),
        ([1e39, 1.0], "returned 1e\\+39, not a finite fp32 number, for row 0"),
        (["1", 1.0], "returned '1' \\(str\\) for row 0"),
        (1.0, "returned float, expected a list"),
        ("ab", "returned str, expected a list"),
        ([[1.0], 2.0], "returned \\[1.0\\] \\(list\\) for row 0"),
    ],
)
def test_bad_reward_outputs_are_named(returned, message):
    def bad(prompts, completions, **kw):
        return returned

    with pytest.raises(RewardError, match=f"reward 'bad' {message}"):
        score_completions(parse_reward_specs([bad]), [None] * 2, ["a", "b"], {})


def test_columns_reach_the_reward_functions():
    seen = {}

    def spy(prompts, completions, answer, level, **kw):
        seen.update(answer=answer, level=level)
        return [0.0] * len(completions)

    score_completions(parse_reward_specs([spy]), [None] * 2, ["a", "b"], {"answer": ["1", "2"], "level": [1, 2]})
    assert seen == {"answer": ["1", "2"], "level": [1, 2]}


def test_rewards_in_the_shapes_trl_accepts():
    import numpy as np
    import torch

    shapes = [(0.5, True), np.array([0.5, 1.0], dtype=np.float32), torch.tensor([0.5, 1.0]),
              [np.float32(0.5), torch.tensor(1.0)], [np.int64(0), 1]]
    for returned in shapes:
        def fn(prompts, completions, returned=returned, **kw):
            return returned

        rewards = score_completions(parse_reward_specs([fn]), [None] * 2, ["a", "b"], {})
        assert rewards.shape == (2, 1) and torch.isfinite(rewards).all(), returned


def test_overlong_penalty_hand_derived():
    from rewards.shaping import overlong_penalty

    # Budget 10, buffer 4: lengths up to 6 free, then -factor * (len - 6) / 4 up to -factor at 10.
    reward = overlong_penalty(10, 4, factor=2.0)
    ids = [[1] * n for n in (1, 6, 7, 8, 10)]
    assert reward(None, None, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -2.0]
    with pytest.raises(ValueError, match="buffer_len must be in"):
        overlong_penalty(10, 10)


# ----------------------------------------------------------------------------- rewards/scoring.py, part by part
def test_completion_text_reads_both_of_trls_shapes_and_refuses_others():
    from rewards.scoring import completion_text

    turns = [{"role": "assistant", "content": "first"}, {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "last"}]
    assert completion_text("plain") == "plain"
    assert completion_text(turns) == "last"  # the last turn, not the first
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text({"role": "assistant", "content": "one"}) == "one"
    assert completion_text({"role": "assistant", "content": None}) == ""
    assert completion_text({"role": "assistant"}) == ""
    for bad in ([], ["not a message"], [{"role": "assistant", "content": "a"}, "b"], 3, None, ("a",)):
        with pytest.raises(TypeError, match="a completion must be a string or a list of chat messages"):
            completion_text(bad)


def test_a_reward_spec_is_immutable():
    import dataclasses

    spec = parse_reward_specs(["int"])[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.weight = 5.0


def test_values_at_the_edges_of_what_is_accepted():
    from rewards.scoring import FLOAT32_MAX

    def fn(prompts, completions, **kw):
        return [None, FLOAT32_MAX, None, -FLOAT32_MAX]

    rewards = score_completions(parse_reward_specs([fn]), [None] * 4, ["a", "b", "c", "d"], {})
    assert torch_nan_pattern(rewards[:, 0]) == [True, False, True, False]  # None anywhere, not only last
    assert rewards[1, 0].item() == FLOAT32_MAX and rewards[3, 0].item() == -FLOAT32_MAX

    class LengthOnly:  # has a length, but cannot be iterated
        def __len__(self):
            return 4

    for returned, kind in ((LengthOnly(), "LengthOnly"), ((x for x in [1.0] * 4), "generator"), ({"a": 1.0}, "dict")):
        def bad(prompts, completions, returned=returned, **kw):
            return returned

        with pytest.raises(RewardError, match=f"reward 'bad' returned {kind}, expected a list of 4 floats"):
            score_completions(parse_reward_specs([bad]), [None] * 4, ["a", "b", "c", "d"], {})


def torch_nan_pattern(values) -> list[bool]:
    return [math.isnan(v) for v in values.tolist()]


def test_a_batch_that_raises_is_scored_row_by_row_with_each_rows_own_inputs():
    """A function that fails on the batch is called once per row, with that row's prompt, completion and
    columns (lists of one); a row whose reader is gone (Unscorable) scores None and the others their value."""
    from rewards.scoring import Unscorable

    calls = []

    def per_row(prompts, completions, answer, **kw):
        calls.append((list(prompts), list(completions), list(answer)))
        if len(completions) > 1:
            raise Unscorable("the environment of row 1 stopped")
        assert len(prompts) == len(answer) == 1
        if completions[0] == "gone":
            raise Unscorable("stopped")
        return [len(prompts[0]) * 10.0 + float(answer[0])]

    rewards = score_completions(parse_reward_specs([per_row]), ["p", "pp", "ppp"], ["a", "gone", "c"],
                                {"answer": ["1", "2", "3"]})
    assert torch_nan_pattern(rewards[:, 0]) == [False, True, False]
    assert rewards[0, 0].item() == 11.0 and rewards[2, 0].item() == 33.0
    assert calls[1:] == [(["p"], ["a"], ["1"]), (["pp"], ["gone"], ["2"]), (["ppp"], ["c"], ["3"])]

    def always_fails(prompts, completions, **kw):
        raise ValueError("broken")  # fails on every row alike: the batch's error is the one reported

    with pytest.raises(RewardError, match=r"reward 'always_fails' raised ValueError on row 0: broken"):
        score_completions(parse_reward_specs([always_fails]), [None] * 2, ["a", "b"], {})

    def fails_only_together(prompts, completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("batch only")
        return [1.0]

    with pytest.raises(RewardError, match=r"reward 'fails_only_together' raised RuntimeError on the batch: batch only"):
        score_completions(parse_reward_specs([fails_only_together]), [None] * 2, ["a", "b"], {})


def test_a_column_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match=r"column 'answer' has 1 values for 2 completions"):
        score_completions(parse_reward_specs(["int"]), [None] * 2, ["a", "b"], {"answer": ["1"]})


@pytest.mark.parametrize("shape", ["plain", "chat", "chat with turns"])
def test_score_rows_passes_trls_arguments(shape):
    """score_rows as the trainer calls it: the prompt column becomes `prompts`, every other column and
    completion_ids arrive as keyword lists, one value per completion, plain prompts get plain completions and
    chat prompts chat messages; group_size defaults to one completion per row."""
    from rewards.scoring import score_rows

    seen = {}

    def spy(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions, **kw)
        return [float(i) for i in range(len(completions))]

    prompt = "Q?" if shape == "plain" else [{"role": "user", "content": "Q?"}]
    rows = [{"prompt": prompt, "answer": "4", "level": 1}]
    turns = [[{"role": "assistant", "content": "call"}, {"role": "tool", "content": "4"},
              {"role": "assistant", "content": "<answer>4</answer>"}]]
    rewards = score_rows(parse_reward_specs([spy]), rows, ["<answer>4</answer>"], [[7, 8]],
                         messages=turns if shape == "chat with turns" else None, extra_columns={"environments": ["env"]})
    assert rewards.tolist() == [[0.0]]
    assert seen["prompts"] == [prompt] and "prompt" not in seen
    assert seen["answer"] == ["4"] and seen["level"] == [1] and seen["completion_ids"] == [[7, 8]]
    assert seen["environments"] == ["env"]
    expected = {"plain": ["<answer>4</answer>"], "chat": [[{"role": "assistant", "content": "<answer>4</answer>"}]],
                "chat with turns": turns}[shape]
    assert seen["completions"] == expected
    grouped = score_rows(parse_reward_specs([spy]), rows * 2, ["a", "b", "c", "d"], [[1]] * 4, group_size=2)
    assert grouped.shape == (4, 1) and seen["answer"] == ["4"] * 4 and seen["prompts"] == [prompt] * 4
    own = score_rows(parse_reward_specs([spy]), rows, ["a"], [[1]], prompts=["own prompt"])
    assert own.shape == (1, 1) and seen["prompts"] == ["own prompt"]


def test_correctness_refuses_an_answer_column_of_another_length():
    """A dataset column that does not line up with the completions is a bug upstream, not rows to drop."""
    with pytest.raises(ValueError):
        correctness(prompts=[None] * 2, completions=[chat("<answer>1</answer>")] * 2, answer=["1"])
    assert correctness(prompts=[None] * 2, completions=[chat("<answer>1</answer>"), chat("x")],
                       answer=["1", "1"]) == [2.0, 0.0]
