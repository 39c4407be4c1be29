"""The run lock (driver/runlock.py): one driver per run directory, stale locks taken over,
released however a run ends."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from trainforge.config import Config, validate
from trainforge.driver.runlock import LOCK_FILE, RunLock, acquire, check_writable, run_locks
from trainforge.errors import ConfigError, RunLockedError

ROOT = Path(__file__).resolve().parents[2]
ADVICE = "choose another run.name"

# A process that takes the lock, says so, and waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from trainforge.driver.runlock import acquire
lock = acquire(Path(sys.argv[1]), what="run directory", advice="wait")
print("locked", flush=True)
time.sleep(600)
"""


def take(directory: Path) -> RunLock:
    return acquire(directory, what="run directory", advice=ADVICE)


def record(directory: Path) -> dict:
    return json.loads((directory / LOCK_FILE).read_text())


def config_for(tmp_path: Path, name: str, output_dir: Path, storage: Path | str | None = None) -> Config:
    raw = tiny_run(tmp_path, run={"name": name, "output_dir": str(output_dir)})
    if storage is not None:
        raw["checkpoint"] = {"storage_path": str(storage)}
    return validate(raw)


def test_acquire_records_the_holder_and_a_second_acquire_names_it(tmp_path: Path) -> None:
    with take(tmp_path):
        held = record(tmp_path)
        assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
        assert held["process_started"] == pytest.approx(psutil.Process().create_time())
        with pytest.raises(RunLockedError) as refused:
            take(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert f"run directory {tmp_path} is in use by another trainforge run: PID {os.getpid()}" in message
    assert f"on host {socket.gethostname()}, started {held['started_at']}" in message
    assert message.endswith(ADVICE)


def test_the_recorded_command_has_no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["/venv/bin/trainforge", "train", "--set", "checkpoint.storage_path=s3://AKIA:hunter2@b/p", "db.password=pw"]
    monkeypatch.setattr(sys, "argv", argv)
    with take(tmp_path):
        command = record(tmp_path)["command"]
    assert command.startswith("trainforge train --set")
    assert "hunter2" not in command and "pw" not in command.split("password")[-1]


def test_the_recorded_command_masks_every_secret_named_key_however_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["trainforge", "train", "c.yaml", "--set", "model.kwargs.hf_token=tok1", "-s", "model.kwargs.secretKey=sk2"]
    argv += ["--set=model.kwargs.db_pass=pw3", "--set", "model.kwargs={private_key: pk4, hidden: 8}"]
    argv += ["--set", "train.max_steps=5", "--token-file", "/run/token"]
    monkeypatch.setattr(sys, "argv", argv)
    with take(tmp_path):
        command = record(tmp_path)["command"]
    assert not [secret for secret in ("tok1", "sk2", "pw3", "pk4") if secret in command], command
    assert "--set=model.kwargs.db_pass=***" in command and "'model.kwargs=***'" in command
    assert "train.max_steps=5" in command and "--token-file /run/token" in command


def test_release_clears_the_record_and_the_next_run_takes_the_lock_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = take(tmp_path)
    lock.release()
    lock.release()  # idempotent
    assert (tmp_path / LOCK_FILE).read_bytes() == b""
    with caplog.at_level(logging.WARNING, logger="trainforge"), take(tmp_path):
        pass
    assert not caplog.records


def test_a_sigkilled_holder_is_refused_while_alive_and_taken_over_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=f"PID {holder.pid} on host {socket.gethostname()}"):
            take(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=scaled(30))
    finally:
        holder.kill()
    assert record(tmp_path)["pid"] == holder.pid  # a killed holder cannot clear its record
    with caplog.at_level(logging.WARNING, logger="trainforge"), take(tmp_path):
        assert record(tmp_path)["pid"] == os.getpid()
    assert any(
        f"left by PID {holder.pid}" in r.getMessage() and "no longer running" in r.getMessage() for r in caplog.records
    )


def write_record(directory: Path, **fields: object) -> None:
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": "2026-01-01T00:00:00Z", "command": "x"}
    (directory / LOCK_FILE).write_text(json.dumps({**me, "process_started": 0.0, **fields}))


def test_a_record_whose_pid_was_reused_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # PID 1 is alive, but it started at another time than the holder the record names.
    write_record(tmp_path, pid=1, process_started=psutil.Process(1).create_time() - 3600)
    with caplog.at_level(logging.WARNING, logger="trainforge"), take(tmp_path):
        pass
    assert any("left by PID 1 " in r.getMessage() for r in caplog.records)


def test_a_live_holder_on_this_host_is_refused_even_where_flock_does_not_stop_it(tmp_path: Path) -> None:
    # What a file system without working flock looks like: the record names a running process.
    write_record(tmp_path, pid=1, process_started=psutil.Process(1).create_time())
    with pytest.raises(RunLockedError, match=r"PID 1 on host .*flock did not stop it"):
        take(tmp_path)


