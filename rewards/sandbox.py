"""Running model-written Python confined by the operating system, with the verdict decided outside it.

    run_tests(program, cases, setup, limits, helpers=..., entry_point=...) -> [1.0 or 0.0 per case]

Each run starts two processes (rewards/judge.py holds the code of both):

    confined   the model's program, inside bubblewrap (a maintained sandbox tool, Debian's `bubblewrap`):
               new pid, network, ipc and uts namespaces; a read-only view of the interpreter and the system
               libraries only (site-packages hidden, no project folder, no /etc, no host /tmp or /dev/shm), a
               private size-capped tmpfs as /tmp; no new privileges; a seccomp filter (no new namespaces, keyrings,
               ptrace, mounts, bpf, io_uring); a distinct unprivileged uid for each program running at once (when
               started as root); RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC; and a memory and process-count
               limit over its whole process tree (a cgroup, when one can be made)
    judge      trusted: the task's helpers, setup and test cases, with the functions the tests call as proxies
               into the confined process. What comes back is plain data, compared here.

The trainer reads every output pipe with a cap while it streams and kills both processes (and everything in the
sandbox's pid namespace and cgroup) at the wall deadline, so a call returns within `wall_seconds` plus about a
second at most (the clean-up) whatever the program does, and never raises for anything the program does.

`isolation()` says which layers this machine gives (most checked by running a probe in the sandbox); where
one is missing (no bubblewrap, not root, no writable cgroup), programs still run with what there is, the run's
first log line names what is missing, and `Limits(require_full_isolation=True)` (`--sandbox-isolation full`)
refuses to run them instead. docs/tools.md says what each missing layer leaves unstopped.
"""

from __future__ import annotations

import ast
import builtins
import fcntl
import glob
import json
import logging
import os
import selectors
import shutil
import secrets
import signal
import site
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

JUDGE_SOURCE = Path(__file__).with_name("judge.py").read_text()
FIRST_UID, UID_SLOTS = 1_862_270_976, 64  # one unprivileged uid per program running at once on this machine
logger = logging.getLogger("grpo.sandbox")
ISOLATION_CHOICES = ("available", "full")
LAYERS = ("bubblewrap", "pid_namespace", "network_namespace", "filesystem_view", "distinct_uid", "seccomp",
          "memory_cgroup", "process_cgroup", "resource_limits")


class SandboxUnavailable(ValueError):
    """Full isolation was required and this machine does not give it (a setting this machine cannot meet)."""


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_seconds: float = 10.0  # the whole run, every case included; the trainer kills everything then
    cpu_seconds: int = 5  # RLIMIT_CPU of each process in the sandbox
    memory_bytes: int = 1 << 30  # the sandbox's whole process tree (cgroup), and RLIMIT_AS of each process
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: the largest file it may write
    disk_bytes: int = 16 << 20  # the size of its private /tmp (its only writable folder)
    processes: int = 16  # its whole process tree (cgroup pids.max), and RLIMIT_NPROC of its uid
    output_bytes: int = 1 << 16  # of stdout and of stderr; a program that prints more is stopped
    result_bytes: int = 1 << 20  # the largest answer to one call the judge accepts
    audit_hook: bool = True  # an extra guard inside the confined process; the OS sandbox is the boundary
    require_full_isolation: bool = False  # refuse to run programs where a layer of `isolation()` is missing


@dataclass
class RunResult:
    """One program's outcome: a float per case, and what happened."""

    scores: list[float]
    timed_out: bool  # the judge was still running at the wall deadline
    stdout: str  # the program's, cut at limits.output_bytes
    stderr: str
    log: str  # the judge's: why each failed case failed


@dataclass(frozen=True)
class Isolation:
    """The layers this machine gives a confined program (LAYERS), and why each missing one is missing."""

    layers: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        return [name for name in LAYERS if not self.layers.get(name)]

    def describe(self) -> str:
        if not self.missing:
            return "code sandbox: full isolation (" + ", ".join(LAYERS) + ")"
        return "code sandbox: MISSING " + "; ".join(f"{name} ({self.reasons.get(name, 'not obtained')})"
                                                   for name in self.missing) + " -- docs/tools.md says what is then not stopped"


