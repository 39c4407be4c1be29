"""``trainforge bench data``: one epoch of a generated parquet image data set, streamed through trainforge.

The data set (bench/imageset.py): PNG images of ``image_size`` pixels in parquet files of about
192 MB. The stream decodes each image and resizes it to 32 x 32 (``data.image_size``), the input of
the other benchmarks' ``small_cnn``, so the bytes per sample are an image data set's while the
model stays small. In the same run, on the same files:

* cold read: every file's pages evicted (``posix_fadvise(DONTNEED)``, which leaves other processes'
  caches alone), then every file read once, sequentially: what the disk (or the S3 endpoint)
  delivers with nothing else running;
* the epoch: ``trainforge.fit`` with ``data.name: parquet``, ``small_cnn``, ``workers`` workers,
  one epoch, the files evicted again first; samples/s, and the data-wait share of step time from
  the run's own ``metrics.jsonl`` (``perf/data_wait_s`` against ``perf/step_time_s``);
* memory: every 0.5 s, the resident memory of every process under this one (the local Ray this
  benchmark starts: its daemons, the train workers, the processes running Ray Data's tasks and its
  split coordinator) and the object store's use, read from the raylet.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from trainforge.bench.imageset import (
    GB,
    MB,
    NUM_CLASSES,
    DataSet,
    DataSetSpec,
    cold_read,
    evict,
    generate,
    s3_endpoint,
    s3_read,
    upload,
)
from trainforge.consoles import make_console
from trainforge.errors import TrainforgeError

TRAIN_SIZE = 32  # the stream resizes every image to this (data.image_size)
BATCH_SIZE = 64  # per worker
SAMPLE_INTERVAL_S = 0.5
PROGRESS_EVERY_S = 20.0
DATA_WAIT_GOAL = 0.05


class BenchFailed(TrainforgeError):
    """The benchmark's run failed or measured nothing."""

    exit_code = 1


# ----------------------------------------------------------------------------------------------
# Memory while the epoch runs


ROLES = ("train worker", "train controller", "ray data", "idle ray worker", "ray daemons", "driver")


def role_of(title: str) -> str:
    """What a process under this one is, from its title (Ray names its workers ``ray::<what runs>``).
    Every ``ray::`` task or actor other than Ray Train's is Ray Data's: nothing else runs here."""
    if "RayTrainWorker" in title:
        return "train worker"
    if "TrainController" in title:
        return "train controller"
    if title.startswith("ray::IDLE"):
        return "idle ray worker"
    if title.startswith("ray::"):
        return "ray data"
    return "ray daemons"


@dataclass
class ProcessPeak:
    pid: int
    role: str
    rss: int = 0
    anon: int = 0  # resident minus shared (file pages and the object store's shared memory)
    cpu_s: float = 0.0  # user + system seconds so far


