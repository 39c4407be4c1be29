"""``trainforge bench tune``: what a search costs beyond its trials' training, and what ASHA saves.

Three measurements, each a real search through ``trainforge.tune`` on a local Ray of its own:

* **overhead**: ``--trials`` trials of the demo config (digits, MLP) run ``--steps`` steps each,
  one at a time.
  A trial's overhead is its wall time as the search driver saw it (Tune starting the trial's
  actor to the trial's end) minus its training loop's time (first step to the final report, from
  ``metrics.jsonl``: ``time/unix`` less ``time/elapsed_s`` marks the loop's start). Before the
  loop: the trial function's start, the run's mailbox, the Ray Train controller and worker group,
  building data and model, restore; after it: final validation and save, weight export, the run
  report, and tearing it all down.
* **asha**: the demo search (configs/tune_digits.yaml + tune_digits_space.yaml, ``--asha-trials``
  trials) twice with the same seed, hence the same sampled configs: with ASHA and without early
  stopping. Compute saved is 1 - steps run with ASHA / steps run without; the best final metric of
  both is compared.
* **concurrency**: ``--concurrent`` one-worker trials at once (a local Ray with one logical CPU
  per trial plus one), the peak number running together, and whether all completed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

import trainforge
from trainforge.bench.machine import cpu_model
from trainforge.consoles import make_console
from trainforge.tune.table import fmt_value

CONFIGS = Path(trainforge.__file__).parent / "configs"
DEMO, DEMO_SPACE = CONFIGS / "tune_digits.yaml", CONFIGS / "tune_digits_space.yaml"
QUIET = ["tracking.enabled=false", "metrics.enabled=false"]
MEASURES = ("overhead", "asha", "concurrency")


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "load_average": [round(x, 1) for x in os.getloadavg()],
    }


def loop_span(run_dir: Path) -> tuple[float, float] | None:
    """The training loop's start (first report's time less its elapsed time) and its last report,
    as unix times; None without timed reports."""
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in reports if "time/unix" in r and "time/elapsed_s" in r]
    if not timed:
        return None
    return float(timed[0]["time/unix"] - timed[0]["time/elapsed_s"]), float(timed[-1]["time/unix"])


def lr_search(workdir: Path, name: str, overrides: list[str]) -> trainforge.TuneResult:
    """The demo config over the learning rate alone, without early stopping."""
    base = [*QUIET, f"run.output_dir={workdir}", f"run.name={name}", "tune.scheduler=none", "tune.search=random"]
    return trainforge.tune(DEMO, {"optim.lr": {"loguniform": [1.0e-3, 1.0e-2]}}, [*base, *overrides])


def measure_overhead(workdir: Path, trials: int, steps: int, say: Callable[[str], None]) -> dict[str, Any]:
    result = lr_search(
        workdir,
        "overhead",
        [
            f"train.max_steps={steps}",
            f"train.log_every_n_steps={max(25, steps // 20)}",
            f"checkpoint.every_n_steps={max(25, steps // 4)}",
            f"tune.num_trials={trials}",
            "tune.max_concurrent=1",  # one at a time: no trial's figure includes waiting for another's CPU
        ],
    )
    rows = []
    for trial in result.trials:
        span = loop_span(Path(trial["run_dir"]))
        if span is None or not trial.get("started_at") or not trial.get("ended_at"):
            continue
        wall = float(trial["ended_at"] - trial["started_at"])
        before, after = span[0] - trial["started_at"], trial["ended_at"] - span[1]
        row = {
            "trial": trial["trial_id"],
            "wall_s": wall,
            "loop_s": span[1] - span[0],
            "overhead_s": before + after,
            "before_loop_s": before,  # actor, controller, worker group, data and model, restore
            "after_loop_s": after,  # final validation and save, weights, report, teardown
        }
        rows.append(row)
        say(
            f"  {trial['trial_id']}: wall {wall:.1f} s, training loop {row['loop_s']:.1f} s, outside it "
            f"{row['overhead_s']:.1f} s ({before:.1f} s before the loop, {after:.1f} s after)"
        )
    share = [r["overhead_s"] / r["wall_s"] for r in rows if r["wall_s"] > 0]
    return {
        "trials": rows,
        "median_before_loop_s": statistics.median(r["before_loop_s"] for r in rows),
        "median_after_loop_s": statistics.median(r["after_loop_s"] for r in rows),
        "median_overhead_s": statistics.median(r["overhead_s"] for r in rows),
        "median_wall_s": statistics.median(r["wall_s"] for r in rows),
        "median_share": statistics.median(share) if share else None,
        "goal": "overhead < 5% of trial time for trials of >= 60 s",
    }


def measure_asha(workdir: Path, trials: int, say: Callable[[str], None]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for scheduler in ("asha", "none"):
        started = time.monotonic()
        overrides = [*QUIET, f"run.output_dir={workdir}", f"run.name=demo-{scheduler}", f"tune.num_trials={trials}"]
        result = trainforge.tune(DEMO, DEMO_SPACE, overrides, scheduler=scheduler)
        best = result.best or {}
        found[scheduler] = {
            "steps_run": result.summary["compute"]["steps_run"],
            "steps_budget": result.summary["compute"]["steps_budget"],
            "best_metric": best.get("last_metric"),
            "best_config": best.get("config"),
            "stopped_early": sum(1 for t in result.trials if t["stopped_early"]),
            "wall_s": round(time.monotonic() - started, 1),
        }
        say(f"  {scheduler}: {found[scheduler]}")
    saved = 1 - found["asha"]["steps_run"] / found["none"]["steps_run"]
    return {
        **found,
        "metric": result.summary["metric"],
        "compute_saved": round(saved, 4),
        "goal": "compute saved > 50% at equal best metric (within noise)",
    }


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in edges:
        running += change
        peak = max(peak, running)
    return peak


def measure_concurrency(workdir: Path, concurrent: int, steps: int, say: Callable[[str], None]) -> dict[str, Any]:
    started = time.monotonic()
    result = lr_search(
        workdir,
        "concurrent",
        [
            f"cluster.num_cpus={concurrent + 1}",
            f"train.max_steps={steps}",
            f"tune.num_trials={concurrent}",
            f"tune.max_concurrent={concurrent}",
        ],
    )
    spans = [(t["started_at"], t["ended_at"]) for t in result.trials if t.get("started_at") and t.get("ended_at")]
    finished = sum(1 for t in result.trials if t["status"] == "finished")
    found = {
        "trials": len(result.trials),
        "finished": finished,
        "peak_running": peak_overlap(spans),
        "wall_s": round(time.monotonic() - started, 1),
        "goal": f"{concurrent} concurrent 1-worker trials complete",
    }
    say(f"  {found}")
    return found


def run_tune_bench(
    *,
    measures: tuple[str, ...] = MEASURES,
    trials: int = 3,
    steps: int = 15_000,
    asha_trials: int = 12,
    concurrent: int = 10,
    concurrent_steps: int = 200,
    output: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    shown = console or make_console()

    def say(text: str) -> None:
        shown.print(text, highlight=False, soft_wrap=True)

    report: dict[str, Any] = {"machine": machine(), "measures": {}}
    say(f"bench tune: {report['machine']}")
    with tempfile.TemporaryDirectory(prefix="trainforge-bench-tune-") as scratch:
        for measure in measures:
            say(f"{measure}:")
            where = Path(scratch) / measure
            if measure == "overhead":
                found = measure_overhead(where, trials, steps, say)
            elif measure == "asha":
                found = measure_asha(where, asha_trials, say)
            else:
                found = measure_concurrency(where, concurrent, concurrent_steps, say)
            found["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
            report["measures"][measure] = found
    print_report(shown, report)
    if output is not None:
        output.write_text(json.dumps(report, indent=1))
    return report


def print_report(console: Console, report: dict[str, Any]) -> None:
    measures = report["measures"]
    lines = []
    if "overhead" in measures:
        m = measures["overhead"]
        share = m["median_share"]
        if m["median_wall_s"] < 60:
            verdict = "not judged: trials under 60 s, raise --steps"
        else:
            verdict = "pass" if share is not None and share < 0.05 else "miss"
        lines.append(
            f"trial overhead: median {m['median_overhead_s']:.1f} s of {m['median_wall_s']:.1f} s per trial "
            f"= {share:.1%} ({m['median_before_loop_s']:.1f} s before the training loop, "
            f"{m['median_after_loop_s']:.1f} s after it; goal < 5% for trials >= 60 s): {verdict}"
        )
    if "asha" in measures:
        m = measures["asha"]
        lines.append(
            f"ASHA compute saved: {m['compute_saved']:.0%} ({m['asha']['steps_run']:,} vs {m['none']['steps_run']:,} "
            f"steps); best {m['metric']} {fmt_value(m['asha']['best_metric'])} with ASHA, "
            f"{fmt_value(m['none']['best_metric'])} "
            f"without (goal > 50% at equal best): {'pass' if m['compute_saved'] > 0.5 else 'miss'}"
        )
    if "concurrency" in measures:
        m = measures["concurrency"]
        ok = m["finished"] == m["trials"] and m["peak_running"] == m["trials"]
        lines.append(
            f"concurrency: {m['finished']}/{m['trials']} trials finished, at most {m['peak_running']} running at once "
            f"({m['wall_s']:.0f} s): {'pass' if ok else 'miss'}"
        )
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