def check_isolation(functions, required: str = "available") -> Isolation | None:
    """For a run whose rewards or scorer run model-written programs (functions marked `runs_untrusted_code = True`,
    as rewards.code's are): log which layers this machine gives, a warning naming each missing one; with
    `required="full"`, raise SandboxUnavailable instead where one is missing. None when no function runs programs."""
    if not any(getattr(function, "runs_untrusted_code", False) for function in functions):
        return None
    layers = isolation()
    if layers.missing and required == "full":
        raise SandboxUnavailable(f"--sandbox-isolation full: {layers.describe()}")
    (logger.warning if layers.missing else logger.info)(layers.describe())
    return layers


def run_tests(program: str, cases: list[str], setup: str = "", limits: Limits = Limits(), *, helpers: str = "",
              entry_point: str | None = None) -> list[float]:
    """1.0 for each case (trusted code such as `assert add(2, 3) == 5`) that runs without an exception in the
    judge, after `helpers` and `setup`, with the program's functions called in the confined process; 0.0
    otherwise. Never raises for anything the program does."""
    return run_program(program, cases, setup, limits, helpers=helpers, entry_point=entry_point).scores


def run_program(program: str, cases: list[str], setup: str = "", limits: Limits = Limits(), *, helpers: str = "",
                entry_point: str | None = None) -> RunResult:
    """`run_tests` with the details: the program's output, the judge's log, the timeout. The wall limit counts from
    the start of the two processes (a program may first wait for a free uid slot)."""
    obtained = isolation()
    if limits.require_full_isolation and obtained.missing:
        raise SandboxUnavailable(obtained.describe())
    token = secrets.token_hex(8)  # verdict lines carry it: where no pid namespace hides the judge, a program
    job = {"program": program, "helpers": helpers or "", "setup": setup or "", "cases": list(cases), "token": token,
           "names": proxied_names(program, helpers, entry_point), "wall_seconds": limits.wall_seconds,
           "memory_bytes": limits.memory_bytes, "result_bytes": limits.result_bytes}
    with (_uid_slot() as uid, _Cgroup.make(limits) as cgroup,
          tempfile.TemporaryDirectory(prefix="grpo-sandbox-", ignore_cleanup_errors=True) as folder):
        if uid is not None:  # the working folder without bubblewrap (with it, a private tmpfs): the program's alone
            os.chown(folder, uid, uid)
        streams, timed_out = _run(job, limits, obtained.layers["bubblewrap"], uid, cgroup, folder)
    scores = [None] * len(cases)
    for line in streams["verdicts"].decode(errors="replace").splitlines():
        parts = line.split()  # `<token> case <index> <0|1>`; the first line for a case counts
        if len(parts) == 4 and parts[:2] == [token, "case"] and parts[2].isdigit() and int(parts[2]) < len(cases):
            scores[int(parts[2])] = scores[int(parts[2])] if scores[int(parts[2])] is not None else float(parts[3] == "1")
    text = {name: data.decode(errors="replace") for name, data in streams.items()}
    return RunResult([score or 0.0 for score in scores], timed_out, text["stdout"], text["stderr"], text["log"])


