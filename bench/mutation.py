"""Mutation testing of the core modules with cosmic-ray: how many deliberate bugs each module's tests catch.

    python bench/mutation.py                         # every module; resumes an interrupted run
    python bench/mutation.py --modules loss sampler  # some of them
    python bench/mutation.py --fresh                 # forget the last run's results and start again
    python bench/mutation.py --report                # the table and the untriaged survivors; runs nothing

cosmic-ray (the `mutation` extra) writes each mutant into a copy of the committed tree (`git archive HEAD` under
--workdir, so the checkout is never touched) and runs that module's test selection (MODULES) on it: a failing
selection kills the mutant. Not part of CI; the whole run takes about an hour on two cores.

Three choices keep it that short, and docs/mutation.md says what each leaves out:
- The operators (KEPT_OPERATORS): one flip per operator as a careless edit would make it (+ to -, < to <=, & to |,
  a condition negated, a number moved by one, a loop that never runs, a caught exception that is not), instead of
  cosmic-ray's every-operator-for-every-operator cross product, most of which only raise a TypeError.
- A fork server: torch and transformers load once, and each mutant's pytest runs in a fork of that process that
  imports the project afresh from the mutated files (bytecode writing off, so no stale .pyc is read). That takes
  about 4.5 s of imports off every mutant.
- Per-test selection (mutmut's idea): the unmutated run records, under coverage, which tests run each line of the
  module; a mutant runs only the tests that ran its statement. A statement that ran at import (a default argument,
  a module constant) runs the whole selection; one that no test runs survives without a run. Lines run only in a
  subprocess a test starts, or only while a module- or session-scoped fixture was set up for an earlier test, are
  not credited to the tests that need them: such a mutant may survive here that the whole selection would kill.

A selection that runs past its timeout (ten times the unmutated run, plus 30 s) counts as killed, as in cosmic-ray:
such a mutant made the code hang. Survivors that cannot change behaviour are listed in
bench/mutation_equivalents.toml with the reason; every other survivor is printed for triage. docs/mutation.md
holds the last run's table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "bench" / "mutation_equivalents.toml"
PROJECT = ("grpo", "rewards", "data", "tests", "bench", "train", "eval", "conftest")

# module name -> (file, the tests that select it). Each selection is what exercises that module fast: its own unit
# tests and the trainer tests that run it end to end; the trl parity suite is left out (minutes per mutant). "+"
# marks a test that runs for every mutant the other tests did not kill, as coverage cannot see what it runs (the
# two-rank tests' ranks are other processes: DDP with the default loss, FSDP2 with dapo, whose token count spans
# the ranks).
MODULES = {
    "advantages": ("grpo/algorithm/advantages.py", ["tests/test_advantages.py", "tests/test_update.py"]),
    "loss": ("grpo/algorithm/loss.py", ["tests/test_loss.py", "tests/test_update.py"]),
    "logprobs": ("grpo/algorithm/logprobs.py", ["tests/test_logprobs.py", "tests/test_update.py",
                                                "tests/test_logprob_memory.py"]),
    "sampler": ("grpo/algorithm/sampler.py", ["tests/test_sampler.py", "-m", "not slow",
                                              "-k", "not compiled"]),
    "update": ("grpo/core/update.py", ["tests/test_update.py", *(f"tests/test_trainer.py::test_{name}" for name in (
        "gradient_accumulation_is_exact", "resume_is_exact", "one_generation_feeds_several_updates",
        "reference_sync_mixes_the_policy_in_every_sync_steps_updates", "generation_reuse_updates_on_disjoint_slices",
        "pure_bf16_weights_take_the_fp32_step", "bf16_autocast_tracks_fp32", "beta_zero_loads_no_reference_model",
        "external_rollout_metrics")), "tests/test_reliability.py::test_non_finite_steps_are_skipped_then_stop",
        "tests/test_async.py::test_a_rollout_without_behaviour_log_probs_is_refused_when_corrected",
        "tests/test_async.py::test_staleness_0_is_the_synchronous_loop",
        "tests/test_trainer.py::test_schedules_are_the_ones_transformers_computes",
        "+tests/test_distributed.py::test_two_ranks_compute_what_one_process_computes[ddp]",
        "+tests/test_distributed.py::test_auto_means_fsdp_under_torchrun_and_dapo_counts_global_tokens"]),
    "checkpoint": ("grpo/core/checkpoint.py", ["tests/test_reliability.py",
                                               "tests/test_trainer.py::test_resume_is_exact"]),
    "scoring": ("rewards/scoring.py", ["tests/test_rewards.py"]),
    "gsm8k reward": ("rewards/gsm8k.py", ["tests/test_rewards.py"]),
}
# The pass mark per module (issue #44): killed / (killed + survived), equivalents left out.
TARGETS = {"advantages": 0.9, "loss": 0.9, "logprobs": 0.9, "checkpoint": 0.9}
DEFAULT_TARGET = 0.8

KEPT_OPERATORS = [
    *(f"core/ReplaceBinaryOperator_{a}_{b}" for a, b in [
        ("Add", "Sub"), ("Sub", "Add"), ("Mul", "Div"), ("Div", "Mul"), ("FloorDiv", "Div"), ("Mod", "FloorDiv"),
        ("Pow", "Mul"), ("BitAnd", "BitOr"), ("BitOr", "BitAnd"), ("LShift", "RShift"), ("RShift", "LShift")]),
    *(f"core/ReplaceComparisonOperator_{a}_{b}" for a, b in [
        ("Lt", "LtE"), ("LtE", "Lt"), ("Gt", "GtE"), ("GtE", "Gt"), ("Eq", "NotEq"), ("NotEq", "Eq"),
        ("Is", "IsNot"), ("IsNot", "Is"), ("In", "NotIn"), ("NotIn", "In")]),
    "core/ReplaceUnaryOperator_USub_UAdd", "core/ReplaceUnaryOperator_Delete_Not",
    "core/ReplaceUnaryOperator_Delete_Invert", "core/AddNot",
    "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue", "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue", "core/ReplaceContinueWithBreak",
    "core/NumberReplacer", "core/ZeroIterationForLoop", "core/ExceptionReplacer",
]


# ---------------------------------------------------------------------------------------------------------------
# The fork server and its client (the test command cosmic-ray runs for each mutant)

def _third_party_modules(tree: Path, tests: list[str]) -> list[str]:
    """The modules other than the project's that importing `tests` loads: what the server imports once."""
    files = [t for t in tests if t.endswith(".py")]
    # pytest puts tests/ on the path
    probe = ("import sys, runpy\nsys.path[:0] = ['.', 'tests']\nimport tests.conftest\n"
             + "".join(f"try:\n    runpy.run_path({f!r})\nexcept Exception:\n    pass\n" for f in files)
             + f"print('\\n'.join(m for m in list(sys.modules) if m.split('.')[0] not in {PROJECT!r}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True,
                         env=_environment(tree), check=True)
    return out.stdout.split()


