"""The function every Ray Train worker runs: build -> restore -> steps -> report -> close.

Workers talk to the driver only through ``ray.train.report`` (and read one stop flag), in the
types of ``trainforge.protocol``: a ``Report`` per report, a final ``Report`` or a ``UserError`` as
the return value. Every report is a barrier across ranks, so every decision that changes the
sequence of collectives (report now, save now, stop) is taken from numbers that are identical on
all ranks: the step count, or the control ``Signals`` that came out of the report's own all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import ray
import ray.train

from trainforge.checkpoint.names import checkpoint_name
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import Config
from trainforge.errors import TrainforgeError, TrainingFailed
from trainforge.models import passed
from trainforge.protocol import (
    PAYLOAD_KEY,
    REPORT_KEY,
    BestValidation,
    CheckpointSkipped,
    EndedEarly,
    Event,
    Note,
    Payload,
    Report,
    Resumed,
    SaveFailed,
    StartupMarks,
    Stopping,
    UserError,
    ValidationStarted,
    merge_points,
)
from trainforge.redact import MASK, is_secret_key, remember_secrets
from trainforge.worker import collectives
from trainforge.worker.anomaly import AnomalyGuard, AnomalyLimit, Finding, batch_samples
from trainforge.worker.autobatch import choose_batch, shrink_after_oom
from trainforge.worker.build import WorkerRun, build, evaluate
from trainforge.worker.callbacks import CallbackFailed, Callbacks, step_metrics
from trainforge.worker.early_stopping import EarlyStopping, MetricMissing
from trainforge.worker.fresh import Baseline, reset
from trainforge.worker.hooks import Hooks, build_hooks
from trainforge.worker.logs import shipped_logs
from trainforge.worker.metrics import IntervalHistory, Signals, Throughput, reduce_metrics
from trainforge.worker.preemption import for_worker as notice_watcher_for
from trainforge.worker.profiling import StepProfiler
from trainforge.worker.rejoin import Rendezvous, lost_peer, run_rejoining
from trainforge.worker.rollback import roll_back
from trainforge.worker.saving import Checkpointing, Restored, restore, run_store
from trainforge.worker.step import MetricSums, StepOutOfMemory
from trainforge.worker.straggler import StragglerWatch
from trainforge.worker.user_code import is_user_code_error, user_code_error
from trainforge.worker.watchdog import for_session as watchdog_for

log = logging.getLogger("trainforge.worker")


def train_loop_per_worker(train_loop_config: dict[str, Payload]) -> Report | UserError:
    """Ray Train entry point; rank 0's return value (the final report, or a user's error) reaches the driver."""
    entered = time.time()
    payload = train_loop_config[PAYLOAD_KEY]
    rank = ray.train.get_context().get_world_rank()
    with shipped_logs(payload.mailbox, rank, ray.util.get_node_ip_address()):
        # Rank 0 times its part of the run's start (driver/startup.py), sent after its first step.
        rendezvous = Rendezvous.from_env()
        if rendezvous is None:  # failure.replace: group (Ray Train formed the process group)
            return run_worker(payload, {"train_fn": entered} if rank == 0 else None)
        # failure.replace: worker: this process outlives a lost peer (worker/rejoin.py).
        baseline = Baseline.capture()
        return run_rejoining(
            rendezvous,
            rank,
            lambda generation: run_worker(payload, {"train_fn": entered} if rank == 0 and not generation else None),
            payload.config.failure.max_failures,
            lambda: rejoin_reset(baseline),
        )


def rejoin_reset(baseline: Baseline) -> str | None:
    """A survivor's process put back as before its first run; why it cannot be vouched for, if so."""
    reset(baseline)
    return baseline.problem()


