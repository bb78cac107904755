"""The two processes of a sandboxed test run, and the plain data that passes between them.

    confined side      runs the model's program, and nothing else. Its first process (the zygote) runs only this
                       file's trusted code: for each test case it forks a case process in new pid, mount and ipc
                       namespaces (a fresh /tmp and /proc), which drops to the program's uid, installs the seccomp
                       filter, imports the program and answers that case's calls `name(*args, **kwargs)` with the
                       result as plain data; the case process is killed when its case ends. So a program's state
                       (globals, files, processes, shared memory) lives for one case only: its answers can depend on
                       the inputs of that case's calls and nothing else. It runs inside the OS sandbox
                       (rewards/sandbox.py).
    judge process      runs the task's trusted code: the prompt's helpers, the setup and the test cases. The
                       functions the tests call (`candidate`, the entry point, the program's own functions) are
                       proxies that send the call to the case's process and decode its answer.

So the verdict is decided outside the interpreter that runs the model's code (the way competitive-programming
judges work): the program can answer a call with any bytes it likes, but the judge decodes only plain data --
None, bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset, by exact type -- so an object that
equals everything, a rewritten report, replaced builtins or an early exit cannot reach a comparison. A result that
is not plain data, or a frame that does not parse, fails that case.

The judge and the zygote share a control socket (AF_UNIX, SOCK_SEQPACKET), over which the judge hands each case's
two fresh pipes; the case process never holds the socket. Frames on the pipes are `<length>\\n<json>`. This file
uses the standard library only: rewards/sandbox.py sends its source to each process as `python -c` (the confined
side cannot read the project's files), followed by a call of `confined_main()` or `judge_main()`.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import select
import signal
import socket
import sys
import time

# ---------------------------------------------------------------- plain data, by exact type (never isinstance:
# a subclass of int or str can override __eq__)


def to_plain(value, depth: int = 0):
    """`value` as JSON-able data whose every dict is a one-key tag; TypeError for anything that is not plain."""
    kind = type(value)
    if depth > 100:
        raise TypeError("plain data nested deeper than 100 levels")
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}  # nan, inf, -inf
    if kind is list:
        return [to_plain(item, depth + 1) for item in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [to_plain(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[to_plain(key, depth + 1), to_plain(item, depth + 1)] for key, item in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [to_plain(value.real), to_plain(value.imag)]}
    raise TypeError(f"a {kind.__name__} is not plain data (None, bool, int, float, str, bytes, complex, list, "
                    "tuple, dict, set, frozenset)")


HASHED_ITEMS = 2000  # entries of sets and dicts one answer may hold: hashing colliding keys costs n^2 in the judge


def from_plain(data, budget: list | None = None):
    """The value that `to_plain` encoded; ValueError for anything else. Builds only the plain types, and at most
    HASHED_ITEMS set and dict entries in all (ints that all hash alike would make the judge's work quadratic)."""
    budget = [HASHED_ITEMS] if budget is None else budget
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [from_plain(item, budget) for item in data]
    if kind is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is list:
            if tag == "tuple":
                return tuple(from_plain(item, budget) for item in body)
            if tag in ("set", "frozenset", "dict"):
                budget[0] -= len(body)
                if budget[0] < 0:
                    raise ValueError(f"more than {HASHED_ITEMS} set and dict entries")
            if tag in ("set", "frozenset"):
                return (set if tag == "set" else frozenset)(from_plain(item, budget) for item in body)
            if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in body):
                return {from_plain(key, budget): from_plain(item, budget) for key, item in body}
            if tag == "complex" and len(body) == 2 and all(type(part) is float or type(part) is int for part in body):
                return complex(*body)
    raise ValueError("not plain data")


# ---------------------------------------------------------------- frames: `<length>\n<json>`
class Broken(BaseException):
    """The other side is gone, late, or sent a frame that is not one. A BaseException, so that a test's own
    `except Exception` cannot swallow it."""


def write_frame(fd: int, message, deadline: float | None = None) -> None:
    """Write one frame; with a `deadline` (time.monotonic), on a non-blocking `fd`, Broken once it passes: a reader
    that stops reading (or only peeks, with tee) cannot hold the writer past it."""
    data = json.dumps(message).encode()
    data = memoryview(str(len(data)).encode() + b"\n" + data)
    while data:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
                raise Broken("the other side did not read before the deadline")
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            continue


