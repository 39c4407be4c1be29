"""``trainforge bench recovery``: seconds from a fault to the next completed training step.

Faults are real, on one local Ray, 2 workers of bench/workload.py's small CNN, a checkpoint every
``CHECKPOINT_EVERY`` steps; the fault comes once step ``FAULT_AFTER`` is checkpointed:

- **killed**: SIGKILL of one training worker process;
- **frozen**: SIGSTOP of one (a stuck collective, a frozen host look the same to its peers).

Each through two peers:

- **trainforge** (``trainforge.fit``): with the whole group restarted (``failure.replace: group``,
  the default) and with only the failed worker replaced (``failure.replace: worker``: the survivors
  keep their processes); for a frozen worker with its hang detection (issue 37:
  ``failure.hang: {floor_s: 3, warmup_steps: 5}``, the ceiling at 60 s), and once more with it off
  and ``failure.collective_timeout_s: 10``, the path every run took before;
- **Ray Train alone**: an idiomatic ``TorchTrainer`` loop that checkpoints with
  ``ray.train.report`` and restores from ``ray.train.get_checkpoint()``; a frozen worker is found
  by its process group's timeout (``TorchConfig(timeout_s=10)``).

The next step is the first step completed after the fault, by the restarted group: trainforge's
first report after its restore (the loop reports right after that step), Ray Train's rank 0's
step log. Lost nodes need a cluster of several nodes: tests/faults/test_nodes.py measures them
on network namespaces (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from rich import box
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

import trainforge
from trainforge.bench.peers import POLL_ENV, POLL_INTERVAL_S, local_ray, machine, python_path, restore_env
from trainforge.bench.workload import Workload, build, make_optimizer
from trainforge.errors import TrainforgeError

FAULTS = ("killed", "frozen", "lost")
CHECKPOINT_EVERY = 10
FAULT_AFTER = 20
TOTAL_STEPS = 60
WORKERS = 2
FAULT_WAIT_S = 300.0  # for the step the fault follows
WHAT = {"killed": "killed worker", "frozen": "frozen worker", "lost": "lost node"}
WORKLOAD = Workload(batch_size=32, steps=TOTAL_STEPS, num_samples=4096)
SIGNALS = {"killed": signal.SIGKILL, "frozen": signal.SIGSTOP}
# A lost node: Ray's GCS declares a node dead after these missed health checks (period x threshold),
# what a cluster operator sets in ray start's _system_config (Ray's defaults take about 15 s).
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
ELASTIC = (1, WORKERS)  # a lost node's runs: they continue on the node left


@dataclass
class Measurement:
    fault: str
    peer: str
    setting: str
    seconds: float | None  # from the fault to the next completed step; None: no step came
    restarts: int | None = None


@dataclass
class Variant:
    peer: str
    setting: str
    run: Callable[[str, Path, Fault], float | None]  # the fault's kind, a scratch folder: seconds


class Fault:
    """A thread that signals one training worker of this process's Ray once ``due()`` holds, or
    (``lost``) kills every process of a ``cluster`` node that hosts one."""

    def __init__(self, kind: str, due: Callable[[], bool], cluster: Any = None) -> None:
        self.kind = kind
        self.due = due
        self.cluster = cluster
        self.at: float | None = None
        self.pid: int | None = None
        self.thread = threading.Thread(target=self._inject, name="trainforge-fault", daemon=True)
        self.thread.start()

    def _inject(self) -> None:
        deadline = time.monotonic() + FAULT_WAIT_S
        while not self.due():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        if self.kind == "lost":
            node = node_with_a_training_worker(self.cluster)
            if node is not None:
                self.at = time.time()
                self.cluster.remove_node(node, allow_graceful=False)  # SIGKILL of its raylet and workers
            return
        pids = training_workers()
        if not pids:
            return
        self.pid = max(pids)
        os.kill(self.pid, SIGNALS[self.kind])
        self.at = time.time()

    def close(self) -> None:
        """A frozen process that outlived the run is killed (its group is gone)."""
        self.thread.join(timeout=1)
        if self.pid is not None and self.kind == "frozen":
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


def training_workers() -> list[int]:
    """This process's Ray Train workers (descendants only: never another job's)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("RayTrainWorker" in part for part in process.cmdline()):
                found.append(process.pid)
    return found


def node_with_a_training_worker(cluster: Any) -> Any:
    """A worker node of ``cluster`` whose raylet runs a Ray Train worker (None: none does)."""
    for node in cluster.worker_nodes:
        raylet = node.all_processes["raylet"][0].process.pid
        with contextlib.suppress(psutil.Error):
            if any(
                "RayTrainWorker" in " ".join(child.cmdline())
                for child in psutil.Process(raylet).children(recursive=True)
            ):
                return node
    return None