def run_worker(
    payload: Payload,
    startup: dict[str, float] | None = None,
    *,
    ranks: tuple[int, int] | None = None,
    channel: Channel | None = None,
) -> Report | UserError:
    """One worker's run. Under Ray Train by default; a warm worker group (worker/warm.py) passes
    its own ``ranks`` (rank, world) and report ``channel``, and the store comes from the config."""
    config = payload.config
    remember_secrets(config.to_dict())  # masked in this worker's errors and logs too (redact.py)
    passed.install(payload.passed)  # fit's model/data objects, which the config's factories read
    try:
        stream = payload.stream.to_dict() if payload.stream is not None else None
        run = build(config, ranks, stream=stream, marks=startup)
        log_environment(config, run.rank)
        store = run_store() if ranks is None else CheckpointStore.for_run(config.storage_path, config.run.name)
        checkpointing = Checkpointing(run, store)
        restored = restore(run, checkpointing.store)
        # What restore walked past (corrupt, or not this run's model) is not the run's to rotate.
        checkpointing.writer.passed_over.update(name for name, _ in restored.skipped)
        if startup is not None:
            startup["restore"] = time.time()
        batch_choice = choose_batch(run)  # train.batch_size: auto (a resume keeps the checkpoint's split)
    except TrainforgeError as err:
        # Every rank fails the same way on a bad data path, model or checkpoint; returning (instead
        # of raising) spares Ray's retries, which are meant for crashes. The driver re-raises it.
        return UserError.of(err)
    except Exception as err:
        if not is_user_code_error(err):
            raise
        return UserError.of(user_code_error(err, "while building the run"))
    hooks = build_hooks(run)
    session: Session | None = None
    try:
        events: list[Event] = [Note(batch_choice)] if batch_choice else []
        session = Session(run, checkpointing, restored, payload.mailbox, hooks, events=events, startup=startup)
        if channel is not None:
            session.channel = channel
        return session.train()
    except (SaveFailedStop, AnomalyLimit) as err:  # every rank at the same step: a retry would stop there again
        return UserError.of(TrainingFailed(str(err)))
    except CallbackFailed as err:
        if err.retry:  # after steps: a crash, which Ray Train restarts from the newest checkpoint
            raise
        return UserError.of(err.error)
    except MetricMissing as err:  # every rank at the same pass: a retry would stop there again
        return UserError.of(err)
    except TrainforgeError as err:
        if session is None or not session.before_first_step:
            raise
        return UserError.of(err)
    except Exception as err:
        # At the first step of a fresh run, an exception of the user's code (the model's forward,
        # the data) is one every attempt would raise; after steps, or on a resume, Ray restarts.
        if session is None or not session.before_first_step or not is_user_code_error(err) or lost_peer(err):
            raise
        return UserError.of(user_code_error(err, "at the first step"))
    finally:
        checkpointing.close()
        hooks.close()


class Channel(Protocol):
    """How a Session reaches the driver. Tests run a Session in one process (one rank, or ranks of
    a gloo group without Ray) through a channel of their own."""

    def report(self, report: Report) -> None: ...

    def preempted(self) -> bool: ...


class RayChannel:
    """Ray Train's report barrier and preemption notice."""

    def report(self, report: Report) -> None:
        ray.train.report({REPORT_KEY: report})

    def preempted(self) -> bool:
        return ray.train.get_preemption_info() is not None


class SaveFailedStop(Exception):
    """Raised on every rank at the same report when a save failed and on_save_error is fail."""


@dataclass
class Control:
    """Decisions taken at a report, the same on every rank."""

    save: bool = False
    stop: bool = False
    failed: str | None = None


