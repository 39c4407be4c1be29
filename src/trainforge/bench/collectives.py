"""``trainforge bench collectives``: time, algorithm and bus bandwidth of the four collectives per size.

``workers`` local ranks (``bench/ranks.py``: gloo on CPU, NCCL when CUDA is present) time
all-reduce, reduce-scatter, all-gather and broadcast of float32 buffers at every power-of-two
size of a range. Every timed iteration starts after a barrier, so the ranks enter together; an
iteration's time is the slowest rank's (the collective is done when every rank is), and a size's
figure is the median over the timed iterations, after warm-up ones.

Sizes and bandwidths follow nccl-tests (``doc/PERFORMANCE.md``): the size is the whole buffer (the
all-reduce's buffer, the reduce-scatter's input, the all-gather's output), ``algbw = size / time``
and ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for
reduce-scatter and all-gather and 1 for broadcast: busbw is what each rank's link carried, so it
compares across rank counts and with the link's own speed. Per collective, ``time = alpha +
bytes * beta`` is fitted by least squares on relative residuals (each size counts alike, rather
than the largest sizes drowning the latency); ``trainforge predict --link measured`` reads the
all-reduce fit from the ``--output`` JSON (schema in docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from trainforge.bench.machine import cpu_model
from trainforge.bench.ranks import spawn_ranks
from trainforge.consoles import make_console
from trainforge.errors import TrainforgeError

SCHEMA = "trainforge.bench.collectives/1"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
MAX_BYTES = 4 << 30
ELEMENT = 4  # float32
GB = 1e9  # bandwidths in GB/s of 10^9 bytes, as nccl-tests print them


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' busbw / algbw: the share of the buffer each rank's link carries."""
    if collective == "all_reduce":
        return 2 * (world - 1) / world
    if collective in ("reduce_scatter", "all_gather"):
        return (world - 1) / world
    return 1.0


def parse_size(text: str) -> int:
    """``256MB`` -> 268435456 (KB, MB, GB are powers of 1024, as nccl-tests' -b/-e read them)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B)\s*", text.upper())
    if match is None:
        raise ValueError(text)
    return int(match.group(1)) * UNITS[match.group(2)]


def parse_sizes(text: str) -> list[int]:
    """``1KB..256MB`` -> every power of two from 1 KB to 256 MB; a single size is a range of one."""
    problem = f"--sizes {text!r}: expected LO..HI such as 1KB..256MB (units B, KB, MB, GB; powers of 2 between)"
    parts = text.split("..")
    if len(parts) > 2:
        raise TrainforgeError(problem)
    try:
        low, high = parse_size(parts[0]), parse_size(parts[-1])
    except ValueError:
        raise TrainforgeError(problem) from None
    if not 0 < low <= high <= MAX_BYTES:
        raise TrainforgeError(f"{problem}; LO <= HI, from 1B to 4GB")
    sizes = [1 << exponent for exponent in range(64) if low <= 1 << exponent <= high]
    if not sizes:
        raise TrainforgeError(f"{problem}; no power of 2 lies between {low} and {high} bytes")
    return sizes


def human(size: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]}{unit}"
    return f"{size}B"


# ---------------------------------------------------------------------------------------------
# In every rank


def elements_for(size: int, world: int) -> int:
    """float32 elements of a ``size``-byte buffer, rounded up to a multiple of ``world`` (at least one each)."""
    per_rank = max(1, math.ceil(size / ELEMENT / world))
    return per_rank * world


def operation(collective: str, count: int, world: int, device: torch.device) -> Callable[[], Any]:
    """One call of ``collective`` on a ``count``-element buffer, its tensors allocated once."""
    if collective == "all_reduce":
        buffer = torch.ones(count, device=device)
        return lambda: dist.all_reduce(buffer)
    if collective == "broadcast":
        buffer = torch.ones(count, device=device)
        return lambda: dist.broadcast(buffer, src=0)
    whole, shard = torch.ones(count, device=device), torch.ones(count // world, device=device)
    # torch 2.13 names them *_single; older releases *_tensor.
    if collective == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, whole)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda: gather(whole, shard)


def time_collectives(
    rank: int, world: int, sizes: Sequence[int], iters: int, warmup: int, show_progress: bool
) -> dict[str, Any]:
    """This rank's seconds per timed iteration, per collective and size; or why a collective cannot run."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    shown = Console(stderr=True, highlight=False) if show_progress and rank == 0 else None
    times: dict[str, dict[int, list[float]]] = {name: {} for name in COLLECTIVES}
    unsupported: dict[str, str] = {}
    for collective in COLLECTIVES:
        for size in sizes:
            call = operation(collective, elements_for(size, world), world, device)
            try:
                call()
            except (RuntimeError, NotImplementedError, ValueError) as err:
                # Every rank fails alike (the backend lacks it), so none is left waiting in it.
                unsupported[collective] = f"not supported by {dist.get_backend()}: {str(err).splitlines()[0][:160]}"
                break
            times[collective][size] = timed(call, iters, warmup, device)
            if shown is not None:
                median = statistics.median(times[collective][size])
                shown.print(f"  {collective:<15}{human(size):>7}  {median * 1e6:12.1f} us  (rank 0)")
    return {"times": times, "unsupported": unsupported}


