"""An elastic run sizes its next worker group from a view of the cluster that is current.

Ray Train's elastic scaling policy counts the workers it can start from the resources Ray Data's
``AutoscalingCoordinator`` actor has reserved for the run, and that actor refreshes its view of
the cluster's nodes every 20 s (``TICK_INTERVAL_S``). After a node is lost, the policy would go on
counting the dead node's CPUs for up to 20 s: it asks for the old size, waits out a worker-group
start timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s by default) and only then starts on
the nodes left. ``FreshNodesCallback`` (in the Ray Train controller) asks the coordinator to
recompute at once (``get_reserved_resources(recompute=True)``, the call Ray Data makes before it
pins work to nodes) each time the controller goes to restart or reschedule, so the next decision
sees the node gone as soon as Ray's GCS declares it dead. Failing to reach the coordinator (a Ray
without it) costs nothing but the old wait, logged once.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback

log = logging.getLogger("trainforge")

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # Ray Data's actor: name, namespace
REFRESH_TIMEOUT_S = 10.0


class FreshNodesCallback(ControllerCallback):
    """Refreshes the coordinator's view of the nodes when an elastic group must be sized again."""

    def __init__(self) -> None:
        self.requester = "trainforge"
        self.warned = False

    def after_controller_start(self, train_run_context: Any) -> None:
        self.requester = f"train-{train_run_context.run_id}"  # the policy's id (ray.train's ScalingPolicy)

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        if type(current_state).__name__ in ("RestartingState", "ReschedulingState"):
            self.refresh()

    def refresh(self) -> None:
        try:
            coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
            ray.get(
                coordinator.get_reserved_resources.remote(self.requester, recompute=True), timeout=REFRESH_TIMEOUT_S
            )
        except Exception as err:  # an internal of Ray Data's: the old wait, not a failed run
            if not self.warned:
                log.warning("could not refresh Ray's view of the nodes for the elastic restart: %s", err)
                self.warned = True
