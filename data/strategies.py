"""Input-ignoring answers to a code task: the strategies its test cases must not pay for.

A strategy answers a call of the function under test without reading the arguments (all but one, named below): a
constant, or a sequence indexed by the call's number within the program's life. HumanEval's cases are cut so that
no strategy of the family passes one (data/humaneval.py, `split_check`), and bench/strategies.py replays the family
through the trusted test code to measure what it still collects.

The family of a problem (`strategy_family(prompt, test)`), all listed by name:

    constant v             v for every call. v is one of DEFAULT_CONSTANTS; every literal of the test file (not only
                           the values it compares with) and every constant sub-expression of it (`2.0/3.0`, `-1`,
                           `[1] * 3`: literals, containers, arithmetic and unary operators; no names, no calls; sizes
                           bounded by MAX_SIZE); the prompt's literals (its code's, as above, and its text's: numbers,
                           quoted strings, bracketed lists, tuples, sets and dicts that parse as literals); and the
                           outputs of the docstring's examples (`docstring_outputs`)
    call count from 0 / 1  0, 1, 2, ... (or 1, 2, 3, ...): the number of the call
    alternate True, False  True, False, True, ... (and False, True, ...)
    docstring outputs      the docstring examples' outputs in order, cycling (where there are two or more)
    argument i back        the i-th argument (None where the call has fewer), for every argument the function takes:
                           the one strategy that reads its input, kept because an identity answer is no solution
                           either (`return b` is as much a guess as `return a`)

The call number counts from the program's start. With fresh state per case (the sandbox imports the program anew
for each case) it restarts at every case; with per-program state (one process for the whole problem) it runs on
across the cases. `replay` models both; `candidate_for` is the strategy as an in-process function, and
`strategy_program` the same strategy as the source of a program, to run through the real sandbox.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
import random
import re
from typing import Callable, NamedTuple

DEFAULT_CONSTANTS = (None, True, False, 0, 1, -1, 0.0, "", [], (), {}, "Yes", "No", "YES", "NO", float("nan"))
MAX_SIZE = 10_000  # the most items, characters or bits a constant sub-expression may have (no `10 ** 10 ** 9`)


class Strategy(NamedTuple):
    """One input-ignoring answer: `kind` says how `values` answer the call numbered n (from 0)."""

    name: str  # what a reader sees in a report: "constant 0.456", "alternate True, False"
    kind: str  # "cycle": values[n % len(values)] (a constant is a cycle of one); "count": values[0] + n;
    #            "argument": the call's argument numbered values[0] (from 0)
    values: tuple


def strategy_family(prompt: str, test: str, arguments: int | None = None) -> list[Strategy]:
    """Every strategy of the module docstring for a problem with this prompt and this test file (its source).
    `arguments`: how many the function takes (at least one); by default the most that a function the prompt
    defines takes."""
    outputs = docstring_outputs(prompt)
    constants = distinct([*DEFAULT_CONSTANTS, *code_constants(test), *prompt_constants(prompt), *outputs])
    family = [Strategy(f"constant {_short(value)}", "cycle", (value,)) for value in constants]
    family += [Strategy("call count from 0", "count", (0,)), Strategy("call count from 1", "count", (1,)),
               Strategy("alternate True, False", "cycle", (True, False)),
               Strategy("alternate False, True", "cycle", (False, True))]
    if len(outputs) > 1:
        family.append(Strategy("docstring outputs in order", "cycle", tuple(outputs)))
    count = max(1, arguments if arguments is not None else prompt_arity(prompt))
    family += [Strategy(f"argument {index + 1} back", "argument", (index,)) for index in range(count)]
    return family


# --- the strategy as a function and as a program ---


def answer(strategy: Strategy, call: int, args: tuple):
    """What `strategy` answers to its call numbered `call` (from 0) with these positional arguments."""
    if strategy.kind == "cycle":
        return copy.deepcopy(strategy.values[call % len(strategy.values)])  # a fresh object: tests may change it
    if strategy.kind == "count":
        return strategy.values[0] + call
    if strategy.kind == "argument":
        index = strategy.values[0]
        return copy.deepcopy(args[index]) if index < len(args) else None  # as the sandbox's link hands it back
    raise ValueError(f"unknown strategy kind {strategy.kind!r}")


def candidate_for(strategy: Strategy) -> Callable:
    """The strategy as a function with its own call count, starting at 0: one per case is fresh state per case."""
    calls = 0

    def candidate(*args, **kwargs):
        nonlocal calls
        calls += 1
        return answer(strategy, calls - 1, args)

    return candidate


def strategy_program(entry_point: str, strategy: Strategy) -> str:
    """Python source of a program defining `entry_point` to answer as `strategy` does (the same answers as
    `candidate_for`): the call count is a module global, so it lives as long as the program's process."""
    if strategy.kind == "cycle":
        body = "return copy.deepcopy(VALUES[call % len(VALUES)])"
    elif strategy.kind == "count":
        body = "return VALUES[0] + call"
    elif strategy.kind == "argument":
        body = "return copy.deepcopy(args[VALUES[0]]) if VALUES[0] < len(args) else None"
    else:
        raise ValueError(f"unknown strategy kind {strategy.kind!r}")
    return ("import copy\n\n"
            "nan, inf = float('nan'), float('inf')  # how repr writes them\n"
            f"VALUES = {strategy.values!r}\n"
            "calls = 0\n\n\n"
            f"def {entry_point}(*args, **kwargs):\n"
            "    global calls\n"
            "    call, calls = calls, calls + 1\n"
            f"    {body}\n")


