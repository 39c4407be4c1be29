"""Runs submitted to a Ray cluster as Ray jobs: ``trainforge submit`` and ``trainforge jobs``.

A submitted run is ``trainforge train`` executed by the cluster (Ray's Jobs API on the head's
dashboard, port 8265): the user's working directory travels as the job's ``working_dir`` (their
model and data factories with it; what holds or names a secret stays here: ``job_package``),
together with the config resolved and validated here: the
cluster runs what ``config show`` prints on this machine, with only the cluster's own
``TRAINFORGE_*`` variables applied on top. The job's driver connects to its own cluster (Ray sets
``RAY_ADDRESS`` for every job), so ``cluster.address`` is dropped from it.

Every request goes through the command's ``DashboardWait`` (``dashboard.py``): a head that is
still starting is waited for, up to ``--wait-for-cluster`` seconds; a wrong token, a missing one or
an address that is not a Ray dashboard is a ``ClusterError`` at once (one line, exit code 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shlex
import string
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import yaml

from trainforge.config import Config
from trainforge.driver.dashboard import (
    WAIT_S,
    DashboardWait,
    NotReady,
    answer_reason,
    auth_headers,
    check_dashboard,
    connection_reason,
    dashboard_address,
    find_token,
    refused,
)
from trainforge.driver.job_package import Contents, package_contents, written_package
from trainforge.driver.job_secrets import Secret, secrets_env, split_secrets
from trainforge.driver.tls import dashboard_verify
from trainforge.errors import ClusterError
from trainforge.redact import redact_text

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient
    from rich.table import Table

# Ray's job stop sends SIGTERM, then SIGKILL after this many seconds (Ray's default is 3): the
# remote `trainforge train` needs the time to checkpoint at its next report and return.
STOP_GRACE_S = 120
POLL_S = 1.0
# Never worth uploading: environments, caches, version control, MLflow's default local store. The
# run's own output and checkpoint folders are added when they lie inside the working directory.
# What holds or names a secret is left out by another rule (job_package.withheld_reason).
EXCLUDES = [
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "*.pyc",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    "mlruns",
]
SDK_LOGGERS = (
    "ray.dashboard.modules.dashboard_sdk",
    "ray.dashboard.modules.job.sdk",
    "ray._private.runtime_env.packaging",
)
CONFIG_PREFIX = "trainforge-submit-"
ID_CHARACTERS = "".join(sorted(set(string.ascii_letters + string.digits) - set("IlOo0")))
EXIT_STOPPED = 130

T = TypeVar("T")


@dataclass(frozen=True)
class Submission:
    """A submitted run: its job id and where its results land."""

    job_id: str
    address: str
    run_dir: str
    checkpoints: str  # the run's checkpoint folder, what `trainforge ckpt list` takes (credentials masked)


class Jobs:
    """Ray's ``JobSubmissionClient`` for one dashboard: every call waits for a head that is still
    starting (``DashboardWait``), and the SDK's errors become ClusterErrors."""

    def __init__(
        self,
        address: str | None,
        token_file: Path | None = None,
        *,
        wait_s: float = WAIT_S,
        progress: IO[str] | None = None,
        ca: str | None = None,
        ca_source: str = "--ca",
    ) -> None:
        self.address = dashboard_address(address)
        verify = dashboard_verify(self.address, ca, ca_source)  # the CA of a TLS proxy, else the system's
        self.token = token = find_token(token_file)
        self.wait = DashboardWait(self.address, wait_s, progress)
        self.wait.run(lambda: check_dashboard(self.address, token, verify))
        # Imported only now: Ray takes seconds to import, and a wrong address or token is told sooner.
        from ray.job_submission import JobSubmissionClient

        # Ray's SDK logs every upload step and the log socket's close at INFO; submit says what it did.
        for name in SDK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)

        # The SDK lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override the address it is given.
        with _without_env("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            self.client: JobSubmissionClient = self._call(
                lambda: JobSubmissionClient(self.address, headers=auth_headers(token), verify=verify)
            )

    def _call(self, call: Callable[[], T], job_id: str | None = None) -> T:
        """One SDK call, repeated while the dashboard is not ready (within the command's wait)."""

        def attempt() -> T:
            with self._errors(job_id):
                return call()

        return self.wait.run(attempt)

    @contextlib.contextmanager
    def _errors(self, job_id: str | None = None) -> Iterator[None]:
        """The SDK's exceptions (RuntimeError with an HTTP status, requests' errors) as one line, or
        ``NotReady`` for a lost connection and a 5xx answer (the head may still be starting)."""
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError as err:
            said = str(err)
            status = 401 if said.startswith("Authentication required") else 403 if "failed" in said[:40] else None
            raise refused(self.address, self.token, status) from None
        except requests.exceptions.SSLError as err:
            raise ClusterError(f"TLS with the Ray dashboard at {self.address} failed ({type(err).__name__})") from None
        except requests.HTTPError as err:  # the SDK's version check
            status = err.response.status_code if err.response is not None else 0
            if status in (401, 403):
                raise refused(self.address, self.token, status) from None
            if status >= 500:
                raise NotReady(answer_reason(status, err.response.text if err.response is not None else "")) from None
            raise ClusterError(f"the Ray cluster at {self.address}: HTTP {status} to /api/version") from None
        except (requests.ConnectionError, requests.Timeout, ConnectionError) as err:
            raise NotReady(connection_reason(err)) from None
        except requests.RequestException as err:
            raise ClusterError(f"lost the Ray dashboard at {self.address} ({type(err).__name__})") from None
        except RuntimeError as err:
            answered = re.match(r"Request failed with status code (5\d\d): (.*)\.\Z", str(err), re.DOTALL)
            if answered:
                raise NotReady(answer_reason(int(answered.group(1)), answered.group(2))) from None
            text = " ".join(str(err).split())
            status_refused = re.match(r"Request failed with status code (40[13])\b", text)
            if status_refused:
                raise refused(self.address, self.token, int(status_refused.group(1))) from None
            if job_id is not None and "status code 404" in text:
                raise ClusterError(
                    f"no job {job_id} on the Ray cluster at {self.address} (trainforge jobs list lists them)"
                ) from None
            if "status code 413" in text:
                raise ClusterError(
                    "the working directory is too large for the Ray dashboard (100 MiB): "
                    "list data and outputs in .rayignore, or keep them on shared storage"
                ) from None
            raise ClusterError(f"the Ray cluster at {self.address}: {text}") from None

    def submit(self, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> str:
        """Submit a job under an id chosen here, so that a retry after an answer that was lost (a
        dropped connection, a proxy's 5xx) finds the job submitted instead of submitting it twice."""
        submission_id = new_submission_id()
        attempts = 0

        def attempt() -> str:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and self._exists(submission_id):
                return submission_id
            try:
                return self.client.submit_job(
                    entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata, submission_id=submission_id
                )
            except RuntimeError as err:
                if submission_id in str(err) and "already exists" in str(err):
                    return submission_id
                raise

        return self._call(attempt)

    def _exists(self, job_id: str) -> bool:
        try:
            self.client.get_job_info(job_id)
        except RuntimeError as err:
            if "status code 404" in str(err):
                return False
            raise
        return True

    def info(self, job_id: str) -> JobDetails:
        return self._call(lambda: self.client.get_job_info(job_id), job_id)

    def list(self) -> list[JobDetails]:
        return sorted(self._call(self.client.list_jobs), key=lambda job: job.start_time or 0)

    def logs(self, job_id: str) -> str:
        return self._call(lambda: self.client.get_job_logs(job_id), job_id)

    def stop(self, job_id: str) -> bool:
        return self._call(lambda: self.client.stop_job(job_id), job_id)

    def follow(self, job_id: str, out: IO[str]) -> JobDetails:
        """Write the job's log to ``out`` as it grows; its details once it has ended.

        Ray streams the log over a websocket until the job ends; if that closes early (a proxy,
        a dashboard restart), the rest comes from polling the whole log, past what was written.
        """
        import aiohttp

        log = _Written(out)
        with contextlib.suppress(RuntimeError, OSError, aiohttp.ClientError, asyncio.TimeoutError):
            asyncio.run(self._tail(job_id, log))
        while True:
            details = self.info(job_id)  # before the log, so that an ended job's log is complete
            log.write(self.logs(job_id)[log.chars :])
            if details.status.is_terminal():
                return details
            time.sleep(POLL_S)

    async def _tail(self, job_id: str, log: _Written) -> None:
        async for chunk in self.client.tail_job_logs(job_id):
            log.write(chunk)


class _Written:
    """A text stream that counts what went through it, flushing each write (progress lines)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.chars = 0

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.chars += len(text)


def submission_contents(
    config: Config,
    working_dir: Path,
    *,
    token_file: Path | None = None,
    includes: list[Path] | None = None,
) -> Contents:
    """What a submission of ``config`` sends from ``working_dir`` (``job_package``): the ignore
    rules, and the secret rule told the token file, the token itself and the config's paths."""
    token = find_token(token_file)
    return package_contents(
        working_dir,
        config=config.to_dict(),
        ignore=excludes(config, working_dir),
        token_file=token_file,
        token_values=[token.value] if token else [],
        includes=includes or [],
    )


def shipped_config(config: Config) -> tuple[str, dict[str, Any], list[Secret]]:
    """The name and content of the config file the package carries (secrets masked), and the
    secrets that travel in the job's environment instead (``job_secrets``)."""
    shipped, secrets = split_secrets(job_config(config))
    return f"{CONFIG_PREFIX}{config.run.name}-{uuid.uuid4().hex[:8]}.yaml", shipped, secrets


def submit_run(config: Config, jobs: Jobs, contents: Contents, *, resume: str | None = None) -> Submission:
    """Submit ``trainforge train`` of ``config`` with ``contents`` (``submission_contents``) as the
    job's working directory; ``resume`` is its ``--resume`` (a run directory trained with a
    different config continues).

    The package is a zip of ``contents.sent`` and the resolved config, with its secrets masked;
    the secrets travel in the job's environment (``job_secrets``). Before anything is uploaded,
    the checks ``trainforge train`` makes before Ray starts on a cluster run here (unknown data
    source or model name, cluster-only metrics options).
    """
    # Imported here: launch brings torch and Ray Train, which only a submission needs.
    from trainforge.checkpoint.storage import join_uri
    from trainforge.driver.run import preflight
    from trainforge.metrics.driver.session import check_cluster_options

    preflight(config, local=False)
    check_cluster_options(config.metrics)
    config_name, shipped, secrets = shipped_config(config)
    # What submit prints and the job's metadata keep: masked, as every record of the run.
    run_dir = str(Path(shipped["run"]["output_dir"]) / config.run.name)
    checkpoints = join_uri(shipped["checkpoint"]["storage_path"] or shipped["run"]["output_dir"], config.run.name)
    resume_flag = ["--resume", resume] if resume is not None else []
    with written_package(contents, {config_name: yaml.safe_dump(shipped, sort_keys=False)}) as package:
        job_id = jobs.submit(
            entrypoint=shlex.join(["trainforge", "train", *resume_flag, config_name]),
            runtime_env={
                "working_dir": str(package),
                "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S), **secrets_env(secrets)},
            },
            metadata={"trainforge_run": config.run.name, "run_dir": run_dir, "checkpoints": checkpoints},
        )
    return Submission(job_id=job_id, address=jobs.address, run_dir=run_dir, checkpoints=checkpoints)


def job_config(config: Config) -> dict[str, Any]:
    """The config the job runs: local paths of results made absolute (the job's own working
    directory is a temporary copy), ``cluster.address`` dropped (the job joins its cluster)."""
    shipped = config.to_dict()  # the real values: submit_run splits the secrets off
    shipped["run"]["output_dir"] = str(config.run_dir.parent)
    storage = config.checkpoint.storage_path
    if storage and "://" not in storage:
        shipped["checkpoint"]["storage_path"] = config.storage_path
    shipped["cluster"]["address"] = None
    shipped["cluster"]["tls"] = None  # paths on this machine; the nodes' Ray has its own (RAY_TLS_*)
    return shipped


def excludes(config: Config, working_dir: Path) -> list[str]:
    """EXCLUDES plus this run's output and checkpoint folders when they lie inside ``working_dir``
    (the whole folder holding the runs, or the run's own when that folder is ``working_dir``)."""
    found = list(EXCLUDES)
    root = working_dir.resolve()
    for parent in (config.run_dir.parent, Path(config.storage_path)):
        for folder in (parent, parent / config.run.name):
            if folder.is_relative_to(root) and folder != root:
                found.append(f"/{folder.relative_to(root).as_posix()}")
                break
    return list(dict.fromkeys(found))


def new_submission_id() -> str:
    """An id in Ray's own form (``raysubmit_`` and 16 letters and digits, none easily confused)."""
    return "raysubmit_" + "".join(secrets.choice(ID_CHARACTERS) for _ in range(16))


def is_loopback(address: str) -> bool:
    host = urlparse(address).hostname or ""
    return host in ("localhost", "::1") or bool(re.fullmatch(r"127(\.\d{1,3}){3}", host))


def exit_code(details: JobDetails) -> int:
    """The command's exit code for an ended job: 0 succeeded, 130 stopped, and for a failed one
    the remote ``trainforge train``'s own code (1 failed training, 2 a user error) or 1."""
    status = str(details.status)
    if status == "SUCCEEDED":
        return 0
    if status == "STOPPED":
        return EXIT_STOPPED
    code = details.driver_exit_code
    return code if isinstance(code, int) and code > 0 else 1


def job_fields(details: JobDetails) -> list[tuple[str, str]]:
    """What ``trainforge jobs status`` shows of a job, as (label, value) rows."""
    meta = details.metadata or {}
    fields = [("job", job_name(details)), ("status", f"{details.status}{_first_line(details.message)}")]
    if "trainforge_run" in meta:
        fields += [("run", meta["trainforge_run"]), ("results", meta.get("run_dir", "?"))]
        fields.append(("checkpoints", meta.get("checkpoints", "?")))
    fields.append(("started", _when(details.start_time)))
    if details.end_time:
        fields.append(("ended", f"{_when(details.end_time)} (after {_duration(details)})"))
    if details.driver_exit_code is not None:
        fields.append(("exit code", str(details.driver_exit_code)))
    fields.append(("entrypoint", details.entrypoint))
    # A job of an older submit, or of someone else's, may hold credentials in what it shows.
    return [(label, redact_text(value)) for label, value in fields]


def jobs_table(found: list[JobDetails]) -> Table:
    """``trainforge jobs list``: one row per job, oldest first."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("job", "status", "run", "started", "duration"):
        table.add_column(column)
    for details in found:
        run = redact_text((details.metadata or {}).get("trainforge_run", "-"))
        table.add_row(job_name(details), str(details.status), run, _when(details.start_time), _duration(details))
    return table


def job_name(details: JobDetails) -> str:
    return details.submission_id or details.job_id or "?"


def _first_line(message: str | None) -> str:
    """Ray's message for a failed job ends with the last lines of its log: the first line says it."""
    line = (message or "").strip().split("\n")[0].rstrip(",:")
    return f" ({line})" if line else ""


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _duration(details: JobDetails) -> str:
    if not details.start_time:
        return "-"
    end = details.end_time or time.time() * 1000
    return f"{max(0.0, (end - details.start_time) / 1000):.0f} s"


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
