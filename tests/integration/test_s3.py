"""Checkpoints on S3: a real S3-compatible server (moto) on loopback, real HTTP, real Ray workers.

The server runs in the test process, so a test can take it down mid-run (storage unreachable)
and bring it back with its data. Credentials and the endpoint are set in the environment
before Ray starts, so the controller and every worker see the same "AWS".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from safetensors.torch import load_file

import trainforge
from tests.helpers.faults import Fault, events, free_port, paced_run, reports, signal_a_worker, wait_until
from tests.helpers.s3 import BUCKET, S3Server, serving
from tests.helpers.timing import scaled
from trainforge.checkpoint.storage import CheckpointStore

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with serving(free_port()) as (server, env):
        if ray.is_initialized():
            ray.shutdown()
        ray.init(
            address="local",  # a new instance even if another cluster on this machine advertises itself
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}},
        )
        try:
            yield server
        finally:
            ray.shutdown()


@pytest.fixture
def s3_up(s3: S3Server) -> Iterator[S3Server]:
    """The server is up when a test starts, and again when it ends, whatever the test did."""
    if not s3.running:
        s3.start()
    yield s3
    if not s3.running:
        s3.start()


def s3_config(tmp_path: Path, prefix: str, **sections: Any) -> dict[str, Any]:
    checkpoint = {"storage_path": f"s3://{BUCKET}/{prefix}", **sections.pop("checkpoint", {})}
    return paced_run(tmp_path, checkpoint=checkpoint, **sections)


def run_store(prefix: str) -> CheckpointStore:
    return CheckpointStore.from_uri(f"s3://{BUCKET}/{prefix}/t")


def test_checkpoints_land_in_the_bucket_and_a_killed_worker_resumes_from_there(s3_up: S3Server, tmp_path: Path) -> None:
    run_dir = tmp_path / "t"
    with Fault(lambda: s3_up.committed("kill/t/"), lambda: signal_a_worker(signal.SIGKILL)) as fault:
        result = trainforge.fit(s3_config(tmp_path, "kill"))
        killed = fault.join()

    summary = result.summary
    assert killed["pid"]
    assert summary["status"] == "finished" and summary["global_step"] == 60
    assert summary["restarts"] == 1 and summary["recovery_s"]
    resumed = [e for e in events(run_dir) if e.startswith("resumed from")]
    assert resumed and resumed[0].startswith(f"resumed from s3://{BUCKET}/kill/t/checkpoint_"), resumed
    assert summary["checkpoint"] == f"s3://{BUCKET}/kill/t/checkpoint_000000060"

    # In the bucket: the newest keep_last (5) checkpoints, each with a manifest that lists every
    # object beside it with its size, and each verifying (SHA-256 of every object read back).
    objects = s3_up.keys("kill/t/")
    names = s3_up.committed("kill/t/")
    assert names == [f"checkpoint_{step:09d}" for step in (20, 30, 40, 50, 60)]
    store = run_store("kill")
    for name in names:
        body = s3_up.client().get_object(Bucket=BUCKET, Key=f"kill/t/{name}/manifest.json")["Body"]
        manifest = json.loads(body.read())
        stored = {k.split(f"{name}/", 1)[1]: size for k, size in objects.items() if f"/{name}/" in k}
        listed = {rel: entry["size"] for rel, entry in manifest["files"].items()}
        assert listed == {rel: size for rel, size in stored.items() if rel != "manifest.json"}
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= listed.keys()
        assert store.verify(name).ok
    assert not list(run_dir.glob("checkpoint_*")), "checkpoints belong in the bucket, not the run dir"

    # The final weights are exported from the bucket to the local run directory.
    assert "inner.4.weight" in load_file(str(result.model_path))

    listing = subprocess.run(
        [sys.executable, "-m", "trainforge", "ckpt", "list", f"s3://{BUCKET}/kill/t"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    if "No such command" not in listing.stderr:  # `ckpt` is being written in parallel
        assert listing.returncode == 0, listing.stderr
        assert all(name in listing.stdout for name in names), listing.stdout
    print(f"\nS3: {resumed[0]}; recovery_s {summary['recovery_s']}")


def stop_then_restart_after_a_failed_save(server: S3Server, run_dir: Path) -> dict[str, Any]:
    """Take the storage down; bring it back once the run has reported a failed save."""
    stopped_after = server.committed("outage/t/")[-1]
    server.stop()
    at = time.time()
    wait_until(lambda: any("failed" in e for e in events(run_dir)), 120, "a failed save to be reported")
    server.start()
    return {"at": at, "stopped_after": stopped_after, "down_s": time.time() - at}


def test_storage_outage_fails_saves_but_training_goes_on(s3_up: S3Server, tmp_path: Path) -> None:
    run_dir = tmp_path / "t"
    config = s3_config(tmp_path, "outage")
    with Fault(
        lambda: s3_up.committed("outage/t/"), lambda: stop_then_restart_after_a_failed_save(s3_up, run_dir)
    ) as fault:
        result = trainforge.fit(config)
        outage = fault.join()

    summary = result.summary
    assert summary["status"] == "finished" and summary["global_step"] == 60
    assert summary["final_metrics"]["checkpoint/save_failures"] >= 1
    failed = [e for e in events(run_dir) if "failed" in e]
    assert failed and failed[0].startswith("checkpoint save at step "), failed
    assert summary["checkpoint"] == f"s3://{BUCKET}/outage/t/checkpoint_000000060"
    store = run_store("outage")
    # The checkpoint written before the outage is intact, and the failed save left no checkpoint.
    assert store.verify(outage["stopped_after"]).ok
    failed_step = int(failed[0].split("step ")[1].split()[0])
    failed_name = f"checkpoint_{failed_step:09d}"
    assert failed_name not in s3_up.committed("outage/t/")
    assert not store.verify(failed_name).ok
    print(f"\nS3 outage of {outage['down_s']:.1f} s after {outage['stopped_after']}: {failed}")


def cli_train(config: dict[str, Any], tmp_path: Path) -> subprocess.Popen[str]:
    """`trainforge train` in a subprocess, on this module's Ray (its workers already see the endpoint)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    command = [sys.executable, "-m", "trainforge", "train", str(path), "--address", address]
    # Its output to a file (train.log): a pipe nobody reads while the run goes on fills up and blocks it.
    with (tmp_path / "train.log").open("w") as sink:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=sink, text=True)