@contextlib.contextmanager
def node_cluster() -> Iterator[Any]:
    """A Ray cluster of nodes on this machine (``ray.cluster_utils.Cluster``): a head without CPUs
    (the driver's, where no training worker lands) and, per measurement, two 1-CPU worker nodes.
    Its files live in a temporary directory of its own, so no other ``ray.init`` here joins it."""
    import ray
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="tfbench-", dir="/tmp")  # short: Ray's socket paths live under it
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", POLL_ENV, "PYTHONPATH")}
    os.environ.update(RAY_TMPDIR=temp_dir, PYTHONPATH=python_path())
    os.environ[POLL_ENV] = POLL_INTERVAL_S
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH},
    )
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        restore_env(saved)
        shutil.rmtree(temp_dir, ignore_errors=True)


def two_nodes(cluster: Any) -> None:
    """Two live, idle 1-CPU worker nodes (a lost node is added back for the next measurement)."""
    import ray

    while len(cluster.worker_nodes) < WORKERS:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    deadline = time.monotonic() + FAULT_WAIT_S
    while ray.available_resources().get("CPU", 0) < WORKERS:  # the last run's workers, released late
        if time.monotonic() > deadline:
            raise TrainforgeError(f"bench recovery: the node cluster did not free {WORKERS} CPUs")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# trainforge


def trainforge_run(failure: dict[str, Any], workers: Any = WORKERS) -> Callable[[str, Path, Fault], float | None]:
    def run(kind: str, scratch: Path, fault: Fault) -> float | None:
        config = WORKLOAD.trainforge_config(workers, "recovery", str(scratch))
        config["train"] = {**config["train"], "max_steps": TOTAL_STEPS}
        config["checkpoint"] = {"every_n_steps": CHECKPOINT_EVERY, "keep_last": 3}
        config["failure"] = {"max_failures": 2, **failure}
        config["tracking"] = {"enabled": False}
        trainforge.fit(config, console=Console(file=io.StringIO()))  # the bench's own lines only
        return next_trainforge_step(scratch / "recovery" / "metrics.jsonl", fault.at)

    return run


def next_trainforge_step(metrics: Path, fault_at: float | None) -> float | None:
    """Seconds from the fault to the first report after it that says the run resumed."""
    if fault_at is None or not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        resumed = any(str(event.get("text", "")).startswith("resumed from") for event in record.get("events", []))
        at = record.get("time/unix")
        if resumed and isinstance(at, (int, float)) and at > fault_at:
            return float(at) - fault_at
    return None


def checkpointed(folder: Path, step: int) -> Callable[[], bool]:
    return lambda: (folder / f"checkpoint_{step:09d}").is_dir()


# ---------------------------------------------------------------------------------------------
# Ray Train alone


