"""The command line: bad input gets one line and exit code 2, never a traceback.

Validation is checked through main(argv) in this process (``in_process``): the same code path from
argv to the error line and exit code, without a fresh interpreter's imports per case. A few cases
run as real processes (``trainforge``, ``entry_point``) for what only a process shows: the exit code
of ``python -m trainforge`` and of the console script, and a Ray address that cannot be reached."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers.console import without_startup
from tests.helpers.runs import tiny_run
from tests.helpers.timing import rescaled, scaled

ROOT = Path(__file__).resolve().parents[2]


def trainforge(*args: str, cwd: Path = ROOT, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "trainforge", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def in_process(*args: str, capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """``trainforge ARGS`` as main(argv) in this process: its exit code, stdout and stderr (ANSI
    colour codes removed, as on a terminal that is not one). A command that starts Ray fails the call."""
    from trainforge.cli import main

    def ray_up() -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    ray_before = ray_up()  # the test module's own Ray (ray_local), if it has one
    capsys.readouterr()  # what the test printed before is not the command's
    try:
        main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    assert ray_before or not ray_up(), "the command started Ray"
    return subprocess.CompletedProcess(list(args), code, out, re.sub(r"\x1b\[[0-9;]*m", "", err))


def write_config(tmp_path: Path, **sections: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path, **sections)))  # type: ignore[arg-type]
    return path


def assert_user_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert expected in errors[0], errors[0]


def test_config_show_prints_the_resolved_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process("config", "show", str(write_config(tmp_path)), "--set", "train.batch_size=7", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["train"]["batch_size"] == 7


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "train.bacth_size=3"], "unknown key train.bacth_size — did you mean train.batch_size?"),
        (["--set", "train.batch_size=many"], "train.batch_size = 'many': Input should be a valid integer"),
        (["--set", "optim.lr=-1"], "optim.lr = -1: Input should be greater than 0"),
        (["--set", "nonsense"], "expected key=value"),
        (["--set", "data.name=cifar10", "--set", "data.path=/nonexistent/cifar"], "/nonexistent/cifar"),
        (["--set", "model.name=resnet19"], "resnet18"),
        (["--set", "model.name=null", "--set", "model.factory=no_such_pkg.models:net"], "no_such_pkg.models"),
        (["--set", "model.name=null", "--set", "model.factory=tests.helpers.user_models:nope"], "nope"),
        (["--set", "parallel.strategy=zero3"], "parallel.strategy = 'zero3': Input should be 'ddp' or 'fsdp'"),
        (["--set", "parallel.fsdp.cpu_offload=true"], "parallel.fsdp.cpu_offload needs parallel.strategy: fsdp"),
        (
            ["--set", "parallel.strategy=fsdp", "--set", "parallel.fsdp.cpu_offload=true"],
            "parallel.fsdp.cpu_offload needs scaling.use_gpu: true",
        ),
        (["--set", "train.batch_size=auto"], "train.global_batch_size is required with train.batch_size: auto"),
        (["--set", "parallel.tensor_parallel=2"], "parallel.tensor_parallel 2 must divide scaling.num_workers 1"),
        (
            ["--set", "scaling.num_workers=2", "--set", "parallel.tensor_parallel=2"],
            "parallel.tensor_parallel: Sequential has no tensor-parallel plan",
        ),
        (
            ["--set", "parallel.strategy=fsdp", "--set", "parallel.fsdp.wrap=[Linaer]"],
            "block class 'Linaer' (parallel.fsdp.wrap) matches no module of Sequential; did you mean 'Linear'?",
        ),
        (
            ["--set", "checkpoint.encryption.key_env=TF_UNSET_CHECKPOINT_KEY"],
            "checkpoint.encryption.key_env (TF_UNSET_CHECKPOINT_KEY): the environment variable is not set",
        ),
        (["--set", "checkpoint.encryption.key_env=no-dashes"], "checkpoint.encryption.key_env = 'no-dashes'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    tmp_path: Path, args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = in_process("train", str(write_config(tmp_path)), *args, capsys=capsys)
    assert_user_error(result, expected)
    assert not (tmp_path / "t" / "summary.json").exists()


def test_an_unreachable_ray_address_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    """A real ``python -m trainforge`` process: its exit code, and the one line once Ray is tried."""
    result = trainforge("train", str(write_config(tmp_path)), "--address", "127.0.0.1:9")
    assert_user_error(result, "cannot reach the Ray cluster at 127.0.0.1:9")
    assert not (tmp_path / "t" / "summary.json").exists()


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(in_process("train", str(tmp_path / "absent.yaml"), capsys=capsys), "does not exist")


def entry_point(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script (main() as users run it), or ``python -m trainforge`` without one."""
    script = Path(sys.executable).parent / "trainforge"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "trainforge"]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb", "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [*command, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=scaled(30), check=False
    )


