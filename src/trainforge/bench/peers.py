"""``trainforge bench peers``: the same training job in up to seven implementations, side by side.

(a) plain PyTorch in one process, (b) torchrun + DDP, (c) plain Ray Train, (d) trainforge with its
defaults (MLflow tracking, Prometheus metrics, system sampling on), (e) trainforge with tracking and
metrics off (d/e is what observing a run costs), (f) PyTorch Lightning's DDP strategy and (g)
Hugging Face Accelerate (both with the ``bench`` extra). Every peer trains the
:class:`~trainforge.bench.workload.Workload` (``cnn`` or ``lm``) and reports samples per second over
all workers from the end of step 5 to the end of the last step (the ``lm`` table quotes tokens/s),
and the seconds from its launch to the end of its first step. Measurements are interleaved (a b c
d, then d c b a) and the median of the repeats is quoted, because a small shared machine drifts
over minutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

import trainforge
from trainforge.bench.machine import cpu_model
from trainforge.bench.roster import HEADERS, PEERS, missing_note
from trainforge.bench.workload import WARMUP_STEPS, Workload
from trainforge.consoles import make_console
from trainforge.errors import TrainforgeError

# trainforge's throughput over each other peer's; (a), one process with k threads, has no goal
RATIOS = ("d/a", "d/b", "d/c", "d/e", "d/f", "d/g")
GOALS: dict[str, float] = {"d/c": 1.00, "d/b": 0.93, "d/e": 0.98, "d/f": 1.00, "d/g": 1.00}
RAY_CPUS = 4
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
POLL_INTERVAL_S = "0.2"
SUBPROCESS_TIMEOUT_S = 900


class PeerFailed(TrainforgeError):
    """A peer implementation crashed or returned no figure; the benchmark cannot go on."""

    exit_code = 1


@dataclass(frozen=True)
class Measurement:
    peer: str
    workers: int
    repeat: int
    samples_per_s: float
    wall_s: float  # the whole measurement, start-up included
    load_1min: float  # the machine's load average when it started: the bench shares the machine
    first_step_s: float = 0.0  # from the command's launch (or the call, in the running Ray) to its first step's end


def run_peers(
    counts: Sequence[int],
    *,
    kind: str = "cnn",
    steps: int | None = None,
    batch_size: int | None = None,
    repeats: int = 2,
    peers: Sequence[str] = tuple(PEERS),
    output: Path | None = None,
    console: Console | None = None,
    overrides: Sequence[str] = (),
    peers_reuse_freed_memory: bool = False,
) -> dict[str, Any]:
    """Measure the ``peers`` at every worker count ``repeats`` times; print the tables, return the report.
    ``steps`` and ``batch_size``: the workload kind's defaults where None; ``overrides``: ``key=value``
    for trainforge's runs (d) and (e) only; ``peers_reuse_freed_memory``: the other peers' processes
    get trainforge's allocator thresholds (worker/allocator.py)."""
    shown = console or make_console()
    peers = [peer for peer in PEERS if peer in peers]
    workload = Workload(kind=kind)
    batch = batch_size or workload.spec.batch_size
    workload = Workload.sized_for(steps or workload.spec.steps, batch, max(counts), kind)
    workload = dataclasses.replace(
        workload, overrides=tuple(overrides), peers_reuse_freed_memory=peers_reuse_freed_memory
    )
    model = workload.model_config()
    named = f"{model.name} {model.kwargs}" if model.kwargs else model.name
    shown.print(
        f"bench peers --workload {kind}: {named} on {workload.spec.what}, "
        f"batch {batch} per worker, {WARMUP_STEPS} warm-up + {workload.steps} timed steps, "
        f"workers {', '.join(map(str, counts))}, {repeats} repeat(s), peers {''.join(peers)}"
        + "".join(f", trainforge with --set {item}" for item in overrides)
        + (", the other peers with trainforge's allocator thresholds" if peers_reuse_freed_memory else ""),
        highlight=False,
    )
    note = missing_note(peers)
    if note:
        shown.print(note, highlight=False, markup=False)  # "[bench]" is no markup
    measurements = measure_all(workload, counts, repeats, peers, shown)
    rows = summarise(measurements, counts, peers, workload.spec.per_sample)
    shown.print(results_table(rows, repeats, peers, workload.spec.unit))
    shown.print(startup_table(rows, peers))
    shown.print(STARTUP_NOTE, highlight=False)
    for line in [*goal_lines(rows), spread_line(measurements)]:
        shown.print(line, highlight=False)
    report = {
        "machine": machine(),
        "workload": {
            **asdict(workload),
            "model": model.model_dump(mode="json"),
            "unit": workload.spec.unit,
            "warmup_steps": WARMUP_STEPS,
            "repeats": repeats,
        },
        "goals": GOALS,
        "rows": rows,
        "measurements": [asdict(m) for m in measurements],
    }
    if output is not None:
        output.write_text(json.dumps(report, indent=2) + "\n")
    return report


