"""trainforge.driver.jobs without a cluster: address and token resolution, the shipped config, exit codes.
Against a real Ray head: tests/integration/test_submit.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.runs import tiny_run
from trainforge.config import load_config
from trainforge.driver.dashboard import Token, dashboard_address, find_token
from trainforge.driver.jobs import EXCLUDES, excludes, exit_code, job_config
from trainforge.errors import ConfigError

CLEAN = ("RAY_ADDRESS", "RAY_JOBS_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture(autouse=True)
def no_ray_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_the_address_comes_from_the_flag_then_ray_jobs_address_then_an_http_ray_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://from-ray-address:8265")
    assert dashboard_address(None) == "http://from-ray-address:8265"
    monkeypatch.setenv("RAY_JOBS_ADDRESS", "https://from-jobs-address:443/")
    assert dashboard_address(None) == "https://from-jobs-address:443"
    assert dashboard_address("http://flag:8265") == "http://flag:8265"
    monkeypatch.delenv("RAY_JOBS_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # a GCS address is not the dashboard's: not used
    with pytest.raises(ConfigError, match="no cluster: give --address"):
        dashboard_address(None)


@pytest.mark.parametrize("address", ["head:6379", "ray://head:10001", "http://", "ftp://head:8265"])
def test_an_address_that_is_not_a_dashboard_url_is_refused(address: str) -> None:
    with pytest.raises(ConfigError, match="the Ray dashboard's URL"):
        dashboard_address(address)


def test_the_token_comes_from_the_flag_then_rays_own_sources_in_rays_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert find_token(None) is None
    default = tmp_path / "home" / ".ray" / "auth_token"
    default.parent.mkdir(parents=True)
    default.write_text("from-default\n")
    assert find_token(None) == Token("from-default", "~/.ray/auth_token")
    (tmp_path / "path").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "path"))
    assert find_token(None) == Token("from-path", f"RAY_AUTH_TOKEN_PATH {tmp_path / 'path'}")
    monkeypatch.setenv("RAY_AUTH_TOKEN", " from-env ")
    assert find_token(None) == Token("from-env", "RAY_AUTH_TOKEN")
    (tmp_path / "flag").write_text("from-flag")
    assert find_token(tmp_path / "flag") == Token("from-flag", f"--token-file {tmp_path / 'flag'}")


@pytest.mark.parametrize(("content", "problem"), [(None, "no such file"), ("", "not a Ray token"), ("a b", "not a")])
def test_a_token_file_that_holds_no_token_is_one_line(tmp_path: Path, content: str | None, problem: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"--token-file {path}: {problem}"):
        find_token(path)


def test_the_job_runs_the_resolved_config_with_absolute_result_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(
        tiny_run(Path("runs"), run={"name": "r"}, cluster={"address": "elsewhere:6379"}),
        ["checkpoint.storage_path=ckpts", "optim.lr=0.5"],
    )
    shipped = job_config(config)
    assert shipped["run"]["output_dir"] == str(tmp_path / "runs")
    assert shipped["checkpoint"]["storage_path"] == str(tmp_path / "ckpts")
    assert shipped["cluster"]["address"] is None  # the job's driver joins its own cluster
    assert shipped["optim"]["lr"] == 0.5
    assert excludes(config, tmp_path) == [*EXCLUDES, "/runs", "/ckpts"]
    s3 = load_config(tiny_run(Path("/shared/runs"), run={"name": "r"}), ["checkpoint.storage_path=s3://b/p"])
    assert job_config(s3)["checkpoint"]["storage_path"] == "s3://b/p"
    assert excludes(s3, tmp_path) == EXCLUDES
    here = load_config(tiny_run(Path("."), run={"name": "r"}))
    assert excludes(here, tmp_path) == [*EXCLUDES, "/r"]  # the run's own folder, not the whole directory


@pytest.mark.parametrize(
    ("status", "driver_exit_code", "expected"),
    [("SUCCEEDED", 0, 0), ("STOPPED", None, 130), ("FAILED", 2, 2), ("FAILED", 1, 1), ("FAILED", None, 1)],
)
def test_the_exit_code_follows_the_jobs_status(status: str, driver_exit_code: int | None, expected: int) -> None:
    details = SimpleNamespace(status=status, driver_exit_code=driver_exit_code)
    assert exit_code(details) == expected
