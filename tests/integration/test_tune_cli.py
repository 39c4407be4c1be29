"""``trainforge tune`` on the command line: a bad space file or tune setting is one line, exit code 2,
before Ray starts. Checked through main(argv) in this process (test_cli.in_process, which fails a
command that starts Ray); one case runs as a real ``python -m trainforge`` process."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import tiny_run
from tests.integration.test_cli import assert_user_error, in_process, trainforge


def tune_command(tmp_path: Path, space: str, *extra: str) -> list[str]:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run(tmp_path)))
    space_file = tmp_path / "space.yaml"
    space_file.write_text(space)
    return ["tune", str(config), "--space", str(space_file), *extra]


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        ("optim.lrr: {loguniform: [1.0e-4, 0.1]}\n", "unknown config key optim.lrr — did you mean optim.lr?"),
        ("optim.lr: {logunifrom: [1.0e-4, 0.1]}\n", "unknown domain 'logunifrom' — did you mean loguniform?"),
        ("optim.lr: {uniform: [0.1]}\n", "optim.lr: uniform takes [lo, hi] with lo < hi, got [0.1]"),
        ("optim.lr: {uniform: [0.1, 0.01]}\n", "got [0.1, 0.01]"),
        ("optim.name: {grid: []}\n", "optim.name: grid needs at least one value, got an empty list"),
        ("optim.name: {choice: [sgd, lion]}\n", "value 'lion' is rejected: optim.name 'lion' is not a torch.optim"),
        ("optim.lr: [0.1, 0.2]\n", "expected one domain such as {uniform: [lo, hi]}"),
        ("- optim.lr\n", "expected a mapping of config keys to domains"),
    ],
)
def test_bad_space_files_are_one_line_and_exit_2(
    tmp_path: Path, space: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = in_process(*tune_command(tmp_path, space), capsys=capsys)
    assert_user_error(result, expected)
    assert expected in result.stderr  # rich printed the brackets instead of taking them for markup
    assert not (tmp_path / "t").exists()  # nothing ran


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--scheduler", "hyperband"],
            "tune.scheduler = 'hyperband': Input should be 'none', 'asha', 'pbt' or 'median'",
        ),
        (["--search", "grid"], "tune.search grid needs at least one {grid: [...]} domain in the space file"),
        (["--trials", "0"], "tune.num_trials = 0: Input should be greater than or equal to 1"),
        (["--set", "tune.scheduler_params.asha={grace: 3}", "--scheduler", "asha"], "did you mean grace_period?"),
    ],
)
def test_bad_search_settings_are_one_line_and_exit_2(
    tmp_path: Path, extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = in_process(*tune_command(tmp_path, "optim.lr: {loguniform: [1.0e-4, 0.1]}\n", *extra), capsys=capsys)
    assert_user_error(result, expected)


def test_a_missing_space_file_is_a_user_error(tmp_path: Path) -> None:
    """A real process: ``python -m trainforge tune`` exits 2 with the one line."""
    command = tune_command(tmp_path, "")
    command[3] = str(tmp_path / "missing.yaml")
    assert_user_error(trainforge(*command), "space file")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--measure", "speed"], "--measure 'speed': choose from overhead, asha, concurrency"),
        (["--measure", "asha", "--asha-trials", "0"], "--asha-trials 0: must be >= 1"),
        (["--output", "/nonexistent/dir/x.json"], "folder /nonexistent/dir does not exist"),
    ],
)
def test_bench_tune_refuses_bad_flags_before_it_starts(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_user_error(in_process("bench", "tune", *args, capsys=capsys), expected)
