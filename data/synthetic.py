"""A seeded, GSM8K-shaped task for offline runs: short word problems with small arithmetic.

Each row has the hub's columns: `question` and `answer`, the answer a worked solution with
calculator annotations (`<<a+b=c>>`) ending in `#### N`, exactly like GSM8K.

Four kinds of problem (`KINDS`): add, subtract, multiply and two_step (a purchase, then the change).
Their numbers come from a scale (`SCALES`): `standard` (two-digit sums, up to 9 x 12, change from $100;
the default) or `easy` (sums up to 6 + 6, products up to 5 x 5, change from $20: few enough facts for the `tiny` model
to learn them all; the learning experiment's, bench/learning.py).
"""

from __future__ import annotations

import random

_NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar"]
_ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "cards"]

# The inclusive ranges each kind draws its numbers from.
SCALES = {
    "standard": dict(add=(2, 40), start=(10, 60), boxes=(2, 9), per_box=(2, 12), price=(2, 9), count=(2, 6), paid=100),
    "easy": dict(add=(1, 6), start=(2, 9), boxes=(2, 5), per_box=(2, 5), price=(2, 5), count=(2, 4), paid=20),
}


def _add(rng: random.Random, scale: dict) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(*scale["add"]), rng.randint(*scale["add"])
    question = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"
    return question, answer


def _subtract(rng: random.Random, scale: dict) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(*scale["start"])
    b = rng.randint(1, a - 1)
    question = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
    answer = f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left.\n#### {a - b}"
    return question, answer


def _multiply(rng: random.Random, scale: dict) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, per_box = rng.randint(*scale["boxes"]), rng.randint(*scale["per_box"])
    total = boxes * per_box
    question = f"{name} buys {boxes} boxes with {per_box} {item} in each box. How many {item} does {name} buy?"
    answer = f"{name} buys {boxes} * {per_box} = <<{boxes}*{per_box}={total}>>{total} {item}.\n#### {total}"
    return question, answer


def _two_step(rng: random.Random, scale: dict) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    price, count, paid = rng.randint(*scale["price"]), rng.randint(*scale["count"]), scale["paid"]
    cost = price * count
    question = (
        f"{name} buys {count} {item} at ${price} each and pays with a ${paid} bill. "
        f"How much change does {name} get?"
    )
    answer = (
        f"The {item} cost {count} * {price} = <<{count}*{price}={cost}>>{cost} dollars.\n"
        f"The change is {paid} - {cost} = <<{paid}-{cost}={paid - cost}>>{paid - cost} dollars.\n"
        f"#### {paid - cost}"
    )
    return question, answer


_TEMPLATES = (_add, _subtract, _multiply, _two_step)
KINDS = tuple(template.__name__.lstrip("_") for template in _TEMPLATES)  # add, subtract, multiply, two_step


def make_synthetic_problems(num_rows: int, seed: int = 0, scale: str = "standard") -> list[dict[str, str]]:
    """`num_rows` rows with `question`, `answer` and `kind` (one of KINDS), numbers from SCALES[scale]; seeded."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose from {sorted(SCALES)}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        template = rng.choice(_TEMPLATES)
        question, answer = template(rng, SCALES[scale])
        rows.append({"question": question, "answer": answer, "kind": template.__name__.lstrip("_")})
    return rows


def make_synthetic_gsm8k(num_rows: int, seed: int = 0) -> list[dict[str, str]]:
    """`num_rows` GSM8K-shaped rows (the hub's two columns); the same seed always gives the same rows."""
    return [{"question": row["question"], "answer": row["answer"]} for row in make_synthetic_problems(num_rows, seed)]
