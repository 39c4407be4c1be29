"""`trainforge train` refuses, in one line and before Ray starts, a run directory another run holds,
an output directory it cannot write and a --resume path that is not a checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.mounts import tmpfs
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from trainforge.driver.runlock import acquire

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "trainforge"


def train(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "trainforge"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    return subprocess.run(
        [*command, "train", str(config), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(180),
        check=False,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path / "elsewhere")))
    return path


def test_a_second_run_in_a_held_run_directory_exits_2_naming_the_holder(tmp_path: Path, config: Path) -> None:
    run_dir = tmp_path / "runs" / "shared"
    checkpoint = run_dir / "checkpoint_000000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text('{"files": {}}')
    (run_dir / "summary.json").write_text('{"status": "finished", "global_step": 10}')
    (run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    with acquire(run_dir, what="run directory", advice="wait"):
        before = snapshot(run_dir)
        result = train(config, "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "run.name=shared")
        after = snapshot(run_dir)
    line = one_error_line(result)
    assert f"run directory {run_dir} is in use by another trainforge run" in line
    assert f"PID {os.getpid()} on host {socket.gethostname()}" in line
    assert "run.name" in line
    assert after == before  # the holder's checkpoints, summary and metrics are untouched
    assert not (run_dir / "ray.log").exists() and not (run_dir / "config.yaml").exists()  # Ray never started


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "ro", "ro") as target:
        yield target


def test_an_output_dir_on_a_read_only_file_system_exits_2(read_only_dir: Path, config: Path) -> None:
    line = one_error_line(train(config, "--set", f"run.output_dir={read_only_dir}"))
    assert f"run.output_dir {read_only_dir} is not writable: Read-only file system" in line


def test_an_output_dir_that_is_a_file_exits_2(tmp_path: Path, config: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    line = one_error_line(train(config, "--set", f"run.output_dir={a_file}"))
    assert f"run.output_dir {a_file} is not writable: Not a directory" in line


@pytest.mark.parametrize(
    ("relative", "partial", "expected"),
    [
        ("nonexistent/checkpoint_1", False, "no such directory"),
        ("half/checkpoint_000000005", True, "manifest.json is missing"),
    ],
    ids=["missing", "no-manifest"],
)
def test_a_resume_path_that_is_not_a_checkpoint_exits_2_before_ray_starts(
    tmp_path: Path, config: Path, relative: str, partial: bool, expected: str
) -> None:
    resume = tmp_path / relative
    if partial:  # a save that never wrote its manifest
        resume.mkdir(parents=True)
        (resume / "model.safetensors").write_bytes(b"partial")
    line = one_error_line(train(config, "--resume", str(resume)))
    assert f"checkpoint.resume (--resume) {resume} is not a checkpoint: {expected}" in line
    assert not (tmp_path / "elsewhere" / "t" / "ray.log").exists()
