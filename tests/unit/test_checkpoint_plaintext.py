"""Plaintext never outlives its process (#36): an encrypted checkpoint's files are decrypted into
files that no directory names, so a process killed with SIGKILL at any point of a restore (or of
the driver's copy of the final weights into the run directory) leaves nothing decrypted behind,
and the next restore or ``ckpt inspect`` starts on a clean machine.

Each case forks a real process that restores (or copies out) an encrypted checkpoint and stops at
a point of the decryption or the load, where the plaintext must exist (it is looked for among the
process's open files and in the file system); it is killed there with SIGKILL, and neither the
file system nor the next reader finds a byte of the plaintext or a ``trainforge-plain`` name.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests.helpers.checkpoints import MODEL_FILE, snapshot
from tests.unit.test_checkpoint import save_all, small_model, trained
from tests.unit.test_checkpoint_crypto import cipher
from tests.unit.test_checkpoint_hostile import worker_run, writer
from trainforge.checkpoint import crypto, reader
from trainforge.checkpoint.inspect import inspect_checkpoint
from trainforge.checkpoint.opened import process_mark
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.worker import saving
from trainforge.worker.saving import restore

SHM = Path("/dev/shm")
STEP = 5
_MAX_SCANNED = 64 << 20


def encrypted_run(tmp_path: Path) -> tuple[CheckpointStore, bytes]:
    """A run with one encrypted checkpoint, and bytes only its plaintext holds (weights drawn
    from the OS's randomness, so no other test's checkpoint has them)."""
    store = CheckpointStore.from_uri(str(tmp_path / "run"), cipher())
    saver = writer(tmp_path, store)
    saver.cipher = store.cipher
    model = small_model()
    optimizer = trained(model)
    unique = torch.frombuffer(bytearray(os.urandom(4 * 96)), dtype=torch.int32).float().reshape(16, 6)
    with torch.no_grad():
        model[0].weight.copy_(unique)
    [outcome] = save_all(saver, [snapshot(model, optimizer, STEP)])
    assert outcome.error is None, outcome.error
    return store, unique.numpy().tobytes()[:64]


def plaintext_in_files(roots: list[Path], needle: bytes, since: float) -> list[str]:
    """Paths under ``roots`` named ``trainforge-plain*`` or holding ``needle`` (files of this user;
    under /dev/shm only those changed since ``since``, as other processes share it)."""
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                path = os.path.join(folder, name)
                try:
                    info = os.lstat(path)
                    if info.st_uid != os.getuid() or (root == SHM and info.st_mtime < since):
                        continue
                    if name.startswith("trainforge-plain"):
                        found.append(path)
                    elif stat.S_ISREG(info.st_mode) and info.st_size <= _MAX_SCANNED:
                        with open(path, "rb") as handle:
                            if needle in handle.read():
                                found.append(path)
                except OSError:  # gone meanwhile, or not ours to read
                    continue
    return found


def plaintext_held(pid: int, needle: bytes) -> bool:
    """Whether a file process ``pid`` has open holds ``needle`` (what a memfd would)."""
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            info = os.stat(f"/proc/{pid}/fd/{entry}")
            if stat.S_ISREG(info.st_mode) and info.st_size <= _MAX_SCANNED:
                with open(f"/proc/{pid}/fd/{entry}", "rb") as handle:
                    if needle in handle.read():
                        return True
        except OSError:
            continue
    return False


def pause_points(stop_at: str, say: Callable[[str], None]) -> None:
    """In the forked process: stop (tell the test, then wait to be killed) at ``stop_at``."""

    def pause(point: str) -> None:
        if point == stop_at:
            say(point)
            while True:
                signal.pause()

    original_stream = crypto.FileCipher.open_stream

    def open_stream(self: crypto.FileCipher, rel: str, source: IO[bytes], size: int, target: IO[bytes]) -> None:
        if type(target).__name__ == "_Discard":  # verification: decrypted into nothing
            return original_stream(self, rel, source, size, target)

        class Tap:
            def write(self, data: bytes) -> int:
                written = target.write(data)
                if hasattr(target, "flush"):
                    target.flush()  # as a file bigger than a buffer would be by now
                pause("mid-file")
                return written

        original_stream(self, rel, source, size, Tap())  # type: ignore[arg-type]
        pause(f"decrypted {rel}")

    original_read, original_load = reader.read_tensors, saving.load_into

    def read_tensors(*args: Any, **kwargs: Any) -> Any:
        pause("reading tensors")
        return original_read(*args, **kwargs)

    def load_into(*args: Any, **kwargs: Any) -> Any:
        loaded = original_load(*args, **kwargs)
        pause("loaded")
        return loaded

    crypto.FileCipher.open_stream = open_stream  # type: ignore[method-assign]
    reader.read_tensors = read_tensors
    saving.load_into = load_into


@pytest.fixture
def killed_at(tmp_path: Path) -> Iterator[Callable[[Callable[[], Any], str], int]]:
    """``killed_at(work, point)``: fork a process that runs ``work`` until ``point``; its pid once
    it is there (the test kills it)."""
    children: list[int] = []

    def run(work: Callable[[], Any], point: str) -> int:
        scratch = tmp_path / "tmp"
        scratch.mkdir(exist_ok=True)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                os.close(read_end)
                tempfile.tempdir = str(scratch)
                torch.set_num_threads(1)
                pause_points(point, lambda said: os.write(write_end, f"{said}\n".encode()))
                work()
                os.write(write_end, b"finished\n")
            except BaseException as err:
                os.write(write_end, f"failed: {err!r}\n".encode())
            finally:
                os._exit(0)
        children.append(pid)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as events:
            said = events.readline().decode().strip()  # blocks until the child is there (or gone)
        assert said == point, f"the restore did not stop at {point!r}: {said or 'no word'}"
        return pid

    yield run
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and fork: Linux")
@pytest.mark.parametrize(
    "point", ["mid-file", "decrypted trainer_state.json", f"decrypted {MODEL_FILE}", "reading tensors", "loaded"]
)
def test_a_restore_killed_at_any_point_leaves_no_plaintext(
    tmp_path: Path, point: str, killed_at: Callable[[Callable[[], Any], str], int]
) -> None:
    started = time.time() - 1
    store, needle = encrypted_run(tmp_path)
    roots = [SHM, tmp_path] if SHM.is_dir() else [tmp_path]
    assert not plaintext_in_files(roots, needle, started)  # the checkpoint itself is ciphertext

    pid = killed_at(lambda: restore(worker_run(tmp_path), store), point)
    assert plaintext_held(pid, needle) or plaintext_in_files(roots, needle, started), "no plaintext to leave"
    kill(pid)
    assert not plaintext_in_files(roots, needle, started)

    # What the next run and the next `ckpt inspect` do: both read the checkpoint, nothing is left.
    path = str(tmp_path / "run" / checkpoint_name(STEP))
    report = inspect_checkpoint(path, store.cipher)
    assert report["problems"] == [] and report["step"] == STEP
    assert restore(worker_run(tmp_path), store).progress.global_step == STEP
    assert not plaintext_in_files(roots, needle, started)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and fork: Linux")
@pytest.mark.parametrize("point", ["mid-file", f"decrypted {MODEL_FILE}"])
def test_the_final_weights_copy_killed_midway_leaves_nothing_in_the_run_directory(
    tmp_path: Path, point: str, killed_at: Callable[[Callable[[], Any], str], int]
) -> None:
    store, needle = encrypted_run(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    name = checkpoint_name(STEP)
    pid = killed_at(lambda: store.copy_out(name, MODEL_FILE, out / MODEL_FILE), point)
    kill(pid)
    assert not plaintext_in_files([out], needle, 0) and not list(out.iterdir())

    # Where the unnamed file cannot be linked in, a named copy is made at the end: one that a
    # killed process left is removed by the next write, one a live process is writing is not.
    dead, live = out / f".{MODEL_FILE}.partial-{pid}-1", out / f".{MODEL_FILE}.partial-{process_mark(os.getppid())}"
    dead.write_bytes(needle)
    live.write_bytes(b"being written")
    store.copy_out(name, MODEL_FILE, out / MODEL_FILE)  # whole, it is the run's product in plaintext
    store.copy_out(name, MODEL_FILE, out / MODEL_FILE)  # again: replaced whole
    assert sorted(p.name for p in out.iterdir()) == sorted([MODEL_FILE, live.name])
    assert plaintext_in_files([out], needle, 0) == [str(out / MODEL_FILE)]
