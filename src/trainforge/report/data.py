"""A run directory read back for the report: its reports, restart markers, events and summary.

The plots (``plots.py``) and the page (``html.py``) draw from one ``RunData``; ``load_run`` reads
only what the driver wrote, so it works for any run directory, finished or not. A report's events
are read by kind (``protocol.event_from_json``): a ``Resumed`` one marks a restart at its step. A
run written before events had kinds (plain strings) loads too: its events show as plain text, and
its resumes, which are not parsed out of their sentences, as events without markers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.errors import TrainforgeError
from trainforge.protocol import EVENTS_KEY, Event, Resumed, WorkerFailure, curve_points, event_from_json
from trainforge.redact import redact_config, redact_text

REPORT_DIR = "report"


class ReportError(TrainforgeError):
    """A run directory cannot be turned into a report."""


@dataclass(frozen=True)
class Marker:
    """A restart on the timelines: a worker failure, or the resume that followed it."""

    step: int
    kind: str  # "failure" or "resume"
    label: str


@dataclass(frozen=True)
class EventRow:
    """One line of the report's event list, at the step where the driver saw it."""

    step: int
    text: str
    kind: str = "event"  # "event", "failure" or "resume"


@dataclass
class RunData:
    """Everything the plots and the page need, read once from the run directory."""

    run_dir: Path
    reports: list[dict[str, Any]] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""
    skipped_lines: int = 0

    @property
    def name(self) -> str:
        run = self.summary.get("config", {}).get("run", {}) if isinstance(self.summary.get("config"), dict) else {}
        return str(run.get("name") or self.run_dir.name)

    def segments(self) -> list[list[dict[str, Any]]]:
        """Reports split at every resume, so that curves restart at the resumed step instead of folding back."""
        parts: list[list[dict[str, Any]]] = [[]]
        for report in self.reports:
            if parts[-1] and is_resume(report):
                parts.append([])
            parts[-1].append(report)
        return [part for part in parts if part]

    def points(self) -> list[dict[str, Any]]:
        """Every report's curve points: one per log interval, then the report's own (``curve_points``)."""
        return [point for report in self.reports for point in curve_points(report)]

    def model_section(self) -> dict[str, Any]:
        """The run's ``model`` config section: the summary's, else config.yaml's ({} without either)."""
        config = self.summary.get("config")
        if not isinstance(config, dict):
            import yaml

            try:
                config = yaml.safe_load(self.config_text) if self.config_text else None
            except yaml.YAMLError:
                config = None
        model = config.get("model") if isinstance(config, dict) else None
        return model if isinstance(model, dict) else {}

    def has(self, key: str) -> bool:
        return any(finite(point.get(key)) is not None for point in self.points())


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number, else None (missing keys, NaN, strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def is_resume(report: dict[str, Any]) -> bool:
    return resumed_of(report) is not None


def events_of(report: dict[str, Any]) -> list[Event]:
    """A report's events by kind; entries that are not events are left out (never raises)."""
    found = report.get(EVENTS_KEY)
    events = (event_from_json(value) for value in found) if isinstance(found, list) else iter(())
    return [event for event in events if event is not None]


def resumed_of(report: dict[str, Any]) -> Resumed | None:
    """The report's ``Resumed`` event: the first report of a worker group after a restore."""
    return next((event for event in events_of(report) if isinstance(event, Resumed)), None)


def step_of(report: dict[str, Any], default: int) -> int:
    step = finite(report.get("step"))
    return int(step) if step is not None else default


def load_run(run_dir: str | Path, summary: dict[str, Any] | None = None) -> RunData:
    """Read a run directory; ``summary`` (from the driver) takes the place of summary.json when given."""
    path = Path(run_dir).expanduser()
    metrics_path, summary_path = path / "metrics.jsonl", path / "summary.json"
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory; pass a run directory (<run.output_dir>/<run.name>)")
    if summary is None and not metrics_path.is_file() and not summary_path.is_file():
        raise ReportError(f"{path} has neither metrics.jsonl nor summary.json; is it a trainforge run directory?")
    data = RunData(run_dir=path)
    if metrics_path.is_file():
        _read_metrics(metrics_path, data)
    if summary is not None:
        data.summary = summary
    elif summary_path.is_file():
        try:
            loaded = json.loads(summary_path.read_text())
        except (OSError, ValueError) as err:
            raise ReportError(f"{summary_path} is not readable JSON ({err})") from None
        data.summary = loaded if isinstance(loaded, dict) else {}
    config_path = path / "config.yaml"
    if config_path.is_file():
        data.config_text = config_text(config_path)
    elif isinstance(data.summary.get("config"), dict):
        import yaml

        data.config_text = yaml.safe_dump(redact_config(data.summary["config"]), sort_keys=False)
    return data


def config_text(path: Path) -> str:
    """The run's config.yaml as the report shows it: masked again, key by key where it parses (a
    run directory written before a masking rule existed, or by someone else, may hold a secret
    under any key), else line by line as text."""
    import yaml

    from trainforge.config.safeyaml import YamlRefused, read_yaml_file

    try:
        tree = read_yaml_file(path, "config.yaml")
    except YamlRefused as err:  # beyond a limit (size, depth, aliases): not shown at all
        return f"# config.yaml not shown: {err}\n"
    except (TrainforgeError, OSError, ValueError):  # not YAML: masked as text
        return redact_text(path.read_text(errors="replace"))
    if not isinstance(tree, dict):
        return redact_text(path.read_text(errors="replace"))
    return str(yaml.safe_dump(redact_config(tree), sort_keys=False))


def _read_metrics(metrics_path: Path, data: RunData) -> None:
    """Reports in file order; worker errors and resumes become markers at the step they happened."""
    step = 0
    for line in metrics_path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a killed driver
            data.skipped_lines += 1
            continue
        if not isinstance(record, dict):
            data.skipped_lines += 1
            continue
        if record.get("event") == "worker_error":
            errors = WorkerFailure.from_json(record).errors
            ranks = ", ".join(str(rank) for rank in errors) or "?"
            data.markers.append(Marker(step, "failure", f"worker failure (rank {ranks})"))
            for rank, message in errors.items():
                data.events.append(EventRow(step, f"worker failure on rank {rank}: {message}", "failure"))
            if not errors:
                data.events.append(EventRow(step, "worker failure", "failure"))
            continue
        if record.get("event") == "hang":  # driver/hangs.py's diagnosis: a marker where it happened
            ranks = ", ".join(str(rank) for rank in record.get("ranks") or []) or "none stuck"
            data.markers.append(Marker(step, "failure", f"hang (rank {ranks})"))
            data.events.append(EventRow(step, str(record.get("text", "hang")), "failure"))
            continue
        if "event" in record:
            # A driver's record says itself in ``text`` where it has one (driver/rerun.py's config_changed).
            said = record["text"] if isinstance(record.get("text"), str) else json.dumps(record)
            data.events.append(EventRow(step, f"{record['event']}: {said}"))
            continue
        step = step_of(record, step)
        for event in events_of(record):
            if isinstance(event, Resumed):
                data.markers.append(Marker(event.step, "resume", f"resumed at step {event.step}"))
                data.events.append(EventRow(event.step, event.text, "resume"))
            else:
                data.events.append(EventRow(step, event.text))
        data.reports.append(record)


def resume_point(report: dict[str, Any]) -> int:
    """The step a report's attempt resumed from; the first report after a restore is one step past it."""
    resumed = resumed_of(report)
    return resumed.step if resumed is not None else max(step_of(report, 1) - 1, 0)
