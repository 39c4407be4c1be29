"""Container images built and run for real: Debian's podman (with runc), a base image made from
Debian's packages by mmdebstrap (public image registries are out of reach here), and
``Dockerfile.cpu`` built on it with pip set up as this machine's pip is.

Both images are kept between test runs under tags that name a hash of their inputs: the base's
package list; the Dockerfile, the constraints, trainforge's sources and the base. A run whose
inputs did not change reuses them without building; one whose sources changed rebuilds on
podman's layer cache (the dependency layer stays), and drops the images older inputs left.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from tests.deploy.tools import ROOT

# crun refuses this machine's hybrid cgroups; runc runs.
PODMAN = ("podman", "--runtime", "runc")
BASE_REPO = "localhost/trainforge-test-base"
IMAGE_REPO = "localhost/trainforge-test"
# What Dockerfile.cpu asks of its base: Python 3.11 with venv, TLS roots, groupadd/useradd (minbase).
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
SUITE = "bookworm"
# The build context .dockerignore lets in, and the Dockerfile.
IMAGE_INPUTS = ("Dockerfile.cpu", "deploy/docker/constraints.txt", "pyproject.toml", "README.md", "src")
# pip's settings that say where packages come from: passed to the build as the Dockerfile's
# PIP_* arguments, local paths among them mounted read-only at the same place.
PIP_SETTINGS = ("index-url", "extra-index-url", "find-links", "cert")
LOCK = Path.home() / ".cache" / "trainforge-tests" / "podman.lock"


def missing_tools() -> str | None:
    """Why containers cannot be built and run here, or None when they can."""
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (.ci/run installs Debian's podman, runc and mmdebstrap)"
    info = subprocess.run([*PODMAN, "info", "--format", "json"], capture_output=True, text=True, timeout=120)
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[-300:]}"
    return None


def ulimits() -> list[str]:
    """``--ulimit`` flags at the machine's own limits: podman's defaults are above them here and
    cannot be raised, and runc refuses an nproc above the kernel's pid_max."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    if nproc == resource.RLIM_INFINITY or nproc > pid_max:
        nproc = pid_max
    if nofile == resource.RLIM_INFINITY:
        nofile = 65536
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def podman(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        output = done.stdout[-3000:] + done.stderr[-3000:]
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{output}")
    return done


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """One build at a time on this machine (xdist workers, other sessions)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def digest(paths: list[Path], *extra: str) -> str:
    h = hashlib.sha256()
    for item in extra:
        h.update(item.encode() + b"\0")
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def image_id(tag: str) -> str | None:
    found = podman("image", "inspect", "--format", "{{.Id}}", tag, timeout=60, check=False)
    return found.stdout.strip() if found.returncode == 0 else None


def drop_other_tags(repo: str, keep: str, prefix: str = "") -> None:
    """Untag what older inputs left (the layers they share with ``keep`` stay)."""
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", repo, timeout=60).stdout.split()
    for tag in listed:
        if tag != keep and tag.split(":")[-1].startswith(prefix):
            podman("rmi", tag, timeout=120, check=False)


def base_image(timeout: float) -> str:
    """A Debian bookworm minbase with ``BASE_PACKAGES``, made by mmdebstrap from Debian's archive
    (the mirrors apt uses here) and imported; made once per machine."""
    tag = f"{BASE_REPO}:{SUITE}-{digest([], SUITE, *BASE_PACKAGES)}"
    if image_id(tag) is None:
        with tempfile.TemporaryDirectory(prefix="trainforge-rootfs-", dir="/var/tmp") as work:
            rootfs = Path(work) / "rootfs.tar"
            made = subprocess.run(
                ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs)],
                capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
            assert made.returncode == 0, f"mmdebstrap failed:\n{made.stderr[-3000:]}"
            podman("import", "--change", "CMD=/bin/bash", str(rootfs), tag, timeout=timeout)
        drop_other_tags(BASE_REPO, tag)
    return tag


def host_pip_settings() -> dict[str, str]:
    """pip's source settings on this machine (config files, then PIP_* variables), by option."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    found: dict[str, str] = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if option in PIP_SETTINGS:
            found[option] = value.strip().strip("'\"")  # :env: entries come last and win
    return found


def pip_build_flags() -> list[str]:
    """The build arguments and read-only mounts that let pip inside the build reach packages
    the way pip does here: a local mirror or wheel directory, a proxy's CA."""
    flags: list[str] = []
    mounts: set[str] = set()
    for option, value in host_pip_settings().items():
        flags += ["--build-arg", f"PIP_{option.upper().replace('-', '_')}={value}"]
        for item in value.split():
            path = urlparse(item).path if item.startswith("file://") else item
            if path.startswith("/") and Path(path).exists():
                mounts.add(str(Path(path).parent if path.endswith("/simple") else path))
    for path in sorted(mounts):
        flags += ["--volume", f"{path}:{path}:ro"]
    settings = host_pip_settings()
    # torch's CPU build: from the mirror when pip finds it there, else from PyTorch's index.
    if "find-links" in settings or "index-url" in settings:
        flags += ["--build-arg", f"TORCH_INDEX={settings.get('index-url', 'https://pypi.org/simple')}"]
    return flags


def built_image(
    name: str, dockerfile: Path, inputs: list[Path], timeout: float, *build_args: str
) -> tuple[str, dict[str, object]]:
    """``dockerfile`` (its directory the context) built on ``base_image()`` as
    ``localhost/trainforge-test:NAME-HASH``, or the image already tagged so; and what the build took
    (``built``: False when reused; ``build_s``; ``size``)."""
    base = base_image(timeout)
    flags = [*pip_build_flags(), "--build-arg", f"BASE_IMAGE={base}", *build_args]
    tag = f"{IMAGE_REPO}:{name}-{digest([dockerfile, *inputs], image_id(base) or base, *flags)}"
    record: dict[str, object] = {"tag": tag, "built": False}
    if image_id(tag) is None:
        context = ROOT if dockerfile.parent == ROOT else dockerfile.parent
        started = time.monotonic()
        podman(
            "build", "--network", "host", *ulimits(), *flags,
            "--label", f"trainforge.test.inputs={tag}", "--file", str(dockerfile), "--tag", tag, str(context),
            timeout=timeout,
        )  # fmt: skip
        record.update(built=True, build_s=round(time.monotonic() - started, 1))
        drop_other_tags(IMAGE_REPO, tag, prefix=f"{name}-")
    inspected = json.loads(podman("image", "inspect", tag, timeout=60).stdout)[0]
    record["size"] = inspected["Size"]
    return tag, record


def cpu_image(timeout: float) -> tuple[str, dict[str, object]]:
    """``Dockerfile.cpu`` built on the Debian base with pip's sources as here."""
    return built_image("cpu", ROOT / "Dockerfile.cpu", [ROOT / p for p in IMAGE_INPUTS[1:]], timeout)


COMPOSE_IMAGES = Path(__file__).resolve().parent / "compose"
COMPOSE = ROOT / "deploy" / "compose"


def compose_images(timeout: float) -> dict[str, str]:
    """Every image the laptop cluster runs here (compose.override.yaml's variables), built or reused."""
    own = COMPOSE_IMAGES
    moto = f"MOTO_VERSION={importlib.metadata.version('moto')}"
    return {
        "TRAINFORGE_TEST_IMAGE": cpu_image(timeout)[0],
        "TRAINFORGE_TEST_MLFLOW_IMAGE": built_image("mlflow", COMPOSE / "mlflow" / "Dockerfile", [], timeout)[0],
        "TRAINFORGE_TEST_POSTGRES_IMAGE": built_image(
            "postgres", own / "postgres.Containerfile", [own / "postgres-entrypoint.sh"], timeout
        )[0],
        "TRAINFORGE_TEST_PROMETHEUS_IMAGE": built_image("prometheus", own / "prometheus.Containerfile", [], timeout)[0],
        "TRAINFORGE_TEST_S3_IMAGE": built_image("s3", own / "s3.Containerfile", [], timeout, "--build-arg", moto)[0],
    }
