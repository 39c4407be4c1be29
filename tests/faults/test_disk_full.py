"""Checkpoint storage on a local disk that fills up mid-run (a real 2 MiB tmpfs, real ENOSPC).

With the default ``checkpoint.on_save_error: continue`` every later save fails, training goes on
to the end with the failures counted and reported, and the checkpoint written before the disk
filled stays valid and is the one the summary names.

Both runs are of one shape and share a warm worker group (``scaling.reuse_workers``; the first starts
it): the saves are the checkpoint writer's, the same code under Ray Train's own group.
"""

from __future__ import annotations

import errno
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainforge
from tests.helpers.faults import Fault, checkpoints, events, paced_run, reports
from tests.helpers.mounts import tmpfs
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.errors import TrainingFailed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]
WARM = {"reuse_workers": True}


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 2 MiB tmpfs; skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    mount_point = Path(tempfile.mkdtemp(prefix="tf-small-disk-"))
    try:
        with tmpfs(mount_point, "size=2m"):
            yield mount_point
    finally:
        mount_point.rmdir()


def fill(disk: Path) -> dict[str, object]:
    """Write zeros until the file system says ENOSPC."""
    chunk = b"\0" * (64 << 10)
    with (disk / "filler").open("wb") as handle:
        try:
            while True:
                handle.write(chunk)
                handle.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return {"full_after": [p.name for p in checkpoints(disk / "t")]}


def test_disk_full_fails_saves_but_training_goes_on(small_disk: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "t"
    config = paced_run(tmp_path, checkpoint={"storage_path": str(small_disk)}, scaling=WARM)
    with Fault(lambda: checkpoints(small_disk / "t"), lambda: fill(small_disk)) as fault:
        result = trainforge.fit(config)
        filled = fault.join()

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 60
    failures = summary["final_metrics"]["checkpoint/save_failures"]
    assert failures >= 1
    failed = [e for e in events(run_dir) if "failed" in e]
    assert failed and all("No space left on device" in e for e in failed), failed

    # What was committed before the disk filled is intact, and it is what the summary names.
    # No failed save left a checkpoint or a temp directory behind.
    before = filled["full_after"]
    assert before
    on_disk = sorted(p.name for p in (small_disk / "t").iterdir() if p.name.startswith(("checkpoint_", ".tmp-")))
    assert on_disk == before, on_disk
    for name in before:
        assert CheckpointStore.from_uri(str(small_disk / "t")).verify(name).ok
    assert summary["checkpoint"] == str(small_disk / "t" / before[-1])

    exported = load_file(str(result.model_path))
    last_valid = load_file(str(small_disk / "t" / before[-1] / "model.safetensors"))
    same = all(torch.equal(exported[k], last_valid[k]) for k in exported)
    print(
        f"\ndisk full after {before}: {failures} failed saves ({failed[0]}); "
        f"model.safetensors is the weights of {before[-1] if same else 'step 60'}, summary global_step 60"
    )


def test_disk_full_at_the_final_save_with_on_save_error_fail_fails_the_run(small_disk: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "t"
    config = paced_run(
        tmp_path,
        train={"max_steps": 30},
        checkpoint={"storage_path": str(small_disk), "every_n_steps": None, "on_save_error": "fail"},
        scaling=WARM,
    )
    # No periodic checkpoints: the only save is the final one, and the disk is full by then.
    with Fault(lambda: reports(run_dir), lambda: fill(small_disk)), pytest.raises(TrainingFailed):
        trainforge.fit(config)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