def _environment(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def serve(path: str, modules: list[str]) -> None:
    """Import `modules` once, then for each request fork, run pytest in the child and send back its exit code."""
    sys.dont_write_bytecode = True
    for name in modules:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module that imports only in a certain order is loaded by the child
            pass
    import pytest
    import torch

    torch.set_num_threads(1)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    while True:
        conn, _ = server.accept()
        request = json.loads(conn.makefile().readline())
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                server.close()
                signal_alarm(request["timeout"])
                os.chdir(request["cwd"])
                with open(request["log"], "w") as log:
                    os.dup2(log.fileno(), 1)
                    os.dup2(log.fileno(), 2)
                    if request.get("map"):
                        code = _run_mapping_lines(pytest, request["args"], **request["map"])
                    else:
                        code = int(pytest.main(request["args"]))
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        conn.close()


def _run_mapping_lines(pytest, args: list[str], module: str, out: str) -> int:
    """Run pytest under coverage of `module` alone, each test in its own coverage context, and write
    {line: [the node ids that ran it]} to `out` ("" among them: the line ran at import). Returns pytest's code."""
    import coverage

    cov = coverage.Coverage(data_file=None, include=[module], config_file=False)

    class Contexts:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            cov.switch_context(item.nodeid)
            yield
            cov.switch_context("")

    cov.start()
    try:
        code = int(pytest.main(args, plugins=[Contexts()]))
    finally:
        cov.stop()
    data = cov.get_data()
    lines = data.contexts_by_lineno(module) if module in data.measured_files() else {}
    Path(out).write_text(json.dumps({str(line): sorted(set(names)) for line, names in lines.items()}))
    return code


def signal_alarm(seconds: float) -> None:
    """A mutant that hangs dies by SIGALRM after `seconds`: its pytest exits by a signal, which counts as killed."""
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(seconds)))


