"""What crosses between the workers and the driver, as types: the payload the workers receive, their
reports and the events in them, a user's error, and what the controller and the workers' log
shipping put into the driver's mailbox. Nothing on either side parses a sentence back: an event
is a type with fields, and its ``text`` is only for people (console, workers.log, the report page).

Pure Python (an import contract keeps torch, Ray and the rest of trainforge out), so that the
worker that builds these, the Ray Train controller that forwards them and the driver-side readers
of metrics.jsonl share one definition.

A report's ``history``: one point per ``train.log_every_n_steps`` interval. Each
``ray.train.report`` is a barrier across ranks served by the Ray Train controller, so reports are
stretched to ``train.report_min_interval_s`` apart; a curve with one point per report would have
a handful of points. A report therefore carries the log intervals it spans; in metrics.jsonl::

    {"step": 60, "train/loss": 0.41, ..., "history": [
        {"step": 40, "time/unix": ..., "train/loss": 0.45, "train/lr": ..., "perf/samples_per_s": ...},
        {"step": 50, ...}, {"step": 60, ...}],
     "events": [{"kind": "resumed", "step": 40, "path": "...", ..., "text": "resumed from ... at step 40"}]}

in step order, the last at the report's own step, together with a point per validation pass
since the previous report (``val/*`` at the step it ran). The report's top-level figures stay the
aggregate over its whole span (what summary.json's ``final_metrics`` holds).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeGuard, Union, get_args, get_origin, get_type_hints

from trainforge.errors import TrainforgeError, error_for, kind_of

if TYPE_CHECKING:
    from trainforge.config import Config
    from trainforge.data.stream import StreamShape

# Ray Train passes dicts: its ``train_loop_config`` and what a worker hands ``ray.train.report``
# (whose values may be any picklable object). Each holds one of ours under this key: the Payload,
# which the workers' entry point takes out, and the Report, which the controller callback takes out.
PAYLOAD_KEY = REPORT_KEY = "trainforge"
HISTORY_KEY = "history"
EVENTS_KEY = "events"
PARAMETERS_KEY = "parameters"
# The report keys the driver adds to every report when a price is set (driver/cost.py), for the
# progress line, MLflow, metrics.jsonl and Prometheus.
SO_FAR_KEY = "cost/so_far"
PROJECTED_KEY = "cost/projected_total"
CURRENCY_KEY = "cost/currency"
# Keys that place a point rather than measure something.
COORDINATES = frozenset({"step", "time/unix"})

Level = Literal["info", "warning", "error"]


# --- events: what happened, said once by the worker that saw it -------------------------------


@dataclass(frozen=True)
class Resumed:
    """The run continues from a checkpoint; ``resharded_from`` is the writer's layout (``fsdp x tp2``)
    when it differs from this run's (``layout``)."""

    step: int
    path: str
    resharded_from: str | None = None
    layout: str | None = None
    kind: ClassVar[str] = "resumed"
    level: ClassVar[Level] = "info"

    @property
    def text(self) -> str:
        said = f"resumed from {self.path} at step {self.step}"
        if self.resharded_from is not None:
            said += f"; resharded: the checkpoint was written by {self.resharded_from}, this run uses {self.layout}"
        return said


@dataclass(frozen=True)
class CheckpointSkipped:
    """Restore passed over a checkpoint (``name``, newest first) that does not verify or load."""

    name: str
    reason: str
    kind: ClassVar[str] = "checkpoint_skipped"
    level: ClassVar[Level] = "warning"

    @property
    def text(self) -> str:
        return f"skipped checkpoint {self.name}: {self.reason}"


@dataclass(frozen=True)
class SaveFailed:
    """A checkpoint save did not commit (``final``: the run's last save)."""

    step: int
    error: str
    final: bool = False
    kind: ClassVar[str] = "save_failed"
    level: ClassVar[Level] = "error"

    @property
    def text(self) -> str:
        return f"{'final ' if self.final else ''}checkpoint save at step {self.step} failed: {self.error}"


@dataclass(frozen=True)
class Stopping:
    """Every rank checkpoints and returns: the driver asked for a stop, or the cluster gave notice."""

    reason: str
    kind: ClassVar[str] = "stopping"
    level: ClassVar[Level] = "warning"

    @property
    def text(self) -> str:
        return f"stopping: {self.reason}"


