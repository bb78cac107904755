"""A seeded, GSM8K-shaped task for offline runs: short word problems with small arithmetic.

Each row has the hub's columns: `question` and `answer`, the answer a worked solution with
calculator annotations (`<<a+b=c>>`) ending in `#### N`, exactly like GSM8K.
"""

from __future__ import annotations

import random

_NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar"]
_ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "cards"]


def _add(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    question = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"
    return question, answer


def _subtract(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(10, 60)
    b = rng.randint(1, a - 1)
    question = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
    answer = f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left.\n#### {a - b}"
    return question, answer


def _multiply(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, per_box = rng.randint(2, 9), rng.randint(2, 12)
    total = boxes * per_box
    question = f"{name} buys {boxes} boxes with {per_box} {item} in each box. How many {item} does {name} buy?"
    answer = f"{name} buys {boxes} * {per_box} = <<{boxes}*{per_box}={total}>>{total} {item}.\n#### {total}"
    return question, answer


def _two_step(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    price, count, paid = rng.randint(2, 9), rng.randint(2, 6), 100
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


def make_synthetic_gsm8k(num_rows: int, seed: int = 0) -> list[dict[str, str]]:
    """`num_rows` GSM8K-shaped rows; the same seed always gives the same rows."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        question, answer = rng.choice(_TEMPLATES)(rng)
        rows.append({"question": question, "answer": answer})
    return rows
