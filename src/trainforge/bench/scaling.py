"""``trainforge bench scaling CONFIG --workers 1,2,4``: what more workers buy, measured on this cluster.

The config trains once per worker count, one count after the other, on the Ray the config names
(a local Ray, or ``cluster.address``). The per-worker batch is the config's, so the global batch
grows with the workers (weak scaling, as ``trainforge predict`` assumes). Every run is short
(``--steps``), with checkpoints, MLflow and Prometheus off and gradient communication timed
(``metrics.comm_timing``); its run directory stays under the bench's folder.

Per count:

* **samples/s**: the run's steady throughput over all workers (from the end of the warm-up steps
  to the last step, validation excluded; worker/metrics.Throughput);
* **efficiency against linear**: samples/s over the smallest count's samples/s scaled by the
  ratio of worker counts (1.0: every added worker adds a full share);
* **where a step's time goes**: the reports after the first (the first holds the warm-up) weighted
  by their steps: data wait, compute (forward and backward less the exposed communication),
  exposed gradient communication (rank 0's: the step waiting for the all-reduce after its
  backward), optimizer; and the communication in flight, which overlaps the backward.

With ``--link`` the predictor's communication model (``trainforge predict``'s) is checked: each
count's step is predicted from its own measured compute and the link, and the efficiency that
step gives is set beside the measured one, with the error in points. The JSON (``--output``)
and a report (``report.html``: an efficiency plot and a time-breakdown plot) are written into
the bench's folder.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainforge.bench.machine import cpu_model
from trainforge.config import Config, load_config
from trainforge.errors import TrainforgeError
from trainforge.predict.links import INTRA_NODE, Link
from trainforge.protocol import curve_points
from trainforge.report.data import finite, load_run

SCHEMA = "trainforge.bench.scaling/1"
DEFAULT_STEPS = 60
INTERVALS_PER_RUN = 6  # log intervals: the first (warm-up) is left out of the time split
PARTS = ("data_wait_s", "compute_s", "comm_exposed_s", "optimizer_s")  # a step's time, in that order


@dataclass(frozen=True)
class Point:
    """One worker count, measured; times are seconds per optimizer step."""

    workers: int
    samples_per_s: float
    efficiency: float  # against linear from the smallest count
    step_time_s: float
    data_wait_s: float
    compute_s: float  # forward + backward, less the exposed communication
    comm_exposed_s: float
    optimizer_s: float
    comm_s: float  # in flight (overlaps the backward); not a part of the step's sum
    steps_measured: int
    run_dir: str
    predicted_efficiency: float | None = None
    error_points: float | None = None  # (predicted - measured) efficiency, in percentage points


def run_config(config: Config, workers: int, steps: int, folder: Path) -> Config:
    """The config as one bench run: ``workers`` fixed, ``steps`` steps, observers off, nothing resumed."""
    data = config.to_dict()
    data["run"].update(name=f"w{workers}", output_dir=str(folder))
    data["scaling"]["num_workers"] = workers
    data["train"].update(
        max_steps=steps,
        epochs=None,
        eval_every_n_steps=None,
        log_every_n_steps=max(1, steps // INTERVALS_PER_RUN),
    )
    data["checkpoint"].update(
        every_n_steps=None, every_n_minutes=None, at_epoch_end=False, resume="none", storage_path=None
    )
    data["tracking"]["enabled"] = False
    data["metrics"].update(enabled=False, comm_timing=True)
    data["profile"] = None
    return load_config(data)


def weighted_means(points: list[dict[str, Any]], keys: Sequence[str]) -> tuple[dict[str, float], int]:
    """Per-step means of ``keys`` over points that each cover the steps since the one before,
    the first (warm-up) left out when there are others; and the steps they cover."""
    timed = [p for p in points if finite(p.get("step")) is not None and any(k in p for k in keys)]
    spans, previous = [], 0
    for point in sorted(timed, key=lambda p: p["step"]):
        step = int(point["step"])
        if step > previous:
            spans.append((point, step - previous))
        previous = max(previous, step)
    if len(spans) > 1:
        spans = spans[1:]
    total = sum(span for _, span in spans)
    if not total:
        return dict.fromkeys(keys, 0.0), 0
    return {k: sum((finite(p.get(k)) or 0.0) * span for p, span in spans) / total for k in keys}, total


STEP_KEYS = ("perf/step_time_s", "perf/data_wait_s", "perf/compute_s", "perf/optimizer_s")  # per log interval
COMM_KEYS = ("perf/comm_s", "perf/comm_exposed_s")  # per report (rank 0 measures them at each)


def step_breakdown(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Where a step's time went, from a run's reports as metrics.jsonl holds them: the step's parts
    from every log interval (each report's ``history``), the communication from the reports'
    own points (``history.curve_points`` gives both)."""
    points = [point for report in reports for point in curve_points(report)]
    parts, steps = weighted_means(points, STEP_KEYS)
    if not steps:
        raise TrainforgeError("the run wrote no timed reports to metrics.jsonl; raise --steps")
    comm, _ = weighted_means(points, COMM_KEYS)
    exposed = comm["perf/comm_exposed_s"]
    return {
        "step_time_s": parts["perf/step_time_s"],
        "data_wait_s": parts["perf/data_wait_s"],
        "compute_s": max(parts["perf/compute_s"] - exposed, 0.0),
        "comm_exposed_s": exposed,
        "optimizer_s": parts["perf/optimizer_s"],
        "comm_s": comm["perf/comm_s"],
        "steps_measured": steps,
    }


