"""``trainforge submit`` and ``trainforge jobs`` against a real Ray head with token authentication.

One ``ray start --head --block`` (dashboard included: it serves the Jobs API) on loopback for the
module, with ``RAY_AUTH_MODE=token`` and a token of the test's own, in a private temp dir and on
ports of its own, so that it neither joins nor disturbs another Ray on the machine. It is ended
by killing its own process tree (never ``ray stop``, which would end every Ray on the machine).
The first submission is sent one second after ``ray start``, long before the head can take a job:
``submit`` waits for it (``--wait-for-cluster``); the other tests wait for the Jobs API first.

The submitted run trains a model from a factory module that exists only in the submitting
command's working directory: the job can import it only because the directory travelled with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from tests.helpers.runs import tiny_run
from tests.helpers.timing import rescaled, scaled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # ray and trainforge of this environment
HF_TOKEN = "SubmittedSecret0x9E2"  # a credential in the model's kwargs: reaches the model, no record
MODEL_MODULE = '''
from torch import nn


def build(hidden: int = 16, hf_token: str = "") -> nn.Module:
    """A digits-sized classifier: (B, 1, 8, 8) -> (B, 10), that needs a credential (not its mask)."""
    if not hf_token.startswith("SubmittedSecret"):
        raise ValueError("the model got no credential or a masked one")
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
'''


@dataclass(frozen=True)
class Head:
    url: str
    token: str
    process: subprocess.Popen[bytes]
    log: Path  # what ray start said
    started_at: float  # time.monotonic() when ray start was launched

    def said(self) -> str:
        return f"ray start said:\n{self.log.read_text()[-3000:]}"


def free_ports(count: int) -> list[int]:
    """Ports free now (bound together, so distinct); Ray binds them a moment later."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def client_env(**values: str) -> dict[str, str]:
    """The submitting user's environment: no Ray address or token of the machine's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_JOBS"))}
    return {**env, "TERM": "dumb", **values}


@pytest.fixture(scope="module")
def started_head() -> Iterator[Head]:
    """The head, launched and not waited for."""
    token = uuid.uuid4().hex
    temp_dir = tempfile.mkdtemp(prefix="tfjob-", dir="/tmp")  # short: Ray's socket paths live under it
    gcs, dashboard, client, agent, agent_grpc, runtime_env, metrics = free_ports(7)
    env = {
        **client_env(),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the job's `trainforge` command
        "OMP_NUM_THREADS": "1",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 (open for the module's lifetime)
    started_at = time.monotonic()
    head_process = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--temp-dir={temp_dir}",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--num-cpus=4",
            "--object-store-memory=200000000",  # the machine is shared: 200 MB instead of 30% of memory
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--metrics-export-port={metrics}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield Head(f"http://127.0.0.1:{dashboard}", token, head_process, Path(log.name), started_at)
    finally:
        end_process_tree(head_process)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def head(started_head: Head) -> Head:
    """The head once its Jobs API answers: for the tests that time or count what they send."""
    try:
        wait_for_jobs_api(started_head.url, started_head.token, started_head.process, timeout_s=120)
    except (RuntimeError, TimeoutError) as err:
        raise RuntimeError(f"{err}; {started_head.said()}") from None
    return started_head


def wait_for_jobs_api(url: str, token: str, head_process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """The dashboard answers /api/jobs/ with the token (its job module starts after the server)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if head_process.poll() is not None:
            raise RuntimeError(f"ray start exited with {head_process.returncode}")
        try:
            answer = requests.get(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=5)
            if answer.status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Ray dashboard at {url} did not serve the Jobs API within {timeout_s:.0f} s")


