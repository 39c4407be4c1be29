"""Worker-side observers: the loop says what happened at each report and save, hooks decide what to
do with it (export Prometheus metrics, sample the node's CPU and GPU, ...). The loop never grows an
``if feature_enabled:``; a feature is a hook plus one line in ``build_hooks``, which hands each
feature what it needs from the run (the features' modules never see ``WorkerRun``).

Hooks run on the training thread, so they must be cheap (no network round trips per call). A hook
that raises is logged once and then skipped: observing a run never stops it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from trainforge.metrics.worker.comm import comm_hooks
from trainforge.metrics.worker.hook import metrics_hooks
from trainforge.metrics.worker.system import system_hooks

if TYPE_CHECKING:
    from trainforge.checkpoint.writer import SaveOutcome
    from trainforge.protocol import Report
    from trainforge.worker.build import WorkerRun

log = logging.getLogger("trainforge.worker")


class WorkerHook(Protocol):
    def on_report(self, report: Report, local: dict[str, float]) -> None:
        """Every rank, just before ``ray.train.report``. ``report`` is the all-reduced report (the
        same on every rank; a hook may add to its ``figures``, which reach the driver's callback with
        this rank's report); ``local`` is this rank's own per-step times over the interval
        (``data_s``, ``compute_s``, ``optim_s``, ``step_s``) and its ``steps``, to which the
        communication hook, which runs first, adds ``comm_s`` and ``comm_exposed_s``."""
        ...

    def on_save(self, outcome: SaveOutcome) -> None:
        """Rank 0, when a checkpoint save finished (``outcome.error`` is set when it failed)."""
        ...

    def close(self) -> None: ...


class Hooks:
    """Fan-out with failure isolation."""

    def __init__(self, hooks: list[WorkerHook]) -> None:
        self.hooks = hooks
        self._failed: set[int] = set()

    def _each(self, method: str, *args: Any) -> None:
        for index, hook in enumerate(self.hooks):
            if index in self._failed:
                continue
            try:
                getattr(hook, method)(*args)
            except Exception as err:  # observing must never take training down
                log.warning("%s.%s failed, disabled for this run: %s", type(hook).__name__, method, err)
                self._failed.add(index)

    def on_report(self, report: Report, local: dict[str, float]) -> None:
        self._each("on_report", report, local)

    def on_save(self, outcome: SaveOutcome) -> None:
        self._each("on_save", outcome)

    def close(self) -> None:
        self._each("close")


def build_hooks(run: WorkerRun) -> Hooks:
    """The hooks this run's config asks for."""
    hooks: list[WorkerHook] = []
    hooks.extend(system_hooks(run.config))
    compression = run.plan.compression
    hooks.extend(  # before Prometheus' hook, which exports the figures it adds to ``local``
        comm_hooks(
            run.config.metrics.comm_timing,
            world=run.world,
            model=run.model,
            device=run.device,
            chosen=compression.hook if compression is not None else None,
        )
    )
    hooks.extend(metrics_hooks(run.config, rank=run.rank))
    return Hooks(hooks)