def replay(row: dict, strategy: Strategy, fresh_per_case: bool = True) -> list[bool]:
    """Which of a code-task row's cases `strategy` passes (`replay_program`). fresh_per_case: the strategy restarts
    (call count 0) at each case, as a program imported anew for every case; else one call count runs on across the
    row's cases, as one program process for the whole problem."""
    return replay_program(row, lambda: candidate_for(strategy), fresh_per_case)


def replay_program(row: dict, new_program: Callable[[], Callable], fresh_per_case: bool = True,
                   runs: Callable[[object, dict], bool] | None = None) -> list[bool]:
    """Which of a code-task row's cases the function `new_program()` makes passes, replayed through the row's
    trusted test code in this process (only trusted functions run here): the prompt's code, the entry point's name
    bound to the function, the setup (HumanEval's binds `candidate` to it), then the cases in order in one
    namespace, as the judge runs them. fresh_per_case: a new function for each case. `runs(code, namespace)` runs
    one case, True where it raises nothing (by default any Exception fails it)."""
    runs = runs or _runs
    program = [new_program()]  # the program behind the proxy; replaced to start it anew

    def proxy(*args, **kwargs):
        return program[0](*args, **kwargs)

    namespace = {"__name__": "tests"}
    state = random.getstate()  # the tests may draw from the global `random`: the caller's draws stay its own
    try:
        helpers = _runs(row.get("prompt_code") or "", namespace)  # the problem's helpers (and the entry point's stub)
        namespace[row["entry_point"]] = proxy  # the judge's proxy for the entry point
        if not (helpers and _runs(row.get("setup") or "", namespace)):
            return [False] * len(row["tests"])  # as in the judge: no case runs after a failed setup
        passed = []
        for case in row["tests"]:
            if fresh_per_case:
                program[0] = new_program()
            passed.append(runs(case, namespace))
        return passed
    finally:
        random.setstate(state)


def _runs(code, namespace: dict) -> bool:
    try:
        exec(code, namespace)
        return True
    except Exception:  # noqa: BLE001 -- an assertion, or an answer the test cannot use
        return False


def passes(context: dict, code, strategy: Strategy) -> bool:
    """Whether the statements `code` pass, in a copy of `context`, with `candidate` the strategy, fresh (the cut's
    test: one case as a program imported for it alone would meet it)."""
    return _runs(code, {**context, "candidate": candidate_for(strategy)})


def prompt_arity(prompt: str, name: str | None = None) -> int:
    """The positional parameters of the function `name` defined in `prompt`, or the most any function there takes
    (0 where none parses)."""
    try:
        tree = ast.parse(prompt)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0
    return max((len(node.args.posonlyargs) + len(node.args.args) for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and name in (None, node.name)),
               default=0)


# --- where the constants come from ---

NOT_LITERAL = object()
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY_OPERATORS = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}


