"""Warm worker groups: a run that finds an idle group of its shape starts training on it, without a
Ray Train controller, a placement group, worker processes that import torch, or a process group
of its own (docs/architecture.md, "Warm worker groups").

A ``WarmPool`` actor owns the groups: their placement groups and worker actors (worker/warm.py)
live as long as the pool does. A run *leases* a group of its shape (workers, resources per worker,
placement strategy, the workers' environment, the collective timeout, the working directory and
the user's factory modules as they are on disk now), runs every rank's ``run_worker`` on it,
and gives it back when every rank ended its run cleanly; after anything else (a worker that died,
an error, a run the driver abandoned) the group is killed and its placement group removed, never
handed out again. A failure of the warm group is a worker failure like any other: the run counts
it against ``failure.max_failures`` and carries on under Ray Train from its newest verified
checkpoint, exactly as a restarted Ray Train worker group would.

Two owners: a search keeps one pool for all its trials (``tune.reuse_workers``) and shuts it down
at its end; ``scaling.reuse_workers`` keeps one per driver process, for a notebook or a service
that calls ``trainforge.fit`` again and again; it dies with that process.

What a warm group takes: a fixed number of CPU workers, data built in the workers (not streamed
through Ray Data), data parallelism without tensor parallelism (runs that need Ray Train's
per-run machinery, GPUs or sub-groups, go through Ray Train as before; ``why_not`` says which).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainforge.config import Config
from trainforge.data.registry import source_of
from trainforge.protocol import Payload, Report, StartupMarks, UserError, WorkerFailure
from trainforge.worker.warm import WarmWorker

log = logging.getLogger("trainforge")

RemoteWorker = ray.remote(WarmWorker)


class WarmGroupFailed(Exception):
    """The warm group could not finish the run (a worker died, a collective failed): the run goes
    on under Ray Train from its newest checkpoint."""


def why_not(config: Config) -> str | None:
    """Why this run cannot use a warm group; None when it can."""
    scaling, parallel = config.scaling, config.parallel
    if isinstance(scaling.num_workers, tuple):
        return "scaling.num_workers is elastic (Ray Train resizes the group)"
    if scaling.use_gpu:
        return "scaling.use_gpu (warm groups are CPU only for now)"
    if source_of(config.data).stream is not None:
        return f"data.name {config.data.name} streams through Ray Data (Ray Train's dataset shards)"
    if parallel.tensor_parallel > 1 or parallel.strategy != "ddp":
        return "parallel.strategy fsdp / parallel.tensor_parallel build process sub-groups per run"
    return None


@dataclass(frozen=True)
class Shape:
    """What makes two runs' groups interchangeable."""

    workers: int
    resources: dict[str, float]
    strategy: str
    env: dict[str, str]
    timeout_s: int
    code: str  # the working directory and the user's factory modules' files as they are now

    @property
    def key(self) -> str:
        return json.dumps(
            [self.workers, self.resources, self.strategy, self.env, self.timeout_s, self.code], sort_keys=True
        )

    @classmethod
    def of(cls, config: Config, env: dict[str, str]) -> Shape:
        scaling = config.scaling
        resources = dict(scaling.resources_per_worker or {"CPU": 1.0})
        timeout = math.ceil(config.failure.collective_timeout_s)  # as build_trainer's TorchConfig
        return cls(
            int(scaling.max_workers), resources, scaling.placement_strategy, dict(env), timeout, code_stamp(config)
        )


def code_stamp(config: Config) -> str:
    """The working directory and, for each module the config names (``model.factory``,
    ``data.factory``, ``parallel.tp_plan``), its file's size and modification time. A worker
    forgets every user module after a run (worker/fresh.py), whichever the config names; this
    keeps runs of other code on groups of their own."""
    names = [getattr(config.model, "factory", None), getattr(config.data, "factory", None), config.parallel.tp_plan]
    stamp: list[Any] = [os.getcwd()]
    for name in filter(None, names):
        module = str(name).partition(":")[0]
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        try:
            info = os.stat(origin) if origin else None
        except OSError:
            info = None
        stamp.append([module, origin, info.st_size if info else None, info.st_mtime_ns if info else None])
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]


