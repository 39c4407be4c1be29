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

``OwnClusterCleaner`` takes its place (driver/trainer.py swaps it in): the cleaner asks the
GCS it is connected to, which is the run's own, and removes the group only when that GCS records
the controller as DEAD. No answer, or no record, is not death; the group then stays until the
cluster ends, as it would had the cleaner itself died. The check is one GCS read per interval,
where Ray's resolves the cluster and makes an HTTP request every second.

The actor's class is all this module holds, with nothing of torch or Ray Train imported: the
actor's process imports it as it starts, while the run's workers start.
"""

from __future__ import annotations

import logging
import threading

import ray
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
