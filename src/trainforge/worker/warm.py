"""A worker of a warm group: a Ray actor that outlives one run, so the next run that fits its shape
finds torch imported, trainforge's worker modules loaded and the process group formed.

The driver side (driver/warm.py) starts the actors, forms their gloo group once, and hands each
run's ``Payload`` to ``run``; the run itself is the same ``run_worker`` Ray Train's workers call,
with the group's ranks and a report channel that gathers every rank's report to rank 0, which
puts the merged report in the run's mailbox (what Ray Train's controller does through
``ForwardingCallback``). After each run a worker puts its process back as it was before its first
run (worker/fresh.py), so the next run observes what it would on a new worker; anything it cannot
vouch for (an error, a run that did not end on every rank, state it cannot put back) makes the
driver discard the whole group instead of handing it out again.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Any

import ray
import ray.tune.trainable.trainable_fn_utils  # see below
import torch.distributed as dist
from ray.exceptions import ActorDiedError, RayError

from trainforge.protocol import Payload, Report, UserError, merge_reports
from trainforge.worker import collectives
from trainforge.worker.fresh import Baseline, reset
from trainforge.worker.logs import shipped_logs
from trainforge.worker.loop import run_worker
from trainforge.worker.rejoin import set_local_ranks

log = logging.getLogger("trainforge.worker")

# Imported above as a Ray Train worker has it before its run: ``ray.train.get_context()`` imports
# Ray Tune the first time it is called, and Ray Tune imports rich, which draws from Python's RNG as
# it loads; on a warm worker that first call is inside the first run, after its seeds are set, and
# that run alone would draw a shifted Python stream.


class GatheringChannel:
    """Every rank's report to rank 0 (one all-gather, the barrier Ray Train's report also is);
    rank 0 puts the merged report (its figures plus every node's ``system/`` samples) in the mailbox."""

    def __init__(self, rank: int, mailbox: Any) -> None:
        self.rank = rank
        self.mailbox = mailbox

    def report(self, report: Report) -> None:
        reports = collectives.all_gather_objects(report)
        if self.rank == 0 and self.mailbox is not None:
            merged = merge_reports(reports)
            if merged is not None:
                self.mailbox.put.remote(merged)

    def preempted(self) -> bool:
        return False  # Ray Train's preemption notice comes through its controller, which a warm group has none of


class WarmWorker:
    """One rank of a warm group (``ray.remote`` by driver/warm.py, with the group's resources)."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.world = 0
        self.runs = 0
        self.baseline: Baseline | None = None  # the process before its first run

    def address(self) -> tuple[str, int]:
        """This node's address and a free port: rank 0's, where the group's store listens."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, rank: int, world: int, host: str, port: int, timeout_s: float) -> int:
        """Form the group's gloo process group (once per group: the runs reuse it)."""
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.rank, self.world = rank, world
        set_local_ranks(rank, world)
        # What every run starts from: this process as a new worker's is before its first run.
        self.baseline = Baseline.capture()
        return rank

    def run(self, payload: Payload) -> Report | UserError:
        """One run on this rank; rank 0's return value is the run's (a final Report or a user's error)."""
        assert self.rank is not None and self.baseline is not None, "join the group first"
        marks = {"train_fn": time.time()} if self.rank == 0 else None
        self.runs += 1
        ended = threading.Event()
        threading.Thread(target=end_with_the_driver, args=(payload.mailbox, ended), daemon=True).start()
        try:
            with shipped_logs(payload.mailbox, self.rank, ray.util.get_node_ip_address()):
                channel = GatheringChannel(self.rank, payload.mailbox)
                return run_worker(payload, marks, ranks=(self.rank, self.world), channel=channel)
        finally:
            ended.set()
            reset(self.baseline)

    def problem(self) -> str | None:
        """Why this worker must not run another run (None: it is as a new worker would be)."""
        return self.baseline.problem() if self.baseline is not None else None

    def ping(self) -> int:
        return self.runs


def end_with_the_driver(mailbox: Any, ended: threading.Event, every_s: float = 0.5) -> None:
    """A Ray Train worker dies with its run's driver (its controller is the driver's, its actors the
    controller's); a warm worker belongs to the pool instead, so it watches the run's mailbox, which
    is the driver's, and ends its process the moment that is gone: a run whose driver ended (a
    trial Tune stopped) writes nothing more, no checkpoint past the step Tune stopped it at."""
    while not ended.wait(every_s):
        try:
            ray.get(mailbox.stop_requested.remote(), timeout=30)
        except ActorDiedError:
            if not ended.is_set():
                log.warning("warm worker: the run's driver is gone; ending this worker")
                end_this_actor()
        except RayError:  # slow or unreachable for now: not gone
            continue


def end_this_actor(grace_s: float = 10.0) -> None:
    """End this worker's process the way ``ray.kill`` ends an actor: an intended exit, which Ray
    does not report as a worker that "died ... by an unexpected system error" (a bare ``os._exit``
    is one, printed on the search's console each time a scheduler stops a trial). ``os._exit``
    after ``grace_s`` should Ray not have ended the process by then (its GCS unreachable)."""
    try:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
    except RayError as err:
        log.warning("warm worker: Ray could not end this worker (%s); exiting", err)
    else:
        time.sleep(grace_s)
    os._exit(1)
