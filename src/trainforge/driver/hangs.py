"""A hung worker group, diagnosed before anything is killed, then recovered without waiting.

The workers' watchdogs (worker/watchdog.py) tell the driver when a step runs far past the run's
own step times, each with its training thread's stack. The driver gathers what comes for
``GATHER_S`` after the first (or until every rank has spoken), then:

- **names the ranks that did not arrive**: those that sent nothing (frozen, stopped, stuck with the
  GIL held) and those whose stack is not a wait for the others (in their own code, in the data);
  the ranks waiting in a collective arrived. When every rank waits, none is named (a slow network
  or peer outside the group): the diagnosis says so and nothing is killed;
- **looks at each named process where it runs**: a task on its node (Ray, pinned to the node)
  reads its state from /proc (``stopped`` for SIGSTOP) and its Python stack with ``py-spy dump
  --nonblocking`` (a stopped process is read as it is), then, with ``failure.hang.kill``, kills
  it: its peers' collectives fail at once and Ray Train restarts the group from the newest
  checkpoint, instead of waiting out ``failure.collective_timeout_s`` and the frozen process;
- writes ``runs/<name>/diagnosis/<time>/``: ``diagnosis.json`` (step, every rank's node, pid,
  phase, wait and whether it arrived) and ``rank<N>.txt`` (its stack), and returns a
  ``Diagnosis`` whose one line the console prints and metrics.jsonl records (the report marks it
  on its timelines).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from trainforge.config.schema import HangConfig
from trainforge.errors import printable
from trainforge.protocol import HangSuspected, WorkerIdentity

log = logging.getLogger("trainforge")

GATHER_S = 2.0  # after the first rank's report, how long the others' may take (their watchdogs wake every 0.5 s)
LOOK_TIMEOUT_S = 20.0  # a node that does not answer in this time is frozen too: said, not waited for
DUMP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Diagnosis:
    """What the driver found about one hang."""

    step: int
    time: float
    line: str  # the console's line
    culprits: tuple[int, ...]  # the ranks that did not arrive
    directory: str
    killed: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "hang",
            "time": self.time,
            "step": self.step,
            "text": self.line,
            "ranks": list(self.culprits),
            "killed": list(self.killed),
            "diagnosis": self.directory,
        }


@dataclass
class HangDoctor:
    """Gathers the watchdogs' reports and the workers' identities; ``poll`` diagnoses a hang once
    the gathering is over. ``look``: how a node's processes are looked at (and killed)."""

    run_dir: Path
    rule: HangConfig
    look: Callable[[str, list[int], bool], dict[int, dict[str, Any]]] = field(default=lambda *a: look_on_node(*a))
    clock: Callable[[], float] = time.monotonic
    roster: dict[int, WorkerIdentity] = field(default_factory=dict)
    pending: dict[int, HangSuspected] = field(default_factory=dict)
    first_at: float | None = None
    diagnosed: set[int] = field(default_factory=set)  # steps already diagnosed (one diagnosis per hang)
    running: concurrent.futures.Future[Diagnosis] | None = None
    pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainforge-hang")
    )

    def on_identity(self, identity: WorkerIdentity) -> None:
        self.roster[identity.rank] = identity

    def on_suspected(self, suspected: HangSuspected) -> None:
        if suspected.step in self.diagnosed:
            return
        self.pending.setdefault(suspected.rank, suspected)
        if self.first_at is None:
            self.first_at = self.clock()

    def on_group_failed(self) -> None:
        """A group failed: what its ranks said is over; the new group's ranks introduce themselves."""
        self.roster.clear()
        self.pending.clear()
        self.first_at = None
        self.diagnosed.clear()

    def poll(self) -> Diagnosis | None:
        """A diagnosis that is ready (once); one is started when the gathering is over. It runs on
        a thread of its own: a node that does not answer must not stop the driver's loop."""
        if self.running is not None and self.running.done():
            finished, self.running = self.running, None
            return finished.result()
        if self.first_at is None or self.running is not None:
            return None
        everyone = bool(self.roster) and set(self.roster) <= set(self.pending)
        if not everyone and self.clock() - self.first_at < GATHER_S:
            return None
        pending, self.pending, self.first_at = self.pending, {}, None
        step = max(suspected.step for suspected in pending.values())
        self.diagnosed.add(step)
        self.running = self.pool.submit(self.diagnose, step, pending, dict(self.roster))
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def diagnose(self, step: int, pending: dict[int, HangSuspected], roster: dict[int, WorkerIdentity]) -> Diagnosis:
        ranks = sorted(set(roster) | set(pending))
        culprits = [rank for rank in ranks if rank not in pending or not pending[rank].waiting]
        # Killed: the silent ranks (their watchdog could not run: frozen, stopped); the ones stuck in
        # their own work only when another rank arrived (else the whole group waits on something
        # outside it, a data source, and a restart would not help).
        arrived = any(rank in pending and pending[rank].waiting for rank in ranks)
        victims = {rank for rank in culprits if arrived or rank not in pending} if self.rule.kill else set()
        looked: dict[int, dict[str, Any]] = {}
        by_node: dict[str, list[int]] = {}
        for rank in culprits:
            if rank in roster:
                by_node.setdefault(roster[rank].node_id, []).append(rank)
        for node_id, node_ranks in by_node.items():
            for kill in (True, False):
                chosen = [rank for rank in node_ranks if (rank in victims) == kill]
                if not chosen:
                    continue
                answers = self.look(node_id, [roster[rank].pid for rank in chosen], kill)
                for rank in chosen:
                    looked[rank] = answers.get(roster[rank].pid, {"state": "no answer from its node"})
        when = time.time()
        folder = self.run_dir / "diagnosis" / datetime.datetime.fromtimestamp(when).strftime("%Y%m%d-%H%M%S")
        records = {rank: record(roster.get(rank), rank, pending.get(rank), looked.get(rank)) for rank in ranks}
        killed = tuple(rank for rank in culprits if looked.get(rank, {}).get("killed"))
        line = describe(step, culprits, records, pending, killed, folder, self.rule.kill)
        write_diagnosis(folder, step, line, records)
        return Diagnosis(step, when, line, tuple(culprits), str(folder), killed)


