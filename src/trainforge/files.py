"""Reading a file a user names (a flag, a config key, an input): regular files only, bounded.

A FIFO opened for reading waits for a writer and a device such as ``/dev/zero`` never ends, so a
path the user gives is opened without blocking (``O_NONBLOCK``), checked to be a regular file on
the descriptor it was opened as, and read up to a limit. Every problem is one line naming the flag
or key, never a hang or a traceback. Checkpoints have their own stricter reader, which also refuses
symbolic links (``checkpoint/schema.open_regular``).

A safetensors file starts with the length of its JSON header (8 bytes, little-endian): every
reader of one (``model.pretrained``, a checkpoint's weights, ``export``, ``generate``) asks
:func:`safetensors_header` first, which refuses a header longer than ``SAFETENSORS_MAX_HEADER``
or listing more than ``SAFETENSORS_MAX_TENSORS`` tensors before parsing a byte of it: parse time
is bounded, whatever the file says.

A path given as an output (``--output``, ``certs create FOLDER``) goes through
:func:`check_output_path` before any work starts: a symbolic link there (to a folder, to a file, or
dangling) is refused rather than written through, as is a file where a folder belongs and the
reverse, and a parent folder that is missing or not writable; one line naming the flag, never a
traceback.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Literal

from trainforge.errors import TrainforgeError, printable

# The largest real headers (a single-file model of a few thousand tensors) take a few hundred KB.
SAFETENSORS_MAX_HEADER = 16 << 20
SAFETENSORS_MAX_TENSORS = 100_000

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


def safetensors_header(
    path: str | os.PathLike[str], what: str, error: type[TrainforgeError] = TrainforgeError
) -> tuple[int, dict[str, Any]]:
    """The JSON header of the safetensors file ``path`` and the offset where its data starts, the
    header's length checked against the limits before it is read; ``error`` naming ``what`` (the
    key or flag and the file) otherwise. The offsets and dtypes are left to safetensors."""
    try:
        descriptor = os.open(Path(path), _OPEN_FLAGS)
    except OSError as err:
        raise error(f"{what}: cannot be read ({err.strerror or err})") from None
    with os.fdopen(descriptor, "rb") as handle:
        mode = os.fstat(descriptor)
        if not stat.S_ISREG(mode.st_mode):
            raise error(f"{what}: {file_kind(mode.st_mode)}, not a regular file")
        length = int.from_bytes(handle.read(8), "little") if mode.st_size >= 8 else -1
        if length < 0 or length > mode.st_size - 8:
            raise error(f"{what}: not a readable safetensors file (it ends before its header does)")
        if length > SAFETENSORS_MAX_HEADER:
            raise error(
                f"{what}: its safetensors header is {length} bytes, more than the "
                f"{human_size(SAFETENSORS_MAX_HEADER)} trainforge reads (SAFETENSORS_MAX_HEADER): refused unread"
            )
        raw = handle.read(length)
    if raw.count(b'"data_offsets"') > SAFETENSORS_MAX_TENSORS:  # an upper bound, counted before parsing
        raise error(
            f"{what}: its safetensors header lists more than {SAFETENSORS_MAX_TENSORS} tensors, the most "
            "trainforge reads (SAFETENSORS_MAX_TENSORS): refused unparsed"
        )
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise error(
            f"{what}: not a readable safetensors file (its header is not JSON: {printable(str(err))[:200]})"
        ) from None
    if not isinstance(header, dict):
        raise error(f"{what}: not a readable safetensors file (its header is not a JSON object)")
    return 8 + length, header


def check_output_path(
    path: str | os.PathLike[str],
    flag: str,
    kind: Literal["file", "folder"],
    error: type[TrainforgeError] = TrainforgeError,
) -> None:
    """``path`` may be written as a ``kind``: new, or an existing regular file (``file``) or real
    directory (``folder``; whether it must be empty is the verb's rule), never a symbolic link; the
    folder it goes into must exist (for a new ``folder``: its nearest existing ancestor) and be
    writable. ``error`` names ``flag`` and the path otherwise."""
    given = Path(path).expanduser()
    where = f"{flag} {given}"
    try:
        mode: int | None = os.lstat(given).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        parents = Path(os.path.abspath(given)).parents
        blocker = next((p for p in parents if os.path.lexists(p) and not p.is_dir()), given.parent)
        raise error(f"{where}: {blocker} is a file, not a folder") from None
    except OSError as err:
        raise error(f"{where}: cannot be checked ({err.strerror or err})") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise error(
            f"{where}: a symbolic link ({'dangling' if not given.exists() else 'to ' + str(given.resolve())}); "
            "outputs are not written through links: give the real path"
        )
    if mode is not None and kind == "folder" and not stat.S_ISDIR(mode):
        raise error(f"{where}: exists and is {'a file' if stat.S_ISREG(mode) else file_kind(mode)}, not a folder")
    if mode is not None and kind == "file" and not stat.S_ISREG(mode):
        raise error(f"{where}: exists and is {file_kind(mode)}, not a file to write")
    parent = Path(os.path.abspath(given)).parent
    if kind == "folder":
        while not os.path.lexists(parent) and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        missing = f"folder {parent} does not exist" if not os.path.lexists(parent) else f"{parent} is not a folder"
        raise error(f"{where}: {missing}")
    # A new path is made in its folder, and a folder's output is staged beside it and renamed.
    if (mode is None or kind == "folder") and not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{where}: folder {parent} is not writable")
    if mode is not None and not os.access(given, os.W_OK | (os.X_OK if kind == "folder" else 0)):
        raise error(f"{where}: not writable")
    if mode is None or kind == "folder":
        _try_a_new_file(given if mode is not None else parent, where, error)


def _try_a_new_file(folder: Path, where: str, error: type[TrainforgeError]) -> None:
    """Make and remove a file in ``folder``: permissions say yes to root where the file system says
    no (/sys, /proc, a read-only mount), and the verb's write must not be the first to find out."""
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".trainforge-write-test-")
    except OSError as err:
        raise error(f"{where}: folder {folder} takes no new file ({err.strerror or err})") from None
    os.close(handle)
    os.unlink(name)


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
