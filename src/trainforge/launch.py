"""Driver side of a run: connect to Ray, assemble the TorchTrainer, run it, write summary.json."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs
import ray
from ray.train.torch import TorchConfig
from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.exceptions import TrainingFailedError
from ray.train.v2.torch.torch_trainer import TorchTrainer

from trainforge import errors
from trainforge.checkpoint.format import write_json_atomic
from trainforge.checkpoint.state import MODEL_FILE
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import Config, to_yaml
from trainforge.errors import CheckpointError, ClusterError, TrainforgeError, TrainingFailed
from trainforge.metrics.session import check_cluster_options, local_ray_options, publish_local_targets
from trainforge.observe import ForwardingCallback, Observer, Observers, Pump, start_mailbox
from trainforge.redact import install_on_logger, redact_config, redact_text, redacting
from trainforge.runlock import run_locks
from trainforge.worker.loop import train_loop_per_worker, worker_env

log = logging.getLogger("trainforge")
install_on_logger()  # every driver-side line of the "trainforge" logger, on every handler, redacted

# The controller polls workers at this interval and each report waits for that poll; Ray's
# default (2 s) would make every report cost up to 2 s of training time.
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
COLLECTIVE_TIMEOUT_ENV = "RAY_TRAIN_COLLECTIVE_TIMEOUT_S"


@dataclass
class Outcome:
    """What came back from Ray Train, before it is turned into a summary."""

    status: str  # finished, stopped (graceful stop, resumable), failed, aborted
    final_metrics: dict[str, Any]
    checkpoint: str | None
    wall_time_s: float
    error: str | None = None


def resolve_address(config: Config, address: str | None) -> str | None:
    return address or config.cluster.address or os.environ.get("RAY_ADDRESS") or None


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, with a clear message, instead of waiting on Ray's long connect retries."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = parsed.hostname, parsed.port or (10001 if parsed.scheme == "ray" else 6379)
    if not host:
        raise ClusterError(f"Ray address {address!r} is not host:port, ray://host:port or 'auto'")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address} ({err.strerror or err}); "
            "check the address, or unset RAY_ADDRESS/--address to train on a local Ray"
        ) from None


@contextlib.contextmanager
def ray_logs_to(path: Path, *, verbose: bool) -> Iterator[None]:
    """Ray's driver-side log lines go to ``path``; on the terminal too only when verbose."""
    ray_logger = logging.getLogger("ray")
    handler = redacting(logging.FileHandler(path))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # Ray installs its own stderr handler on import; park it unless the user asked for Ray's logs.
    parked = [] if verbose else list(ray_logger.handlers)
    for kept in ray_logger.handlers if verbose else []:
        redacting(kept)
    for old in parked:
        ray_logger.removeHandler(old)
    ray_logger.addHandler(handler)
    try:
        yield
    finally:
        ray_logger.removeHandler(handler)
        for old in parked:
            ray_logger.addHandler(old)
        handler.close()


@contextlib.contextmanager
def ray_session(config: Config, address: str | None, *, verbose: bool) -> Iterator[str]:
    """Connect to the cluster at ``address`` or start a local Ray; yields a description of it."""
    if ray.is_initialized():
        yield "the Ray instance already running in this process"
        return
    quiet = {"log_to_driver": verbose, "configure_logging": False}
    if address:
        check_cluster_options(config.metrics)
        check_reachable(address)
        try:
            ray.init(address=address, **quiet)  # type: ignore[arg-type]
        except (ConnectionError, RuntimeError) as err:
            raise ClusterError(f"cannot connect to the Ray cluster at {address}: {err}") from None
        where = f"the Ray cluster at {address}"
    else:
        workers = config.scaling.max_workers
        cpus_per_worker = (config.scaling.resources_per_worker or {}).get("CPU", 1)
        # Logical CPUs: enough for every worker even on a 2-core laptop; threads are capped per worker.
        num_cpus = config.cluster.num_cpus or max(os.cpu_count() or 1, int(workers * cpus_per_worker) + 1, 4)
        # address="local": always a new cluster, never one some other `ray start` left on this machine.
        # No dashboard (11 more processes, ~0.9 GB); metrics export works without it (metrics/session.py).
        options = local_ray_options(config.metrics)
        with bound_to(config.cluster.bind_address):
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **options, **quiet)  # type: ignore[arg-type]
        where = f"a local Ray ({num_cpus} logical CPUs, listening on {config.cluster.bind_address})"
    try:
        # Prometheus finds a local Ray's metrics agent through the file Ray's dashboard would write.
        with contextlib.nullcontext() if address else publish_local_targets(config.metrics):
            yield where
    finally:
        ray.shutdown()


