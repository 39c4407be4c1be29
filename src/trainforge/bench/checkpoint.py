"""``trainforge bench checkpoint``: checkpoint save and load of a given size, through trainforge's own code.

A stack of ``Linear(1024, 1024)`` layers of the requested size is trained with Adam (whose two
moments double the bytes), and each repeat measures, on the disk of ``--dir``:

* raw disk: one file as large as the checkpoint, 16 MiB buffered writes, then ``fsync``;
* sync save: the snapshot (``model_snapshot`` + ``snapshot_tensors``) + the component files and
  ``trainer_state.json`` (every file hashed while written, the files in parallel, each fsynced) +
  ``write_manifest_of`` + ``CheckpointStore.commit``,
  each phase timed; then one more ``fsync`` of every file, which should find nothing left to flush;
* load: ``CheckpointStore.verify``, then restore's reading half (``read_saved`` + ``load_state``
  of each component, ``checkpoint/reader.py``) into a second model and optimizer, from a cold page
  cache (the files' pages are evicted first);
* async save: a training loop keeps stepping; the stall is what the snapshot and
  ``CheckpointWriter.save_async`` cost the training thread, and the steps taken while the
  background thread writes are timed against steps without a save in flight.

Torch runs with the intra-op threads of a trainforge worker (``train.threads_per_worker``, 1).
MB means 10^6 bytes throughout. The median of the repeats is judged against the goals.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import trainforge
from trainforge.bench.machine import cpu_model
from trainforge.checkpoint.crypto import KEY_BYTES, FileCipher
from trainforge.checkpoint.format import write_json_hashed, write_manifest_of
from trainforge.checkpoint.hashing import DEFAULT_HASH, in_parallel
from trainforge.checkpoint.reader import load_state
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.schema import FULL, STATE_FILE
from trainforge.checkpoint.state import (
    Record,
    Snapshot,
    State,
    capture_rng,
    model_snapshot,
    snapshot_tensors,
    tensor_file,
    write_tensors,
)
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name, fsync_path
from trainforge.checkpoint.writer import CheckpointWriter, RotationPolicy, state_file
from trainforge.consoles import make_console
from trainforge.errors import TrainforgeError

MB = 1_000_000
WIDTH = 1024
BATCH = 16
RAW_CHUNK = 16 << 20
IDLE_STEPS = 4  # timed steps without a save in flight, after one warm-up step
MAX_STEPS_DURING_SAVE = 400
GOALS = {
    "save_s": ("sync save", "<", 30.0),
    "load_s": ("load", "<", 20.0),
    "stall_fraction": ("async stall / sync save", "<=", 0.10),
    "durable_write_fraction": ("save bandwidth / raw disk", ">=", 0.70),
}


class BenchFailed(TrainforgeError):
    """The benchmark cannot run here (memory, disk) or a save failed."""

    exit_code = 1


@dataclass
class Repeat:
    """Every figure of one repeat, in seconds and bytes."""

    raw_write_s: float = 0.0
    snapshot_s: float = 0.0
    write_state_s: float = 0.0
    manifest_s: float = 0.0
    commit_s: float = 0.0
    flush_s: float = 0.0
    verify_s: float = 0.0
    load_weights_s: float = 0.0
    load_optimizer_s: float = 0.0
    stall_s: float = 0.0
    background_s: float = 0.0
    idle_step_s: float = 0.0
    saving_step_s: float = 0.0
    steps_during_save: int = 0
    checkpoint_bytes: int = 0
    files: dict[str, int] = field(default_factory=dict)

    @property
    def save_s(self) -> float:
        return self.snapshot_s + self.write_state_s + self.manifest_s + self.commit_s

    @property
    def load_s(self) -> float:
        return self.verify_s + self.load_weights_s + self.load_optimizer_s

    def derived(self) -> dict[str, float]:
        disk_part = self.write_state_s + self.manifest_s + self.commit_s
        raw_bw = self.checkpoint_bytes / self.raw_write_s
        return {
            "save_s": self.save_s,
            "load_s": self.load_s,
            "stall_fraction": self.stall_s / self.save_s,
            "raw_write_MBps": raw_bw / MB,
            "save_write_MBps": self.checkpoint_bytes / disk_part / MB,
            "save_write_fraction": self.checkpoint_bytes / disk_part / raw_bw,
            "durable_write_MBps": self.checkpoint_bytes / (disk_part + self.flush_s) / MB,
            "durable_write_fraction": self.checkpoint_bytes / (disk_part + self.flush_s) / raw_bw,
            "step_slowdown": self.saving_step_s / self.idle_step_s - 1 if self.idle_step_s else 0.0,
        }


@dataclass
class Workload:
    """The model and optimizer being checkpointed, and a training step on them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layers: int
    step_count: int = 0
    previous: Snapshot | None = None

    @classmethod
    def of_size(cls, size_mb: float, seed: int = 0) -> Workload:
        layers = max(1, round(size_mb * MB / (4 * (WIDTH * WIDTH + WIDTH))))
        torch.manual_seed(seed)
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
        return cls(model, optimizer, layers)

    @property
    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def step(self) -> float:
        """One forward/backward/Adam step; its seconds."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        self.model(torch.randn(BATCH, WIDTH)).square().mean().backward()
        self.optimizer.step()
        self.step_count += 1
        return time.perf_counter() - started

    def snapshot(self) -> Snapshot:
        """What ``worker/saving.Checkpointing.save`` hands the writer, taken the same way: into the
        previous snapshot's host buffers when there is one (the caller has waited for its save)."""
        previous = self.previous.states if self.previous else {}
        states = {
            "model": State(tensors=model_snapshot(self.model, previous["model"].tensors if previous else None)),
            "optimizer": State(
                {"name": "adam"},
                snapshot_tensors(self.optimizer.state_dict(), previous["optimizer"].tensors if previous else None),
            ),
            "progress": State({"global_step": self.step_count, "samples_seen": self.step_count * BATCH}),
            "rng": State(rank_values=capture_rng()),
        }
        record = Record(
            plan="ddp",
            config={"bench": {"layers": self.layers, "width": WIDTH}},
            versions={"torch": torch.__version__, "trainforge": trainforge.__version__},
        )
        snap = Snapshot(self.step_count, 0, FULL, states, record=record, exports={"model.safetensors": "model"})
        self.previous = snap
        return snap


