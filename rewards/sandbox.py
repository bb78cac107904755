"""Running model-written Python confined by the operating system, with the verdict decided outside it.

    run_tests(program, cases, setup, limits, helpers=..., entry_point=...) -> [1.0 or 0.0 per case]

Each run starts two processes (rewards/judge.py holds the code of both), joined by a control socket:

    confined   inside bubblewrap (a maintained sandbox tool, Debian's `bubblewrap`): new pid, network, ipc and uts
               namespaces; a read-only view of the interpreter and the system libraries only (site-packages hidden, no
               project folder, no /etc, no host /tmp or /dev/shm); no new privileges; a distinct unprivileged uid for
               each program running at once (when started as root); a memory and process-count limit over its whole
               process tree (a cgroup, when one can be made). Its first process, the zygote, runs only trusted code: for
               each test case it forks a case process into new pid, mount and ipc namespaces with its own /tmp (a
               size- and file-capped tmpfs) and /proc, which sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE and
               RLIMIT_NPROC, drops to the uid, installs the seccomp filter (seccomp_filter) and only then imports the
               program and answers that case's calls. A program's state lives for one case.
    judge      trusted: the task's helpers, setup and test cases, with the functions the tests call as proxies
               into the case's process. What comes back is plain data, compared here.

The trainer reads every output pipe with a cap while it streams and kills both processes (and everything in the
sandbox's pid namespace and cgroup) at the wall deadline; every write of the judge has that deadline too. A call
returns within `wall_seconds` plus about a second at most whatever the program does, and never raises for anything
the program does; clean-up that takes longer (processes still exiting, a cgroup still busy) goes on in a janitor
thread that never gives up (`_later`).

`isolation()` says which layers this machine gives (checked by running a probe program the way programs run); where
one is missing (no bubblewrap, not root, no writable cgroup), programs still run with what there is, the run's
first log line names what is missing, and `Limits(require_full_isolation=True)` (`--sandbox-isolation full`)
refuses to run them instead; where no program can run at all (`Isolation.refusal`), every run refuses with the
reason. docs/tools.md says what each missing layer leaves unstopped.
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
import socket
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from rewards.judge import ANSWERS_FD, REQUESTS_FD

JUDGE_SOURCE = Path(__file__).with_name("judge.py").read_text()
FIRST_UID, UID_SLOTS = 1_862_270_976, 64  # one unprivileged uid per program running at once on this machine
logger = logging.getLogger("grpo.sandbox")
ISOLATION_CHOICES = ("available", "full")
LAYERS = ("bubblewrap", "pid_namespace", "network_namespace", "filesystem_view", "distinct_uid", "seccomp",
          "fresh_case_state", "memory_cgroup", "process_cgroup", "resource_limits")


class SandboxUnavailable(ValueError):
    """Full isolation was required and this machine does not give it (a setting this machine cannot meet)."""


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_seconds: float = 10.0  # the whole run, every case included; the trainer kills everything then
    cpu_seconds: int = 5  # RLIMIT_CPU of each case process; no case starts once the cases together used it
    memory_bytes: int = 1 << 30  # the sandbox's whole process tree (cgroup), and RLIMIT_AS of each process
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: the largest file it may write
    disk_bytes: int = 16 << 20  # the size of each case's private /tmp (its only writable folder)
    tmp_files: int = 4096  # files and folders that /tmp may hold: bounds the kernel's teardown of it
    processes: int = 16  # its whole process tree (cgroup pids.max), and RLIMIT_NPROC of its uid
    output_bytes: int = 1 << 16  # of stdout and of stderr; a program that prints more is stopped
    result_bytes: int = 1 << 20  # the largest answer to one call the judge accepts
    call_seconds: float = 2.0  # a generated group's call answers within this, or its process is started anew
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
    refusal: str = ""  # why no program can run here at all, where that is so (run_program and check_isolation raise)

    @property
    def missing(self) -> list[str]:
        return [name for name in LAYERS if not self.layers.get(name)]

    def describe(self) -> str:
        if not self.missing:
            return "code sandbox: full isolation (" + ", ".join(LAYERS) + ")"
        missing = "; ".join(f"{name} ({self.reasons.get(name, 'not obtained')})" for name in self.missing)
        return f"code sandbox: MISSING {missing} -- docs/tools.md says what is then not stopped"


def check_isolation(functions, required: str = "available") -> Isolation | None:
    """For a run whose rewards or scorer run model-written programs (functions marked `runs_untrusted_code = True`,
    as rewards.code's are): log which layers this machine gives, a warning naming each missing one; with
    `required="full"`, raise SandboxUnavailable instead where one is missing. None when no function runs programs."""
    if not any(getattr(function, "runs_untrusted_code", False) for function in functions):
        return None
    layers = isolation()
    if layers.refusal:
        raise SandboxUnavailable(layers.refusal)
    if layers.missing and required == "full":
        raise SandboxUnavailable(f"--sandbox-isolation full: {layers.describe()}")
    (logger.warning if layers.missing else logger.info)(layers.describe())
    return layers


def run_tests(program: str, cases: list[str], setup: str = "", limits: Limits = Limits(), *, helpers: str = "",
              entry_point: str | None = None, groups: list | None = None) -> list[float]:
    """1.0 for each case (trusted code such as `assert add(2, 3) == 5`) that runs without an exception in the
    judge, after `helpers` and `setup`, with the program's functions called in the confined process; 0.0
    otherwise. Then 1.0 for each group of `groups` whose calls [args, kwargs, expected] (plain data as
    rewards.judge.to_plain encodes it) of `entry_point` all answer the expected output; the groups share one case
    process (rewards.judge.run_groups). Never raises for anything the program does."""
    return run_program(program, cases, setup, limits, helpers=helpers, entry_point=entry_point, groups=groups).scores


def run_program(program: str, cases: list[str], setup: str = "", limits: Limits = Limits(), *, helpers: str = "",
                entry_point: str | None = None, groups: list | None = None) -> RunResult:
    """`run_tests` with the details: the program's output, the judge's log, the timeout. The wall limit counts from
    the start of the two processes (a program may first wait for a free uid slot)."""
    if groups and not entry_point:
        raise ValueError("groups of calls need the entry point they call")
    obtained = isolation()
    if obtained.refusal:
        raise SandboxUnavailable(obtained.refusal)
    if limits.require_full_isolation and obtained.missing:
        raise SandboxUnavailable(obtained.describe())
    token = secrets.token_hex(8)  # verdict lines carry it: where no pid namespace hides the judge, a program
    job = {"program": program, "helpers": helpers or "", "setup": setup or "", "cases": list(cases), "token": token,
           "names": proxied_names(program, helpers, entry_point), "wall_seconds": limits.wall_seconds,
           "memory_bytes": limits.memory_bytes, "result_bytes": limits.result_bytes, "groups": list(groups or []),
           "entry_point": entry_point, "call_seconds": limits.call_seconds}
    with (_uid_slot() as uid, _Cgroup.make(limits) as cgroup,
          tempfile.TemporaryDirectory(prefix="grpo-sandbox-", ignore_cleanup_errors=True) as folder):
        if uid is not None:  # the working folder without bubblewrap (with it, a private tmpfs): the program's alone
            os.chown(folder, uid, uid)
        streams, timed_out = _run(job, limits, obtained.layers["bubblewrap"], uid, cgroup, folder,
                                  require_namespaces=obtained.layers["fresh_case_state"])
    scores = [None] * (len(cases) + len(job["groups"]))
    for line in streams["verdicts"].decode(errors="replace").splitlines():
        parts = line.split()  # `<token> case <index> <0|1>`; the first line for a case counts
        if len(parts) == 4 and parts[:2] == [token, "case"] and parts[2].isdigit() and int(parts[2]) < len(scores):
            case = int(parts[2])
            scores[case] = scores[case] if scores[case] is not None else float(parts[3] == "1")
    text = {name: data.decode(errors="replace") for name, data in streams.items()}
    return RunResult([score or 0.0 for score in scores], timed_out, text["stdout"], text["stderr"], text["log"])


def _run(job: dict, limits: Limits, bubblewrap: bool, uid: int | None, cgroup: _Cgroup, folder: str,
         require_namespaces: bool = False):
    """Start the confined side and the judge, joined by a control socket; collect their output (`_collect`); kill
    both, the cgroup and the uid's processes whatever happens. `require_namespaces`: a case whose namespaces cannot
    be made is not run (the probe found that they can). Returns (streams, timed_out)."""
    processes, control = [], socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        program = seccomp_filter()
        settings = {**_limit_settings(limits), "uid": uid, "unshare_net": not bubblewrap,
                    "keyctl": _syscall_number("keyctl"), "capset": _syscall_number("capset"),
                    "require_namespaces": require_namespaces,
                    "control_fd": control[0].fileno(), "requests_fd": REQUESTS_FD,
                    "answers_fd": ANSWERS_FD, "audit_hook": limits.audit_hook,
                    "seccomp": program.hex() if program else ""}
        command = cgroup.enter_command() + _confined_command(settings, limits, bubblewrap)
        processes.append(subprocess.Popen(
            command, cwd=folder, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=[control[0].fileno()]))
        processes.append(subprocess.Popen(
            [sys.executable, "-I", "-c", JUDGE_SOURCE + "\njudge_main()\n"], env={}, cwd=folder,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=[control[1].fileno()], start_new_session=True))
        payload = json.dumps({**job, "control_fd": control[1].fileno()}).encode()
        for end in control:
            end.close()
        confined, judge = processes
        return _collect(judge, confined, payload, time.monotonic() + limits.wall_seconds + 0.5,
                        limits.output_bytes, verdict_bytes=64 * (len(job["cases"]) + len(job["groups"])) + 256)
    finally:
        deadline = time.monotonic() + CLEANUP_SECONDS
        for end in control:
            end.close()
        for process in processes:
            _kill_group(process.pid)
        cgroup.kill(deadline)
        for process in processes:
            _reap(process, deadline)


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
            if key in ("cpu_seconds", "memory_bytes", "file_bytes", "processes", "disk_bytes", "tmp_files")}


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


def _kill_uid(uid: int, deadline: float | None = None) -> bool:
    """SIGKILL every process of `uid` (a slot's own uid: nothing else runs as it) until none is left (True) or
    `deadline` (time.monotonic) passes (False)."""
    while True:
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
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _clear_keys(uid: int) -> None:
    """Empty the kernel keyrings of `uid` when a program left keys there (they outlive processes): one short process
    as that uid, the confined side's own clearing (judge._fresh_keyrings). Only where there is no seccomp filter:
    every case process installs it before the program runs, and it refuses every keyring call, so no program can
    have stored a key (the uid's count then holds the session keyrings its cases joined, which the kernel collects)."""
    if seccomp_filter() is not None:
        return
    try:
        line = next((line for line in Path("/proc/key-users").read_text().splitlines()
                     if line.split(":")[0].strip() == str(uid)), "")
    except OSError:
        return
    fields = line.split()
    # beyond its user, user-session and persistent keyrings and the session keyring it joined (until the kernel's
    # garbage collection takes it, moments after the run)
    if len(fields) < 3 or int(fields[2].split("/")[0]) <= 4 or _syscall_number("keyctl") is None:
        return
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    clear = f"os.setgroups([]); os.setgid({uid}); os.setuid({uid}); _fresh_keyrings({_syscall_number('keyctl')})\n"
    command = [python, "-I", "-S", "-c", JUDGE_SOURCE + "\n" + clear]
    if _bwrap():  # where the interpreter may not be readable to that uid
        command = _bubblewrap_args(python, Limits(), root=True) + command
    try:
        subprocess.run(command, env={}, cwd="/", timeout=2, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
    except (subprocess.SubprocessError, OSError) as error:
        logger.warning("could not empty the keyrings of uid %d: %s", uid, error)


@contextmanager
def _uid_slot():
    """A uid of its own for this program (root only, else None): slot k of UID_SLOTS, held by a lock file in a
    root-owned folder, so that programs of other threads and processes on this machine never share one. The slot is
    released once no process of its uid is left (by the janitor, where that takes longer than CLEANUP_SECONDS)."""
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

            def give_back() -> None:
                try:
                    _clear_keys(uid)
                finally:
                    os.close(fd)  # releases the lock

            def release() -> bool:
                """The janitor's task: once no process of the uid is left, give the slot back."""
                if not _kill_uid(uid, deadline=time.monotonic()):
                    return False
                give_back()
                return True

            if not _kill_uid(uid, deadline=time.monotonic() + 1.0):  # a crashed earlier holder's leftovers
                os.close(fd)  # that will not die (yet): another slot
                continue
            try:
                yield uid
            finally:
                if _kill_uid(uid, deadline=time.monotonic() + CLEANUP_SECONDS):
                    give_back()
                else:
                    _later(release)
            return
        time.sleep(0.05)  # every slot busy: more than UID_SLOTS programs at once on this machine


# ---------------------------------------------------------------- the confined process's command
def _confined_command(settings: dict, limits: Limits, bubblewrap: bool) -> list[str]:
    """bubblewrap (when present) around `python -I -S -c judge.py confined_main() SETTINGS`."""
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    command = [python, "-I", "-S", "-B", "-u", "-c", JUDGE_SOURCE + "\nconfined_main()\n", json.dumps(settings)]
    if not bubblewrap:
        return command
    return _bubblewrap_args(python, limits, os.geteuid() == 0) + command


def _bubblewrap_args(python: str, limits: Limits, root: bool) -> list[str]:
    """The confined side's view. Its zygote keeps CAP_SYS_ADMIN to make each case's namespaces and mounts, and (as
    root) CAP_SETUID/CAP_SETGID to drop to the program's uid and CAP_KILL to end a case's process of that uid; the
    case process gives up every capability before the program runs (rewards.judge._case_main)."""
    args = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN"]
    if root:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
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
    # would belong to the program. Each case mounts its own /tmp over this one (its only writable folder).
    for mount in ["/", "/dev", *hidden]:
        args += ["--remount-ro", mount]
    return [_bwrap()] + args[1:]


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
REFUSED_CALLS = (  # EPERM
    # namespaces, keyrings, tracing, mounts, the kernel's riskier interfaces, modules, file handles
    "unshare", "setns", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "mount",
    "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "open_by_handle_at", "name_to_handle_at", "init_module",
    "finit_module", "delete_module", "kexec_load",
    # SysV and POSIX message-queue IPC: objects that outlive the processes that made them
    "shmget", "shmat", "shmctl", "semget", "semop", "semtimedop", "semctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    # the page cache as a channel between programs: evicting another's pages, and probing which pages are cached
    "fadvise64", "mincore", "readahead", "cachestat", "process_madvise", "io_setup", "io_submit",
    # another process's descriptors
    "pidfd_getfd")
SYSCALL_NUMBERS = {  # machine: (AUDIT_ARCH of linux/audit.h, {name: number})
    "x86_64": (0xC000003E, dict(
        unshare=272, setns=308, keyctl=250, add_key=248, request_key=249, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, mount=165, umount2=166, pivot_root=155, open_tree=428, move_mount=429, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, bpf=321, perf_event_open=298, userfaultfd=323,
        io_uring_setup=425, open_by_handle_at=304, name_to_handle_at=303, init_module=175, finit_module=313,
        delete_module=176, kexec_load=246, shmget=29, shmat=30, shmctl=31, semget=64, semop=65, semtimedop=220,
        semctl=66, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240, mq_unlink=241, mq_timedsend=242,
        mq_timedreceive=243, mq_notify=244, mq_getsetattr=245, fadvise64=221, mincore=27, readahead=187,
        cachestat=451, process_madvise=440, io_setup=206, io_submit=209, clone=56, clone3=435, socket=41,
        socketpair=53, madvise=28, preadv2=327, pwritev2=328, pidfd_getfd=438, capset=126)),
    "aarch64": (0xC00000B7, dict(
        unshare=97, setns=268, keyctl=219, add_key=217, request_key=218, ptrace=117, process_vm_readv=270,
        process_vm_writev=271, mount=40, umount2=39, pivot_root=41, open_tree=428, move_mount=429, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, bpf=280, perf_event_open=241, userfaultfd=282,
        io_uring_setup=425, open_by_handle_at=265, name_to_handle_at=264, init_module=105, finit_module=273,
        delete_module=106, kexec_load=104, shmget=194, shmat=196, shmctl=195, semget=190, semop=193, semtimedop=192,
        semctl=191, msgget=186, msgsnd=189, msgrcv=188, msgctl=187, mq_open=180, mq_unlink=181, mq_timedsend=182,
        mq_timedreceive=183, mq_notify=184, mq_getsetattr=185, fadvise64=223, mincore=232, readahead=213,
        cachestat=451, process_madvise=440, io_setup=0, io_submit=2, clone=220, clone3=435, socket=198,
        socketpair=199, madvise=233, preadv2=286, pwritev2=287, pidfd_getfd=438, capset=91)),
}
CLONE_NEW_NAMESPACES = 0x7E020080  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
ALLOWED_SOCKET_FAMILIES = (1,)  # AF_UNIX: its sockets live and die with the case's processes
REFUSED_MADVICE = (20, 21)  # MADV_COLD, MADV_PAGEOUT: reclaim file pages that other processes may have cached
RWF_NOWAIT = 0x8  # preadv2/pwritev2: fail instead of reading from disk, which tells whether a page is cached


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A classic-BPF seccomp program, installed by each case process on itself (rewards.judge._install_seccomp):
    EPERM for REFUSED_CALLS and for clone with a CLONE_NEW* flag; ENOSYS for clone3, whose flags it cannot read (libc
    then falls back to clone); EAFNOSUPPORT for a socket of any family but ALLOWED_SOCKET_FAMILIES (no AF_INET in the
    empty network namespace, no netlink, no AF_VSOCK, which no network namespace confines); EPERM for madvise's
    REFUSED_MADVICE; EOPNOTSUPP for preadv2/pwritev2 with RWF_NOWAIT; the x32 ABI refused; a foreign architecture
    killed. None on a machine without a table here (the `seccomp` layer is then missing)."""
    machine = machine or os.uname().machine
    if machine not in SYSCALL_NUMBERS:
        return None
    arch, number = SYSCALL_NUMBERS[machine]
    # opcodes of linux/filter.h (BPF_LD|BPF_W|BPF_ABS; BPF_JMP|BPF_JEQ, JGE, JSET|BPF_K; BPF_RET|BPF_K), actions of
    # linux/seccomp.h (SECCOMP_RET_ALLOW, KILL_PROCESS, ERRNO | errno); struct seccomp_data: nr at 0, arch at 4,
    # args[i] at 16 + 8 i (the low 32 bits on a little-endian machine)
    load, jump_eq, jump_ge, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys, eopnotsupp, eafnosupport = (0x00050000 | errno for errno in (1, 38, 95, 97))

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter

    def argument(index: int) -> bytes:
        return op(load, 16 + 8 * index)

    def when(call: str, *block: bytes) -> list[bytes]:
        """`block` (which ends in a return) for system call `call`; the next check otherwise."""
        return [op(jump_eq, number[call], 0, len(block)), *block]

    program = [op(load, 4), op(jump_eq, arch, 1, 0), op(ret, kill), op(load, 0)]
    if machine == "x86_64":
        program += [op(jump_ge, 0x40000000, 0, 1), op(ret, eperm)]  # the x32 ABI's numbers
    for call in REFUSED_CALLS:
        program += when(call, op(ret, eperm))
    program += when("clone3", op(ret, enosys))
    program += when("clone", argument(0), op(jump_set, CLONE_NEW_NAMESPACES, 0, 1), op(ret, eperm), op(ret, allow))
    for call in ("socket", "socketpair"):  # args[0]: the family
        families = [op(jump_eq, family, len(ALLOWED_SOCKET_FAMILIES) - i, 0)
                    for i, family in enumerate(ALLOWED_SOCKET_FAMILIES)]
        program += when(call, argument(0), *families, op(ret, eafnosupport), op(ret, allow))
    advice = [op(jump_eq, value, len(REFUSED_MADVICE) - i, 0) for i, value in enumerate(REFUSED_MADVICE)]
    program += when("madvise", argument(2), *advice, op(ret, allow), op(ret, eperm))
    for call in ("preadv2", "pwritev2"):  # args[5]: the RWF_* flags
        program += when(call, argument(5), op(jump_set, RWF_NOWAIT, 0, 1), op(ret, eopnotsupp), op(ret, allow))
    return b"".join(program + [op(ret, allow)])


def _syscall_number(name: str) -> int | None:
    """A system call's number on this machine (the confined side calls keyctl and capset through libc's syscall)."""
    machine = os.uname().machine
    return SYSCALL_NUMBERS[machine][1][name] if machine in SYSCALL_NUMBERS else None



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
        cls.sweep()
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

    def kill(self, deadline: float | None = None) -> None:
        """SIGKILL whatever is still in the cgroup and remove it, until `deadline` (time.monotonic; None: now plus
        CLEANUP_SECONDS); what is not gone by then is handed to the janitor, which keeps trying."""
        deadline = time.monotonic() + CLEANUP_SECONDS if deadline is None else deadline
        folders, self.folders = self.folders, []
        for folder in folders:
            while not _remove_cgroup(folder):
                if time.monotonic() > deadline:
                    _later(lambda folder=folder: _remove_cgroup(folder))
                    break
                time.sleep(0.005)

    @staticmethod
    def sweep() -> None:
        """Remove the cgroups that a trainer which died mid-run left behind (named after its pid, which is gone)."""
        for parent in _cgroup_parents().values():
            for folder in parent.glob("grpo-sandbox-*-*"):
                owner = folder.name.split("-")[2]
                if owner.isdigit() and not Path(f"/proc/{owner}").exists() and folder not in _swept:
                    _swept.add(folder)
                    _later(lambda folder=folder: _remove_cgroup(folder))


def _remove_cgroup(folder: Path) -> bool:
    """One attempt: SIGKILL every process in the cgroup, then remove it. True once it is gone."""
    try:
        pids = (folder / "cgroup.procs").read_text().split()
    except FileNotFoundError:
        return True
    except OSError:
        pids = []
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    try:
        folder.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:  # processes still exiting: busy for a moment after the last one died
        return False


# ---------------------------------------------------------------- clean-up that outlasts a call
CLEANUP_SECONDS = 0.3  # how long a call waits for its processes and cgroup to be gone before the janitor takes over
_janitor_tasks: list = []
_swept: set = set()  # stale cgroups already handed to the janitor
_janitor_lock = threading.Lock()


def _later(task) -> None:
    """Hand `task` (a callable that returns True once its clean-up is done) to the janitor: a daemon thread that
    retries each task, backing off to once a second, until it succeeds. Nothing is ever given up on, and no call
    waits for it."""
    with _janitor_lock:
        _janitor_tasks.append(task)
        if len(_janitor_tasks) == 1:
            threading.Thread(target=_janitor, name="grpo-sandbox-janitor", daemon=True).start()


def _janitor() -> None:
    pause = 0.005
    while True:
        with _janitor_lock:
            tasks = list(_janitor_tasks)
        done = []
        for task in tasks:
            try:
                finished = task()
            except Exception:  # noqa: BLE001 -- a clean-up that failed this time is tried again
                logger.debug("sandbox clean-up failed, retrying", exc_info=True)
                finished = False
            if finished:
                done.append(task)
        with _janitor_lock:
            for task in done:
                _janitor_tasks.remove(task)
            if not _janitor_tasks:
                return
        time.sleep(pause)
        pause = min(1.0, pause * 2)


def pending_cleanup() -> int:
    """How many clean-ups the janitor still holds (processes still exiting, cgroups still busy)."""
    with _janitor_lock:
        return len(_janitor_tasks)


def _reap(process: subprocess.Popen, deadline: float) -> None:
    """Wait for a killed process until `deadline`, then leave it to the janitor."""
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _later(lambda: process.poll() is not None)


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
            probe = parent / f"grpo-sandbox-probe-{os.getpid()}-{secrets.token_hex(4)}"
            probe.mkdir()
            probe.rmdir()
    except OSError:
        return {}
    return parents


# ---------------------------------------------------------------- what this machine gives
PROBE = r"""
import json, os, socket, sys
CALLS = 0


def probe(project, site_packages):
    global CALLS
    CALLS += 1
    status = open("/proc/self/status").read()
    facts = {"pid": os.getpid(), "uid": os.getuid(), "calls": CALLS, "root_entries": sorted(os.listdir("/")),
             "sees_project": os.path.exists(project), "writes_outside_tmp": [], "refused_sockets": [],
             "no_new_privs": status.split("NoNewPrivs:")[1].split()[0] == "1",
             "seccomp": status.split("Seccomp:")[1].split()[0] == "2",
             "proc_entries": sorted(name for name in os.listdir("/proc") if not name.isdigit()),
             "interfaces": [line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]],
             "earlier_case_file": os.path.exists("/tmp/probe-mark"),
             "tmp_files_limit": os.statvfs("/tmp").f_files}
    open("/tmp/probe-mark", "w").close()
    try:
        import ctypes
        facts["new_user_namespace"] = ctypes.CDLL(None).unshare(0x10000000) == 0
    except OSError:
        facts["new_user_namespace"] = False
    for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET, 40):  # 40: AF_VSOCK
        try:
            socket.socket(family, socket.SOCK_DGRAM).close()
        except OSError:
            facts["refused_sockets"].append(int(family))
    try:
        facts["site_packages"] = [path for path in site_packages if os.listdir(path)]
    except OSError:
        facts["site_packages"] = []
    for folder in ["/", "/dev", *site_packages]:
        try:
            open(os.path.join(folder, "probe"), "w").close()
            facts["writes_outside_tmp"].append(folder)
        except OSError:
            pass
    return json.dumps(facts)
"""


def _probe(bubblewrap: bool, root: bool) -> tuple[list[dict], str]:
    """Run PROBE the way programs run, for two cases (each in its own case process): what each case saw, and the
    judge's log and the program's stderr (which say why, where it saw nothing)."""
    project, site_packages = str(Path(__file__).resolve().parent), _site_packages()
    case = f"print('probe:' + probe({project!r}, {site_packages!r}))"
    job = {"program": PROBE, "helpers": "", "setup": "", "cases": [case, case], "token": "probe", "names": ["probe"],
           "wall_seconds": 20.0, "memory_bytes": Limits().memory_bytes, "result_bytes": Limits().result_bytes,
           "groups": [], "entry_point": None, "call_seconds": Limits().call_seconds}
    with (_uid_slot() as uid, tempfile.TemporaryDirectory(prefix="grpo-sandbox-probe-") as folder):
        if uid is not None:
            os.chown(folder, uid, uid)
        streams, _ = _run(job, Limits(audit_hook=False), bubblewrap, uid, _Cgroup([]), folder)
    log = streams["log"].decode(errors="replace")
    facts = [json.loads(line[len("probe:"):]) for line in log.splitlines() if line.startswith("probe:")]
    return facts, (log + streams["stderr"].decode(errors="replace")).strip()[-2000:]


def _unreadable_parent(path: str) -> str | None:
    """The first folder above `path` (or `path` itself) that users other than its owner may not search or read, or
    None: where the interpreter sits under one (a 0700 /root), a program that has switched to its own uid cannot
    import the standard library."""
    for folder in [*reversed(Path(path).parents), Path(path)]:
        mode = os.stat(folder).st_mode
        if not mode & stat.S_IXOTH or (folder == Path(path) and not mode & stat.S_IROTH):
            return str(folder)
    return None


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """The layers a program gets on this machine: the namespaces, the view, the uid, the filter and the fresh state
    of each case checked by a probe run the way programs are run (rewards.judge's zygote and case processes); the
    cgroups by making one; the resource limits need no privilege."""
    layers, reasons = dict.fromkeys(LAYERS, False), {}
    layers["resource_limits"] = True  # setrlimit needs no privilege
    bubblewrap = bool(_bwrap())
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
    stdlib = os.path.dirname(os.__file__)
    blocked = _unreadable_parent(stdlib) if root and not bubblewrap else None
    if blocked:  # the program's uid could not import the standard library: refuse, saying why
        return Isolation(layers, reasons, refusal=(
            f"code sandbox: programs cannot run here: the interpreter's standard library ({stdlib}) is not readable "
            f"by the program's own uid ({blocked} is not searchable by other users) and bubblewrap, which would show "
            "it, is not installed: apt-get install bubblewrap, or use a Python installed where other users may read"))
    facts, log = _probe(bubblewrap, root)
    if len(facts) != 2:
        reason = f"the probe program did not run: {log or 'no output'}"
        return Isolation(layers, {**reasons, "bubblewrap": reason}, refusal=f"code sandbox: {reason}")
    first, second = facts
    layers["bubblewrap"] = bubblewrap
    layers["pid_namespace"] = first["pid"] == 1 and first["proc_entries"] == ["self", "thread-self"]
    layers["network_namespace"] = first["interfaces"] in ([], ["lo"])
    layers["filesystem_view"] = bubblewrap and not (first["sees_project"] or first["site_packages"]
                                                    or first["writes_outside_tmp"]
                                                    or {"home", "etc"} & set(first["root_entries"]))
    layers["distinct_uid"] = root and FIRST_UID <= first["uid"] < FIRST_UID + UID_SLOTS and first["no_new_privs"]
    layers["seccomp"] = (first["seccomp"] and not first["new_user_namespace"]
                         and set(first["refused_sockets"]) == {2, 10, 16, 17, 40})
    layers["fresh_case_state"] = (second["calls"] == 1 and not second["earlier_case_file"]
                                  and second["pid"] == 1 and first["tmp_files_limit"] <= Limits().tmp_files)
    if seccomp_filter() is None:
        reasons["seccomp"] = f"no system-call table for {os.uname().machine} in rewards/sandbox.py"
    for name in ("pid_namespace", "network_namespace", "filesystem_view", "distinct_uid", "seccomp",
                 "fresh_case_state"):
        if not layers[name] and name not in reasons:
            reasons[name] = f"the probe saw {facts}"
    if not bubblewrap:
        reasons.setdefault("filesystem_view", "needs bubblewrap")
    return Isolation(layers, reasons)