def measure_all(
    workload: Workload, counts: Sequence[int], repeats: int, peers: Sequence[str], shown: Console
) -> list[Measurement]:
    """Every peer at every worker count; a progress line each.

    Repeats alternate the order (a b c d, then d c b a, ...), so a machine that drifts over
    minutes favours no peer by its position.
    """
    measurements: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="trainforge-bench-") as scratch, local_ray():
        for workers in counts:
            for repeat in range(repeats):
                order = list(peers) if repeat % 2 == 0 else list(reversed(peers))
                for peer in order:
                    load = os.getloadavg()[0]
                    started = time.monotonic()
                    rate, first = MEASURES[peer](workload, workers, Path(scratch) / f"{peer}-{workers}w-r{repeat}")
                    wall = round(time.monotonic() - started, 1)
                    found = Measurement(peer, workers, repeat, rate, wall, load, round(first, 2))
                    measurements.append(found)
                    shown.print(progress_line(found, repeats), highlight=False)
    return measurements


def progress_line(found: Measurement, repeats: int) -> str:
    """``  2 workers 1/2  (c) Ray Train            1496.1 samples/s  first step  6.1 s   29 s  load 4.5``"""
    workers = f"{found.workers} worker" + ("s" if found.workers > 1 else "")
    return (
        f"  {workers:<9} {found.repeat + 1}/{repeats}  {PEERS[found.peer]:<27}{found.samples_per_s:8.1f} samples/s"
        f"  first step {found.first_step_s:4.1f} s  {found.wall_s:4.0f} s  load {found.load_1min:.1f}"
    )


# ---------------------------------------------------------------------------------------------
# The peers: each returns samples/s over all workers and seconds from its start to its first step


Figures = tuple[float, float]  # samples/s over all workers, seconds to the end of the first step


def measure_plain(workload: Workload, workers: int, scratch: Path) -> Figures:
    """(a) One process, ``workers`` intra-op threads, batch ``workers * b``."""
    command = [sys.executable, "-m", "trainforge.bench.workload", "--threads", str(workers)]
    return _run_script(command, workload, scratch, threads=workers, what=PEERS["a"])


def measure_torchrun(workload: Workload, workers: int, scratch: Path) -> Figures:
    """(b) ``workers`` torchrun processes with one thread each."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(workers),
        "-m",
        "trainforge.bench._torchrun_worker",
    ]
    return _run_script(command, workload, scratch, threads=1, what=PEERS["b"])


def measure_ray_train(workload: Workload, workers: int, scratch: Path) -> Figures:
    """(c) A TorchTrainer around an ordinary Ray Train loop; rank 0 returns its figure."""
    called = time.time()
    figures = ray_train_figures(workload, workers, scratch, PEERS["c"])
    return float(figures["samples_per_s"]), float(figures["first_step_unix"]) - called


def ray_train_figures(workload: Workload, workers: int, scratch: Path, peer: str) -> dict[str, float]:
    """An ordinary TorchTrainer around bench/workload.py's loop (``bench peers``' and ``bench
    startup``'s plain Ray Train); rank 0's StepClock figures."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from trainforge.bench.workload import ray_train_loop

    trainer = TorchTrainer(
        ray_train_loop,  # type: ignore[arg-type]  # Train V2 passes the return value on; the stubs are V1's
        train_loop_config={"workload": workload.to_json()},
        scaling_config=ray.train.ScalingConfig(num_workers=workers),
        run_config=ray.train.RunConfig(name=scratch.name, storage_path=str(scratch)),
    )
    returned = getattr(trainer.fit(), "return_value", None)  # Train V2's Result; mypy sees V1's
    if not isinstance(returned, dict) or "samples_per_s" not in returned or not returned.get("first_step_unix"):
        raise PeerFailed(f"{peer} returned {returned!r} instead of its measured figures")
    return returned


def measure_trainforge(workload: Workload, workers: int, scratch: Path, *, observed: bool = True) -> Figures:
    """(d) ``trainforge.fit``; its progress display goes to a buffer so the bench output stays readable."""
    config = workload.trainforge_config(workers, name=scratch.name, output_dir=str(scratch.parent), observed=observed)
    called = time.time()
    result = trainforge.fit(config, console=Console(file=io.StringIO()))
    rate = float(result.summary["throughput_samples_per_s"])
    if rate <= 0:
        peer = PEERS["d" if observed else "e"]
        raise PeerFailed(f"{peer} reported throughput {rate} (summary in {result.run_dir})")
    first, _ = trainforge_first_step(result.run_dir / "summary.json")
    return rate, first - called


