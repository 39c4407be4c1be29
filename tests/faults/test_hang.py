"""A hung worker (SIGSTOP, as a stuck NCCL/gloo call or a frozen host would look) does not stall the run.

The other rank's collective times out after ``failure.collective_timeout_s``, Ray Train counts a
worker-group failure, kills the group (the frozen process included) and restarts it; trainforge
resumes from the newest checkpoint and finishes.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import trainforge
from tests.helpers.faults import Fault, checkpoints, paced_run, recovery_s, reports, signal_a_worker

TIMEOUT_S = 10


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_frozen_worker_times_out_and_the_run_resumes(tmp_path: Path) -> None:
    config = paced_run(
        tmp_path,
        scaling={"num_workers": 2},
        failure={"max_failures": 2, "collective_timeout_s": TIMEOUT_S},
    )
    run_dir = tmp_path / "t"

    def freeze() -> dict[str, Any]:
        return {**signal_a_worker(signal.SIGSTOP), "after": checkpoints(run_dir)[-1].name}

    with Fault(lambda: checkpoints(run_dir), freeze) as fault:
        started = time.monotonic()
        result = trainforge.fit(config)
        wall_s = time.monotonic() - started
        frozen = fault.join()
        stopped_pid = frozen["stopped_pid"]
        # Ray killed the frozen process when it tore the group down (fault.close() is the safety net).
        assert not psutil.pid_exists(stopped_pid) or psutil.Process(stopped_pid).status() == psutil.STATUS_ZOMBIE

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 60
    assert summary["restarts"] >= 1
    errors = [e for r in reports(run_dir) if r.get("event") == "worker_error" for e in r["errors"].values()]
    # gloo's own message carries the timeout it was given: failure.collective_timeout_s reached it.
    assert any(f"{TIMEOUT_S * 1000}ms" in e or "timed out" in e.lower() for e in errors), errors
    print(
        f"\nhang: SIGSTOP after {frozen['after']}; worker errors {errors}; first step after recovery "
        f"{recovery_s(run_dir, frozen['at']):.1f} s after the freeze; summary recovery_s {summary['recovery_s']}; "
        f"run wall {wall_s:.1f} s"
    )
