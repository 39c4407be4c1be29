"""Checkpoints of real runs: the ``trainforge ckpt`` tools name every corruption, restore walks back
past a corrupt newest checkpoint, and rotation holds across restarts.

One tiny run is trained once per module; tests that change a run work on a copy of it. The ``ckpt``
tools run through main(argv) in this process (test_cli.in_process); one verify of a corrupt and one
of a missing checkpoint, and the checkpoint bench, run as real ``python -m trainforge`` processes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import trainforge
from tests.helpers.faults import events_of
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from tests.integration.test_cli import in_process
from tests.unit.test_checkpoint import CORRUPTIONS, flip_byte
from trainforge.checkpoint.inspect import list_checkpoints
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
EVERY = 5


def run_config(output_dir: Path, max_steps: int, **checkpoint: Any) -> dict[str, Any]:
    """The module's runs share a warm worker group (the first starts it): what they test is the
    checkpoints' and the restore's, the same code on Ray Train's own group."""
    return tiny_run(
        output_dir,
        train={"max_steps": max_steps},
        checkpoint={"every_n_steps": EVERY, "keep_last": 10, **checkpoint},
        scaling={"reuse_workers": True},
    )


def fit(config: dict[str, Any]) -> trainforge.RunResult:
    # resume: the tests continue a trained run directory with more steps (a changed config)
    result = trainforge.fit(config, console=Console(file=io.StringIO()), resume="auto")
    assert result.status == "finished"
    return result


def without_columns(env: Any) -> dict[str, str]:
    """pytest-xdist's workers set COLUMNS=80, which the CLI respects as a user's width; its tables
    are read here as a pipe gets them, at their natural width (trainforge/consoles.py)."""
    return {name: value for name, value in env.items() if name != "COLUMNS"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainforge", *args],
        cwd=ROOT,
        env={**without_columns(os.environ), "PYTHONPATH": str(ROOT), "TERM": "dumb"},
        capture_output=True,
        text=True,
        timeout=scaled(300),
        check=False,
    )


