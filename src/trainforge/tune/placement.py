"""Giving a stopped trial's resources back: the placement groups of its Ray Train worker groups.

When Tune stops a trial (a scheduler's early stop, a PBT exploit, the time budget) it ends the
trial's actor at once. The trial's Ray Train controller dies with it, but the placement group the
controller created for its workers does not: a placement group lives as long as the job that
created it. Ray Train starts a detached ``PlacementGroupCleaner`` for that case, but it finds the
controller's state through the dashboard's state API, which fails when the dashboard is off or
when several Ray instances run on one machine; the group then holds its CPUs (and GPUs) until
the search ends.

So each trial's Ray Train run records its controller and the placement group of every worker
group it starts (a controller-side callback, ``RecordPlacementGroups``) in a ledger actor owned by
the search driver. Once the trial's actor has ended, the driver kills the trial's controller
first (a controller still shutting down would answer the removal of its group by starting a new
one) and then removes the groups.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.util.placement_group import PlacementGroup, remove_placement_group

log = logging.getLogger("trainforge")


@ray.remote(num_cpus=0)
class PlacementGroupLedger:
    """trial id -> its Ray Train controllers and the hex ids of its worker groups' placement groups."""

    def __init__(self) -> None:
        self.groups: dict[str, list[str]] = {}
        self.controllers: dict[str, list[Any]] = {}

    def add(self, trial_id: str, group_id: str, controller: Any) -> None:
        self.groups.setdefault(trial_id, []).append(group_id)
        self.controllers.setdefault(trial_id, []).append(controller)

    def take(self, trial_ids: list[str] | None = None) -> tuple[list[Any], list[str]]:
        """Forget and return the controllers and groups of these trials (all trials when None)."""
        chosen = list(self.groups) if trial_ids is None else trial_ids
        controllers = [actor for trial in chosen for actor in self.controllers.pop(trial, [])]
        return controllers, [group for trial in chosen for group in self.groups.pop(trial, [])]


def start_ledger() -> Any:
    """A ledger on the driver's node (like the run's mailbox: it must outlive worker nodes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return PlacementGroupLedger.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]


class RecordPlacementGroups(WorkerGroupCallback):
    """Ray Train controller callback: every worker group's placement group goes into the ledger."""

    def __init__(self, ledger: Any, trial_id: str) -> None:
        self.ledger = ledger
        self.trial_id = trial_id

    def after_worker_group_start(self, worker_group: Any) -> None:
        group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        controller = ray.get_runtime_context().current_actor
        self.ledger.add.remote(self.trial_id, group.id.hex(), controller)


def release(ledger: Any, trial_ids: list[str] | None = None) -> int:
    """Kill the Ray Train controllers of trials whose actors have ended (all when None) and remove
    their recorded placement groups; the number of groups removed. Groups a finished run already
    removed are skipped."""
    try:
        controllers, group_ids = ray.get(ledger.take.remote(trial_ids), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as err:
        log.warning("could not read the placement group ledger: %s", err)
        return 0
    for controller in controllers:
        try:
            ray.kill(controller, no_restart=True)
        except Exception as err:  # already gone
            log.debug("controller %s: %s", controller, err)
    table = ray.util.placement_group_table()
    removed = 0
    for group_id in group_ids:
        if table.get(group_id, {}).get("state", "REMOVED") == "REMOVED":
            continue
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
            removed += 1
        except Exception as err:  # already gone between the table read and now
            log.debug("placement group %s: %s", group_id, err)
    if removed:
        log.info("removed %d placement group(s) that ended trials left holding resources", removed)
    return removed


class Releaser:
    """Relay listener: a trial's placement groups are removed a few seconds after Tune ended its
    actor (the controller must be gone, or it would start a new group), and at once when a
    paused trial starts again (its old actor is gone by then)."""

    DELAY_S = 5.0

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.due: dict[str, float] = {}

    def on_trial_start(self, trial: Any) -> None:
        release(self.ledger, [trial.trial_id])

    def on_trial_complete(self, trial: Any) -> None:
        self.due[trial.trial_id] = time.monotonic() + self.DELAY_S

    def on_trial_error(self, trial: Any) -> None:
        self.due[trial.trial_id] = time.monotonic() + self.DELAY_S

    def on_step_end(self) -> None:
        now = time.monotonic()
        ready = [trial_id for trial_id, at in self.due.items() if at <= now]
        if ready:
            for trial_id in ready:
                del self.due[trial_id]
            release(self.ledger, ready)