def efficiencies(counts: Sequence[int], rates: Sequence[float]) -> list[float]:
    """Each count's samples/s against linear scaling of the smallest count's."""
    base = min(range(len(counts)), key=lambda i: counts[i])
    per_worker = rates[base] / counts[base]
    return [rate / (count * per_worker) if per_worker > 0 else 0.0 for count, rate in zip(counts, rates, strict=True)]


def predicted(config: Config, points: list[Point], link: Link, workers_per_node: int) -> list[tuple[float, float]]:
    """(predicted efficiency, error in points) per point: the predictor's communication model
    checked against each count's measured step.

    Each count's step is predicted from its own measured compute (forward, backward and optimizer,
    less the exposed communication) and data wait, plus what the predictor says DDP's all-reduce
    of this model adds over ``link``. Compute is taken at each count, not the smallest's, because
    workers that share a machine's cores (a small test cluster) compute more slowly side by side:
    that is not the link's doing, and would hide how right or wrong the link model is. The
    predicted efficiency is the measured one scaled by measured step / predicted step.
    """
    from trainforge.predict.inputs import model_bytes, workload_of
    from trainforge.predict.model import Topology, predict_points

    sizes = model_bytes(config, None)
    topology = Topology(workers_per_node, INTRA_NODE, link)
    out = []
    for point in points:
        work = workload_of(config, sizes, point.compute_s + point.optimizer_s)
        (modelled,) = predict_points(work, [point.workers], topology)
        step = point.data_wait_s + modelled.step_time_s
        expected = point.efficiency * (point.step_time_s / step) if step > 0 else 0.0
        out.append((expected, 100 * (expected - point.efficiency)))
    return out


def default_folder(config: Config) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(config.run.output_dir).expanduser().resolve() / f"{config.run.name}-scaling-{stamp}"


def run_scaling_bench(
    config: Config,
    counts: Sequence[int],
    *,
    steps: int = DEFAULT_STEPS,
    folder: Path | None = None,
    link: Link | None = None,
    workers_per_node: int = 1,
    address: str | None = None,
    output: Path | None = None,
    console: Console,
) -> dict[str, Any]:
    """Train ``config`` at every count, print the table, write the JSON and the report; the result."""
    import trainforge

    folder = folder or default_folder(config)
    folder.mkdir(parents=True, exist_ok=True)
    address = address or config.cluster.address or os.environ.get("RAY_ADDRESS")
    where = address or "a local Ray"
    cores = os.cpu_count() or 1
    if not address and max(counts) > cores:
        console.print(
            f"[yellow]note:[/] {max(counts)} workers on {cores} CPU cores share cores: the figures then "
            "measure this machine's cores, not what more workers would buy on separate devices"
        )
    console.print(f"bench scaling: {config.run.name}, {steps} steps per count on {where}; runs in {folder}")
    rates, measured = [], []
    for index, workers in enumerate(counts, start=1):
        plural = "s" if workers > 1 else ""
        console.print(f"[{index}/{len(counts)}] {workers} worker{plural}: training {steps} steps ...")
        run = run_config(config, workers, steps, folder)
        result = trainforge.fit(run, address=address, console=Console(file=io.StringIO()))
        rate = float(result.summary.get("throughput_samples_per_s") or 0.0)
        if rate <= 0:
            raise TrainforgeError(f"the {workers}-worker run measured no throughput (raise --steps); see {run.run_dir}")
        parts = step_breakdown(load_run(run.run_dir).reports)
        rates.append(rate)
        measured.append((workers, parts, run.run_dir))
        console.print(
            f"[{index}/{len(counts)}] {workers} worker{plural}: {rate:,.1f} samples/s, "
            f"{parts['step_time_s'] * 1e3:,.1f} ms per step ({run.run_dir})"
        )
    points = [
        Point(workers=w, samples_per_s=rate, efficiency=eff, run_dir=str(run_dir), **parts)  # type: ignore[arg-type]
        for (w, parts, run_dir), rate, eff in zip(measured, rates, efficiencies(counts, rates), strict=True)
    ]
    if link is not None:
        points = [
            replace(p, predicted_efficiency=expected, error_points=error)
            for p, (expected, error) in zip(points, predicted(config, points, link, workers_per_node), strict=True)
        ]
    figures = {
        "schema": SCHEMA,
        "config": config.run.name,
        "cluster": where,
        "steps": steps,
        "link": None
        if link is None
        else {"name": link.name, "source": link.source, "workers_per_node": workers_per_node},
        "points": [asdict(p) for p in points],
        "machine": {"cpu": cpu_model(), "cores": cores, "python": platform.python_version()},
    }
    console.print(table(points))
    text = json.dumps(figures, indent=2) + "\n"
    (folder / "scaling.json").write_text(text)
    if output is not None:
        output.write_text(text)
    from trainforge.report.scaling import write_scaling_report

    page = write_scaling_report(figures, folder)
    console.print(f"report: {page}")
    return figures


def table(points: list[Point]) -> Table:
    out = Table(title="Scaling (per-worker batch fixed; times per step)")
    for header in ("workers", "samples/s", "efficiency", "step", "data", "compute", "comm exposed", "comm in flight"):
        out.add_column(header, justify="right")
    predicted_any = any(p.predicted_efficiency is not None for p in points)
    if predicted_any:
        out.add_column("predicted", justify="right")
        out.add_column("error", justify="right")
    for p in points:
        row = [
            str(p.workers),
            f"{p.samples_per_s:,.1f}",
            f"{p.efficiency:.1%}",
            *(
                f"{value * 1e3:,.1f} ms"
                for value in (p.step_time_s, p.data_wait_s, p.compute_s, p.comm_exposed_s, p.comm_s)
            ),
        ]
        if predicted_any:
            row += [f"{p.predicted_efficiency:.1%}", f"{p.error_points:+.1f} pts"]
        out.add_row(*row)
    return out
