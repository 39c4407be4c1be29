"""``trainforge bench startup``: one measurement of every peer through the real CLI, and its flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled
from tests.integration.test_cli import assert_user_error, in_process
from trainforge.bench.startup import PEERS
from trainforge.driver.startup import PHASES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 70 s on a quiet 2-core machine: five runs, four of them start a Ray
def test_every_peer_reaches_its_first_step_cold_and_in_a_running_ray(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TERM": "dumb"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "trainforge", "bench", "startup", "--repeats", "1", "--output", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(850),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    settings = {(row["peer"], row["setting"]) for row in report["rows"]}
    running = {("ray_train", "running"), ("trainforge", "running"), ("trainforge", "warm")}
    assert settings == {*((peer, "cold") for peer in PEERS), *running}
    for row in report["rows"]:
        # The exit comes after the first step; a first step needs at least an interpreter's start.
        assert 0.1 < row["first_step_s"] <= row["exit_s"], row
    for setting in ("cold", "running", "warm"):
        mine = next(r for r in report["rows"] if r["peer"] == "trainforge" and r["setting"] == setting)
        if setting != "warm":
            theirs = next(r for r in report["rows"] if r["peer"] == "ray_train" and r["setting"] == setting)
            ratio = mine["first_step_s"] / theirs["first_step_s"]
            assert report["ratios"][setting] == pytest.approx(ratio, abs=0.002)
        phases = report["phases"][setting]
        assert set(phases) <= {name for name, _ in PHASES} and "first_step" in phases
        # trainforge's phases add up to its measured first step: nothing of the start goes untimed
        # but the moment between the launch and the process's own start (or the call and fit's first line).
        gap = mine["first_step_s"] - sum(phases.values())
        assert -0.05 <= gap <= scaled(1.0), (setting, phases, mine)
    # The config read is timed in every setting: from the command's start, or from the fit call.
    assert all("cli" in report["phases"][setting] for setting in ("cold", "running", "warm"))
    assert "Seconds to the first step" in result.stdout and "trainforge's start by phase" in result.stdout
    assert "trainforge / plain Ray Train, cold:" in result.stdout
    torchrun = next(r for r in report["rows"] if r["peer"] == "torchrun")
    assert report["warm"]["torchrun_cold_s"] == torchrun["first_step_s"]
    assert "trainforge on warm workers: first step" in result.stdout
    assert not list(tmp_path.glob("runs")), "the benchmark must not leave run folders in the working directory"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--repeats", "0"], "--repeats 0: must be >= 1"),
        (["--workers", "0"], "--workers 0: must be 1-64"),
        (["--setting", "warm"], "--setting 'warm': cold, running or both"),
    ],
)
def test_bad_flags_are_one_line(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(in_process("bench", "startup", *args, capsys=capsys), expected)