def code_constants(source: str) -> list:
    """The value of every constant expression in `source` (a literal, or a sub-expression of literals, containers,
    arithmetic and unary operators: `constant_value`), breadth first; [] for source that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    values = (constant_value(node) for node in ast.walk(tree) if isinstance(node, ast.expr))
    return [value for value in values if value is not NOT_LITERAL]


def constant_value(node: ast.AST):
    """The value of an expression made of literals, containers (list, tuple, set, dict), arithmetic and unary
    operators only, or NOT_LITERAL (a name, a call, an error, a result over MAX_SIZE)."""
    try:
        return _evaluate(node)
    except (ArithmeticError, TypeError, ValueError, RecursionError, MemoryError):
        return NOT_LITERAL


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant):
        value = node.value
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_evaluate(item) for item in node.elts]  # a Starred item raises TypeError
        value = {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    elif isinstance(node, ast.Dict):
        if None in node.keys:
            raise TypeError("** in a dict")
        value = {_evaluate(key): _evaluate(item) for key, item in zip(node.keys, node.values, strict=True)}
    elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPERATORS:
        value = UNARY_OPERATORS[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _refuse_large(node.op, left, right)
        value = OPERATORS[type(node.op)](left, right)
    else:
        raise TypeError(f"not a constant expression: {type(node).__name__}")
    if _size(value) > MAX_SIZE:
        raise ValueError("too large")
    return value


def _refuse_large(op: ast.operator, left, right) -> None:
    """Raise ValueError before an operation whose result would pass MAX_SIZE (the check after it comes too late)."""
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and right * abs(left).bit_length() > MAX_SIZE:
            raise ValueError("too large a power")
    if isinstance(op, ast.Mult):  # the size of what is repeated, not its length: [[0] * 10_000] * 10_000
        for count, other in ((left, right), (right, left)):
            if isinstance(count, int) and isinstance(other, (str, bytes, list, tuple)):
                if count * max(1, _size(other)) > MAX_SIZE:
                    raise ValueError("too long a repetition")
    if isinstance(op, ast.Mod) and isinstance(left, (str, bytes)):
        raise TypeError("string formatting ('%0999999999d' % 1 is a gigabyte)")


def _size(value) -> int:
    if isinstance(value, int):
        return value.bit_length()
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) + sum(_size(item) for item in value)
    if isinstance(value, dict):
        return len(value) + sum(_size(key) + _size(item) for key, item in value.items())
    return 1


def prompt_constants(prompt: str) -> list:
    """The literals of a prompt: its code's constant expressions (`code_constants`), and in its text (the docstring)
    numbers, quoted strings and bracketed spans that parse as literals (`[1, 2]`, `(1, 'a')`, `{"a": 1}`)."""
    found = list(code_constants(prompt))
    for match in re.finditer(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w)|'[^'\n]*'|\"[^\"\n]*\"", prompt):
        found.append(_literal(match.group()))
    for start, character in enumerate(prompt):
        if character in "[({":
            found.append(_literal(_bracketed(prompt, start)))
    return [value for value in found if value is not NOT_LITERAL]


def _bracketed(text: str, start: int, limit: int = 1000) -> str:
    """The span of `text` from the bracket at `start` to the one that closes it (not past `limit` characters)."""
    depth = 0
    for end in range(start, min(len(text), start + limit)):
        depth += (text[end] in "[({") - (text[end] in "])}")
        if depth == 0:
            return text[start:end + 1]
    return ""


def _literal(text: str):
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NOT_LITERAL


# --- the docstring's examples ---

CALL_ARROWS = ("==>", "=>", "➞", "->", "==", " = ", "should return", "returns", "return")  # after `f(x)`
OUTPUT_ARROWS = ("should be", "Output:", "output:")  # "the output should be 1", "Output: [2, 1]"


def docstring_outputs(prompt: str) -> list:
    """The outputs of the examples in a prompt's docstrings, in order. HumanEval's styles covered:

        >>> f(x)            the fewest lines after a `>>>` line (before a blank line or the next `>>>`) that parse
        y                   together as a literal (HumanEval/0, /34); where none do, the output on the `>>>` line
        >>> f(x) == y       itself, after an arrow or after the call's closing bracket (/108, /116, /156)
        f(x) ==> y          a line with one of CALL_ARROWS after a `)` (`==>`, `=>`, `➞`, `->`, `==`, ` = `,
        f(x) ➞ y            "should return", "returns"), or one of OUTPUT_ARROWS anywhere ("should be", "Output:"):
        f(x) should return y.   the text after the first arrow that a literal follows (/72, /76, /95, /130, /140, /161;
        Output: y           `Output:` lines in /115, /120; "the output should be 1." in /78, "the result should be
        ...should be y      ('bcd',False)" in /112). That text is read as: the whole of it without a trailing `.` or
                            `,`; as it is; without a `# comment`; the value after its last ` = ` (`-> 19 - 5 - 6 =
                            8` in /67); true / false / none as True / False / None (`=> true` in /76); else its
                            longest leading literal (`should return False is ...`).

    Not covered: outputs given in words ("return the sum", "an empty list"), and an output on a line of its own
    after a call without `>>>`. A docstring here is any string statement (/115's follows an import)."""
    outputs, lines = [], "\n".join(_docstrings(prompt)).splitlines()
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        index += 1
        if line.startswith(">>>"):
            value, taken = _output_lines(lines[index:])
            index += taken
            if value is NOT_LITERAL:
                value = _arrow_output(line, after_call=True)
        else:
            value = _arrow_output(line)
        if value is not NOT_LITERAL:
            outputs.append(value)
    return outputs


def _output_lines(lines: list[str]) -> tuple[object, int]:
    """(value, lines taken) of the output after a `>>>` line: the fewest of the next lines (up to a blank line or
    the next `>>>`) that parse together as a literal; (NOT_LITERAL, 0) where none do."""
    block = []
    for line in lines:
        if not line.strip() or line.strip().startswith(">>>"):
            break
        block.append(line.strip())
        value = _literal(" ".join(block))
        if value is not NOT_LITERAL:
            return value, len(block)
    return NOT_LITERAL, 0


def _docstrings(prompt: str) -> list[str]:
    """The string statements of a prompt (its docstrings), in order; the whole prompt where it does not parse."""
    try:
        tree = ast.parse(prompt)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return [prompt]
    strings = [node for node in ast.walk(tree) if isinstance(node, ast.Expr)
               and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    return [node.value.value for node in sorted(strings, key=lambda node: node.lineno)]


def _arrow_output(line: str, after_call: bool = False):
    """The output an example line gives after its first arrow that a literal follows (or, with after_call, right
    after its first call's closing bracket), or NOT_LITERAL."""
    positions = [match.end() for arrow in OUTPUT_ARROWS for match in re.finditer(re.escape(arrow), line)]
    positions += [match.end() for arrow in CALL_ARROWS for match in re.finditer(re.escape(arrow), line)
                  if ")" in line[:match.start()]]
    if after_call and "(" in line:
        call = _bracketed(line, line.index("("))
        positions.append(line.index("(") + len(call))
    for position in sorted(positions):
        value = _output_text(line[position:])
        if value is not NOT_LITERAL:
            return value
    return NOT_LITERAL


def _output_text(text: str):
    text = text.strip()
    if not text:
        return NOT_LITERAL
    attempts = [text.rstrip(".,").strip(), text, text.split(" #")[0].strip(), text.rsplit(" = ", 1)[-1].rstrip(".")]
    words = {"true": True, "false": False, "none": None}
    for attempt in attempts:
        if attempt.lower() in words:
            return words[attempt.lower()]
        value = _literal(attempt)
        if value is not NOT_LITERAL:
            return value
    for end in sorted({match.start() for match in re.finditer(r"[\s,.;:]", text)}, reverse=True):
        value = _literal(text[:end])
        if value is not NOT_LITERAL:
            return value
    return NOT_LITERAL


# --- helpers ---


def distinct(values: list) -> list:
    """`values` without repeats, in order; 1, 1.0 and True are three values (`type(v) is int` tells them apart)."""
    seen, kept = set(), []
    for value in values:
        key = _key(value)
        if key not in seen:
            seen.add(key)
            kept.append(value)
    return kept


def _key(value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "float nan"
    return f"{type(value).__name__} {value!r}"


def _short(value, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