def record(
    identity: WorkerIdentity | None, rank: int, said: HangSuspected | None, looked: dict[str, Any] | None
) -> dict[str, Any]:
    """One rank's part of diagnosis.json."""
    found: dict[str, Any] = {
        "rank": rank,
        "node_ip": identity.node_ip if identity else None,
        "hostname": identity.hostname if identity else None,
        "pid": identity.pid if identity else None,
        "arrived": bool(said and said.waiting),
    }
    if said is not None:
        found.update(phase=said.phase, waited_s=said.waited_s, bound_s=said.bound_s, stack=list(said.stack))
    else:
        found["said"] = "nothing: its watchdog did not run (frozen, stopped, or stuck holding the GIL)"
    if looked is not None:
        found["state"] = looked.get("state")
        if looked.get("stack"):
            found["stack"] = thread_stack(looked["stack"], identity.thread_id if identity else None)
            found["stack_source"] = "py-spy"
        if looked.get("killed"):
            found["killed"] = True
    return found


def describe(
    step: int,
    culprits: list[int],
    records: dict[int, dict[str, Any]],
    pending: dict[int, HangSuspected],
    killed: tuple[int, ...],
    folder: Path,
    kill: bool,
) -> str:
    """The console's one line: who did not arrive, where it is, what was done."""
    waited = max((suspected.waited_s for suspected in pending.values()), default=0.0)
    if not culprits:
        return (
            f"hang at step {step}: every rank waits in a collective ({waited:.0f} s); none is stuck in its own "
            f"work (a slow network or peer?); nothing killed; diagnosis: {folder}"
        )
    parts = []
    for rank in culprits:
        record = records[rank]
        where = f"node {record['node_ip']}, pid {record['pid']}" if record["pid"] else "not introduced"
        state = f", {record['state']}" if record.get("state") else ""
        frame = innermost(record.get("stack") or [])
        parts.append(f"rank {rank} ({where}{state}) in {frame}")
    arrived = [rank for rank, record in records.items() if record["arrived"]]
    plural = len(arrived) > 1
    listed = ", ".join(map(str, arrived))
    others = f"; rank{'s' if plural else ''} {listed} wait{'' if plural else 's'} in a collective" if arrived else ""
    if killed:
        action = f"killed rank {', '.join(map(str, killed))}: Ray Train restarts the group from the newest checkpoint"
    elif kill:
        action = "not killed (its node did not answer, or every rank is stuck in its own work)"
    else:
        action = "failure.hang.kill is false: left to failure.collective_timeout_s"
    return printable(
        f"hang at step {step} after {waited:.0f} s: {'; '.join(parts)} did not arrive{others}; {action}; "
        f"diagnosis: {folder}"
    )


