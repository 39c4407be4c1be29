"""The container images (Dockerfile, Dockerfile.cpu, the compose MLflow image) and the laptop
cluster (deploy/compose) checked statically; test_images.py and test_compose.py build and start
them for real with podman. checkov covers both the Dockerfiles and the rendered Kubernetes objects
(one run).
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from tests.deploy.tools import DOCKERFILES, ROOT, gauges_outlive_a_scrape, load_generator, normalise_relabel
from tests.helpers.cli import trainforge_command, trainforge_on_path
from trainforge.config import load_config

COMPOSE = ROOT / "deploy" / "compose"
PINNED_IMAGE = re.compile(r"[\w./-]+:[\w.-]*\d[\w.-]*")


def stages(dockerfile: str) -> list[tuple[str, str | None]]:
    """(image, stage name) of every FROM, with ARG defaults substituted (defaults may name
    earlier arguments)."""
    text = (ROOT / dockerfile).read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    found = []
    for image, name in re.findall(r"^FROM (\S+)(?: AS (\S+))?", text, re.M):
        while "${" in image:
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        found.append((image, name))
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfiles_pin_their_base_images_and_run_as_a_non_root_user(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    for image, _ in stages(dockerfile):
        assert PINNED_IMAGE.fullmatch(image) and not image.endswith(":latest"), image
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] == "10001:10001", users
    assert re.findall(r"\bpip install [^\n]*\"(?:[\w-]+)\"", text) == [], "every pip requirement names its version"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_trainforge_images_build_a_wheel_then_install_it_with_the_pinned_set(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    built = stages(dockerfile)
    assert [name for _, name in built] == ["build", "runtime"]
    assert built[1][0].startswith("nvidia/cuda:" if dockerfile == "Dockerfile" else "python:")
    assert "pip wheel" in text and "COPY --from=build /wheels" in text
    assert "-c /tmp/constraints.txt /tmp/wheels/trainforge-*.whl" in text
    assert re.search(r'"torch==2\.13\.0(\+cpu)?"', text)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_trainforge_images_take_their_bases_and_pips_sources_as_build_arguments(dockerfile: str) -> None:
    """A mirror's base image and package index, as the image tests build with
    (tests/deploy/images.py); the defaults are the public images users pull."""
    text = (ROOT / dockerfile).read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(re.fullmatch(r"\$\{\w+_IMAGE\}", image) for image in froms), froms
    pip_args = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"}
    declared = [set(line.split()[1:]) for line in re.findall(r"^ARG [^\n]+", text, re.M)]
    assert sum(pip_args <= names for names in declared) == 2, "both stages pass pip's sources through"
    assert '--index-url "${TORCH_INDEX}"' in text


def test_the_constraints_pin_every_runtime_dependency_within_pyprojects_ranges() -> None:
    lock = load_generator(ROOT / "deploy" / "docker" / "lock.py")
    pins = dict(line.split("==") for line in lock.OUTPUT.read_text().splitlines() if not line.startswith("#"))
    # pyproject.toml's [project] dependencies, as the editable install recorded them.
    runtime = [Requirement(t) for t in importlib.metadata.requires("trainforge") or [] if "extra ==" not in t]
    assert len(runtime) >= 10
    for req in runtime:
        name = lock.canonical(req.name)
        if lock.PER_IMAGE.match(name):
            continue
        assert name in pins, f"{name} is not in constraints.txt: run `.venv/bin/python deploy/docker/lock.py`"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"
    assert not any(lock.PER_IMAGE.match(name) for name in pins)


def test_the_build_context_holds_only_what_the_images_copy() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1 :][:4] == [
        "!pyproject.toml", "!README.md", "!src/", "!deploy/docker/constraints.txt",
    ]  # fmt: skip


def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def compose_schema() -> jsonschema.protocols.Validator:
    """The Compose Specification's JSON schema as check-jsonschema (a dev dependency) vendors it
    from compose-spec/compose-spec (schema/compose-spec.json)."""
    text = (importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_the_compose_file_validates_against_the_compose_specification() -> None:
    validator = compose_schema()
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(compose())]
    assert not errors, "\n".join(errors)
    broken = compose()
    broken["services"]["ray-head"]["healtcheck"] = broken["services"]["ray-head"].pop("healthcheck")
    assert not validator.is_valid(broken)


def test_the_laptop_cluster_has_every_service_healthy_pinned_and_on_loopback() -> None:
    services = compose()["services"]
    assert {"ray-head", "ray-worker", "mlflow", "postgres", "prometheus", "grafana", "minio"} <= set(services)
    assert services["ray-worker"]["deploy"]["replicas"] == 2
    for name, service in services.items():
        assert PINNED_IMAGE.fullmatch(service["image"]) and not service["image"].endswith(":latest"), name
        if service.get("restart") != "no":  # the one-shot bucket creator exits
            test = service["healthcheck"]["test"]
            # The replicated worker's is the shell form (podman-compose 1.0.3 consumes a CMD list).
            replicated = service.get("deploy", {}).get("replicas", 1) > 1
            assert (isinstance(test, str) and replicated) or test[0] == "CMD", name
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for dependency in service.get("depends_on", {}).values():
            assert dependency["condition"] in ("service_healthy", "service_completed_successfully"), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name} mounts {source}, which does not exist"


def test_secrets_come_from_an_ignored_env_file_with_a_placeholder_template() -> None:
    text = (COMPOSE / "compose.yaml").read_text()
    used = set(re.findall(r"\$\{(\w+)", text)) | {
        s["environment"] for s in compose()["secrets"].values() if "environment" in s
    }
    example = dict(
        line.split("=", 1)
        for line in (COMPOSE / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert used == set(example), f"compose uses {sorted(used)}, .env.example lists {sorted(example)}"
    secret_names = {"RAY_AUTH_TOKEN", "POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}
    assert all(example[name].startswith("replace-with-") for name in secret_names)
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/compose/.env"], cwd=ROOT, timeout=30)
        assert ignored.returncode == 0, "deploy/compose/.env must be git-ignored"


def test_the_laptop_prometheus_loads_the_project_rules_and_relabels_like_the_shipped_config(tmp_path: Path) -> None:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    shipped = yaml.safe_load((ROOT / "deploy/monitoring/prometheus/prometheus.yml").read_text())
    relabel = [normalise_relabel(r) for r in config["scrape_configs"][0]["metric_relabel_configs"]]
    assert relabel == [normalise_relabel(r) for r in shipped["scrape_configs"][0]["metric_relabel_configs"]]
    prometheus = compose()["services"]["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "../monitoring/rules:/etc/prometheus/rules:ro" in prometheus["volumes"]
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (.ci/run installs Debian's)")
    # The container's layout: the config with the project's rules beside it.
    shutil.copyfile(COMPOSE / "prometheus.yml", tmp_path / "prometheus.yml")
    (tmp_path / "rules").symlink_to(ROOT / "deploy/monitoring/rules")
    checked = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 2 rule files found" in checked.stdout + checked.stderr


def test_the_laptop_prometheus_scrapes_every_ray_gauge_before_the_agent_drops_it() -> None:
    """A run's ranks live a few seconds in the laptop cluster's workers (test_compose.py's: about
    15 s); their gauges stay on the agent two export intervals after the last push. The ray job's
    scrape comes within that, so each rank is scraped however short its process."""
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    interval = job.get("scrape_interval", config["global"]["scrape_interval"])
    for service in ("ray-head", "ray-worker"):
        export_ms = compose()["services"][service]["environment"].get("RAY_metrics_report_interval_ms")
        assert gauges_outlive_a_scrape(interval, export_ms), (service, interval, export_ms)


def test_grafana_is_provisioned_with_the_project_dashboards() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    provisioning = ROOT / "deploy/monitoring/grafana/provisioning"
    provider = yaml.safe_load((provisioning / "dashboards/trainforge.yml").read_text())
    assert mounts["../monitoring/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["../monitoring/grafana/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"
    assert mounts["../monitoring/grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    assert grafana["environment"]["PROMETHEUS_URL"] == "http://prometheus:9090"


def test_the_laptop_run_resolves_with_the_cluster_environment() -> None:
    head = compose()["x-ray-node"]["environment"]
    env = {k: str(v) for k, v in head.items() if k.startswith("TRAINFORGE_")}
    config = load_config(COMPOSE / "run.yaml", env=env)
    assert config.checkpoint.storage_path.startswith("s3://checkpoints/")
    assert config.tracking.uri == "http://mlflow:5000"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_checkov_passes_on_the_manifests_pod_templates_and_dockerfiles(checkov_reports: list[dict[str, Any]]) -> None:
    by_type = {r["check_type"]: r for r in checkov_reports}
    assert set(by_type) == {"kubernetes", "dockerfile"}, set(by_type)
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
        for r in checkov_reports
        for c in r["results"]["failed_checks"]
    ]
    assert not failed, "checkov failed:\n" + "\n".join(failed)
    # It read what it was meant to: every Dockerfile and every pod template as a Pod.
    passed = [c for r in checkov_reports for c in r["results"]["passed_checks"]]
    assert {c["file_path"] for c in passed if c["check_id"] == "CKV_DOCKER_3"} == {f"/docker/{d}" for d in DOCKERFILES}
    pods = {c["resource"] for c in passed if c["check_id"] == "CKV_K8S_20" and c["resource"].startswith("Pod.")}
    assert len(pods) == 6, pods  # head, worker group and submitter of each overlay


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_checkov_skip_is_justified_inline(checkov_reports: list[dict[str, Any]]) -> None:
    skipped = [c for r in checkov_reports for c in r["results"]["skipped_checks"]]
    assert skipped, "expected the documented skips (image digests, the head's token, the submitter's probes)"
    for check in skipped:
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason.split()) >= 8, f"{check['check_id']} on {check['resource']} is skipped without a reason"


def test_the_ray_containers_run_with_tls_from_a_certificate_they_sign_at_start(tmp_path: Path) -> None:
    """Each Ray service signs a certificate for its own address (the CA from the git-ignored
    deploy/compose/tls, mounted as secrets) before `ray start`, with Ray's TLS variables naming it;
    the signing half of the head's command, run here with its paths moved under tmp_path, makes
    a certificate the CA signed for this machine's address."""
    from cryptography import x509

    document = compose()
    env = document["x-ray-node"]["environment"]
    assert env["RAY_USE_TLS"] == "1"
    assert {env[n] for n in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")} == {
        "/tmp/tls/node.crt", "/tmp/tls/node.key", "/tmp/tls/ca.crt"
    }  # fmt: skip
    secrets = {s["source"]: s["target"] for s in document["x-ray-node"]["secrets"] if isinstance(s, dict)}
    assert secrets == {"ray_tls_ca_cert": "/run/secrets/ray-ca/ca.crt", "ray_tls_ca_key": "/run/secrets/ray-ca/ca.key"}
    assert document["secrets"]["ray_tls_ca_key"] == {"file": "./tls/ca.key"}
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/compose/tls/ca.key"], cwd=ROOT, timeout=30)
    assert ignored.returncode == 0, "deploy/compose/tls must be git-ignored"
    for name in ("ray-head", "ray-worker"):
        sign, start = document["services"][name]["command"][-1].split(" && exec ")
        assert start.startswith("ray start ") and "--ca-from /run/secrets/ray-ca" in sign, name
    ca = tmp_path / "ca"
    subprocess.run([*trainforge_command(), "certs", "create", str(ca)], check=True, capture_output=True, timeout=120)
    sign = document["services"]["ray-head"]["command"][-1].split(" && exec ")[0]
    sign = sign.replace("/run/secrets/ray-ca", str(ca)).replace("/tmp/tls", str(tmp_path / "tls"))
    path = f"{trainforge_on_path(tmp_path / 'bin')}:/usr/bin:/bin"
    done = subprocess.run(["sh", "-c", sign], env={"PATH": path}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    node = x509.load_pem_x509_certificate((tmp_path / "tls" / "node.crt").read_bytes())
    node.verify_directly_issued_by(x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes()))
    addresses = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    own = subprocess.run(["hostname", "-i"], capture_output=True, text=True, timeout=30).stdout.split()[0]
    assert own in [str(ip) for ip in addresses.get_values_for_type(x509.IPAddress)]
