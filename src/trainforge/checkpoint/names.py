"""The names of checkpoint directories, formatted and parsed in this one place.

``checkpoint_<step:09d>`` is a committed checkpoint (9 digits, so names sort by step);
``.tmp-checkpoint_<step>-<random>`` a save in progress (or one that never finished);
``.invalid-checkpoint_<step>-<ns>-<random>`` an invalid checkpoint set aside. No imports beyond the
standard library, so the driver and the CLI can use it cheaply.
"""

from __future__ import annotations

import re
import time
import uuid

TEMP_PREFIX = ".tmp-"
RETIRED_PREFIX = ".invalid-"
_CHECKPOINT = re.compile(r"checkpoint_(\d{1,18})")
_HIDDEN = re.compile(r"(?:\.tmp-|\.invalid-)checkpoint_(\d{1,18})(?!\d)")


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``: ``checkpoint_000000100``."""
    if step < 0:
        raise ValueError(f"a checkpoint's step is >= 0, not {step}")
    return f"checkpoint_{step:09d}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a committed checkpoint's directory name, None for any other name."""
    match = _CHECKPOINT.fullmatch(name)
    return int(match.group(1)) if match else None


def name_of_uri(uri: str) -> str:
    """The last segment of a checkpoint's path or URI (a query such as ``?endpoint_override=`` left
    out): the checkpoint's directory name."""
    path = uri.partition("?")[0] if "://" in uri else uri
    return path.rstrip("/").rpartition("/")[2]


def step_of_uri(uri: str) -> int | None:
    """The step of the checkpoint a path or URI names (its last segment), None if it names none."""
    return parse_checkpoint_name(name_of_uri(uri))


def staging_name(name: str) -> str:
    """A fresh, unique hidden name to write checkpoint ``name`` under before it is committed."""
    return f"{TEMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"


def retired_name(name: str) -> str:
    """A unique hidden name to set an invalid checkpoint aside under (two in one second differ)."""
    return f"{RETIRED_PREFIX}{name}-{time.time_ns()}-{uuid.uuid4().hex[:8]}"


def step_of_hidden(name: str) -> int | None:
    """The step of a staging (``.tmp-``) or set-aside (``.invalid-``) directory's name, else None."""
    match = _HIDDEN.match(name)
    return int(match.group(1)) if match else None