def ray_train_recovery_loop(config: dict[str, Any]) -> None:
    """An idiomatic Ray Train loop that checkpoints every CHECKPOINT_EVERY steps and restores from
    the newest; rank 0 appends ``step unix-time`` to ``steps_file`` after every step."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    workload = Workload.from_json(config["workload"])
    steps_file = Path(config["steps_file"])
    context = ray.train.get_context()
    dataset, model = build(workload)
    step, state = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        step = int(state["step"])
    model = ray.train.torch.prepare_model(model)
    optimizer = make_optimizer(model)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(dataset, batch_size=workload.batch_size, shuffle=True, drop_last=True)
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    while step < TOTAL_STEPS:
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            step += 1
            if context.get_world_rank() == 0:
                with steps_file.open("a") as handle:
                    handle.write(f"{step} {time.time()}\n")
            if step % CHECKPOINT_EVERY == 0:
                report_checkpoint(step, model, optimizer, context.get_world_rank())
            if step >= TOTAL_STEPS:
                break


def report_checkpoint(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    import ray.train

    if rank != 0:
        ray.train.report({"step": step})
        return
    with tempfile.TemporaryDirectory() as folder:
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        state = {"model": inner.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, Path(folder) / "state.pt")
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(folder))


def ray_train_run(timeout_s: int, workers: Any = WORKERS) -> Callable[[str, Path, Fault], float | None]:
    def run(kind: str, scratch: Path, fault: Fault) -> float | None:
        import ray.train
        from ray.train.torch import TorchConfig, TorchTrainer

        steps_file = scratch / "steps.txt"
        trainer = TorchTrainer(
            ray_train_recovery_loop,
            train_loop_config={"workload": WORKLOAD.to_json(), "steps_file": str(steps_file)},
            torch_config=TorchConfig(timeout_s=timeout_s),
            scaling_config=ray.train.ScalingConfig(num_workers=workers),
            run_config=ray.train.RunConfig(
                name="recovery",
                storage_path=str(scratch / "ray"),
                failure_config=ray.train.FailureConfig(max_failures=2),
            ),
        )
        trainer.fit()
        return next_logged_step(steps_file, fault.at)

    return run


def logged_step(steps_file: Path, step: int) -> Callable[[], bool]:
    def due() -> bool:
        with contextlib.suppress(OSError, ValueError):
            lines = steps_file.read_text().split("\n")[:-1]  # the last piece may be a line cut short
            return any(int(line.split()[0]) >= step for line in lines)
        return False

    return due


def next_logged_step(steps_file: Path, fault_at: float | None) -> float | None:
    """Seconds from the fault to the restarted group's first step: the first step after the fault
    that goes back (the new group redoes the steps since the checkpoint), else the first after it
    (rank 0 may finish a step in flight when another node goes, before its group fails)."""
    if fault_at is None or not steps_file.is_file():
        return None
    logged = [
        (int(step), float(at)) for step, at in (line.split() for line in steps_file.read_text().splitlines() if line)
    ]
    after = [(i, at) for i, (_, at) in enumerate(logged) if at > fault_at]
    if not after:
        return None
    again = [at for i, at in after if i > 0 and logged[i][0] <= logged[i - 1][0]]
    return (again[0] if again else after[0][1]) - fault_at


# ---------------------------------------------------------------------------------------------
# The bench


def variants(kind: str) -> list[Variant]:
    if kind == "lost":
        return [
            Variant("trainforge", "elastic [1, 2]", trainforge_run({}, list(ELASTIC))),
            Variant("Ray Train alone", "elastic (1, 2)", ray_train_run(timeout_s=300, workers=ELASTIC)),
        ]
    if kind == "killed":
        return [
            Variant("trainforge", "", trainforge_run({})),
            Variant("trainforge", "failure.replace: worker", trainforge_run({"replace": "worker"})),
            Variant("Ray Train alone", "", ray_train_run(timeout_s=300)),
        ]
    return [
        Variant(
            "trainforge",
            "hang detection (floor 3 s)",
            trainforge_run({"collective_timeout_s": 60, "hang": {"floor_s": 3, "warmup_steps": 5}}),
        ),
        Variant(
            "trainforge",
            "hang detection (floor 3 s), failure.replace: worker",
            trainforge_run(
                {"replace": "worker", "collective_timeout_s": 60, "hang": {"floor_s": 3, "warmup_steps": 5}}
            ),
        ),
        Variant(
            "trainforge",
            "hang detection off, collective timeout 10 s",
            trainforge_run({"collective_timeout_s": 10, "hang": {"enabled": False}}),
        ),
        Variant("Ray Train alone", "process group timeout 10 s", ray_train_run(timeout_s=10)),
    ]


def measure(kind: str, variant: Variant, scratch: Path, cluster: Any = None) -> Measurement:
    scratch.mkdir(parents=True, exist_ok=True)
    if variant.peer == "trainforge":
        due = checkpointed(scratch / "recovery", FAULT_AFTER)
    else:
        due = logged_step(scratch / "steps.txt", FAULT_AFTER)
    if cluster is not None:
        two_nodes(cluster)
    fault = Fault(kind, due, cluster)
    try:
        seconds = variant.run(kind, scratch, fault)
    finally:
        fault.close()
    return Measurement(kind, variant.peer, variant.setting, round(seconds, 2) if seconds is not None else None)


def run_bench(
    faults: list[str], repeats: int, output: Path | None, console: Console, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    measurements: list[Measurement] = []
    on_one_node = [kind for kind in faults if kind != "lost"]
    with tempfile.TemporaryDirectory(prefix="trainforge-recovery-") as root:
        # A worker's faults in one local Ray; a lost node's in a cluster of nodes on this machine.
        for kinds, place in ((on_one_node, local_ray), (["lost"] if "lost" in faults else [], node_cluster)):
            if not kinds:
                continue
            with place() as cluster:
                for repeat in range(repeats):
                    for kind in kinds:
                        for index, variant in enumerate(variants(kind)):
                            label = f"{WHAT[kind]}, {variant.peer}{f' ({variant.setting})' if variant.setting else ''}"
                            progress(f"[{repeat + 1}/{repeats}] {label} ...")
                            found = measure(kind, variant, Path(root) / f"{kind}-{index}-{repeat}", cluster)
                            progress(f"    {found.seconds if found.seconds is not None else 'no step'} s")
                            measurements.append(found)
    rows = summarise(measurements)
    console.print(table(rows))
    if output is not None:
        document = {"machine": machine(), "rows": rows, "measurements": [asdict(m) for m in measurements]}
        output.write_text(json.dumps(document, indent=2) + "\n")
    return rows


def summarise(measurements: list[Measurement]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str, str], list[float | None]] = {}
    for found in measurements:
        rows.setdefault((found.fault, found.peer, found.setting), []).append(found.seconds)
    summary = []
    for (fault, peer, setting), values in rows.items():
        measured = [value for value in values if value is not None]
        median = statistics.median(measured) if measured else None
        summary.append(
            {
                "fault": fault,
                "peer": peer,
                "setting": setting,
                "seconds": median,
                "runs": len(values),
                "without_a_next_step": len(values) - len(measured),
            }
        )
    return summary


def table(rows: list[dict[str, Any]]) -> Table:
    shown = Table(title="From the fault to the next completed step (median)", box=box.SIMPLE_HEAD)
    for column in ("fault", "peer", "setting", "seconds", "runs"):
        shown.add_column(column, justify="right" if column in ("seconds", "runs") else "left")
    for row in rows:
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else "no step"
        shown.add_row(WHAT[row["fault"]], row["peer"], row["setting"] or "-", seconds, str(row["runs"]))
    return shown
