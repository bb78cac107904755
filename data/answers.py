"""Turning answer text into canonical number strings, so "18", "18.0", "$18" and "1,000" compare as numbers.

GSM8K solutions end with a line `#### N`; the gold answer is the text after the last `####`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number as people write it: optional sign and $, digits with optional thousands separators,
# optional decimals. Used to find "the last number" in free text (lenient scoring).
_NUMBER_RE = re.compile(r"-?\$?\s?-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def canonical_number(text: str | None) -> str | None:
    """Normalise a number written as text to a canonical string, or None if it is not a number.

    Removes `$`, thousands separators, surrounding spaces, a trailing period and a trailing `%`;
    integral values lose their decimals ("18.0" -> "18", "-0" -> "0"); others are written without
    trailing zeros or exponent ("0.50" -> "0.5").
    """
    if text is None:
        return None
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".").rstrip("%")
    if not s or not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex above rules this out
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gold_answer(solution: str | None) -> str | None:
    """The canonical number after the last `####` of a GSM8K solution, or None if there is none."""
    if solution is None or "####" not in str(solution):
        return None
    return canonical_number(str(solution).rsplit("####", 1)[1])


def extract_last_number(text: str) -> str | None:
    """The canonical form of the last number in free text (GSM8K's lenient scoring), or None."""
    matches = _NUMBER_RE.findall(text or "")
    for candidate in reversed(matches):
        number = canonical_number(candidate)
        if number is not None:
            return number
    return None


def gold_from_column(value: str | None) -> str | None:
    """Gold answer from a dataset `answer` cell: a full solution (`... #### N`) or a bare number."""
    if value is None:
        return None
    if "####" in str(value):
        return extract_gold_answer(value)
    return canonical_number(value)
