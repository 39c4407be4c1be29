"""``python -m trainforge.bench.steploop``: trainforge's loop against the plain one in one process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from trainforge.bench.steploop import PartClock, summary_lines
from trainforge.bench.workload import WARMUP_STEPS


def test_part_clock_leaves_out_the_warm_up_steps_and_the_rest_is_the_step_less_its_parts() -> None:
    clock = PartClock()
    for _ in range(WARMUP_STEPS):
        clock.add(1.0, 1.0, 1.0)  # warm-up: slow, not counted
    for _ in range(10):
        clock.add(0.001, 0.030, 0.002)
    figures = clock.figures(samples_per_s=1600.0, global_batch=64)  # 40 ms a step
    assert figures["data"] == pytest.approx(1.0) and figures["compute"] == pytest.approx(30.0)
    assert figures["optimizer"] == pytest.approx(2.0) and figures["step"] == pytest.approx(40.0)
    assert figures["rest"] == pytest.approx(7.0)


def test_the_summary_gives_medians_and_trainforges_difference_per_part() -> None:
    def row(rate: float, compute: float) -> dict[str, float]:
        parts = {"data": 4.0, "compute": compute, "optimizer": 0.5, "rest": 0.0}
        return {**parts, "step": 64_000 / rate, "samples_per_s": rate}

    rows = [("plain", row(1600.0, 30.0)), ("trainforge", row(1500.0, 31.0)), ("plain", row(1800.0, 28.0))]
    rows.append(("trainforge", row(1700.0, 29.0)))
    lines = summary_lines(rows)
    assert "1700.0 samples/s" in lines[0] and "1600.0 samples/s" in lines[1], lines
    assert lines[2].startswith("trainforge/plain 0.941 (samples/s)"), lines[2]
    assert "forward+backward +1.00 ms" in lines[2] and "data +0.00 ms" in lines[2], lines[2]


@pytest.mark.slow  # a process that builds the CNN and trains it through both loops
def test_the_benchmark_times_both_loops() -> None:
    command = [sys.executable, "-m", "trainforge.bench.steploop", "--steps", "10", "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    rows = {m.group(1): m for m in re.finditer(r"repeat 1  (plain loop|trainforge) +([\d.]+) samples/s.*", done.stdout)}
    assert set(rows) == {"plain loop", "trainforge"}, done.stdout
    assert all(float(m.group(2)) > 0 for m in rows.values())
    optimizer = re.search(r"trainforge .*optimizer +([\d.]+) ms", rows["trainforge"].group(0))
    assert optimizer is not None and float(optimizer.group(1)) > 0, rows["trainforge"].group(0)
    assert re.search(r"^trainforge/plain [\d.]+ \(samples/s\); per step", done.stdout, re.M), done.stdout
    bad = subprocess.run([*command[:3], "--steps", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--steps must be >= 10" in bad.stderr
