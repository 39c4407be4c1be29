"""Driver side of a run: connect to Ray, assemble the TorchTrainer, run it with its observers, end it
(summary.json through summary.py)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.fs as pafs
import ray
from ray.train.torch import TorchConfig
from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.exceptions import TrainingFailedError
from ray.train.v2.torch.torch_trainer import TorchTrainer
from rich.console import Console

from trainforge.checkpoint.crypto import cipher_of
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.checkpoint.uris import check_scheme, first_line
from trainforge.config import Config, FactoryData, to_yaml
from trainforge.config.factories import import_from_working_directory
from trainforge.consoles import DataConsole
from trainforge.data.augment import augment_of, check_augment
from trainforge.data.factory import check_data_factory
from trainforge.data.registry import check_local_paths, open_stream, source_of
from trainforge.data.stream import StreamShape, check_stream_config, ordered_split_config
from trainforge.data.tokens import prepare_or_verify
from trainforge.driver.cost import CostMeter
from trainforge.driver.elastic import FreshNodesCallback
from trainforge.driver.events import ForwardingCallback, Pump, StartupCallback, start_mailbox
from trainforge.driver.hangs import HangDoctor
from trainforge.driver.ray_session import ray_logs_to, ray_session, resolve_address
from trainforge.driver.replace import ReplacingTorchConfig
from trainforge.driver.rerun import check_rerun, record_changes
from trainforge.driver.runlock import run_locks
from trainforge.driver.startup import Timeline
from trainforge.driver.summary import RunRecord, finish_run_dir
from trainforge.driver.tls_watch import TlsWatch
from trainforge.driver.trainer import RunTrainer
from trainforge.driver.warm import Shape as WarmShape
from trainforge.driver.warm import WarmGroupFailed, WarmTrainer, process_pool, why_not
from trainforge.errors import CheckpointError, ConfigError, TrainforgeError, TrainingFailed, UserCodeError
from trainforge.models import passed
from trainforge.models.registry import load_factory, require_builtin
from trainforge.observers import Observer, Observers, SinkSetup
from trainforge.observers.registry import build_observers
from trainforge.protocol import PAYLOAD_KEY, Payload, Report, RunInfo, UserError
from trainforge.redact import install_on_logger, redact_text
from trainforge.worker.build import check_block_names, check_model_output, check_parameter_names, check_pretrained_fits
from trainforge.worker.callbacks import check_callbacks
from trainforge.worker.loop import train_loop_per_worker, worker_env
from trainforge.worker.optim import check_optimizer
from trainforge.worker.profiling import fetch_profiles
from trainforge.worker.registry import state_schemas
from trainforge.worker.schedule import check_schedule

log = logging.getLogger("trainforge")
install_on_logger()  # every driver-side line of the "trainforge" logger, on every handler, redacted

# The controller polls workers at this interval and each report waits for that poll; Ray's
# default (2 s) would make every report cost up to 2 s of training time.
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
COLLECTIVE_TIMEOUT_ENV = "RAY_TRAIN_COLLECTIVE_TIMEOUT_S"
ChangedConfig = Literal["refuse", "continue"] | None


@dataclass
class Outcome:
    """What came back from Ray Train, before it is turned into a summary."""

    status: str  # finished, stopped (graceful stop, resumable), failed, aborted
    final: Report | None  # rank 0's final report, or the last one the driver saw
    checkpoint: str | None
    wall_time_s: float
    error: str | None = None
    raise_after: TrainforgeError | None = None  # the user's error, raised once the summary is written
    stopped_by: dict[str, Any] | None = None  # why the driver stopped the run (its TLS watch)


def build_trainer(
    config: Config, mailbox: Any, callbacks: Sequence[Any] = (), *, local_ray: bool = False
) -> TorchTrainer:
    """The run's TorchTrainer; ``callbacks`` are extra Ray Train callbacks for its controller
    (a hyperparameter search records each trial's placement groups with one). On a ``local_ray``
    (one this process started) relative data paths are made absolute for the workers."""
    scaling = config.scaling
    resources = dict(scaling.resources_per_worker) if scaling.resources_per_worker else None
    env = run_env(config)
    streamed: dict[str, Any] = {}
    # Streamed sources (and factories returning Ray Datasets) are read by Ray Data and reach the
    # workers as Ray Train's dataset shards. Decided here, once: the workers follow the payload.
    stream = open_stream(config.data, config.seed, progress=log.info)
    if stream is not None:
        if config.failure.replace == "worker":
            raise ConfigError(
                "failure.replace worker: a streamed data source is split by Ray Data across the whole "
                "worker group, which a replaced worker cannot rejoin; use failure.replace: group"
            )
        streamed = {"datasets": stream.datasets(), "dataset_config": ordered_split_config()}
        log.info(
            "streaming %d training rows%s from %s",
            stream.shape.train_rows,
            f" and {stream.shape.val_rows} validation rows" if stream.shape.val_rows else "",
            stream.origin,
        )
    payload = make_payload(config, mailbox, stream.shape if stream is not None else None, local_ray=local_ray)
    # An elastic group is sized from Ray Data's view of the nodes, refreshed at each restart (driver/elastic.py).
    elastic = [FreshNodesCallback()] if isinstance(scaling.num_workers, tuple) else []
    return RunTrainer(
        train_loop_per_worker,
        train_loop_config={PAYLOAD_KEY: payload},
        # The process group's timeout (gloo and NCCL collectives); rounded up, as 0 s would make
        # init_process_group itself time out.
        torch_config=(ReplacingTorchConfig if config.failure.replace == "worker" else TorchConfig)(
            timeout_s=math.ceil(config.failure.collective_timeout_s)
        ),
        scaling_config=ScalingConfig(
            num_workers=scaling.num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker=resources,
            placement_strategy=scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=config.run.name,
            storage_path=config.storage_path,
            failure_config=FailureConfig(max_failures=config.failure.max_failures),
            # trainforge writes, verifies and rotates checkpoints itself (checkpoint/writer.py);
            # Ray's own checkpoint registry stays empty.
            # StartupCallback is one of Ray Train's internal callback kinds, which RunConfig accepts
            # beside UserCallbacks (its annotation names only those).
            callbacks=[ForwardingCallback(mailbox), StartupCallback(mailbox), *elastic, *callbacks],  # type: ignore[list-item]
            worker_runtime_env={"env_vars": env},
        ),
        **streamed,
    )


def run_env(config: Config) -> dict[str, str]:
    """Every worker's environment: scaling.network_profile, then scaling.env, over the node's own."""
    env = {**worker_env(), **config.scaling.worker_env}
    if not ray.util.client.ray.is_connected():
        # Local cluster: let workers import user modules (model.factory) from the working directory.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return env


def make_payload(config: Config, mailbox: Any, stream: StreamShape | None, *, local_ray: bool) -> Payload:
    """What every worker receives, with the objects ``api.fit`` was given; on a ``local_ray`` (one
    this process started) relative data paths are made absolute for the workers."""
    absolute = Config.model_validate(with_absolute_data_paths(config.to_dict())) if local_ray else config
    return Payload(config=absolute, mailbox=mailbox, stream=stream, passed=passed.current())


def with_absolute_data_paths(config: dict[str, Any]) -> dict[str, Any]:
    """``data.path`` / ``data.val_path`` relative to the driver's working directory, made absolute
    for a local Ray, whose workers do not start in that directory. URIs (``s3://``) stay as given."""
    data = dict(config["data"])
    for key in ("path", "val_path"):
        value = data.get(key)
        if value and "://" not in value and not Path(value).expanduser().is_absolute():
            data[key] = str(Path(value).expanduser().resolve())
    return {**config, "data": data}


def preflight(config: Config, *, local: bool) -> None:
    """Checks that need neither tensors nor a cluster, so that common mistakes fail before Ray starts.

    Paths and factories are checked only for a local Ray: a remote cluster has its own file system
    and Python path, and the workers check them there.
    """
    if source_of(config.data).streamed:
        check_stream_config(
            config.data, tensor_parallel=config.parallel.tensor_parallel, auto_batch=config.train.auto_batch
        )
    if config.model.name is not None:
        require_builtin(config.model.name)
    check_data_factory(config.data, local=False)
    check_augment(augment_of(config.data))
    check_optimizer(config.optim)
    check_schedule(config.schedule, config.optim)
    if local:  # checkpoint.encryption: the key is in this machine's environment (a cluster's workers have their own)
        cipher_of(config.checkpoint.encryption)
    check_storage(config, local=local)  # before a corpus is prepared: nothing written for a run that cannot save
    if not local:
        return
    prepare_or_verify(config.data)  # data.name tokens: data.prepare's corpus written if missing, every byte checked
    check_local_paths(config.data)
    user_code = config.model.factory or config.optim.factory or config.callbacks or isinstance(config.data, FactoryData)
    if user_code:
        import_from_working_directory()  # as the local workers see it (run_env's PYTHONPATH)
    if config.model.factory is not None:
        load_factory(config.model.factory)
    check_callbacks(config)
    if config.optim.factory is not None:
        load_factory(config.optim.factory, "optim.factory", "a torch.optim.Optimizer", ConfigError)
    check_data_factory(config.data)
    check_block_names(config)
    check_pretrained_fits(config)
    check_parameter_names(config)
    check_model_output(config)


def check_storage(config: Config, *, local: bool) -> None:
    """``checkpoint.storage_path``: a scheme trainforge reads and, on an object store, a bucket that
    answers and exists, within TRAINFORGE_STORAGE_TIMEOUT_S, before Ray starts. A remote cluster's
    workers may reach storage that this machine cannot: there it is a warning."""
    storage = config.storage_path
    check_scheme(storage, "checkpoint.storage_path")
    if "://" not in storage:
        return
    try:
        store = CheckpointStore.for_run(storage, config.run.name)
        bucket = store.root.split("/", 1)[0]
        problem = "no such bucket" if store.fs.get_file_info(bucket).type == pafs.FileType.NotFound else None
    except (CheckpointError, OSError) as err:
        problem = first_line(err)
    if problem is None:
        return
    message = f"checkpoint.storage_path {redact_text(storage)} cannot be used: {problem}"
    if local:
        raise CheckpointError(f"{message}; check the URI, the credentials and the endpoint")
    log.warning("%s (from this machine; the cluster's workers may reach it)", message)


def check_resume(config: Config, *, local: bool) -> None:
    """``--resume none`` or a path start a run: refuse one that already has checkpoints, whose
    timeline they would otherwise mix with the new one. A path must be a checkpoint that verifies
    (every byte, here, before Ray starts); on a remote cluster, where paths are the cluster's, the
    workers check it themselves."""
    mode = config.checkpoint.resume
    if mode == "auto":
        return
    if mode != "none" and local:
        check_resume_path(mode, config)
    try:
        store = CheckpointStore.for_run(config.storage_path, config.run.name)
        existing = [entry.name for entry in store.entries()]
    except OSError as err:  # storage the driver cannot see: the workers will find out
        log.warning("could not list the run's checkpoints from the driver: %s", err)
        return
    if existing:
        raise CheckpointError(
            f"checkpoint.resume is {mode} but {store.uri('')} already holds {len(existing)} checkpoint(s) "
            f"(newest {existing[-1]}); use a new run.name, or --resume auto to continue this run"
        )


def check_resume_path(path: str, config: Config) -> None:
    """A checkpoint to start from: one that verifies as restore verifies it, or one line before Ray starts."""
    given = Path(path).expanduser()
    problem: str | None
    if "://" not in path and not given.is_dir():
        problem = "not a directory" if given.exists() else "no such directory"
    else:
        try:
            store, name = CheckpointStore.for_checkpoint(path, cipher_of(config.checkpoint.encryption))
            manifest, problem = store.read_manifest(name)
        except (OSError, ValueError) as err:  # a URI pyarrow cannot open (pyarrow.ArrowInvalid is a ValueError)
            manifest, problem = None, str(err)
        if manifest is not None:
            # Every byte and the load check, as the workers will: a bad checkpoint costs seconds, not a Ray start.
            check = store.verify(name, schemas=state_schemas())
            if check.ok:
                return
            problem = "; ".join(check.problems)
    raise CheckpointError(
        f"checkpoint.resume (--resume) {path} is not a checkpoint: {problem}; give a checkpoint_NNNNNNNNN "
        "directory (trainforge ckpt list RUN_DIR), or --resume auto"
    )


def train(
    config: Config,
    *,
    console: Console | None = None,
    observers: Iterable[Observer] = (),
    address: str | None = None,
    verbose: bool = False,
    callbacks: Sequence[Any] = (),
    lock_wait_s: float = 0.0,
    pool: Any = None,
    startup: Timeline | None = None,
    changed_config: ChangedConfig = None,
) -> dict[str, Any]:
    """Train the run with the standard observers around ``observers``; its summary. Raises
    TrainingFailed when it failed, and TrainforgeError for user errors. ``startup``: the run's
    start-up marks so far (``api.fit``'s, from its call); a new timeline starts here without one.
    ``changed_config``: what a run directory whose recorded config differs gets (driver/rerun.py):
    ``refuse``, ``continue`` (the change recorded), or None, unchecked (a search's trials).

    The standard observers are observers/registry.py's sinks that the config turns on, in its
    order, with ``observers`` before the closing ones (the report writer, MLflow); their hooks fire
    as observers/base.py says. ``api.fit`` and a search's trials (tune/trial.py) run through here.
    """
    run_dir = config.run_dir
    setup = SinkSetup(config, run_dir, console or DataConsole(stderr=True))
    fanout = Observers(build_observers(setup, observers))
    try:
        summary = run_training(
            config,
            fanout,
            address=address,
            verbose=verbose,
            callbacks=callbacks,
            lock_wait_s=lock_wait_s,
            pool=pool,
            startup=startup,
            changed_config=changed_config,
        )
    except BaseException as err:
        fanout.on_error(err)
        raise
    summary.update(fanout.summary_entries())  # as the observers added them to summary.json
    raise_if_failed(summary, run_dir)
    fanout.check_complete()
    return summary


def run_training(
    config: Config,
    observers: Observers,
    *,
    address: str | None,
    verbose: bool,
    callbacks: Sequence[Any] = (),
    lock_wait_s: float = 0.0,
    pool: Any = None,
    startup: Timeline | None = None,
    changed_config: ChangedConfig = None,
) -> dict[str, Any]:
    """Train to completion (or failure) and return the summary that was written to summary.json.

    The run's directory (and checkpoint folder) is locked from before Ray starts until the summary
    is written, whatever the outcome (driver/runlock.py); ``lock_wait_s`` waits for a holder that is ending.
    ``pool``: a warm worker pool (driver/warm.py) to lease the run's workers from.
    """
    if startup is None:
        startup = Timeline()
    startup.mark("imports")
    address = resolve_address(config, address)
    local = address is None
    preflight(config, local=local)
    watch = TlsWatch.for_run(config)  # certificates that expire within the margin: refused here
    with run_locks(config, local=local, wait_s=lock_wait_s):
        check_resume(config, local=local)
        if changed_config is not None:
            record_changes(config.run_dir, check_rerun(config, resume=changed_config == "continue"))
        startup.mark("preflight")
        return _train(
            config,
            observers,
            address=address,
            verbose=verbose,
            callbacks=callbacks,
            startup=startup,
            pool=pool,
            watch=watch,
        )


def _train(
    config: Config,
    observers: Observers,
    *,
    address: str | None,
    verbose: bool,
    callbacks: Sequence[Any],
    startup: Timeline,
    pool: Any = None,
    watch: TlsWatch | None = None,
) -> dict[str, Any]:
    run_dir = config.run_dir
    (run_dir / "config.yaml").write_text(to_yaml(config))
    os.environ.setdefault(POLL_ENV, str(config.cluster.report_poll_interval_s))
    # Ray Train's own barrier in report() waits at most this long too (Ray passes it to the workers).
    os.environ[COLLECTIVE_TIMEOUT_ENV] = str(config.failure.collective_timeout_s)
    fanout = observers
    started = time.monotonic()
    with (
        ray_logs_to(run_dir / "ray.log", verbose=verbose),
        ray_session(config, address, verbose=verbose) as where,
    ):
        startup.mark("ray")
        mailbox = start_mailbox()
        doctor = HangDoctor(run_dir, config.failure.hang) if config.failure.hang.enabled else None
        pump = Pump(mailbox, fanout, CostMeter.for_config(config, started), startup, doctor)
        fanout.on_start(RunInfo(config.run.name, config.scaling.num_workers, where, str(run_dir)))
        try:
            outcome, config = _fit_warm(config, mailbox, pump, started, pool, local_ray=address is None, watch=watch)
            if outcome is None:
                trainer = build_trainer(config, mailbox, callbacks, local_ray=address is None)
                outcome = _fit(trainer, pump, started, watch)
        finally:
            if doctor is not None:
                doctor.close()
    store = None
    if outcome.checkpoint:  # the final weights out of the last checkpoint (decrypted with the run's key)
        store = CheckpointStore.for_run(config.storage_path, config.run.name)
        store.cipher = cipher_of(config.checkpoint.encryption)
    if config.profile is not None:
        copy_profiles(config, run_dir)
    summary = finish_run_dir(run_dir, run_record(config, outcome, pump), store)
    fanout.on_end(summary)
    if outcome.status == "failed":
        (run_dir / "error.log").write_text(redact_text(outcome.error or ""))
    if outcome.raise_after is not None:
        raise outcome.raise_after
    return summary


def copy_profiles(config: Config, run_dir: Path) -> None:
    """The workers wrote their profiles beside the checkpoints (worker/profiling.py); the report and
    MLflow read them from the run directory. A copy that fails is a warning: the run stands."""
    try:
        fetch_profiles(CheckpointStore.for_run(config.storage_path, config.run.name), run_dir)
    except OSError as err:
        log.warning("could not copy the profile into %s: %s", run_dir, redact_text(str(err)))


def _fit_warm(
    config: Config, mailbox: Any, pump: Pump, started: float, pool: Any, *, local_ray: bool, watch: TlsWatch | None
) -> tuple[Outcome | None, Config]:
    """The run on a warm worker group (driver/warm.py) when one is asked for and the run can use
    one. No outcome: run it under Ray Train instead, with the config returned. That is when no warm
    group was asked for, when the run cannot use one (said once), or when the warm group failed with
    failures to spare: Ray Train's group then continues from the newest checkpoint, and the failure
    counts against ``failure.max_failures``."""
    if pool is None and not config.scaling.reuse_workers:
        return None, config
    reason = why_not(config)
    if reason is not None:
        log.info("warm workers not used: %s", reason)
        return None, config
    if pool is None:
        pool = process_pool()
    payload = make_payload(config, mailbox, None, local_ray=local_ray)
    trainer = WarmTrainer(pool, WarmShape.of(config, run_env(config)), payload, mailbox)
    try:
        return _fit(trainer, pump, started, watch), config
    except WarmGroupFailed as err:
        left = config.failure.max_failures
        if left == 0:
            elapsed = time.monotonic() - started
            failed = Outcome("failed", pump.last_report, pump.last_checkpoint, elapsed, f"warm worker group: {err}")
            return failed, config
        log.warning("warm worker group failed (%s); the run continues under Ray Train from its newest checkpoint", err)
        spare = left - 1 if left > 0 else -1  # -1: unlimited
        return None, config.model_copy(update={"failure": config.failure.model_copy(update={"max_failures": spare})})


def _fit(trainer: TorchTrainer | WarmTrainer, pump: Pump, started: float, watch: TlsWatch | None = None) -> Outcome:
    """Run ``fit`` on a thread; the main thread drains reports and owns the signals.

    First Ctrl-C (or SIGTERM): the workers checkpoint and stop at their next report. Second: abort.
    ``watch``: the run's TLS certificates against the clock (driver/tls_watch.py); when it says the
    run cannot go on, the run ends as failed without waiting for ``fit``.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=target, name="trainforge-fit", daemon=True)
    thread.start()
    try:
        with graceful_stop(pump.mailbox):
            while thread.is_alive():
                thread.join(timeout=0.5)
                pump.drain()
                ended = (
                    watch.poll(pump.mailbox.request_stop.remote, awaiting_group=pump.awaiting_group) if watch else None
                )
                if ended is not None:  # said once, by the command's error line
                    return Outcome("failed", pump.last_report, pump.last_checkpoint, time.monotonic() - started, ended)
    except KeyboardInterrupt:
        pump.drain()
        return Outcome("aborted", pump.last_report, pump.last_checkpoint, time.monotonic() - started)
    pump.drain()
    elapsed = time.monotonic() - started
    if "error" in box:
        err = box["error"]
        user_error = _user_error(err)
        if user_error is not None:
            raise user_error from None
        if not isinstance(err, TrainingFailedError):
            raise err
        trace = "".join(traceback.format_exception(err))
        return Outcome("failed", pump.last_report, pump.last_checkpoint, elapsed, trace)
    returned = getattr(box["result"], "return_value", None)  # rank 0's: a final Report or a UserError
    if isinstance(returned, UserError):
        error = returned.error()
        if isinstance(error, TrainingFailed):  # the run's own failure (a save under on_save_error: fail)
            return Outcome("failed", pump.last_report, pump.last_checkpoint, elapsed, returned.message)
        if isinstance(error, UserCodeError):  # the run started: its summary says how it ended (restarts: 0)
            return Outcome("failed", pump.last_report, pump.last_checkpoint, elapsed, returned.message, error)
        raise error
    final = returned if isinstance(returned, Report) else pump.last_report
    status = final.status if final is not None and final.status else "finished"
    checkpoint = final.checkpoint if final is not None else None
    asked = watch.stopped_by(final.step if final is not None else 0) if watch and status == "stopped" else None
    return Outcome(status, final, checkpoint or pump.last_checkpoint, elapsed, stopped_by=asked)


@contextlib.contextmanager
def graceful_stop(mailbox: Any) -> Iterator[None]:
    """SIGINT/SIGTERM: first asks for a checkpoint-and-stop, second raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    asked = 0

    def handler(signum: int, frame: Any) -> None:
        nonlocal asked
        asked += 1
        if asked > 1:
            raise KeyboardInterrupt
        log.warning("stopping: the workers checkpoint at their next report (press Ctrl-C again to abort)")
        mailbox.request_stop.remote()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _user_error(err: Exception) -> TrainforgeError | None:
    """A TrainforgeError raised inside a worker (bad data path, bad factory) is the user's, not a crash."""
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, TrainforgeError):
            return current
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        stack.extend(getattr(current, "worker_failures", {}).values())
    return None


def run_record(config: Config, outcome: Outcome, pump: Pump) -> RunRecord:
    """What summary.json says about this driver's run (summary.build_summary)."""
    final = outcome.final or pump.last_report
    return RunRecord(
        status=outcome.status,
        final=final,
        recovery=pump.recovery,
        wall_time_s=outcome.wall_time_s,
        checkpoint=outcome.checkpoint,
        config=config.to_dict(),
        num_workers=config.scaling.max_workers,
        error=outcome.error,
        cost=pump.cost.final(final, outcome.wall_time_s).to_dict() if pump.cost is not None else None,
        startup=pump.startup.to_dict(),
        stopped_by=outcome.stopped_by,
    )


def raise_if_failed(summary: dict[str, Any], run_dir: Path) -> None:
    if summary["status"] == "failed":
        raise TrainingFailed(
            f"training failed: {summary.get('error', 'unknown error')} (details: {run_dir / 'error.log'})"
        )
