"""Each worker's watchdog: the work in progress against the run's own step times.

A thread beside the training loop wakes every ``POLL_S``. After ``failure.hang.warmup_steps``
completed steps, a step is a hang once it has run longer than ``failure.hang.multiple`` x the p99
of the last ``WINDOW`` step times, and at least ``failure.hang.floor_s``; never longer than
``failure.collective_timeout_s``, which stays the hard ceiling (gloo's or NCCL's own timeout). Other
phases have bounds of their own: a checkpoint or a validation pass, ``multiple`` x the longest
earlier pass of its kind (at least ``floor_s``; the first one, only the ceiling); the start
(building the run, restoring, the first step: compiling, warming caches) is not judged (Ray
Train's and the collectives' own timeouts bound it).

On a hang the watchdog sends the driver one ``HangSuspected`` per step and phase: the step, how
long it waited, and the training thread's stack, which says whether the rank arrived at a
collective and waits there for its peers. A rank that is frozen (SIGSTOP, a stopped host) or
whose interpreter is stuck holding the GIL sends nothing: the driver names it by that silence
(driver/hangs.py). Each worker sends its ``WorkerIdentity`` (rank, node, pid, training thread)
when the watchdog starts.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trainforge.config.schema import HangConfig
from trainforge.protocol import HangSuspected, WorkerIdentity

POLL_S = 0.5
WINDOW = 256  # step times the p99 is taken over
STACK_FRAMES = 40  # the innermost frames sent
# Where an innermost frame means "waiting for the other ranks": a collective, DDP's backward (its
# reducer waits for the peers' buckets inside the autograd engine), Ray (Train's report barrier).
WAITING_IN = (
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}autograd{os.sep}",
    # DDP's own code innermost: its collectives (the buffers' broadcast in forward, the parameters'
    # sync); the user's forward inside DDP's has the user's frames innermost.
    f"torch{os.sep}nn{os.sep}parallel{os.sep}distributed.py",
    f"site-packages{os.sep}ray{os.sep}",
)
STDLIB = sysconfig.get_paths()["stdlib"]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class Watchdog:
    """Times the training thread's steps and phases; its thread reports a hang once per step and
    phase. ``send`` puts a message in the driver's mailbox (fire and forget)."""

    def __init__(
        self,
        rule: HangConfig,
        ceiling_s: float,
        rank: int,
        send: Callable[[object], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rule = rule
        self.ceiling_s = ceiling_s
        self.rank = rank
        self.send = send
        self.clock = clock
        self.durations: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.longest: dict[str, float] = {}  # of each other phase (checkpoint, validation): its longest pass
        self.phase_name = "start"
        self.step = 0  # the last completed step
        self.since = clock()  # when the work in progress began
        self.reported: tuple[int, str] | None = None
        self.thread_ident = threading.get_ident()  # the training thread: the one that builds the watchdog
        self.thread_native = threading.get_native_id()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, node_id: str, node_ip: str) -> None:
        self.send(WorkerIdentity(self.rank, os.getpid(), self.thread_native, node_id, node_ip, socket.gethostname()))
        self._thread = threading.Thread(target=self._watch, name="trainforge-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def step_done(self, step: int) -> None:
        """The training thread completed ``step``: its time joins the window (the first step after
        the start does not: it compiles, fills caches, waits for the slowest rank to start)."""
        now = self.clock()
        if self.phase_name == "step":
            self.durations.append(now - self.since)
        self.phase_name, self.step, self.since = "step", step, now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Work that is not a step (a checkpoint, a validation pass), bounded by the ceiling; the
        next step's time starts after it."""
        previous = self.phase_name
        self.phase_name, self.since = name, self.clock()
        try:
            yield
        finally:
            now = self.clock()
            self.longest[name] = max(self.longest.get(name, 0.0), now - self.since)
            self.phase_name, self.since = previous, now

    def bound_s(self) -> float:
        """How long the work in progress may take before it is a hang (inf: not judged)."""
        if self.phase_name == "start":
            return math.inf
        if self.phase_name != "step":  # its first pass has only the ceiling; later ones, the longest so far
            longest = self.longest.get(self.phase_name)
            typical = longest if longest is not None else math.inf
        elif len(self.durations) >= self.rule.warmup_steps:
            typical = p99(list(self.durations))
        else:
            typical = math.inf
        return min(self.ceiling_s, max(self.rule.floor_s, self.rule.multiple * typical))

    def check(self) -> HangSuspected | None:
        """A hang report when the work in progress is past its bound (once per step and phase)."""
        phase, step, since = self.phase_name, self.step, self.since
        waited, bound = self.clock() - since, self.bound_s()
        if waited <= bound or self.reported == (step, phase):
            return None
        self.reported = (step, phase)
        stack = training_stack(self.thread_ident)
        found = HangSuspected(
            self.rank, step + 1, phase, round(waited, 3), round(bound, 3), is_waiting(stack), stack, time.time()
        )
        self.send(found)
        return found

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception:  # the watchdog must never take the worker down
                continue


def training_stack(thread_ident: int) -> tuple[str, ...]:
    """The thread's frames, outermost first, as ``func (file:line)`` (py-spy's form)."""
    frame: Any = sys._current_frames().get(thread_ident)
    if frame is None:
        return ()
    frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
    return tuple(f"{entry.name} ({entry.filename}:{entry.lineno})" for entry in frames)


def is_waiting(stack: tuple[str, ...]) -> bool:
    """Whether the innermost frame outside Python's own library (threading's waits) is a wait for
    the other ranks: a collective, the autograd engine under DDP, Ray. One in the user's code (a
    forward inside DDP's included), in the data or in trainforge's own loop is not."""
    for line in reversed(stack):
        path = line.rpartition(" (")[2]
        if path.startswith(STDLIB) and "site-packages" not in path:
            continue
        return any(marker in path for marker in WAITING_IN)
    return False


def for_session(config: Any, rank: int, mailbox: Any) -> Watchdog | None:
    """The watchdog of a worker that reports to a driver (None without one, or switched off)."""
    rule: HangConfig = config.failure.hang
    if mailbox is None or not rule.enabled:
        return None
    return Watchdog(rule, config.failure.collective_timeout_s, rank, lambda item: mailbox.put.remote(item))