def test_a_record_from_another_host_is_taken_over_with_a_warning_about_shared_locks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_record(tmp_path, host="elsewhere", pid=123)
    with caplog.at_level(logging.WARNING, logger="trainforge"), take(tmp_path):
        pass
    assert any("host elsewhere" in r.getMessage() and "does not share locks" in r.getMessage() for r in caplog.records)


def test_a_lock_held_for_another_host_says_so(tmp_path: Path) -> None:
    write_record(tmp_path, host="elsewhere", pid=123)
    other = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as an NFS server holds it for that host
        with pytest.raises(RunLockedError, match=r"PID 123 on host elsewhere.*another host"):
            take(tmp_path)
    finally:
        os.close(other)


def test_run_locks_are_released_however_the_run_ends(tmp_path: Path) -> None:
    config = config_for(tmp_path, "r", tmp_path)
    for ending in (RuntimeError("failed"), KeyboardInterrupt()):
        with pytest.raises(type(ending)), run_locks(config, local=True):
            raise ending
        with take(config.run_dir):
            pass


def test_the_checkpoint_folder_is_locked_when_storage_is_elsewhere(tmp_path: Path) -> None:
    storage = tmp_path / "store"
    first = config_for(tmp_path, "same", tmp_path / "a", storage)
    with run_locks(first, local=True):
        assert record(storage / "same")["pid"] == os.getpid()
        # Another run directory, the same run.name and storage_path: the same checkpoint folder.
        second = config_for(tmp_path, "same", tmp_path / "b", storage)
        refused = f"checkpoint folder {storage / 'same'} is in use by another trainforge run: PID {os.getpid()}"
        with pytest.raises(RunLockedError, match=re.escape(refused)), run_locks(second, local=True):
            pass
        assert not (tmp_path / "b" / "same" / LOCK_FILE).read_bytes()  # its run-dir lock was given back
        # Another run.name under the same storage_path: checkpoints go to another folder.
        with run_locks(config_for(tmp_path, "other", tmp_path / "a", storage), local=True):
            pass


def test_object_store_checkpoints_are_not_locked_and_the_log_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = config_for(tmp_path, "r", tmp_path, "s3://bucket/prefix")
    with caplog.at_level(logging.INFO, logger="trainforge"), run_locks(config, local=True):
        pass
    assert any("cannot be locked" in r.getMessage() for r in caplog.records)


def test_an_unwritable_output_dir_is_one_line_naming_the_key(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=f"run.output_dir {a_file} is not writable: Not a directory"):
        check_writable(a_file / "run", "run.output_dir")
    check_writable(tmp_path / "run", "run.output_dir")
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # the probe file is gone


def test_a_dangling_link_on_the_way_to_a_runs_folders_is_refused(tmp_path: Path) -> None:
    """run.output_dir or checkpoint.storage_path through a link to nowhere: the run would make a
    folder nobody named (the link's target); one line instead. A link to a folder is a choice: kept."""
    (tmp_path / "runs").symlink_to(tmp_path / "nowhere")
    (tmp_path / "ck").symlink_to(tmp_path / "gone" / "deeper")
    for config, key, link in [
        (config_for(tmp_path, "r", tmp_path / "runs"), "run.output_dir", tmp_path / "runs"),
        (config_for(tmp_path, "r", tmp_path / "runs" / "sub"), "run.output_dir", tmp_path / "runs"),
        (
            config_for(tmp_path, "r", tmp_path / "out", storage=tmp_path / "ck"),
            "checkpoint.storage_path",
            tmp_path / "ck",
        ),
    ]:
        refusal = f"^{key} .*: {link} is a symbolic link to .*, which does not exist"
        with pytest.raises(ConfigError, match=refusal), run_locks(config, local=True):
            pass
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "gone").exists()
    (tmp_path / "real").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    with run_locks(config_for(tmp_path, "r", tmp_path / "linked"), local=True):
        assert (tmp_path / "real" / "r").is_dir()


def test_a_second_search_in_one_search_directory_is_refused_before_ray_starts(tmp_path: Path) -> None:
    import trainforge

    config = {
        "run": {"name": "search", "output_dir": str(tmp_path)},
        "model": {"name": "mlp"},
        "data": {"name": "digits"},
        "train": {"max_steps": 10},
    }
    (tmp_path / "search").mkdir()
    with take(tmp_path / "search"), pytest.raises(RunLockedError, match=rf"search directory .* PID {os.getpid()}\b"):
        trainforge.tune(config, {"optim.lr": {"loguniform": [1e-3, 1e-2]}}, trials=1)
    assert sorted(p.name for p in (tmp_path / "search").iterdir()) == [LOCK_FILE]  # nothing written