@dataclass
class Sampler:
    """Peak resident memory of every process under this one, and the object store's use, every
    ``interval_s``; ``tick`` is called every ``PROGRESS_EVERY_S`` from the same thread."""

    interval_s: float = SAMPLE_INTERVAL_S
    tick: Callable[[Sampler], None] = lambda _: None
    peaks: dict[int, ProcessPeak] = field(default_factory=dict)
    role_sum_peaks: dict[str, int] = field(default_factory=dict)
    store_peak: int = 0
    store_capacity: int = 0
    spilled: int = 0
    store_error: str = ""
    samples: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-data-sampler", daemon=True)
        self._store = object_store_reader()

    @contextlib.contextmanager
    def running(self) -> Iterator[Sampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self.sample()

    def _loop(self) -> None:
        last_tick = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.sample()
            if time.monotonic() - last_tick >= PROGRESS_EVERY_S:
                last_tick = time.monotonic()
                self.tick(self)

    def sample(self) -> None:
        me = psutil.Process()
        sums: dict[str, int] = {}
        for process in [me, *me.children(recursive=True)]:
            try:
                with process.oneshot():
                    title = "driver" if process.pid == me.pid else " ".join(process.cmdline())
                    memory = process.memory_info()
                    cpu = process.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            role = "driver" if process.pid == me.pid else role_of(title)
            peak = self.peaks.setdefault(process.pid, ProcessPeak(process.pid, role))
            if ROLES.index(role) < ROLES.index(peak.role):  # an idle worker that later ran a task
                peak.role = role
            peak.rss = max(peak.rss, memory.rss)
            peak.anon = max(peak.anon, memory.rss - getattr(memory, "shared", 0))
            peak.cpu_s = max(peak.cpu_s, cpu.user + cpu.system)
            sums[peak.role] = sums.get(peak.role, 0) + memory.rss
        for role, total in sums.items():
            self.role_sum_peaks[role] = max(self.role_sum_peaks.get(role, 0), total)
        try:
            used, capacity, spilled = self._store()
            self.store_peak, self.store_capacity = max(self.store_peak, used), capacity
            self.spilled = max(self.spilled, spilled)
        except Exception as err:  # a private Ray API: a changed reply must not end the benchmark
            self.store_error = f"{type(err).__name__}: {err}"
        self.samples += 1

    def cpu_s(self, role: str) -> float:
        """CPU seconds the processes of ``role`` used, as last sampled."""
        return sum(p.cpu_s for p in self.peaks.values() if p.role == role)

    def of_role(self, role: str) -> list[ProcessPeak]:
        return sorted((p for p in self.peaks.values() if p.role == role), key=lambda p: -p.rss)


def object_store_reader() -> Callable[[], tuple[int, int, int]]:
    """(bytes used, capacity, bytes spilled so far) of the cluster's object stores, from the raylet
    (what ``ray memory --stats-only`` prints; Ray has no public API for it)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)

    def read() -> tuple[int, int, int]:
        stats = get_memory_info_reply(state, timeout_seconds=10).store_stats
        return int(stats.object_store_bytes_used), int(stats.object_store_bytes_avail), int(stats.spilled_bytes_total)

    return read


# ----------------------------------------------------------------------------------------------
# The epoch


def run_config(path: str, workers: int, scratch: Path) -> dict[str, Any]:
    """One epoch of ``small_cnn`` on the streamed files: no validation, no tracking or Prometheus
    (observing is measured by bench peers), one checkpoint at the end."""
    return {
        "run": {"name": "bench-data", "output_dir": str(scratch)},
        "model": {"name": "small_cnn"},
        "data": {
            "name": "parquet",
            "path": path,
            "image_size": TRAIN_SIZE,
            "num_classes": NUM_CLASSES,
            "val_fraction": 0.0,
        },
        "train": {"max_steps": None, "epochs": 1, "batch_size": BATCH_SIZE, "log_every_n_steps": 20},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "scaling": {"num_workers": workers},
        "tracking": {"enabled": False},
        "metrics": {"enabled": False},
        "failure": {"max_failures": 0},
        "seed": 0,
    }


@dataclass(frozen=True)
class StepSplit:
    """Per-step seconds over the epoch, as the workers timed them (averaged over ranks)."""

    steps: int
    data_wait_s: float
    step_s: float
    steady_data_wait_s: float  # without the first report interval, which waits for Ray Data to start
    steady_step_s: float

    @property
    def share(self) -> float:
        return self.data_wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def steady_share(self) -> float | None:
        """None when the epoch had a single report interval."""
        return self.steady_data_wait_s / self.steady_step_s if self.steady_step_s > 0 else None


def step_split(metrics_jsonl: Path) -> StepSplit:
    """Data wait against step time from every report interval of ``metrics.jsonl``, weighted by
    its steps."""
    points: dict[int, tuple[float, float]] = {}
    for line in metrics_jsonl.read_text().splitlines():
        record = json.loads(line)
        for point in record.get("history", []):
            points[int(point["step"])] = (float(point["perf/data_wait_s"]), float(point["perf/step_time_s"]))
    wait = total = steady_wait = steady_total = 0.0
    previous = 0
    for index, step in enumerate(sorted(points)):
        steps = step - previous
        previous = step
        wait += points[step][0] * steps
        total += points[step][1] * steps
        if index > 0:
            steady_wait += points[step][0] * steps
            steady_total += points[step][1] * steps
    return StepSplit(previous, wait, total, steady_wait, steady_total)


def last_report(metrics_jsonl: Path) -> dict[str, Any]:
    """The newest report line (read from the end: the file grows with the run)."""
    with contextlib.suppress(OSError), open(metrics_jsonl, "rb") as handle:
        handle.seek(max(0, handle.seek(0, os.SEEK_END) - 65536))
        for line in reversed(handle.read().splitlines()):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if "step" in record:
                    return dict(record)
    return {}


def epoch_progress(run_dir: Path, show: Callable[[str], None]) -> Callable[[Sampler], None]:
    started = time.monotonic()

    def tick(sampler: Sampler) -> None:
        report = last_report(run_dir / "metrics.jsonl")
        where = "starting (counting rows, starting workers and Ray Data)"
        if report:
            done = report["step"] / max(report["total_steps"], 1)
            rate = report["perf/samples_per_s"]
            where = f"step {report['step']}/{report['total_steps']} ({done:.0%}), {rate:.0f} samples/s"
        workers = sampler.of_role("train worker")
        rss = max((p.rss for p in workers), default=0)
        show(
            f"  epoch {time.monotonic() - started:5.0f} s: {where}; train worker RSS peak {rss / GB:.2f} GB, "
            f"object store peak {sampler.store_peak / GB:.2f} GB"
        )

    return tick


@contextlib.contextmanager
def local_ray(workers: int, env: dict[str, str]) -> Iterator[None]:
    """A local Ray on loopback that ``trainforge.fit`` reuses: its processes are this one's children,
    which the sampler needs. ``env`` (S3 endpoint and credentials) is set before it starts, so
    every worker sees it."""
    import ray

    from trainforge.driver.ray_session import LOOPBACK, bound_to

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with bound_to(LOOPBACK):
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, workers + 1, 4),  # what trainforge train would start
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        yield
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ----------------------------------------------------------------------------------------------
# The benchmark


def default_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainforge" / "bench-data"


def run_data_bench(
    *,
    size_gb: float = 10.0,
    image_size: int = 128,
    workers: int = 2,
    directory: Path | None = None,
    keep: bool = False,
    s3: bool = False,
    endpoint_url: str | None = None,
    output: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Generate (or reuse) the data set, read it cold, stream one epoch of it; print and return the report.

    The files are deleted at the end unless ``keep`` (a reused data set is left as it was found)."""
    shown = console or make_console()

    def say(text: str) -> None:
        shown.print(text, highlight=False)

    spec = DataSetSpec(size_gb, image_size, rows_multiple=BATCH_SIZE * workers)
    folder = (directory or default_folder()) / spec.folder_name
    say(
        f"bench data: {size_gb:g} GB of {image_size} x {image_size} PNG images in parquet, streamed "
        f"{'from S3' if s3 else 'from local disk'} through small_cnn (resized to {TRAIN_SIZE} x {TRAIN_SIZE}), "
        f"{workers} workers, batch {BATCH_SIZE} per worker, one epoch"
    )
    data = generate(spec, folder, say)
    try:
        report = measure(data, spec, workers, s3, endpoint_url, say)
    finally:
        if not keep and not data.reused:
            shutil.rmtree(folder, ignore_errors=True)
            say(f"deleted {folder} (--keep keeps it for the next run)")
    shown.print(results_table(report))
    say(goal_line(report))
    if output is not None:
        output.write_text(json.dumps(report, indent=1) + "\n")
    return report


def measure(
    data: DataSet, spec: DataSetSpec, workers: int, s3: bool, endpoint_url: str | None, say: Callable[[str], None]
) -> dict[str, Any]:
    from trainforge.api import fit
    from trainforge.bench.peers import machine

    uri = f"s3://trainforge-bench/{spec.folder_name}" if s3 else str(data.folder)
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="trainforge-bench-data-"))
        env = stack.enter_context(s3_endpoint(endpoint_url)) if s3 else {}
        with local_ray(workers, env):
            if s3:
                upload(data, uri, say)
                read = s3_read(uri)
            else:
                read = cold_read(data.files)
                evict(data.files)  # the epoch reads cold too
            say(
                f"cold read: {read.bytes / GB:.2f} GB in {read.seconds:.1f} s, {read.gb_per_s:.2f} GB/s ({read.method})"
            )
            run_dir = Path(scratch) / "bench-data"
            with Sampler(tick=epoch_progress(run_dir, say)).running() as sampler:
                started = time.monotonic()
                result = fit(run_config(uri, workers, Path(scratch)), console=Console(file=io.StringIO()))
                epoch_s = time.monotonic() - started
            if result.status != "finished":
                raise BenchFailed(f"the epoch ended {result.status} (run in {run_dir})")
            split = step_split(run_dir / "metrics.jsonl")
            samples = int(result.summary["global_step"]) * BATCH_SIZE * workers
    return {
        "machine": {**machine(), "memory_gb": psutil.virtual_memory().total / GB},
        "data": {
            **asdict(spec),
            "where": uri if s3 else "local disk",
            "folder": str(data.folder),
            "files": len(data.files),
            "rows": data.rows,
            "bytes": data.bytes,
            "bytes_per_row": data.bytes / data.rows,
            "generate_s": data.generate_s,
            "reused": data.reused,
        },
        "read": {**asdict(read), "gb_per_s": read.gb_per_s},
        "epoch": {
            "workers": workers,
            "batch_size": BATCH_SIZE,
            "train_size": TRAIN_SIZE,
            "samples": samples,
            "steps": split.steps,
            "epoch_s": epoch_s,
            "samples_per_s": samples / epoch_s,
            "steady_samples_per_s": float(result.summary["throughput_samples_per_s"]),
            "ingest_mb_per_s": samples * data.bytes / data.rows / MB / epoch_s,
            "data_wait_share": split.share,
            "steady_data_wait_share": split.steady_share,
            **asdict(split),
        },
        "memory": memory_figures(sampler),
        "goals": {"data_wait_share": DATA_WAIT_GOAL},
    }


