"""TensorBoard: a run's metrics and hyperparameters as event files under ``<run dir>/tensorboard/``
(``tracking.tensorboard: true``; docs/tracking.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.observers.base import Observer, SinkSetup
from trainforge.protocol import COORDINATES, Report, Resumed, RunInfo, curve_points
from trainforge.redact import redact_config
from trainforge.tracking.records import flatten

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from trainforge.config import Config

TENSORBOARD_DIR = "tensorboard"


class TensorBoardWriter(Observer):
    """Every number of every report as a scalar by step, under metrics.jsonl's key (``train/loss``,
    ``val/accuracy``, ``perf/samples_per_s``, ...): each log interval and validation pass from the
    report's history at its own step, the report's other figures at its step. The config's
    flattened scalar values go to the hparams plugin once per driver session.

    A report with a ``Resumed`` event (a worker group restored from a checkpoint, or a new driver
    session of the run) starts a new event file that purges the steps after that checkpoint, which
    the run does again: each step shows once, as the run's final timeline has it.
    """

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.config = config
        self.logdir = Path(run_dir) / TENSORBOARD_DIR
        self.writer: SummaryWriter | None = None

    def on_start(self, info: RunInfo) -> None:
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        self.writer = self._open()
        events = self.writer.file_writer  # the event file the constructor opened
        if events is not None:
            events.add_summary(hparams_pb(hyperparameters(self.config.to_dict()), self.config.run.name))
        self.writer.flush()

    def on_report(self, report: Report) -> None:
        if self.writer is None:
            return
        resumed = [event.step for event in report.events if isinstance(event, Resumed)]
        if resumed:
            self.writer.close()
            self.writer = self._open(purge_step=resumed[-1] + 1)
        for point in curve_points(report):
            step, walltime = int(point["step"]), point.get("time/unix", report.time)
            for key, value in point.items():
                if key not in COORDINATES and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, global_step=step, walltime=walltime)
        self.writer.flush()  # reports come seconds apart (train.report_min_interval_s): a live view keeps up

    def on_end(self, summary: dict[str, Any]) -> None:
        self._close()

    def on_error(self, error: BaseException) -> None:
        self._close()

    def _open(self, purge_step: int | None = None) -> SummaryWriter:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step)

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def hyperparameters(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """The config's flattened scalar values (``optim.lr``, ``scaling.num_workers``, ...), credentials
    masked; lists and unset keys (None) are left out, the hparams plugin takes scalars only."""
    return {key: value for key, value in flatten(redact_config(config)) if isinstance(value, (bool, int, float, str))}


def sink(setup: SinkSetup) -> TensorBoardWriter | None:
    """The run's TensorBoard observer, when ``tracking.tensorboard``."""
    return TensorBoardWriter(setup.config, setup.run_dir) if setup.config.tracking.tensorboard else None
