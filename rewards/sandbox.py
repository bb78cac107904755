"""Running model-written Python in a separate, confined process: one float per test case, never an exception.

    run_tests(code, cases, setup="", limits=Limits()) -> [1.0 or 0.0 per case]

Each program runs in a fresh `python -I` process (isolated mode: no user site, no PYTHON* variables) whose
bootstrap confines itself before it reads the program:

    limits      RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space), RLIMIT_FSIZE (bytes written to a file),
                RLIMIT_NOFILE, no core files; a wall-clock deadline in the parent, which kills the whole
                process group (start_new_session) when it passes
    network     a new, empty network namespace (unshare(CLONE_NEWNET)) where the kernel allows it: no
                interface but a down loopback, so every connect fails
    user        when started as root: setgid/setuid to nobody (65534), with RLIMIT_NPROC, so a fork bomb
                stops at a few processes and files only root may read stay closed
    files       a fresh temporary working directory (removed after), an empty environment; common standard
                modules (math, re, collections, typing, ...) are imported before the user switch, since the
                interpreter's folders may not be readable to nobody
    audit hook  installed before the program runs (sys.addaudithook, which a program cannot remove):
                refuses opening files outside the working directory and the interpreter's own library
                folders, process creation (os.system, os.fork, subprocess, os.exec*, os.spawn*, posix_spawn),
                sockets, ctypes, os.kill, and frame inspection (sys._getframe) that could read the
                bootstrap's result key

The audit hook is a guard rail, not a boundary: Python's documentation says so, and a C extension could get
around it. The boundary is the process with its limits, its namespace and its user; what was obtained is in
`isolation()` (the network namespace and the user switch need root, or they are skipped and said so). For
untrusted code at scale, run the trainer itself in a container or gVisor.

Results are streamed: the bootstrap prints a line with a random key (read from stdin, never in the program's
namespace) after each case, so cases passed before a timeout or crash still count. A program that exits,
hangs, raises at import, or prints a fake result line gets 0.0 for the cases it did not really pass.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_seconds: float = 10.0  # the parent's deadline for the whole program, every case included
    cpu_seconds: int = 5  # RLIMIT_CPU
    memory_bytes: int = 1 << 30  # RLIMIT_AS: address space (a 10 GB allocation fails with MemoryError)
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file it may write
    output_bytes: int = 1 << 16  # stdout / stderr kept
    processes: int = 8  # RLIMIT_NPROC of the nobody user (when started as root)
    audit_hook: bool = True  # off only to test the process limits on their own (tests/test_code_rewards.py)


BOOTSTRAP = r'''
import ctypes, json, os, resource, sys
key, limits = sys.stdin.readline().strip(), json.loads(sys.argv[1])
for name, value in (("RLIMIT_CPU", limits["cpu_seconds"]), ("RLIMIT_AS", limits["memory_bytes"]),
                    ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
isolation = {"network_namespace": False, "user": "unchanged"}
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET
    isolation["network_namespace"] = True
PRELOAD = ("math", "cmath", "re", "string", "collections", "itertools", "functools", "heapq", "bisect", "typing",
           "fractions", "decimal", "statistics", "random", "hashlib", "json", "copy", "operator", "datetime",
           "enum", "dataclasses", "array", "textwrap", "numbers", "unicodedata", "traceback", "socket", "encodings.idna")
for name in PRELOAD:  # imported while the interpreter's folders are still readable (they may not be to nobody)
    __import__(name)
if os.getuid() == 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    isolation["user"] = "nobody"
print(key, "isolation", json.dumps(isolation), flush=True)
here = os.path.realpath(os.getcwd())
readable = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
BLOCKED = ("os.system", "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "subprocess.Popen",
           "socket.", "ctypes.", "os.kill", "os.killpg", "sys._getframe", "sys._current_frames", "os.putenv",
           "os.chdir", "os.chmod", "os.chown", "os.link", "os.symlink", "shutil.")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DENIED_MODULES = ("ctypes", "_ctypes", "socket", "_socket", "subprocess", "multiprocessing", "gc", "inspect")
def guard(event, args, write=os.write, realpath=os.path.realpath):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in DENIED_MODULES:
        raise PermissionError(f"sandbox: import {args[0]} is not allowed")
    if event == "open" and isinstance(args[0], (str, bytes)):
        path = realpath(args[0] if isinstance(args[0], str) else args[0].decode(errors="replace"))
        writing = bool(args[2] & WRITE_FLAGS) if len(args) > 2 and isinstance(args[2], int) else True
        if not (path == here or path.startswith(here + os.sep)) and (writing or not path.startswith(readable)):
            raise PermissionError(f"sandbox: opening {path} is not allowed")
program, cases, setup = json.loads(sys.stdin.read())
del libc
for name in [name for name in sys.modules if name.split(".")[0] in ("ctypes", "_ctypes")]:
    del sys.modules[name]  # a program's `import ctypes` is then a new import, which the hook refuses
if limits["audit_hook"]:
    sys.addaudithook(guard)
namespace = {"__name__": "__main__"}
def report(index, passed):
    sys.__stdout__.write(f"{key} case {index} {int(passed)}\n"); sys.__stdout__.flush()
try:
    exec(compile(program, "program.py", "exec"), namespace)
    exec(compile(setup, "setup.py", "exec"), namespace)
except BaseException as error:
    print(f"program failed: {type(error).__name__}: {error}", file=sys.__stderr__)
    os._exit(0)
for index, case in enumerate(cases):
    try:
        exec(compile(case, f"case{index}.py", "exec"), namespace)
        report(index, True)
    except BaseException as error:
        print(f"case {index}: {type(error).__name__}: {error}", file=sys.__stderr__)
        report(index, False)
os._exit(0)
'''


@dataclass
class RunResult:
    """One program's outcome: a float per case, and what happened."""

    scores: list[float]
    timed_out: bool
    returncode: int | None
    stdout: str
    stderr: str
    isolation: dict


