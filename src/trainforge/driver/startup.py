"""Where a run's start goes: from the command (or the ``fit`` call) to the end of its first step.

Each phase ends at a *mark*, a unix time taken where the phase ends: the CLI and the driver mark
their own (``mark``); the Ray Train controller marks its phases in a ``StartupCallback``; rank 0
marks the worker's and sends them to the mailbox after its first step (worker/loop.py). The
driver keeps the first start of a run (a restart after a failure is ``recovery_s``'s business) and
writes ``startup`` into summary.json: seconds to the first step and per phase, in this order.
``trainforge bench startup`` reads it back. A watcher (``Timeline.watch``: the console's start-up
lines) hears of each phase as its mark arrives.

This module imports nothing heavy: the CLI marks its own phases before torch and Ray are imported.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# (mark, what the phase that ends at it holds), in the order they happen.
PHASES: tuple[tuple[str, str], ...] = (
    ("cli", "Python start and the CLI's imports (from a fit call: none), the config read and validated"),
    (
        "imports",
        "torch, Ray and the driver's modules imported (trainforge train starts a local Ray meanwhile), "
        "the run's observers and MLflow tracker made",
    ),
    ("preflight", "checks before Ray (paths, factories, pretrained weights), the run lock"),
    ("ray", "a local Ray up (what its start took beyond the imports), or the cluster connected"),
    ("controller", "Ray Train's controller actor started"),
    ("workers", "placement group and worker actors started"),
    ("process_group", "torch.distributed process group set up"),
    ("train_fn", "the training function shipped to the workers and trainforge's worker modules imported"),
    ("data", "the data set or stream shard built"),
    ("model", "model, optimizer and parallel wrapper built (and pretrained weights read)"),
    ("restore", "checkpoint restored (or found absent)"),
    ("first_step", "the first training step"),
)
ORDER = {name: i for i, name in enumerate(name for name, _ in PHASES)}
log = logging.getLogger("trainforge")
# The process's own start, when trainforge's CLI launched it; fit() called from Python starts at the call
# (api.fit makes the run's Timeline as it is called; a search's trials start theirs in run_training).
_command: dict[str, float] = {}


def command_started() -> None:
    """The CLI's entry: the run's clock starts when this process started, and its first phase ends now."""
    _command["start"] = command_start_time()
    _command["cli"] = time.time()


# A process this much older than the CPU it has used waited before it became Python.
WAITED_S = 30.0


def command_start_time(waited_s: float = WAITED_S) -> float:
    """When the command started: this process's start, unless the process is far older than the CPU
    it has used. A shell runs the last command of ``bash -c "pip install ... && trainforge train"``
    by exec, in its own process, whose start is then the shell's, before the install: an
    interpreter's start is CPU work, so the CPU used so far stands for it instead."""
    start, now, cpu = process_start_time(), time.time(), time.process_time()
    return now - cpu if now - start > cpu + waited_s else start


def process_start_time() -> float:
    """When this process started (unix time), to the kernel's clock tick; now, where it does not say.

    Linux gives a process's start in ticks since boot; the boot time it gives is whole seconds
    (psutil's ``create_time`` inherits that error of up to 1 s), so the start is taken back from
    now on the boot-time clock instead."""
    try:
        fields = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), after pid and comm
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: the phases before the call go untimed
        return time.time()


# Told of each phase as its first mark arrives: its name, and the seconds from the start to its end.
Watcher = Callable[[str, float], None]


class Timeline:
    """The marks of one run's start; ``start`` is the command's start (or the ``fit`` call)."""

    def __init__(self, start: float | None = None) -> None:
        self.marks: dict[str, float] = {}
        self.watchers: list[Watcher] = []
        if start is not None:
            self.start = start
        elif _command:
            # One run per CLI process: its marks are taken once.
            self.start = _command.pop("start")
            self.marks["cli"] = _command.pop("cli")
        else:
            self.start = time.time()

    def mark(self, name: str, at: float | None = None) -> None:
        """The phase ``name`` ended at ``at`` (now); a phase's first end is the one kept."""
        if name not in ORDER:
            raise ValueError(f"unknown start-up phase {name!r}")
        if name in self.marks:
            return
        self.marks[name] = time.time() if at is None else at
        for watcher in self.watchers:
            try:
                watcher(name, self.marks[name] - self.start)
            except Exception as err:  # a display must never stop the run
                log.warning("start-up watcher failed: %s", err)

    def add(self, marks: Mapping[str, float]) -> None:
        """Marks from another process (the controller's, rank 0's), in the order of the phases."""
        for name, at in sorted(marks.items(), key=lambda item: ORDER.get(item[0], -1)):
            if name in ORDER:
                self.mark(name, at)

    def watch(self, watcher: Watcher) -> None:
        """Tell ``watcher`` of every phase marked so far (in order), and of each one from now on."""
        for name, at in sorted(self.marks.items(), key=lambda item: ORDER[item[0]]):
            watcher(name, at - self.start)
        self.watchers.append(watcher)

    def to_dict(self) -> dict[str, Any] | None:
        """summary.json's ``startup``: when the run started (unix time), seconds to the first step,
        and each phase's seconds.

        A phase lasts from the previous phase's mark (or the start) to its own. Marks from other
        processes are clipped to never run backwards, so a clock skew between nodes shows as a 0 s
        phase rather than a negative one. None before any mark."""
        if not self.marks:
            return None
        phases: dict[str, float] = {}
        previous = self.start
        for name, _ in PHASES:
            if name not in self.marks:
                continue
            at = max(self.marks[name], previous)
            phases[name] = round(at - previous, 3)
            previous = at
        found: dict[str, Any] = {"start_unix": self.start, "phases": phases}
        if "first_step" in self.marks:
            found["to_first_step_s"] = round(previous - self.start, 3)
        return found
