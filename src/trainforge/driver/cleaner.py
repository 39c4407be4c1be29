"""A run's placement group is removed when its Ray Train controller dies, and only then.

Ray Train (2.60) starts a detached ``PlacementGroupCleaner`` actor beside each controller: should
the controller die without shutting down, the cleaner removes the run's placement group so its
resources come back. It asks whether the controller lives through Ray's state API, and that API
finds "the" cluster from machine-wide guesses: ``RAY_API_SERVER_ADDRESS`` or ``RAY_ADDRESS``, the
address file of the newest ``ray start``, a scan of the machine's GCS processes, the dashboard URL
recorded in the GCS found, which is http://127.0.0.1:8265 for a Ray started without a dashboard
(trainforge's local Ray). When the server that answers is another cluster's (a plain ``ray.init()``
on the same machine, whose dashboard takes that port and shares the machine's token in
~/.ray/auth_token; a dashboard forwarded there), it has never heard of the controller, and Ray's
cleaner reads "no such actor" as "dead": it removes the placement group of a run that is training.
Ray then destroys every worker ("Destroying worker since its placement group was removed") and the
run fails its health checks at once. (Seen in CI: a test's run failed at step 0 seconds after
another test's plain Ray Train script started its Ray.)

``OwnClusterCleanerCallback`` takes its place (``RunTrainer`` swaps it in): the cleaner asks the
GCS it is connected to, which is the run's own, and removes the group only when that GCS records
the controller as DEAD. No answer, or no record, is not death; the group then stays until the
cluster ends, as it would had the cleaner itself died. The check is one GCS read per interval,
where Ray's resolves the cluster and makes an HTTP request every second.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2.torch.torch_trainer import TorchTrainer
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

log = logging.getLogger("trainforge")

CHECK_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 10.0


def controller_state(actor_id: str) -> str | None:
    """The actor's state in the GCS this process is connected to (ALIVE, RESTARTING, DEAD, ...);
    None when the GCS has no record of it or does not answer."""
    from ray._private.state import actors

    try:
        return actors(actor_id=actor_id).get("State")
    except Exception as err:  # the GCS busy or restarting: ask again next time
        log.debug("controller %s: %s", actor_id, err)
        return None


class OwnClusterCleaner:
    """Detached actor: removes the registered placement group once the controller is DEAD."""

    def __init__(self, controller_id: str, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.controller_id = controller_id
        self.interval_s = interval_s
        self.group: PlacementGroup | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.checked = 0

    def register_placement_group(self, group: PlacementGroup) -> None:
        """The group of the worker group now running (a restart registers its new one)."""
        with self.lock:
            self.group = group

    def start_monitoring(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.watch, name="trainforge-pg-cleaner", daemon=True)
            self.thread.start()

    def checks(self) -> int:
        """How many times the controller has been looked up (tests wait on it)."""
        return self.checked

    def watch(self) -> None:
        while not self.stopping.wait(self.interval_s):
            state = controller_state(self.controller_id)
            self.checked += 1
            if state == "DEAD":
                with self.lock:
                    group = self.group
                if group is not None and placement_group_table(group).get("state") not in (None, "REMOVED"):
                    log.warning("the Ray Train controller %s is dead: removing its placement group", self.controller_id)
                    remove_placement_group(group)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def stop(self) -> None:
        """The controller shuts down normally (it removes its own group): leave it, and exit."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=STOP_TIMEOUT_S)
        ray.actor.exit_actor()


class OwnClusterCleanerCallback(ControllerCallback, WorkerGroupCallback):
    """In the controller: starts the run's ``OwnClusterCleaner``, gives it each worker group's
    placement group, stops it when the controller ends normally."""

    def __init__(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.cleaner: Any = None

    def after_controller_start(self, train_run_context: Any) -> None:
        controller_id = ray.get_runtime_context().get_actor_id()
        try:
            self.cleaner = (
                ray.remote(OwnClusterCleaner)
                .options(
                    num_cpus=0,
                    lifetime="detached",  # it must outlive the controller it watches
                    resources={HEAD_NODE_RESOURCE_NAME: 0.001},  # and the worker nodes
                )
                .remote(controller_id, self.interval_s)
            )
            self.cleaner.start_monitoring.remote()
        except Exception as err:  # a run without the safety net still trains
            log.warning("could not start the placement group cleaner: %s", err)
            self.cleaner = None

    def after_worker_group_start(self, worker_group: Any) -> None:
        if self.cleaner is None:
            return
        group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        try:
            ray.get(self.cleaner.register_placement_group.remote(group), timeout=STOP_TIMEOUT_S)
        except Exception as err:
            log.warning("could not hand the placement group to its cleaner: %s", err)

    async def before_controller_shutdown(self) -> None:
        self.stop()

    def before_controller_abort(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self.cleaner is None:
            return
        cleaner, self.cleaner = self.cleaner, None
        try:
            ray.get(cleaner.stop.remote(), timeout=STOP_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            pass  # exit_actor ends the call this way
        except Exception as err:
            log.warning("could not stop the placement group cleaner: %s", err)


class RunTrainer(TorchTrainer):
    """Ray Train's TorchTrainer with ``OwnClusterCleanerCallback`` in place of its placement group
    cleaner (the module's docstring says why)."""

    def _create_default_callbacks(self) -> list[Any]:
        return [
            OwnClusterCleanerCallback() if isinstance(callback, PlacementGroupCleanerCallback) else callback
            for callback in super()._create_default_callbacks()
        ]
