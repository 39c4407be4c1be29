"""An elastic run sizes its next worker group from a view of the cluster that is current.

Ray Train's elastic scaling policy counts the workers it can start from the resources Ray Data's
``AutoscalingCoordinator`` actor has reserved for the run, and that actor refreshes its view of
the cluster's nodes every 20 s (``TICK_INTERVAL_S``). After a node is lost, the policy would go on
counting the dead node's CPUs for up to 20 s: it asks for the old size, waits out a worker-group
start timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s by default) and only then starts on
the nodes left. ``FreshNodesCallback`` (in the Ray Train controller) asks the coordinator to
recompute at once (``get_reserved_resources(recompute=True)``, the call Ray Data makes before it
pins work to nodes) each time the controller goes to restart or reschedule, so the next decision
sees the node gone as soon as Ray's GCS declares it dead, and once before the first group (a
coordinator an earlier run left in the same Ray may not yet count a node added since). Failing to
reach the coordinator (a Ray without it) costs nothing but the old wait, logged once.

A node killed outright is still alive to the GCS for a moment after its workers' peers fail (until
its health checks have failed ``health_check_failure_threshold`` times), and a decision taken then
would count it. So before refreshing, the callback knocks on the node manager of every node the
failed group ran on; a node whose raylet does not answer is waited for, up to the GCS's own window
for declaring it dead, and the refresh follows. A worker killed on a live node costs no wait.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

log = logging.getLogger("trainforge")

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # Ray Data's actor: name, namespace
REFRESH_TIMEOUT_S = 10.0
KNOCK_TIMEOUT_S = 0.5  # a raylet that does not accept a connection in this long is taken for gone
MAX_DEATH_WAIT_S = 60.0


class FreshNodesCallback(ControllerCallback, WorkerGroupCallback):
    """Refreshes the coordinator's view of the nodes when an elastic group must be sized again."""

    def __init__(self) -> None:
        self.requester = "trainforge"
        self.warned = False
        self.group_nodes: set[str] = set()  # the node ids the running group's workers are on

    def after_controller_start(self, train_run_context: Any) -> None:
        self.requester = f"train-{train_run_context.run_id}"  # the policy's id (ray.train's ScalingPolicy)
        # The first group too: a coordinator an earlier run left in this Ray may not have seen a
        # node added since its last tick, and the run would start smaller than the cluster allows.
        self.refresh(missing_is_fine=True)

    def after_worker_group_start(self, worker_group: Any) -> None:
        self.group_nodes = {worker.metadata.node_id for worker in worker_group.get_workers()}

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        if type(current_state).__name__ in ("RestartingState", "ReschedulingState"):
            self.wait_for_lost_nodes()
            self.refresh()

    def wait_for_lost_nodes(self) -> None:
        """Until the GCS has declared dead every node of the group whose raylet does not answer
        (at most its own window for that)."""
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["NodeID"] in self.group_nodes}
        if not nodes:
            return
        with ThreadPoolExecutor(max_workers=min(len(nodes), 16)) as pool:
            answers = dict(zip(nodes, pool.map(answers_knock, nodes.values()), strict=True))
        silent = {node for node, answered in answers.items() if not answered}
        deadline = time.monotonic() + death_window_s()
        while silent and time.monotonic() < deadline:
            time.sleep(0.1)
            silent &= {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def refresh(self, missing_is_fine: bool = False) -> None:
        """``missing_is_fine``: before the first group, no coordinator yet means the policy creates
        one, whose first view is current."""
        try:
            coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
        except ValueError as err:  # none in this Ray
            if not missing_is_fine:
                self.warn(err)
            return
        try:
            ray.get(
                coordinator.get_reserved_resources.remote(self.requester, recompute=True), timeout=REFRESH_TIMEOUT_S
            )
        except Exception as err:  # an internal of Ray Data's: the old wait, not a failed run
            self.warn(err)

    def warn(self, err: Exception) -> None:
        if not self.warned:
            log.warning("could not refresh Ray's view of the nodes for the elastic restart: %s", err)
            self.warned = True


def answers_knock(node: dict[str, Any]) -> bool:
    """Whether the node's raylet accepts a TCP connection (a killed one refuses, a lost host is silent)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), KNOCK_TIMEOUT_S):
            return True
    except OSError:
        return False


def death_window_s() -> float:
    """How long the GCS takes at most to declare a silent node dead: its health checks' period times
    their failure threshold, plus one check's timeout (Ray's _system_config, the same in every process)."""
    from ray._raylet import Config  # type: ignore[attr-defined]  # Cython, no stubs

    period, threshold = Config.health_check_period_ms(), Config.health_check_failure_threshold()
    return min(MAX_DEATH_WAIT_S, (period * threshold + Config.health_check_timeout_ms()) / 1000 + 1.0)
