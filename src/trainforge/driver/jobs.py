"""Runs submitted to a Ray cluster as Ray jobs: ``trainforge submit`` and ``trainforge jobs``.

A submitted run is ``trainforge train`` executed by the cluster (Ray's Jobs API on the head's
dashboard, port 8265): the user's working directory travels as the job's ``working_dir`` (their
model and data factories with it), together with the config resolved and validated here: the
cluster runs what ``config show`` prints on this machine, with only the cluster's own
``TRAINFORGE_*`` variables applied on top. The job's driver connects to its own cluster (Ray sets
``RAY_ADDRESS`` for every job), so ``cluster.address`` is dropped from it.

The first contact is bounded: a TCP connect, then ``GET /api/version`` with the token, each with
a short timeout, before Ray's SDK (whose requests have no timeout) is used. A wrong token, a
missing one or an unreachable address is a ``ClusterError`` (one line, exit code 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlparse

import yaml

from trainforge.config import Config
from trainforge.errors import ClusterError, ConfigError

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient
    from rich.table import Table

ADDRESS_ENV = "RAY_JOBS_ADDRESS"
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0
# Ray's job stop sends SIGTERM, then SIGKILL after this many seconds (Ray's default is 3): the
# remote `trainforge train` needs the time to checkpoint at its next report and return.
STOP_GRACE_S = 120
POLL_S = 1.0
# Never worth uploading: environments, caches, version control, MLflow's default local store. The
# run's own output and checkpoint folders are added when they lie inside the working directory.
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
EXIT_STOPPED = 130


@dataclass(frozen=True)
class Token:
    """A Ray authentication token and where it was found (named in errors, never the value)."""

    value: str
    source: str


@dataclass(frozen=True)
class Submission:
    """A submitted run: its job id and where its results land."""

    job_id: str
    address: str
    run_dir: str
    checkpoints: str  # the run's checkpoint folder: what `trainforge ckpt list` takes


def dashboard_address(address: str | None) -> str:
    """``--address``, else ``RAY_JOBS_ADDRESS``, else ``RAY_ADDRESS`` when it is a dashboard URL."""
    given = address or os.environ.get(ADDRESS_ENV) or None
    ray_address = os.environ.get("RAY_ADDRESS", "")
    if given is None and ray_address.startswith(("http://", "https://")):
        given = ray_address
    if given is None:
        raise ConfigError(f"no cluster: give --address http://HEAD:8265 (the Ray dashboard), or set {ADDRESS_ENV}")
    parsed = urlparse(given)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"--address {given!r}: the Ray dashboard's URL, http://HEAD:8265 (not the GCS HEAD:6379 or ray://)"
        )
    return given.rstrip("/")


def find_token(token_file: Path | None) -> Token | None:
    """The token to send: ``--token-file``, else Ray's own sources in Ray's order
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``); None when there is none."""
    if token_file is not None:
        return _read_token(token_file, f"--token-file {token_file}", required=True)
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return Token(os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        return _read_token(path, f"RAY_AUTH_TOKEN_PATH {path}", required=True)
    return _read_token(Path.home() / ".ray" / "auth_token", "~/.ray/auth_token", required=False)


def _read_token(path: Path, source: str, *, required: bool) -> Token | None:
    try:
        with path.open("rb") as file:
            value = file.read(4097).decode("utf-8").strip()
    except FileNotFoundError:
        if not required:
            return None
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{source}: cannot read the token ({err})") from None
    if not value or len(value) > 4096 or any(c.isspace() for c in value):
        raise ConfigError(f"{source}: not a Ray token (one line; `ray get-auth-token` prints the cluster's)")
    return Token(value, source)


def check_dashboard(address: str, token: Token | None) -> None:
    """The dashboard answers and takes the token, within seconds; else one ClusterError."""
    import requests

    parsed = urlparse(address)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=CONNECT_TIMEOUT_S):
            pass
        answer = requests.get(f"{address}/api/version", headers=auth_headers(token), timeout=REQUEST_TIMEOUT_S)
    except (OSError, requests.RequestException) as err:
        reason = type(err).__name__ if isinstance(err, requests.RequestException) else err.strerror or str(err)
        raise ClusterError(
            f"cannot reach the Ray dashboard at {address} ({reason}); check the address (http://HEAD:8265)"
        ) from None
    if answer.status_code == 401:
        raise ClusterError(
            f"the Ray cluster at {address} requires a token and none was found: set RAY_AUTH_TOKEN or "
            "RAY_AUTH_TOKEN_PATH, or give --token-file (`ray get-auth-token` on the head prints it)"
        )
    if answer.status_code == 403:
        source = token.source if token else "the request"
        raise ClusterError(
            f"the Ray cluster at {address} refused the token from {source}: it is not this cluster's "
            "token (`ray get-auth-token` on the head prints it)"
        )
    if answer.status_code != 200:
        raise ClusterError(
            f"{address} answered HTTP {answer.status_code} to /api/version: is it a Ray dashboard (port 8265)?"
        )


def auth_headers(token: Token | None) -> dict[str, str]:
    """Ray's dashboard reads ``Authorization: Bearer <token>`` (ray/_private/authentication)."""
    return {"Authorization": f"Bearer {token.value}"} if token else {}