def run_tests(code: str, cases: list[str], setup: str = "", limits: Limits = Limits()) -> list[float]:
    """1.0 for each case (a snippet such as `assert f(2) == 4`) that ran without an exception after the
    program and `setup`, 0.0 otherwise; a program that fails to start, hangs or crashes scores 0 on the cases
    it had not passed. Never raises for anything the program does."""
    return run_program(code, cases, setup, limits).scores


def run_program(code: str, cases: list[str], setup: str = "", limits: Limits = Limits()) -> RunResult:
    """`run_tests` with the details: stdout / stderr (cut at limits.output_bytes), timeout, isolation."""
    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as folder:
        os.chmod(folder, 0o777)  # the nobody user works in it
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", BOOTSTRAP, json.dumps(asdict(limits))], cwd=folder, env={},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        payload = key + "\n" + json.dumps([code, list(cases), setup])
        timed_out = False
        try:
            stdout, stderr = process.communicate(payload.encode(), timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
        except BrokenPipeError:  # it died before reading its input
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
        _kill_group(process.pid)  # anything it left behind in its session
    scores, isolation = [0.0] * len(cases), {}
    for line in stdout.decode(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == key:
            if parts[1] == "isolation":
                isolation = json.loads(line.split(" ", 2)[2])
            elif parts[1] == "case" and len(parts) == 4 and parts[2].isdigit() and int(parts[2]) < len(cases):
                scores[int(parts[2])] = float(parts[3] == "1")

    def text(data: bytes) -> str:
        return data[: limits.output_bytes].decode(errors="replace").replace(key, "<key>")

    return RunResult(scores, timed_out, process.returncode, text(stdout), text(stderr), isolation)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@lru_cache(maxsize=1)
def isolation() -> dict:
    """What confinement this machine gives a program (network namespace, user), found by running one."""
    return run_program("", [], "").isolation
