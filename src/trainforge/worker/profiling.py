"""``profile: {steps: [START, END], ranks: [...]}``: a torch.profiler trace of a few optimizer steps.

On each listed rank the profiler (CPU activities, and CUDA when the rank has a GPU) starts before
step START and stops after step END (1-based optimizer steps, inclusive). The rank then writes,
under ``profile/`` in the run's checkpoint storage (the same place as its checkpoints, so it works
wherever checkpoints do: a local run directory, NFS, S3):

* ``rank<R>.trace.json``: the Chrome/Perfetto trace (``export_chrome_trace``; open it in
  https://ui.perfetto.dev or chrome://tracing);
* ``rank<R>.summary.json``: the top operators by self time (calls, self CPU and CUDA time) and the
  communication share: the time collectives (c10d, gloo, NCCL) were running, their intervals
  merged, over the profiled wall time.

With the default storage the checkpoint store is the run directory; otherwise the driver copies
``profile/`` into the run directory when the run ends (``fetch_profiles``), where the report and
MLflow find it. A run resumed past START records nothing; one that ends before END writes what it
recorded. Profiling costs time: the profiled steps are slower and the trace's writing is training
time, so a profiled run's throughput figures are not representative.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
import torch
from torch.profiler import ProfilerActivity, profile

if TYPE_CHECKING:
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.worker.build import WorkerRun

log = logging.getLogger("trainforge.worker")

PROFILE_DIR = "profile"
TOP_OPERATORS = 15
# Collectives as the profiler names them: c10d's ops (c10d::allreduce_, ...), gloo's and NCCL's own
# (gloo:all_reduce, nccl:all_reduce, ncclDevKernel_AllReduce...), and DDP/FSDP's record_param_comms.
COMM_PATTERN = re.compile(r"^(c10d::|gloo:|nccl:|ncclDevKernel|ncclKernel|record_param_comms)", re.IGNORECASE)


def trace_name(rank: int) -> str:
    return f"rank{rank}.trace.json"


def summary_name(rank: int) -> str:
    return f"rank{rank}.summary.json"


@dataclass
class Interval:
    start_us: float
    end_us: float


def merged_length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of ``intervals`` (nested collectives count once)."""
    total = 0.0
    current: Interval | None = None
    for item in sorted(intervals, key=lambda i: i.start_us):
        if current is None or item.start_us > current.end_us:
            if current is not None:
                total += current.end_us - current.start_us
            current = Interval(item.start_us, item.end_us)
        else:
            current.end_us = max(current.end_us, item.end_us)
    if current is not None:
        total += current.end_us - current.start_us
    return total


def top_operators(averages: Any, limit: int = TOP_OPERATORS) -> list[dict[str, Any]]:
    """The operators with the most self time (device time first when there is any), from
    ``profile.key_averages()``: name, calls, self CPU ms, self CUDA ms, total CPU ms."""
    rows = []
    for item in averages:
        device_us = float(getattr(item, "self_device_time_total", 0.0) or 0.0)
        rows.append(
            {
                "name": str(item.key),
                "calls": int(item.count),
                "self_cpu_ms": round(float(item.self_cpu_time_total) / 1000.0, 4),
                "self_cuda_ms": round(device_us / 1000.0, 4),
                "cpu_total_ms": round(float(item.cpu_time_total) / 1000.0, 4),
            }
        )
    rows.sort(key=lambda r: (r["self_cuda_ms"], r["self_cpu_ms"]), reverse=True)
    return rows[:limit]


def comm_share(events: Any, wall_us: float) -> float:
    """The fraction of the profiled wall time during which a collective was running (any thread,
    or the device), intervals merged; 0 without collectives."""
    comm = [
        Interval(float(e.time_range.start), float(e.time_range.end)) for e in events if COMM_PATTERN.match(str(e.name))
    ]
    if wall_us <= 0:
        return 0.0
    return min(1.0, merged_length(comm) / wall_us)


@dataclass
class StepProfiler:
    """Profiles optimizer steps ``start``..``end`` on this rank; off when the rank is not listed."""

    start: int = 0
    end: int = -1
    rank: int = 0
    store: CheckpointStore | None = None
    cuda: bool = False
    recorder: Any = field(default=None, init=False)
    started_at: float = field(default=0.0, init=False)
    done: bool = field(default=False, init=False)

    @classmethod
    def for_run(cls, run: WorkerRun, store: CheckpointStore) -> StepProfiler:
        spec = run.config.profile
        if spec is None or run.rank not in spec.ranks:
            return cls()
        return cls(spec.steps[0], spec.steps[1], run.rank, store, run.device.type == "cuda")

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def at_step(self, completed: int) -> None:
        """Called with the optimizer steps completed: before the first step, then after each."""
        if not self.enabled or self.done:
            return
        if self.recorder is None and completed == self.start - 1:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.recorder = profile(activities=activities, record_shapes=True)
            self.recorder.start()
            self.started_at = time.perf_counter()
            log.info("profiling steps %d..%d on rank %d", self.start, self.end, self.rank)
        elif self.recorder is not None and completed >= self.end:
            self.finish()

    def finish(self) -> None:
        """Stop and write what was recorded (the run may end before END)."""
        if self.recorder is None or self.done:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - self.started_at) * 1e6
        self.recorder.stop()
        self.done = True
        recorder, self.recorder = self.recorder, None
        summary = {
            "rank": self.rank,
            "steps": [self.start, self.end],
            "wall_ms": round(wall_us / 1000.0, 3),
            "comm_share": round(comm_share(recorder.events(), wall_us), 6),
            "device": "cuda" if self.cuda else "cpu",
            "top_operators": top_operators(recorder.key_averages()),
        }
        self._write(recorder, summary)

    def _write(self, recorder: Any, summary: dict[str, Any]) -> None:
        assert self.store is not None  # enabled
        with tempfile.TemporaryDirectory(prefix="trainforge-profile-") as scratch:
            trace = Path(scratch) / trace_name(self.rank)
            recorder.export_chrome_trace(str(trace))
            table = Path(scratch) / summary_name(self.rank)
            table.write_text(json.dumps(summary, indent=1))
            for local in (trace, table):
                self.store.upload(local, PROFILE_DIR, local.name)
        log.info("profile of rank %d written to %s", self.rank, self.store.uri(PROFILE_DIR))


def fetch_profiles(store: CheckpointStore, run_dir: Path) -> list[Path]:
    """Copy the run's ``profile/`` files from its checkpoint store into ``run_dir/profile`` (the
    driver, at the end of the run); nothing to do when the store is the run directory."""
    source = store.path(PROFILE_DIR)
    target = run_dir / PROFILE_DIR
    if store.is_local and Path(source).resolve() == target.resolve():
        return sorted(target.glob("rank*.json")) if target.is_dir() else []
    selector = pafs.FileSelector(source, recursive=False, allow_not_found=True)
    infos = [info for info in store.fs.get_file_info(selector) if info.type == pafs.FileType.File]
    copied = []
    for info in infos:
        if not re.fullmatch(r"rank\d+\.(trace|summary)\.json", info.base_name):
            continue
        target.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(info.path, str(target / info.base_name), store.fs, pafs.LocalFileSystem())
        copied.append(target / info.base_name)
    return sorted(copied)


def read_summaries(run_dir: Path) -> list[dict[str, Any]]:
    """The ``rank<R>.summary.json`` files of a run directory, by rank; unreadable ones left out."""
    found = []
    for path in sorted((run_dir / PROFILE_DIR).glob("rank*.summary.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("top_operators"), list):
            found.append(data)
    return sorted(found, key=lambda d: int(d.get("rank", 0)))
