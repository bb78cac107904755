"""The errors a run ends with mid-way, each one line for the user; and a plug-in fails the same way wherever it fails.

TrainingError: the run cannot go on (too many skipped updates, a full disk, a plug-in's or a reward's fault at a step);
the last good checkpoint is kept, and train.py prints the command that resumes from it.

Plug-ins are the code a user names in a setting, `module:function` or `path/to/file.py:function`: an advantage
estimator (--advantage-estimator), a loss objective (--loss-type), an evaluation scorer (--eval-scorer). `guarded`
wraps one so that whatever it raises becomes one PluginError naming the setting, the plug-in, the file and line where
it raised, and the exception. The start-of-run probe adds "on a probe batch", the trainer adds the step, the last
checkpoint and the command that resumes (grpo.core.trainer.Trainer.train), so the user reads one `error:` line either
way. Reward functions fail as rewards.RewardError (rewards/scoring.py), which the trainer reports the same way.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps); the last good checkpoint is kept."""


class PluginError(RuntimeError):
    """A plug-in raised, or returned something unusable; the message names the setting, the plug-in and its file."""


class NoSignalError(PluginError):
    """A plug-in estimator gave no finite advantage: nothing to learn from (refused at the probe; a step with it is
    skipped as a non-finite one is)."""


def source_file(function: Callable) -> str:
    """The file a plug-in's code lives in ('?' when it has none, a builtin say)."""
    try:
        return inspect.getsourcefile(inspect.unwrap(function)) or "?"
    except TypeError:
        return "?"


def raised_at(error: BaseException, function: Callable) -> str:
    """`file:line` of the innermost frame of `error`'s traceback inside the plug-in's file (else its file)."""
    path = source_file(function)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == path]
    return f"{path}:{frames[-1].lineno}" if frames else path


def guarded(function: Callable, setting: str, spec: str) -> Callable:
    """`function` (the plug-in `spec` of `setting`), whose exceptions become one PluginError that names them."""

    @functools.wraps(function)  # its name and signature (the start-of-run checks read them)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except PluginError:
            raise
        except (Exception, SystemExit) as error:  # any exception of user code (sys.exit too), with where it came from
            raise PluginError(f"{setting} {spec!r} raised {type(error).__name__} at {raised_at(error, function)}: "
                              f"{error}") from error

    return call