def assert_usage_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Usage: trainforge") and lines[-1].startswith(expected), result.stderr
    assert len(lines) <= 4, result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["deploy"], "Error: No such command 'deploy'."),  # the console script, as a real process
        (["train", "quickstart", "--sett", "x=1"], "Error: No such option: --sett"),
        (["ckpt", "verify"], "Error: Missing argument 'path'."),
    ],
)
def test_usage_errors_print_click_usage_and_exit_2(
    tmp_path: Path, args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = entry_point(*args, cwd=tmp_path) if args == ["deploy"] else in_process(*args, capsys=capsys)
    assert_usage_error(result, expected)


def test_version_names_trainforge_torch_and_ray(tmp_path: Path) -> None:
    from importlib.metadata import version

    from trainforge import __version__

    result = entry_point("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = f"trainforge {__version__} (torch {version('torch')}, ray {version('ray')})"
    assert result.stdout.strip() == expected
    assert re.fullmatch(r"trainforge [\d.]+ \(torch \S+, ray \S+\)", expected)


HOSTILE = {
    "binary": (b"\xff\xfe\x00\x01", "is not UTF-8 text"),
    "deep": (b"[" * 100_000, "nested deeper than 64 levels"),
    "alias-bomb": (
        b"a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
        b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
        "once aliases are expanded",
    ),
    "duplicate": (b"model: {name: mlp}\ntrain: {max_steps: 1}\ntrain: {max_steps: 2}\n", "duplicate key 'train'"),
    "infinite-lr": (b"model: {name: mlp}\ntrain: {max_steps: 1}\noptim: {lr: .inf}\n", "optim.lr = inf"),
    "directory": (None, "is a directory"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_config_is_one_line_before_ray_starts(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``binary`` runs the console script as a real process; the others main(argv) in this process."""
    content, expected = HOSTILE[case]
    path = tmp_path / "configs"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    args = ("train", str(path), "--set", "run.output_dir=runs")
    start = time.monotonic()
    # An unreachable RAY_ADDRESS: had the command got as far as Ray, the error would say so instead.
    if case == "binary":
        result = entry_point(*args, cwd=tmp_path, env={"RAY_ADDRESS": "127.0.0.1:9"})
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
        result = in_process(*args, capsys=capsys)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()  # no run directory, no ray.log: Ray never started
    # Refused before Ray, not after a connection attempt's timeouts: 15 s on the quiet machine, stretched by the load.
    assert elapsed < rescaled(15), f"{elapsed:.1f} s (the loader's own time: tests/unit/test_config_hostile.py)"


@pytest.mark.slow
def test_train_command_runs_and_prints_the_summary_path(tmp_path: Path) -> None:
    result = trainforge("train", str(write_config(tmp_path)), "--set", "scaling.num_workers=2")
    assert result.returncode == 0, result.stderr
    summary_path = Path(result.stdout.strip().splitlines()[-1])
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "finished" and summary["num_workers"] == 2
    assert "Traceback" not in result.stderr
    assert "step 20/20" in result.stderr  # the last report's progress line, when not on a terminal
    assert (summary_path.parent / "ray.log").exists()
    # The start, phase by phase, from the process's start: the CLI's, the driver's, the
    # controller's (its callback) and rank 0's marks all arrived, and add up.
    startup = summary["startup"]
    phases = startup["phases"]
    for phase in ("cli", "imports", "ray", "controller", "workers", "process_group", "train_fn", "model", "first_step"):
        assert phase in phases, phases
    assert all(seconds >= 0 for seconds in phases.values())
    assert startup["to_first_step_s"] == pytest.approx(sum(phases.values()), abs=0.01)
    assert startup["start_unix"] <= summary_path.stat().st_mtime - startup["to_first_step_s"]
    assert "SIGTERM handler" not in result.stderr  # Ray's warning for an init off the main thread


def test_a_failed_check_stops_the_ray_that_started_early(tmp_path: Path) -> None:
    """``trainforge train`` starts a local Ray while it imports; a check that fails after that
    (a data path that does not exist) stops it: no Ray process of that session outlives the command."""
    ray_tmp = tmp_path / "ray"  # Ray's session folder, named on every one of its processes' command lines
    ray_tmp.mkdir()
    config = write_config(tmp_path, data={"name": "cifar10", "path": str(tmp_path / "absent")})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb", "RAY_TMPDIR": str(ray_tmp)}
    result = subprocess.run(
        [sys.executable, "-m", "trainforge", "train", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(240),
        check=False,
    )
    assert_user_error(result, str(tmp_path / "absent"))
    # Only the error: what Ray logged while it started early (its token-authentication notice)
    # is held back for a run that never came.
    assert len(without_startup(result.stderr)) == 1, result.stderr
    assert list(ray_tmp.iterdir()), "the command started no Ray: this test would prove nothing"
    left = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if str(ray_tmp) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == [], f"Ray processes left running: {left}"


@pytest.mark.slow
def test_factory_that_returns_no_module_fails_once_without_retries(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        model={"name": None, "factory": "tests.helpers.user_models:not_a_module"},
        failure={"max_failures": 3},
    )
    result = trainforge("train", str(config))
    assert_user_error(result, "not_a_module")
