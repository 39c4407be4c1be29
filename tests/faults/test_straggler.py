"""A slowed worker is named as a straggler, and ``failure.straggler.action: restart`` restarts the
group (issue 37, section 3).

One real Ray Train worker process is slowed from outside, as a busy or throttled host would slow
it: stopped and continued on a duty cycle (SIGSTOP 100 ms, SIGCONT 100 ms). Its own time per step
(data wait and forward) grows, its peer's does not (the peer waits in backward), so the report
after ``window_steps`` slow steps names it, with its node and pid, and every rank raises: Ray Train
restarts the group from the newest checkpoint, the slowed process is gone, and the run finishes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trainforge
from tests.helpers.faults import (
    Fault,
    checkpoints,
    duty_cycle,
    events_of,
    paced_run,
    reports,
    wait_until,
    worker_pids,
)
from trainforge.protocol import Straggler

STOP_S = CONT_S = 0.1
MAX_SLOWED_S = 180


def slow_a_worker() -> dict[str, Any]:
    """Stop and continue one training worker until its process is gone (the group restarted)."""
    pid = max(wait_until(worker_pids, 30, "a training worker process"))
    return duty_cycle(pid, STOP_S, CONT_S, MAX_SLOWED_S)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_slowed_worker_is_named_and_restart_restarts_the_group(tmp_path: Path) -> None:
    config = paced_run(
        tmp_path,
        train={"max_steps": 150},
        scaling={"num_workers": 2},
        failure={"max_failures": 2, "straggler": {"threshold": 1.5, "window_steps": 20, "action": "restart"}},
    )
    config["model"]["kwargs"] = {"delay_s": 0.02}
    run_dir = tmp_path / "t"

    with Fault(lambda: checkpoints(run_dir), slow_a_worker) as fault:
        result = trainforge.fit(config)
        slowed = fault.join(timeout_s=MAX_SLOWED_S + 30)

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 150
    assert summary["restarts"] >= 1
    lines = reports(run_dir)
    named = [(line, e) for line in lines for e in events_of(line) if isinstance(e, Straggler)]
    assert named, [e.text for line in lines for e in events_of(line)]
    line, first = named[0]
    assert first.pid == slowed["pid"] and first.action == "restart" and first.score > 1.5, first.text
    assert f"rank {first.rank} (node " in first.text
    errors = [e for r in lines if r.get("event") == "worker_error" for e in r["errors"].values()]
    assert any("is a straggler" in e for e in errors), errors
    print(
        f"\nstraggler: {first.text}; named {line['time/unix'] - slowed['at']:.1f} s after the duty cycle began "
        f"({slowed['cycles']} cycles of {STOP_S} s stopped / {CONT_S} s running); restarts {summary['restarts']}, "
        f"recovery_s {summary.get('recovery_s')}"
    )
