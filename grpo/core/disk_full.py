"""A full disk under the run folder stops the run with one message: what could not be written, where, and the
checkpoint it resumes from (train.py adds the command that resumes).

The trainer runs each write into the run folder (run_config.json, metrics.jsonl and samples.jsonl, eval/,
checkpoints/) inside `writing(run_dir, what)`, which turns a failure that is the disk being full into DiskFullError,
a TrainingError: the trainer adds the last good checkpoint and train.py prints one `error:` line. Nothing is lost:
checkpoints are atomic (grpo.core.checkpoint), so a save that ran out of space leaves the previous checkpoint
complete and its own `.tmp-` folder, which the next save removes; a resumed run drops the log lines past its
checkpoint (grpo.core.metrics).

Writers report a full disk in three ways; `no_space` looks for each:
    Python's own writes                     OSError with errno ENOSPC (EDQUOT: a quota), or such an error as the
                                            cause or context of another
    Rust's (safetensors, tokenizers)        the errno in the message, as Rust's io::Error writes it:
                                            "No space left on device (os error 28)"
    torch's zip writer (torch.save,         RuntimeError "unexpected pos 17280 vs 17172", no errno: a full disk
    torch.distributed.checkpoint)           only when it is that writer's error (ZIP_WRITER_FAILURES) and the
                                            folder's file system has under FULL_BELOW bytes free after the failure
torch.distributed.checkpoint gathers every rank's failure into one CheckpointException (a BaseException); its
`failures` are looked through too.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from grpo.errors import TrainingError

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_BELOW = 1 << 20  # bytes free under which a failed write without an errno counts as a full disk
ZIP_WRITER_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "inline_container")  # torch's short writes


class DiskFullError(TrainingError):
    """A write into the run folder found its disk full; the run stops with its last checkpoint intact."""


@contextmanager
def writing(run_dir: str | Path, what: str) -> Iterator[None]:
    """Run writes of `what` (a name under `run_dir`, for the message); a full disk raises DiskFullError naming
    both, from the writer's own error. Any other failure passes through unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except (Exception, CheckpointException) as error:
        reason = no_space(error, run_dir)
        if reason is None:
            raise
        raise DiskFullError(f"the disk is full ({reason}): could not write {what} in the run folder {run_dir} "
                            f"[{_one_line(error)}].") from error


def no_space(error: BaseException, folder: str | Path) -> str | None:
    """Why `error`, raised by a write into `folder`, is the disk being full ("No space left on device"); None when
    it is something else (an OSError with another errno says what) or nothing says it is."""
    causes = list(_causes(error))
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno in NO_SPACE_ERRNOS:
            return os.strerror(cause.errno)
        for code in NO_SPACE_ERRNOS:
            if f"(os error {code})" in str(cause):  # Rust's io::Error, e.g. safetensors' SafetensorError
                return os.strerror(code)
    if isinstance(error.__cause__ or error, OSError) and (error.__cause__ or error).errno is not None:
        return None  # e.g. permission denied, on a disk that also happens to be full
    zip_writer = [cause for cause in causes if isinstance(cause, RuntimeError) and not isinstance(cause, OSError)
                  and any(text in str(cause) for text in ZIP_WRITER_FAILURES)]
    try:
        full = bool(zip_writer) and free_bytes(folder) < FULL_BELOW
    except OSError:  # the folder cannot be looked at: nothing says the disk is full
        full = False
    return os.strerror(errno.ENOSPC) if full else None


def free_bytes(folder: str | Path) -> int:
    """Bytes an unprivileged write can still use on the file system of `folder` (or of its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, the errors it was raised from or while handling, and the ranks' errors a CheckpointException holds."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            pending += [failure for failure, _traceback in current.failures.values()]


def _one_line(error: BaseException) -> str:
    """`Type: first line of the message` of the writer's error (a CheckpointException: its first rank's)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