def end_process_tree(root: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``ray start`` and every process under it (job drivers run in sessions of their
    own, so a process group would miss them), SIGKILL to whatever is left after 3 s."""
    try:
        tree = [psutil.Process(root.pid), *psutil.Process(root.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=3)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
    root.wait(timeout=5)


def trainforge(*args: str, cwd: Path, env: dict[str, str], timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "trainforge"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's working directory: their model module and a run config that names it, with the
    run's results in ``results/`` under it (relative: submit makes it absolute for the job, and
    leaves it out of the upload)."""
    where = tmp_path_factory.mktemp("project")
    (where / "mymodels.py").write_text(MODEL_MODULE)
    config = tiny_run(
        Path("results"),
        run={"name": "submitted"},
        model={"name": None, "factory": "mymodels:build", "kwargs": {"hidden": 16, "hf_token": HF_TOKEN}},
        checkpoint={"every_n_steps": 10},
        tracking={"enabled": False},  # the MLflow store costs seconds and is not what is tested
    )
    (where / "run.yaml").write_text(yaml.safe_dump(config))
    return where


@dataclass(frozen=True)
class Submitted:
    result: subprocess.CompletedProcess[str]
    early: bool  # sent one second after ray start (False when another test had started the head before)


@pytest.fixture(scope="module")
def submitted(started_head: Head, project: Path) -> Submitted:
    """One submission, sent a second after ``ray start`` and followed to its end: the run the
    tests below look at. The generous wait is for a loaded machine, where the head takes long."""
    early = time.monotonic() - started_head.started_at < 1
    time.sleep(max(0.0, started_head.started_at + 1 - time.monotonic()))
    result = trainforge(
        "submit",
        "run.yaml",
        "--address",
        started_head.url,
        "--wait-for-cluster",
        "180",
        cwd=project,
        env=client_env(RAY_AUTH_TOKEN=started_head.token),
        timeout=scaled(420),
    )
    if result.returncode != 0:
        result.stderr += f"\n{started_head.said()}"
    return Submitted(result, early)


def job_id_of(result: subprocess.CompletedProcess[str]) -> str:
    found = re.search(r"submitted job (\S+) to", result.stderr)
    assert found, result.stderr
    return found.group(1)


def test_submit_runs_the_config_with_the_users_model_and_streams_progress(submitted: Submitted, project: Path) -> None:
    result = submitted.result
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = project / "results" / "submitted"
    assert f"results: {run_dir}" in result.stderr
    # The remote run's progress display (a line every 10 s and the last report's), passed through as it arrives.
    assert "step 20/20" in result.stderr, result.stderr
    assert re.search(r"finished at step 20 ", result.stderr), result.stderr
    assert result.stdout.strip().splitlines()[-1] == f"{run_dir}/summary.json"
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["config"]["model"]["factory"] == "mymodels:build"
    # The resolved config went with the job and was removed from the working directory afterwards.
    assert not list(project.glob("trainforge-submit-*"))


def test_submit_to_a_head_started_a_second_earlier_waits_for_it_and_submits_once(
    submitted: Submitted, head: Head, project: Path
) -> None:
    result = submitted.result
    assert result.returncode == 0, result.stderr
    if submitted.early:  # no head can take a job one second after `ray start`
        assert f"waiting for the Ray dashboard at {head.url} (" in result.stderr, result.stderr
    assert not error_lines(result)
    # One job, although submit asked again and again while the head was starting.
    env = client_env(RAY_AUTH_TOKEN=head.token)
    listed = trainforge("jobs", "list", "--address", head.url, cwd=project, env=env)
    assert listed.returncode == 0, listed.stderr
    assert len(re.findall(r"\ssubmitted\s", listed.stdout)) == 1, listed.stdout


def test_the_credential_reaches_the_model_through_the_jobs_environment_and_no_record(
    submitted: Submitted, head: Head, project: Path
) -> None:
    """The model refuses a masked token, so the run's success says the real one reached it; the
    config file the job ran and every record say ``***``. The job's environment does hold it: Ray
    shows a job's runtime_env to whoever holds the cluster's token (docs/security.md)."""
    assert submitted.result.returncode == 0, submitted.result.stderr
    job = job_id_of(submitted.result)
    env = client_env(RAY_JOBS_ADDRESS=head.url, RAY_AUTH_TOKEN=head.token)
    status = trainforge("jobs", "status", job, cwd=project, env=env)
    listed = trainforge("jobs", "list", cwd=project, env=env)
    printed = [submitted.result.stdout, submitted.result.stderr, status.stdout, listed.stdout]
    assert not [text for text in printed if HF_TOKEN in text], printed
    files = [p for p in (project / "results").rglob("*") if p.is_file()]
    assert not [str(p) for p in files if HF_TOKEN.encode() in p.read_bytes()]
    summary = yaml.safe_load((project / "results" / "submitted" / "summary.json").read_text())
    assert summary["config"]["model"]["kwargs"] == {"hidden": 16, "hf_token": "***"}
    info = requests.get(f"{head.url}/api/jobs/{job}", headers={"Authorization": f"Bearer {head.token}"}, timeout=10)
    details = info.json()
    assert HF_TOKEN not in json.dumps([details["metadata"], details["entrypoint"]]), details
    assert HF_TOKEN in json.dumps(details["runtime_env"]["env_vars"])  # the trade-off, as documented
    # The package as the head unpacked it: the user's module, and no file holding the token (the
    # project's run.yaml holds it in clear: left out, the job ran the masked copy) (#36).
    unpacked = head.log.parent / "session_latest" / "runtime_resources" / "working_dir_files"
    packages = [module.parent for module in unpacked.glob("*/mymodels.py")]
    assert packages, sorted(str(p) for p in unpacked.rglob("*"))
    held = [
        p for package in packages for p in package.rglob("*") if p.is_file() and HF_TOKEN.encode() in p.read_bytes()
    ]
    assert not held and not [package for package in packages if (package / "run.yaml").exists()]


def test_ckpt_list_reads_the_submitted_runs_checkpoints(submitted: Submitted, project: Path) -> None:
    assert submitted.result.returncode == 0
    run_dir = project / "results" / "submitted"
    listed = trainforge("ckpt", "list", str(run_dir), cwd=project, env=client_env())
    assert listed.returncode == 0, listed.stderr
    assert "checkpoint_000000010" in listed.stdout
    assert "checkpoint_000000020" in listed.stdout
    assert "invalid" not in listed.stdout


def test_jobs_list_status_logs_and_stop_on_the_finished_job(submitted: Submitted, head: Head, project: Path) -> None:
    job = job_id_of(submitted.result)
    env = client_env(RAY_JOBS_ADDRESS=head.url, RAY_AUTH_TOKEN=head.token)
    listed = trainforge("jobs", "list", cwd=project, env=env)
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"{job}\s+SUCCEEDED\s+submitted", listed.stdout), listed.stdout
    status = trainforge("jobs", "status", job, cwd=project, env=env)
    assert status.returncode == 0, status.stderr
    assert re.search(r"status:\s+SUCCEEDED", status.stdout), status.stdout
    assert f"results:     {project / 'results' / 'submitted'}" in status.stdout
    logs = trainforge("jobs", "logs", job, cwd=project, env=env)
    assert logs.returncode == 0, logs.stderr
    assert "step 20/20" in logs.stdout
    stop = trainforge("jobs", "stop", job, cwd=project, env=env)
    assert stop.returncode == 0, stop.stderr
    assert f"{job} was not running (SUCCEEDED)" in stop.stdout
    missing = trainforge("jobs", "status", "raysubmit_nosuchjob", cwd=project, env=env)
    assert missing.returncode == 2
    assert len(error_lines(missing)) == 1 and "no job raysubmit_nosuchjob" in missing.stderr


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("not-the-token", "refused the token from RAY_AUTH_TOKEN"),
        (None, "requires a token (HTTP 401) and none was sent"),
    ],
)
def test_a_wrong_or_missing_token_is_one_line_and_exit_2(
    head: Head, project: Path, tmp_path: Path, token: str | None, expected: str
) -> None:
    # HOME without ~/.ray/auth_token: only what the test gives is sent.
    env = client_env(HOME=str(tmp_path), **({"RAY_AUTH_TOKEN": token} if token else {}))
    started = time.monotonic()
    result = trainforge("submit", "run.yaml", "--address", head.url, cwd=project, env=env)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    errors = error_lines(result)
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert elapsed < rescaled(10), elapsed  # refused at once, not after retries (10 s quiet, stretched by the load)