def test_storage_outage_with_on_save_error_fail_stops_the_run_cleanly(s3_up: S3Server, tmp_path: Path) -> None:
    run_dir = tmp_path / "t"
    # A failed save is reported at the first report after its background write gives up (the S3
    # client retries first): the long tail after step 40 leaves it time to be seen mid-run.
    config = s3_config(
        tmp_path,
        "fail",
        model={"kwargs": {"delay_s": 0.1}},
        train={"max_steps": 200},
        checkpoint={"every_n_steps": 40, "on_save_error": "fail"},
    )
    process = cli_train(config, tmp_path)
    try:
        # Training has started (the first report): storage goes away before the first save at step 40.
        wait_until(lambda: any("step" in r for r in reports(run_dir)) or process.poll() is not None, 240, "step 5")
        s3_up.stop()
        process.wait(timeout=scaled(240))
        stderr = (tmp_path / "train.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
        s3_up.start()

    assert process.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "on_save_error is fail" in errors[0], stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert 40 <= summary["global_step"] < 200
    assert "checkpoint save at step 40 failed" in summary["error"]
    assert (run_dir / "error.log").is_file()


def test_parquet_digits_stream_from_the_bucket_and_reach_95_percent(s3_up: S3Server, tmp_path: Path) -> None:
    """data.path s3://...: listed, counted and read by Ray Data's tasks through pyarrow's S3 file system."""
    from tests.helpers.tables import write_parquet
    from tests.integration.test_stream import parquet_run

    folder = write_parquet(tmp_path / "digits", shuffle_seed=1)
    client = s3_up.client()
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), BUCKET, f"datasets/digits/{path.name}")
    summary = trainforge.fit(parquet_run(tmp_path, f"s3://{BUCKET}/datasets/digits")).summary

    assert summary["status"] == "finished"
    assert summary["final_metrics"]["val/accuracy"] >= 0.95, summary["final_metrics"]