@dataclass
class Session:
    """One worker's pass through training, from the restored position to the end (or a stop)."""

    run: WorkerRun
    checkpointing: Checkpointing
    restored: Restored
    control: Any = None  # the driver's mailbox (its stop flag); None without a driver
    hooks: Hooks = field(default_factory=lambda: Hooks([]))
    channel: Channel = field(default_factory=RayChannel)
    sums: MetricSums = field(init=False)
    history: IntervalHistory = field(init=False)
    meter: Throughput = field(init=False)
    events: list[Event] = field(default_factory=list)  # rank 0's, for its next report
    val_metrics: dict[str, float] = field(default_factory=dict)
    val_points: list[dict[str, float]] = field(default_factory=list)  # every pass since the last report
    last_pass: tuple[int, dict[str, float]] | None = None  # the newest validation: its step and metrics
    save_failures: int = 0
    oom_retries: int = 0  # steps retried with smaller micro-batches after running out of memory
    last_checkpoint: str | None = None
    startup: dict[str, float] | None = None  # rank 0's start-up marks, sent to the driver after the first step

    def __post_init__(self) -> None:
        cfg = self.run.config
        self.per_step = self.run.data.samples_per_step  # this rank's share of the global batch
        self.sums = MetricSums(self.run.device)
        self.history = IntervalHistory()
        self.meter = Throughput(self.per_step * self.run.data_world)
        self.progress = self.restored.progress
        self.first_step = self.progress.global_step
        self.profiler = StepProfiler.for_run(self.run, self.checkpointing.store)  # off without `profile`
        # Right after a restore, report after the first step: the driver times recovery from it.
        stride = 1 if self.restored.source else cfg.train.log_every_n_steps
        self.next_report = self.first_step + stride
        self.last_checkpoint = self.restored.source
        self.started = self.last_report = self.last_save = time.perf_counter()
        self.reports = 0
        self.stop_probe: Any = None  # the stop flag's pending read: asked at one report, read at a later one
        self.failed_message = ""
        self.events.extend(restore_events(self.restored, self.run))
        # The user's callbacks and train.early_stopping (worker/callbacks.py, worker/early_stopping.py).
        self.callbacks = cast(Callbacks | None, self.run.components.get(Callbacks.name))
        self.early = cast(EarlyStopping | None, self.run.components.get(EarlyStopping.name))
        self.ended = ended_by_state(self.callbacks, self.early)  # a run restored after its stop ends at once
        self.committed: list[str] = []  # rank 0: checkpoints committed since the callbacks last heard
        self.validated_step: int | None = None
        self.best_due: dict[str, float] | None = None  # restore_best: the metrics of a pass to checkpoint
        self.watchdog = watchdog_for(cfg, self.run.rank, self.control)  # hangs named to the driver (worker/watchdog.py)
        self.stragglers = StragglerWatch(  # worker/straggler.py
            cfg.failure.straggler, self.run.world, min_workers=cfg.scaling.min_workers
        )
        self.preemption_saved = False  # the checkpoint a preemption notice asks for, taken once
        if self.early is not None and self.early.cfg.restore_best and self.early.best_step is not None:
            self.checkpointing.writer.keep = {checkpoint_name(self.early.best_step)}

    @property
    def before_first_step(self) -> bool:
        """A fresh run (nothing restored) that has not completed a step yet."""
        return self.restored.source is None and self.progress.global_step == self.first_step

    def train(self) -> Report:
        # The node's preemption notices (worker/preemption.py), under Ray Train.
        notices = notice_watcher_for(self.run.config) if isinstance(self.channel, RayChannel) else None
        if notices is not None:
            notices.start()
        if self.watchdog is not None:
            self.watchdog.start(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        try:
            return self.train_steps()
        finally:
            for watcher in (self.watchdog, notices):
                if watcher is not None:
                    watcher.stop()

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Work that is not a step, for the watchdog (bounded by failure.collective_timeout_s)."""
        return self.watchdog.phase(name) if self.watchdog is not None else contextlib.nullcontext()

    def train_steps(self) -> Report:
        run, progress = self.run, self.progress
        self.profiler.at_step(progress.global_step)
        if self.callbacks is not None:
            self.callbacks.fire("on_train_start", progress.global_step)
        stopped = self.agreed_stop()
        while progress.global_step < run.total_steps and not stopped:
            stopped = self.epoch()
        # A stop a callback or early stopping asked for is the run's end, not an interruption.
        return self.finish("stopped" if stopped and self.ended is None else "finished")

    def send_startup(self) -> None:
        assert self.startup is not None
        self.startup["first_step"] = time.time()
        if self.control is not None:
            self.control.put.remote(StartupMarks(tuple(self.startup.items())))  # fire and forget
        self.startup = None

    def epoch(self) -> bool:
        """Steps to the end of the current epoch (or of training); True when asked to stop."""
        run, cfg, progress, data = self.run, self.run.config, self.progress, self.run.data
        batches = data.batches()
        step_hook = self.callbacks is not None and self.callbacks.defines("on_step_end")
        while progress.global_step < run.total_steps and not data.epoch_done:
            before = dict(self.sums.values) if step_hook else {}
            lr = run.runner.lr if step_hook else 0.0
            try:
                times = run.runner.run(batches, data.accum, self.sums)
            except StepOutOfMemory:
                # Raised on every rank at the same point: all retry the step, from the same
                # position, with about half the micro-batch and twice the accumulation steps.
                self.events.append(Note(shrink_after_oom(run), "warning"))
                self.oom_retries += 1
                batches = data.batches()
                continue
            if times is None:  # the loader ran dry early: count the epoch as done rather than loop on it
                data.finish_epoch()
                break
            if times.anomaly is not None and self.on_anomaly(times.anomaly):
                return False  # rolled back: training goes on from the restored step, past the bad batch
            progress.global_step += 1
            if self.watchdog is not None:
                self.watchdog.step_done(progress.global_step)
            if self.startup is not None:
                self.send_startup()
            run.after_step(progress.global_step)  # local SGD's sync points, the weights' average
            self.profiler.at_step(progress.global_step)
            data.advance()
            progress.samples_seen += self.per_step * run.data_world
            self.meter.step_done()
            if step_hook and self.callbacks is not None:
                metrics = step_metrics(run, before, self.sums.values, lr)  # a host sync: only for on_step_end
                self.callbacks.fire("on_step_end", progress.global_step, progress.global_step, metrics)
            for name in ("data_s", "compute_s", "optim_s", "forward_s"):
                self.sums.add(name, getattr(times, name))
            if progress.global_step % cfg.train.log_every_n_steps == 0:
                # A point for the curves; it is reduced with the others at the next report.
                self.history.close(self.sums, progress.global_step, run.runner.lr)
            if cfg.train.eval_every_n_steps and progress.global_step % cfg.train.eval_every_n_steps == 0:
                self.val_metrics = self.validate()
            if self.step_ends():
                return True
            if progress.global_step >= run.total_steps:
                break
            due = progress.global_step >= self.next_report or self.checkpointing.due(progress.global_step)
            if due and self.report_and_act():
                return True
        if data.epoch_done:
            # A full epoch: the next one starts at its beginning with a new shuffle.
            data.next_epoch()
            run.runner.scheduler.epoch_end()  # schedule.interval epoch: the LR of the next epoch
            more = progress.global_step < run.total_steps
            if more and run.val_set is not None and cfg.train.eval_every_n_steps is None:
                self.val_metrics = self.validate()
                if self.step_ends():
                    return True
            if more and cfg.checkpoint.at_epoch_end:
                self.save(None)
        return False

    def on_anomaly(self, finding: Finding) -> bool:
        """train.anomaly: the step the runner dropped is recorded (rank 0's event) and counted as
        skipped, or rolled back to the newest checkpoint (True; every rank, the verdict is agreed)."""
        run, guard = self.run, cast(AnomalyGuard, self.run.runner.guard)
        step = self.progress.global_step + 1
        samples = batch_samples(run.data)  # before a rollback moves the data position
        restored = None
        if guard.cfg.action == "rollback":
            with self.phase("rollback"):  # a restore, not a step: the watchdog bounds it by the ceiling
                restored = roll_back(run, self.checkpointing, guard, step)
        if restored is None:
            guard.skipped += 1
            if guard.cfg.action == "rollback":
                self.events.append(Note(f"step {step}: no checkpoint to roll back to yet; the step is skipped"))
        if run.rank == 0 and restored is not None:
            self.events.append(finding.event(step, samples, restored.source, run.runner.lr))
            self.events.extend(CheckpointSkipped(name, reason) for name, reason in restored.skipped)
            self.events.extend(Note(note, "warning") for note in restored.notes)
        if restored is not None:
            self.validated_step = None  # the steps from the checkpoint on are trained (and validated) anew
        elif run.rank == 0:
            self.events.append(finding.event(step, samples))
        return restored is not None

    def report_and_act(self) -> bool:
        """Report, then save and/or stop as the reduced control signals say; True to stop."""
        report, control = self.report()
        if control.failed:
            raise_save_failure(control.failed)
        if control.save or self.checkpointing.due(self.progress.global_step):
            self.save(report)
        return control.stop

    def report(self, *, final: bool = False) -> tuple[Report, Control]:
        cfg = self.run.config
        now = time.perf_counter()
        signals = self.gather_control_signals(final=final)
        self.announce_checkpoints()
        reduced = reduce_metrics(
            self.run, self.sums, self.history, now - self.last_report, self.progress, self.meter, signals
        )
        figures = reduced.report.figures
        figures.update(self.val_metrics)  # the last pass; the history has each of them
        figures["time/elapsed_s"] = now - self.started
        figures["checkpoint/save_failures"] = self.save_failures
        figures["checkpoint/stall_s"] = self.checkpointing.stall_s
        if cfg.train.global_batch_size is not None:  # the split this worker count derived (or auto chose)
            figures["batch/micro_batch_size"] = self.run.data.micro_batch
            figures["batch/grad_accum_steps"] = self.run.data.accum
            figures["batch/oom_retries"] = self.oom_retries
        if self.run.runner.guard is not None:
            figures.update(self.run.runner.guard.figures())
        slow = self.stragglers.observe(reduced.own_s, round(reduced.totals.get("steps", 0.0) / self.run.world))
        stragglers = self.stragglers.events(slow, self.progress.global_step)
        self.events.extend(stragglers)
        figures.update(self.stragglers.figures())
        if self.run.world > 1:  # the Prometheus hook's per-rank gauges
            reduced.local["straggler_score"] = self.stragglers.last[self.run.rank]
        rank0 = self.run.rank == 0
        report = replace(
            reduced.report,
            history=merge_points(reduced.report.history, self.val_points),
            events=tuple(self.events) if rank0 else (),
            checkpoint=self.last_checkpoint if rank0 else None,
        )
        self.events.clear()
        self.val_metrics = {}
        self.val_points = []
        self.last_report = now
        self.next_report = next_report_step(cfg, self.progress.global_step, figures["perf/step_time_s"])
        self.hooks.on_report(report, reduced.local)  # they may add figures (per-node samples, communication)
        if not final:
            self.channel.report(report)
            # Every rank, at the same report (the scores are all-reduced): restart or exclude raise,
            # a worker failure to Ray Train.
            self.stragglers.act(stragglers, self.run.rank, self.checkpoint_now)
        return report, self.decide(reduced.signals)

    def gather_control_signals(self, *, final: bool) -> Signals:
        """Rank 0's view (save outcomes, stop flag, time since the last save) and the preemption
        notice, for the report's all-reduce."""
        signals = Signals()
        failed_message = ""
        if self.run.rank == 0:
            for outcome in self.checkpointing.collect():
                self.hooks.on_save(outcome)
                if outcome.error:
                    signals.save_failures += 1
                    failure = SaveFailed(outcome.step, outcome.error)
                    failed_message = failure.text
                    self.events.append(failure)
                else:
                    self.last_checkpoint = outcome.uri
                    self.committed.extend([outcome.uri] if outcome.uri else [])
            signals.stop = 1.0 if (not final and self.stop_requested()) else 0.0
            signals.minutes_since_save = (time.perf_counter() - self.last_save) / 60
        self.save_failures += int(signals.save_failures)
        self.failed_message = failed_message
        # A barrier across workers, so not at every report: every rank calls it at the same reports.
        self.reports += 1
        preempted = self.reports % PREEMPTION_CHECK_EVERY == 0 and self.channel.preempted()
        signals.preempted = 1.0 if preempted else 0.0
        return signals

    def decide(self, signals: Signals) -> Control:
        """What every rank does after a report, from the signals summed over ranks."""
        cfg = self.run.config.checkpoint
        control = Control()
        if signals.save_failures > 0:
            self.save_failures = max(self.save_failures, int(signals.save_failures))
            if cfg.on_save_error == "fail":
                control.failed = self.failed_message or "a checkpoint save failed"
        if signals.stop > 0:
            control.stop = control.save = True
            self.events.append(Stopping("the driver asked for a stop; every worker checkpoints and returns"))
        elif signals.preempted > 0 and not self.preemption_saved:
            # Checkpoint at once, once. Elastic: train on; when the node goes, Ray Train restarts the
            # group on the nodes left, from this checkpoint. Fixed size: stop, resumable.
            self.preemption_saved = control.save = True
            control.stop = not isinstance(self.run.config.scaling.num_workers, tuple)
            then = "every worker returns" if control.stop else "training goes on until the node goes (elastic)"
            self.events.append(
                Stopping(f"the cluster gave notice of preemption; every worker checkpoints, then {then}")
            )
        every = cfg.every_n_minutes
        if every is not None and signals.minutes_since_save >= every:
            control.save = True
        return control

    def stop_requested(self) -> bool:
        """The driver's stop flag, without waiting on it: the read asked for at an earlier report is
        taken if it has arrived, and a new one is sent. A stop takes effect one report later."""
        if self.control is None:
            return False
        answer = False
        if self.stop_probe is not None:
            ready, _ = ray.wait([self.stop_probe], timeout=0)
            if not ready:
                return False
            try:
                answer = bool(ray.get(self.stop_probe))
            except Exception as err:  # the driver went away: keep training, it may come back
                log.debug("stop flag unreadable: %s", err)
        self.stop_probe = self.control.stop_requested.remote()
        return answer

    def save(self, report: Report | None, *, final: bool = False) -> None:
        # The snapshot stall is training time: it stays in the throughput figure.
        with self.phase("checkpoint"):
            self.checkpointing.save(report.scalars() if report is not None else {}, final=final)
        self.last_save = time.perf_counter()

    def checkpoint_now(self) -> None:
        """A checkpoint of this step, committed when this returns (every rank: a collective)."""
        self.save(None)
        with self.phase("checkpoint"):
            outcomes = self.checkpointing.wait()
        for outcome in outcomes:
            self.hooks.on_save(outcome)

    def timed_evaluate(self) -> dict[str, float]:
        if self.run.rank == 0 and self.control is not None:  # the console says so while the pass runs
            self.control.put.remote(ValidationStarted(self.progress.global_step))  # fire and forget
        started = time.perf_counter()
        with self.phase("validation"):
            metrics = evaluate(self.run)
        self.meter.exclude(time.perf_counter() - started)
        self.run.runner.scheduler.validated(metrics)  # ReduceLROnPlateau: all-reduced, the same on every rank
        self.val_points.append({"step": self.progress.global_step, "time/unix": time.time(), **metrics})
        self.last_pass = (self.progress.global_step, metrics)
        return metrics

    def validate(self) -> dict[str, float]:
        """A validation pass during training, then what follows one: the callbacks' hook, early
        stopping's count and (``restore_best``) a checkpoint of a pass that improved, due at the
        end of the step (``step_ends``), which rotation keeps."""
        metrics = self.timed_evaluate()
        if self.after_validation(metrics) and self.early is not None and self.early.cfg.restore_best:
            self.best_due = {"step": self.progress.global_step, **metrics}
            self.checkpointing.writer.keep = {checkpoint_name(self.progress.global_step)}
        return metrics

    def step_ends(self) -> bool:
        """After a step's hooks and validation: True when the run ends here (its final save then
        holds the best pass's weights too); else the best pass's checkpoint, if one is due."""
        if self.agreed_stop():
            return True
        if self.best_due is not None:
            # Every rank: the metrics are all-reduced, so all save here. As a final save does, it
            # holds the full weights under a sharded plan: the driver may export them.
            self.checkpointing.save(self.best_due, final=True)
            self.last_save = time.perf_counter()
            self.best_due = None
        return False

    def after_validation(self, metrics: dict[str, float], *, during_training: bool = True) -> bool:
        """The callbacks' ``on_validation_end`` and early stopping's count, once per step; whether
        the pass improved on early stopping's best. Patience that runs out at the final pass
        (``during_training`` False) ends nothing: the run is at its end."""
        step = self.progress.global_step
        if step == self.validated_step:
            return False
        self.validated_step = step
        if self.callbacks is not None:
            self.callbacks.fire("on_validation_end", step, dict(metrics))
        improved = self.early.observe(step, metrics) if self.early is not None else None
        if during_training and self.early is not None and self.early.exhausted and self.ended is None:
            self.ended = EndedEarly(step, self.early.reason, "early_stopping")
        return bool(improved)

    def agreed_stop(self) -> bool:
        """Whether the run ends after this step: a callback asked on some rank (the ranks agree in
        one collective, only when there are callbacks) or early stopping ran out of patience (its
        metrics are the same on every rank). A callback's failure is raised here, on every rank."""
        if self.callbacks is not None and self.ended is None:
            step = self.progress.global_step
            fresh_start = self.restored.source is None and step <= self.first_step + 1
            reason = self.callbacks.agree(self.run.device, step, retry=not fresh_start)
            if reason is not None:
                self.ended = EndedEarly(step, reason, "callback")
        return self.ended is not None

    def announce_checkpoints(self) -> None:
        """``on_checkpoint`` on every rank for each checkpoint rank 0 saw committed (one broadcast,
        only when there are callbacks)."""
        if self.callbacks is None:
            self.committed.clear()
            return
        committed = cast(list[str], collectives.broadcast_object(list(self.committed)))
        self.committed.clear()
        for uri in committed:
            self.callbacks.fire("on_checkpoint", self.progress.global_step, uri)

    def finish(self, status: str) -> Report:
        """Final validation, final checkpoint (waited for), final report: what rank 0 returns."""
        run = self.run
        self.profiler.finish()
        step = self.progress.global_step
        # local SGD: one model at the end, not one per worker
        changed = run.finish(step) if status == "finished" else False
        if status == "finished" and run.val_set is not None:
            if self.last_pass is not None and self.last_pass[0] == step and not changed:
                self.val_metrics = dict(self.last_pass[1])  # this step's pass: the weights have not moved since
            else:
                self.val_metrics = self.timed_evaluate()
            self.after_validation(self.val_metrics, during_training=False)
        if self.ended is not None:
            self.events.append(self.ended)
        if self.early is not None:
            stopped = self.ended is not None and self.ended.source == "early_stopping"
            self.events.append(BestValidation(self.early.cfg.metric, self.early.best, self.early.best_step, stopped))
        report, control = self.report(final=True)
        if control.failed:
            raise_save_failure(control.failed)
        if self.progress.global_step > self.first_step or self.last_checkpoint is None:
            self.save(report, final=True)
        final_error: SaveFailed | None = None
        for outcome in self.checkpointing.wait():
            self.hooks.on_save(outcome)
            if outcome.error:
                self.save_failures += 1
                final_error = SaveFailed(outcome.step, outcome.error, final=True)
            else:
                self.last_checkpoint = outcome.uri
                self.committed.extend([outcome.uri] if outcome.uri else [])
        self.announce_checkpoints()
        if self.callbacks is not None:
            self.callbacks.fire("on_train_end", self.progress.global_step)
            # A hook's failure ends the run here, on every rank; a stop asked now changes nothing.
            self.callbacks.agree(self.run.device, self.progress.global_step, retry=not self.before_first_step)
        # Only rank 0 knows how its save went; every rank must take the same way out.
        failed_anywhere = collectives.all_reduce_sum([1.0 if final_error else 0.0], self.run.device).item() > 0
        if failed_anywhere and self.run.config.checkpoint.on_save_error == "fail":
            raise_save_failure(final_error.text if final_error else "the final checkpoint save failed")
        final = replace(
            report,
            figures={**report.figures, "checkpoint/save_failures": self.save_failures},
            events=report.events + ((final_error,) if final_error else ()),
            checkpoint=self.last_checkpoint or report.checkpoint,
            status=status,
            final_save_error=final_error.error if final_error else None,
        )
        self.channel.report(final)
        return final


# Ray's preemption notice is read every this many reports (reports are >= 1 s apart by default;
# clouds give 30 s or more of notice).
PREEMPTION_CHECK_EVERY = 5


def raise_save_failure(message: str) -> None:
    raise SaveFailedStop(f"{message}; stopped because checkpoint.on_save_error is fail")


def report_stride(cfg: Config, step_time_s: float) -> int:
    """Steps until the next report: every log_every_n_steps, stretched so that reports are at least
    train.report_min_interval_s apart. Each report is a barrier through the Ray Train controller,
    so reporting faster than it polls would stall training. ``step_time_s`` is all-reduced, hence
    the same on every rank, and so is the stride."""
    by_time = math.ceil(cfg.train.report_min_interval_s / step_time_s) if step_time_s > 0 else 1
    return max(cfg.train.log_every_n_steps, by_time)


def next_report_step(cfg: Config, step: int, step_time_s: float) -> int:
    """The step of the next report: at least ``report_stride`` steps on, rounded up to the end of a
    log interval, so that a report cuts no interval short and each point of the report's history
    covers ``train.log_every_n_steps`` steps (save for the reports a restore, a checkpoint or the
    end of training asks for)."""
    every = cfg.train.log_every_n_steps
    return math.ceil((step + report_stride(cfg, step_time_s)) / every) * every


def ended_by_state(callbacks: Callbacks | None, early: EarlyStopping | None) -> EndedEarly | None:
    """The stop a restored run had already agreed on (its final checkpoint holds it), if any."""
    if callbacks is not None and callbacks.stop is not None:
        return EndedEarly(callbacks.stop.step, callbacks.stop.reason, "callback")
    if early is not None and early.exhausted and early.last_step is not None:
        return EndedEarly(early.last_step, early.reason, "early_stopping")
    return None


def restore_events(restored: Restored, run: WorkerRun) -> list[Event]:
    """What the run says about where it starts, from what restore did (worker/saving.Restored)."""
    events: list[Event] = []
    if restored.source:
        layout = run.plan.layout_name if restored.resharded_from is not None else None
        events.append(Resumed(restored.progress.global_step, restored.source, restored.resharded_from, layout))
    events.extend(CheckpointSkipped(name, reason) for name, reason in restored.skipped)
    events.extend(Note(note) for note in restored.notes)
    if restored.written_by is not None:
        said = (
            f"resumed with {run.world} workers from a checkpoint written by {restored.written_by}: "
            "training continues, but is no longer bit-identical to an uninterrupted run"
        )
        events.append(Note(said, "warning"))
    return events


def log_environment(config: Config, rank: int) -> None:
    """One line per worker (workers.log): what scaling.network_profile and scaling.env asked for and
    what this process has, secrets masked; a node that overrides them, or a typo, shows here."""
    wanted = config.scaling.worker_env
    if not wanted:
        return
    shown = []
    for name in sorted(wanted):
        value = os.environ.get(name)
        text = "(unset)" if value is None else (MASK if is_secret_key(name) else value)
        shown.append(f"{name}={text}")
    log.info("rank %d on %s: worker environment: %s", rank, platform.node(), " ".join(shown))


def worker_env() -> dict[str, str]:
    """Environment every worker process gets: one BLAS thread unless the user set otherwise."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
