"""``failure.replace: worker``: a failed worker is replaced alone; the others keep their processes.

Ray Train (2.60) replaces only the failed *replica groups* of a worker group whose backend says it
has them (``has_replica_groups``, what its torchft integration uses): the controller starts a new
actor in the dead worker's placement-group bundle, with its world rank, and leaves the other actors
running. Placement, health checks and failure accounting (``failure.max_failures``) stay Ray
Train's. Here every worker is its own replica group, and the backend does not form the process
group itself: it runs a rendezvous store in the controller (which lives as long as the run) and
tells each worker where it is. The workers form, and after a loss re-form, one process group over
it (worker/rejoin.py): the survivors drop theirs, put their process back as it was (worker/fresh.py)
and rejoin while the replacement starts, and everyone restores the newest checkpoint, as a
restarted group would, so the run stays exactly the uninterrupted one. What it saves is the
survivors' process start-up, imports and group teardown: measured by ``trainforge bench recovery``.

A full start (the run's first, or Ray Train's fallback when every worker failed or the group changes
size) opens a new namespace in the store, so nothing of an earlier group's joins is counted.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from typing import Any

import ray
import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

from trainforge.worker.rejoin import RENDEZVOUS_ENV, Rendezvous

log = logging.getLogger("trainforge")


class ReplacingBackend(_TorchBackend):
    """Ray Train's torch backend with one replica group per worker and the process group left to
    the workers (they rejoin it after a peer is replaced)."""

    has_replica_groups = True

    def __init__(self) -> None:
        super().__init__()
        self.store: dist.TCPStore | None = None
        self.rendezvous: Rendezvous | None = None

    def on_start(self, worker_group: Any, backend_config: Any) -> None:  # a ReplacingTorchConfig
        from ray.train.v2._internal.execution.worker_group import WorkerGroup

        if self.store is None:
            # Listens on this node (the controller's) for the run's life; port 0: the OS picks one.
            self.store = dist.TCPStore(
                ray.util.get_node_ip_address(),
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=backend_config.timeout_s),
            )
        if isinstance(worker_group, WorkerGroup):
            # A full start: a namespace of its own, so no join of an earlier group is counted.
            gpus = worker_group.get_resources_per_worker().get("GPU", 0)
            self.rendezvous = Rendezvous(
                host=self.store.host,
                port=self.store.port,
                namespace=uuid.uuid4().hex[:12],
                world=len(worker_group),
                backend=backend_config.backend or ("nccl" if gpus else "gloo"),
                timeout_s=backend_config.timeout_s,
            )
        assert self.rendezvous is not None, "a replica group is replaced only after a full start"
        worker_group.execute(_set_torch_distributed_env_vars)
        worker_group.execute(_announce, self.rendezvous.to_env())

    def on_training_start(self, worker_group: Any, backend_config: Any) -> None:
        return None


def _announce(value: str) -> None:
    os.environ[RENDEZVOUS_ENV] = value


class ReplacingTorchConfig(TorchConfig):
    """``TorchConfig`` whose backend replaces failed workers alone (``failure.replace: worker``)."""

    @property
    def backend_cls(self) -> type[ReplacingBackend]:
        return ReplacingBackend