def innermost(stack: list[str]) -> str:
    return stack[-1] if stack else "an unknown frame"


def thread_stack(dump: list[str], thread_id: int | None) -> list[str]:
    """The training thread's frames from a py-spy dump (innermost first there), outermost first."""
    frames: list[str] = []
    inside = thread_id is None
    for line in dump:
        if line.startswith("Thread "):
            if frames and inside:
                break
            inside = thread_id is None or line.split()[1] == str(thread_id)
            continue
        if inside and line.startswith("    "):
            frames.append(line.strip())
    return list(reversed(frames))


def write_diagnosis(folder: Path, step: int, line: str, records: dict[int, dict[str, Any]]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        document = {"step": step, "summary": line, "ranks": {str(rank): record for rank, record in records.items()}}
        (folder / "diagnosis.json").write_text(json.dumps(document, indent=2) + "\n")
        for rank, record in records.items():
            (folder / f"rank{rank}.txt").write_text("\n".join(record.get("stack") or ["(no stack)"]) + "\n")
    except OSError as err:
        log.warning("could not write the hang diagnosis into %s: %s", folder, err)


def look_on_node(node_id: str, pids: list[int], kill: bool) -> dict[int, dict[str, Any]]:
    """``look_at`` on ``node_id`` (a task pinned there); a node that does not answer in time is said."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    task = ray.remote(num_cpus=0, max_retries=0)(look_at).options(scheduling_strategy=where)
    try:
        answers: dict[int, dict[str, Any]] = ray.get(task.remote(pids, kill), timeout=LOOK_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as err:
        return {pid: {"state": f"no answer from its node ({type(err).__name__})"} for pid in pids}
    return answers


def look_at(pids: list[int], kill: bool) -> dict[int, dict[str, Any]]:
    """On the processes' node: each one's state and Python stack, then (``kill``) SIGKILL."""
    found: dict[int, dict[str, Any]] = {}
    for pid in pids:
        found[pid] = {"state": process_state(pid), "stack": py_spy_dump(pid)}
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
                found[pid]["killed"] = True
            except OSError as err:
                found[pid]["kill_error"] = err.strerror or str(err)
    return found


STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped by a tracer"}


def process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat.rpartition(")")[2].split()[0]
    return STATES.get(code, {"Z": "a zombie"}.get(code, code))


def py_spy_dump(pid: int) -> list[str]:
    """``py-spy dump --nonblocking``'s lines (a stopped process is read as it stands), or why not."""
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        done = subprocess.run(
            [binary, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=DUMP_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return [f"(py-spy could not run: {err})"]
    if done.returncode != 0:
        return [f"(py-spy: {(done.stderr or done.stdout).strip().splitlines()[-1:] or ['failed']})"]
    return done.stdout.splitlines()
