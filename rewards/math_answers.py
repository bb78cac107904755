"""A math answer reward on Hugging Face's math-verify (the `tasks` extra), with trl 1.16's `accuracy_reward` semantics.

    accuracy_reward = 1.0 if verify(parse(solution), parse(completion)) else 0.0;  None if the solution does not parse

The completion is parsed as trl parses it: LaTeX only, a \\boxed{} answer tried first, the first match taken, no
match without an anchor (a bare "42" at the end is not an answer), units normalised. The gold `solution` column is
parsed with math-verify's defaults (LaTeX and plain expressions). None (trl's "cannot score this row") leaves the
row out of the weighted sum. math-verify's timeouts use signal.alarm, which only the main thread may set: in another
thread (asynchronous rollouts) they are off, as in trl.
"""

from __future__ import annotations

import logging
import threading

from rewards.scoring import completion_text

INSTALL_HINT = "pip install -e '.[tasks]' (the math-verify package)"


def accuracy_reward(prompts=None, completions=(), solution=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's math answer equals the `solution` column's (math-verify), 0.0 when not, None when
    the solution does not parse."""
    if solution is None:
        raise ValueError(f"accuracy_reward needs a `solution` column (the gold answer); the rows have {sorted(kwargs)}")
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError(f"accuracy_reward needs math-verify: {INSTALL_HINT}") from None
    main_thread = threading.current_thread() is threading.main_thread()
    parsing_timeout, verify_timeout = (10, 5) if main_thread else (None, None)
    if not main_thread:  # math-verify warns on every call that the timeout is off
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                        try_extract_without_anchor=False)]
    rewards = []
    for completion, gold in zip(completions, solution, strict=True):
        gold_parsed = parse(gold, parsing_timeout=parsing_timeout)  # as trl: a gold that is not text does not parse
        if not gold_parsed:
            rewards.append(None)
            continue
        answer_parsed = parse(completion_text(completion), extraction_config=extraction, extraction_mode="first_match",
                              parsing_timeout=parsing_timeout)
        rewards.append(float(verify(gold_parsed, answer_parsed, timeout_seconds=verify_timeout)))
    return rewards


accuracy_reward.required_columns = ("solution",)  # checked before the model loads (rewards.scoring)


MATH_REWARDS = {"accuracy_reward": accuracy_reward}
