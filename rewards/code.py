"""Rewards for code tasks (trl's signature): syntax, execution against the task's tests, PEP 8 style, safety.

The completion's code is its last ```python block (or last ``` block, or the whole text). A row of a code task
has these columns (data/humaneval.py builds them for HumanEval; docs/code-tasks.md describes the format):

    prompt_code   code the completion continues or replaces (a signature and docstring); optional
    entry_point   the function the tests call; optional
    setup         code run after the program, before the cases (imports, `candidate = entry_point`)
    tests         the test cases: code snippets, each passed when it runs without an exception
    generated_cases  more cases: groups of calls of the entry point with their expected outputs, each group a JSON
                  text (data/humaneval_cases.py makes HumanEval's); optional

    syntax       1.0 when the program parses (`ast.parse`), else 0.0
    execution    the share of test cases passed; for a row with generated cases, 1.0 when the program passes every
                 case (tests and generated groups), else PARTIAL_CREDIT times the share (`case_reward`). Each test
                 case runs after the program in a confined process of its own, the generated groups in one more
                 (rewards.sandbox: time, memory, network, user, files); 0.0 for a program that does not parse
    pep8         1 - (style problems pycodestyle finds per line), at least 0; 0.0 when it does not parse
    safety       -1.0 when the code uses a word of UNSAFE_PATTERNS (process, network, file-system or
                 introspection calls), else 0.0: a penalty to add with a weight, e.g. `safety:0.5`
"""

from __future__ import annotations

import ast
import json
import re
from concurrent.futures import ThreadPoolExecutor

from rewards.sandbox import Limits, run_tests
from rewards.scoring import completion_text

FENCE = re.compile(r"```(python|py)?[ \t]*\n(.*?)```", re.DOTALL)
UNSAFE_PATTERNS = (r"\bos\.system\b", r"\bsubprocess\b", r"\bsocket\b", r"\bshutil\.rmtree\b", r"\bos\.remove\b",
                   r"\bos\.fork\b", r"\bos\.kill\b", r"__import__", r"\beval\s*\(", r"\bexec\s*\(", r"\bctypes\b",
                   r"\bopen\s*\(\s*['\"]/", r"\bsys\.exit\b", r"\burllib\b", r"\brequests\b", r"\bglobals\s*\(")
LIMITS = Limits()
WORKERS = 2  # programs run at once
PARTIAL_CREDIT = 0.1  # what passing every case but one is worth, at most: see `case_reward`


def extract_code(completion) -> str:
    """The code of a completion: its last ```python (or ```) block, else all of its text."""
    text = completion_text(completion)
    blocks = FENCE.findall(text)
    python = [code for language, code in blocks if language]
    return (python or [code for _, code in blocks] or [text])[-1].strip("\n")


def _syntax_tree(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # null bytes; too deep for the parser
        return None


def parses(code: str) -> bool:
    return _syntax_tree(code) is not None


def program_of(code: str, prompt_code: str | None, entry_point: str | None) -> str:
    """The program to test: the completion's code after the prompt's (whose imports it may need); a completion
    that only continues the prompt's function (no `def entry_point`) is appended to it as the body."""
    if not prompt_code:
        return code
    tree = _syntax_tree(code)
    defines = tree is not None and any(isinstance(node, ast.FunctionDef) and node.name == entry_point
                                       for node in ast.walk(tree))
    if defines:  # the whole function: it replaces the prompt's, whose imports it may use
        return f"{prompt_code}\n\n{code}\n"
    return prompt_code.rstrip("\n") + "\n" + code + "\n"  # the body of the prompt's function


def problem_helpers(prompt_code: str | None, entry_point: str | None) -> str:
    """The prompt's code that the tests may use, run by the judge: its imports and helper functions, without the
    entry point's own definition (the tests call the program's). Empty for a prompt that does not parse on its own
    (a bare signature: nothing to help with)."""
    tree = _syntax_tree(prompt_code or "")
    if tree is None:
        return ""
    kept = [node for node in tree.body if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                and node.name == entry_point)]
    return "\n".join(ast.unparse(node) for node in kept)


