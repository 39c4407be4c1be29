"""``trainforge bench peers``: a CI-sized run through the real CLI, its flags, and its arithmetic."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers.timing import scaled
from trainforge.bench.peers import Measurement, goal_lines, results_table, spread_line, summarise
from trainforge.bench.workload import WARMUP_STEPS, StepClock, Workload

ROOT = Path(__file__).resolve().parents[2]
# The CI-sized run leaves out (e) (trainforge with observers off: (d)'s path, a Ray Train start more) and
# (f) Lightning and (g) Accelerate (they add minutes, not paths); the table's (e) column is checked below.
MEASURED = "abcd"


def bench(*args: str, cwd: Path, timeout: int = 1100) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "trainforge", "bench", "peers", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 1 to 3 minutes on a busy 2-core machine, most of it Ray start-up
def test_ci_sized_run_measures_every_peer_and_prints_the_table(tmp_path: Path) -> None:
    """Two workers: every peer's distributed path (DDP processes, torchrun, Ray workers)."""
    out = tmp_path / "out.json"
    flags = ("--workers", "2", "--steps", "20", "--repeats", "1", "--peers", MEASURED, "--output", str(out))
    result = bench(*flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    report = json.loads(out.read_text())
    assert [row["workers"] for row in report["rows"]] == [2]
    assert len(report["measurements"]) == len(MEASURED)
    assert all(m["samples_per_s"] > 0 and m["first_step_s"] > 0 for m in report["measurements"])
    for row in report["rows"]:
        assert all(row[peer] > 0 for peer in MEASURED)
        assert set(row["first_step_s"]) == set(MEASURED)
        assert row["d/c"] == pytest.approx(row["d"] / row["c"])
        assert row["d/b"] == pytest.approx(row["d"] / row["b"])
        assert row["d/a"] == pytest.approx(row["d"] / row["a"])
        # One repeat: the median is the measurement itself.
        for peer in MEASURED:
            (only,) = [m for m in report["measurements"] if m["peer"] == peer and m["workers"] == row["workers"]]
            assert row[peer] == only["samples_per_s"]
    assert report["workload"]["steps"] == 20
    assert report["workload"]["warmup_steps"] == WARMUP_STEPS
    assert report["workload"]["kind"] == "cnn" and report["workload"]["unit"] == "samples/s"

    table = result.stdout[result.stdout.index("samples/s over all workers, median of 1") :]
    headers = ("(a) PyTorch", "(b) torchrun", "(c) Ray", "trainforge", "d/a", "d/c", "d/b")
    for header in headers:
        assert header in table, result.stdout
    for row in report["rows"]:
        assert f"{row['d/c']:.3f}" in table and f"{row['d/b']:.3f}" in table, result.stdout
    assert "goal d/c >= 1.00:" in result.stdout
    assert "goal d/b >= 0.93:" in result.stdout
    assert "goal d/e" not in result.stdout and "(e) trainforge" not in table, "(e) was not measured"
    assert "repeats: 1, so no spread" in result.stdout
    assert "seconds to the first step, median" in result.stdout and "from the command's launch" in result.stdout
    # Progress: a line per measurement while it runs.
    progress = r"^  2 workers\s+1/1  \(\w\) .* samples/s  first step .* load"
    assert len(re.findall(progress, result.stdout, re.M)) == len(MEASURED)
    assert "run report" not in result.stderr, "the peers' temporary run folders are not worth a log line"
    assert not list(tmp_path.glob("runs")), "the benchmark must not leave run folders in the working directory"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--repeats", "0"], "--repeats 0: must be >= 1"),
        (["--steps", "5"], "--steps 5: must be >= 10"),
        (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (["--workers", "0,2"], "--workers '0,2': counts from 1 to 10000"),
        (["--workers", "one"], "expected comma-separated integers"),
        (["--output", "/nonexistent-dir/out.json"], "folder /nonexistent-dir does not exist"),
        (["--peers", "dx"], "--peers 'dx': letters from abcdefg or names pytorch"),
        (["--workload", "gpt"], "--workload 'gpt': cnn or lm"),
        (["--set", "parallel.channels_lst=false"], "unknown key parallel.channels_lst"),
        (["--set", "train"], "--set 'train': expected key=value"),
    ],
)
def test_bad_values_are_one_line_and_exit_code_2(tmp_path: Path, args: list[str], expected: str) -> None:
    started = time.monotonic()
    result = bench(*args, cwd=tmp_path, timeout=scaled(60))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("error:") and expected in errors[0], errors[0]
    assert time.monotonic() - started < 30, "bad flags must be refused before anything is measured"


def test_warmup_matches_trainforge_throughput_definition() -> None:
    from trainforge.worker.metrics import WARMUP_STEPS as TRAINFORGE_WARMUP

    assert WARMUP_STEPS == TRAINFORGE_WARMUP