def run_checkpoint_bench(
    *,
    size_mb: float = 500,
    directory: Path | None = None,
    repeats: int = 3,
    output: Path | None = None,
    console: Console | None = None,
    hash_algorithm: str = DEFAULT_HASH,
    encrypt: bool = False,
) -> dict[str, Any]:
    """Measure ``repeats`` times, print the tables, return (and optionally write) the report.
    ``hash_algorithm``: the manifest hash of the sync save (``blake3``, the default, or ``sha256``);
    ``encrypt``: every checkpoint encrypted as ``checkpoint.encryption`` does (a random key, here)."""
    shown = console or make_console()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    try:
        cipher = FileCipher(os.urandom(KEY_BYTES), "bench checkpoint --encrypt") if encrypt else None
        return _run(size_mb, directory, repeats, output, shown, hash_algorithm, cipher)
    finally:
        torch.set_num_threads(threads_before)


def worker_threads() -> int:
    """The intra-op threads a trainforge worker trains with by default (``train.threads_per_worker``)."""
    from trainforge.config import TrainConfig

    return int(TrainConfig.model_fields["threads_per_worker"].default)


def _run(
    size_mb: float,
    directory: Path | None,
    repeats: int,
    output: Path | None,
    shown: Console,
    algorithm: str,
    cipher: FileCipher | None = None,
) -> dict[str, Any]:
    workload = Workload.of_size(size_mb)
    model_bytes = workload.model_bytes
    check_memory(model_bytes)
    with work_dir(directory) as where:
        check_disk(where, 3 * model_bytes)
        shown.print(
            f"bench checkpoint: {workload.layers} x Linear({WIDTH}, {WIDTH}) = {model_bytes / MB:.0f} MB of fp32 "
            f"weights, Adam state {2 * model_bytes / MB:.0f} MB; disk {describe_disk(where)}; "
            f"{torch.get_num_threads()} torch thread(s); {repeats} repeat(s); hash {algorithm}"
            f"{'; encrypted (AES-256-GCM)' if cipher else ''}",
            highlight=False,
        )
        target = Workload.of_size(size_mb, seed=1)  # what loads receive
        workload.step()  # Adam's moments exist from the first step on
        found: list[Repeat] = []
        for index in range(repeats):
            figures = measure_once(workload, target, where / f"r{index}", algorithm, cipher)
            found.append(figures)
            d = figures.derived()
            shown.print(
                f"  repeat {index + 1}/{repeats}: save {d['save_s']:.2f} s, load {d['load_s']:.2f} s, "
                f"stall {figures.stall_s:.2f} s, raw disk {d['raw_write_MBps']:.0f} MB/s",
                highlight=False,
            )
    medians = summarise(found)
    shown.print(goals_table(medians, repeats))
    shown.print(phases_table(found, repeats))
    report = {
        "machine": machine(),
        "workload": {
            "layers": workload.layers,
            "width": WIDTH,
            "model_MB": model_bytes / MB,
            "checkpoint_MB": found[0].checkpoint_bytes / MB,
            "files": found[0].files,
            "repeats": repeats,
            "directory": str(directory) if directory else tempfile.gettempdir(),
            "hash": algorithm,
            "encrypted": cipher is not None,
        },
        "goals": {key: {"what": what, "op": op, "goal": goal} for key, (what, op, goal) in GOALS.items()},
        "median": medians,
        "verdicts": {key: verdict(key, medians[key]) for key in GOALS},
        "repeats": [{**asdict(r), **r.derived()} for r in found],
    }
    if output is not None:
        output.write_text(json.dumps(report, indent=2) + "\n")
    return report


