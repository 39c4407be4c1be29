"""Reading a file a user names (a flag, a config key, an input): regular files only, bounded.

A FIFO opened for reading waits for a writer and a device such as ``/dev/zero`` never ends, so a
path the user gives is opened without blocking (``O_NONBLOCK``), checked to be a regular file on
the descriptor it was opened as, and read up to a limit. Every problem is one line naming the flag
or key, never a hang or a traceback. Checkpoints have their own stricter reader, which also refuses
symbolic links (``checkpoint/schema.open_regular``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainforge.errors import TrainforgeError

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def read_user_file(
    path: str | os.PathLike[str], what: str, max_bytes: int, error: type[TrainforgeError] = TrainforgeError
) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them; ``error`` naming
    ``what`` (``--token-file F``, ``data.path F``) when it is missing, not a regular file, unreadable
    or larger."""
    try:
        descriptor = os.open(Path(path).expanduser(), _OPEN_FLAGS)
    except FileNotFoundError:
        raise error(f"{what}: no such file") from None
    except OSError as err:
        raise error(f"{what}: cannot be read ({err.strerror or err})") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{what}: {file_kind(mode)}, not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(descriptor, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise error(f"{what}: cannot be read ({err.strerror or err})") from None
    finally:
        os.close(descriptor)
    if size > max_bytes:
        raise error(f"{what}: larger than {human_size(max_bytes)}, the most read")
    return b"".join(chunks)


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` is, for a message: ``a FIFO``, ``a directory``, ..."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def human_size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"