LOOPBACK = "127.0.0.1"
# Ray reads this at import; False makes its node-address lookup answer 127.0.0.1 (as on macOS).
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def bound_to(bind_address: str) -> Iterator[None]:
    """While a local Ray starts: make it take 127.0.0.1 as its node address, when asked to.

    Ray 2.60 on Linux replaces a loopback ``_node_ip_address`` by the machine's routable address
    (services.resolve_ip_for_localhost) and its servers listen on every interface. Its one path to
    a loopback node is the macOS/Windows one, ``ray_constants.ENABLE_RAY_CLUSTER`` false: then the
    node address is 127.0.0.1 and GCS, raylet, object manager, workers and the metrics agent listen
    on 127.0.0.1 only (tests/integration/test_loopback.py checks every listening socket). The
    environment variable carries the same choice to the processes ``ray.init`` spawns.
    """
    if bind_address != LOOPBACK:
        yield
        return
    from ray._private import ray_constants

    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(CLUSTER_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(CLUSTER_ENV, None)
        else:
            os.environ[CLUSTER_ENV] = saved_env


def build_trainer(config: Config, mailbox: Any, callbacks: Sequence[Any] = ()) -> TorchTrainer:
    """The run's TorchTrainer; ``callbacks`` are extra Ray Train callbacks for its controller
    (a hyperparameter search records each trial's placement groups with one)."""
    scaling = config.scaling
    resources = dict(scaling.resources_per_worker) if scaling.resources_per_worker else None
    env = worker_env()
    if not ray.util.client.ray.is_connected():
        # Local cluster: let workers import user modules (model.factory) from the working directory.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": config.to_dict(), "control": mailbox},
        # The process group's timeout (gloo and NCCL collectives); rounded up, as 0 s would make
        # init_process_group itself time out.
        torch_config=TorchConfig(timeout_s=math.ceil(config.failure.collective_timeout_s)),
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
            # trainforge writes, verifies and rotates checkpoints itself (checkpoint/manager.py);
            # Ray's own checkpoint registry stays empty.
            callbacks=[ForwardingCallback(mailbox), *callbacks],
            worker_runtime_env={"env_vars": env},
        ),
    )


