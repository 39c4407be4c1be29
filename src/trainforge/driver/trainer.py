"""The run's Ray Train trainer: ``RunTrainer``, a ``TorchTrainer`` whose placement group cleaner
asks the run's own GCS (driver/cleaner.py says why), through ``OwnClusterCleanerCallback``."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2.torch.torch_trainer import TorchTrainer

from trainforge.driver.cleaner import CHECK_INTERVAL_S, STOP_TIMEOUT_S, OwnClusterCleaner

log = logging.getLogger("trainforge")


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
        # Not waited for: the cleaner may still be starting (a new process), and the workers' first
        # step must not wait for it. Its calls run in order, after start_monitoring.
        self.cleaner.register_placement_group.remote(group)

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
