"""The run lock: one trainforge driver at a time per run directory and per checkpoint folder.

Two drivers in one run directory delete and rotate each other's checkpoints and interleave
summary.json and metrics.jsonl. Before Ray starts, the driver takes an exclusive ``flock`` on
``<dir>/.lock`` and writes who it is into that file; when the run ends, however it ends, it clears
the record and unlocks. A holder that dies without doing so (SIGKILL, a crash) loses its flock to
the kernel at once; its record stays behind and the next run takes over with a warning naming it.
The file is never deleted: unlinking a lock file that another process has just opened would let
two runs lock two different files.

The record matters where flock cannot be trusted. On NFS, Linux forwards flock to the server as a
POSIX lock unless the mount says ``local_lock=flock``/``all`` or ``nolock``, in which case flock
only excludes processes on the same host. So a record naming a live process on this host is
refused even when flock succeeds, and one naming another host is taken over with a warning that
says what that means. Object stores (``s3://``) have no exclusive create: they are not locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil
import yaml

from trainforge.config import Config
from trainforge.errors import ConfigError, RunLockedError
from trainforge.files import file_kind
from trainforge.redact import MASK, is_secret_key, redact_config, redact_text

log = logging.getLogger("trainforge")

LOCK_FILE = ".lock"
_RECORD_MAX = 4096  # the record is read back from a shared directory: bounded
_START_SLACK_S = 1.0  # psutil's start times of one process agree to the clock tick; a reused PID differs by more


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: written into the lock file as JSON."""

    host: str
    pid: int
    started_at: str  # when it took the lock, UTC
    process_started: float  # the process's start time (psutil), which tells a reused PID apart
    command: str

    @classmethod
    def me(cls) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            process_started=psutil.Process().create_time(),
            command=_command(),
        )

    def describe(self) -> str:
        return f"PID {self.pid} on host {self.host}, started {self.started_at} (command: {self.command})"

    def is_here(self) -> bool:
        return self.host == socket.gethostname()

    def is_running(self) -> bool:
        """On this host: the same process (not a reused PID) still exists."""
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            return abs(process.create_time() - self.process_started) < _START_SLACK_S
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # it exists; we cannot look closer, so it may be the holder


def _command() -> str:
    """This process's command line, fit for a file others read: credentials masked (redact.py)."""
    words = [Path(sys.argv[0]).name, *sys.argv[1:]]
    return redact_text(shlex.join(_shown(word) for word in words))[:300]


def _shown(word: str) -> str:
    """One word of a command line with the value of a ``KEY=VALUE`` item masked (also given as
    ``--set=KEY=VALUE``) when KEY is secret-named or VALUE, read as YAML, holds a secret-named key."""
    option, equals, item = word.partition("=") if word.startswith("--") else ("", "", word)
    key, assigns, value = item.partition("=")
    if not assigns:
        return word
    if is_secret_key(key) or _holds_secret(value):
        return f"{option}{equals}{key}={MASK}"
    return word


def _holds_secret(text: str) -> bool:
    """Whether ``text`` is YAML with a secret-named key anywhere in it (``{hf_token: ...}``)."""
    if ":" not in text:
        return False
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return redact_config(value) != value


class RunLock:
    """A held lock; ``release`` clears the record and unlocks (idempotent)."""

    def __init__(self, path: Path, descriptor: int | None) -> None:
        self.path = path
        self._descriptor = descriptor

    def release(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is None:
            return
        try:
            os.ftruncate(descriptor, 0)  # a clean release leaves no record: the next run takes it silently
        except OSError as err:
            log.warning("could not clear the lock record %s: %s", self.path, err)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(directory: Path, *, what: str, advice: str, wait_s: float = 0.0) -> RunLock:
    """Lock ``directory`` (which must exist) for this process, or raise RunLockedError in one line
    naming the holder. ``what`` names the directory in messages, ``advice`` says what to do instead;
    ``wait_s`` waits that long for a holder that is ending (a restarted tune trial)."""
    path = directory / LOCK_FILE
    try:
        # O_NONBLOCK: a FIFO planted as .lock must not block the open (it is refused below).
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ConfigError(f"{what} {directory} is not writable: cannot open {path}: {err.strerror or err}") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise ConfigError(
            f"{what} {directory}: its lock file {path} is {file_kind(mode)}, not a regular file; remove it "
            "(trainforge creates it)"
        )
    try:
        if not _flock(descriptor, path, wait_s):
            holder = _read_holder(descriptor, settle_s=0.5)
            raise RunLockedError(_refusal(what, directory, holder, advice))
        previous = _read_holder(descriptor)
        if previous is not None:
            _take_over(what, directory, previous, advice)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps(asdict(Holder.me())).encode(), 0)
        os.fsync(descriptor)  # on a shared file system, others read the record from the server
    except BaseException:
        os.close(descriptor)  # also drops the flock, if it was taken
        raise
    return RunLock(path, descriptor)


