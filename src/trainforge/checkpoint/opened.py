"""A verified checkpoint as its readers see it: a local directory, or an encrypted checkpoint's
plaintext held in anonymous files.

Plaintext never outlives its process. Each decrypted file is a ``memfd`` (elsewhere than Linux, a
temporary file unlinked before a byte is written into it): no directory names it, so the kernel
frees it once its last descriptor closes, which a normal exit, an exception, a SIGKILL and an OOM
kill all do. There is nothing for a later run to sweep, on this machine or any other.

Readers ask for files by their names inside the checkpoint (``trainer_state.json``,
``<component>.safetensors``, ``sharded/__0_0.distcp``): :meth:`CheckpointFiles.open` for a
stream (a regular file, never a link), :meth:`CheckpointFiles.path` for a library that opens by
name (safetensors maps the file; the name is valid in this process only).

The driver's copy of the final weights into the run directory (:func:`write_whole`) is plaintext
meant to stay; until it is whole it has no name either, or (where the file system refuses to link
an unnamed file) a name that tells its owner process, removed by the next copy once that is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from trainforge.checkpoint.schema import open_regular

if TYPE_CHECKING:
    from trainforge.checkpoint.crypto import FileCipher


class CheckpointFiles(Protocol):
    """A checkpoint's files by their names inside it."""

    name: str  # the checkpoint's directory name

    def listing(self) -> set[str]:
        """Every file's name inside the checkpoint (``a/b`` for nested ones)."""
        ...

    def open(self, rel: str) -> BinaryIO:
        """File ``rel`` opened for reading from its start; FileNotFoundError when there is none."""
        ...

    def path(self, rel: str) -> str:
        """A name that opens file ``rel`` in this process, for libraries that open by name."""
        ...


class DirectoryFiles:
    """A local checkpoint directory (plaintext, or a checkpoint that is not encrypted)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = root.name

    def listing(self) -> set[str]:
        return {p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()}

    def open(self, rel: str) -> BinaryIO:
        return open_regular(self.root / rel, rel)

    def path(self, rel: str) -> str:
        return str(self.root / rel)


class DecryptedFiles:
    """An encrypted checkpoint's plaintext, one anonymous file per file, by name; :func:`decrypted`
    makes one and closes it (the files are gone then)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._descriptors: dict[str, int] = {}

    def listing(self) -> set[str]:
        return set(self._descriptors)

    def open(self, rel: str) -> BinaryIO:
        # A new open file description on Linux (its own offset); /dev/fd elsewhere shares one.
        descriptor = os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC)
        os.lseek(descriptor, 0, os.SEEK_SET)
        return os.fdopen(descriptor, "rb")

    def path(self, rel: str) -> str:
        descriptor = self._descriptors.get(rel)
        if descriptor is None:
            raise FileNotFoundError(errno.ENOENT, f"{rel} is not in the checkpoint", rel)
        return f"{_FD_DIR}/{descriptor}"

    def add(self, rel: str) -> BinaryIO:
        """A new anonymous file for ``rel``, opened for writing (the caller closes the stream)."""
        descriptor = anonymous_file()
        self._descriptors[rel] = descriptor
        return os.fdopen(os.dup(descriptor), "wb")

    def close(self) -> None:
        """Close every file: the kernel frees their pages (no name holds them)."""
        descriptors, self._descriptors = self._descriptors, {}
        for descriptor in descriptors.values():
            os.close(descriptor)

    @property
    def closed(self) -> bool:
        return not self._descriptors


_FD_DIR = "/proc/self/fd" if sys.platform.startswith("linux") else "/dev/fd"


def anonymous_file() -> int:
    """A descriptor of a new, empty file that no directory names (closed on exec)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("trainforge-plain", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as handle:  # unlinked when created, before anything is written
        descriptor = os.dup(handle.fileno())
    os.set_inheritable(descriptor, False)
    return descriptor


@contextlib.contextmanager
def decrypted(directory: Path, files: Iterable[str], cipher: FileCipher) -> Iterator[DecryptedFiles]:
    """The plaintext of ``files`` of the encrypted checkpoint at ``directory``, each file
    authenticated before it is read, in anonymous files that close (and vanish) on exit."""
    plain = DecryptedFiles(directory.name)
    names = list(files)
    _allow_descriptors(len(names))
    try:
        for rel in names:
            source_path = directory / rel
            with open(source_path, "rb") as source, plain.add(rel) as out:
                cipher.open_stream(rel, source, source_path.stat().st_size, out)
        yield plain
    finally:
        plain.close()


def _allow_descriptors(count: int) -> None:
    """Raise this process's soft limit on open files (up to its hard limit) so that ``count``
    more fit: each decrypted file holds one (a checkpoint of many ranks has many files)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = len(os.listdir(_FD_DIR)) + count + 64 if os.path.isdir(_FD_DIR) else count + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard)
        )


def write_whole(target: Path, fill: Callable[[BinaryIO], None]) -> None:
    """``target`` written by ``fill`` and given its name once complete. The bytes go into a file of
    ``target``'s folder that has no name (Linux's ``O_TMPFILE``), linked in when whole, so a process
    killed while writing leaves nothing behind. Where the file system or the sandbox refuses that
    link, the finished bytes are copied to ``.<name>.partial-<owner>`` and renamed into place; a
    partial file whose owner process is gone is removed by the next write of that name."""
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        if not alive(stale.name.rsplit(".partial-", 1)[1]):
            stale.unlink(missing_ok=True)
    partial = target.with_name(f".{target.name}.partial-{process_mark()}")
    try:
        descriptor = os.open(target.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):  # no O_TMPFILE here, or not on this file system
        try:
            with open(partial, "wb") as out:
                fill(out)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return
    with os.fdopen(descriptor, "w+b") as out:
        fill(out)
        out.flush()
        if not _link_in(f"/proc/self/fd/{out.fileno()}", target, partial):  # refused (EXDEV in some sandboxes)
            out.seek(0)
            try:
                with open(partial, "wb") as copy:
                    shutil.copyfileobj(out, copy, _COPY_CHUNK)
                partial.replace(target)
            finally:
                partial.unlink(missing_ok=True)


def _link_in(unnamed: str, target: Path, partial: Path) -> bool:
    """Give the unnamed file ``target``'s name (replacing a file there whole); False if the file
    system refuses to link it."""
    try:
        os.link(unnamed, target, follow_symlinks=True)
        return True
    except FileExistsError:  # linked beside it, then renamed over it
        partial.unlink(missing_ok=True)
    except OSError:
        return False
    try:
        os.link(unnamed, partial, follow_symlinks=True)
    except OSError:
        return False
    partial.replace(target)
    return True


_COPY_CHUNK = 8 << 20


def process_mark(pid: int | None = None) -> str:
    """``<pid>-<start time>`` of a process: names what it owns, and tells it from a later process
    that reuses its pid."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid)}"


def alive(mark: str) -> bool:
    """Whether the process :func:`process_mark` named still runs (a malformed mark: no)."""
    pid_text, _, started = mark.partition("-")
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid
        pass
    return _start_time(pid) == started


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux's /proc), or "0" where unknown."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "0"
    return stat_line.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces


def as_files(where: Path | CheckpointFiles) -> CheckpointFiles:
    """A checkpoint's files, given its directory or its files."""
    return DirectoryFiles(where) if isinstance(where, Path) else where


__all__ = [
    "CheckpointFiles",
    "DecryptedFiles",
    "DirectoryFiles",
    "alive",
    "anonymous_file",
    "as_files",
    "decrypted",
    "process_mark",
    "write_whole",
]
