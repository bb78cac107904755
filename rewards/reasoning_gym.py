"""reasoning-gym's verifiers as a reward: `task_score` (rows from `--dataset reasoning-gym:NAME`,
data/reasoning_gym.py).

    task_score = score_answer(the completion's answer, the row's problem)   in [0, 1]

The answer is the text inside the completion's last <answer>; a row's `answer_extraction` column (set by
--answer-extraction) may add a fallback for completions without the tag: their last number, or their last line.
Each task scores its own way (exact text, numbers with sign and separators tolerated, partial credit for some); a
completion without an answer is scored as the answer None, which most tasks score 0 (a few give 0.01 or so); an answer
the task's verifier
raises on (prime_factorization on a word) scores 0, with one warning per task and error; the score is clipped to
[0, 1]; an answer with "nan" or "inf" in it scores 0 unless the oracle has one (verifiers that compare with a
tolerance can pay them). The verifiers that evaluate answers as code, or pay a constant, are refused when the rows
are made (data/reasoning_gym.verifier_problems). Only the extracted answer is
scored, never the whole completion: a task whose scorer gives partial credit to an answer that contains the oracle
(reasoning-gym's default) would otherwise pay for a completion that lists many candidates.

    task_solved = 1 if task_score == 1 exactly else 0

Partial credit can be climbed without solving anything: reasoning-gym's default verifier pays len(oracle) /
len(answer) to an answer that contains the oracle, so on `letter_counting` (answers 1, 2, 3, ...) the answer "10"
collects half marks whenever the count is 1 or 0, and GRPO on SmolLM2-135M-Instruct drove its greedy answers to
"10" (docs/tasks.md). `task_solved` pays only a solved problem (exactly 1: spell_backward's float sum of ninths
passes 1.0 for a wrong answer with extra words).
"""

from __future__ import annotations

import logging

import re

from data.reasoning_gym import ANSWER_EXTRACTIONS, scorer
from rewards.gsm8k import extract_xml_answer
from rewards.scoring import completion_text

logger = logging.getLogger("grpo.rewards")
# a number as written: sign, thousands separators, decimals, exponent ("1,234", "-0.5", "2.5e3"; not "1,2,3")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\d,])")
# "nan" / "inf": verifiers that compare with a tolerance can pay them (complex_arithmetic: min(1, exp(-nan)) is 1)
_NON_FINITE = re.compile(r"\b(nan|inf|infinity)\b", re.IGNORECASE)


def extract_answer(text: str, extraction: str = "tag") -> str | None:
    """The answer a completion gives, by `--answer-extraction` (data.reasoning_gym.ANSWER_EXTRACTIONS): the text
    inside its last <answer>; failing that, with tag-or-last-number its last number, with tag-or-last-line its last
    non-empty line."""
    tagged = extract_xml_answer(text)
    if tagged or extraction == "tag":  # an empty tag (a stray <answer> at the end) falls back too
        return tagged
    if extraction == "tag-or-last-number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    if extraction == "tag-or-last-line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    raise ValueError(f"unknown answer extraction {extraction!r}; known: {', '.join(ANSWER_EXTRACTIONS)}")


def task_score(prompts, completions, question, answer, metadata, task, task_settings, answer_extraction=None,
               **kwargs) -> list[float]:
    """The task's `score_answer` of the extracted answer, per completion, clipped to [0, 1]; rows carry their task,
    its settings and how to extract the answer."""
    return [min(max(score, 0.0), 1.0) for score in verifier_scores(completions, question, answer, metadata, task,
                                                                   task_settings, answer_extraction)]


def verifier_scores(completions, question, answer, metadata, task, task_settings,
                    answer_extraction=None) -> list[float]:
    """The verifiers' own scores, unclipped (NaN and failures 0)."""
    scores = []
    extractions = answer_extraction or ["tag"] * len(completions)
    for completion, *entry in zip(completions, question, answer, metadata, task, task_settings, extractions,
                                  strict=True):
        row_question, row_answer, row_metadata, name, settings, extraction = entry
        problem = {"question": row_question, "answer": row_answer, "metadata": row_metadata}
        extracted = extract_answer(completion_text(completion), extraction)
        verify = scorer(name, settings)  # outside the try: an unknown task or bad settings stop the step, named
        if extracted and _NON_FINITE.search(extracted) and not _NON_FINITE.search(str(row_answer)):
            scores.append(0.0)
            continue
        try:
            score = float(verify(extracted, problem))
        except Exception as error:  # noqa: BLE001 - a task's verifier that raises on a malformed answer scores it 0
            _warn_once(name, error)
            score = 0.0
        scores.append(score if score == score else 0.0)  # NaN is 0
    return scores


_warned: set[tuple[str, str]] = set()


def _warn_once(name: str, error: Exception) -> None:
    if (name, type(error).__name__) not in _warned:
        _warned.add((name, type(error).__name__))
        logger.warning("reasoning-gym task %s: its score_answer raised %s (%s) on an answer; such answers score 0 "
                       "(said once per task and error)", name, type(error).__name__, error)


def task_solved(prompts, completions, question, answer, metadata, task, task_settings, answer_extraction=None,
                **kwargs) -> list[float]:
    """1.0 when the task's verifier gives the extracted answer exactly full marks, else 0.0: no partial credit to
    climb."""
    return [1.0 if score == 1.0 else 0.0 for score in verifier_scores(completions, question, answer, metadata, task,
                                                                      task_settings, answer_extraction)]


TASK_REWARDS = {"task_score": task_score, "task_solved": task_solved}