@dataclass(frozen=True)
class EndedEarly:
    """The run ends before its budget, as a finished run: a callback asked (``source: callback``) or
    ``train.early_stopping`` ran out of patience (``source: early_stopping``), after ``step``."""

    step: int
    reason: str
    source: Literal["callback", "early_stopping"]
    kind: ClassVar[str] = "ended_early"
    level: ClassVar[Level] = "info"

    @property
    def text(self) -> str:
        return f"ended at step {self.step}: {self.reason}"


@dataclass(frozen=True)
class BestValidation:
    """``train.early_stopping``'s record at the end of a run: the best value of ``metric`` and the step
    of the pass (and, with ``restore_best``, of the checkpoint) that gave it; ``stopped``: whether
    patience ran out."""

    metric: str
    best: float | None
    best_step: int | None
    stopped: bool
    kind: ClassVar[str] = "best_validation"
    level: ClassVar[Level] = "info"

    @property
    def text(self) -> str:
        if self.best is None or self.best_step is None:
            return f"early stopping: no finite {self.metric} yet"
        return f"early stopping: best {self.metric} {self.best:.6g} at step {self.best_step}"


@dataclass(frozen=True)
class Anomaly:
    """``train.anomaly`` (worker/anomaly.py): step ``step`` had a non-finite loss or gradient, or a
    loss spike; re-run from the same state and batch, it gave the same verdict (``data``: the
    batch is at fault) or not (``not_data``: the hardware or a race). ``samples``: the global
    batch's sample indices (every rank's, in rank order). The step was skipped, or the run rolled
    back to ``checkpoint``, past the samples up to this batch, with the LR now ``lr``. Losses are
    the mean over ranks; None where not finite."""

    step: int
    anomaly: Literal["nonfinite", "spike"]
    attribution: Literal["data", "not_data"]
    action: Literal["skipped", "rolled_back"]
    loss: float | None
    rerun_loss: float | None
    grad_norm: float | None
    samples: tuple[int, ...] = ()
    checkpoint: str | None = None
    lr: float | None = None
    kind: ClassVar[str] = "anomaly"
    level: ClassVar[Level] = "warning"

    @property
    def text(self) -> str:
        what = "a non-finite loss or gradient" if self.anomaly == "nonfinite" else f"a loss spike ({_num(self.loss)})"
        cause = "the data (the re-run agreed)" if self.attribution == "data" else "not the data (the re-run differed)"
        done = "skipped" if self.action == "skipped" else f"rolled back to {self.checkpoint}, LR now {_num(self.lr)}"
        return f"step {self.step}: {what}, attributed to {cause}; {done} ({len(self.samples)} samples)"


def _num(value: float | None) -> str:
    """A number of an event's text; an event read back from metrics.jsonl may lack it."""
    return "?" if value is None else f"{value:.6g}"


@dataclass(frozen=True)
class Straggler:
    """``failure.straggler`` (worker/straggler.py): rank ``rank`` (process ``pid``) on ``node``
    (Ray's ``node_id``) spent ``score`` times the other ranks' median own time per step (data wait
    and forward; ``own_s`` seconds a step) above ``threshold`` for ``steps`` consecutive steps; then
    ``action``: what was done, which is ``report`` where ``exclude`` could not be (a ``Note`` says why)."""

    step: int
    rank: int
    node: str
    score: float
    own_s: float
    steps: int
    threshold: float
    action: Literal["report", "restart", "exclude"]
    pid: int | None = None
    node_id: str | None = None
    kind: ClassVar[str] = "straggler"
    level: ClassVar[Level] = "warning"

    @property
    def text(self) -> str:
        then = {
            "report": "",
            "restart": "; restarting the worker group",
            "exclude": f"; checkpointing, then excluding its node (Ray node {self.node_id}) from the run",
        }
        return (
            f"step {self.step}: rank {self.rank} (node {self.node}, pid {self.pid}) is a straggler: "
            f"{_num(self.score)}x the other "
            f"ranks' time per step (data wait and forward, {_num(self.own_s)} s) for {self.steps} steps "
            f"(threshold {_num(self.threshold)}){then.get(self.action, '')}"
        )


@dataclass(frozen=True)
class Note:
    """Anything else the run says about itself (optimizer not restored, the batch size chosen, an
    out-of-memory retry, ...), and every event of a run written before events had kinds."""

    text: str
    level: Level = "info"
    kind: ClassVar[str] = "note"