def measure_trainforge_unobserved(workload: Workload, workers: int, scratch: Path) -> Figures:
    """(e) As (d) with MLflow tracking and Prometheus metrics off."""
    return measure_trainforge(workload, workers, scratch, observed=False)


def measure_lightning(workload: Workload, workers: int, scratch: Path) -> Figures:
    """(f) ``python script.py``, a Lightning Trainer with ``strategy="ddp"``, ``devices=workers``:
    Lightning starts the other processes itself; 1 thread each."""
    command = [sys.executable, "-m", "trainforge.bench._lightning_worker", "--devices", str(workers)]
    return _run_script(command, workload, scratch, threads=1, what=PEERS["f"])


def measure_accelerate(workload: Workload, workers: int, scratch: Path) -> Figures:
    """(g) ``accelerate launch`` (the module its console script runs), 1 thread per process."""
    return _run_script(accelerate_command(workers), workload, scratch, threads=1, what=PEERS["g"])


def accelerate_command(workers: int) -> list[str]:
    """``accelerate launch`` with every setting given (so it warns of no defaults): its ``--cpu``
    launcher for one process; for more, its torchrun launcher (``--multi_gpu``, the only one that
    starts several processes without mpirun), the script choosing the CPU and gloo itself."""
    launcher = ["--cpu"] if workers == 1 else ["--multi_gpu", "--main_process_port", str(free_port())]
    settings = ["--num_processes", str(workers), "--num_machines", "1", "--mixed_precision", "no"]
    settings += ["--dynamo_backend", "no"]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        *settings,
        "-m",
        "trainforge.bench._accelerate_worker",
    ]


def free_port() -> int:
    """A loopback port free now: torchrun's fixed default (29500) may be another run's."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


MEASURES: dict[str, Callable[[Workload, int, Path], Figures]] = {
    "a": measure_plain,
    "b": measure_torchrun,
    "c": measure_ray_train,
    "d": measure_trainforge,
    "e": measure_trainforge_unobserved,
    "f": measure_lightning,
    "g": measure_accelerate,
}


def trainforge_first_step(summary_path: Path) -> tuple[float, dict[str, float]]:
    """A trainforge run's first step (unix time at its end) and its start by phase, from summary.json."""
    startup = json.loads(summary_path.read_text()).get("startup") or {}
    if "to_first_step_s" not in startup:
        raise PeerFailed(f"{summary_path} has no startup timing")
    return float(startup["start_unix"]) + float(startup["to_first_step_s"]), dict(startup["phases"])


def _run_script(command: list[str], workload: Workload, scratch: Path, *, threads: int, what: str) -> Figures:
    """Run a peer's script in a fresh process tree and read the figures it writes as JSON.

    A peer that crashes (a reference script, not trainforge: e.g. gloo aborting a process at
    shutdown) is run once more, with its error on stderr; a second crash fails the benchmark."""
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": python_path()}
    for attempt in (1, 2):
        out.unlink(missing_ok=True)
        launched = time.time()
        done = subprocess.run(
            [*command, "--workload", workload.to_json(), "--out", str(out)],
            env=env,
            cwd=scratch,  # Lightning writes its logs and checkpoint under the working directory
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=False,
        )
        if done.returncode == 0 and out.is_file():
            figures = json.loads(out.read_text())
            return float(figures["samples_per_s"]), float(figures["first_step_unix"]) - launched
        failure = f"{what} exited with code {done.returncode}: {crash_lines(done.stderr)}"
        if attempt == 1:
            print(f"warning: {failure}; measuring it again", file=sys.stderr)
    raise PeerFailed(failure)