def _flock(descriptor: int, path: Path, wait_s: float) -> bool:
    """True once the exclusive flock is ours; False if another holds it past ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # Some FUSE and NFS mounts refuse flock: the record alone decides, on this host only.
            log.warning("no flock on the file system of %s (%s): only the holder record guards it", path, err)
            return True


def _read_holder(descriptor: int, settle_s: float = 0.0) -> Holder | None:
    """The record in the lock file; None when empty or unreadable. ``settle_s``: a holder that has
    just taken the flock writes its record a moment later, so an empty file is read again."""
    deadline = time.monotonic() + settle_s
    while True:
        raw = os.pread(descriptor, _RECORD_MAX, 0)
        if raw or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    try:
        data = json.loads(raw)
        return Holder(
            host=str(data["host"]),
            pid=int(data["pid"]),
            started_at=str(data["started_at"]),
            process_started=float(data["process_started"]),
            command=str(data["command"])[:300],
        )
    except (ValueError, KeyError, TypeError):  # empty, half-written or not ours
        return None


def _refusal(what: str, directory: Path, holder: Holder | None, advice: str) -> str:
    if holder is None:
        who = "another process (it left no holder record)"
    elif not holder.is_here():
        who = f"{holder.describe()}; that is another host, whose lock this shared file system honours"
    elif not holder.is_running():
        who = (
            f"{holder.describe()}; that process has ended but a process it started still holds the lock "
            f"(find it with: fuser {directory / LOCK_FILE})"
        )
    else:
        who = holder.describe()
    return f"{what} {directory} is in use by another trainforge run: {who}; {advice}"


def _take_over(what: str, directory: Path, previous: Holder, advice: str) -> None:
    """flock is ours but a record was left behind: the holder ended without releasing, or flock does
    not reach it (NFS without shared locks). Refuse a holder known to run, warn about the rest."""
    if not previous.is_here():
        log.warning(
            "taking over the lock of %s %s left by %s: flock says it is free; if that run is still going, "
            "this file system does not share locks between hosts (NFS with local_lock or nolock): stop one of them",
            what,
            directory,
            previous.describe(),
        )
    elif previous.pid != os.getpid() and previous.is_running():
        raise RunLockedError(
            _refusal(what, directory, previous, advice) + " (flock did not stop it: does this file system support it?)"
        )
    else:
        log.warning(
            "taking over the lock of %s %s left by %s, which is no longer running", what, directory, previous.describe()
        )


def check_writable(directory: Path, key: str) -> None:
    """Create ``directory`` and a file in it, so that an unwritable ``key`` fails in one line before Ray starts."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        raise ConfigError(f"{key} {directory.parent} is not writable: {err.strerror or err}{where}") from None


def refuse_dangling_links(path: Path, key: str) -> None:
    """A symbolic link to nothing on the way to a run's folder: resolved, the run would make the
    link's target, a folder nobody named; one line instead (a link to a folder is a choice: kept)."""
    given = path.expanduser()
    for step in (given, *given.parents):
        if step.is_symlink() and not step.exists():
            raise ConfigError(
                f"{key} {given.parent}: {step} is a symbolic link to {os.readlink(step)}, which does not exist: "
                "make that folder, or give the real path"
            )


@contextlib.contextmanager
def run_locks(config: Config, *, local: bool, wait_s: float = 0.0) -> Iterator[None]:
    """Hold the run's locks for the ``with`` block: its run directory (created, and checked to be
    writable, first), and its checkpoint folder when that is another local directory."""
    run_dir = config.run_dir
    refuse_dangling_links(Path(config.run.output_dir) / config.run.name, "run.output_dir")
    if config.checkpoint.storage_path and "://" not in config.checkpoint.storage_path:
        refuse_dangling_links(Path(config.checkpoint.storage_path) / config.run.name, "checkpoint.storage_path")
    check_writable(run_dir, "run.output_dir")
    with contextlib.ExitStack() as held:
        advice = "wait for it to end, or choose another run.name or run.output_dir"
        held.enter_context(acquire(run_dir, what="run directory", advice=advice, wait_s=wait_s))
        root = checkpoint_root(config, local=local)
        if root is not None and root != run_dir:
            check_writable(root, "checkpoint.storage_path")
            advice = "wait for it to end, or choose another run.name or checkpoint.storage_path"
            held.enter_context(acquire(root, what="checkpoint folder", advice=advice, wait_s=wait_s))
        yield


def checkpoint_root(config: Config, *, local: bool) -> Path | None:
    """The local folder that holds the run's checkpoints, when the driver can lock it.

    Checkpoints live in ``<storage_path>/<run.name>`` (launch.check_resume, Ray Train's RunConfig),
    so runs of other names that share a storage_path never collide; what collides is the same
    run.name under one storage_path from two run directories. A remote cluster's paths are its own
    unless this machine sees the storage root too (a job driver on a node with the shared mount).
    """
    storage = config.storage_path
    if "://" in storage:
        log.info(
            "checkpoint.storage_path is an object store (%s): it cannot be locked, so make sure no other "
            "run uses run.name %s there (docs/operations.md, 'The run lock')",
            storage.split("://", 1)[0],
            config.run.name,
        )
        return None
    if not local and not Path(storage).is_dir():
        return None
    return Path(storage) / config.run.name
