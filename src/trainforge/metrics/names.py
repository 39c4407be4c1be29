"""Every Prometheus metric trainforge exports, in one place: name, help text, labels, who records it.

The names here are the names Prometheus stores. Ray's metrics agent prefixes every
``ray.util.metrics`` name with ``ray_`` on export; the shipped scrape config
(deploy/monitoring/prometheus/prometheus.yml) strips it again for ``ray_trainforge_*``, so
dashboards and rules read ``trainforge_*``.

All of them are gauges. Ray's counters appear only after their first increment (a healthy run
would export no failure counter at all, and the checks in tests could not see it), and Ray's
histograms export bucket midpoints instead of the observed sums. Counts that can only grow are
gauges holding the count so far; rules read them with ``increase()``, which also copes with the
reset when a restarted worker group starts counting again.
"""

from __future__ import annotations

from dataclasses import dataclass

RAY_PREFIX = "ray_"  # what Ray's exporter puts in front of every ray.util.metrics name

RUN_LABELS = ("run", "trial")  # trial: empty (hence absent in Prometheus) outside `trainforge tune`
RANK_LABELS = (*RUN_LABELS, "rank", "node")


@dataclass(frozen=True)
class MetricDef:
    name: str
    help: str
    labels: tuple[str, ...]
    recorded_by: str  # "every rank", "rank 0", "first worker per node", "driver"


def _rank(name: str, help_text: str, *extra: str) -> MetricDef:
    return MetricDef(name, help_text, (*RANK_LABELS, *extra), "every rank")


def _rank0(name: str, help_text: str) -> MetricDef:
    return MetricDef(name, help_text, RANK_LABELS, "rank 0")


def _gpu(name: str, help_text: str) -> MetricDef:
    return MetricDef(name, help_text, (*RUN_LABELS, "node", "gpu"), "first worker per node")


TRAINING = (
    _rank("trainforge_train_loss", "Training loss over the last report interval, averaged over all ranks."),
    _rank("trainforge_val_loss", "Validation loss of the most recent evaluation."),
    _rank("trainforge_val_accuracy", "Validation accuracy of the most recent evaluation."),
    _rank("trainforge_samples_per_second", "Training samples per second over all workers, last report interval."),
    _rank("trainforge_global_step", "Optimizer steps completed."),
    _rank("trainforge_learning_rate", "Learning rate of the first parameter group."),
    _rank("trainforge_grad_norm", "Global gradient norm, mean over the last report interval."),
    _rank("trainforge_world_size", "Workers in the worker group."),
    _rank("trainforge_step_seconds", "This rank's mean optimizer step time over the last report interval."),
    _rank(
        "trainforge_step_phase_seconds",
        "This rank's mean time per step in each phase (data wait, compute incl. backward, optimizer).",
        "phase",
    ),
    _rank(
        "trainforge_comm_seconds",
        "This rank's mean time per step with a gradient all-reduce in flight (overlaps backward).",
    ),
    _rank(
        "trainforge_comm_exposed_seconds",
        "This rank's mean time per step spent waiting for the last gradient all-reduce after backward.",
    ),
    _rank("trainforge_last_step_timestamp_seconds", "Unix time of the last report, i.e. of the last completed step."),
    _rank(
        "trainforge_step_own_seconds",
        "This rank's own time per step (data wait and forward, no peer waited for), last report interval.",
    ),
    _rank(
        "trainforge_straggler_score",
        "This rank's own time per step over the median of the other ranks' (worker/straggler.py); 1 is typical.",
    ),
)
STEP_PHASES = ("data", "compute", "optimizer")

CHECKPOINT = (
    _rank0("trainforge_checkpoint_save_seconds", "Duration of the last successful checkpoint save (background)."),
    _rank0("trainforge_checkpoint_size_bytes", "Size of the last successful checkpoint."),
    _rank0("trainforge_checkpoint_last_success_timestamp_seconds", "Unix time the last successful save finished."),
    _rank0("trainforge_checkpoint_save_failures", "Failed checkpoint saves since this worker group started."),
    _rank0("trainforge_checkpoint_stall_seconds", "Training-thread stall of the last save (state copy to host)."),
)

GPU = (
    _gpu("trainforge_gpu_utilization_percent", "GPU utilization (NVML), percent."),
    _gpu("trainforge_gpu_memory_used_bytes", "GPU memory in use (NVML)."),
    _gpu("trainforge_gpu_temperature_celsius", "GPU core temperature (NVML)."),
    _gpu("trainforge_gpu_power_watts", "GPU power draw (NVML)."),
)

DRIVER = (
    MetricDef(
        "trainforge_restarts",
        "Worker-group failures in this run so far, by reason (oom, node, error); each is followed by a "
        "restart from the last checkpoint until failure.max_failures is spent.",
        (*RUN_LABELS, "reason"),
        "driver",
    ),
    MetricDef(
        "trainforge_run_active",
        "1 while the run trains (also while it waits for workers), 0 once it ended.",
        RUN_LABELS,
        "driver",
    ),
    MetricDef(
        "trainforge_run_last_report_timestamp_seconds",
        "Unix time of the last report that reached the driver (the run's start before the first one).",
        RUN_LABELS,
        "driver",
    ),
    MetricDef(
        "trainforge_run_cost",
        "What the run's workers cost so far (a resumed run's earlier driver sessions included), in "
        "`currency` (the cost section's prices x reserved GPUs/CPUs x wall hours); only with a price set.",
        (*RUN_LABELS, "currency"),
        "driver",
    ),
    MetricDef(
        "trainforge_run_cost_projected",
        "The cost projected to the end of the run at this session's pace, in `currency`; only with a price set.",
        (*RUN_LABELS, "currency"),
        "driver",
    ),
)
RESTART_REASONS = ("oom", "node", "error")

ALL = (*TRAINING, *CHECKPOINT, *GPU, *DRIVER)

# Names that dashboards and rules may reference although a CPU-only trainforge run on a local Ray
# does not export them: each exists only where its source runs. The expression check in
# tests/integration/test_prometheus.py accepts these and nothing else that is missing.
CONDITIONAL_NAMES: dict[str, tuple[str, ...]] = {
    # trainforge's own NVML gauges: only on nodes where NVML finds a GPU.
    "gpu": tuple(m.name for m in GPU),
    # NVIDIA dcgm-exporter (a DaemonSet on Kubernetes GPU nodes, deploy/monitoring/README.md).
    "dcgm": ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_UTIL"),
    # kube-state-metrics (Kubernetes): container restarts and their reasons.
    "kube": ("kube_pod_container_status_last_terminated_reason", "kube_pod_container_status_restarts_total"),
    # Ray creates this counter when its memory monitor kills its first worker on a node.
    "ray_oom": ("ray_memory_manager_worker_eviction_total",),
}


def by_name() -> dict[str, MetricDef]:
    return {m.name: m for m in ALL}
