"""What a Ray session needs for Prometheus: ``ray.init`` options and service discovery.

On a Ray cluster the dashboard process on the head node writes
``<session dir>/prom_metrics_service_discovery.json`` (every node's metrics agent, as a file_sd
target list) and links ``<temp dir>/prom_metrics_service_discovery.json`` to it; the shipped
Prometheus config reads that link. trainforge starts its local Ray with ``include_dashboard=False``
(the full dashboard adds 11 processes and about 0.9 GB of memory), and without the dashboard
nobody writes the file, although every node's metrics agent still serves ``/metrics``. So for a
local Ray trainforge writes the same file, in the same format and place, and empties it when the
session ends so that Prometheus does not keep scraping ports that are gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from trainforge.config import MetricsConfig
from trainforge.errors import ConfigError

log = logging.getLogger("trainforge")

DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # Ray's name (ray_constants)


def local_ray_options(metrics: MetricsConfig) -> dict[str, Any]:
    """Extra ``ray.init`` options for a local Ray: how often processes push metrics to the agent."""
    if not metrics.enabled or metrics.export_interval_s is None:
        return {}
    return {"_system_config": {"metrics_report_interval_ms": round(metrics.export_interval_s * 1000)}}


def check_cluster_options(metrics: MetricsConfig) -> None:
    """Before connecting to a cluster: its processes took their export interval at ``ray start``."""
    if metrics.export_interval_s is not None:
        raise ConfigError(
            "metrics.export_interval_s applies to a local Ray only; for a cluster set "
            "RAY_metrics_report_interval_ms in the environment of `ray start` on every node"
        )


def node_targets() -> list[str]:
    """``host:port`` of every live node's metrics agent."""
    targets = []
    for node in ray.nodes():
        if node.get("Alive"):
            host = str(node["NodeManagerAddress"])
            host = f"[{host}]" if ":" in host else host  # IPv6
            targets.append(f"{host}:{node['MetricsExportPort']}")
    return targets


def write_targets(path: Path, targets: list[str]) -> None:
    """Atomically, as Prometheus may read the file at any moment."""
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    os.replace(partial, path)


def link(target: Path, at: Path) -> None:
    """Point ``at`` to ``target``, replacing whatever is there (another session's link)."""
    partial = at.with_name(f".{at.name}.{os.getpid()}.tmp")
    partial.unlink(missing_ok=True)
    partial.symlink_to(target)
    os.replace(partial, at)


@contextlib.contextmanager
def publish_local_targets(metrics: MetricsConfig) -> Iterator[Path | None]:
    """Write the discovery file for the local Ray this process started; yields its path."""
    if not metrics.enabled:
        yield None
        return
    try:
        node = ray._private.worker.global_worker.node
        assert node is not None, "called after ray.init"
        session_file = Path(node.get_session_dir_path()) / DISCOVERY_FILE
        write_targets(session_file, node_targets())
        link(session_file, Path(node.get_temp_dir_path()) / DISCOVERY_FILE)
    except (OSError, AttributeError, KeyError) as err:  # metrics are an observer: never stop the run
        log.warning("could not write Prometheus' service discovery file: %s", err)
        yield None
        return
    try:
        yield session_file
    finally:
        try:
            write_targets(session_file, [])
        except OSError as err:
            log.debug("could not empty %s: %s", session_file, err)