def read_frame(fd: int, limit: int, deadline: float | None = None):
    """The next message on `fd`; Broken at EOF, past `deadline` (time.monotonic), over `limit` bytes, or malformed."""

    def read(count: int) -> bytes:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise Broken("no answer before the deadline")
        chunk = os.read(fd, count)
        if not chunk:
            raise Broken("the other side closed its pipe")
        return chunk

    header = b""
    while (byte := read(1)) != b"\n":
        if not byte.isdigit() or len(header) >= 12:
            raise Broken("a frame header that is not a length")
        header += byte
    if not header or int(header) > limit:
        raise Broken(f"a frame of {header.decode()} bytes (the limit is {limit})")
    size, body = int(header), bytearray()
    while len(body) < size:
        body += read(size - len(body))  # bytearray: appending stays linear, however the sender splits its frame
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise Broken(f"a frame that is not JSON: {error}") from None


# ---------------------------------------------------------------- the confined side
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
REQUESTS_FD, ANSWERS_FD = 3, 4  # a case process's two pipes, at these numbers (its only descriptors beside 0-2)


def confined_main() -> None:
    """The zygote: run one case process at a time, as the judge's control messages say, and nothing of the
    program's. argv[1]: JSON settings from rewards.sandbox.

        b"case" + two pipe fds   fork a case process that reads requests from the first, answers on the second
        b"end"                   kill the case process and everything it started; reply b"ended" once all are gone
        end of the socket        the judge is done (or dead): kill the case, exit

    `cpu_seconds` bounds the program's CPU time over all its cases: each case process has it as its RLIMIT_CPU (the
    same for every case, so that no case reads what earlier ones spent), and once the cases together have used it, no
    further case is started (its pipes are closed at once)."""
    settings = json.loads(sys.argv[1])
    control = socket.socket(fileno=settings["control_fd"])
    case, spent = None, 0.0  # (the case supervisor's pid, the write end of its stop pipe); CPU seconds used
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 16, 2)
        except OSError:
            message, fds = b"", []
        if case is not None and message != b"case":
            spent += _end_case(*case)
            case = None
        if message == b"case" and len(fds) == 2 and case is None and spent < settings["cpu_seconds"]:
            case = _start_case(settings, control, fds)
        elif message == b"case":
            os.write(2, f"sandbox: a case not run: the program's {settings['cpu_seconds']} s of CPU time are used "
                        "up\n".encode())
        elif message == b"end":
            control.send(b"ended")
        for fd in fds:
            os.close(fd)
        if not message:
            os._exit(0)


def _start_case(settings: dict, control: socket.socket, pipes: list[int]) -> tuple[int, int]:
    """Fork the case's supervisor (`_supervise_case`); returns its pid and the write end of its stop pipe."""
    stop_read, stop_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(stop_write)
            control.close()
            _supervise_case(settings, pipes, stop_read)
        finally:
            os._exit(1)  # never back into the zygote's loop
    os.close(stop_read)
    return pid, stop_write


def _end_case(pid: int, stop_write: int) -> float:
    """Stop the case (its supervisor kills the case process, then exits); the CPU seconds the case used, its
    processes all together (each reaped its own: a pid namespace's pid 1 reaps every process of it)."""
    os.close(stop_write)
    _, _, usage = os.wait4(pid, 0)
    return usage.ru_utime + usage.ru_stime


