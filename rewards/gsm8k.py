"""The five GSM8K rewards of the classic Qwen2.5-0.5B GRPO recipe, same names and scales, bugs fixed.

| name           | value | when                                                              |
|----------------|-------|-------------------------------------------------------------------|
| correctness    | 2.0   | the number inside <answer> equals the gold number                 |
| int            | 0.5   | the number inside <answer> is an integer                          |
| strict_format  | 0.5   | exactly <reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n? |
| soft_format    | 0.5   | <reasoning>...</reasoning> then <answer>...</answer>, any spacing |
| xmlcount       | <=0.5 | 0.125 per tag on its own line, -0.001 per character after </answer>|

Deviations from the widely copied versions (each is a bug there):
- soft_format/strict_format: the copied regexes lack re.DOTALL, so `.` never crosses a newline and
  multi-line reasoning never matches. Ours use DOTALL.
- correctness: compares canonical numbers, not strings: "18", "18.0", "$18" and "18." all equal
  gold "18"; "1,000" equals "1000".
- int: accepts negative integers (the copied `str.isdigit` rejects "-3") and values like "18.0".
- xmlcount: the text after </answer> is charged once, and a completion ending at `\n</answer>`
  is not charged its whole length (see count_xml).
"""

from __future__ import annotations

import re

from data.answers import canonical_number, gold_from_column
from rewards.scoring import completion_text

# One block of content that holds no tag of ours, so a duplicated tag cannot hide inside `.*?`.
_NO_TAG = r"(?:(?!</?(?:reasoning|answer)>).)*?"
_STRICT_RE = re.compile(rf"<reasoning>\n{_NO_TAG}\n</reasoning>\n<answer>\n{_NO_TAG}\n</answer>\n?", re.DOTALL)
_SOFT_RE = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)


def extract_xml_answer(text: str) -> str | None:
    """The text inside the last <answer> (up to </answer> or the end), stripped; None without <answer>."""
    if "<answer>" not in text:
        return None
    return text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0].strip()


def _answers(completions) -> list[str | None]:
    return [extract_xml_answer(completion_text(c)) for c in completions]


def correctness(prompts, completions, answer, **kwargs) -> list[float]:
    """2.0 when the number inside <answer> equals the gold answer (numbers compared canonically), else 0."""
    rewards = []
    for extracted, gold in zip(_answers(completions), answer, strict=True):
        gold_number = gold_from_column(None if gold is None else str(gold))
        ok = extracted is not None and gold_number is not None and canonical_number(extracted) == gold_number
        rewards.append(2.0 if ok else 0.0)
    return rewards


def int_answer(prompts, completions, **kwargs) -> list[float]:
    """0.5 when the number inside <answer> is an integer (negative ones too), else 0."""
    rewards = []
    for extracted in _answers(completions):
        number = canonical_number(extracted)
        rewards.append(0.5 if number is not None and "." not in number else 0.0)
    return rewards


def strict_format(prompts, completions, **kwargs) -> list[float]:
    """0.5 for exactly `<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>` (one optional final newline)."""
    return [0.5 if _STRICT_RE.fullmatch(completion_text(c)) else 0.0 for c in completions]


def soft_format(prompts, completions, **kwargs) -> list[float]:
    """0.5 when a <reasoning>...</reasoning> pair is followed by an <answer>...</answer> pair, anywhere."""
    return [0.5 if _SOFT_RE.search(completion_text(c)) else 0.0 for c in completions]


def count_xml(text: str) -> float:
    """0.125 per tag on its own line, minus 0.001 per character after the last </answer> (a newline is free).

    The copied version charges the trailing text twice, and when the text ends right after
    `\n</answer>` (no final newline, the usual case at EOS) it charges the whole completion.
    Ours charges the text after </answer> once.
    """
    score = 0.0
    if text.count("<reasoning>\n") == 1:
        score += 0.125
    if text.count("\n</reasoning>\n") == 1:
        score += 0.125
    if text.count("\n<answer>\n") == 1:
        score += 0.125
    if text.count("\n</answer>") == 1:
        score += 0.125
        trailing = text.rsplit("\n</answer>", 1)[1]
        score -= len(trailing.removeprefix("\n")) * 0.001
    return score


def xmlcount(prompts, completions, **kwargs) -> list[float]:
    """The recipe's `count_xml` shaping reward: at most 0.5, less for text after </answer>."""
    return [count_xml(completion_text(c)) for c in completions]


GSM8K_REWARDS = {
    "correctness": correctness,
    "int": int_answer,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xmlcount": xmlcount,
}
