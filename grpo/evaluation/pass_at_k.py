"""pass@k and maj@k over n sampled completions per problem, each with a 95% interval over the problems.

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]     (Chen et al. 2021, "Evaluating Large Language Models
                                                          Trained on Code", eq. 1: unbiased for k <= n)

where c of a problem's n completions are correct. Taking the fraction of problems with a correct answer among the
first k samples is unbiased too, but wastes the other n - k samples; the estimator averages over every k-subset.

    maj@k  = E_problems[ correctness of the most frequent answer among the k = n samples ]

A vote is a completion's extracted answer, compared as text (reasoning-gym's "5" and "5.0" are two answers, and
tasks with many right answers split their votes); completions without one do not vote; answers tied for the most
votes share the problem's credit equally (so the figure does not depend on the order of the samples); no answer at
all scores 0. Interval: mean +- 1.96 standard errors of the per-problem values (a normal approximation over the
problems; clipped to [0, 1]), so it says how much the figure would move on another draw of problems and samples.
"""

from __future__ import annotations

import math
from collections import Counter


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k completions drawn without replacement from n, c of them correct,
    hold at least one correct one; as the product prod_{i=n-c+1}^{n} (1 - k / i), which never forms the binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(answers: list[str | None], correct: list[bool]) -> float:
    """The correctness of the most frequent non-None answer (ties share the credit); 0.0 when none has an answer."""
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return 0.0
    most = max(votes.values())
    winners = [answer for answer, count in votes.items() if count == most]
    # an answer's correctness: the share of its samples scored correct (1 or 0 when they score alike, as they do
    # unless the correctness key also scores something else), so that no sample order changes the figure
    def share(answer):
        marks = [ok for a, ok in zip(answers, correct, strict=True) if a == answer]
        return sum(marks) / len(marks)
    return sum(share(answer) for answer in winners) / len(winners)


def mean_interval(values: list[float]) -> dict:
    """{"mean", "low", "high"}: the mean and its 95% normal interval (1.96 standard errors), clipped to [0, 1]."""
    m = len(values)
    if m == 0:
        return {"mean": math.nan, "low": math.nan, "high": math.nan}
    mean = sum(values) / m
    spread = 0.0 if m < 2 else 1.96 * math.sqrt(sum((v - mean) ** 2 for v in values) / (m - 1) / m)
    return {"mean": mean, "low": max(0.0, mean - spread), "high": min(1.0, mean + spread)}


def summarize_samples(correct: list[list[bool]], answers: list[list[str | None]]) -> dict:
    """pass@1..n and maj@n, each {"mean", "low", "high"}, from per-problem correctness and extracted answers of n
    samples each."""
    if not correct:
        raise ValueError("pass@k needs at least one problem")
    n = len(correct[0])
    if any(len(row) != n for row in correct):
        raise ValueError("every problem needs the same number of samples")
    summary = {f"pass@{k}": mean_interval([pass_at_k(n, sum(row), k) for row in correct]) for k in range(1, n + 1)}
    summary[f"maj@{n}"] = mean_interval([majority_correct(a, c) for a, c in zip(answers, correct, strict=True)])
    return summary