def measure_once(
    workload: Workload, target: Workload, where: Path, algorithm: str = DEFAULT_HASH, cipher: FileCipher | None = None
) -> Repeat:
    """One repeat: raw disk, sync save, cold load, async save while training; removes its files."""
    where.mkdir(parents=True)
    figures = Repeat()
    try:
        sync = CheckpointStore.from_uri(str(where / "sync"), cipher)
        sync_save(workload, sync, where / "scratch", figures, algorithm)
        figures.raw_write_s = raw_write(where / "raw.bin", figures.checkpoint_bytes)  # exactly the same size
        load(target, sync, checkpoint_name(workload.step_count), figures)
        shutil.rmtree(where / "sync")
        async_save(workload, CheckpointStore.from_uri(str(where / "async"), cipher), where / "scratch", figures)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return figures


def raw_write(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes sequentially in 16 MiB buffered writes and fsync them."""
    block = os.urandom(RAW_CHUNK)
    view = memoryview(block)
    started = time.perf_counter()
    with path.open("wb") as handle:
        left = size
        while left > 0:
            handle.write(view[: min(left, RAW_CHUNK)])
            left -= RAW_CHUNK
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def sync_save(
    workload: Workload, store: CheckpointStore, scratch: Path, figures: Repeat, algorithm: str = DEFAULT_HASH
) -> None:
    """The save path of ``CheckpointWriter``'s thread (one rank, full layout), phase by phase."""
    name = checkpoint_name(workload.step_count)
    started = time.perf_counter()
    snap = workload.snapshot()
    figures.snapshot_s = time.perf_counter() - started

    started = time.perf_counter()
    staging = store.staging_dir(name, scratch)
    jobs = {tensor_file(n, s.tensors): s.tensors for n, s in snap.states.items() if s.tensors is not None}
    cipher = store.cipher
    records = in_parallel(
        partial(write_tensors, staging / rel, tree, algorithm, cipher.sealer(rel) if cipher else None)
        for rel, tree in jobs.items()
    )
    written = dict(zip(jobs, records, strict=True))
    ranks = [{n: s.rank_values for n, s in snap.states.items() if s.rank_values is not None}]
    state = state_file(snap, ranks, written)
    written[STATE_FILE] = write_json_hashed(
        staging / STATE_FILE, state, algorithm, cipher.sealer(STATE_FILE) if cipher else None
    )
    figures.write_state_s = time.perf_counter() - started

    started = time.perf_counter()
    meta: dict[str, Any] = {"global_step": snap.step, "epoch": 0, "metrics": {}, "created_at": time.time()}
    meta["world_size"] = 1
    if cipher is not None:
        meta["encryption"] = cipher.record()
    manifest = write_manifest_of(staging, written, meta, algorithm=algorithm)
    figures.manifest_s = time.perf_counter() - started

    started = time.perf_counter()
    final = Path(store.commit(staging, name))
    figures.commit_s = time.perf_counter() - started
    del snap

    figures.files = {rel: int(entry["size"]) for rel, entry in manifest["files"].items()}
    figures.checkpoint_bytes = sum(figures.files.values())
    started = time.perf_counter()
    for path in final.iterdir():
        fsync_path(path)
    figures.flush_s = time.perf_counter() - started
    for path in final.iterdir():
        evict(path)


def load(target: Workload, store: CheckpointStore, name: str, figures: Repeat) -> None:
    """What restore does on rank 0: verify, then trainer state, weights and optimizer, read by
    the one reader restore uses."""
    started = time.perf_counter()
    check = store.verify(name)
    figures.verify_s = time.perf_counter() - started
    if not check.ok:
        raise BenchFailed(f"the checkpoint just saved does not verify: {'; '.join(check.problems)}")
    started = time.perf_counter()
    with store.opened(Path(store.path(name))) as directory:  # encrypted: decrypted first, counted in the load
        saved = read_saved(directory)
        weights = load_state(directory, saved, "model", rank=0, same_ranks=True, shards={})
        target.model.load_state_dict(weights.tensors, strict=True)
        figures.load_weights_s = time.perf_counter() - started
        started = time.perf_counter()
        optimizer = load_state(directory, saved, "optimizer", rank=0, same_ranks=True, shards={})
        target.optimizer.load_state_dict(optimizer.tensors)
        figures.load_optimizer_s = time.perf_counter() - started


def async_save(workload: Workload, store: CheckpointStore, scratch: Path, figures: Repeat) -> None:
    """Training steps go on while the manager writes in the background; time what the loop feels."""
    manager = CheckpointWriter(store, RotationPolicy(keep_last=1), scratch=scratch, cipher=store.cipher)
    # A first save, as a run's first checkpoint: later snapshots copy into its host buffers.
    manager.save_async(workload.snapshot())
    manager.wait()
    manager.collect()
    workload.step()
    figures.idle_step_s = statistics.median(workload.step() for _ in range(IDLE_STEPS))

    started = time.perf_counter()
    manager.save_async(workload.snapshot())
    figures.stall_s = time.perf_counter() - started

    during: list[float] = []
    outcomes = manager.collect()
    while not outcomes and len(during) < MAX_STEPS_DURING_SAVE:
        during.append(workload.step())
        outcomes = manager.collect()
    manager.close()
    outcomes += manager.collect()
    if not outcomes or outcomes[0].error:
        raise BenchFailed(f"the background save failed: {outcomes[0].error if outcomes else 'no outcome'}")
    figures.background_s = outcomes[0].seconds
    figures.steps_during_save = len(during)
    # The last step usually ends after the save did: count only steps that overlapped it fully.
    figures.saving_step_s = statistics.median(during[:-1] or during) if during else 0.0


def evict(path: Path) -> None:
    """Drop a (flushed) file's pages from the page cache, so the next read comes from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Preconditions and the place to write


@contextlib.contextmanager
def work_dir(directory: Path | None) -> Iterator[Path]:
    """A fresh folder on the chosen disk (a temp dir by default), removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="trainforge-bench-ckpt-", dir=directory))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def check_memory(model_bytes: int) -> None:
    # Model, gradients, two Adam moments, a snapshot of all three, a second model + optimizer to
    # load into, and the transient copy load_weights makes: about ten times the weights.
    needed = 10 * model_bytes
    available = psutil.virtual_memory().available
    if available < needed:
        raise BenchFailed(
            f"--size-mb {model_bytes / MB:.0f} needs about {needed / 1e9:.1f} GB of free memory, "
            f"{available / 1e9:.1f} GB are available; use a smaller --size-mb"
        )


