"""Why a checkpoint is not valid, typed: a kind that decisions read, then the text that people read.

Restore decides by the kind alone: a checkpoint that needs another key is not corrupt (a fresh start
over it would bury it), and one written in an earlier format needs ``trainforge ckpt upgrade``, not
to be skipped. No decision reads a problem's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainforge.errors import CheckpointError

ProblemKind = Literal["invalid", "key", "outdated", "unreadable"]
INVALID: ProblemKind = "invalid"  # missing, corrupt, malformed or unsafe: not loadable as it is
KEY: ProblemKind = "key"  # encrypted, and this reader has no key or another key
OUTDATED: ProblemKind = "outdated"  # an earlier release's format: ``trainforge ckpt upgrade`` converts it
UNREADABLE: ProblemKind = "unreadable"  # storage did not answer (unreachable, permission denied)


@dataclass(frozen=True)
class Problem:
    """One reason a checkpoint is not valid."""

    kind: ProblemKind
    text: str

    def __str__(self) -> str:
        return self.text


class KeyProblem(CheckpointError):
    """The checkpoint is encrypted and the reader has no key, or another key."""

    kind: ProblemKind = KEY


class OutdatedCheckpoint(CheckpointError):
    """The checkpoint was written in an earlier format: ``trainforge ckpt upgrade PATH`` converts it."""

    kind: ProblemKind = OUTDATED


def problem_of(err: CheckpointError) -> Problem:
    """A raised CheckpointError as a problem of its kind (``invalid`` unless it names another)."""
    kind: ProblemKind = getattr(err, "kind", INVALID)
    return Problem(kind, str(err))
