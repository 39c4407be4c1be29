"""The laptop cluster (deploy/compose/compose.yaml) started for real with Debian's podman-compose,
its images built here (tests/deploy/images.py, compose/compose.override.yaml: PostgreSQL and
Prometheus from Debian's packages, moto's S3 server for MinIO, no Grafana), and used from this
machine as a user would: ``trainforge submit`` to the head's dashboard with the cluster's token.

One cluster per module (started in stages, each waited for by what it serves), torn down after
with its volumes and network, whatever the tests did.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from tests.deploy import images
from tests.deploy.tools import ROOT
from tests.helpers.cli import trainforge_command
from tests.helpers.faults import events_of, patched_environ, wait_until
from tests.helpers.sessions import assert_bit_identical
from tests.helpers.timing import scaled, slowdown
from trainforge.protocol import Resumed

COMPOSE = ROOT / "deploy" / "compose"
FILES = (COMPOSE / "compose.yaml", images.COMPOSE_IMAGES / "compose.override.yaml")
PROJECT = "trainforge-test"
LABEL = f"io.podman.compose.project={PROJECT}"
TRAINFORGE = trainforge_command()
DASHBOARD = "http://127.0.0.1:8265"
S3_USER, S3_KEY = "trainforge-test", secrets.token_hex(12)
# Quiet 2-core machine, measured (docs/deploy.md): every image reused 10 s (all built: 5 min);
# PostgreSQL, S3 and Prometheus answer in 5 s, MLflow in 25 s, the Ray head and both workers in
# 30 s; a submitted run of RUN below takes 40 s, 55 s with a worker container killed.
BUILD_S = 1500
SERVICES_QUIET_S = 5
MLFLOW_QUIET_S = 25
SERVICE_S = 60
RAY_S = 90
RUN_S = 240
# The ray job's scrape every 5 s, DNS discovery every 30 s (prometheus.yml): the series are in
# Prometheus by the time the run has ended; this is what a slow query may add.
SCRAPE_S = 90
# The user's run: deploy/compose/run.yaml's with steps paced (0.1 s) so that a worker container can
# be killed between checkpoints, and SPREAD so that the two workers land in the two worker
# containers while both are up (and in the one left when one is killed).
RUN: dict[str, dict[str, Any]] = {
    "model": {"name": None, "factory": "user_models:paced_net", "kwargs": {"delay_s": 0.1}},
    "train": {"max_steps": 100, "batch_size": 32, "log_every_n_steps": 5},
    "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}, "placement_strategy": "SPREAD"},
    "checkpoint": {"every_n_steps": 20, "keep_last": 3},
    "failure": {"max_failures": 2},
}


@dataclass
class Cluster:
    env: dict[str, str]
    token: Path
    workdir: Path

    def submit(self, name: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``trainforge submit`` of the user's run from its directory, as ``name``."""
        return subprocess.Popen(
            [*TRAINFORGE, "submit", "run.yaml", "--set", f"run.name={name}", "--address", DASHBOARD, *flags],
            cwd=self.workdir, env=env or user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def run(self, name: str) -> str:
        """Submit with the token and wait: the output of a run that succeeded."""
        proc = self.submit(name, "--token-file", str(self.token), "--wait-for-cluster", str(round(scaled(RAY_S))))
        out, _ = proc.communicate(timeout=scaled(RUN_S))
        assert proc.returncode == 0, out[-4000:]
        return out


def container(service: str, number: int = 1) -> str:
    return f"{PROJECT}_{service}_{number}"


def user_env() -> dict[str, str]:
    """This machine's environment without a Ray token or address of its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


def compose(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """podman-compose with ``timeout`` seconds of the quiet machine's (scaled)."""
    command = ["podman-compose", "-p", PROJECT, *(f"--file={f}" for f in FILES), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(timeout))


def http_ok(url: str, headers: dict[str, str] | None = None) -> bytes | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as answer:
            return answer.read() if answer.status == 200 else None
    except OSError:
        return None


def write_secrets(directory: Path) -> dict[str, Path]:
    """The secret files compose.override.yaml mounts; Ray's CA key readable by group 10001 only."""
    certs = [*TRAINFORGE, "certs", "create", str(directory / "tls")]
    made = subprocess.run(certs, capture_output=True, timeout=scaled(120))
    assert made.returncode == 0, made.stderr
    values = {
        "ray_auth_token": secrets.token_hex(32),
        "postgres_password": secrets.token_hex(12),
        "minio_root_user": S3_USER,
        "minio_root_password": S3_KEY,
        "grafana_admin_password": secrets.token_hex(12),
    }
    files = {}
    for name, value in values.items():
        files[name] = directory / name
        files[name].write_text(value)
        files[name].chmod(0o644)
    for name in ("ca.crt", "ca.key"):
        shutil.copyfile(directory / "tls" / name, directory / name)
    (directory / "ca.crt").chmod(0o644)
    os.chown(directory / "ca.key", -1, 10001)
    (directory / "ca.key").chmod(0o640)
    return files


def leftovers() -> list[str]:
    """Containers, volumes and networks of this project that podman still has."""
    found = []
    for kind, listing, field in (("container", ("ps", "--all"), "Names"), ("volume", ("volume", "ls"), "Name"),
                                 ("network", ("network", "ls"), "Name")):  # fmt: skip
        listed = images.podman(*listing, "--filter", f"label={LABEL}", "--format", f"{{{{.{field}}}}}", timeout=60)
        found += [f"{kind} {name}" for name in listed.stdout.split()]
    network = images.podman("network", "exists", f"{PROJECT}_default", timeout=60, check=False)
    if network.returncode == 0 and f"network {PROJECT}_default" not in found:
        found.append(f"network {PROJECT}_default")
    return found


def tear_down(env: dict[str, str]) -> list[str]:
    """``podman-compose down -v``, then whatever it left (it keeps the network): what was left."""
    compose(env, "down", "--volumes")
    left = leftovers()
    for item in left:
        kind, name = item.split(" ", 1)
        images.podman(kind, "rm", "--force", name, timeout=120, check=False)
    return left


class StartClock:
    """How much slower than the quiet machine this cluster's containers start now: each stage's
    measured seconds over its quiet figure. A later stage's wait is its quiet figure times the
    largest such ratio so far (never less than the suite's slowdown): the measurement is of this
    machine, these containers and the load they start under, not a guess capped in advance."""

    def __init__(self) -> None:
        self.ratios: dict[str, float] = {}

    def timed(self, stage: str, quiet_s: float, wait: Any) -> None:
        started = time.monotonic()
        wait()
        self.ratios[stage] = (time.monotonic() - started) / quiet_s

    def factor(self) -> float:
        return max([slowdown(), *self.ratios.values()])

    def wait(self, condition: Any, quiet_s: float, what: str, interval_s: float) -> Any:
        """``wait_until`` for ``quiet_s`` of the quiet machine's, times ``factor()`` (wait_until
        multiplies by the suite's slowdown itself, and stretches a wait by the load after that)."""
        return wait_until(condition, quiet_s * self.factor() / slowdown(), what, interval_s=interval_s)

    def describe(self) -> str:
        measured = ", ".join(f"{stage} x{ratio:.1f}" for stage, ratio in self.ratios.items())
        return f"start-up measured {measured}; waits x{self.factor():.1f}"


def start(env: dict[str, str], token: str, clock: StartClock) -> None:
    """Up in dependency order, each stage waited for by what it serves: podman-compose 1.0.3
    starts dependencies without waiting for their health (nor runs health checks without systemd).
    Each stage's wait is scaled by how slowly the stages before it started (``StartClock``)."""

    def up(*services: str) -> None:
        # Services already up are reported as name conflicts and left running: not an error.
        done = compose(env, "up", "--detach", *services)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    ready = ["pg_isready", "--host=127.0.0.1", "--username=mlflow", "--dbname=mlflow"]

    def postgres_ready() -> bool:
        try:
            return images.podman("exec", container("postgres"), *ready, timeout=30, check=False).returncode == 0
        except subprocess.TimeoutExpired:  # a probe slower than 30 s on a busy machine: not ready yet
            return False

    def services() -> None:
        up("postgres", "minio", "prometheus")
        wait_until(postgres_ready, SERVICE_S, "PostgreSQL", interval_s=0.5)
        wait_until(lambda: http_ok("http://127.0.0.1:9000/"), SERVICE_S, "the S3 server", interval_s=0.5)
        wait_until(lambda: http_ok("http://127.0.0.1:9090/-/ready"), SERVICE_S, "Prometheus", interval_s=0.5)

    clock.timed("PostgreSQL, S3, Prometheus", SERVICES_QUIET_S, services)
    up("s3-init")
    exited = images.podman("wait", container("s3-init"), timeout=scaled(SERVICE_S) * clock.factor())
    assert exited.stdout.strip() == "0", images.podman("logs", container("s3-init"), timeout=60).stderr

    def mlflow() -> None:
        up("mlflow")
        clock.wait(lambda: http_ok("http://127.0.0.1:5000/health"), SERVICE_S, "MLflow", interval_s=0.5)

    clock.timed("MLflow", MLFLOW_QUIET_S, mlflow)
    up("ray-head", "ray-worker")
    headers = {"Authorization": f"Bearer {token}"}

    def alive_nodes() -> list[str]:
        answer = http_ok("http://127.0.0.1:8265/nodes?view=summary", headers)
        nodes = json.loads(answer)["data"]["summary"] if answer else []
        return [n["raylet"].get("nodeManagerAddress", "?") for n in nodes if n["raylet"]["state"] == "ALIVE"]

    try:
        clock.wait(lambda: len(alive_nodes()) == 3, RAY_S, "the Ray head and two workers", interval_s=1)
    except TimeoutError as err:
        raise TimeoutError(f"{err} ({clock.describe()}): {ray_containers_not_up(alive_nodes())}") from None


def ray_containers_not_up(alive: list[str]) -> str:
    """Which Ray container has no ALIVE node on the dashboard, in what state, and its last words."""
    missing = []
    for name in (container("ray-head"), container("ray-worker", 1), container("ray-worker", 2)):
        fmt = (
            "{{.State.Status}} exit={{.State.ExitCode}} restarts={{.RestartCount}} started={{.State.StartedAt}}"
            " ip={{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        )
        inspected = images.podman("inspect", "--format", fmt, name, timeout=60, check=False)
        if inspected.returncode != 0:
            missing.append(f"{name} not created ({inspected.stderr.strip()[-200:]})")
            continue
        state = inspected.stdout.strip()
        if state.rsplit("ip=", 1)[-1] in alive:
            continue
        logs = images.podman("logs", "--tail", "5", name, timeout=60, check=False)
        last = " | ".join((logs.stdout + logs.stderr).strip().splitlines()[-5:])
        missing.append(f"{name} not an ALIVE Ray node: {state}; last log lines: {last or '(none)'}")
    return "; ".join(missing) or f"every Ray container is an ALIVE node now ({alive})"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = images.missing_tools() or (None if shutil.which("podman-compose") else "podman-compose not installed")
    if why is None and os.geteuid() != 0:
        why = "rootful podman only: Ray's CA key is mounted for the containers' group 10001 (chown)"
    if why is not None:
        pytest.skip(why)
    # One cluster on the machine at a time, and no build beside it: its project name and host ports
    # are fixed (another session's suite waits here rather than tearing this one down).
    with images.exclusive():
        env = {**os.environ, **images.compose_images(timeout=scaled(BUILD_S))}
        secret_dir = tmp_path_factory.mktemp("compose-secrets")
        files = write_secrets(secret_dir)
        conf = secret_dir / "containers.conf"
        limits = images.ulimits()[1::2]
        conf.write_text(f'[containers]\ndefault_ulimits = {json.dumps(limits)}\n[engine]\nruntime = "runc"\n')
        env.update(
            CONTAINERS_CONF=str(conf),
            TRAINFORGE_TEST_SECRETS=str(secret_dir),
            MINIO_ROOT_USER=S3_USER,
            MINIO_ROOT_PASSWORD=S3_KEY,
            POSTGRES_PASSWORD=files["postgres_password"].read_text(),
            RAY_AUTH_TOKEN=files["ray_auth_token"].read_text(),
            GRAFANA_ADMIN_PASSWORD=files["grafana_admin_password"].read_text(),
        )
        workdir = tmp_path_factory.mktemp("compose-user")
        shutil.copyfile(ROOT / "tests" / "helpers" / "user_models.py", workdir / "user_models.py")
        run = yaml.safe_load((COMPOSE / "run.yaml").read_text())
        for section, values in RUN.items():
            run[section] = {**run.get(section, {}), **values}
        (workdir / "run.yaml").write_text(yaml.safe_dump(run))
        tear_down(env)  # what an interrupted session left
        try:
            started, clock = time.monotonic(), StartClock()
            start(env, files["ray_auth_token"].read_text(), clock)
            print(f"compose cluster up in {time.monotonic() - started:.0f} s ({clock.describe()})")
            yield Cluster(env, files["ray_auth_token"], workdir)
        finally:
            left = tear_down(env)
            assert left == [] or all(item.startswith("network") for item in left), f"down left {left}"


def s3_client() -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1",
        aws_access_key_id=S3_USER, aws_secret_access_key=S3_KEY,
    )  # fmt: skip


def committed_checkpoints(run: str) -> list[int]:
    """Steps of the run's checkpoints in the S3 store whose manifest is written (committed)."""
    listed = s3_client().list_objects_v2(Bucket="checkpoints", Prefix=f"runs/{run}/").get("Contents", [])
    found = (re.fullmatch(rf"runs/{run}/checkpoint_(\d+)/manifest\.json", o["Key"]) for o in listed)
    return sorted(int(m.group(1)) for m in found if m)


def mlflow_run(name: str, download_to: Path) -> tuple[Any, Path]:
    """The MLflow run named ``name`` (searched through the server, as a user would) and its artifacts."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="http://127.0.0.1:5000")
    experiment = client.get_experiment_by_name("trainforge")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'")
    # Through the server: its presigned URLs name http://minio:9000, which only the cluster's
    # network resolves (docs/deploy.md says so to users).
    with patched_environ(MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD="false"):
        local = Path(client.download_artifacts(found.info.run_id, "", str(download_to)))
    return found, local


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    """The uninterrupted run: its submit output, its MLflow run and that run's artifacts."""
    out = cluster.run("compose-reference")
    return out, *mlflow_run("compose-reference", tmp_path_factory.mktemp("reference"))


def worker_addresses() -> set[str]:
    fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
    return {images.podman("inspect", "--format", fmt, container("ray-worker", n), timeout=60).stdout.strip()
            for n in (1, 2)}  # fmt: skip


def prometheus(query: str) -> list[dict[str, Any]]:
    url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": query})
    answer = http_ok(url)
    return json.loads(answer)["data"]["result"] if answer else []


def scrapes_against_reports(run: str, artifacts: Path) -> str:
    """When Prometheus scraped each Ray target (``up``'s samples) and found the run's loss on it,
    in seconds from the run's first report, and when the ranks reported: where a series went."""
    lines = (artifacts / "metrics.jsonl").read_text().splitlines()
    times = [r["time/unix"] for r in map(json.loads, filter(str.strip, lines)) if "time/unix" in r]
    if not times:
        return "the run has no timed reports in metrics.jsonl"
    first = min(times)
    found = {s["metric"]["instance"]: s["values"] for s in prometheus(f'trainforge_train_loss{{run="{run}"}}[15m]')}
    story = [f"ranks reported from +0 to +{max(times) - first:.0f} s"]
    for target in prometheus('up{job="ray"}[15m]'):
        instance = target["metric"]["instance"]
        scraped = " ".join(f"{float(t) - first:+.0f}{'' if v == '1' else '(down)'}" for t, v in target["values"])
        loss = " ".join(f"{float(t) - first:+.0f}" for t, _ in found.get(instance, []))
        story.append(f"{instance} scraped at {scraped}; loss found at {loss or 'none'}")
    return "; ".join(story)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_submitted_run_trains_in_both_workers_checkpoints_to_s3_and_ends_in_mlflow_and_prometheus(
    cluster: Cluster, reference: tuple[str, Any, Path]
) -> None:
    out, run, artifacts = reference
    assert "finished at step 100" in out, out[-2000:]
    # Checkpoints in the S3 store, the last kept ones committed.
    assert committed_checkpoints("compose-reference") == [60, 80, 100]
    # MLflow: the run finished with its parameters, curves and model.
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["scaling.placement_strategy"] == "SPREAD"
    from mlflow.tracking import MlflowClient

    curve = MlflowClient(tracking_uri="http://127.0.0.1:5000").get_metric_history(run.info.run_id, "train/loss")
    assert len(curve) >= 100 // 5 * 0.9, len(curve)
    logged = {p.name for p in artifacts.iterdir()}
    assert {"model.safetensors", "summary.json", "config.yaml", "metrics.jsonl"} <= logged, logged
    summary = json.loads((artifacts / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["restarts"] == 0 and summary["num_workers"] == 2
    assert summary["checkpoint"] == "s3://checkpoints/runs/compose-reference/checkpoint_000000100"
    # Prometheus scraped both ranks' metrics, each from its own worker container's metrics agent.
    query = 'count by (instance, rank) (last_over_time(trainforge_train_loss{run="compose-reference"}[15m]))'
    try:
        series = wait_until(lambda: len(found := prometheus(query)) == 2 and found, SCRAPE_S, "both ranks' series", 1)
    except TimeoutError as err:
        raise TimeoutError(f"{err}: {scrapes_against_reports('compose-reference', artifacts)}") from None
    print(f"\nPrometheus: {scrapes_against_reports('compose-reference', artifacts)}")  # pytest -s
    instances = {s["metric"]["instance"].rsplit(":", 1)[0] for s in series}
    assert instances == worker_addresses(), (instances, worker_addresses())


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_killed_worker_container_resumes_from_the_newest_checkpoint_bit_identical(
    cluster: Cluster, reference: tuple[str, Any, Path], tmp_path: Path
) -> None:
    proc = cluster.submit("compose-killed", "--token-file", str(cluster.token), "--wait-for-cluster", "60")
    try:
        wait_until(lambda: committed_checkpoints("compose-killed"), RUN_S, "a checkpoint in S3", 0.1)
        images.podman("kill", container("ray-worker", 2), timeout=60)
        at_kill = committed_checkpoints("compose-killed")
        out, _ = proc.communicate(timeout=scaled(RUN_S))
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert at_kill[-1] < 100, at_kill  # killed mid-run
    _, artifacts = mlflow_run("compose-killed", tmp_path)
    summary = json.loads((artifacts / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["restarts"] == 1, summary
    records = [json.loads(line) for line in (artifacts / "metrics.jsonl").read_text().splitlines() if line.strip()]
    (resumed,) = [e for r in records for e in events_of(r) if isinstance(e, Resumed)]
    assert resumed.step == at_kill[-1], (resumed, at_kill)
    assert resumed.path == f"s3://checkpoints/runs/compose-killed/checkpoint_{resumed.step:09d}"
    *_, reference_artifacts = reference
    assert_bit_identical(
        load_file(artifacts / "model.safetensors"), load_file(reference_artifacts / "model.safetensors")
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_submit_without_the_token_or_with_a_wrong_one_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {cluster.token.read_text()}"}

    def jobs() -> list[Any]:
        return json.loads(http_ok("http://127.0.0.1:8265/api/jobs/", headers) or b"null")

    before = jobs()
    home = tmp_path / "home"  # no ~/.ray/auth_token
    home.mkdir()
    none = cluster.submit("no-token", "--wait-for-cluster", "0", env={**user_env(), "HOME": str(home)})
    out, _ = none.communicate(timeout=scaled(60))
    assert none.returncode == 2 and "requires a token (HTTP 401) and none was sent" in out, out
    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_hex(32))
    refused = cluster.submit("wrong-token", "--token-file", str(wrong), "--wait-for-cluster", "0")
    out, _ = refused.communicate(timeout=scaled(60))
    assert refused.returncode == 2 and "token" in out, out
    assert jobs() == before
    assert http_ok("http://127.0.0.1:8265/api/jobs/") is None  # the Jobs API itself answers no one without it


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_only_the_ports_compose_yaml_documents_are_published_and_only_on_loopback(cluster: Cluster) -> None:
    documented = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    listed = images.podman("ps", "--filter", f"label={LABEL}", "--format", "{{.Names}}", timeout=60).stdout.split()
    assert {container("ray-head"), container("ray-worker", 1), container("mlflow")} <= set(listed), listed
    for name in listed:
        service = re.fullmatch(rf"{PROJECT}_(.+)_\d+", name).group(1)  # type: ignore[union-attr]
        published = sorted(line for line in images.podman("port", name, timeout=60).stdout.splitlines() if line)
        # compose.yaml's "127.0.0.1:8265:8265" is podman's "8265/tcp -> 127.0.0.1:8265".
        ports = [p.rsplit(":", 1) for p in documented[service].get("ports", [])]
        assert published == sorted(f"{inside}/tcp -> {outside}" for outside, inside in ports), (name, published)
