"""The worker hook that exports training metrics to Prometheus through Ray's metrics agent.

Every rank records its own gauges (labels run, trial, rank, node) at every report: the
all-reduced training figures, its own step time and phases, its gradient communication and the
report's timestamp (the stall alert's input). Rank 0 adds its checkpoint saves; the first
worker of each node adds the node's GPUs. A report costs a few dozen in-process ``Gauge.set``
calls (tens of microseconds, docs/monitoring.md) and no network round trip.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from trainforge.metrics.names import CHECKPOINT, TRAINING
from trainforge.metrics.worker.export import Gauges
from trainforge.metrics.worker.gpu import NodeGpus
from trainforge.metrics.worker.place import local_rank

if TYPE_CHECKING:
    from trainforge.checkpoint.writer import SaveOutcome
    from trainforge.config import Config
    from trainforge.protocol import Report

log = logging.getLogger("trainforge.worker")

# report key -> gauge; the report has the same values on every rank (one all-reduce)
REPORTED = {
    "train/loss": "trainforge_train_loss",
    "val/loss": "trainforge_val_loss",
    "val/accuracy": "trainforge_val_accuracy",
    "perf/samples_per_s": "trainforge_samples_per_second",
    "step": "trainforge_global_step",
    "train/lr": "trainforge_learning_rate",
    "train/grad_norm": "trainforge_grad_norm",
    "world_size": "trainforge_world_size",
    "time/unix": "trainforge_last_step_timestamp_seconds",
}
# this rank's own times per step (worker/metrics.local_times) -> phase label
PHASES = {"data_s": "data", "compute_s": "compute", "optim_s": "optimizer"}


class PrometheusHook:
    """Worker hook (worker/hooks.py): gauges per rank, checkpoint gauges on rank 0, GPUs per node."""

    def __init__(
        self,
        labels: dict[str, str],
        *,
        rank: int,
        gpus: NodeGpus | None = None,
    ) -> None:
        self.gauges = Gauges(TRAINING, labels)
        self.checkpoint = Gauges(CHECKPOINT, labels) if rank == 0 else None
        self.gpus = gpus
        self.save_failures = 0

    def on_report(self, report: Report, local: dict[str, float]) -> None:
        gauges = self.gauges
        values = report.scalars()
        for key, name in REPORTED.items():
            if key in values:
                gauges.set(name, values[key])
        steps = local.get("steps", 0.0)
        if steps:
            gauges.set("trainforge_step_seconds", local["step_s"])
            for key, phase in PHASES.items():
                gauges.set("trainforge_step_phase_seconds", local.get(key, 0.0), phase=phase)
            if "straggler_score" in local:  # worker/straggler.py, set by the loop
                gauges.set("trainforge_step_own_seconds", local["own_s"])
                gauges.set("trainforge_straggler_score", local["straggler_score"])
            if "comm_s" in local:  # from metrics.comm.CommReport, the hook before this one
                gauges.set("trainforge_comm_seconds", local["comm_s"])
                gauges.set("trainforge_comm_exposed_seconds", local["comm_exposed_s"])
        if self.checkpoint is not None:
            self.checkpoint.set("trainforge_checkpoint_save_failures", self.save_failures)
            stall = report.figures.get("checkpoint/stall_s")
            if stall is not None:
                self.checkpoint.set("trainforge_checkpoint_stall_seconds", stall)
        if self.gpus is not None:
            self.gpus.record()

    def on_save(self, outcome: SaveOutcome) -> None:
        if self.checkpoint is None:
            return
        if outcome.error:
            self.save_failures += 1
            self.checkpoint.set("trainforge_checkpoint_save_failures", self.save_failures)
            return
        self.checkpoint.set("trainforge_checkpoint_save_seconds", outcome.seconds)
        self.checkpoint.set("trainforge_checkpoint_size_bytes", outcome.size_bytes)
        self.checkpoint.set("trainforge_checkpoint_last_success_timestamp_seconds", time.time())

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()


def metrics_hooks(config: Config, *, rank: int) -> list[PrometheusHook]:
    """The Prometheus hook for this worker when ``metrics.enabled``; none if it cannot be built
    (observing a run never stops it). Its communication gauges come from ``metrics.comm.CommReport``."""
    import ray

    if not config.metrics.enabled:
        return []
    try:
        node = ray.util.get_node_ip_address()
        labels = {"run": config.run.name, "trial": config.metrics.trial or "", "rank": str(rank), "node": node}
        first_on_node = local_rank() == 0
        hook = PrometheusHook(labels, rank=rank, gpus=NodeGpus(labels) if first_on_node else None)
    except Exception as err:
        log.warning("Prometheus metrics disabled for this worker: %s", err)
        return []
    return [hook]
