"""A run's start-up timeline (driver/startup.py): phases in order, clipped marks, the CLI's marks."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from trainforge.bench.startup import Start, goal_lines, summarise
from trainforge.driver import startup
from trainforge.driver.startup import PHASES, Timeline, process_start_time


def test_phases_last_from_the_previous_mark_in_the_order_they_happen() -> None:
    timeline = Timeline(start=100.0)
    # Out of order on purpose: marks arrive from the driver, the controller and rank 0.
    timeline.add({"first_step": 110.0, "controller": 104.0, "ray": 101.5, "workers": 106.0})
    found = timeline.to_dict()
    assert found is not None
    assert list(found["phases"]) == ["ray", "controller", "workers", "first_step"]
    assert found["phases"] == {"ray": 1.5, "controller": 2.5, "workers": 2.0, "first_step": 4.0}
    assert found["to_first_step_s"] == 10.0 == pytest.approx(sum(found["phases"].values()))
    assert found["start_unix"] == 100.0


def test_a_mark_from_a_skewed_clock_is_a_zero_phase_not_a_negative_one() -> None:
    timeline = Timeline(start=100.0)
    timeline.add({"ray": 103.0, "controller": 102.0, "first_step": 105.0})  # the controller's node runs behind
    found = timeline.to_dict()
    assert found is not None
    assert found["phases"] == {"ray": 3.0, "controller": 0.0, "first_step": 2.0}
    assert all(seconds >= 0 for seconds in found["phases"].values())


def test_the_first_end_of_a_phase_is_kept_and_unknown_names_are_refused() -> None:
    timeline = Timeline(start=0.0)
    timeline.mark("workers", 5.0)
    timeline.add({"workers": 9.0, "not_a_phase": 1.0})  # a restarted group's marks: recovery, not start-up
    assert timeline.marks == {"workers": 5.0}
    with pytest.raises(ValueError, match="unknown start-up phase"):
        timeline.mark("warp_drive")
    assert Timeline(start=0.0).to_dict() is None
    assert "to_first_step_s" not in (Timeline(start=0.0).to_dict() or {})


def test_the_cli_marks_go_to_the_first_timeline_only() -> None:
    startup.command_started()
    first, second = Timeline(), Timeline()
    assert "cli" in first.marks and first.start <= first.marks["cli"] <= time.time()
    assert second.marks == {} and second.start >= first.start


def test_the_process_start_is_exact_to_a_tick_not_to_a_second() -> None:
    """psutil's create_time rests on the boot time in whole seconds; ours reads the boot clock."""
    ours = process_start_time()
    assert ours <= time.time()
    assert abs(ours - psutil.Process().create_time()) < 1.05
    assert time.time() - ours < 24 * 3600  # this test process did not start yesterday


def test_a_command_a_shell_execs_after_waiting_starts_when_python_does() -> None:
    """``bash -c "slow step && trainforge train"``: bash execs the last command in its own process,
    whose start is the shell's; the command's clock must not count the wait before it."""
    probe = (
        "import time; from trainforge.driver.startup import command_start_time, process_start_time; "
        "now = time.time(); print(now - command_start_time(waited_s=1.0), now - process_start_time())"
    )
    out = subprocess.run(
        ["bash", "-c", f'sleep 3; exec "{sys.executable}" -c "{probe}"'], capture_output=True, text=True, check=True
    ).stdout
    command_age, process_age = (float(value) for value in out.split())
    assert process_age >= 3.0  # the shell's start, before its sleep
    assert command_age < process_age - 2.0  # the interpreter's own start-up only


def test_the_phase_table_names_every_phase_once() -> None:
    names = [name for name, _ in PHASES]
    assert len(set(names)) == len(names) and names[-1] == "first_step"


def test_bench_startup_summarises_medians_ratios_and_phases() -> None:
    found = [
        Start("ray_train", "cold", 0, 10.0, 14.0),
        Start("ray_train", "cold", 1, 12.0, 15.0),
        Start("trainforge", "cold", 0, 11.0, 16.0, {"ray": 3.0, "first_step": 0.1}),
        Start("trainforge", "cold", 1, 11.0, 17.0, {"ray": 1.0, "first_step": 0.3}),
        Start("ray_train", "running", 0, 8.0, 9.0),
        Start("trainforge", "running", 0, 9.6, 11.0, {"controller": 2.0}),
        Start("trainforge", "warm", 0, 0.4, 1.2, {"controller": 0.1}),
        Start("trainforge", "warm", 1, 0.6, 1.4, {"controller": 0.3}),
    ]
    summary = summarise(found)
    rows = {(row["peer"], row["setting"]): row for row in summary["rows"]}
    assert rows[("ray_train", "cold")]["first_step_s"] == 11.0 and rows[("ray_train", "cold")]["runs"] == 2
    assert rows[("trainforge", "cold")]["exit_s"] == 16.5
    assert summary["ratios"] == {"cold": 1.0, "running": 1.2}
    assert summary["phases"]["cold"] == {"ray": 2.0, "first_step": 0.2}
    lines = goal_lines(summary)
    assert lines[0] == "trainforge / plain Ray Train, cold: 1.00 (goal <= 1.05: met)"
    assert "in a running Ray: 1.20 (goal <= 1.10: NOT met)" in lines[1]
    # On warm workers: against torchrun's cold first step (the 7.8 s when not measured).
    assert summary["phases"]["warm"] == {"controller": 0.2}
    assert summary["warm"] == {"first_step_s": 0.5, "torchrun_cold_s": 7.8}
    assert lines[2] == "trainforge on warm workers: first step 0.5 s (goal < torchrun's cold 7.8 s: met)"
    with_torchrun = summarise([*found, Start("torchrun", "cold", 0, 0.45, 1.0)])
    assert "(goal < torchrun's cold 0.5 s: NOT met)" in goal_lines(with_torchrun)[2]