def ckpt(*args: str, capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    return in_process("ckpt", *args, capsys=capsys)


def events(run_dir: Path) -> list[str]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [event.text for row in rows for event in events_of(row)]


def saved_steps(run_dir: Path) -> list[int]:
    return [e.step for e in CheckpointStore.from_uri(str(run_dir)).entries()]


def best_saved_step(run_dir: Path, steps: list[int], metric: str) -> int:
    """The saved step whose report (the metrics the checkpoint carries) has the largest ``metric``."""
    at_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step") in steps and metric in row:
            at_step[row["step"]] = row[metric]
    assert set(at_step) == set(steps)
    return max(steps, key=lambda s: at_step[s])


ROTATION = {"keep_last": 2, "keep_best_metric": "train/loss", "keep_best_mode": "max"}


@pytest.fixture(scope="module")
def trained(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 20-step run with a checkpoint every 5 steps, rotated to the newest 2
    plus the one with the highest train/loss (the worst, so that it differs from the newest)."""
    result = fit(run_config(tmp_path_factory.mktemp("trained"), 20, **ROTATION))
    best = best_saved_step(result.run_dir, [5, 10, 15, 20], "train/loss")
    assert saved_steps(result.run_dir) == sorted({best, 15, 20})
    return result.run_dir


@pytest.mark.slow
def test_ckpt_verify_and_list_name_every_corruption(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = tmp_path / "cases"
    source = trained / checkpoint_name(15)
    for index, (corrupt, _) in enumerate(CORRUPTIONS.values(), start=1):
        shutil.copytree(source, cases / checkpoint_name(index))
        corrupt(cases / checkpoint_name(index))
    shutil.copytree(source, cases / checkpoint_name(99))

    listing = ckpt("list", str(cases), capsys=capsys)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[1]: line for line in listing.stdout.splitlines() if line.startswith("│ checkpoint_")}
    for index, (_, reason) in enumerate(CORRUPTIONS.values(), start=1):
        assert reason in rows[checkpoint_name(index)] and "valid" not in rows[checkpoint_name(index)].split("│")[-2]
    assert rows[checkpoint_name(99)].split("│")[-2].strip() == "valid"
    assert "1 valid of 6 checkpoint(s)" in listing.stdout

    for index, (kind, (_, reason)) in enumerate(CORRUPTIONS.items(), start=1):
        # The first as a real process: exit code 1 from the command itself.
        args = ("verify", str(cases / checkpoint_name(index)))
        result = cli("ckpt", *args) if index == 1 else ckpt(*args, capsys=capsys)
        assert result.returncode == 1, (kind, result.stdout, result.stderr)
        lines = result.stdout.splitlines()
        assert lines[0] == f"invalid: {cases / checkpoint_name(index)}"
        assert any(reason in line for line in lines[1:]), (kind, lines)

    valid = ckpt("verify", str(trained / checkpoint_name(20)), capsys=capsys)
    assert valid.returncode == 0 and valid.stdout.startswith("valid: "), valid.stdout

    missing = cli("ckpt", "verify", str(tmp_path / "absent"))  # a real process: exit code 2
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == f"error: {tmp_path / 'absent'} does not exist"

    inspected = ckpt("inspect", "--json", str(trained / checkpoint_name(20)), capsys=capsys)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["step"] == 20 and report["world_size"] == 1
    assert report["components"]["progress"]["values"] == {"global_step": 20, "samples_seen": 20 * 16}
    assert report["manifest"]["global_step"] == 20 and report["problems"] == []
    assert report["config"]["model"]["name"] == "mlp" and report["config"]["train"]["max_steps"] == 20
    weights = report["components"]["model"]["weights"]
    assert weights["tensors"] > 0 and weights["parameters"] > 0 and set(weights["dtypes"]) == {"F32"}
    assert report["components"]["optimizer"]["size_bytes"] > 0
    assert set(report["versions"]) >= {"torch", "ray", "trainforge"}


@pytest.mark.slow
def test_resume_walks_back_past_a_corrupt_newest_checkpoint_and_rotation_holds_across_restarts(
    trained: Path, tmp_path: Path
) -> None:
    """One fit for both (each Ray Train fit costs ~18 s): a copy of the fixture's run (keep_last 2
    plus the worst train/loss) with its newest checkpoint corrupt and a half-written save, re-run
    with more steps and the same rotation."""
    run_dir = tmp_path / trained.name
    shutil.copytree(trained, run_dir)
    flip_byte(run_dir / checkpoint_name(20))
    half_written = run_dir / ".tmp-checkpoint_000000025-0badf00d"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"\x00" * 1000)
    # A save that crashed in an earlier run: changed long before this run starts (the writer leaves
    # alone a staging dir changed within seconds of its start, which may be a save in flight).
    an_hour_ago = time.time() - 3600
    os.utime(half_written, (an_hour_ago, an_hour_ago))

    result = fit(run_config(tmp_path, 30, **ROTATION))

    assert result.run_dir == run_dir and result.summary["global_step"] == 30
    seen = events(run_dir)
    skipped = [e for e in seen if e.startswith("skipped checkpoint ")]
    assert skipped == ["skipped checkpoint checkpoint_000000020: model.safetensors fails its BLAKE3 check (corrupted)"]
    resumed = [e for e in seen if e.startswith("resumed from ")]
    assert resumed == [f"resumed from {run_dir / checkpoint_name(15)} at step 15"]
    # The half-written save was not restored, and the first save of the new run removed it (it
    # predates the run); the corrupt one was set aside when step 20 was saved again.
    assert not half_written.exists()
    rows = {row.name: row for row in list_checkpoints(str(run_dir))}
    assert not [row for row in rows.values() if row.kind == "incomplete"]
    [retired] = [row for row in rows.values() if row.kind == "retired"]
    assert retired.name.startswith(".invalid-checkpoint_000000020-")
    # Rotation counted the first run's checkpoints with the new run's: the newest 2 and the one with
    # the highest train/loss of all saved steps are kept, and every one kept verifies.
    best = best_saved_step(run_dir, [5, 10, 15, 20, 25, 30], "train/loss")
    assert saved_steps(run_dir) == sorted({best, 25, 30})
    assert [name for name, row in rows.items() if row.valid] == [checkpoint_name(s) for s in sorted({best, 25, 30})]


@pytest.mark.slow
def test_a_run_whose_checkpoints_do_not_load_into_its_model_stops_once_in_one_line(
    trained: Path, tmp_path: Path
) -> None:
    """Every checkpoint verifies but holds another model shape: exit 2 at the first restore, not a
    Ray restart loop of failure.max_failures attempts."""
    run_dir = tmp_path / trained.name
    shutil.copytree(trained, run_dir)
    config = run_config(tmp_path, 30)
    config["model"] = {"name": "mlp", "kwargs": {"hidden_sizes": [8]}}
    config["failure"] = {"max_failures": 3}
    config["scaling"] = {"num_workers": 1}  # Ray Train's own group, whose failures Ray would restart
    with pytest.raises(CheckpointError) as caught:
        trainforge.fit(config, console=Console(file=io.StringIO()), resume="auto")
    message = str(caught.value)
    assert message.startswith(f"no checkpoint of this run loads into the model as configured ({checkpoint_name(20)}")
    assert "size mismatch" in message and "\n" not in message
    summary = run_dir / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["restarts"] == 0


@pytest.mark.parametrize("flags", [[], ["--encrypt"]], ids=["plaintext", "encrypted"])
def test_bench_checkpoint_measures_through_the_real_code_paths(tmp_path: Path, flags: list[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "checkpoint", "--size-mb", "4", "--repeats=1", "--dir", str(tmp_path), "--output", str(out)]
    result = cli(*argv, *flags)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["workload"]["encrypted"] == bool(flags)
    assert "checkpoint I/O goals" in result.stdout and "where the time goes" in result.stdout
    report = json.loads(out.read_text())
    assert set(report["verdicts"]) == {"save_s", "load_s", "stall_fraction", "durable_write_fraction"}
    assert set(report["verdicts"].values()) <= {"pass", "miss"}
    [figures] = report["repeats"]
    assert figures["files"].keys() == {"model.safetensors", "optimizer.pt", "trainer_state.json"}
    # Adam's two moments: the checkpoint is about three times the weights.
    assert 2.8 < report["workload"]["checkpoint_MB"] / report["workload"]["model_MB"] < 3.3
    assert figures["save_s"] > 0 and figures["load_s"] > 0 and figures["raw_write_MBps"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # its files are gone

    bad = cli("bench", "checkpoint", "--size-mb", "0")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --size-mb 0.0: must be > 0"


@pytest.mark.slow
def test_ckpt_tools_read_checkpoints_on_s3(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same tools on an S3-compatible server (moto on loopback), through pyarrow's S3 file system."""
    moto_server = pytest.importorskip("moto.server")
    import socket

    import pyarrow.fs as pafs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        fs = pafs.S3FileSystem(
            endpoint_override=env["AWS_ENDPOINT_URL"], scheme="http", region="us-east-1", allow_bucket_creation=True
        )
        fs.create_dir("ckpt-bucket")
        for step in (15, 20):
            target = f"ckpt-bucket/runs/t/{checkpoint_name(step)}"
            pafs.copy_files(str(trained / checkpoint_name(step)), target, None, fs)
        with fs.open_output_stream(f"ckpt-bucket/runs/t/{checkpoint_name(20)}/optimizer.pt") as stream:
            stream.write(b"cut short")

        listing = ckpt("list", "s3://ckpt-bucket/runs/t", capsys=capsys)
        assert listing.returncode == 0, listing.stderr
        rows = {line.split()[1]: line for line in listing.stdout.splitlines() if line.startswith("│ checkpoint_")}
        assert rows[checkpoint_name(15)].split("│")[-2].strip() == "valid"
        assert "optimizer.pt has 9 bytes" in rows[checkpoint_name(20)]
        bad = ckpt("verify", f"s3://ckpt-bucket/runs/t/{checkpoint_name(20)}", capsys=capsys)
        assert bad.returncode == 1 and "optimizer.pt has 9 bytes" in bad.stdout
        inspected = ckpt("inspect", "--json", f"s3://ckpt-bucket/runs/t/{checkpoint_name(15)}", capsys=capsys)
        assert inspected.returncode == 0, inspected.stderr
        assert json.loads(inspected.stdout)["step"] == 15
        missing = ckpt("list", "s3://ckpt-bucket/runs/absent", capsys=capsys)
        assert missing.returncode == 2
        assert missing.stderr.strip() == "error: s3://ckpt-bucket/runs/absent does not exist"
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
