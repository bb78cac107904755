"""Guards against learning the prior: what the policy answers, beside what the problems' answers are.

A policy can raise its reward without learning the task by giving one answer to every question: on a task
whose most common answer is "1" (letter_counting), answering "1" always scores that answer's share. These
checks say when that is happening.

Training (each step, over every rank's completions; `answer_metrics`):
    answers/distinct_share     mean over groups of (distinct answers in the group) / G: near 1/G, the group
                               gives one answer whatever it samples
    answers/most_common_share  share of the step's answered completions that give its most common answer
    answers/answered           share of the completions with an answer at all
and `CollapseWatch`, which warns when, over the last WINDOW steps, one answer is at least COLLAPSE_SHARE of the
answered completions and at least COLLAPSE_MARGIN above that answer's share among their problems' gold answers
(a task whose answers really are mostly "1" is not a collapse; a policy that says "1" far more often is). Where
no gold answer is known (rows without one; an environment's prompts, which its reset text rewrote), one answer must
be NO_GOLD_SHARE of them: nothing then says the answer is not simply right.

Evaluation (eval.py; `prior_summary`): the share of the model's most common answer, and the accuracy of the
best constant answer on the same problems (each candidate scored by the same scorer as the model), with the
model's accuracy on the problems that constant does not solve: a rise there is not the prior.

An answer is what the task's extraction finds in a completion (grpo.evaluation.evaluate.sample_answer: the last
<answer>, as a number for GSM8K, by --answer-extraction for reasoning-gym); a completion without one gives None,
which is never counted as an answer.
"""

from __future__ import annotations

import collections
import json
import logging

logger = logging.getLogger("grpo")

WINDOW = 5  # steps the collapse check looks back over
COLLAPSE_SHARE = 0.5  # one answer given by at least this share of the answered completions ...
COLLAPSE_MARGIN = 0.25  # ... and by this much more than the gold answers of their problems hold it
NO_GOLD_SHARE = 0.9  # ... or, with no gold answer to compare, at least this share
MIN_ANSWERED = 16  # answered completions in the window (up to WINDOW steps) before it judges
CONSTANT_CANDIDATES = (20, 5)  # the most common gold answers, and the model's most common answers, tried as constants


def prompt_key(prompt) -> str:
    """A hashable key of a row's prompt (a string or chat messages), to find the row a completion answered."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def answer_metrics(answers: list[str | None], group: int) -> dict:
    """The step's answers/* metrics from its N = B * G extracted answers, grouped [prompt 0 x G, ...]."""
    groups = [answers[start : start + group] for start in range(0, len(answers), group)]
    given = [answer for answer in answers if answer is not None]
    top = collections.Counter(given).most_common(1)
    return {"answers/distinct_share": sum(len({a for a in g if a is not None}) / group for g in groups) / len(groups),
            "answers/most_common_share": top[0][1] / len(given) if top else 0.0,
            "answers/answered": len(given) / len(answers)}


class CollapseWatch:
    """Warns (once per answer) when the policy's answers collapse to one value over the last WINDOW steps."""

    def __init__(self, window: int = WINDOW, share: float = COLLAPSE_SHARE, margin: float = COLLAPSE_MARGIN):
        self.steps = collections.deque(maxlen=window)
        self.share, self.margin, self.warned = share, margin, set()

    def update(self, step: int, answers: list[str | None], golds: list[str | None]) -> str | None:
        """Add a step's answers and their problems' gold answers (None where unknown); returns the warning it
        logged, or None."""
        self.steps.append([(a, g) for a, g in zip(answers, golds, strict=True) if a is not None])
        pairs = [pair for step_pairs in self.steps for pair in step_pairs]
        if len(pairs) < MIN_ANSWERED:
            return None
        answer, count = collections.Counter(a for a, _ in pairs).most_common(1)[0]
        share = count / len(pairs)
        known = [g for _, g in pairs if g is not None]
        gold_share = sum(g == answer for g in known) / len(known) if known else 0.0
        bar = max(self.share, gold_share + self.margin) if known else max(self.share, NO_GOLD_SHARE)
        if share < bar or answer in self.warned:
            return None
        self.warned.add(answer)
        where = f", while it is the gold answer of {gold_share:.0%} of them" if known else ""
        message = (f"step {step}: the answers are collapsing to one value: {answer!r} is {share:.0%} of the "
                   f"{len(pairs)} answers of the last {len(self.steps)} step(s){where}. A policy that gives one answer "
                   "to every question learns the task's prior, not the task: check the reward, the prompt and "
                   "answers/distinct_share (docs/tasks.md, 'Learning the prior')")
        logger.warning(message)
        return message


def prior_summary(answers: list[str | None], golds: list[str | None], correct: list[bool], score_constant) -> dict:
    """eval.py's guards: `answers/most_common` and its `answers/most_common_share` among the model's answers; with
    gold answers, `best_constant_answer` and `best_constant_accuracy` (`score_constant(answer) -> list[bool]`, one
    per problem, as the model's completions are scored), and `accuracy_beyond_constant`: the model's accuracy on
    the problems that constant does not solve."""
    given = [a for a in answers if a is not None]
    top = collections.Counter(given).most_common(1)
    summary = {"answers/most_common": top[0][0] if top else None,  # share of the answers given, as in training
               "answers/most_common_share": top[0][1] / len(given) if top else 0.0}
    known = [g for g in golds if g is not None]
    if not known or score_constant is None:
        return summary
    golds_first, model_first = CONSTANT_CANDIDATES
    candidates = [g for g, _ in collections.Counter(known).most_common(golds_first)]
    candidates += [a for a, _ in collections.Counter(given).most_common(model_first) if a not in candidates]
    best, best_marks = None, None
    for candidate in candidates:
        marks = score_constant(candidate)
        if best_marks is None or sum(marks) > sum(best_marks):
            best, best_marks = candidate, marks
    beyond = [ok for ok, constant_ok in zip(correct, best_marks, strict=True) if not constant_ok]
    summary.update({"best_constant_answer": best, "best_constant_accuracy": sum(best_marks) / len(best_marks),
                    "accuracy_beyond_constant": sum(beyond) / len(beyond) if beyond else 0.0})
    return summary
