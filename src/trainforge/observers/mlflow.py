"""MLflow: the observer that records one training job as one MLflow run (the store, the outbox and the
records it sends are tracking/'s; docs/tracking.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.observers.base import Observer, SinkSetup
from trainforge.protocol import PROJECTED_KEY, SO_FAR_KEY, Report, RunInfo, WorkerFailure
from trainforge.tracking.outbox import Leftover, Outbox
from trainforge.tracking.records import (
    clean_tags,
    cluster_tags,
    config_params,
    git_tags,
    metric_points,
    scaling_tags,
    version_tags,
)
from trainforge.tracking.registry import SUMMARY_KEY, ModelRegistration
from trainforge.tracking.runs import (
    RESUME_FILE,
    RunPlan,
    artifact_call,
    end_call,
    open_run,
    params_call,
    tags_call,
)
from trainforge.tracking.store import TrackingError, probe, resolve_uri
from trainforge.worker.profiling import PROFILE_DIR, read_summaries

if TYPE_CHECKING:
    from trainforge.config import Config

LOG_FILE = "tracking.log"  # MLflow's own log lines and HTTP retries of this run
# Run-directory files uploaded at the end (those that exist), then the report folder.
ARTIFACT_FILES = ("config.yaml", "summary.json", "metrics.jsonl", "workers.log", "model.safetensors", "error.log")
REPORT_DIR = "report"


class MlflowTracker(Observer):
    """Observer: params and tags at the start, every report's numbers as metrics, the run
    directory's files as artifacts at the end, all through a background ``Outbox``.

    ``on_report`` only converts a report and appends to a queue, so tracking costs the training
    path nothing: it runs on the driver, which never waits on it until ``on_end``.
    """

    def __init__(
        self, config: Config, run_dir: Path, *, parent_run_id: str | None = None, run_name: str | None = None
    ) -> None:
        self.settings = config.tracking
        self.run_dir = Path(run_dir)
        self.uri = resolve_uri(self.settings.uri, config.run.output_dir)
        self.config = config
        plan = RunPlan(
            uri=self.uri,
            experiment=self.settings.experiment,
            run_name=run_name or config.run.name,
            tags={},
            parent_run_id=parent_run_id or self.settings.parent_run_id,
            resume_file=self.run_dir / RESUME_FILE,
            run_dir=self.run_dir,
        )
        self.outbox = Outbox(
            self.uri,
            lambda client: open_run(client, plan),
            max_points=self.settings.max_buffered_points,
            log_path=self.run_dir / LOG_FILE,
        )
        self.cwd = Path(os.getcwd())
        self.restarts = 0
        self.world_size: int | None = None
        self.leftover: Leftover | None = None
        self.registration: ModelRegistration | None = None

    def on_start(self, info: RunInfo) -> None:
        static = {
            **version_tags(),
            **scaling_tags(self.config.scaling.model_dump()),
            **cluster_info(),
            "trainforge.run_dir": str(self.run_dir),
        }
        cwd = self.cwd
        self.outbox.add_call("params", params_call(config_params(self.config.to_dict())))
        self.outbox.add_call(
            "tags", lambda client, run_id: tags_call(clean_tags({**static, **git_tags(cwd)}))(client, run_id)
        )
        self.outbox.start()

    def on_report(self, report: Report) -> None:
        world = report.world_size
        if world is not None and world != self.world_size:
            self.world_size = world
            self.outbox.add_call("world size tag", tags_call({"trainforge.world_size": str(world)}))
        self.outbox.add_points(metric_points(report))

    def on_worker_error(self, failure: WorkerFailure) -> None:
        self.restarts += 1
        self.outbox.add_call("restarts tag", tags_call({"trainforge.restarts": str(self.restarts)}))

    def on_end(self, summary: dict[str, Any]) -> None:
        step = int(summary.get("global_step", 0))
        self.outbox.add_points(
            metric_points(
                {
                    "step": step,
                    "run/wall_time_s": summary.get("wall_time_s"),
                    "run/restarts": summary.get("restarts"),
                    **end_figures(summary, self.run_dir),
                }
            )
        )
        model_name = self.settings.register_model
        if model_name:  # before the artifacts: its outcome goes into the summary.json they upload
            self.registration = ModelRegistration(model_name, self.config, self.run_dir, summary)
            if self.registration.package():
                self.outbox.add_call(f"model registration {model_name}", self.registration.call)
        for name in ARTIFACT_FILES:
            if (self.run_dir / name).is_file():
                self.outbox.add_call(f"artifact {name}", artifact_call(self.run_dir / name))
        if (self.run_dir / REPORT_DIR).is_dir():
            self.outbox.add_call("report artifacts", artifact_call(self.run_dir / REPORT_DIR, REPORT_DIR))
        if (self.run_dir / PROFILE_DIR).is_dir():
            self.outbox.add_call("profile artifacts", artifact_call(self.run_dir / PROFILE_DIR, PROFILE_DIR))
        self.outbox.add_call(f"final status {summary.get('status')}", end_call(str(summary.get("status"))))
        self._close()

    def on_error(self, error: BaseException) -> None:
        """The run raised instead of reaching ``on_end`` (a user error the workers found): the
        MLflow run ends FAILED rather than showing RUNNING forever."""
        if self.outbox.started and self.leftover is None:
            self.outbox.add_call("final status failed", end_call("failed"))
            self._close()

    def _close(self) -> None:
        what = f"the run in {self.run_dir} (all of it is in that directory)"
        self.leftover = self.outbox.close_and_say(self.settings.flush_timeout_s, what)
        if self.registration is not None:
            self.registration.finish()

    @property
    def registered_model(self) -> dict[str, Any] | None:
        """summary.json's ``registered_model`` (name, version, uri; or why there is no version)."""
        return self.registration.record if self.registration is not None else None

    def summary_entries(self) -> dict[str, Any]:
        """What the tracker added to summary.json: ``registered_model``, with tracking.register_model."""
        record = self.registered_model
        return {SUMMARY_KEY: record} if record is not None else {}

    def check_complete(self) -> None:
        """With ``tracking.required``, a run whose record in MLflow is incomplete ends in an error."""
        missing = self.leftover.describe() if self.leftover else ""
        if self.registration is not None and self.registration.expected and not self.registration.registered:
            missing = (
                missing or f"a version of model {self.registration.name} ({(self.registered_model or {}).get('error')})"
            )
        if self.settings.required and missing:
            raise TrackingError(
                f"training ended ({self.run_dir / 'summary.json'}) but tracking.required is set and MLflow at "
                f"{self.uri} is missing: {missing}"
            )


