"""``train.anomaly`` end to end in a Ray Train run: a NaN from the model (once, at one forward)
and a loss spike from a bad sample, both rolled back, attributed in metrics.jsonl's events and
counted in summary.json; the run finishes with a finite loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import trainforge
from tests.helpers.anomalies import BAD_INDEX
from tests.helpers.runs import tiny_run

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.mark.slow  # one Ray Train run of 16 steps with two in-process rollbacks: over 10 s
def test_a_nan_and_a_spike_are_attributed_and_rolled_back_in_a_ray_run(tmp_path: Path) -> None:
    config = tiny_run(
        tmp_path,
        run={"name": "anomalies"},
        model={"name": None, "factory": "tests.helpers.anomalies:nan_once", "kwargs": {"at": 6}},
        data={"name": "factory", "factory": "tests.helpers.anomalies:digits_huge", "shuffle": False},
        train={"max_steps": 16, "batch_size": 16, "anomaly": {"window": 5, "action": "rollback"}},
        checkpoint={"every_n_steps": 4},
    )
    summary = trainforge.fit(config).summary
    assert summary["status"] == "finished" and summary["global_step"] == 16
    assert math.isfinite(summary["final_metrics"]["train/loss"])
    assert summary["anomalies"] == {"skipped": 0, "rolled_back": 2, "attributed": {"data": 1, "not_data": 1}}
    lines = (tmp_path / "anomalies" / "metrics.jsonl").read_text().splitlines()
    events = [e for line in lines for e in json.loads(line).get("events", []) if e.get("kind") == "anomaly"]
    nan, spike = events
    assert (nan["step"], nan["anomaly"], nan["attribution"], nan["action"]) == (
        6,
        "nonfinite",
        "not_data",
        "rolled_back",
    )
    assert nan["checkpoint"].endswith("checkpoint_000000004") and nan["lr"] == pytest.approx(0.025)
    # After the first rollback the steps from 5 on read from sample 96: the bad one is in step 11's batch.
    assert (spike["step"], spike["anomaly"], spike["attribution"]) == (11, "spike", "data")
    assert spike["checkpoint"].endswith("checkpoint_000000008") and spike["lr"] == pytest.approx(0.0125)
    assert BAD_INDEX in spike["samples"] and len(spike["samples"]) == 16