def check_disk(where: Path, checkpoint_bytes: int) -> None:
    free = shutil.disk_usage(where).free
    if free < 2 * checkpoint_bytes:
        raise BenchFailed(
            f"{where} has {free / 1e9:.1f} GB free, the benchmark writes up to {2 * checkpoint_bytes / 1e9:.1f} GB "
            "at once; choose another --dir or a smaller --size-mb"
        )


def describe_disk(where: Path) -> str:
    """``/dev/vda (ext4) at /`` for the mount holding ``where``."""
    best = ("?", "?", "/")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if str(where).startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[2]):
                best = (device, fstype, mount)
    return f"{best[0]} ({best[1]}) at {best[2]}"


def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_GB": round(psutil.virtual_memory().total / 1e9, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "trainforge": trainforge.__version__,
    }


# ---------------------------------------------------------------------------------------------
# Summary and tables


def summarise(found: Sequence[Repeat]) -> dict[str, float]:
    """The median over repeats of every raw and derived figure."""
    rows = [{**{k: v for k, v in asdict(r).items() if isinstance(v, (int, float))}, **r.derived()} for r in found]
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def verdict(key: str, value: float) -> str:
    _, op, goal = GOALS[key]
    met = {"<": value < goal, "<=": value <= goal, ">=": value >= goal}[op]
    return "pass" if met else "miss"


