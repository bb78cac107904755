"""The reader's path through one training step: its files, their lines, and the structure it relies on.

    python bench/reader_path.py            # the table, the total, import cycles, branches in grpo/update.py

Reads the README's table "One step, file by file" (the files a reader opens for one step on the plain path:
train.py -> Trainer.train -> rollout -> rewards -> advantages -> update -> log-probs -> loss), counts each
file's lines (docstrings and comments included), and checks what the structure promises:
    - the step's files together hold at most BUDGET lines, grpo/trainer.py at most TRAINER_BUDGET;
    - no import cycle among the product's modules (grpo/, rewards/, data/, train.py, eval.py), counting the
      imports inside functions too;
    - grpo/update.py has no `if` on the kernels or on the rank (they reach it as functions and collectives).
Exits 1, naming what failed, when one does not hold. A measurement, not a test: the figures go to
docs/benchmarks.md.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 1400
TRAINER_BUDGET = 300
PRODUCT = ("grpo", "rewards", "data")
TABLE_TITLE = "One step, file by file"


def step_files(readme: str) -> list[str]:
    """The files named in the README's step table (its second column, in backticks), in order."""
    section = readme.split(f"## {TABLE_TITLE}", 1)
    if len(section) < 2:
        raise SystemExit(f"README.md has no section '## {TABLE_TITLE}'")
    rows = [line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    files = []
    for row in rows[2:]:  # after the header and its rule
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        files += re.findall(r"`([\w/.]+\.py)`", cells[1])
    return files


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    modules = {module_name(ROOT / name): ROOT / name for name in ("train.py", "eval.py")}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The product modules `path` imports, anywhere in the file (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {target for target in targets if target in modules and target != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in graph:
        if node not in index:
            visit(node)
    return result


def branches_on(path: Path, words: tuple[str, ...]) -> list[str]:
    """`if` tests (statements and expressions) in `path` that mention one of `words`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.If, ast.IfExp)):
            test = ast.unparse(node.test)
            if any(re.search(rf"\b{word}\b", test) for word in words):
                found.append(f"line {node.lineno}: if {test}")
    return found


def main() -> int:
    failures = []
    files = step_files((ROOT / "README.md").read_text())
    counts = {name: len((ROOT / name).read_text().splitlines()) for name in files}
    total = sum(counts.values())
    print(f"{'file':28s} {'lines':>6s}")
    for name, count in counts.items():
        print(f"{name:28s} {count:6d}")
    print(f"{'total (' + str(len(files)) + ' files)':28s} {total:6d}   budget {BUDGET}")
    if total > BUDGET:
        failures.append(f"the step's files hold {total} lines, over the budget of {BUDGET}")
    if counts.get("grpo/trainer.py", 0) > TRAINER_BUDGET:
        failures.append(f"grpo/trainer.py has {counts['grpo/trainer.py']} lines, over {TRAINER_BUDGET}")

    modules = product_modules()
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    found = cycles(graph)
    print(f"\nimport cycles among {len(modules)} product modules: {len(found) or 'none'}")
    for component in found:
        print("  " + " <-> ".join(component))
        failures.append(f"import cycle: {', '.join(component)}")

    branches = branches_on(ROOT / "grpo" / "update.py", ("kernels", "rank", "distributed", "ddp", "fsdp"))
    print(f"kernel or rank branches in grpo/update.py: {len(branches) or 'none'}")
    for branch in branches:
        print("  " + branch)
        failures.append(f"grpo/update.py branches on kernels or rank ({branch})")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
