"""checkpoint.resume (auto, none, a path) and the save triggers, on a real local Ray.

Every run here is of one shape, so they share a warm worker group (``scaling.reuse_workers``): the
first starts it as Ray Train would (~12 s on a quiet machine, 30-45 s loaded), the others start in
about a second. Resume and the save triggers are the worker's Session's, the same code either way;
under Ray Train's own worker group they run in test_exact_resume.py, test_mlflow.py and
test_ckpt_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainforge
from tests.helpers.faults import events_of
from tests.helpers.runs import tiny_run
from trainforge.errors import CheckpointError

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]


def warm_run(tmp_path: Path, **sections: dict) -> dict:
    """``tiny_run`` on this module's warm worker group."""
    return tiny_run(tmp_path, scaling={"reuse_workers": True}, **sections)


def events(run_dir: Path) -> list[str]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e.text for line in lines for e in events_of(json.loads(line))]


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("checkpoint_*"))


def test_auto_continues_none_refuses_and_a_path_starts_from_it(tmp_path: Path) -> None:
    first = trainforge.fit(warm_run(tmp_path, train={"max_steps": 10}, checkpoint={"every_n_steps": 5}))
    assert names(first.run_dir) == ["checkpoint_000000005", "checkpoint_000000010"]
    assert first.summary["checkpoint"].endswith("checkpoint_000000010")

    # Re-running a finished run resumes from its newest checkpoint, changes nothing and writes no
    # new checkpoint. (The same run with a longer budget continuing from its newest valid checkpoint,
    # the other half of auto, is test_mlflow.py's resume and test_ckpt_cli.py's walk-back past a
    # corrupt checkpoint: each Ray Train fit costs ~18 s, so this module does not repeat it.)
    again = trainforge.fit(warm_run(tmp_path, train={"max_steps": 10}, checkpoint={"every_n_steps": 5}))
    assert again.summary["global_step"] == 10
    assert any(
        e.startswith("resumed from") and e.endswith("checkpoint_000000010 at step 10") for e in events(again.run_dir)
    )
    assert names(again.run_dir) == ["checkpoint_000000005", "checkpoint_000000010"]

    with pytest.raises(CheckpointError, match="already holds 2 checkpoint"):
        trainforge.fit(warm_run(tmp_path, checkpoint={"resume": "none"}))

    source = first.run_dir / "checkpoint_000000005"
    branched = trainforge.fit(
        warm_run(tmp_path, run={"name": "branch"}, train={"max_steps": 8}, checkpoint={"resume": str(source)})
    )
    assert branched.summary["global_step"] == 8
    assert any("checkpoint_000000005 at step 5" in e for e in events(branched.run_dir))

    # Checked on the driver, before Ray starts (launch.check_resume_path).
    with pytest.raises(CheckpointError, match=r"nowhere is not a checkpoint: no such directory"):
        trainforge.fit(warm_run(tmp_path, run={"name": "bad"}, checkpoint={"resume": str(tmp_path / "nowhere")}))


def test_minutes_and_epoch_end_triggers_and_best_kept(tmp_path: Path) -> None:
    result = trainforge.fit(
        warm_run(
            tmp_path,
            train={"epochs": 2, "max_steps": None, "batch_size": 256, "log_every_n_steps": 2},
            checkpoint={
                "every_n_minutes": 1e-6,  # due at every report
                "at_epoch_end": True,
                "keep_last": 1,
                "keep_best_metric": "train/loss",
                "keep_best_mode": "max",  # the worst loss, so that it differs from the newest
            },
        )
    )
    # digits: 1438 samples / 256 = 5 steps per epoch; reports every 2 steps -> saves at 2, 4, 5 (epoch end),
    # then 7, 9 and 10 (end). Rotation keeps the newest and the one with the highest reported loss.
    kept = names(result.run_dir)
    assert kept[-1] == "checkpoint_000000010"
    assert len(kept) == 2 and kept[0] == "checkpoint_000000002"
