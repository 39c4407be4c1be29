"""A worker that outlives the loss of a peer (``failure.replace: worker``, driver/replace.py).

Ray Train replaces a dead worker alone; the survivors keep their processes. Every worker forms the
process group itself over the run's rendezvous store, one *generation* at a time: each join adds one
to the store's count, so with ``world`` workers the n-th join belongs to generation
``(n - 1) // world``: the first group, then after a loss the survivors' rejoins and the
replacements' first joins. A survivor whose collective fails because a peer is gone leaves its run
(the objects of the run are dropped: model, optimizer, loaders), destroys its process group, puts
the process back as it was before its first run (worker/fresh.py, what a warm worker does between
runs), and joins the next generation; the run then restores the newest checkpoint on every rank, as
a restarted group does, so the result is the uninterrupted run's.

An error that is not a lost peer (the user's code, a checkpoint that does not load) ends the worker
as before, and Ray Train handles it. So does a rejoin that does not complete within the process
group's timeout (no replacement came), and more rejoins than ``failure.max_failures``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

import ray
import torch.distributed as dist

log = logging.getLogger("trainforge.worker")

RENDEZVOUS_ENV = "TRAINFORGE_RENDEZVOUS"
T = TypeVar("T")

# How a process group reports a peer that went away (gloo's TCP pairs; NCCL's remote errors).
_LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "remote process exited",
    "ncclremoteerror",
)


@dataclass(frozen=True)
class Rendezvous:
    """Where the run's workers meet (the store in the Ray Train controller) and how many they are."""

    host: str
    port: int
    namespace: str  # one per full group start
    world: int
    backend: str  # gloo or nccl
    timeout_s: float

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        value = os.environ.get(RENDEZVOUS_ENV)
        return cls(**json.loads(value)) if value else None

    def join(self, rank: int) -> int:
        """Form this worker's process group of the next generation (waits for every rank of it);
        returns the generation."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        joined = store.add(f"{self.namespace}/joins", 1)
        generation = (joined - 1) // self.world
        if self.backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail, not hang, on a lost peer
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"{self.namespace}/{generation}/", store),
            rank=rank,
            world_size=self.world,
            timeout=timeout,
        )
        # Ray Train numbers each one-worker replica group's worker 0 on its node; a worker's place on
        # its node among the run's workers is what LOCAL_RANK says under Ray Train's full groups.
        set_local_ranks(rank, self.world)
        return generation


def set_local_ranks(rank: int, world: int) -> None:
    """What torchrun (and Ray Train) set: the node's workers numbered (metrics/worker/place.py), from
    every rank's node address (a collective over the default process group)."""
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, ray.util.get_node_ip_address())
    local = [i for i, node in enumerate(nodes) if node == nodes[rank]]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local.index(rank)),
        LOCAL_WORLD_SIZE=str(len(local)),
        NODE_RANK=str(list(dict.fromkeys(nodes)).index(nodes[rank])),
    )


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is a collective that failed because a peer is gone."""
    seen: BaseException | None = err
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, (dist.DistNetworkError, dist.DistBackendError)) or any(m in text for m in _LOST_PEER):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def run_rejoining(
    rendezvous: Rendezvous,
    rank: int,
    run: Callable[[int], T],
    max_rejoins: int,
    reset: Callable[[], str | None],
) -> T:
    """``run(generation)`` in process groups of successive generations: after a lost peer, leave the
    group, ``reset`` the process and join the next one, at most ``max_rejoins`` times (-1: no limit).
    ``reset`` returns why the process cannot be vouched for as a fresh worker's (worker/fresh.py's
    ``Baseline.problem``): then this worker fails instead, and Ray Train replaces it too."""
    rejoins = 0
    while True:
        generation = rendezvous.join(rank)
        if generation:
            log.warning("rank %d (pid %d) joined the process group's generation %d", rank, os.getpid(), generation)
        try:
            return run(generation)
        except Exception as err:
            if not lost_peer(err) or rejoins == max_rejoins:
                raise
            rejoins += 1
            lost_at = time.monotonic()
            log.warning(
                "rank %d (pid %d): a peer was lost (%s); keeping this process and rejoining for its replacement",
                rank,
                os.getpid(),
                str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
            )
        dist.destroy_process_group()
        unfit = reset()
        if unfit is not None:
            raise RuntimeError(f"rank {rank} lost a peer and cannot rejoin: this process is not as a new one ({unfit})")
        log.info("rank %d: left the lost group in %.2f s", rank, time.monotonic() - lost_at)
