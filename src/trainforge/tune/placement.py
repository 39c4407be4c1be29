"""Giving a stopped trial's resources back: the placement groups of its Ray Train worker groups.

When Tune stops a trial (a scheduler's early stop, a PBT exploit, the time budget) it ends the
trial's actor at once. The trial's Ray Train controller dies with it, but the placement group the
controller created for its workers does not: a placement group lives as long as the job that
created it. Ray Train starts a detached ``PlacementGroupCleaner`` for that case, but it finds the
controller's state through the dashboard's state API, which fails when the dashboard is off or
when several Ray instances run on one machine; the group then holds its CPUs (and GPUs) until
the search ends.

So each trial's Ray Train run records its controller when it starts, and the placement group of
every worker group it starts (a controller-side callback, ``RecordPlacementGroups``), in a ledger
actor owned by the search driver. Once the trial's actor has ended, the driver kills the trial's
controller first (a controller still shutting down would answer the removal of its group by
starting a new one) and then removes the groups.

The ledger alone is not enough: a controller that dies between creating a group and the end of
its worker group's start (Tune stopping the trial while a restart is under way; a loaded machine
makes that window seconds long) never records the group. The GCS does know: every group carries
its creator actor and whether that actor is dead. A group of this job whose creator is dead can
never be used again (its workers died with the creator), so ``release`` also removes every such
*orphan*, recorded or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

import ray
from ray.core.generated.gcs_pb2 import PlacementGroupTableData  # type: ignore[attr-defined]
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.util.placement_group import PlacementGroup, remove_placement_group

log = logging.getLogger("trainforge")


@ray.remote(num_cpus=0)
class PlacementGroupLedger:
    """trial id -> its Ray Train controllers and the hex ids of its worker groups' placement groups."""

    def __init__(self) -> None:
        self.groups: dict[str, list[str]] = {}
        self.controllers: dict[str, list[Any]] = {}
        self.killed: set[str] = set()  # hex ids of every controller handed out to be killed

    def add_controller(self, trial_id: str, controller: Any) -> None:
        self.controllers.setdefault(trial_id, []).append(controller)

    def add_group(self, trial_id: str, group_id: str) -> None:
        self.groups.setdefault(trial_id, []).append(group_id)

    def take(self, trial_ids: list[str] | None = None) -> tuple[list[Any], list[str]]:
        """Forget and return the controllers and groups of these trials (all trials when None)."""
        chosen = list(self.groups | self.controllers) if trial_ids is None else trial_ids
        controllers = [actor for trial in chosen for actor in self.controllers.pop(trial, [])]
        self.killed.update(actor._actor_id.hex() for actor in controllers)
        return controllers, [group for trial in chosen for group in self.groups.pop(trial, [])]

    def killed_ids(self) -> set[str]:
        """Every controller taken so far: one killed by an earlier release may still be dying."""
        return set(self.killed)