def end_figures(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The session's whole bill (summary.json's ``cost``) and each profiled rank's communication
    share (``profile/comm_share`` for rank 0, ``profile/rank<R>/comm_share`` for the others)."""
    figures: dict[str, Any] = {}
    cost = summary.get("cost")
    if isinstance(cost, dict):
        figures[SO_FAR_KEY] = cost.get("so_far")
        figures[PROJECTED_KEY] = cost.get("projected_total")
    for profiled in read_summaries(run_dir):
        rank = int(profiled.get("rank", 0))
        figures["profile/comm_share" if rank == 0 else f"profile/rank{rank}/comm_share"] = profiled.get("comm_share")
    return {key: value for key, value in figures.items() if value is not None}


def cluster_info() -> dict[str, str]:
    """Nodes, CPUs, GPUs and accelerator kinds of the Ray cluster this run uses."""
    import ray

    if not ray.is_initialized():
        return {}
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    return cluster_tags(ray.cluster_resources(), alive)


def sink(setup: SinkSetup) -> MlflowTracker | None:
    """The run's MLflow observer, when ``tracking.enabled`` (``make_tracker``)."""
    return make_tracker(setup.config, setup.run_dir)


def make_tracker(
    config: Config, run_dir: Path, *, parent_run_id: str | None = None, run_name: str | None = None
) -> MlflowTracker | None:
    """The run's MLflow observer, or None when ``tracking.enabled`` is false.

    With ``tracking.required`` the store is probed now, so an unreachable one stops the run
    before training starts (TrackingError, exit code 2).
    """
    if not config.tracking.enabled:
        return None
    tracker = MlflowTracker(config, run_dir, parent_run_id=parent_run_id, run_name=run_name)
    if config.tracking.required:
        probe(tracker.uri)
    return tracker
