"""Hang detection and diagnosis without Ray: the watchdog's rule (worker/watchdog.py) on a clock the
test moves, the stack it sends, and the driver's doctor (driver/hangs.py) naming the rank that did
not arrive, looking at a real stopped process (its state from /proc, its stack by py-spy) and
killing it. With Ray and a SIGSTOPped worker: tests/faults/test_hang.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from trainforge.config.schema import HangConfig
from trainforge.driver.hangs import GATHER_S, Diagnosis, HangDoctor, look_at
from trainforge.protocol import HangSuspected, WorkerIdentity
from trainforge.worker.watchdog import Watchdog, is_waiting, training_stack


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(rule: HangConfig, ceiling_s: float = 300.0) -> tuple[Watchdog, Clock, list[object]]:
    clock, sent = Clock(), []
    return Watchdog(rule, ceiling_s, 1, sent.append, clock=clock), clock, sent


def test_a_step_is_a_hang_past_the_multiple_of_the_run_s_p99_with_a_floor_and_the_ceiling() -> None:
    dog, clock, sent = watchdog(HangConfig(multiple=10, floor_s=2, warmup_steps=5), ceiling_s=60)
    assert dog.bound_s() == float("inf")  # the start (building, restoring, the first step) is not judged
    clock.now += 30
    dog.step_done(1)  # the first step: not a step time (compiles, waits for the slowest rank's start)
    assert dog.check() is None and not dog.durations
    for step in range(2, 6):
        clock.now += 0.1
        dog.step_done(step)
    assert dog.bound_s() == 60  # 4 step times, fewer than warmup_steps: the ceiling
    clock.now += 0.1
    dog.step_done(6)
    assert dog.bound_s() == pytest.approx(2.0)  # 10 x 0.1 s is under the floor
    for step in range(7, 40):
        clock.now += 0.5
        dog.step_done(step)
    assert dog.bound_s() == pytest.approx(5.0)  # 10 x the p99 (0.5 s)
    clock.now += 4.9
    assert dog.check() is None
    clock.now += 0.2
    found = dog.check()
    assert isinstance(found, HangSuspected) and sent == [found]
    assert (found.rank, found.step, found.phase, found.bound_s) == (1, 40, "step", 5.0)
    assert found.waited_s == pytest.approx(5.1)
    clock.now += 10
    assert dog.check() is None and len(sent) == 1  # once per step and phase
    with dog.phase("checkpoint"):
        assert dog.bound_s() == 60  # the first checkpoint: not judged by step times, only the ceiling
        clock.now += 61
        assert dog.check() is not None and len(sent) == 2
    clock.now += 1
    dog.step_done(40)
    assert dog.durations[-1] == pytest.approx(1.0)  # the step's time counts from the checkpoint's end
    with dog.phase("checkpoint"):
        assert dog.bound_s() == 60  # 10 x the longest checkpoint so far (61 s), under the ceiling
    dog.longest["checkpoint"] = 0.4
    with dog.phase("checkpoint"):
        assert dog.bound_s() == pytest.approx(4.0)  # 10 x 0.4 s


def test_the_ceiling_bounds_the_learnt_rule() -> None:
    dog, clock, _ = watchdog(HangConfig(multiple=100, floor_s=1, warmup_steps=1), ceiling_s=20)
    dog.step_done(1)
    for step in range(2, 5):
        clock.now += 1.0
        dog.step_done(step)
    assert dog.bound_s() == 20


def test_the_stack_says_whether_a_rank_waits_for_the_others() -> None:
    release = threading.Event()
    threading_started = threading.Event()

    def own_work() -> None:
        threading_started.set()
        release.wait(30)

    thread = threading.Thread(target=own_work)
    thread.start()
    threading_started.wait(10)
    try:
        assert thread.ident is not None
        stack = training_stack(thread.ident)
        assert any("own_work" in line and "test_hangs.py" in line for line in stack)
        assert not is_waiting(stack)  # threading's wait is the stdlib's: the frame under it is the test's own
    finally:
        release.set()
        thread.join()
    site = str(Path(psutil.__file__).parents[1])  # site-packages
    collective = ("step (/x/loop.py:1)", f"all_reduce ({site}/torch/distributed/distributed_c10d.py:2900)")
    backward = ("_backward (/x/step.py:1)", f"_engine_run_backward ({site}/torch/autograd/graph.py:829)")
    report = (
        "report (/x/loop.py:1)",
        f"get ({site}/ray/_private/worker.py:2900)",
        f"wait ({threading.__file__}:320)",
    )
    forward = (f"forward ({site}/torch/nn/parallel/distributed.py:1600)", "forward (/home/u/model.py:12)")
    buffers = (
        f"forward ({site}/torch/nn/parallel/distributed.py:1886)",
        f"_distributed_broadcast_coalesced ({site}/torch/nn/parallel/distributed.py:2363)",
    )  # DDP's forward broadcasting its buffers (a model with BatchNorm): a collective
    assert is_waiting(collective) and is_waiting(backward) and is_waiting(report) and is_waiting(buffers)
    assert not is_waiting(forward)  # the user's forward inside DDP's: its own work


STOPPED = """
import threading, time
def stuck_in_user_code():
    while True:
        time.sleep(0.01)