def timed(call: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        call()
    seconds = []
    for _ in range(iters):
        dist.barrier()  # the ranks enter together; the slowest rank's time is taken afterwards
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


# ---------------------------------------------------------------------------------------------
# On the driver


@dataclass(frozen=True)
class Point:
    bytes: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float


@dataclass(frozen=True)
class Fit:
    """``time = alpha_s + bytes * beta_s_per_byte``; ``bandwidth_GBps`` is 1/beta in GB/s (algbw's asymptote)."""

    alpha_s: float
    beta_s_per_byte: float
    bandwidth_GBps: float


def fit_alpha_beta(points: Sequence[Point]) -> Fit:
    """Least squares of ``time = alpha + bytes * beta`` on relative residuals (weights 1/time),
    with ``alpha, beta >= 0``: a latency or a per-byte cost below zero means nothing, and noisy
    timings (a loaded machine, few iterations) can tilt the unconstrained line below zero. A
    ``beta`` of 0 (no bandwidth term: ``bandwidth_GBps`` infinite) says the sizes did not
    separate bandwidth from noise; ``predict --link measured`` refuses such a fit."""
    if len(points) < 2:
        only = points[0]
        return Fit(0.0, only.time_s / only.bytes, only.bytes / only.time_s / GB)
    weights = [1 / p.time_s for p in points]
    # Minimise sum (w (alpha + beta x - t))^2: the 2x2 normal equations.
    s_ww = sum(w * w for w in weights)
    s_wwx = sum(w * w * p.bytes for w, p in zip(weights, points, strict=True))
    s_wwxx = sum(w * w * p.bytes**2 for w, p in zip(weights, points, strict=True))
    s_wwt = sum(w * w * p.time_s for w, p in zip(weights, points, strict=True))
    s_wwxt = sum(w * w * p.bytes * p.time_s for w, p in zip(weights, points, strict=True))
    det = s_ww * s_wwxx - s_wwx**2
    alpha = (s_wwt * s_wwxx - s_wwx * s_wwxt) / det
    beta = (s_ww * s_wwxt - s_wwx * s_wwt) / det
    # The constrained optimum lies on the boundary the unconstrained one crossed (a convex
    # quadratic in two variables): fit the one parameter left.
    if beta < 0:
        alpha, beta = s_wwt / s_ww, 0.0
    elif alpha < 0:
        alpha, beta = 0.0, s_wwxt / s_wwxx
    return Fit(alpha, beta, (1 / beta) / GB if beta > 0 else math.inf)


def summarise(collective: str, world: int, per_rank: Sequence[dict[int, list[float]]]) -> list[Point]:
    """Per size: the slowest rank's time in each iteration, then the median over iterations."""
    points = []
    for size in per_rank[0]:
        slowest = [max(column) for column in zip(*(ranks[size] for ranks in per_rank), strict=True)]
        seconds = statistics.median(slowest)
        moved = elements_for(size, world) * ELEMENT
        algbw = moved / seconds / GB
        points.append(Point(moved, seconds, algbw, algbw * bus_factor(collective, world)))
    return points


def run_collectives_bench(
    sizes: Sequence[int],
    *,
    workers: int = 2,
    iters: int = 10,
    warmup: int = 2,
    output: Path | None = None,
    console: Console | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Time the four collectives at every size in ``workers`` local ranks; print the table and fits."""
    shown = console or make_console()
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= workers else "gloo"
    device = torch.cuda.get_device_name(0) if backend == "nccl" else cpu_model()
    shown.print(
        f"bench collectives: {workers} ranks over {backend} on {device}, float32, sizes {human(sizes[0])}.."
        f"{human(sizes[-1])} ({len(sizes)}), {warmup} warm-up + {iters} timed iterations, median of the slowest rank",
        highlight=False,
    )
    returned = spawn_ranks(time_collectives, workers, list(sizes), iters, warmup, show_progress, backend=backend)
    unsupported: dict[str, str] = returned[0]["unsupported"]
    results = {
        name: summarise(name, workers, [r["times"][name] for r in returned])
        for name in COLLECTIVES
        if name not in unsupported
    }
    fits = {name: fit_alpha_beta(points) for name, points in results.items() if points}
    report = {
        "schema": SCHEMA,
        "backend": backend,
        "workers": workers,
        "iters": iters,
        "warmup": warmup,
        "dtype": "float32",
        "machine": {"cpu": cpu_model(), "device": device, "cores": os.cpu_count(), "python": platform.python_version()},
        "results": {name: [asdict(p) for p in points] for name, points in results.items()},
        "unsupported": unsupported,
        "fits": {name: asdict(fit) for name, fit in fits.items()},
    }
    shown.print(results_table(results, unsupported, workers))
    shown.print(fits_table(fits))
    if output is not None:
        output.write_text(json.dumps(report, indent=2) + "\n")
        shown.print(f"wrote {output}", highlight=False)
    return report


SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC"}


def results_table(results: dict[str, list[Point]], unsupported: dict[str, str], workers: int) -> Table:
    """A row per size; per collective its median time (us), algbw and busbw (GB/s)."""
    legend = ", ".join(f"{short} {name}" for name, short in SHORT.items())
    table = Table(title=f"Collectives over {workers} ranks ({legend}): us, algbw and busbw in GB/s (10^9 B)")
    table.add_column("size", justify="right")
    for name in COLLECTIVES:
        if name in unsupported:
            table.add_column(SHORT[name])
            continue
        for figure in ("us", "algbw", "busbw"):
            table.add_column(f"{SHORT[name]} {figure}", justify="right")
    sizes = next(iter(results.values()), [])
    for row, point in enumerate(sizes):
        cells = []
        for name in COLLECTIVES:
            if name in unsupported:
                cells.append(unsupported[name] if row == 0 else "")
                continue
            p = results[name][row]
            cells += [f"{p.time_s * 1e6:.1f}", f"{p.algbw_GBps:.3f}", f"{p.busbw_GBps:.3f}"]
        table.add_row(human(point.bytes), *cells)
    return table


def fits_table(fits: dict[str, Fit]) -> Table:
    table = Table(title="Latency/bandwidth fit: time = alpha + bytes x beta (least squares, relative residuals)")
    for column in ("collective", "alpha (us)", "beta (ns/byte)", "1/beta (GB/s)"):
        table.add_column(column, justify="left" if column == "collective" else "right")
    for name, fit in fits.items():
        table.add_row(name, f"{fit.alpha_s * 1e6:.1f}", f"{fit.beta_s_per_byte * 1e9:.4f}", f"{fit.bandwidth_GBps:.3f}")
    return table