def memory_figures(sampler: Sampler) -> dict[str, Any]:
    workers = sampler.of_role("train worker")
    data = sampler.of_role("ray data")
    return {
        "train_worker_peak_rss": [p.rss for p in workers],
        "train_worker_peak_anon": [p.anon for p in workers],
        "ray_data_process_peak_rss": max((p.rss for p in data), default=0),
        "ray_data_process_peak_anon": max((p.anon for p in data), default=0),
        "ray_data_processes": len(data),
        "peak_rss_sum_by_role": sampler.role_sum_peaks,
        "cpu_s_by_role": {role: sampler.cpu_s(role) for role in ROLES},
        "object_store_peak": sampler.store_peak,
        "object_store_capacity": sampler.store_capacity,
        "object_store_spilled": sampler.spilled,
        "object_store_error": sampler.store_error,
        "samples": sampler.samples,
        "processes": [asdict(p) for p in sorted(sampler.peaks.values(), key=lambda p: (ROLES.index(p.role), -p.rss))],
    }


def results_table(report: dict[str, Any]) -> Table:
    data, read, epoch, memory = report["data"], report["read"], report["epoch"], report["memory"]
    table = Table(title=f"bench data: {data['bytes'] / GB:.2f} GB, {data['rows']:,} rows", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    gb = [f"{rss / GB:.2f}" for rss in memory["train_worker_peak_rss"]]
    anon = [f"{rss / GB:.2f}" for rss in memory["train_worker_peak_anon"]]
    sums, cpu = memory["peak_rss_sum_by_role"], memory["cpu_s_by_role"]
    samples = max(epoch["samples"], 1)
    rows = [
        ("files, bytes per row", f"{data['files']}, {data['bytes_per_row'] / 1000:.1f} kB"),
        ("generation", "reused" if data["reused"] else f"{data['generate_s']:.0f} s"),
        ("cold read", f"{read['gb_per_s']:.2f} GB/s"),
        ("epoch", f"{epoch['epoch_s']:.0f} s, {epoch['samples']:,} samples"),
        (
            "samples/s (whole epoch; steady, from step 5)",
            f"{epoch['samples_per_s']:.0f}; {epoch['steady_samples_per_s']:.0f}",
        ),
        ("ingest", f"{epoch['ingest_mb_per_s']:.1f} MB/s"),
        (
            "data wait / step time (whole; after the first report)",
            f"{epoch['data_wait_share']:.1%}; {percent(epoch['steady_data_wait_share'])}",
        ),
        ("peak RSS per train worker (of it not shared)", f"{' / '.join(gb)} GB ({' / '.join(anon)} GB)"),
        (
            "peak RSS of a Ray Data process (not shared), processes",
            f"{memory['ray_data_process_peak_rss'] / GB:.2f} GB ({memory['ray_data_process_peak_anon'] / GB:.2f} GB), "
            f"{memory['ray_data_processes']}",
        ),
        ("peak RSS, all Ray Data processes", f"{sums.get('ray data', 0) / GB:.2f} GB"),
        (
            "object store peak / capacity",
            f"{memory['object_store_peak'] / GB:.2f} / {memory['object_store_capacity'] / GB:.2f} GB",
        ),
        ("object store spilled", f"{memory['object_store_spilled'] / GB:.2f} GB"),
        (
            "peak RSS, Ray's daemons / this process",
            f"{sums.get('ray daemons', 0) / GB:.2f} / {sums.get('driver', 0) / GB:.2f} GB",
        ),
        (
            "CPU ms per sample: Ray Data (read, decode) / train workers",
            f"{cpu.get('ray data', 0) * 1000 / samples:.2f} / {cpu.get('train worker', 0) * 1000 / samples:.2f}",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def goal_line(report: dict[str, Any]) -> str:
    epoch = report["epoch"]
    share, steady = epoch["data_wait_share"], epoch["steady_data_wait_share"]
    verdict = "pass" if share <= DATA_WAIT_GOAL else "miss"
    return (
        f"goal data wait <= {DATA_WAIT_GOAL:.0%} of step time at {epoch['workers']} workers: {verdict} "
        f"({share:.1%} over the epoch, {percent(steady)} after the first report interval)"
    )


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"