thread = threading.Thread(target=stuck_in_user_code, name="train")
thread.start()
print(thread.native_id, flush=True)
thread.join()
"""


@pytest.fixture
def stopped_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    process = subprocess.Popen([sys.executable, "-c", STOPPED], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    thread_id = int(process.stdout.readline())
    os.kill(process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while psutil.Process(process.pid).status() != psutil.STATUS_STOPPED:  # the signal is delivered soon, not at once
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.01)
    yield process, thread_id
    if process.poll() is None:
        process.kill()
    process.wait()


def finished(doctor: HangDoctor) -> Diagnosis | None:
    """The diagnosis the doctor starts at this poll (on its thread), once it is done."""
    assert doctor.poll() is None and doctor.running is not None
    doctor.running.result(timeout=120)
    return doctor.poll()


def identity(rank: int, pid: int, thread_id: int = 0) -> WorkerIdentity:
    return WorkerIdentity(rank, pid, thread_id, "node-a", "10.0.0.7", "host-a")


def suspected(rank: int, *, waiting: bool, step: int = 41) -> HangSuspected:
    stack = ("train (/x/loop.py:1)", "all_reduce (/x/torch/distributed/c10d.py:1)") if waiting else ("f (/x/y.py:2)",)
    return HangSuspected(rank, step, "step", 12.0, 5.0, waiting, stack, time.time())


def test_the_doctor_names_the_silent_rank_shows_its_stack_and_state_and_kills_it(
    tmp_path: Path, stopped_process: tuple[subprocess.Popen[str], int]
) -> None:
    process, thread_id = stopped_process
    clock = Clock()
    looked: list[tuple[str, list[int], bool]] = []

    def look(node_id: str, pids: list[int], kill: bool) -> dict[int, dict[str, object]]:
        looked.append((node_id, pids, kill))
        return look_at(pids, kill)  # what the task pinned to the node runs

    doctor = HangDoctor(tmp_path, HangConfig(), look=look, clock=clock)
    doctor.on_identity(identity(0, os.getpid()))
    doctor.on_identity(identity(1, process.pid, thread_id))
    doctor.on_suspected(suspected(0, waiting=True))
    assert doctor.poll() is None  # rank 1 may still speak
    clock.now += GATHER_S
    diagnosis = finished(doctor)
    assert diagnosis is not None and diagnosis.culprits == (1,) and diagnosis.killed == (1,)
    assert looked == [("node-a", [process.pid], True)]
    assert process.wait(timeout=30) == -signal.SIGKILL
    line = diagnosis.line
    assert "\n" not in line and f"rank 1 (node 10.0.0.7, pid {process.pid}, stopped)" in line
    assert "stuck_in_user_code" in line and "rank 0 waits in a collective" in line and "killed rank 1" in line
    found = json.loads((Path(diagnosis.directory) / "diagnosis.json").read_text())
    assert found["step"] == 41 and found["ranks"]["1"]["arrived"] is False and found["ranks"]["0"]["arrived"] is True
    assert found["ranks"]["1"]["state"] == "stopped" and found["ranks"]["1"]["stack_source"] == "py-spy"
    stack = (Path(diagnosis.directory) / "rank1.txt").read_text().splitlines()
    assert "stuck_in_user_code" in stack[-1] and not any("MainThread" in line for line in stack)
    assert doctor.poll() is None  # one diagnosis per hang
    doctor.on_suspected(suspected(0, waiting=True))  # the same step again: already diagnosed
    clock.now += GATHER_S
    assert doctor.poll() is None


def test_a_rank_stuck_in_its_own_work_is_named_and_when_every_rank_waits_nothing_is_killed(tmp_path: Path) -> None:
    clock = Clock()
    looked: list[list[int]] = []

    def look(node_id: str, pids: list[int], kill: bool) -> dict[int, dict[str, object]]:
        looked.append(pids)
        return {pid: {"state": "running", "stack": []} for pid in pids}  # nothing to kill: only named

    doctor = HangDoctor(tmp_path, HangConfig(kill=False), look=look, clock=clock)
    doctor.on_identity(identity(0, 100))
    doctor.on_identity(identity(1, 101))
    doctor.on_suspected(suspected(0, waiting=True))
    doctor.on_suspected(suspected(1, waiting=False))
    diagnosis = finished(doctor)  # every rank spoke: no need to wait
    assert diagnosis is not None and diagnosis.culprits == (1,) and diagnosis.killed == ()
    assert "f (/x/y.py:2)" in diagnosis.line and "failure.hang.kill is false" in diagnosis.line
    doctor.on_group_failed()
    doctor.on_identity(identity(0, 200))
    doctor.on_identity(identity(1, 201))
    doctor.on_suspected(suspected(0, waiting=True, step=90))
    doctor.on_suspected(suspected(1, waiting=True, step=90))
    everyone = finished(doctor)
    assert everyone is not None and everyone.culprits == () and "nothing killed" in everyone.line
    assert looked == [[101]]


def test_a_silent_rank_is_killed_even_when_no_other_rank_waits_in_a_collective(tmp_path: Path) -> None:
    """Rank 1 said nothing (stopped); rank 0 is in its own work: the silent one is killed (its
    watchdog could not run), the other only named."""
    clock = Clock()
    looked: list[tuple[list[int], bool]] = []

    def look(node_id: str, pids: list[int], kill: bool) -> dict[int, dict[str, object]]:
        looked.append((pids, kill))
        return {pid: {"state": "stopped" if pid == 101 else "running", "killed": kill} for pid in pids}

    doctor = HangDoctor(tmp_path, HangConfig(), look=look, clock=clock)
    doctor.on_identity(identity(0, 100))
    doctor.on_identity(identity(1, 101))
    doctor.on_suspected(suspected(0, waiting=False))
    clock.now += GATHER_S
    diagnosis = finished(doctor)
    assert diagnosis is not None and diagnosis.culprits == (0, 1) and diagnosis.killed == (1,)
    assert sorted(looked) == [([100], False), ([101], True)]


def test_hang_settings_are_checked_in_one_line(tmp_path: Path) -> None:
    from trainforge.config import load_config
    from trainforge.errors import ConfigError

    path = tmp_path / "run.yaml"
    path.write_text("run: {name: t}\nfailure: {hang: {multiple: 1.0}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), [])
    assert "failure.hang.multiple" in str(caught.value) and "\n" not in str(caught.value)


def test_no_watchdog_without_a_driver_or_with_hang_detection_off() -> None:
    from types import SimpleNamespace

    from trainforge.config.schema import FailureConfig
    from trainforge.worker.watchdog import for_session

    mailbox = SimpleNamespace(put=SimpleNamespace(remote=lambda item: None))
    on = SimpleNamespace(failure=FailureConfig())
    off = SimpleNamespace(failure=FailureConfig(hang=HangConfig(enabled=False)))
    assert isinstance(for_session(on, 0, mailbox), Watchdog)
    assert for_session(on, 0, None) is None  # a Session run in one process, without a driver
    assert for_session(off, 0, mailbox) is None
