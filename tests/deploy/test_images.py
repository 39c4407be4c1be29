"""Dockerfile.cpu built for real (tests/deploy/images.py: podman, a base made from Debian's
packages) and run as the manifests and the compose file run it: UID 10001, a read-only root file
system, a tmpfs for /tmp.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deploy import images
from tests.helpers.timing import scaled

# Quiet 2-core machine, measured (docs/deploy.md): base 20 s, cold build 115 s, the quickstart 25 s.
BUILD_S = 600
RUN_S = 120


@pytest.fixture(scope="module")
def cpu_image() -> tuple[str, dict[str, object]]:
    why = images.missing_tools()
    if why is not None:
        pytest.skip(why)
    with images.exclusive():
        return images.cpu_image(timeout=scaled(BUILD_S))


def run_in(image: str, *command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
    return images.podman(
        "run", "--rm", "--read-only", "--tmpfs", "/tmp:rw,size=1g,mode=1777", "--shm-size", "1g",
        "--user", "10001:10001", "--env", "HOME=/tmp", *images.ulimits(), *flags, image, *command,
        timeout=scaled(RUN_S), check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_cpu_image_builds_on_a_debian_base_and_is_reused_when_its_inputs_match(
    cpu_image: tuple[str, dict[str, object]],
) -> None:
    tag, record = cpu_image
    print(f"cpu image {tag}: {record}")
    inspected = json.loads(images.podman("image", "inspect", tag, timeout=60).stdout)[0]
    assert inspected["Config"]["User"] == "10001:10001"
    assert inspected["Config"]["Labels"]["trainforge.test.inputs"] == tag
    assert 1e9 < inspected["Size"] < 4e9, inspected["Size"]  # torch's CPU build, not CUDA's libraries
    # The same inputs name the same image: a second look builds nothing.
    again, second = images.cpu_image(timeout=scaled(BUILD_S))
    assert again == tag and second["built"] is False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_image_runs_the_quickstart_as_uid_10001_on_a_read_only_root(
    cpu_image: tuple[str, dict[str, object]],
) -> None:
    tag, _ = cpu_image
    version = run_in(tag, "trainforge", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("trainforge 0.1.0 (torch 2.13.0+cpu, ray 2.60.0)"), version.stdout
    # Who runs, and that the root file system refuses writes (the tmpfs takes them).
    probe = run_in(tag, "sh", "-c", "id -u; id -g; touch /opt/trainforge/x 2>&1; touch /tmp/x && echo tmp-ok")
    assert probe.stdout.splitlines()[:2] == ["10001", "10001"], probe.stdout
    assert "Read-only file system" in probe.stdout and "tmp-ok" in probe.stdout, probe.stdout
    train = run_in(
        tag, "sh", "-c",
        "cd /tmp && trainforge train quickstart --set run.output_dir=/tmp/runs >/tmp/log 2>&1"
        " || { tail -n 40 /tmp/log; exit 1; }; cat /tmp/runs/quickstart/summary.json",
        env={"TRAINFORGE_SCALING__NUM_WORKERS": "1"},
    )  # fmt: skip
    assert train.returncode == 0, train.stdout + train.stderr
    summary = json.loads(train.stdout)
    assert summary["status"] == "finished", summary["status"]
    assert summary["num_workers"] == 1
    assert summary["final_metrics"]["val/accuracy"] >= 0.95, summary["final_metrics"]
