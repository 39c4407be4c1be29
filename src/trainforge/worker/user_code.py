"""A user's exception before the first step: not a crash to retry, a mistake to report.

When every rank raises the same exception while building the run (the model's factory, the data)
or in the first step of a fresh run (the model's ``forward``), a restart would raise it again: the
worker returns it as a ``UserCodeError`` naming the exception and the user's own ``file:line``, and
the run ends after one attempt (exit 2). A rank that raises alone leaves the others in a collective
until it times out, and Ray Train restarts the group as for any crash; so do failures of the
process group, running out of memory, and anything after steps were done.
"""

from __future__ import annotations

import os
import traceback

import torch

from trainforge.config.factories import raised_at
from trainforge.errors import UserCodeError
from trainforge.redact import redact_text

COMMUNICATION = (os.sep + os.path.join("torch", "distributed") + os.sep, os.sep + "ray" + os.sep)
COMMUNICATION_TEXT = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out")


def is_user_code_error(err: BaseException) -> bool:
    """Whether ``err`` is one the user's code raised, the same on any attempt: not a failure of the
    process group or of a peer, not out of memory."""
    if not isinstance(err, Exception) or isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return False
    if isinstance(err, torch.distributed.DistError):
        return False
    text = str(err).lower()
    if any(word in text for word in COMMUNICATION_TEXT):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return not frames or not any(part in os.path.realpath(frames[-1].filename) for part in COMMUNICATION)


def user_code_error(err: BaseException, when: str) -> UserCodeError:
    """One line: the exception, where in the user's code it was raised, and that it was not retried."""
    lines = str(err).strip().splitlines()
    what = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    where = raised_at(err)
    return UserCodeError(
        redact_text(
            f"{what}{where}, raised by every worker {when}; fix it and run again (not retried: it would "
            "fail the same way)"
        )
    )
