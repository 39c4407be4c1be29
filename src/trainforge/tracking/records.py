"""What a run looks like to MLflow: params from the config, metric points from reports, tags.

Pure functions without MLflow imports: MLflow's limits (name characters, value lengths) are
applied here, so the background sender never has a record refused for its shape.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainforge.protocol import COORDINATES, Report, curve_points
from trainforge.redact import redact_config

# MLflow's own limits (mlflow.utils.validation); a longer value is refused by the server.
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
TRUNCATED = "...[truncated]"

# MLflow accepts letters, digits, '_', '-', '.', ' ', ':' and '/' in names (':' not on Windows).
_BAD_CHARS = re.compile(r"[^/\w.\- :]")

# (key, value, timestamp in ms, step): one metric point, in the shape MLflow's Metric takes.
Point = tuple[str, float, int, int]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``{"optim": {"lr": 0.1}}`` -> ``("optim.lr", 0.1)``; an empty mapping stays one entry."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def param_value(value: Any) -> str:
    """A config value as MLflow stores it: strings as they are, the rest as JSON (YAML spells them alike)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return clip(text, MAX_PARAM_VALUE_LENGTH)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying so at the end."""
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def config_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The flattened resolved config (``optim.lr``, ``scaling.num_workers``, ...) as MLflow params,
    credentials masked (``trainforge.redact``)."""
    return {sanitize_key(key): param_value(value) for key, value in flatten(redact_config(config))}


def sanitize_key(name: str) -> str:
    """A metric, param or tag name MLflow accepts: bad characters become '_', and the name must
    be a normalised relative path (no empty, '.' or '..' segments), at most 250 characters."""
    parts = [_BAD_CHARS.sub("_", part) for part in str(name).split("/") if part]
    parts = [part if part.strip(".") else part.replace(".", "_") for part in parts]
    clean = "/".join(parts) or "_"
    if len(clean) > MAX_KEY_LENGTH:  # keep names unique when cut: the tail becomes a hash
        digest = hashlib.sha1(clean.encode()).hexdigest()[:10]
        clean = f"{clean[: MAX_KEY_LENGTH - 11]}~{digest}"
    return clean


def metric_points(report: Report | Mapping[str, Any]) -> list[Point]:
    """Every number of a report (or of a mapping of figures by name) as MLflow points: one per log
    interval from the report's ``history`` (each at its own step and time), the rest at the
    report's step and time (``trainforge.protocol.curve_points``)."""
    points = []
    for record in curve_points(report):
        step = int(record.get("step", 0))
        unix = record.get("time/unix")
        stamp = int(float(unix if isinstance(unix, (int, float)) else time.time()) * 1000)
        for key, value in record.items():
            if key in COORDINATES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            points.append((sanitize_key(key), float(value), stamp, step))
    return points


def git_tags(cwd: Path) -> dict[str, str]:
    """The commit of the working directory's git checkout and whether it has uncommitted changes.

    The working directory is not trusted: its ``.git/config`` can name programs for git to run
    (``core.fsmonitor``, clean filters, hooks). ``_git`` neutralises every one that ``rev-parse``
    and ``status`` could start; a repository git refuses (another user's, without
    ``safe.directory``) gives no tags.
    """
    try:
        commit = _git(cwd, "rev-parse", "HEAD")
        dirty = _git(cwd, *_no_filters(cwd), "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"mlflow.source.git.commit": commit, "trainforge.git_dirty": "true" if dirty else "false"}


# Settings that make rev-parse or status run a program, overridden on the command line (which
# wins over every config file). --no-optional-locks: status does not rewrite the index, so no
# post-index-change hook either.
_GIT_SAFE = (
    "--no-optional-locks",
    *("-c", "core.fsmonitor=false"),
    *("-c", "core.hooksPath=/dev/null"),
    *("-c", "core.pager=cat"),
    *("-c", "core.untrackedCache=false"),
)
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat"}
_FILTER_KEY = re.compile(r"^filter\.(.+)\.(clean|smudge|process)$")


def _git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | _GIT_ENV
    done = subprocess.run(
        ["git", *_GIT_SAFE, *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True, env=env
    )
    return done.stdout.strip()


def _no_filters(cwd: Path) -> list[str]:
    """``-c filter.NAME.clean=`` (empty: no filter) for every filter driver the configs define:
    status runs a file's clean filter to compare it with the index."""
    try:
        listed = _git(cwd, "config", "--name-only", "--get-regexp", r"^filter\.")
    except subprocess.CalledProcessError:  # exit 1: no filter configured
        return []
    overrides = []
    for key in listed.splitlines():
        match = _FILTER_KEY.match(key.strip())
        if match:
            overrides += ["-c", f"filter.{match.group(1)}.{match.group(2)}="]
    return overrides


def version_tags() -> dict[str, str]:
    """Versions of the libraries that decide what a run computes."""
    tags = {}
    for package in ("trainforge", "torch", "ray", "mlflow"):
        try:
            tags[f"trainforge.version.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return tags


def scaling_tags(scaling: Mapping[str, Any]) -> dict[str, str]:
    """Workers and accelerator kind as the config asks for them."""
    workers = scaling.get("num_workers", 1)
    asked = f"{workers[0]}-{workers[1]}" if isinstance(workers, (list, tuple)) else str(workers)
    return {"trainforge.workers": asked, "trainforge.accelerator": "gpu" if scaling.get("use_gpu") else "cpu"}


def cluster_tags(resources: Mapping[str, float], nodes: int) -> dict[str, str]:
    """What the cluster offers (``ray.cluster_resources()``): nodes, CPUs, GPUs and their kinds."""
    tags = {
        "trainforge.cluster.nodes": str(nodes),
        "trainforge.cluster.cpus": f"{resources.get('CPU', 0):g}",
        "trainforge.cluster.gpus": f"{resources.get('GPU', 0):g}",
    }
    kinds = sorted(key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:"))
    if kinds:
        tags["trainforge.cluster.accelerator_types"] = ",".join(kinds)
    return tags


def clean_tags(tags: Mapping[str, str]) -> dict[str, str]:
    return {sanitize_key(key): clip(str(value), MAX_TAG_VALUE_LENGTH) for key, value in tags.items()}