def syntax(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion's code parses."""
    return [float(parses(extract_code(c))) for c in completions]


def case_reward(passed: list[float], generated: bool = True) -> float:
    """The execution reward of a program's per-case scores: the share passed for a row with its own tests only;
    with `generated` cases, 1.0 when every case passed, else PARTIAL_CREDIT * (the share passed).

    Many generated cases (data/humaneval_cases.py) find most of the ways a program can be wrong, and a program that
    fails one is wrong somewhere: a one-liner right on 95% of the inputs (`max(words, key=len)` without the
    tie-break) is still wrong. So there the share is a tie-break among wrong programs, never near the worth of a
    right one: no program that fails a case earns more than PARTIAL_CREDIT on any problem, whatever it does. Under
    GRPO's group-scaled advantages (scale_rewards "group") the scale of the tie-break does not matter within a group
    of wrong programs: their advantages are divided by the group's spread, so partial credit still orders them as
    the share does. A few hand-written tests tell a near-solution from a forgery no better than the share does, so a
    row without generated cases keeps the share."""
    if not passed:
        return 0.0
    share = sum(passed) / len(passed)
    return share if not generated or share == 1.0 else PARTIAL_CREDIT * share


def case_scores(completion, tests, setup=None, prompt_code=None, entry_point=None, generated_cases=None) -> list:
    """One completion's score per case of a row: its tests, then its generated groups ([] where its program does
    not parse or the row has no case)."""
    program = program_of(extract_code(completion), prompt_code, entry_point)
    groups = [[[call["args"], call["kwargs"], call["expected"]] for call in json.loads(group)]
              for group in generated_cases or []]
    if not parses(program) or not (tests or groups):
        return []
    return run_tests(program, list(tests or []), setup or "", LIMITS, helpers=problem_helpers(prompt_code, entry_point),
                     entry_point=entry_point, groups=groups)


def execution(prompts, completions, tests, setup=None, prompt_code=None, entry_point=None, generated_cases=None,
              **kwargs) -> list[float]:
    """Each completion's `case_reward` over its row's test cases and generated groups (rewards.sandbox)."""
    count = len(completions)
    setup, prompt_code, entry_point, generated_cases = (column or [None] * count for column in
                                                        (setup, prompt_code, entry_point, generated_cases))

    def score(row: int) -> float:
        scores = case_scores(completions[row], tests[row], setup[row], prompt_code[row], entry_point[row],
                             generated_cases[row])
        return case_reward(scores, generated=bool(generated_cases[row]))

    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(score, range(count)))


execution.runs_untrusted_code = True  # rewards.sandbox.check_isolation: the run says what confines it


def pep8(prompts, completions, **kwargs) -> list[float]:
    """1 - (pycodestyle's problems per line of code), at least 0; 0.0 for code that does not parse."""
    try:
        import pycodestyle
    except ImportError as error:
        raise ImportError("the pep8 reward needs pycodestyle: pip install -e '.[code]'") from error
    rewards = []
    for completion in completions:
        code = extract_code(completion)
        lines = code.splitlines(keepends=True)
        if not parses(code) or not lines:
            rewards.append(0.0)
            continue
        lines[-1] = lines[-1] if lines[-1].endswith("\n") else lines[-1] + "\n"
        checker = pycodestyle.Checker(lines=lines, quiet=True, max_line_length=100)
        rewards.append(max(0.0, 1.0 - checker.check_all() / len(lines)))
    return rewards


def safety(prompts, completions, **kwargs) -> list[float]:
    """-1.0 for code that uses a word of UNSAFE_PATTERNS, else 0.0."""
    return [-float(any(re.search(p, extract_code(c)) for p in UNSAFE_PATTERNS)) for c in completions]


def passed_all(completion, row) -> dict:
    """Evaluation scorer (--eval-scorer rewards.code:passed_all): pass@1 of a greedy completion (every case passed,
    the generated ones too, as HumanEval+ counts), pass@1_base (every case of the row's own tests, EvalPlus's "base":
    for HumanEval the figure papers report), and the share of all cases passed."""
    tests = list(row["tests"] or [])
    scores = case_scores(completion, tests, row.get("setup"), row.get("prompt_code"), row.get("entry_point"),
                         row.get("generated_cases"))
    share = sum(scores) / len(scores) if scores else 0.0
    checked = scores[:len(tests)]
    return {"pass@1": float(bool(scores) and share == 1.0),
            "pass@1_base": float(bool(checked) and sum(checked) == len(checked)), "tests_passed": share}


passed_all.runs_untrusted_code = True

CODE_REWARDS = {"syntax": syntax, "execution": execution, "pep8": pep8, "safety": safety}