def preflight(config: Config, *, local: bool) -> None:
    """Checks that need neither tensors nor a cluster, so that common mistakes fail before Ray starts.

    Paths and factories are checked only for a local Ray: a remote cluster has its own file system
    and Python path, and the workers check them there.
    """
    from trainforge.data.registry import SOURCES, unknown_source_message
    from trainforge.errors import DataError
    from trainforge.models.registry import load_factory, require_builtin

    if config.data.name not in SOURCES:
        raise DataError(unknown_source_message(config.data.name))
    if config.model.name is not None:
        require_builtin(config.model.name)
    if not local:
        return
    if config.data.path is not None and not Path(config.data.path).expanduser().exists():
        raise DataError(f"data.path {config.data.path} does not exist (data.name {config.data.name})")
    if config.model.factory is not None:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as the local workers see it (build_trainer's PYTHONPATH)
        load_factory(config.model.factory)


def check_resume(config: Config, *, local: bool) -> None:
    """``--resume none`` or a path start a run: refuse one that already has checkpoints, whose
    timeline they would otherwise mix with the new one. A path must be a checkpoint whose manifest
    reads (the workers verify every byte); on a remote cluster, where paths are the cluster's, they
    check it themselves."""
    mode = config.checkpoint.resume
    if mode == "auto":
        return
    if mode != "none" and local:
        check_resume_path(mode)
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


def check_resume_path(path: str) -> None:
    """A checkpoint to start from: a directory whose manifest reads, or one line before Ray starts."""
    given = Path(path).expanduser()
    problem: str | None
    if "://" not in path and not given.is_dir():
        problem = "not a directory" if given.exists() else "no such directory"
    else:
        try:
            store, name = CheckpointStore.for_checkpoint(path)
            manifest, problem = store.read_manifest(name)
        except (OSError, ValueError) as err:  # a URI pyarrow cannot open (pyarrow.ArrowInvalid is a ValueError)
            manifest, problem = None, str(err)
        if manifest is not None:
            return
    raise CheckpointError(
        f"checkpoint.resume (--resume) {path} is not a checkpoint: {problem}; give a checkpoint_NNNNNNNNN "
        "directory (trainforge ckpt list RUN_DIR), or --resume auto"
    )


def run_training(
    config: Config,
    observers: list[Observer],
    *,
    address: str | None,
    verbose: bool,
    callbacks: Sequence[Any] = (),
    lock_wait_s: float = 0.0,
) -> dict[str, Any]:
    """Train to completion (or failure) and return the summary that was written to summary.json.

    The run's directory (and checkpoint folder) is locked from before Ray starts until the summary
    is written, whatever the outcome (runlock.py); ``lock_wait_s`` waits for a holder that is ending.
    """
    address = resolve_address(config, address)
    local = address is None
    preflight(config, local=local)
    with run_locks(config, local=local, wait_s=lock_wait_s):
        check_resume(config, local=local)
        return _train(config, observers, address=address, verbose=verbose, callbacks=callbacks)


def _train(
    config: Config, observers: list[Observer], *, address: str | None, verbose: bool, callbacks: Sequence[Any]
) -> dict[str, Any]:
    run_dir = config.run_dir
    (run_dir / "config.yaml").write_text(to_yaml(config))
    os.environ.setdefault(POLL_ENV, str(config.cluster.report_poll_interval_s))
    # Ray Train's own barrier in report() waits at most this long too (Ray passes it to the workers).
    os.environ[COLLECTIVE_TIMEOUT_ENV] = str(config.failure.collective_timeout_s)
    fanout = Observers(observers)
    started = time.monotonic()
    with (
        ray_logs_to(run_dir / "ray.log", verbose=verbose),
        ray_session(config, address, verbose=verbose) as where,
    ):
        mailbox = start_mailbox()
        pump = Pump(mailbox, fanout)
        fanout.on_start(
            {"name": config.run.name, "workers": config.scaling.num_workers, "cluster": where, "run_dir": str(run_dir)}
        )
        outcome = _fit(build_trainer(config, mailbox, callbacks), pump, started)
    summary = make_summary(config, outcome, pump)
    if outcome.checkpoint:
        store = CheckpointStore.for_run(config.storage_path, config.run.name)
        summary["model_weights_step"] = export_final_weights(store, outcome.checkpoint, run_dir, summary["global_step"])
    write_json_atomic(run_dir / "summary.json", summary)
    fanout.on_end(summary)
    if outcome.status == "failed":
        (run_dir / "error.log").write_text(redact_text(outcome.error or ""))
    return summary


def _fit(trainer: TorchTrainer, pump: Pump, started: float) -> Outcome:
    """Run ``fit`` on a thread; the main thread drains reports and owns the signals.

    First Ctrl-C (or SIGTERM): the workers checkpoint and stop at their next report. Second: abort.
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
    except KeyboardInterrupt:
        pump.drain()
        return Outcome("aborted", pump.last_metrics, pump.last_checkpoint, time.monotonic() - started)
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
        return Outcome("failed", pump.last_metrics, pump.last_checkpoint, elapsed, trace)
    value = getattr(box["result"], "return_value", None)
    returned = value if isinstance(value, dict) else {}
    if returned.get("user_error") == "TrainingFailed":
        return Outcome("failed", pump.last_metrics, pump.last_checkpoint, elapsed, returned["message"])
    if "user_error" in returned:
        raise getattr(errors, returned["user_error"], TrainforgeError)(returned["message"])
    final = returned or pump.last_metrics
    status = str(final.get("status", "finished"))
    return Outcome(status, final, final.get("checkpoint/path") or pump.last_checkpoint, elapsed)


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


def export_final_weights(store: CheckpointStore, checkpoint_uri: str, run_dir: Path, final_step: int) -> int | None:
    """Copy model.safetensors out of the run's last valid checkpoint (local or object store); the
    step it holds, which is older than the final step when the final save failed (said in the log).
    The run's own store is opened from the config: the checkpoint's URI as the workers report it
    names bucket and key only, not the credentials or endpoint the storage path may carry."""
    name = checkpoint_uri.rstrip("/").rpartition("/")[2]
    step = int(name.rsplit("_", 1)[-1]) if name.rsplit("_", 1)[-1].isdigit() else None
    try:
        pafs.copy_files(f"{store.path(name)}/{MODEL_FILE}", str(run_dir / MODEL_FILE), store.fs, pafs.LocalFileSystem())
    except OSError as err:
        log.error("could not copy the final weights out of %s: %s", checkpoint_uri, err)
        return None
    if step is not None and step != final_step:
        log.warning("model.safetensors holds the weights of step %s, the last checkpoint that was saved", step)
    return step


def make_summary(config: Config, outcome: Outcome, pump: Pump) -> dict[str, Any]:
    final = outcome.final_metrics or pump.last_metrics
    return {
        "status": outcome.status,
        "global_step": int(final.get("step", 0)),
        "epoch": int(final.get("epoch", 0)),
        "num_workers": int(final.get("world_size", config.scaling.max_workers)),
        "restarts": len(pump.worker_errors),
        "recovery_s": pump.recovery_s,
        "final_metrics": {k: v for k, v in final.items() if "/" in k and isinstance(v, (int, float))},
        "throughput_samples_per_s": float(final.get("perf/steady_samples_per_s", 0.0)),
        "wall_time_s": round(outcome.wall_time_s, 3),
        "checkpoint": redact_text(outcome.checkpoint) if outcome.checkpoint else None,
        "config": redact_config(config.to_dict()),
        **({"error": redact_text(outcome.error.strip().splitlines()[-1])} if outcome.error else {}),
    }


def raise_if_failed(summary: dict[str, Any], run_dir: Path) -> None:
    if summary["status"] == "failed":
        raise TrainingFailed(
            f"training failed: {summary.get('error', 'unknown error')} (details: {run_dir / 'error.log'})"
        )