@dataclass
class Group:
    group_id: str
    key: str
    placement: Any
    workers: list[Any]
    joined: bool = False
    lessee: Any = None  # the leasing run's mailbox: when it is gone, so is the run
    runs: int = 0


@ray.remote(num_cpus=0, max_concurrency=16)  # type: ignore[call-overload]
class WarmPool:
    """Idle and leased warm groups; a lease takes an idle group of the run's shape or starts one."""

    def __init__(self, max_idle: int = 4) -> None:
        self.lock = threading.Lock()
        self.groups: dict[str, Group] = {}
        self.idle: list[str] = []  # group ids, the most recently given back last
        self.max_idle = max_idle
        self.started = 0

    def lease(self, shape: Shape, lessee: Any) -> tuple[str, list[Any], bool, int]:
        """(group id, its workers by rank, whether its process group is formed, runs it has served)."""
        self.reap()
        with self.lock:
            for group_id in reversed(self.idle):
                group = self.groups[group_id]
                if group.key == shape.key:
                    self.idle.remove(group_id)
                    group.lessee = lessee
                    return group.group_id, group.workers, group.joined, group.runs
            # A new group needs resources: idle groups of other shapes give theirs back first.
            for group_id in [g for g in self.idle if self.groups[g].key != shape.key]:
                self._kill(group_id)
            group = self._start(shape)
            group.lessee = lessee
            return group.group_id, group.workers, False, 0

    def _start(self, shape: Shape) -> Group:
        bundles = [dict(shape.resources) for _ in range(shape.workers)]
        placement = placement_group(bundles, strategy=shape.strategy)
        cpus = shape.resources.get("CPU", 0.0)
        others = {k: v for k, v in shape.resources.items() if k not in ("CPU", "GPU")}
        workers = [
            RemoteWorker.options(
                num_cpus=cpus,
                resources=others or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank),
                runtime_env={"env_vars": shape.env},
                max_restarts=0,
            ).remote()
            for rank in range(shape.workers)
        ]
        self.started += 1
        group = Group(uuid.uuid4().hex[:12], shape.key, placement, workers)
        self.groups[group.group_id] = group
        return group

    def joined(self, group_id: str) -> None:
        with self.lock:
            if group_id in self.groups:
                self.groups[group_id].joined = True

    def give_back(self, group_id: str, healthy: bool) -> None:
        with self.lock:
            group = self.groups.get(group_id)
            if group is None:
                return
            if not healthy:
                self._kill(group_id)
                return
            group.lessee = None
            group.runs += 1
            self.idle.append(group_id)
            while len(self.idle) > self.max_idle:
                self._kill(self.idle[0])

    def reap(self) -> int:
        """Kill the leased groups whose run is gone (its driver, a trial's actor, ended); how many."""
        with self.lock:
            leased = [(g.group_id, g.lessee) for g in self.groups.values() if g.lessee is not None]
        gone = [group_id for group_id, lessee in leased if not alive(lessee)]
        with self.lock:
            for group_id in gone:
                if group_id in self.groups and self.groups[group_id].lessee is not None:
                    self._kill(group_id)
        return len(gone)

    def _kill(self, group_id: str) -> None:
        group = self.groups.pop(group_id)
        if group_id in self.idle:
            self.idle.remove(group_id)
        for worker in group.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(group.placement)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"idle": len(self.idle), "leased": len(self.groups) - len(self.idle), "started": self.started}

    def shutdown(self) -> int:
        """Kill every group, idle or leased, and give their resources back; how many."""
        with self.lock:
            ids = list(self.groups)
            for group_id in ids:
                self._kill(group_id)
        return len(ids)