def goals_table(m: dict[str, float], repeats: int) -> Table:
    table = Table(title=f"checkpoint I/O goals (median of {repeats})")
    for column in ("measure", "value", "goal", ""):
        table.add_column(column, justify="left" if column == "measure" else "right")
    rows = [
        ("save_s", "sync save (snapshot + write + hash + commit)", f"{m['save_s']:.2f} s", "< 30 s"),
        ("load_s", "load (verify + weights + optimizer, cold cache)", f"{m['load_s']:.2f} s", "< 20 s"),
        (
            "stall_fraction",
            "async save: training stall per save",
            f"{m['stall_s']:.2f} s = {m['stall_fraction']:.1%} of sync save",
            "<= 10%",
        ),
        (
            "durable_write_fraction",
            "save write bandwidth, made durable (+ fsync)",
            f"{m['durable_write_MBps']:.0f} MB/s = {m['durable_write_fraction']:.0%} of raw",
            ">= 70%",
        ),
    ]
    for key, what, value, goal in rows:
        result = verdict(key, m[key])
        table.add_row(what, value, goal, f"[green]{result}[/]" if result == "pass" else f"[red]{result}[/]")
    table.add_row(
        "save write bandwidth as saved (no fsync)",
        f"{m['save_write_MBps']:.0f} MB/s = {m['save_write_fraction']:.0%} of raw",
        "",
        "",
    )
    table.add_row("raw sequential write (16 MiB writes + fsync)", f"{m['raw_write_MBps']:.0f} MB/s", "", "")
    return table


def phases_table(found: Sequence[Repeat], repeats: int) -> Table:
    m = summarise(found)
    size = found[0].checkpoint_bytes
    table = Table(title=f"where the time goes (median of {repeats}, checkpoint {size / MB:.0f} MB)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("MB/s", justify="right")
    phases = [
        ("snapshot (model_snapshot + snapshot_tensors)", "snapshot_s"),
        ("write_state (safetensors + torch.save + json, hashed + fsynced)", "write_state_s"),
        ("write_manifest_of (the recorded digests, nothing read back)", "manifest_s"),
        ("commit (rename)", "commit_s"),
        ("fsync of the files again (the save already did)", "flush_s"),
        ("verify (read + hash, cold)", "verify_s"),
        ("load_weights + read_trainer_state", "load_weights_s"),
        ("load_optimizer (torch.load weights_only)", "load_optimizer_s"),
        ("raw write of the same size", "raw_write_s"),
        ("async: background save (write + hash + commit + rotate)", "background_s"),
    ]
    for label, key in phases:
        seconds = m[key]
        table.add_row(label, f"{seconds:.2f}", f"{size / seconds / MB:.0f}" if seconds > 0 else "-")
    table.add_row(
        "async: training step, idle / during background save",
        f"{m['idle_step_s']:.3f} / {m['saving_step_s']:.3f}",
        f"{m['step_slowdown']:+.0%}",
    )
    return table