Event = Resumed | CheckpointSkipped | SaveFailed | Stopping | EndedEarly | BestValidation | Anomaly | Straggler | Note
EVENT_TYPES: dict[str, Any] = {
    cls.kind: cls
    for cls in (Resumed, CheckpointSkipped, SaveFailed, Stopping, EndedEarly, BestValidation, Anomaly, Straggler, Note)
}


def event_to_json(event: Event) -> dict[str, Any]:
    """``{"kind": ..., fields..., "text": ...}``: the text for people, the fields for programs."""
    return {"kind": event.kind, **asdict(event), "text": event.text}


def event_from_json(value: Any) -> Event | None:
    """An event read back from metrics.jsonl, which is not trusted: never raises. A string (a run
    written before events had kinds) is a Note with that text, unread; an entry of unknown kind or
    with fields of the wrong type is a Note with its ``text`` if it has one, else None (skipped)."""
    if isinstance(value, str):
        return Note(value)
    if not isinstance(value, Mapping):
        return None
    cls = EVENT_TYPES.get(value.get("kind"))  # type: ignore[arg-type]
    if cls is not None:
        hints = get_type_hints(cls)
        values = {f.name: _tupled(value[f.name]) for f in fields(cls) if f.name in value}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if required <= values.keys() and all(_fits(values[name], hints[name]) for name in values):
            return cls(**values)
    text = value.get("text")
    return Note(text) if isinstance(text, str) else None