def alive(mailbox: Any, timeout_s: float = 10.0) -> bool:
    """Whether a run's mailbox (owned by its driver) still answers; a slow answer is not death."""
    try:
        ray.get(mailbox.stop_requested.remote(), timeout=timeout_s)
    except ActorDiedError:
        return False
    except (GetTimeoutError, RayError):  # ActorUnavailableError among them: it may come back
        return True
    return True


def start_pool() -> Any:
    """A pool on the driver's node, owned by this process (its groups die with it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return WarmPool.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]


_process_pool: dict[str, Any] = {}


def process_pool() -> Any:
    """``scaling.reuse_workers``: this process's pool in the Ray it is connected to now."""
    context = ray.get_runtime_context()
    session = (context.get_node_id(), context.get_job_id())  # a Ray started again reuses job ids
    if _process_pool.get("session") != session:
        _process_pool.update(session=session, pool=start_pool())
    return _process_pool["pool"]


def shutdown_pool(pool: Any, timeout_s: float = 60.0) -> None:
    """Give every group's resources back (a search's end), then end the pool."""
    try:
        ray.get(pool.shutdown.remote(), timeout=timeout_s)
    except RayError as err:
        log.warning("warm worker pool: could not shut down cleanly: %s", err)
    ray.kill(pool, no_restart=True)


@dataclass
class WarmTrainer:
    """Runs one run on a leased group; ``fit`` as ``_fit`` expects of a TorchTrainer."""

    pool: Any
    shape: Shape
    payload: Payload
    mailbox: Any
    return_value: Report | UserError | None = None

    def fit(self) -> WarmTrainer:
        try:
            group_id, workers, joined, runs = self.lease()
        except RayError as err:  # the pool itself is gone
            raise WarmGroupFailed(f"no warm worker pool: {type(err).__name__}: {err}".splitlines()[0][:500]) from None
        healthy = False
        try:
            marks = {"controller": time.time()}  # the lease: what Ray Train's controller start is to its runs
            if joined:
                log.info("warm worker group %s: %d worker(s), run %d on them", group_id, len(workers), runs + 1)
            else:
                host, port = ray.get(workers[0].address.remote())
                world, timeout = len(workers), self.shape.timeout_s
                ray.get([w.join.remote(rank, world, host, port, timeout) for rank, w in enumerate(workers)])
                self.pool.joined.remote(group_id)
            marks["workers"] = marks["process_group"] = time.time()
            self.mailbox.put.remote(StartupMarks(tuple(marks.items())))
            results = wait_all([w.run.remote(self.payload) for w in workers])
            self.return_value = results[0]
            healthy = all(isinstance(r, Report) for r in results)
        except RayError as err:
            message = f"{type(err).__name__}: {err}".splitlines()[0][:500]
            self.mailbox.put.remote(WorkerFailure({-1: f"warm worker group: {message}"}, time.time()))
            raise WarmGroupFailed(message) from None
        finally:
            self.pool.give_back.remote(group_id, healthy)
        return self

    def lease(self) -> tuple[str, list[Any], bool, int]:
        """A group whose every worker is as a new one would be (worker/fresh.py); a used group
        that cannot say so is killed, with one line saying why, and the lease taken again."""
        while True:
            group_id, workers, joined, runs = ray.get(self.pool.lease.remote(self.shape, self.mailbox))
            if not runs:
                return group_id, workers, joined, runs
            try:
                problems = ray.get([w.problem.remote() for w in workers])
            except RayError as err:
                problems = [f"{type(err).__name__}: {err}".splitlines()[0][:300]]
            said = [(rank, problem) for rank, problem in enumerate(problems) if problem]
            if not said:
                return group_id, workers, joined, runs
            ray.get(self.pool.give_back.remote(group_id, False))
            rank, problem = said[0]
            log.warning("warm worker group %s not reused (rank %d: %s); starting new workers", group_id, rank, problem)


def wait_all(refs: list[Any]) -> list[Any]:
    """Every rank's return value, in rank order; the first failure raises at once (the other ranks
    would otherwise wait in a collective for the dead one until the collective timeout)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready[0])  # raises the rank's error now
    return ray.get(refs)
