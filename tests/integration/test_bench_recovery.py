"""``trainforge bench recovery``: a killed worker through both peers via the real CLI, and its flags.
(The frozen-worker rows take minutes: their path is tests/faults/test_hang.py's; a lost node's is
tests/faults/test_nodes.py's.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled
from tests.integration.test_cli import assert_user_error, in_process

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 90 s on a quiet 2-core machine: three runs with a restart each
def test_a_killed_worker_is_measured_for_trainforge_and_ray_train_alone(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TERM": "dumb"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "trainforge", "bench", "recovery", "--faults", "killed", "--output", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(850),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(row["fault"], row["peer"], row["setting"]): row for row in report["rows"]}
    assert set(rows) == {
        ("killed", "trainforge", ""),
        ("killed", "trainforge", "failure.replace: worker"),
        ("killed", "Ray Train alone", ""),
    }
    for row in rows.values():
        # A restart starts new worker processes: more than an interpreter's start, and a step came.
        assert row["runs"] == 1 and row["without_a_next_step"] == 0, row
        assert row["seconds"] is not None and row["seconds"] > 0.1, row
    assert "From the fault to the next completed step" in result.stdout
    assert report["machine"]["cpu_count"] == os.cpu_count()
    assert not list(tmp_path.glob("runs")), "the benchmark must not leave run folders in the working directory"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--faults", "melted"], "--faults 'melted': a comma-separated list of killed, frozen, lost"),
        (["--faults", ""], "--faults '': a comma-separated list of killed, frozen, lost"),
        (["--repeats", "0"], "--repeats 0: must be 1-100"),
    ],
)
def test_bad_flags_are_one_line(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(in_process("bench", "recovery", *args, capsys=capsys), expected)


def test_ray_train_alones_next_step_is_the_restarted_groups(tmp_path: Path) -> None:
    """A step rank 0 finished after the fault, before its group failed, is not recovery: the next
    step is the first that goes back (the new group redoes the steps since the checkpoint)."""
    from trainforge.bench.recovery import next_logged_step

    steps = tmp_path / "steps.txt"
    steps.write_text("19 100.0\n20 100.1\n21 100.3\n21 106.0\n22 106.1\n")  # fault at 100.2
    assert next_logged_step(steps, 100.2) == pytest.approx(5.8)
    steps.write_text("19 100.0\n20 100.1\n21 106.0\n")  # nothing in flight: the first step after it
    assert next_logged_step(steps, 100.2) == pytest.approx(5.8)
    assert next_logged_step(steps, 200.0) is None and next_logged_step(steps, None) is None
