"""The parent MLflow run of a hyperparameter search; its trials' runs nest under it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.tracking.outbox import Leftover, Outbox
from trainforge.tracking.records import (
    clean_tags,
    config_params,
    metric_points,
    param_value,
    sanitize_key,
    version_tags,
)
from trainforge.tracking.runs import (
    RESUME_FILE,
    RunPlan,
    artifact_call,
    end_call,
    open_run,
    params_call,
    tags_call,
)
from trainforge.tracking.store import probe, resolve_uri

if TYPE_CHECKING:
    from trainforge.config import Config


class SearchRun:
    """One MLflow run per search, fed from the driver through the same fail-soft ``Outbox`` as a
    training run: every method returns at once, an unreachable server is retried and said once.

    A disabled search run (``tracking.enabled: false``) accepts every call and does nothing;
    its ``run_id`` is None.
    """

    def __init__(self, config: Config, name: str) -> None:
        self.settings = config.tracking
        self.name = name
        self.uri = resolve_uri(self.settings.uri, config.run.output_dir)
        self.outbox: Outbox | None = None
        self.leftover: Leftover | None = None

    @classmethod
    def start(
        cls, config: Config, name: str, params: Mapping[str, Any] | None = None, *, log_dir: Path | None = None
    ) -> SearchRun:
        """Open the search's run in ``tracking.experiment``: params are the base config (flattened,
        ``base.`` prefix) plus ``params`` (the space, searcher, scheduler...), as given.

        With ``tracking.required`` an unreachable store raises TrackingError here.
        ``log_dir``: the search's folder: MLflow's own log lines go to its ``tracking.log``, and its
        ``tracking.json`` remembers the run, so a continued search reopens it; default neither.
        """
        search = cls(config, name)
        if not search.settings.enabled:
            return search
        if search.settings.required:
            probe(search.uri)
        plan = RunPlan(
            uri=search.uri,
            experiment=search.settings.experiment,
            run_name=name,
            tags={"trainforge.kind": "search"},
            parent_run_id=search.settings.parent_run_id,
            resume_file=log_dir / RESUME_FILE if log_dir is not None else None,
        )
        search.outbox = Outbox(
            search.uri,
            lambda client: open_run(client, plan),
            max_points=search.settings.max_buffered_points,
            label="search",
            log_path=log_dir / "tracking.log" if log_dir is not None else None,
        )
        base = {f"base.{key}": value for key, value in config_params(config.to_dict()).items()}
        search.outbox.add_call("params", params_call({**base, **_params(params or {})}))
        search.outbox.add_call("tags", tags_call(clean_tags(version_tags())))
        search.outbox.start()
        return search

    @property
    def run_id(self) -> str | None:
        """The parent run's id, for ``make_tracker(parent_run_id=...)``; waits for the store to
        create the run (at most ``tracking.flush_timeout_s``), None when it could not."""
        if self.outbox is None:
            return None
        opened = self.outbox.wait_open(self.settings.flush_timeout_s)
        return opened.run_id if opened else None

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Numeric values of ``metrics`` at ``step`` (e.g. the best value so far per finished trial)."""
        if self.outbox is not None:
            self.outbox.add_points(metric_points({**metrics, "step": step}))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.outbox is not None:
            self.outbox.add_call("params", params_call(_params(params)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.outbox is not None:
            self.outbox.add_call("tags", tags_call(clean_tags({k: str(v) for k, v in tags.items()})))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file, or a directory's content, uploaded as it is when the background thread gets to it."""
        if self.outbox is not None:
            self.outbox.add_call(f"artifact {Path(path).name}", artifact_call(Path(path), artifact_path))

    def end(self, status: str = "finished") -> Leftover | None:
        """Set the final status (``finished``, ``failed``, ``stopped``), wait at most
        ``tracking.flush_timeout_s`` for everything queued; what could not be logged (None if disabled)."""
        if self.outbox is None:
            return None
        self.outbox.add_call(f"final status {status}", end_call(status))
        self.leftover = self.outbox.close_and_say(self.settings.flush_timeout_s, f"search {self.name}")
        return self.leftover


def _params(params: Mapping[str, Any]) -> dict[str, str]:
    return {sanitize_key(str(key)): param_value(value) for key, value in params.items()}