def start_ledger() -> Any:
    """A ledger on the driver's node (like the run's mailbox: it must outlive worker nodes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return PlacementGroupLedger.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]


class RecordPlacementGroups(ControllerCallback, WorkerGroupCallback):
    """Ray Train controller callback: the controller as it starts, then every worker group's
    placement group, go into the ledger."""

    def __init__(self, ledger: Any, trial_id: str) -> None:
        self.ledger = ledger
        self.trial_id = trial_id

    def after_controller_start(self, train_run_context: Any) -> None:
        self.ledger.add_controller.remote(self.trial_id, ray.get_runtime_context().current_actor)

    def after_worker_group_start(self, worker_group: Any) -> None:
        group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        self.ledger.add_group.remote(self.trial_id, group.id.hex())


def _group_records() -> list[Any]:
    """The GCS's own records of every placement group (``placement_group_table()`` leaves out
    the creator; the records are what it parses)."""
    from ray._private.state import state

    accessor = state._connect_and_get_accessor()
    return [PlacementGroupTableData.FromString(raw) for raw in accessor.get_placement_group_table()]


def orphaned_groups(dying: Collection[str] = ()) -> tuple[list[str], list[str]]:
    """Hex ids of this job's live placement groups whose creator actor is dead, and of those
    created by the actors in ``dying`` (hex actor ids) that still wait for their creator's death.
    Groups the driver itself created (Tune's, for its trial actors) have no creator actor: the GCS
    marks them with a nil id and ``creator_actor_dead`` set, so the nil id is what excludes them."""
    job = ray.get_runtime_context().get_job_id()
    orphans, waiting = [], []
    for record in _group_records():
        if record.state == PlacementGroupTableData.REMOVED or record.is_detached:
            continue
        if record.creator_job_id.hex() != job or ray.ActorID(record.creator_actor_id).is_nil():
            continue
        if record.creator_actor_dead:
            orphans.append(record.placement_group_id.hex())
        elif record.creator_actor_id.hex() in dying:
            waiting.append(record.placement_group_id.hex())
    return orphans, waiting


def _remove(group_id: str) -> bool:
    try:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
        return True
    except Exception as err:  # removed between the table read and now
        log.debug("placement group %s: %s", group_id, err)
        return False


def release(ledger: Any, trial_ids: list[str] | None = None, *, settle_s: float = 10.0, final: bool = False) -> int:
    """Kill the Ray Train controllers of trials whose actors have ended (all when None), remove
    their recorded placement groups and every orphaned group of this job; the number removed.

    ``ray.kill`` returns before the actor is dead, and a group is an orphan only once the GCS has
    marked its creator dead: wait up to ``settle_s`` for that, so groups the killed controllers
    created but never recorded go too. Controllers killed by an earlier call count as well: on a
    loaded machine one can take longer to die than that call waited. ``final`` (the search has
    ended, no trial runs): what killed controllers still hold after the wait is removed anyway."""
    try:
        controllers, group_ids = ray.get(ledger.take.remote(trial_ids), timeout=30)
        dying = ray.get(ledger.killed_ids.remote(), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as err:
        log.warning("could not read the placement group ledger: %s", err)
        controllers, group_ids, dying = [], [], set()
    for controller in controllers:
        try:
            ray.kill(controller, no_restart=True)
        except Exception as err:  # already gone
            log.debug("controller %s: %s", controller, err)
    live = {gid for gid, info in ray.util.placement_group_table().items() if info.get("state") != "REMOVED"}
    removed = sum(_remove(group_id) for group_id in group_ids if group_id in live)
    deadline = time.monotonic() + settle_s
    while True:
        orphans, waiting = orphaned_groups(dying)
        removed += sum(_remove(group_id) for group_id in orphans)
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if waiting and final:
        log.info("removing %d placement group(s) of killed trial controllers not yet marked dead", len(waiting))
        removed += sum(_remove(group_id) for group_id in waiting)
    elif waiting:
        log.info("%d placement group(s) of killed trial controllers still held after %.0f s", len(waiting), settle_s)
    if removed:
        log.info("removed %d placement group(s) that ended trials left holding resources", removed)
    return removed


class Releaser:
    """Relay listener: a trial's placement groups are removed a few seconds after Tune ended its
    actor (the controller must be gone, or it would start a new group), and at once when a
    paused trial starts again (its old actor is gone by then)."""

    DELAY_S = 5.0

    def __init__(self, ledger: Any, pool: Any = None) -> None:
        self.ledger = ledger
        self.pool = pool  # driver/warm.WarmPool: a stopped trial's warm group is killed, not handed out
        self.due: dict[str, float] = {}

    def on_trial_start(self, trial: Any) -> None:
        release(self.ledger, [trial.trial_id])
        self._reap()

    def _reap(self) -> None:
        if self.pool is not None:
            self.pool.reap.remote()  # fire and forget: the pool checks every leased group's run

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
            self._reap()
