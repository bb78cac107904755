"""The two processes of a sandboxed test run, and the plain data that passes between them.

    confined process   runs the model's program, and nothing else: it answers calls `name(*args, **kwargs)`
                       with the result as plain data. It runs inside the OS sandbox (rewards/sandbox.py).
    judge process      runs the task's trusted code: the prompt's helpers, the setup and the test cases. The
                       functions the tests call (`candidate`, the entry point, the program's own functions) are
                       proxies that send the call to the confined process and decode its answer.

So the verdict is decided outside the interpreter that runs the model's code (the way competitive-programming
judges work): the program can answer a call with any bytes it likes, but the judge decodes only plain data --
None, bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset, by exact type -- so an object that
equals everything, a rewritten report, replaced builtins or an early exit cannot reach a comparison. A result that
is not plain data, or a frame that does not parse, fails that call.

Frames on the two pipes are `<length>\\n<json>`. This file uses the standard library only: rewards/sandbox.py sends
its source to each process as `python -c` (the confined process cannot read the project's files), followed by a
call of `confined_main()` or `judge_main()`.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import select
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


def write_frame(fd: int, message) -> None:
    data = json.dumps(message).encode()
    data = str(len(data)).encode() + b"\n" + data
    while data:
        data = data[os.write(fd, data):]


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


# ---------------------------------------------------------------- the confined process
def confined_main() -> None:
    """Confine this process (limits, then the distinct uid), run the program, then answer calls until the judge
    closes the request pipe. argv[1]: JSON settings from rewards.sandbox."""
    import resource

    settings = json.loads(sys.argv[1])
    for name, value in (("RLIMIT_CPU", settings["cpu_seconds"]), ("RLIMIT_AS", settings["memory_bytes"]),
                        ("RLIMIT_FSIZE", settings["file_bytes"]), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0),
                        ("RLIMIT_NPROC", settings["processes"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if settings["unshare_net"]:  # without bubblewrap: a network namespace of its own, where the kernel allows it
        libc.unshare(0x40000000)  # CLONE_NEWNET
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (bubblewrap sets it too): no setuid program raises it again
    if settings["uid"] is not None:  # started as root: drop to this program's own unprivileged uid for good
        os.setgroups([])
        os.setgid(settings["uid"])
        os.setuid(settings["uid"])
    _fresh_keyrings(settings["keyctl"])
    del libc, ctypes
    for name in [name for name in sys.modules if name.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # so that a program's `import ctypes` is an import the audit hook sees
    requests, answers = settings["requests_fd"], settings["answers_fd"]
    program = read_frame(requests, 1 << 30)
    if settings["audit_hook"]:
        sys.addaudithook(_guard)
    namespace = {"__name__": "program"}
    try:
        exec(compile(program, "program.py", "exec"), namespace)
    except BaseException as error:  # noqa: BLE001 -- whatever the program raises is its failure
        write_frame(answers, {"error": _describe(error)})
        os._exit(0)
    write_frame(answers, {"ready": True})
    while True:
        try:
            name, args, kwargs = read_frame(requests, 1 << 30)
        except Broken:
            os._exit(0)
        try:
            value = namespace[name](*from_plain(args), **from_plain(kwargs))
            answer = {"value": to_plain(value)}
        except BaseException as error:  # noqa: BLE001
            answer = {"error": _describe(error)}
        write_frame(answers, answer)


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
    """Read the job (JSON on stdin), run the trusted code with proxies into the confined process, and write one
    verdict line `<token> case <i> <0|1>` per case to stdout as each finishes."""
    import resource

    job = json.loads(sys.stdin.read())
    deadline = time.monotonic() + job["wall_seconds"]
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the task's own code prints goes to the log, never among the verdicts
    link = Link(job["requests_fd"], job["answers_fd"], job["result_bytes"], deadline)
    cases = job["cases"]
    try:
        link.start(job["program"])
        namespace = {"__name__": "tests"}
        exec(compile(job["helpers"], "helpers.py", "exec"), namespace)  # the problem's own helpers, trusted
        namespace.update({name: link.proxy(name) for name in job["names"]})
        exec(compile(job["setup"], "setup.py", "exec"), namespace)
    except BaseException as error:  # noqa: BLE001
        print(f"before the cases: {type(error).__name__}: {error}", file=sys.stderr)
        cases = []
    for index, case in enumerate(cases):
        try:
            if link.broken:
                raise Broken(link.broken)
            exec(compile(case, f"case{index}.py", "exec"), namespace)
            passed = True
        except BaseException as error:  # noqa: BLE001
            print(f"case {index}: {type(error).__name__}: {error}", file=sys.stderr)
            passed = False
        verdicts.write(f"{job['token']} case {index} {int(passed)}\n")
        verdicts.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without waiting for threads the task's code may have started


class Link:
    """The judge's end of the two pipes to the confined process."""

    def __init__(self, requests: int, answers: int, limit: int, deadline: float):
        self.requests, self.answers, self.limit, self.deadline = requests, answers, limit, deadline
        self.broken = ""

    def start(self, program: str) -> None:
        write_frame(self.requests, program)
        answer = self.receive("ready")
        if "error" in answer:
            name, message = answer["error"]
            raise RuntimeError(f"the program raised {name}: {message}")

    def receive(self, expected: str) -> dict:
        """The next answer: a dict with the key `expected` ("ready" or "value") or "error"; Broken otherwise."""
        try:
            answer = read_frame(self.answers, self.limit, self.deadline)
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
        if self.broken:
            raise Broken(self.broken)
        try:
            write_frame(self.requests, [name, to_plain(list(args)), to_plain(kwargs)])
        except OSError as error:  # BrokenPipeError: it has exited
            self.broken = f"the program's process: {error}"
            raise Broken(self.broken) from None
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
    if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(kind, (StopIteration,
                                                                                            StopAsyncIteration)):
        return RuntimeError(f"{name}: {message}")
    try:
        return kind(message)
    except Exception:  # noqa: BLE001 -- a builtin whose constructor wants other arguments
        return RuntimeError(f"{name}: {message}")