def _run(job: dict, limits: Limits, bubblewrap: bool, uid: int | None, cgroup: _Cgroup, folder: str):
    """Start the confined process and the judge, joined by two pipes; collect their output (`_collect`); kill both,
    the cgroup and the uid's processes whatever happens. Returns (streams, timed_out)."""
    fds, processes = [], []
    try:
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        fds += [requests_read, requests_write, answers_read, answers_write]
        seccomp_fd = _seccomp_fd() if bubblewrap else None
        fds += [seccomp_fd] if seccomp_fd is not None else []
        settings = {**_limit_settings(limits), "uid": uid, "unshare_net": not bubblewrap, "keyctl": _keyctl_number(),
                    "requests_fd": requests_read, "answers_fd": answers_write, "audit_hook": limits.audit_hook}
        command = cgroup.enter_command() + _confined_command(settings, limits, bubblewrap, seccomp_fd)
        processes.append(subprocess.Popen(
            command, cwd=folder, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=[requests_read, answers_write, *[seccomp_fd] * (seccomp_fd is not None)]))
        processes.append(subprocess.Popen(
            [sys.executable, "-I", "-c", JUDGE_SOURCE + "\njudge_main()\n"], env={}, cwd=folder,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(requests_write, answers_read), start_new_session=True))
        for fd in fds:
            os.close(fd)
        fds = []
        payload = json.dumps({**job, "requests_fd": requests_write, "answers_fd": answers_read}).encode()
        confined, judge = processes
        return _collect(judge, confined, payload, time.monotonic() + limits.wall_seconds + 0.5, limits.output_bytes,
                        verdict_bytes=64 * len(job["cases"]) + 256)
    finally:
        for fd in fds:
            os.close(fd)
        for process in processes:
            _kill_group(process.pid)
        cgroup.kill()
        if uid is not None:
            _kill_uid(uid)
        for process in processes:
            process.wait()


def proxied_names(program: str, helpers: str, entry_point: str | None) -> list[str]:
    """The names the tests may call in the program: the entry point where the task names one; else every top-level
    name the program binds, but for the problem's helpers (they stay the problem's own, run by the judge) and the
    builtins (a program's `abs` or `range` must not become the tests')."""
    def bound(code: str) -> set[str]:
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return set()
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
        return names

    if entry_point:
        return [entry_point]
    return sorted(bound(program) - bound(helpers or "") - set(dir(builtins)))


def _limit_settings(limits: Limits) -> dict:
    return {key: value for key, value in asdict(limits).items()
            if key in ("cpu_seconds", "memory_bytes", "file_bytes", "processes")}


