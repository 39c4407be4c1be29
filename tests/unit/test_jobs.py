"""trainforge.driver.jobs without a cluster: address and token resolution, the shipped config, exit codes.
Against a real Ray head: tests/integration/test_submit.py."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.cli import main
from trainforge.config import Config, load_config
from trainforge.driver.dashboard import Token, dashboard_address, find_token
from trainforge.driver.job_package import package_contents
from trainforge.driver.job_secrets import SECRETS_ENV, submitted_source, with_secrets
from trainforge.driver.jobs import (
    EXCLUDES,
    excludes,
    exit_code,
    job_config,
    job_fields,
    submission_contents,
    submit_run,
)
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


SECRET = "SubmitSecret0x51C"
STORAGE = f"s3://KEY:{SECRET}@bucket/ck?endpoint_override=127.0.0.1:9000&scheme=http"


def secret_config() -> Config:
    kwargs = {"hidden": 8, "hf_token": SECRET, "secretKey": SECRET, "keys": {"api_keys": [SECRET, SECRET]}}
    raw = tiny_run(Path("/shared/runs"), run={"name": "r"}, model={"name": None, "factory": "m:b", "kwargs": kwargs})
    return load_config(
        raw, [f"checkpoint.storage_path={STORAGE}", f"tracking.uri=https://alice:{SECRET}@mlflow.example"]
    )


class RecordingJobs:
    """The Jobs API's client as submit_run uses it: what it was sent, the config file as uploaded."""

    address = "http://127.0.0.1:8265"

    def submit(self, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> str:
        self.package = Path(runtime_env["working_dir"])  # the zip job_package wrote, removed after the upload
        self.sent = {"entrypoint": entrypoint, "runtime_env": runtime_env, "metadata": metadata}
        with zipfile.ZipFile(self.package) as archive:
            self.uploaded_text = archive.read(entrypoint.split()[-1]).decode()
        return "raysubmit_test"


def test_submit_passes_resume_to_the_jobs_trainforge_train(tmp_path: Path) -> None:
    """``submit --resume auto``: the job's ``trainforge train`` continues a changed config too."""
    jobs = RecordingJobs()
    submit_run(secret_config(), jobs, package_contents(tmp_path, config={}, ignore=[]), resume="auto")  # type: ignore[arg-type]
    words = jobs.sent["entrypoint"].split()
    assert words[:4] == ["trainforge", "train", "--resume", "auto"] and words[-1].startswith("trainforge-submit-r-")
    submit_run(secret_config(), jobs, package_contents(tmp_path, config={}, ignore=[]))  # type: ignore[arg-type]
    assert "--resume" not in jobs.sent["entrypoint"]


def test_submit_uploads_no_secret_and_the_job_gets_them_through_its_environment(tmp_path: Path) -> None:
    config, jobs = secret_config(), RecordingJobs()
    submission = submit_run(config, jobs, submission_contents(config, tmp_path))  # type: ignore[arg-type]
    env = jobs.sent["runtime_env"]["env_vars"]
    # The uploaded file, the entrypoint, the job's metadata and what submit prints hold no secret ...
    shown = [jobs.uploaded_text, jobs.sent["entrypoint"], json.dumps(jobs.sent["metadata"]), repr(submission)]
    shown.append(json.dumps({k: v for k, v in jobs.sent["runtime_env"].items() if k != "env_vars"}))
    assert not [text for text in shown if SECRET in text], shown
    assert not jobs.package.exists() and not list(tmp_path.iterdir())  # nothing written into the working directory
    uploaded = yaml.safe_load(jobs.uploaded_text)
    assert uploaded["model"]["kwargs"] == {
        "hidden": 8,
        "hf_token": "***",
        "secretKey": "***",
        "keys": {"api_keys": ["***", "***"]},
    }
    assert uploaded["checkpoint"]["storage_path"] == STORAGE.replace(SECRET, "***")
    # ... the job's environment does, and its trainforge train puts them back: the config it runs is this one.
    assert SECRET in env[SECRETS_ENV]
    assert with_secrets(uploaded, env[SECRETS_ENV]) == job_config(config)
    assert load_config(with_secrets(uploaded, env[SECRETS_ENV])).to_dict() == load_config(job_config(config)).to_dict()
    # The ckpt list hint: the run's folder joined before the URI's query, not after it.
    assert submission.checkpoints == "s3://KEY:***@bucket/ck/r?endpoint_override=127.0.0.1:9000&scheme=http"
    assert jobs.sent["metadata"]["checkpoints"] == submission.checkpoints
    assert submission.run_dir == jobs.sent["metadata"]["run_dir"] == "/shared/runs/r"


def test_submit_prints_no_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = RecordingJobs()
    jobs.address = f"http://admin:{SECRET}@127.0.0.1:8265"  # a dashboard behind a proxy's basic auth
    monkeypatch.setattr("trainforge.cli.jobs._jobs", lambda *args: jobs)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(secret_config().to_dict()))
    main(["submit", "run.yaml", "--no-wait"])
    printed = capsys.readouterr()
    assert printed.out == "raysubmit_test\n"
    assert SECRET not in printed.out + printed.err, printed.err
    hint = "trainforge ckpt list s3://KEY:***@bucket/ck/r?endpoint_override=127.0.0.1:9000&scheme=http"
    assert hint in printed.err and "--address http://admin:***@127.0.0.1:8265" in printed.err


def test_train_in_a_submitted_job_reads_its_secrets_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"kwargs": {"hf_token": "***", "n": [1, "***"]}}, "train": {"x": 1}}))
    assert submitted_source(str(path)) == str(path)  # not a submitted job: the file as it is
    monkeypatch.setenv(
        SECRETS_ENV, json.dumps([[["model", "kwargs", "hf_token"], "t0k"], [["model", "kwargs", "n", 1], 7]])
    )
    assert submitted_source(str(path)) == {"model": {"kwargs": {"hf_token": "t0k", "n": [1, 7]}}, "train": {"x": 1}}
    for wrong, problem in [
        ("{not json", "is not a list of [path, value]"),
        (
            '[[["model", "kwargs", "other"], "v"]]',
            "has a value for model.kwargs.other, which the config file does not hold",
        ),
        ('[[["model", "kwargs", "n", 5], "v"]]', "has a value for model.kwargs.n.5"),
        ('[[["train", "x", "deeper"], "v"]]', "has a value for train.x.deeper"),
    ]:
        monkeypatch.setenv(SECRETS_ENV, wrong)
        with pytest.raises(ConfigError, match=re.escape(problem)) as refused:
            submitted_source(str(path))
        assert "\n" not in str(refused.value) and "t0k" not in str(refused.value)


def test_jobs_status_masks_credentials_a_job_holds() -> None:
    """A job submitted by an older trainforge (credentials in its metadata) or by hand."""
    details = SimpleNamespace(
        submission_id="raysubmit_x",
        job_id=None,
        status="FAILED",
        message=f"cannot open s3://KEY:{SECRET}@b/p",
        metadata={"trainforge_run": "r", "run_dir": "/r", "checkpoints": f"{STORAGE}/r"},
        start_time=None,
        end_time=None,
        driver_exit_code=1,
        entrypoint=f"trainforge train c.yaml --set checkpoint.storage_path={STORAGE}",
    )
    fields = dict(job_fields(details))  # type: ignore[arg-type]
    assert not [value for value in fields.values() if SECRET in value], fields
    assert fields["checkpoints"].startswith("s3://KEY:***@bucket/ck?")
