"""The worked example of tools in the rollout: a calculator the model may call while it solves GSM8K.

    python train.py --preset calculator                  # SmolLM2-135M-Instruct on CPU (docs/tools.md)
    python train.py --model Qwen/Qwen2.5-0.5B-Instruct --tools data.calculator:calculator \
        --system-prompt "$(python -c 'from data.calculator import SYSTEM_PROMPT; print(SYSTEM_PROMPT)')" \
        --reward correctness:2 int strict_format tool_success

`calculator` evaluates arithmetic by walking the expression's syntax tree (numbers, + - * / // % **, unary
signs, parentheses) and nothing else: no names, calls or attributes, so a model cannot run code through it.
"""

from __future__ import annotations

import ast
import math
import operator

SYSTEM_PROMPT = """You can use a calculator. To compute something, write only
<tool_call>
{"name": "calculator", "arguments": {"expression": "48 / 2"}}
</tool_call>
and stop; the result comes back in the next message. When you know the answer, respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_LENGTH, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 1e30


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        result = _OPERATORS[type(node.op)](left, right)
        if abs(result) > MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return result
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "48 / 2 + 3".
    """
    if not isinstance(expression, str) or len(expression) > MAX_LENGTH:
        raise ValueError(f"expression must be a string of at most {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r}: {error.msg}") from None
    value = _value(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer():
            return str(int(value))
        return f"{value:.6g}"
    return str(value)


# A worked tool exchange shown before the question: small models copy its call format.
EXAMPLE = [
    {"role": "user", "content": "What is 48 * 17?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 * 17"}}\n'
                                     "</tool_call>"},
    {"role": "tool", "name": "calculator", "content": "816"},
    {"role": "assistant", "content": "<reasoning>\n48 * 17 = 816\n</reasoning>\n<answer>\n816\n</answer>"},
]


def arithmetic_rows(count: int, seed: int = 0, one_shot: bool = True) -> list[dict]:
    """Seeded products and sums of 3- and 2-digit numbers that a small model gets wrong in its head, as rows
    with a chat `prompt` (the system prompt, the worked tool exchange with `one_shot`, the question) and the
    `answer`: for the calculator's worked example (bench/tool_learning.py)."""
    import random

    rng, rows = random.Random(seed), []
    for _ in range(count):
        a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(100, 999)
        expression, value = rng.choice([(f"{a} * {b}", a * b), (f"{a} * {b} + {c}", a * b + c),
                                        (f"{a} + {c} * {b}", a + c * b)])
        question = f"What is {expression}?"
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, *(EXAMPLE if one_shot else []),
                  {"role": "user", "content": question}]
        rows.append({"prompt": prompt, "question": question, "answer": str(value)})
    return rows
