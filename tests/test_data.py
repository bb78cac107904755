import json

import pytest

from data import (
    DataError,
    SYSTEM_PROMPT,
    add_prompts,
    canonical_number,
    extract_gold_answer,
    extract_last_number,
    load_gsm8k,
    make_synthetic_gsm8k,
)
from tests.conftest import gsm8k_dir


@pytest.mark.parametrize(
    "text, expected",
    [
        ("18", "18"),
        ("18.0", "18"),
        ("$18", "18"),
        ("1,000", "1000"),
        ("$1,000.50", "1000.5"),
        ("-3", "-3"),
        ("0.50", "0.5"),
        (" 42. ", "42"),
        ("-0", "0"),
        ("abc", None),
        ("", None),
        ("1/2", None),
    ],
)
def test_canonical_number(text, expected):
    assert canonical_number(text) == expected


def test_gold_answer_takes_the_last_marker():
    assert extract_gold_answer("a #### 3\nthen #### $1,234") == "1234"
    assert extract_gold_answer("no marker 5") is None


def test_last_number():
    assert extract_last_number("so 3 apples and then $1,200.") == "1200"
    assert extract_last_number("it is -7") == "-7"
    assert extract_last_number("none") is None


@pytest.mark.skipif(gsm8k_dir() is None, reason="../shared/data/gsm8k is not present")
def test_every_shared_gsm8k_answer_parses():
    folder = gsm8k_dir()
    total = 0
    for split in ("train", "test"):
        rows = load_gsm8k(str(folder), split=split)
        for row in rows:
            assert extract_gold_answer(row["answer"]) is not None, row
        total += len(rows)
    assert total == 8792  # 7,473 train + 1,319 test


@pytest.mark.skipif(gsm8k_dir() is None, reason="../shared/data/gsm8k is not present")
def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = load_gsm8k(str(gsm8k_dir() / "test.jsonl"))
    pq.write_table(pa.Table.from_pylist(rows[:200]), tmp_path / "test.parquet")
    assert load_gsm8k(str(tmp_path / "test.parquet")) == rows[:200]
    # The hub's folder layout (main/test-00000-of-00001.parquet) is found by split name.
    (tmp_path / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:10]), tmp_path / "main" / "test-00000-of-00001.parquet")
    assert load_gsm8k(str(tmp_path / "main"), split="test") == rows[:10]


def test_bad_rows_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [
        {"question": "ok?", "answer": "x #### 4"},
        {"question": "bad gold", "answer": "x #### four"},
        {"question": "", "answer": "#### 3"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"bad.jsonl: row 1 .*does not parse"):
        load_gsm8k(str(path))
    kept = load_gsm8k(str(path), skip_bad_rows=True)
    assert kept == rows[:1]


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "cols.jsonl"
    path.write_text(json.dumps({"problem": "q", "answer": "#### 1"}))
    with pytest.raises(DataError, match=r"missing column\(s\) \['question'\].*problem"):
        load_gsm8k(str(path))


def test_invalid_json_line_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl: line 2"):
        load_gsm8k(str(path))


def test_missing_local_path_is_reported():
    with pytest.raises(DataError, match="no such file"):
        load_gsm8k("./does/not/exist.jsonl")


def test_synthetic_is_seeded_and_gsm8k_shaped():
    a, b = make_synthetic_gsm8k(50, seed=3), make_synthetic_gsm8k(50, seed=3)
    assert a == b
    assert a != make_synthetic_gsm8k(50, seed=4)
    for row in a:
        assert set(row) == {"question", "answer"}
        assert extract_gold_answer(row["answer"]) is not None
    assert len(load_gsm8k("synthetic:30")) == 30
    assert load_gsm8k("synthetic:30", split="test") != load_gsm8k("synthetic:30")


def test_prompts_keep_every_column():
    rows = add_prompts([{"question": "Q?", "answer": "#### 1", "difficulty": "easy"}])
    assert rows[0]["difficulty"] == "easy" and rows[0]["answer"] == "#### 1"
    assert rows[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Q?"},
    ]
    assert "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>" in SYSTEM_PROMPT


def test_one_shot_prompts_put_a_worked_example_in_the_format_before_the_question(tmp_path):
    from data import load_task_rows
    from data.prompts import EXAMPLE_QUESTION, EXAMPLE_SOLUTION
    from rewards.gsm8k import correctness, strict_format

    rows = add_prompts([{"question": "Q?", "answer": "#### 1"}], one_shot=True)
    system, example_question, example_answer, question = rows[0]["prompt"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT} and question == {"role": "user", "content": "Q?"}
    assert example_question == {"role": "user", "content": EXAMPLE_QUESTION}
    assert example_answer["role"] == "assistant"
    # The example is itself a completion the recipe's rewards pay in full: the layout, and the right number (72).
    assert strict_format(None, [example_answer["content"]]) == [0.5]
    assert correctness(None, [example_answer["content"]], ["#### 72"]) == [2.0]
    if gsm8k_dir() is not None:  # it is GSM8K's first train problem
        first = json.loads((gsm8k_dir() / "train.jsonl").read_text().splitlines()[0])
        assert (first["question"], first["answer"]) == (EXAMPLE_QUESTION, EXAMPLE_SOLUTION)
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 1"}) + "\n")
    loaded, task = load_task_rows(str(tmp_path), "train", one_shot=True)
    assert task == "gsm8k" and loaded[0]["prompt"] == rows[0]["prompt"]
    assert len(load_task_rows(str(tmp_path), "train")[0][0]["prompt"]) == 2  # off by default