def crash_lines(stderr: str) -> str:
    """What a crashed process said: its error lines (exceptions, C++ aborts) and its last lines."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    markers = ("Error", "error:", "terminate called", "what():", "Exception", "Signal")
    errors = [line for line in lines if any(m in line for m in markers)]
    picked = list(dict.fromkeys([*errors[:3], *lines[-3:]]))
    return " | ".join(picked) or "no output"


def python_path() -> str:
    """PYTHONPATH that lets a child process import this trainforge, installed or from a source tree."""
    source_root = str(Path(trainforge.__file__).resolve().parents[1])
    return os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """One local Ray for peers (c) and (d); trainforge.fit reuses a Ray that is already running.

    The controller's poll interval is set before Ray starts: every Ray Train report waits for a
    poll, and Ray's default of 2 s would dominate a short run for both Ray peers.
    """
    import ray

    from trainforge.driver.ray_session import LOOPBACK, bound_to

    saved = {name: os.environ.get(name) for name in (POLL_ENV, "PYTHONPATH")}
    os.environ[POLL_ENV] = POLL_INTERVAL_S
    os.environ["PYTHONPATH"] = python_path()  # Ray's worker processes inherit it
    # address="local": always a fresh instance, never a cluster someone else started on this machine.
    try:
        with bound_to(LOOPBACK):  # on loopback, as every trainforge run's local Ray (docs/security.md)
            ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    except Exception as err:  # Ray raises bare Exceptions, e.g. when its node times out on a busy machine
        restore_env(saved)
        raise PeerFailed(f"could not start a local Ray for peers (c) and (d): {err}") from err
    try:
        yield
    finally:
        ray.shutdown()
        restore_env(saved)


def restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ---------------------------------------------------------------------------------------------
# Results


def summarise(
    measurements: Sequence[Measurement],
    counts: Sequence[int],
    peers: Sequence[str] = tuple(PEERS),
    per_sample: int = 1,
) -> list[dict[str, Any]]:
    """One row per worker count: each peer's median throughput (samples/s times ``per_sample``:
    tokens/s for the ``lm`` workload), the ratios both of whose peers were measured, and each
    peer's median seconds to its first step."""
    rows = []
    for workers in counts:
        mine = {peer: [m for m in measurements if m.peer == peer and m.workers == workers] for peer in peers}
        medians = {peer: statistics.median(m.samples_per_s for m in mine[peer]) * per_sample for peer in peers}
        ratios = {name: _ratio(medians[name[0]], medians[name[2]]) for name in ratios_of(peers)}
        first = {peer: statistics.median(m.first_step_s for m in mine[peer]) for peer in peers}
        rows.append({"workers": workers, **medians, **ratios, "first_step_s": first})
    return rows


def ratios_of(peers: Sequence[str]) -> list[str]:
    """The ratios (``d/a``, ``d/b``, ...) whose two peers are both among ``peers``."""
    return [name for name in RATIOS if name[0] in peers and name[2] in peers]


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def results_table(
    rows: Sequence[dict[str, Any]], repeats: int, peers: Sequence[str] = tuple(PEERS), unit: str = "samples/s"
) -> Table:
    table = Table(title=f"{unit} over all workers, median of {repeats}", box=box.SIMPLE_HEAD)
    table.add_column("workers", justify="right")
    for peer in peers:
        table.add_column(HEADERS[peer], justify="right")
    for ratio in ratios_of(peers):
        table.add_column(ratio, justify="right")
    for row in rows:
        table.add_row(
            str(row["workers"]),
            *(f"{row[peer]:.1f}" for peer in peers),
            *(f"{row[ratio]:.3f}" for ratio in ratios_of(peers)),
        )
    return table


STARTUP_NOTE = (
    "first step: from the command's launch, a new process tree, for (a), (b), (f) and (g); from the call "
    "in the bench's running Ray for (c), (d) and (e) (bench startup times them cold)"
)


def startup_table(rows: Sequence[dict[str, Any]], peers: Sequence[str] = tuple(PEERS)) -> Table:
    """Seconds to the first step: (a), (b), (f) and (g) from their command's launch, a new process
    tree each; (c), (d) and (e) from their call in the bench's Ray, already running."""
    table = Table(title="seconds to the first step, median", box=box.SIMPLE_HEAD)
    table.add_column("workers", justify="right")
    for peer in peers:
        table.add_column(HEADERS[peer], justify="right")
    for row in rows:
        table.add_row(str(row["workers"]), *(f"{row['first_step_s'][peer]:.1f}" for peer in peers))
    return table


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``goal d/c >= 1.00: pass at 1 worker(s) (1.011), miss at 2 worker(s) (0.952)``."""
    lines = []
    for ratio, goal in GOALS.items():
        if not rows or ratio not in rows[0]:
            continue
        verdicts = [
            f"{'pass' if row[ratio] >= goal else 'miss'} at {row['workers']} worker(s) ({row[ratio]:.3f})"
            for row in rows
        ]
        lines.append(f"goal {ratio} >= {goal:.2f}: {', '.join(verdicts)}")
    return lines


def spread_line(measurements: Sequence[Measurement]) -> str:
    """How far repeats of one measurement disagree: the noise floor the ratios should be read against."""
    spreads = []
    for key in sorted({(m.peer, m.workers) for m in measurements}):
        rates = [m.samples_per_s for m in measurements if (m.peer, m.workers) == key]
        if len(rates) > 1 and min(rates) > 0:
            spreads.append((max(rates) / min(rates) - 1, key))
    if not spreads:
        return "repeats: 1, so no spread between repeats to judge the noise by"
    worst, (peer, workers) = max(spreads)
    loads = [m.load_1min for m in measurements]
    return (
        f"spread between repeats: median {statistics.median(s for s, _ in spreads):.0%}, largest {worst:.0%} "
        f"({PEERS[peer]} at {workers} worker(s)); load average {min(loads):.1f}-{max(loads):.1f} "
        f"on {os.cpu_count()} CPUs"
    )


def machine() -> dict[str, Any]:
    import ray
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "trainforge": trainforge.__version__,
    }
