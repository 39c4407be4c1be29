"""A hung worker (SIGSTOP, as a stuck NCCL/gloo call or a frozen host would look) is diagnosed and
the run recovers without waiting for it.

The other rank's watchdog sees its step run past the run's own step times (failure.hang: after
warm-up, 10 x the p99, at least floor_s) and tells the driver, which names the rank that sent
nothing, reads its state and stack where it runs (py-spy) into ``diagnosis/<time>/``, and kills
it: the peer's collective fails at once, Ray Train restarts the group and trainforge resumes from
the newest checkpoint. ``failure.collective_timeout_s`` stays the ceiling.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import trainforge
from tests.helpers.faults import Fault, checkpoints, paced_run, recovery_s, reports, signal_a_worker

TIMEOUT_S = 60
FLOOR_S = 3


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_frozen_worker_is_named_with_its_stack_killed_and_the_run_resumes(tmp_path: Path) -> None:
    config = paced_run(
        tmp_path,
        scaling={"num_workers": 2},
        failure={
            "max_failures": 2,
            "collective_timeout_s": TIMEOUT_S,
            "hang": {"floor_s": FLOOR_S, "warmup_steps": 5},
        },
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
        # The driver killed the frozen process (fault.close() is the safety net).
        assert not psutil.pid_exists(stopped_pid) or psutil.Process(stopped_pid).status() == psutil.STATUS_ZOMBIE

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 60
    assert summary["restarts"] >= 1
    (hang,) = [r for r in reports(run_dir) if r.get("event") == "hang"]
    (folder,) = sorted((run_dir / "diagnosis").iterdir())
    assert hang["diagnosis"] == str(folder)
    found = json.loads((folder / "diagnosis.json").read_text())
    frozen_rank = next(int(rank) for rank, record in found["ranks"].items() if record["pid"] == stopped_pid)
    assert hang["ranks"] == [frozen_rank] and hang["killed"] == [frozen_rank]
    record = found["ranks"][str(frozen_rank)]
    assert record["arrived"] is False and record["state"] == "stopped" and record["stack_source"] == "py-spy"
    assert any("loop.py" in frame for frame in record["stack"])  # the training thread's frames, read by py-spy
    other = next(r for rank, r in found["ranks"].items() if int(rank) != frozen_rank)
    assert other["arrived"] is True and other["waited_s"] > FLOOR_S
    assert f"rank {frozen_rank} (node " in hang["text"] and f"pid {stopped_pid}, stopped)" in hang["text"]
    assert (folder / f"rank{frozen_rank}.txt").read_text().strip()
    # No wait for the collective timeout: the peer failed when the frozen rank was killed.
    errors = [e for r in reports(run_dir) if r.get("event") == "worker_error" for e in r["errors"].values()]
    assert not any(f"{TIMEOUT_S * 1000}ms" in e for e in errors), errors
    print(
        f"\nhang: SIGSTOP after {frozen['after']}; diagnosis: {hang['text']}; worker errors {errors}; first step "
        f"after recovery {recovery_s(run_dir, frozen['at']):.1f} s after the freeze; summary recovery_s "
        f"{summary['recovery_s']}; run wall {wall_s:.1f} s"
    )