def _tupled(value: Any) -> Any:
    """A JSON list as the tuple a frozen event holds."""
    return tuple(value) if isinstance(value, list) else value


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type of a field (int, float, str, bool, Optional, Literal,
    ``tuple[X, ...]``)."""
    if get_origin(hint) is Literal:
        return value in get_args(hint)
    if get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(_fits(item, get_args(hint)[0]) for item in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if get_origin(hint) in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


# --- reports --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterCounts:
    """How many parameter elements the model trains and how many ``model.freeze`` holds fixed
    (summary.json's ``parameters``)."""

    trainable: int
    frozen: int = 0

    def to_json(self) -> dict[str, int]:
        return {"trainable": self.trainable, "frozen": self.frozen}

    @classmethod
    def from_json(cls, value: Any) -> ParameterCounts | None:
        """Read back from metrics.jsonl (not trusted: never raises); None unless both are counts."""
        if not isinstance(value, Mapping):
            return None
        trainable, frozen = value.get("trainable"), value.get("frozen")
        if not (_is_count(trainable) and _is_count(frozen)):
            return None
        return cls(trainable=trainable, frozen=frozen)


@dataclass(frozen=True)
class Report:
    """One report of the workers (rank 0's figures, all-reduced, so the same on every rank), and
    the last one, with ``status``, that rank 0 returns.

    ``figures``: the flat numbers by name (``train/loss``, ``perf/...``, ``val/...``,
    ``checkpoint/stall_s``, per-node ``system/<node>/...``, the driver's ``cost/...``); a worker
    hook may add to them before the report is sent. ``history``: one point per log interval and
    validation pass. ``to_json`` gives metrics.jsonl's line (the keys MLflow and the tools read).
    """

    step: int
    epoch: int | None = None
    samples_seen: int | None = None
    total_steps: int | None = None
    world_size: int | None = None
    time: float | None = None  # unix time of the report ("time/unix")
    figures: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    events: tuple[Event, ...] = ()
    checkpoint: str | None = None  # the newest committed checkpoint ("checkpoint/path")
    status: str | None = None  # the final report's: finished or stopped
    final_save_error: str | None = None  # why the run's last save failed
    currency: str | None = None  # the driver's cost figures' ("cost/currency")
    parameters: ParameterCounts | None = None  # the model's trainable and frozen parameters

    def scalars(self) -> dict[str, float]:
        """Every number of the report's own (not its history's), by metrics.jsonl's key."""
        numbers: dict[str, float] = {"step": self.step}
        for key, value in self._coordinates():
            if value is not None:
                numbers[key] = value
        numbers.update(self.figures)
        return numbers

    def value(self, name: str) -> float | None:
        """One number by its key (``val/loss``, ``step``, ...); None when the report lacks it."""
        return self.scalars().get(name)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = dict(self.scalars())
        record[HISTORY_KEY] = [dict(point) for point in self.history]
        for key, text in (
            ("checkpoint/path", self.checkpoint),
            ("checkpoint/final_save_error", self.final_save_error),
            (CURRENCY_KEY, self.currency),
        ):
            if text is not None:
                record[key] = text
        if self.events:
            record[EVENTS_KEY] = [event_to_json(event) for event in self.events]
        if self.status is not None:
            record["status"] = self.status
        if self.parameters is not None:
            record[PARAMETERS_KEY] = self.parameters.to_json()
        return record

    @classmethod
    def from_json(cls, record: Any) -> Report | None:
        """A line of metrics.jsonl read back (not trusted: never raises); None when it is not a
        report (no numeric ``step``). Keys of other types than their own are left out."""
        if not isinstance(record, Mapping) or not _is_number(record.get("step")):
            return None
        own = {"step", HISTORY_KEY, EVENTS_KEY, "checkpoint/path", "checkpoint/final_save_error", "status"}
        own |= {CURRENCY_KEY, PARAMETERS_KEY, *(key for key, _ in _COORDINATE_KEYS)}
        history = record.get(HISTORY_KEY)
        events = record.get(EVENTS_KEY)
        found = (event_from_json(event) for event in events) if isinstance(events, list) else iter(())
        return cls(
            step=int(record["step"]),
            **{name: _int_or_none(record.get(key)) for key, name in _COORDINATE_KEYS if name != "time"},
            time=float(record["time/unix"]) if _is_number(record.get("time/unix")) else None,
            figures={k: v for k, v in record.items() if k not in own and _is_number(v) and isinstance(k, str)},
            history=[_point(p) for p in history if _is_point(p)] if isinstance(history, list) else [],
            events=tuple(event for event in found if event is not None),
            checkpoint=_str_or_none(record.get("checkpoint/path")),
            status=_str_or_none(record.get("status")),
            final_save_error=_str_or_none(record.get("checkpoint/final_save_error")),
            currency=_str_or_none(record.get(CURRENCY_KEY)),
            parameters=ParameterCounts.from_json(record.get(PARAMETERS_KEY)),
        )

    def _coordinates(self) -> list[tuple[str, float | None]]:
        return [(key, getattr(self, name)) for key, name in _COORDINATE_KEYS]


# metrics.jsonl's key -> Report's field, for the numbers that place a report
_COORDINATE_KEYS = (
    ("epoch", "epoch"),
    ("samples_seen", "samples_seen"),
    ("total_steps", "total_steps"),
    ("world_size", "world_size"),
    ("time/unix", "time"),
)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int_or_none(value: Any) -> int | None:
    return int(value) if _is_number(value) and math.isfinite(value) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _is_point(point: Any) -> bool:
    return isinstance(point, Mapping) and _is_step(point.get("step"))


def _point(point: Mapping[str, Any]) -> dict[str, float]:
    return {key: value for key, value in point.items() if isinstance(key, str) and _is_number(value)}


# --- the rest of what crosses ----------------------------------------------------------------


@dataclass(frozen=True)
class PassedObjects:
    """The model and data given to ``trainforge.fit(model=..., data=...)``, each pickled once by
    the driver (models/passed.py), with the names messages call them by (``Net``, ``make_net()``)."""

    model: bytes | None = None
    data: bytes | None = None
    model_name: str = ""
    data_name: str = ""


@dataclass(frozen=True)
class Payload:
    """What every worker receives (Ray Train's ``train_loop_config``): the resolved config, the
    driver's mailbox (the stop flag, log lines; None in tests), a streamed source's shape and the
    objects fit was given."""

    config: Config
    mailbox: Any = None
    stream: StreamShape | None = None
    passed: PassedObjects | None = None


@dataclass(frozen=True)
class UserError:
    """What a worker returns instead of raising for a user's mistake (bad data path, factory,
    checkpoint): Ray spends its retries on crashes, not on these. The driver raises ``error()``."""

    kind: str  # a TrainforgeError class's name (errors.ERROR_KINDS)
    message: str

    @classmethod
    def of(cls, err: TrainforgeError) -> UserError:
        return cls(kind_of(err), str(err))

    def error(self) -> TrainforgeError:
        return error_for(self.kind, self.message)


@dataclass(frozen=True)
class RunInfo:
    """What observers learn when the run starts."""

    name: str
    workers: int | tuple[int, int]
    cluster: str
    run_dir: str


@dataclass(frozen=True)
class WorkerFailure:
    """A worker group failed: each failed rank's first error line, and when the controller saw it
    (unix time; None when a record read back does not say)."""

    errors: dict[int, str]
    time: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "worker_error",
            "errors": {str(rank): text for rank, text in self.errors.items()},
            "time": self.time,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> WorkerFailure:
        """A ``worker_error`` line of metrics.jsonl (never raises)."""
        found = record.get("errors")
        errors = found if isinstance(found, Mapping) else {}
        at = record.get("time")
        return cls(
            {int(rank): str(text) for rank, text in errors.items() if str(rank).isdigit()},
            float(at) if _is_number(at) else None,
        )


@dataclass(frozen=True)
class StartupMarks:
    """When phases of a run's start ended (unix times by phase name, driver/startup.py's): sent by
    the controller (its phases) and by rank 0 after its first step (the worker's)."""

    marks: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class WorkerIdentity:
    """Where a rank runs, sent by each worker as it starts (a restarted group's anew): what the
    driver names a hung rank by, and where it finds the process to look at and to kill."""

    rank: int
    pid: int
    thread_id: int  # the training thread's native id (py-spy names threads by it)
    node_id: str
    node_ip: str
    hostname: str


@dataclass(frozen=True)
class HangSuspected:
    """A rank's watchdog (worker/watchdog.py): the work in progress has run far longer than the
    run's own steps. ``waiting``: the rank is inside a collective (or DDP's backward, where it waits
    for its peers' gradients), so it arrived and waits for others; ``stack``: its training thread,
    outermost frame first (``func (file:line)``)."""

    rank: int
    step: int  # the step in progress (the last completed one + 1)
    phase: str  # step, checkpoint, validation
    waited_s: float
    bound_s: float
    waiting: bool
    stack: tuple[str, ...]
    time: float


@dataclass(frozen=True)
class ValidationStarted:
    """Rank 0 begins a validation pass after ``step``: sent to the driver's mailbox as it starts
    (its result comes with the next report), so that a long pass is not silence."""

    step: int


@dataclass(frozen=True)
class LogLine:
    """One worker log line, tagged with rank and node (worker/logs.py); ``level`` is logging's."""

    level: int
    text: str


@dataclass(frozen=True)
class LogBatch:
    """Log lines a worker ships to the driver's mailbox at once."""

    lines: tuple[LogLine, ...]


# --- a report as curve points ----------------------------------------------------------------


def curve_points(report: Report | Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report as points for curves, in step order: its history points, then the report itself
    without the keys that its history already covers (validation, checkpoint and run figures stay,
    at the report's step). A report without history is one point: itself.

    Reports read back from metrics.jsonl (mappings) are not trusted: history entries that are not
    mappings with a numeric ``step`` are left out.
    """
    if isinstance(report, Report):
        history: Any = report.history
        own: dict[str, Any] = report.scalars()
    else:
        history = report.get(HISTORY_KEY)
        own = {key: value for key, value in report.items() if key != HISTORY_KEY}
    if not isinstance(history, list):
        return [own]
    points = [dict(point) for point in history if _is_point(point)]
    covered = {key for point in points for key in point} - COORDINATES
    return [*points, {key: value for key, value in own.items() if key not in covered}]


def merge_points(*series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several series of points (log intervals, validation passes) as one list in step order;
    points at the same step become one."""
    by_step: dict[Any, dict[str, Any]] = {}
    for points in series:
        for point in points:
            by_step.setdefault(point["step"], {}).update(point)
    return [by_step[step] for step in sorted(by_step)]


def _is_step(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


# --- what the driver makes of one report barrier ----------------------------------------------


PER_NODE_PREFIX = "system/"


def merge_reports(reports: list[Any]) -> Report | None:
    """Rank 0's report (every rank reports the same all-reduced figures) plus the per-node
    ``system/<node>/...`` samples that each node's first worker adds to its own report; None when
    rank 0's is not a Report (a worker of another version)."""
    if not reports or not isinstance(reports[0], Report):
        return None
    first = reports[0]
    samples = {
        key: value
        for other in reports[1:]
        if isinstance(other, Report)
        for key, value in other.figures.items()
        if key.startswith(PER_NODE_PREFIX)
    }
    return replace(first, figures={**first.figures, **samples}) if samples else first
