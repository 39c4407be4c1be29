"""A pipelined run (2 stages x 2 replicas) with one Ray Train worker SIGKILLed after its step-20
checkpoint: Ray Train restarts the group, every stage restores its own state from the checkpoint,
and the run ends bit-identical to the uninterrupted one. The same in gloo ranks without Ray (a
crash at a report, restarted in new processes): tests/integration/test_pipeline.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trainforge
from tests.helpers.faults import kill_a_worker_after
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical, checkpoint_state

STEPS = 120  # about 6 s of steps after the kill at step 20 on 2 cores: the kill lands mid-run


def pipelined(tmp: Path) -> dict[str, Any]:
    return tiny_run(
        tmp,
        model={"name": "llama_tiny", "kwargs": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}},
        data={"name": "synthetic", "kind": "tokens", "seq_len": 16, "vocab_size": 64, "num_samples": 4096},
        train={"max_steps": STEPS, "batch_size": 8, "log_every_n_steps": 10, "grad_clip_norm": 0.5},
        optim={"name": "adamw", "lr": 3e-3},
        scaling={"num_workers": 4},
        parallel={"pipeline": {"stages": 2, "schedule": "1f1b", "microbatches": 4}},
        checkpoint={"every_n_steps": 20, "keep_last": 10},
        failure={"max_failures": 1},
        seed=5,
    )


@pytest.mark.slow  # two Ray runs of 4 workers: about 90 s on 2 cores
@pytest.mark.usefixtures("ray_local")
def test_pipelined_worker_killed_resumes_bit_identical(tmp_path: Path) -> None:
    reference = trainforge.fit(pipelined(tmp_path / "straight"))
    assert reference.status == "finished"
    run_dir = tmp_path / "killed" / "t"
    killed = kill_a_worker_after(run_dir / "checkpoint_000000020")
    resumed = trainforge.fit(pipelined(tmp_path / "killed"))
    assert killed, "no worker was killed"
    assert resumed.summary["status"] == "finished" and resumed.summary["restarts"] == 1
    assert_bit_identical(checkpoint_state(reference.run_dir, STEPS), checkpoint_state(run_dir, STEPS))
