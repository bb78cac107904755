"""Rewards for code tasks (trl's signature): syntax, execution against the task's tests, PEP 8 style, safety.

The completion's code is its last ```python block (or last ``` block, or the whole text). A row of a code task
has these columns (data/humaneval.py builds them for HumanEval; docs/code-tasks.md describes the format):

    prompt_code   code the completion continues or replaces (a signature and docstring); optional
    entry_point   the function the tests call; optional
    setup         code run after the program, before the cases (imports, `candidate = entry_point`)
    tests         the test cases: code snippets, each passed when it runs without an exception

    syntax       1.0 when the program parses (`ast.parse`), else 0.0
    execution    the share of test cases passed, each case run after the program in a confined process
                 (rewards.sandbox: time, memory, network, user, files); 0.0 for a program that does not parse
    pep8         1 - (style problems pycodestyle finds per line), at least 0; 0.0 when it does not parse
    safety       -1.0 when the code uses a word of UNSAFE_PATTERNS (process, network, file-system or
                 introspection calls), else 0.0: a penalty to add with a weight, e.g. `safety:0.5`
"""

from __future__ import annotations

import ast
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


def execution(prompts, completions, tests, setup=None, prompt_code=None, entry_point=None, **kwargs) -> list[float]:
    """The share of each row's test cases the completion's program passes (rewards.sandbox)."""
    count = len(completions)
    setup, prompt_code, entry_point = (column or [None] * count for column in (setup, prompt_code, entry_point))

    def score(row: int) -> float:
        code = extract_code(completions[row])
        program = program_of(code, prompt_code[row], entry_point[row])
        if not parses(program) or not tests[row]:
            return 0.0
        scores = run_tests(program, list(tests[row]), setup[row] or "", LIMITS,
                           helpers=problem_helpers(prompt_code[row], entry_point[row]), entry_point=entry_point[row])
        return sum(scores) / len(scores)

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
    """Evaluation scorer (--eval-scorer rewards.code:passed_all): pass@1 of a greedy completion (every test case
    passed) and the share of cases passed."""
    share = execution(None, [completion], [row["tests"]], [row.get("setup")], [row.get("prompt_code")],
                      [row.get("entry_point")])[0]
    return {"pass@1": float(share == 1.0), "tests_passed": share}


passed_all.runs_untrusted_code = True

CODE_REWARDS = {"syntax": syntax, "execution": execution, "pep8": pep8, "safety": safety}