def test_a_token_file_is_read(head: Head, project: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(head.token + "\n")
    env = client_env(HOME=str(tmp_path), RAY_AUTH_TOKEN="not-the-token")  # --token-file comes first
    result = trainforge(
        "jobs", "list", "--address", head.url, "--token-file", str(tmp_path / "token"), cwd=project, env=env
    )
    assert result.returncode == 0, result.stderr


def test_an_unreachable_address_is_one_line_and_exit_2(project: Path) -> None:
    (closed,) = free_ports(1)
    url = f"http://127.0.0.1:{closed}"
    argv = ["submit", "run.yaml", "--address", url, "--wait-for-cluster", "0"]
    result = trainforge(*argv, cwd=project, env=client_env())
    assert result.returncode == 2, result.stderr
    errors = error_lines(result)
    assert errors == [
        f"error: the Ray dashboard at {url} did not answer (connection refused); is the head running? "
        "(--wait-for-cluster SECONDS waits for one that is starting)"
    ], result.stderr


def test_a_bad_config_is_refused_before_anything_is_submitted(head: Head, project: Path) -> None:
    env = client_env(RAY_AUTH_TOKEN=head.token)
    result = trainforge(
        "submit", "run.yaml", "--address", head.url, "--set", "train.bacth_size=3", cwd=project, env=env
    )
    assert result.returncode == 2
    errors = error_lines(result)
    assert len(errors) == 1 and "unknown key train.bacth_size" in errors[0], result.stderr
    assert "submitted job" not in result.stderr


def test_no_wait_prints_the_job_id_and_following_it_exits_with_the_remote_code(head: Head, project: Path) -> None:
    env = client_env(RAY_JOBS_ADDRESS=head.url, RAY_AUTH_TOKEN=head.token)
    # The job's driver calls a data factory before any worker starts: a missing one fails in seconds.
    overrides = ["--set", "run.name=broken", "--set", "data.name=factory", "--set", "data.factory=mymodels:missing"]
    result = trainforge("submit", "run.yaml", "--no-wait", *overrides, cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip()
    assert f"trainforge jobs logs {job} --follow --address {head.url}" in result.stderr
    followed = trainforge("jobs", "logs", job, "--follow", cwd=project, env=env)
    # The cluster's `trainforge train` found a user error (exit 2): its one line, then the same code here.
    assert followed.returncode == 2, followed.stdout + followed.stderr
    assert re.search(r"error: .*mymodels:missing", followed.stdout), followed.stdout
    assert f"job {job} FAILED: exit code 2" in followed.stderr