def test_step_clock_times_from_the_end_of_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(float(t) for t in range(100))
    monkeypatch.setattr("trainforge.bench.workload.time.perf_counter", lambda: next(ticks))
    walls = iter(1000.0 + t for t in range(100))
    monkeypatch.setattr("trainforge.bench.workload.time.time", lambda: next(walls))
    clock = StepClock(global_batch=128, warmup=5)
    for _ in range(15):
        clock.step_done()
    # Steps end at t = 0..14: the clock runs from t = 4 (end of step 5) to t = 14, over 10 steps;
    # the first step's wall-clock end (bench startup's figure) is taken once, at step 1.
    assert clock.result() == {"samples_per_s": 128.0, "timed_steps": 10, "timed_s": 10.0, "first_step_unix": 1000.0}


def test_workload_holds_one_epoch_at_the_largest_worker_count() -> None:
    workload = Workload.sized_for(steps=20, batch_size=64, max_workers=2)
    assert workload.total_steps == WARMUP_STEPS + 20
    assert workload.num_samples == workload.total_steps * 64 * 2
    config = workload.trainforge_config(2, name="x", output_dir="/tmp")
    assert config["train"]["max_steps"] == workload.total_steps
    assert config["data"]["val_fraction"] == 0
    assert config["optim"] == {"name": "sgd", "lr": 0.01, "momentum": 0.9}


def test_rows_quote_medians_and_goals_say_pass_or_miss() -> None:
    figures = {"a": [10.0, 30.0, 20.0], "b": [100.0, 100.0, 100.0], "c": [90.0, 100.0, 95.0], "d": [96.0, 90.0, 99.0]}
    measurements = [
        Measurement(peer, 2, repeat, rate, 1.0, 0.5)
        for peer, rates in figures.items()
        for repeat, rate in enumerate(rates)
    ]
    (row,) = summarise(measurements, [2], "abcd")
    # Peers (e), (f) and (g) were not measured: no d/e, d/f or d/g ratio, and no goal line for them.
    first_steps = {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}
    expected = {"a": 20.0, "b": 100.0, "c": 95.0, "d": 96.0, "d/a": 4.8, "d/b": 0.96, "d/c": 96.0 / 95.0}
    assert row == {"workers": 2, **expected, "first_step_s": first_steps}
    assert goal_lines([row]) == [
        "goal d/c >= 1.00: pass at 2 worker(s) (1.011)",
        "goal d/b >= 0.93: pass at 2 worker(s) (0.960)",
    ]
    assert goal_lines([{**row, "d/b": 0.9}])[1] == "goal d/b >= 0.93: miss at 2 worker(s) (0.900)"

    # (e), trainforge with its observers off, measured too: its column, d/e and its goal.
    observed_off = [Measurement("e", 2, repeat, rate, 1.0, 0.5) for repeat, rate in enumerate([100.0, 90.0, 94.0])]
    (row,) = summarise([*measurements, *observed_off], [2], "abcde")
    assert row["e"] == 94.0 and row["d/e"] == pytest.approx(96.0 / 94.0)
    assert goal_lines([row])[2] == "goal d/e >= 0.98: pass at 2 worker(s) (1.021)"
    console = Console(file=io.StringIO(), width=200)
    console.print(results_table([row], 3, "abcde"))
    shown = console.file.getvalue()
    assert "(e) trainforge" in shown and "d/e" in shown and "1.021" in shown, shown


def test_spread_line_names_the_noisiest_measurement() -> None:
    measurements = [
        Measurement("a", 1, 0, 100.0, 1.0, 0.5),
        Measurement("a", 1, 1, 110.0, 1.0, 2.0),
        Measurement("c", 1, 0, 100.0, 1.0, 1.0),
        Measurement("c", 1, 1, 150.0, 1.0, 1.5),
    ]
    line = spread_line(measurements)
    assert line.startswith("spread between repeats: median 30%, largest 50% ((c) Ray Train at 1 worker(s))"), line
    assert "load average 0.5-2.0" in line
    assert "no spread" in spread_line(measurements[::2])


def test_set_overrides_only_trainforges_config_and_travels_with_the_workload() -> None:
    """``--set``: the (d) and (e) runs' config gets it; the workload the script peers read keeps it too."""
    from trainforge.bench.workload import Workload

    plain = Workload(kind="cnn").trainforge_config(2, "n", "/tmp/out")
    assert "parallel" not in plain
    workload = Workload(kind="cnn", overrides=("parallel.channels_last=false", "train.log_every_n_steps=7"))
    config = workload.trainforge_config(2, "n", "/tmp/out")
    assert config["parallel"] == {"channels_last": False} and config["train"]["log_every_n_steps"] == 7
    assert config["model"] == plain["model"] and config["train"]["batch_size"] == plain["train"]["batch_size"]
    assert Workload.from_json(workload.to_json()) == workload
    # (d)'s own observation settings come first: a --set of them wins.
    watched = Workload(overrides=("metrics.enabled=false",)).trainforge_config(2, "n", "/tmp/out", observed=True)
    assert watched["metrics"] == {"enabled": False, "comm_timing": True} and watched["tracking"] == {"enabled": True}