def _supervise_case(settings: dict, pipes: list[int], stop_read: int) -> None:
    """Trusted, as root where the trainer is: new pid, mount and ipc namespaces for the case (and a network namespace
    where no bubblewrap made one), then the case process as their pid 1, with stdout and stderr pipes of its own whose
    output this process copies to the run's (so that nothing a case sets on an open file -- a pipe's size, O_NONBLOCK
    -- reaches the next case); kill it when the stop pipe ends. A pid namespace ends with its pid 1: every process the
    case started dies with it, before waitpid returns."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if settings["unshare_net"] else 0)
    namespaces = libc.unshare(flags) == 0  # needs CAP_SYS_ADMIN (root, or bubblewrap's user namespace)
    if not namespaces and settings["require_namespaces"]:  # never a case less confined than the probe found
        os.write(2, f"sandbox: a case not run: no namespaces for it ({os.strerror(ctypes.get_errno())})\n".encode())
        os._exit(1)
    outputs = {1: os.pipe(), 2: os.pipe()}  # the case's stdout and stderr: (read end, write end)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(stop_read)
            for fd, (read, write) in outputs.items():
                os.close(read)
                os.dup2(write, fd)
            _case_main(settings, pipes, namespaces)
        finally:
            os._exit(1)
    for fd in [*pipes, *(write for _, write in outputs.values())]:
        os.close(fd)
    reads = {read: fd for fd, (read, _) in outputs.items()}
    try:
        watched = [stop_read, os.pidfd_open(pid)]  # the stop pipe, and the case process until it exits
        while True:
            ready = select.select([*watched, *reads], [], [])[0]
            for read in [read for read in ready if read in reads]:
                chunk = os.read(read, 1 << 16)
                if chunk:
                    os.write(reads[read], chunk)  # the trainer reads the run's pipes without pause, with a cap
                else:
                    del reads[read]
            if watched[1:] and watched[1] in ready:
                watched = watched[:1]  # exited: a readable pidfd stays readable
            if stop_read in ready or (len(watched) == 1 and not reads):
                break
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        if not namespaces and settings["uid"] is not None:
            _kill_uid_processes(settings["uid"])  # no pid namespace took them: whatever the case left, as its uid
        os._exit(0)


def _kill_uid_processes(uid: int) -> None:
    """SIGKILL every process of `uid`, from a child that has become `uid` (kill(-1) reaches only its own uid's)."""
    pid = os.fork()
    if pid == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.kill(-1, signal.SIGKILL)
        os._exit(0)
    os.waitpid(pid, 0)


def _case_main(settings: dict, pipes: list[int], namespaces: bool) -> None:
    """One case: confine this process (its own /tmp and /proc, two descriptors, limits, the program's uid, the
    seccomp filter), import the program, then answer calls until the judge closes the request pipe. Never returns."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if namespaces:
            _fresh_mounts(libc, settings)
        requests, answers = (os.dup(fd) for fd in pipes)  # above 4, so that dup2 below overwrites neither
        os.dup2(requests, REQUESTS_FD)
        os.dup2(answers, ANSWERS_FD)
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)  # its own open file, as stdout and stderr are its own pipes
        os.closerange(ANSWERS_FD + 1, 1 << 16)  # the zygote's control socket, the stop pipe, anything else
        for name, value in (("RLIMIT_CPU", settings["cpu_seconds"]), ("RLIMIT_AS", settings["memory_bytes"]),
                            ("RLIMIT_FSIZE", settings["file_bytes"]), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0),
                            ("RLIMIT_NPROC", settings["processes"])):
            resource.setrlimit(getattr(resource, name), (value, value))
        _check(libc, libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")  # no setuid program raises it again
        if settings["uid"] is not None:  # started as root: drop to this program's own unprivileged uid for good
            os.setgroups([])
            os.setgid(settings["uid"])
            os.setuid(settings["uid"])
        _drop_capabilities(libc, settings["capset"])  # as root the uid switch did; in a user namespace it does not
        _check(libc, libc.prctl(1, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")  # dies with its supervisor
        _fresh_keyrings(settings["keyctl"])
        if settings["seccomp"]:
            _install_seccomp(libc, bytes.fromhex(settings["seccomp"]))
    except BaseException as error:  # noqa: BLE001 -- never run the program less confined than asked
        os.write(2, f"sandbox: the case process could not be confined: {error}\n".encode())
        os._exit(1)
    del libc, ctypes
    try:
        _serve(settings)
    finally:
        os._exit(0)


def _serve(settings: dict) -> None:
    """Import the program, then answer calls until the judge closes the request pipe (Broken)."""
    program = read_frame(REQUESTS_FD, 1 << 30)
    if settings["audit_hook"]:
        for name in [name for name in sys.modules if name.split(".")[0] in ("ctypes", "_ctypes", "socket", "_socket")]:
            del sys.modules[name]  # so that a program's `import ctypes` or `import socket` is an import the hook sees
        sys.addaudithook(_guard)
    namespace = {"__name__": "program"}
    try:
        exec(compile(program, "program.py", "exec"), namespace)
    except BaseException as error:  # noqa: BLE001 -- whatever the program raises is its failure
        write_frame(ANSWERS_FD, {"error": _describe(error)})
        os._exit(0)
    write_frame(ANSWERS_FD, {"ready": True})
    while True:
        try:
            name, args, kwargs = read_frame(REQUESTS_FD, 1 << 30)
        except Broken:
            os._exit(0)
        try:
            value = namespace[name](*from_plain(args), **from_plain(kwargs))
            answer = {"value": to_plain(value)}
        except BaseException as error:  # noqa: BLE001
            answer = {"error": _describe(error)}
        write_frame(ANSWERS_FD, answer)


def _drop_capabilities(libc, capset: int | None) -> None:
    """Give up every capability: the ambient set, then the effective, permitted and inheritable ones (capset, v3),
    and check that none is left (bubblewrap's user namespace hands its caps to the zygote as ambient ones, which a
    fork keeps)."""
    import ctypes

    _check(libc, libc.prctl(47, 4, 0, 0, 0), "PR_CAP_AMBIENT_CLEAR_ALL")
    if capset is not None:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}, all empty
        _check(libc, libc.syscall(ctypes.c_long(capset), header, data), "capset")
    effective = open("/proc/self/status").read().split("CapEff:")[1].split()[0]
    if int(effective, 16):
        raise PermissionError(f"capabilities left after dropping them: CapEff {effective}")


def _check(libc, result: int, what: str) -> None:
    if result != 0:
        import ctypes

        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _fresh_mounts(libc, settings: dict) -> None:
    """In the case's own mount namespace: mounts private to it; a new tmpfs as /tmp (disk_bytes, and at most
    tmp_files files and folders, so that the kernel's teardown of what it holds stays short); a new /proc of its own
    pid namespace with the process folders only (`subset=pid`: no kernel command line, key users, or other system
    files, and no process outside the case)."""
    nosuid, nodev, noexec, recursive, private = 2, 4, 8, 0x4000, 1 << 18
    tmp = f"size={settings['disk_bytes']},nr_inodes={settings['tmp_files']},mode=1777".encode()
    _check(libc, libc.mount(b"none", b"/", None, recursive | private, None), "mount --make-rprivate /")
    _check(libc, libc.mount(b"tmpfs", b"/tmp", b"tmpfs", nosuid | nodev, tmp), "mount tmpfs /tmp")
    _check(libc, libc.mount(b"proc", b"/proc", b"proc", nosuid | nodev | noexec, b"subset=pid"), "mount proc /proc")
    os.chdir("/tmp")


def _install_seccomp(libc, program: bytes) -> None:
    """Install a classic-BPF seccomp filter (rewards.sandbox.seccomp_filter) on this process and its children."""
    import ctypes

    class SockFprog(ctypes.Structure):  # struct sock_fprog of linux/filter.h
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(instructions))
    _check(libc, libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "PR_SET_SECCOMP")  # SECCOMP_MODE_FILTER


def _fresh_keyrings(keyctl: int | None) -> None:
    """Kernel keyrings outlive processes: the uid's user, user-session and persistent keyrings would carry keys from
    one program of a slot's uid to the next, and the session keyring inherited from the trainer is one for all. So,
    before the program runs: a new session keyring of its own, and the uid's keyrings emptied. (Under the seccomp
    filter every keyctl call is refused, and so is any use of keyrings by the program.) `keyctl`: its system-call
    number here, from rewards.sandbox."""
    if keyctl is None:
        return
    import ctypes

    syscall, long = ctypes.CDLL(None, use_errno=True).syscall, ctypes.c_long
    syscall(long(keyctl), long(1), None)  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
        syscall(long(keyctl), long(7), long(keyring))  # KEYCTL_CLEAR
    persistent = syscall(long(keyctl), long(22), long(-1), long(-3))  # KEYCTL_GET_PERSISTENT, into the new session
    if persistent > 0:
        syscall(long(keyctl), long(7), long(persistent))


def _describe(error: BaseException) -> list[str]:
    try:
        return [type(error).__name__, str(error)[:300]]
    except BaseException:  # noqa: BLE001 -- a program's exception whose __str__ raises
        return [type(error).__name__, ""]


def _guard(event, args, blocked=("os.system", "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn",
                                 "subprocess.Popen", "socket.", "ctypes.", "os.kill", "os.killpg", "os.putenv"),
           modules=("_posixsubprocess", "ctypes", "_ctypes", "_socket", "socket")):
    """An extra guard inside the confined process (the OS sandbox is the boundary): no new processes, sockets,
    ctypes or signals, and no import of the modules that reach them without an audit event. Its settings are
    default arguments, so the program cannot change them."""
    if event.startswith(blocked) or event == "import" and args[0].split(".")[0] in modules:
        raise PermissionError(f"sandbox: {event} {args[0] if event == 'import' else ''} is not allowed".strip())


# ---------------------------------------------------------------- the judge process
def judge_main() -> None:
    """Read the job (JSON on stdin), run the trusted code with proxies into each case's process, and write one
    verdict line `<token> case <i> <0|1>` per case to stdout as each finishes: the cases (a process each), then the
    groups of calls (`run_groups`), numbered after them."""
    import resource

    job = json.loads(sys.stdin.read())
    deadline = time.monotonic() + job["wall_seconds"]
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the task's own code prints goes to the log, never among the verdicts
    link = Link(job["control_fd"], job["program"], job["result_bytes"], deadline)
    cases = job["cases"]
    try:
        namespace = {"__name__": "tests"}
        exec(compile(job["helpers"], "helpers.py", "exec"), namespace)  # the problem's own helpers, trusted
        namespace.update({name: link.proxy(name) for name in job["names"]})
        exec(compile(job["setup"], "setup.py", "exec"), namespace)
        link.end_case()  # a setup that called the program had a process of its own
    except BaseException as error:  # noqa: BLE001
        print(f"before the cases: {type(error).__name__}: {error}", file=sys.stderr)
        cases = []
    for index, case in enumerate(cases):
        try:
            exec(compile(case, f"case{index}.py", "exec"), namespace)
            passed = True
        except BaseException as error:  # noqa: BLE001
            print(f"case {index}: {type(error).__name__}: {error}", file=sys.stderr)
            passed = False
        try:
            link.end_case()
        except Broken as error:
            print(f"case {index}: {error}", file=sys.stderr)
            passed = False
        verdicts.write(f"{job['token']} case {index} {int(passed)}\n")
        verdicts.flush()
    if job["groups"] and not link.dead:
        run_groups(link, job["entry_point"], job["groups"], job["call_seconds"], len(job["cases"]), job["token"],
                   verdicts)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without waiting for threads the task's code may have started


def run_groups(link: Link, entry_point: str, groups: list, call_seconds: float, first: int, token: str,
               verdicts) -> None:
    """Each group of calls [args, kwargs, expected] (plain data, data/humaneval_cases.py) is a case: it passes when
    the entry point answers each call with its expected output (`same_output`). The groups share one process,
    started anew only after it stops answering (an exit, a crash, a call past `call_seconds`): the process keeps its
    state from group to group, and sees only the inputs, never an expected output. Every call of a group is made,
    right or wrong, so the inputs a program sees do not depend on its answers (they would tell it which it got
    wrong)."""
    function = link.proxy(entry_point)
    for number, group in enumerate(groups):
        right = []
        for args, kwargs, expected in group:
            link.call_deadline = time.monotonic() + call_seconds
            try:
                right.append(same_output(function(*from_plain(args), **from_plain(kwargs)), from_plain(expected)))
            except Broken as error:  # the process is gone or late: the next group gets a new one
                print(f"group {number}: {error}", file=sys.stderr)
                right.append(False)
                try:
                    link.end_case()
                except Broken:
                    pass
                break
            except BaseException as error:  # noqa: BLE001 -- the program raised: a wrong answer
                print(f"group {number}: {type(error).__name__}: {error}", file=sys.stderr)
                right.append(False)
                if link.broken:  # importing it failed
                    break
            finally:
                link.call_deadline = None
        verdicts.write(f"{token} case {first + number} {int(all(right))}\n")
        verdicts.flush()
        if link.dead or link.broken.startswith(IMPORT_FAILED):  # no process can answer: the rest fail unrun
            break
    try:
        link.end_case()
    except Broken:
        pass


def same_output(actual, expected) -> bool:
    """The generated cases' equality: an expected float within 1e-6 (relative or absolute), NaN equal to NaN; an
    int equal (an equal float too, as HumanEval's `==`); containers of the same type item by item; a bool only for a
    bool; otherwise the same type and ==. (data.humaneval_cases.same is this function.)"""
    if type(expected) is bool or type(actual) is bool:
        return type(actual) is type(expected) and actual == expected
    if type(expected) is float:
        if type(actual) not in (int, float):
            return False
        if math.isnan(expected):
            return type(actual) is float and math.isnan(actual)
        try:
            return math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6)
        except OverflowError:  # an int too large for a float
            return False
    if type(expected) is int:
        return type(actual) in (int, float) and actual == expected
    if type(expected) in (list, tuple):
        return (type(actual) is type(expected) and len(actual) == len(expected)
                and all(same_output(a, e) for a, e in zip(actual, expected, strict=True)))
    if type(expected) is dict:
        return (type(actual) is dict and actual.keys() == expected.keys()
                and all(same_output(actual[key], expected[key]) for key in expected))
    return type(actual) is type(expected) and actual == expected


IMPORT_FAILED = "the program raised"  # Link.broken's start where importing the program failed


class Link:
    """The judge's end of the confined side: the control socket to the zygote, and the two pipes of the current
    case's process, which the first call of a case opens (`start_case`) and `end_case` closes. Every write and read
    has the run's deadline."""

    def __init__(self, control: int, program: str, limit: int, deadline: float):
        self.control = socket.socket(fileno=control)
        self.program, self.limit, self.deadline = program, limit, deadline
        self.pipes = None  # (requests, answers) of the open case, or None
        self.call_deadline = None  # a deadline of one call, sooner than the run's (`run_groups`)
        self.broken = ""  # why the open case's process can no longer answer
        self.dead = ""  # why no case process can be started any more (the zygote is gone)

    def start_case(self) -> None:
        if self.dead:
            raise Broken(self.dead)
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        self.pipes, self.broken = (requests_write, answers_read), ""  # end_case closes them, whatever happens
        try:
            self._send(b"case", [requests_read, answers_write])
        finally:
            os.close(requests_read)
            os.close(answers_write)
        os.set_blocking(requests_write, False)
        self._write(self.program)
        answer = self.receive("ready")
        if "error" in answer:
            name, message = answer["error"]
            self.broken = f"{IMPORT_FAILED} {name}: {message}"
            raise RuntimeError(self.broken)

    def end_case(self) -> None:
        """Close the case's pipes, and wait until the zygote says its process (and all it started) is gone."""
        if self.pipes is None:
            return
        for fd in self.pipes:
            os.close(fd)
        self.pipes = None
        self._send(b"end")
        if self._receive() != b"ended":
            self.dead = "the confined side did not end the case"
            raise Broken(self.dead)

    def _send(self, message: bytes, fds: list[int] = ()) -> None:
        try:
            self.control.settimeout(max(1e-3, self.deadline - time.monotonic()))
            socket.send_fds(self.control, [message], list(fds))
        except OSError as error:
            self.dead = f"the confined side: {error}"
            raise Broken(self.dead) from None

    def _receive(self) -> bytes:
        try:
            self.control.settimeout(max(1e-3, self.deadline - time.monotonic()))
            return self.control.recv(16)
        except OSError as error:
            self.dead = f"the confined side: {error}"
            raise Broken(self.dead) from None

    def _write(self, message) -> None:
        try:
            write_frame(self.pipes[0], message, self.deadline)
        except (OSError, Broken) as error:  # BrokenPipeError: it has exited; Broken: it stopped reading
            self.broken = f"the program's process: {error}"
            raise Broken(self.broken) from None

    def receive(self, expected: str) -> dict:
        """The next answer: a dict with the key `expected` ("ready" or "value") or "error"; Broken otherwise."""
        deadline = self.deadline if self.call_deadline is None else min(self.deadline, self.call_deadline)
        try:
            answer = read_frame(self.pipes[1], self.limit, deadline)
            if type(answer) is not dict or not ({expected, "error"} & set(answer)):
                raise Broken("an answer that is not one")
            if "error" in answer and not (type(answer["error"]) is list and len(answer["error"]) == 2
                                          and all(type(part) is str for part in answer["error"])):
                raise Broken("an error that is not [name, message]")
            return answer
        except Broken as error:
            self.broken = f"the program's process: {error}"
            raise Broken(self.broken) from None

    def call(self, name: str, args: tuple, kwargs: dict):
        if self.pipes is None:
            self.start_case()
        if self.broken:
            raise Broken(self.broken)
        self._write([name, to_plain(list(args)), to_plain(kwargs)])
        answer = self.receive("value")
        if "error" in answer:
            raise _exception(*answer["error"])
        try:
            return from_plain(answer["value"])
        except (ValueError, TypeError, RecursionError) as error:
            raise TypeError(f"{name} returned something that is not plain data ({error})") from None

    def proxy(self, name: str):
        def call(*args, **kwargs):
            return self.call(name, args, kwargs)

        call.__name__ = call.__qualname__ = name
        return call


def _exception(name: str, message: str) -> Exception:
    """The program's exception as the judge's own builtin class of that name (a test may expect ValueError), or
    RuntimeError; never a class the program defined. Not StopIteration: raised from a proxy inside
    `all(map(candidate, xs))` it would end the iteration and pass the case."""
    kind = getattr(builtins, name, None)
    stops = (StopIteration, StopAsyncIteration)
    if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(kind, stops):
        return RuntimeError(f"{name}: {message}")
    try:
        return kind(message)
    except Exception:  # noqa: BLE001 -- a builtin whose constructor wants other arguments
        return RuntimeError(f"{name}: {message}")
