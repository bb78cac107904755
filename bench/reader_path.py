"""The structure a reader relies on: layers that import downwards only, no import cycles, no function that takes
the Trainer, no kernel branch in the update.

    python bench/reader_path.py            # layers, import cycles, Trainer parameters, branches in the update

Checks:
    - grpo/'s folders and top modules sit in LAYERS, lowest first: each imports only from the layers below it or from
      its own folder (so no two folders import each other, and grpo/config.py imports no loop or feature module);
      rewards/ and data/ import nothing of grpo/;
    - no import cycle among the product's modules (grpo/, rewards/, data/, train.py, eval.py), counting the
      imports inside functions too;
    - no product function takes the Trainer (a parameter annotated Trainer, or named `run` or `trainer`): a
      function's parameters are what it reads;
    - grpo/core/update.py has no `if` on the kernels or on the rank (they reach it as functions and collectives).
The lines one step runs are bench/step_trace.py's. Exits 1, naming what failed, when one does not hold.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("grpo", "rewards", "data")
# grpo/'s parts, lowest first. A part imports from the parts of lower layers and from itself only.
LAYERS = [
    ("grpo.errors", "grpo.config_types"),  # how a run reports a fault; how a setting is read
    ("grpo.algorithm",),  # the math as pure functions
    ("grpo.config",),  # every setting and its checks
    ("grpo.tiny_model", "grpo.parallel", "grpo.kernels"),  # random-init models; ranks and collectives; fast paths
    ("grpo.lora",),  # adapters (its reference call is a parallel ModelCall)
    ("grpo.models",),  # loading the policy, the reference and the tokenizer
    ("grpo.generation",),  # the rollout, the generation backends and where they run, the prompts as tokens
    ("grpo.multiturn",),  # tool calls and environments inside a rollout
    ("grpo.evaluation",),  # greedy and sampled evaluation, its scorers, the answer guards
    ("grpo.core",),  # the training loop: set-up, the step, the update, metrics, checkpoints
    ("grpo.trl_api",),  # trl's GRPOConfig / GRPOTrainer on the loop
    ("grpo.cli", "grpo.plot", "grpo"),  # the programs' side
]


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
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {target for target in targets if target in modules and target != name}
    return found


def part_of(module: str) -> str | None:
    """The LAYERS part a grpo module belongs to (None: not in grpo/)."""
    parts = [part for layer in LAYERS for part in layer if module == part or module.startswith(part + ".")]
    return max(parts, key=len) if parts else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run from a part to a part of the same or a higher layer (its own part aside), and rewards/ or
    data/ importing grpo/."""
    level = {part: number for number, layer in enumerate(LAYERS) for part in layer}
    found = []
    for module, targets in sorted(graph.items()):
        source = part_of(module)
        for target in sorted(targets):
            goal = part_of(target)
            if goal is None:
                continue
            if source is None and module.split(".")[0] in ("rewards", "data"):
                found.append(f"{module} -> {target}: rewards/ and data/ know nothing of grpo/")
            elif source is not None and source != goal and level[goal] >= level[source]:
                found.append(f"{module} -> {target}: {goal} is not below {source} (bench/reader_path.py LAYERS)")
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


def trainer_parameters(modules: dict[str, Path]) -> list[str]:
    """Functions whose parameters stand for the whole trainer: annotated `Trainer`, or named `run` / `trainer`."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg in ("run", "trainer") or "Trainer" in annotation:
                        found.append(f"{name}:{node.lineno} {getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


def main() -> int:
    failures = []
    modules = product_modules()
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    unplaced = sorted(name for name in modules if name.startswith("grpo") and part_of(name) is None)
    upward = layer_violations(graph) + [f"{name} is in no layer of LAYERS" for name in unplaced]
    print(f"imports that do not run down the layers: {len(upward) or 'none'}")
    for violation in upward:
        print("  " + violation)
        failures.append(f"import {violation}")
    found = cycles(graph)
    print(f"import cycles among {len(modules)} product modules: {len(found) or 'none'}")
    for component in found:
        print("  " + " <-> ".join(component))
        failures.append(f"import cycle: {', '.join(component)}")

    takers = trainer_parameters(modules)
    print(f"functions that take the Trainer: {len(takers) or 'none'}")
    for taker in takers:
        print("  " + taker)
        failures.append(f"{taker} takes the Trainer")

    branches = branches_on(ROOT / "grpo" / "core" / "update.py", ("kernels", "rank", "distributed", "ddp", "fsdp"))
    print(f"kernel or rank branches in grpo/core/update.py: {len(branches) or 'none'}")
    for branch in branches:
        print("  " + branch)
        failures.append(f"grpo/core/update.py branches on kernels or rank ({branch})")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