class Jobs:
    """Ray's ``JobSubmissionClient`` for one dashboard, its errors turned into ClusterErrors."""

    def __init__(self, address: str | None, token_file: Path | None = None) -> None:
        self.address = dashboard_address(address)
        token = find_token(token_file)
        check_dashboard(self.address, token)
        # Imported only now: Ray takes seconds to import, and a wrong address or token is told sooner.
        from ray.job_submission import JobSubmissionClient

        # Ray's SDK logs every upload step and the log socket's close at INFO; submit says what it did.
        for name in SDK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)

        # The SDK lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override the address it is given.
        with _without_env("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"), self.errors():
            self.client: JobSubmissionClient = JobSubmissionClient(self.address, headers=auth_headers(token))

    @contextlib.contextmanager
    def errors(self, job_id: str | None = None) -> Iterator[None]:
        """The SDK's exceptions (RuntimeError with an HTTP status, requests' errors) as one line."""
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError:
            raise ClusterError(f"the Ray cluster at {self.address} refused the token") from None
        except (requests.RequestException, ConnectionError) as err:
            raise ClusterError(f"lost the Ray dashboard at {self.address} ({type(err).__name__})") from None
        except RuntimeError as err:
            text = " ".join(str(err).split())
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

    def info(self, job_id: str) -> JobDetails:
        with self.errors(job_id):
            return self.client.get_job_info(job_id)

    def list(self) -> list[JobDetails]:
        with self.errors():
            return sorted(self.client.list_jobs(), key=lambda job: job.start_time or 0)

    def logs(self, job_id: str) -> str:
        with self.errors(job_id):
            return self.client.get_job_logs(job_id)

    def stop(self, job_id: str) -> bool:
        with self.errors(job_id):
            return self.client.stop_job(job_id)

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


def submit_run(config: Config, jobs: Jobs, working_dir: Path) -> Submission:
    """Submit ``trainforge train`` of ``config`` with ``working_dir`` as the job's working directory.

    The resolved config is written into the working directory for the upload and removed after it.
    Before anything is uploaded, the checks ``trainforge train`` makes before Ray starts on a
    cluster run here (unknown data source or model name, cluster-only metrics options).
    """
    # Imported here: launch brings torch and Ray Train, which only a submission needs.
    from trainforge.driver.run import preflight
    from trainforge.metrics.driver.session import check_cluster_options

    preflight(config, local=False)
    check_cluster_options(config.metrics)
    shipped = job_config(config)
    config_file = working_dir / f"{CONFIG_PREFIX}{config.run.name}-{uuid.uuid4().hex[:8]}.yaml"
    try:
        config_file.write_text(yaml.safe_dump(shipped, sort_keys=False))
    except OSError as err:
        raise ConfigError(f"cannot write the submitted config into {working_dir}: {err.strerror or err}") from None
    run_dir = str(Path(shipped["run"]["output_dir"]) / config.run.name)
    storage = str(shipped["checkpoint"]["storage_path"] or shipped["run"]["output_dir"])
    checkpoints = f"{storage.rstrip('/')}/{config.run.name}"
    try:
        with jobs.errors():
            job_id = jobs.client.submit_job(
                entrypoint=f"trainforge train {shlex.quote(config_file.name)}",
                runtime_env={
                    "working_dir": str(working_dir),
                    "excludes": excludes(config, working_dir),
                    "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)},
                },
                metadata={"trainforge_run": config.run.name, "run_dir": run_dir, "checkpoints": checkpoints},
            )
    finally:
        config_file.unlink(missing_ok=True)
    return Submission(job_id=job_id, address=jobs.address, run_dir=run_dir, checkpoints=checkpoints)


def job_config(config: Config) -> dict[str, Any]:
    """The config the job runs: local paths of results made absolute (the job's own working
    directory is a temporary copy), ``cluster.address`` dropped (the job joins its cluster)."""
    shipped = config.to_dict()  # not redacted: the job needs the real values
    shipped["run"]["output_dir"] = str(config.run_dir.parent)
    storage = config.checkpoint.storage_path
    if storage and "://" not in storage:
        shipped["checkpoint"]["storage_path"] = config.storage_path
    shipped["cluster"]["address"] = None
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
    return fields


def jobs_table(found: list[JobDetails]) -> Table:
    """``trainforge jobs list``: one row per job, oldest first."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("job", "status", "run", "started", "duration"):
        table.add_column(column)
    for details in found:
        run = (details.metadata or {}).get("trainforge_run", "-")
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
