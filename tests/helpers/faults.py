"""Fault injection for tests: find this test's Ray Train workers, kill or freeze one, wait for files.

Every process these helpers signal is a descendant of the test process (its own Ray), never a
process of another test session on the same machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from tests.helpers.runs import tiny_run
from tests.helpers.timing import rescaled, scaled
from trainforge.protocol import Resumed, event_from_json


def paced_run(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    """A run whose steps take at least ``delay_s`` (tests.helpers.user_models:paced_net), so a test
    can act mid-run: 60 steps, a checkpoint every 10, two restarts allowed."""
    base = tiny_run(
        tmp_path,
        model={"name": None, "factory": "tests.helpers.user_models:paced_net", "kwargs": {"delay_s": 0.05}},
        train={"max_steps": 60, "batch_size": 8, "log_every_n_steps": 5},
        optim={"name": "adamw", "lr": 0.003},
        checkpoint={"every_n_steps": 10, "keep_last": 5},
        failure={"max_failures": 2},
    )
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return base


def worker_pids() -> list[int]:
    """Training workers (Ray Train's, or a warm group's) of the Ray this test process started (its
    descendants), never anyone else's."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if any("RayTrainWorker" in part or "WarmWorker" in part for part in proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def kill_a_worker_after(marker: Path, timeout_s: float = 180) -> dict[str, Any]:
    """Start a thread that SIGKILLs one training worker once ``marker`` exists."""
    done: dict[str, Any] = {}

    def watch() -> None:
        deadline = time.monotonic() + scaled(timeout_s)
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.01)
        pids = worker_pids()
        if pids:
            victim = max(pids)
            with contextlib.suppress(psutil.Error):
                done["title"] = " ".join(psutil.Process(victim).cmdline())
            os.kill(victim, signal.SIGKILL)
            done["pid"], done["at"], done["pids"] = victim, time.time(), pids

    threading.Thread(target=watch, daemon=True).start()
    return done


def checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoint directories of a run on local storage, oldest first."""
    return sorted(p for p in run_dir.glob("checkpoint_*") if (p / "manifest.json").is_file())


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy; that value, or TimeoutError naming ``what``.

    ``timeout_s`` is the quiet machine's figure, scaled by the machine's slowdown (helpers/timing.py);
    when that runs out on a machine that got busier since, by the last minute's load (``rescaled``)."""
    started = time.monotonic()
    allowed = scaled(timeout_s)
    while True:
        value = condition()
        if value:
            return value
        waited = time.monotonic() - started
        if waited >= allowed:
            allowed = max(allowed, rescaled(timeout_s))
            if waited >= allowed:
                raise TimeoutError(f"timed out after {waited:.0f} s waiting for {what}")
        time.sleep(interval_s)


def reports(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of the run's metrics.jsonl (reports and worker_error records), in order."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run_dir: Path) -> list[str]:
    """The text of every report's events in metrics.jsonl (resumes, skipped checkpoints, save failures)."""
    return [event.text for r in reports(run_dir) for event in events_of(r)]


def events_of(record: dict[str, Any]) -> list[Any]:
    """A metrics.jsonl line's events, typed (trainforge.protocol)."""
    found = (event_from_json(e) for e in record.get("events", []))
    return [event for event in found if event is not None]


def steps_after(run_dir: Path, unix_time: float) -> list[dict[str, Any]]:
    """Reports whose step completed after ``unix_time`` (they carry ``time/unix``)."""
    return [r for r in reports(run_dir) if "step" in r and r.get("time/unix", 0.0) > unix_time]


def first_resumed_report(run_dir: Path) -> dict[str, Any]:
    """The first report of a restarted worker group: the one that says where it resumed from
    (the loop reports right after the first step following a restore)."""
    for report in reports(run_dir):
        if any(isinstance(e, Resumed) for e in events_of(report)):
            return report
    raise AssertionError(f"no report says 'resumed from' in {run_dir / 'metrics.jsonl'}")


def recovery_s(run_dir: Path, fault_at: float) -> float:
    """Seconds from a fault (unix time) to the first completed step of the group that replaced it."""
    return float(first_resumed_report(run_dir)["time/unix"]) - fault_at


class Fault:
    """A background thread that waits for a trigger, then acts on one training worker process.

    ``start()`` arms it; ``close()`` (also on ``with`` exit) resumes and kills whatever it froze,
    so a failing test never leaves a stopped process behind.
    """

    def __init__(
        self, trigger: Callable[[], Any], action: Callable[[], dict[str, Any]], timeout_s: float = 240
    ) -> None:
        self.trigger = trigger
        self.action = action
        self.timeout_s = timeout_s
        self.done: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-fault", daemon=True)

    def start(self) -> Fault:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            wait_until(self.trigger, self.timeout_s, "the fault trigger", interval_s=0.02)
            self.done.update(self.action())
            self.done.setdefault("at", time.time())
        except BaseException as err:  # reported by the test through .error
            self.error = err

    def join(self, timeout_s: float = 60) -> dict[str, Any]:
        self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        return self.done

    def close(self) -> None:
        pid = self.done.get("stopped_pid")
        if pid is not None:
            release_stopped(pid)

    def __enter__(self) -> Fault:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def signal_a_worker(sig: signal.Signals, pick: Callable[[list[int]], int] = max) -> dict[str, Any]:
    """Send ``sig`` to one of this test's training workers; what was done, for Fault.done."""
    pids = wait_until(worker_pids, 30, "a training worker process")
    pid = pick(pids)
    os.kill(pid, sig)
    record: dict[str, Any] = {"pid": pid, "at": time.time(), "signal": sig.name}
    if sig == signal.SIGSTOP:
        record["stopped_pid"] = pid
    return record


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def duty_cycle(pid: int, stop_s: float = 0.1, cont_s: float = 0.1, max_s: float = 180) -> dict[str, Any]:
    """Slow one process as a busy or throttled host would: stop and continue it on a duty cycle
    until it is gone (its worker group restarted) or ``max_s`` passed; never left stopped."""
    started = time.time()
    cycles = 0
    try:
        with contextlib.suppress(ProcessLookupError):
            while alive(pid) and time.time() - started < max_s:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stop_s)
                os.kill(pid, signal.SIGCONT)
                time.sleep(cont_s)
                cycles += 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return {"pid": pid, "at": started, "cycles": cycles, "slowed_s": time.time() - started}


def release_stopped(pid: int) -> None:
    """SIGCONT then SIGKILL a process a test froze, if it still exists (and is still ours)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    except psutil.Error:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants_named(fragment: str) -> Iterator[psutil.Process]:
    """Descendants of the test process whose command line contains ``fragment``."""
    for proc in psutil.Process().children(recursive=True):
        try:
            if any(fragment in part for part in proc.cmdline()):
                yield proc
        except psutil.Error:
            continue


@contextlib.contextmanager
def patched_environ(**values: str) -> Iterator[None]:
    """Set environment variables for the block (and the Ray processes started in it), then restore."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