def client(path: str, timeout: float, log: str, args: list[str], cwd: Path | None = None, mapping: dict | None = None
           ) -> int:
    """Ask the server at `path` to run pytest with `args` in `cwd` (default: here); pytest's exit code.
    `mapping` ({"module", "out"}): run under coverage and write the line -> tests map (the baseline run)."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    request = {"cwd": str(cwd or os.getcwd()), "args": args, "timeout": timeout, "log": log, "map": mapping}
    conn.sendall((json.dumps(request) + "\n").encode())
    code = int(conn.makefile().readline())
    print(f"pytest exit code {code}; its output: {log}")
    return code


def mutated_statements(original: str, mutated: str) -> list[tuple[int, int]]:
    """The (first, last) original lines of each innermost statement that the mutation changed; (0, 0) when a
    changed line is in no statement (a decorator, say)."""
    import ast
    import difflib

    before, after = original.splitlines(), mutated.splitlines()
    changed = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        if tag != "equal":
            changed.update(range(i1 + 1, max(i2, i1 + 1) + 1))
    statements = [node for node in ast.walk(ast.parse(original)) if isinstance(node, ast.stmt)]
    spans = []
    for line in sorted(changed):
        around = [n for n in statements if n.lineno <= line <= n.end_lineno]
        inner = min(around, key=lambda n: n.end_lineno - n.lineno, default=None)
        spans.append((0, 0) if inner is None else (inner.lineno, inner.end_lineno))
    return sorted(set(spans))


def tests_for(lines: dict, spans: list[tuple[int, int]]) -> list[str] | None:
    """The node ids that ran any line of `spans` (by the baseline's map); None: run the whole selection (a line
    that ran at import, or one outside every statement); []: no test of the selection runs the mutated code."""
    chosen = set()
    for first, last in spans:
        if first == 0:
            return None
        for line in range(first, last + 1):
            names = lines.get(str(line), [])
            if "" in names:
                return None
            chosen.update(names)
    return sorted(chosen)


def mutant_client(path: str, timeout: float, log: str, map_file: str, original: str, module: str,
                  args: list[str]) -> int:
    """cosmic-ray's test command for one mutant: run only the tests that ran the mutated statements unmutated
    (mutmut's and cosmic-ray's coverage idea, per test); a mutant no test of the selection reaches survives."""
    always = [arg[1:] for arg in args if arg.startswith("+")]  # what coverage cannot see: run after the others
    args = [arg for arg in args if not arg.startswith("+")]
    lines = json.loads(Path(map_file).read_text())
    spans = mutated_statements(Path(original).read_text(), Path(module).read_text())
    chosen = tests_for(lines, spans)
    if chosen == [] and not always:
        print(f"no test of the selection runs lines {spans}: survived without a run")
        return 0
    options, skip = [], False  # the selection's options (-m, -k) stay; its files and node ids may give way
    for index, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in ("-m", "-k", "-p", "-o", "-W"):
            options += [arg, args[index + 1]]
            skip = True
        elif arg.startswith("-"):
            options.append(arg)
    # The in-process tests first (the whole selection, or the chosen ones), then `always` only for a mutant they
    # did not kill: the same verdict, and the slow multi-process tests run for the few mutants that need them.
    runs = [args if chosen is None else options + chosen] if chosen != [] else []
    runs += [options + always] if always else []
    for run in runs:
        code = client(path, timeout, log, run)
        if code in (4, 5):  # pytest's usage error or no test collected: the selection is wrong, not the mutant caught
            print("NOT A KILL: the selection did not run (see the log); counted as survived, so it shows up for triage")
            return 0
        if code != 0:
            return 1  # a failure, a collection error or a signal (the timeout): killed
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The run

PYTEST_ARGS = ["-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore"]


def prepare_tree(workdir: Path) -> Path:
    """The committed tree, copied under workdir/src (with ../shared beside it, as the checkout has)."""
    tree = workdir / "src"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    shared = ROOT.parent / "shared"
    if shared.exists() and not (workdir / "shared").exists():
        (workdir / "shared").symlink_to(shared)
    return tree


def run_module(name: str, tree: Path, workdir: Path, fresh: bool, recheck: bool = False) -> None:
    path, tests = MODULES[name]
    slug = name.replace(" ", "_")
    config, session = workdir / f"{slug}.toml", workdir / f"{slug}.sqlite"
    sock = str(workdir / f"{slug}.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    server = subprocess.Popen([sys.executable, __file__, "serve", sock, *_third_party_modules(tree, tests)],
                              cwd=tree, env=_environment(tree))
    try:
        for _ in range(600):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        log, line_map, original = (workdir / f"{slug}.pytest.log", workdir / f"{slug}.lines.json",
                                   workdir / f"{slug}.original.py")
        shutil.copyfile(tree / path, original)
        started = time.perf_counter()
        code = client(sock, 3600, str(log), PYTEST_ARGS + [t.lstrip("+") for t in tests], cwd=tree,
                      mapping={"module": str(tree / path), "out": str(line_map)})
        baseline = time.perf_counter() - started
        if code:
            sys.exit(f"{name}: the unmutated tree fails its selection ({' '.join(tests)}); see {log}")
        timeout = 10 * baseline + 30
        # quoted: cosmic-ray splits the command like a shell, and "-k not compiled" must stay one argument
        command = shlex.join([sys.executable, str(Path(__file__).resolve()), "mutant", sock, str(timeout), str(log),
                              str(line_map), str(original), path, "--", *PYTEST_ARGS, *tests])
        exclude = "^(?!(?:" + "|".join(re.escape(op) for op in KEPT_OPERATORS) + ")$)"
        config.write_text(
            f'[cosmic-ray]\nmodule-path = "{path}"\ntimeout = {timeout + 30:.0f}\nexcluded-modules = []\n'
            f"test-command = {json.dumps(command)}\n"
            f'[cosmic-ray.distributor]\nname = "local"\n'
            f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{json.dumps(exclude)}]\n")
        if fresh or not session.exists():
            session.unlink(missing_ok=True)
            subprocess.run(["cosmic-ray", "init", str(config), str(session)], cwd=tree, check=True)
            subprocess.run(["cr-filter-operators", str(session), str(config)], cwd=tree, check=True)
        elif recheck:  # the survivors run again, against the tests committed since
            _forget_survivors(session)
        pending = sum(1 for item, result in _dump(session, tree) if result is None)
        print(f"{name}: {path}, baseline {baseline:.1f} s, {pending} mutants to run", flush=True)
        subprocess.run(["cosmic-ray", "exec", str(config), str(session)], cwd=tree, check=True)
    finally:
        server.kill()
        server.wait()
    # cosmic-ray restores each file after its mutant; a file that differs from the run's copy would mean it did not
    # (compared with the copy, not HEAD, so commits made during a run do not matter).
    if (tree / path).read_bytes() != (workdir / f"{slug}.original.py").read_bytes():
        sys.exit(f"{path} was left mutated in {tree}")


def _forget_survivors(session: Path) -> None:
    """Mark every surviving mutant of a session as not yet run (cosmic-ray's sqlite: a job without a result)."""
    import sqlite3

    with sqlite3.connect(session) as db:
        db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")


def _dump(session: Path, tree: Path) -> list:
    out = subprocess.run(["cosmic-ray", "dump", str(session)], cwd=tree, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _mutated_lines(diff: str) -> tuple[str, str]:
    minus = [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    plus = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(minus), " / ".join(plus)


def _describe(tests: list[str]) -> str:
    """A selection for the table: each file once, with how many of its tests when the selection names some."""
    files, options = {}, []
    for arg in tests:
        path, _, node = arg.lstrip("+").partition("::")
        if arg.startswith("-") or options and options[-1] in ("-m", "-k"):
            options.append(arg)
        else:
            files.setdefault(path, []).extend([node] if node else [])
    named = [f"{path} ({len(nodes)} test{'s' * (len(nodes) > 1)})" if nodes else path for path, nodes in files.items()]
    return ", ".join(named) + (f" {' '.join(options)}" if options else "")


def report(workdir: Path, names: list[str]) -> bool:
    """Print the table and every untriaged survivor; True when each module meets its target."""
    equivalents = tomllib.loads(EQUIVALENTS.read_text()).get("equivalent", []) if EQUIVALENTS.exists() else []
    known = {(e["module"], e["operator"], e["before"], e["after"]): e["why"] for e in equivalents}
    used, rows, untriaged, ok = set(), [], [], True
    for name in names:
        path, tests = MODULES[name]
        session = workdir / f"{name.replace(' ', '_')}.sqlite"
        if not session.exists():
            continue
        counts = Counter()
        for item, result in _dump(session, workdir):
            if result is None:
                counts["pending"] += 1
                continue
            if result["worker_outcome"] == "skipped":
                continue
            outcome = result["test_outcome"]
            if outcome == "survived":
                mutation = item["mutations"][0]
                key = (path, mutation["operator_name"], *_mutated_lines(result["diff"]))
                if key in known:
                    used.add(key)
                    outcome = "equivalent"
                else:
                    untriaged.append((path, mutation["start_pos"][0], key[1], key[2], key[3]))
            counts[outcome] += 1
        live = counts["killed"] + counts["survived"]
        score = counts["killed"] / live if live else 1.0
        target = TARGETS.get(name, DEFAULT_TARGET)
        ok &= score >= target and not counts["pending"]
        rows.append(f"| {name} | `{path}` | {_describe(tests)} | {sum(counts.values())} | {counts['killed']} | "
                    f"{counts['survived']} | {counts['equivalent']} | {counts['incompetent']} | {100 * score:.1f}% "
                    f"| {100 * target:.0f}% |" + (f" {counts['pending']} pending" if counts["pending"] else ""))
    print("| module | file | test selection | mutants | killed | survived | equivalent | incompetent | killed of "
          "non-equivalent | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for path, line, operator, before, after in sorted(untriaged):
        print(f"SURVIVED {path}:{line} {operator}\n    - {before}\n    + {after}")
    stale = [key for key in known if key not in used and any(key[0] == MODULES[n][0] for n in names)]
    for key in stale:
        print(f"stale equivalent (no such surviving mutant now): {key}")
    return ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        serve(argv[1], argv[2:])
        return 0
    if argv and argv[0] == "mutant":
        return mutant_client(argv[1], float(argv[2]), *argv[3:7], argv[argv.index("--") + 1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", choices=list(MODULES), default=list(MODULES), metavar="MODULE",
                        help=f"which modules to mutate (default: all of {', '.join(MODULES)})")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "mutation",
                        help="the tree copy, the sessions and the logs (default: runs/mutation)")
    parser.add_argument("--fresh", action="store_true", help="start every session again instead of resuming")
    parser.add_argument("--recheck", action="store_true",
                        help="run the last run's survivors again (after new tests; the module itself unchanged)")
    parser.add_argument("--report", action="store_true", help="only print the last run's table and survivors")
    args = parser.parse_args(argv)
    args.workdir = args.workdir.resolve()
    if not args.report:
        if shutil.which("cosmic-ray") is None:
            sys.exit("cosmic-ray is not installed: pip install -e '.[mutation]'")
        tree = prepare_tree(args.workdir)
        started = time.perf_counter()
        for name in args.modules:
            run_module(name, tree, args.workdir, args.fresh, args.recheck)
            print(f"{name} done at {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if report(args.workdir, args.modules) else 1


if __name__ == "__main__":
    sys.exit(main())