def _collect(judge, confined, job: bytes, deadline: float, cap: int, verdict_bytes: int) -> tuple[dict, bool]:
    """Write the job to the judge and read every pipe until the judge exits (or the deadline), keeping at most `cap`
    bytes of each output and `verdict_bytes` of the verdicts: the rest is read and dropped, so neither a flood
    nor a process that holds a pipe open can grow the trainer's memory or hold up the call. A program that prints
    more than `cap` bytes is stopped there. Returns the streams, and whether the deadline came first."""
    kept = {"verdicts": b"", "log": b"", "stdout": b"", "stderr": b""}
    limits = {"verdicts": verdict_bytes, "log": cap, "stdout": cap, "stderr": cap}
    seen = dict.fromkeys(kept, 0)
    selector = selectors.DefaultSelector()
    for name, pipe in (("verdicts", judge.stdout), ("log", judge.stderr), ("stdout", confined.stdout),
                       ("stderr", confined.stderr)):
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ, name)
    os.set_blocking(judge.stdin.fileno(), False)
    selector.register(judge.stdin, selectors.EVENT_WRITE, "job")
    judge_open = 3  # the judge's stdin, stdout and stderr, until each reaches its end
    try:
        while judge_open and (remaining := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(min(remaining, 0.25)):
                name = key.data
                try:
                    if name == "job":
                        job = job[os.write(key.fileobj.fileno(), job):]
                        chunk = b"x" if job else b""
                    else:
                        chunk = os.read(key.fileobj.fileno(), 1 << 16)
                        kept[name] += chunk[: max(0, limits[name] - len(kept[name]))]
                        seen[name] += len(chunk)
                        if name in ("stdout", "stderr") and seen[name] > cap:
                            _kill_group(confined.pid)  # printing past the cap is over a limit, like CPU time
                except BlockingIOError:
                    continue
                except OSError:  # the judge closed its stdin early: it has failed
                    chunk = b""
                if not chunk:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    if name in ("job", "verdicts", "log"):
                        judge_open -= 1
    finally:
        selector.close()
        for pipe in (judge.stdin, judge.stdout, judge.stderr, confined.stdout, confined.stderr):
            if not pipe.closed:
                pipe.close()
    return kept, judge_open > 0


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (a slot's own uid: nothing else runs as it), until none is left."""
    for _ in range(100):
        found = False
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == uid:
                        found = True
                        os.kill(int(entry.name), signal.SIGKILL)
                except (FileNotFoundError, ProcessLookupError):
                    pass
        if not found:
            return
        time.sleep(0.01)


def _clear_keys(uid: int) -> None:
    """Empty the kernel keyrings of `uid` when a program left keys there (they outlive processes; the seccomp filter
    refuses keyrings, so this matters where it is missing): one short process as that uid, the confined side's own
    clearing (judge._fresh_keyrings)."""
    try:
        line = next((line for line in Path("/proc/key-users").read_text().splitlines()
                     if line.split(":")[0].strip() == str(uid)), "")
    except OSError:
        return
    fields = line.split()
    # beyond its user, user-session and persistent keyrings and the session keyring it joined (until the kernel's
    # garbage collection takes it, moments after the run)
    if len(fields) < 3 or int(fields[2].split("/")[0]) <= 4 or _keyctl_number() is None:
        return
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    clear = f"os.setgroups([]); os.setgid({uid}); os.setuid({uid}); _fresh_keyrings({_keyctl_number()})\n"
    command = [python, "-I", "-S", "-c", JUDGE_SOURCE + "\n" + clear]
    if isolation().layers["bubblewrap"]:  # where the interpreter may not be readable to that uid
        command = _bubblewrap_args(python, Limits(), root=True) + command
    try:
        subprocess.run(command, env={}, cwd="/", timeout=2, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
    except (subprocess.SubprocessError, OSError) as error:
        logger.warning("could not empty the keyrings of uid %d: %s", uid, error)


@contextmanager
def _uid_slot():
    """A uid of its own for this program (root only, else None): slot k of UID_SLOTS, held by a lock file in a
    root-owned folder, so that programs of other threads and processes on this machine never share one."""
    if os.geteuid() != 0:
        yield None
        return
    folder = Path("/run/grpo-sandbox")
    folder.mkdir(mode=0o700, exist_ok=True)
    status = os.lstat(folder)
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != 0 or status.st_mode & 0o022:
        raise RuntimeError(f"{folder} is not a folder that only root may write: refusing its lock files")
    while True:
        for slot in range(UID_SLOTS):
            fd = os.open(folder / str(slot), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            uid = FIRST_UID + slot
            try:
                _kill_uid(uid)  # a crashed earlier holder's leftovers
                yield uid
            finally:
                try:
                    _clear_keys(uid)
                finally:
                    os.close(fd)  # releases the lock
            return
        time.sleep(0.05)  # every slot busy: more than UID_SLOTS programs at once on this machine


# ---------------------------------------------------------------- the confined process's command
def _confined_command(settings: dict, limits: Limits, bubblewrap: bool, seccomp_fd: int | None) -> list[str]:
    """bubblewrap (when present) around `python -I -S -c judge.py confined_main() SETTINGS`."""
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    command = [python, "-I", "-S", "-B", "-c", JUDGE_SOURCE + "\nconfined_main()\n", json.dumps(settings)]
    if not bubblewrap:
        return command
    return _bubblewrap_args(python, limits, os.geteuid() == 0, seccomp_fd) + command


def _bubblewrap_args(python: str, limits: Limits, root: bool, seccomp_fd: int | None = None) -> list[str]:
    args = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
    if root:  # the confined process switches to its own uid itself, first thing (judge.confined_main)
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # an unprivileged user namespace: the caller's uid outside, no distinct uid
        args += ["--unshare-user", "--disable-userns"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for folder in _interpreter_folders(python):
        parents = [str(parent) for parent in reversed(Path(folder).parents) if str(parent) != "/"]
        for parent in parents:
            args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", folder, folder]
    hidden = _site_packages()
    for packages in hidden:  # the interpreter's installed packages: hidden under an empty tmpfs
        args += ["--tmpfs", packages]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(limits.disk_bytes),
             "--tmpfs", "/tmp", "--chdir", "/tmp"]
    # Read-only: the new root, /dev (its device nodes stay usable) and the hiding tmpfs, which in a user namespace
    # would belong to the program: /tmp is its only writable folder, and its size is the disk limit.
    for mount in ["/", "/dev", *hidden]:
        args += ["--remount-ro", mount]
    return [_bwrap()] + args[1:] + (["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else [])


@lru_cache(maxsize=1)
def _bwrap() -> str | None:
    """bubblewrap's path, found once on the trainer's PATH (programs start with an empty environment)."""
    return shutil.which("bwrap")


def _interpreter_folders(python: str) -> list[str]:
    """What the interpreter needs outside /usr: its prefix (executable, libpython, standard library)."""
    folders = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix), os.path.dirname(python)}
    folders = sorted(folder for folder in folders if not (folder + "/").startswith("/usr/"))
    return [folder for folder in folders if not any(folder.startswith(other + "/") for other in folders)]


def _site_packages() -> list[str]:
    """The base interpreter's package folders (site-packages, and Debian's dist-packages) that the read-only view
    would otherwise show."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
            "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=base)
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages([sys.base_prefix, sys.base_exec_prefix]),
                  *glob.glob("/usr/lib/python3*/dist-packages"), *glob.glob("/usr/local/lib/python3*/dist-packages"),
                  *glob.glob("/usr/local/lib/python3*/site-packages")]
    return sorted({os.path.realpath(path) for path in candidates if os.path.isdir(path)})


# ---------------------------------------------------------------- seccomp: system calls no program needs
REFUSED_CALLS = ("unshare", "setns", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv",
                 "process_vm_writev", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
                 "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                 "open_by_handle_at", "name_to_handle_at", "init_module", "finit_module", "delete_module", "kexec_load")
SYSCALLS = {  # machine: (AUDIT_ARCH, numbers of the refused calls, clone, clone3)
    "x86_64": (0xC000003E, (272, 308, 250, 248, 249, 101, 310, 311, 165, 166, 155, 428, 429, 430, 431, 432, 433, 442,
                            321, 298, 323, 425, 304, 303, 175, 313, 176, 246), 56, 435),
    "aarch64": (0xC00000B7, (97, 268, 219, 217, 218, 117, 270, 271, 40, 39, 41, 428, 429, 430, 431, 432, 433, 442, 280,
                             241, 282, 425, 265, 264, 105, 273, 106, 104), 220, 435),
}
CLONE_NEW_NAMESPACES = 0x7E020080  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A classic-BPF seccomp program for bubblewrap's --seccomp: EPERM for REFUSED_CALLS (new namespaces, keyrings,
    ptrace, mounts, bpf, perf, userfaultfd, io_uring, modules, kexec, file handles) and for clone with a CLONE_NEW*
    flag; ENOSYS for clone3, whose flags it cannot read (libc then falls back to clone); the x32 ABI refused; a
    foreign architecture killed. None on a machine without a table here (the `seccomp` layer is then missing)."""
    machine = machine or os.uname().machine
    if machine not in SYSCALLS:
        return None
    arch, refused, clone, clone3 = SYSCALLS[machine]
    # opcodes of linux/filter.h (BPF_LD|BPF_W|BPF_ABS; BPF_JMP|BPF_JEQ, JGE, JSET|BPF_K; BPF_RET|BPF_K), actions of
    # linux/seccomp.h (SECCOMP_RET_ALLOW, KILL_PROCESS, ERRNO | errno), AUDIT_ARCH_* of linux/audit.h
    load, jump_eq, jump_ge, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter

    program = [op(load, 4), op(jump_eq, arch, 1, 0), op(ret, kill), op(load, 0)]  # seccomp_data.arch, then .nr
    if machine == "x86_64":
        program += [op(jump_ge, 0x40000000, 0, 1), op(ret, eperm)]  # the x32 ABI's numbers
    for number in refused:
        program += [op(jump_eq, number, 0, 1), op(ret, eperm)]
    program += [op(jump_eq, clone3, 0, 1), op(ret, enosys),
                op(jump_eq, clone, 0, 3), op(load, 16), op(jump_set, CLONE_NEW_NAMESPACES, 0, 1), op(ret, eperm),
                op(ret, allow)]  # clone: args[0] (its flags), low 32 bits
    return b"".join(program)


def _keyctl_number() -> int | None:
    """keyctl's system-call number on this machine (judge._fresh_keyrings calls it through libc's syscall)."""
    machine = os.uname().machine
    return SYSCALLS[machine][1][REFUSED_CALLS.index("keyctl")] if machine in SYSCALLS else None


def _seccomp_fd() -> int | None:
    """A pipe's read end holding the filter (bubblewrap reads it), or None without one; the caller closes it."""
    program = seccomp_filter()
    if program is None:
        return None
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: within the pipe's buffer
    except OSError:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read


# ---------------------------------------------------------------- cgroups: memory and process count over the tree
class _Cgroup:
    """A cgroup for one program (v2, or v1's memory and pids hierarchies), or a stand-in that does nothing where
    none can be made. The confined process enters it before bubblewrap starts (`enter_command`)."""

    def __init__(self, folders: list[Path]):
        self.folders = folders

    @classmethod
    def make(cls, limits: Limits) -> _Cgroup:
        parents = _cgroup_parents()
        if not parents:
            return cls([])
        name = f"grpo-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        folders = []
        try:
            for kind, parent in parents.items():
                folder = parent / name
                folder.mkdir()
                folders.append(folder)
                if kind in ("v2", "memory"):
                    memory = "memory.max" if kind == "v2" else "memory.limit_in_bytes"
                    (folder / memory).write_text(str(limits.memory_bytes))
                    for swap in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                        if (folder / swap).exists():
                            (folder / swap).write_text("0" if swap == "memory.swap.max" else str(limits.memory_bytes))
                if kind in ("v2", "pids"):
                    (folder / "pids.max").write_text(str(limits.processes))
        except OSError:
            cls(folders).kill()
            raise
        return cls(folders)

    def __enter__(self) -> _Cgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def enter_command(self) -> list[str]:
        """A shell that writes its own pid into the cgroup, then execs the command: the process is in the cgroup
        before it can fork (preexec_fn is unsafe beside threads; moving it after Popen would race its children)."""
        if not self.folders:
            return []
        procs = [str(folder / "cgroup.procs") for folder in self.folders]
        return ["/bin/sh", "-c", 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; '
                                 'shift; exec "$@"', "sh", *procs, "--"]

    def kill(self) -> None:
        """SIGKILL whatever is still in the cgroup, then remove it."""
        for folder in self.folders:
            for _ in range(200):
                try:
                    pids = (folder / "cgroup.procs").read_text().split()
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.005)
            for _ in range(200):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy for a moment after its last process died
                    time.sleep(0.005)
        self.folders = []


@lru_cache(maxsize=1)
def _cgroup_parents() -> dict[str, Path]:
    """Where this process may make child cgroups with memory and pids limits: {"v2": dir} or {"memory": dir,
    "pids": dir} (v1), or {} where it may not (not root, read-only cgroupfs, controllers not delegated)."""
    try:
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return {}
    found = {}
    for fields in mounts:
        dash = fields.index("-")
        fstype, root, point, options = fields[dash + 1], fields[3], fields[4], fields[dash + 3].split(",")
        for kind in ("memory", "pids"):
            if fstype == "cgroup" and kind in options and kind in own:
                found[kind] = Path(point) / os.path.relpath(own[kind], root)
        if fstype == "cgroup2" and "" in own:
            folder = Path(point) / os.path.relpath(own[""], root)
            try:
                enabled = (folder / "cgroup.subtree_control").read_text().split()
            except OSError:
                enabled = []
            if {"memory", "pids"} <= set(enabled):
                found["v2"] = folder
    parents = {"v2": found["v2"]} if "v2" in found else {k: found[k] for k in ("memory", "pids") if k in found}
    if set(parents) not in ({"v2"}, {"memory", "pids"}):
        return {}
    try:  # writable? make and remove a probe
        for parent in parents.values():
            probe = parent / f"grpo-sandbox-probe-{os.getpid()}"
            probe.mkdir()
            probe.rmdir()
    except OSError:
        return {}
    return parents


# ---------------------------------------------------------------- what this machine gives
PROBE = r'''
import ctypes, json, os, socket
facts = {"pid": os.getpid(), "uid": os.getuid(), "interfaces": [name for _, name in socket.if_nameindex()],
         "root_entries": sorted(os.listdir("/")), "sees_project": os.path.exists(%r),
         "no_new_privs": open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0] == "1",
         "seccomp": open("/proc/self/status").read().split("Seccomp:")[1].split()[0] == "2",
         "writes_outside_tmp": [],
         "new_user_namespace": ctypes.CDLL(None).unshare(0x10000000) == 0}
try:
    facts["site_packages"] = [p for p in %r if os.listdir(p)]
except OSError:
    facts["site_packages"] = []
for folder in ["/", "/dev", *%r]:
    try:
        open(os.path.join(folder, "probe"), "w").close()
        facts["writes_outside_tmp"].append(folder)
    except OSError:
        pass
print(json.dumps(facts))
'''


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """The layers a program gets on this machine: the namespaces, the view, the uid and the filter checked by a probe
    run the way programs are run; the cgroups by making one; the resource limits need no privilege."""
    layers, reasons = dict.fromkeys(LAYERS, False), {}
    layers["resource_limits"] = True  # setrlimit needs no privilege
    bubblewrap = _bwrap()
    if not bubblewrap:
        reasons["bubblewrap"] = "bwrap is not installed (Debian: apt-get install bubblewrap)"
    root = os.geteuid() == 0
    if not root:
        reasons["distinct_uid"] = "not root: every program runs as the trainer's uid"
    parents = _cgroup_parents()
    layers["memory_cgroup"] = layers["process_cgroup"] = bool(parents)
    if not parents:
        reasons["memory_cgroup"] = reasons["process_cgroup"] = (
            "no cgroup this process may make children in with the memory and pids controllers (root, and cgroup v1's "
            "hierarchies or a v2 subtree delegated with those controllers on): the memory and process limits are "
            "per process (RLIMIT_AS, RLIMIT_NPROC), not over the tree")
    project = str(Path(__file__).resolve().parent)
    if bubblewrap:
        limits, probe_uid = Limits(), FIRST_UID + UID_SLOTS  # a uid outside the slots
        probe = PROBE % (project, _site_packages(), _site_packages())
        switch = f"import os; os.setgroups([]); os.setgid({probe_uid}); os.setuid({probe_uid})\n" if root else ""
        python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        seccomp_fd = _seccomp_fd()
        command = _bubblewrap_args(python, limits, root, seccomp_fd) + [python, "-I", "-S", "-B", "-c", switch + probe]
        try:
            done = subprocess.run(command, capture_output=True, timeout=20, env={},
                                  pass_fds=[seccomp_fd] * (seccomp_fd is not None))
            facts = json.loads(done.stdout.decode().strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as error:
            reasons["bubblewrap"] = f"bwrap did not run the probe: {error}"
            facts = None
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        if facts:
            layers["bubblewrap"] = True
            layers["pid_namespace"] = facts["pid"] <= 3
            layers["network_namespace"] = facts["interfaces"] in ([], ["lo"])
            layers["filesystem_view"] = not (facts["sees_project"] or facts["site_packages"] or facts["writes_outside_tmp"]
                                             or {"home", "etc"} & set(facts["root_entries"]))
            layers["distinct_uid"] = root and facts["uid"] == probe_uid and facts["no_new_privs"]
            layers["seccomp"] = facts["seccomp"] and not facts["new_user_namespace"]
            if seccomp_filter() is None:
                reasons["seccomp"] = f"no system-call table for {os.uname().machine} in rewards/sandbox.py"
            for name in ("pid_namespace", "network_namespace", "filesystem_view", "distinct_uid", "seccomp"):
                if not layers[name] and name not in reasons:
                    reasons[name] = f"the probe saw {facts}"
    if not layers["bubblewrap"]:
        for name in ("pid_namespace", "network_namespace", "filesystem_view", "seccomp"):
            reasons.setdefault(name, "needs bubblewrap")
        layers["distinct_uid"] = root  # confined_main switches to the slot's uid itself
    return Isolation(layers, reasons)
