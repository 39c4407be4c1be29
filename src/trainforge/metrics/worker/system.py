"""Per-node system metrics, sampled by the first worker of each node at every report.

Keys, added to that worker's report (``protocol.merge_reports`` collects every node's):
``system/<node>/cpu_percent, memory_used_gb, memory_percent, net_sent_mb_s, net_recv_mb_s,
disk_read_mb_s, disk_write_mb_s`` and, where NVML initialises, per GPU ``gpu<i>_util_percent,
gpu<i>_memory_used_gb, gpu<i>_temperature_c, gpu<i>_power_w``. ``<node>`` is the node's IP.

A sample reads kernel counters (psutil) and NVML: about a millisecond, no sleeps. CPU percent
and the I/O rates cover the time since the previous report. A worker hook (worker/hooks.py) whose
figures MLflow records (tracking/); the NVML reading is ``nvml.Gpus``, shared with the Prometheus
GPU gauges (``gpu.py``). Runs inside workers: imports nothing from the driver side.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import psutil

from trainforge.metrics.nvml import GB, Gpus
from trainforge.metrics.worker.place import local_rank

if TYPE_CHECKING:
    from trainforge.checkpoint.writer import SaveOutcome
    from trainforge.config import Config
    from trainforge.protocol import Report

log = logging.getLogger("trainforge.worker")

MB = 1e6


class Counters:
    """Cumulative I/O byte counters and the time they were read, for rates between reports."""

    def __init__(self) -> None:
        self.time = time.monotonic()
        net = psutil.net_io_counters()
        disk = psutil.disk_io_counters()
        self.values = {
            "net_sent_mb_s": float(net.bytes_sent) if net else None,
            "net_recv_mb_s": float(net.bytes_recv) if net else None,
            "disk_read_mb_s": float(disk.read_bytes) if disk else None,
            "disk_write_mb_s": float(disk.write_bytes) if disk else None,
        }

    def rates_since(self, earlier: Counters) -> dict[str, float]:
        elapsed = max(self.time - earlier.time, 1e-6)
        rates = {}
        for name, value in self.values.items():
            before = earlier.values.get(name)
            if value is not None and before is not None:
                rates[name] = max(value - before, 0.0) / MB / elapsed
        return rates


class SystemMetrics:
    """Worker hook that adds this node's ``system/<node>/...`` sample to the report."""

    def __init__(self, node: str) -> None:
        self.prefix = f"system/{node}/"
        self.gpus = Gpus()
        self.counters = Counters()
        psutil.cpu_percent(interval=None)  # starts the CPU window; the first report reads since here

    def sample(self) -> dict[str, float]:
        memory = psutil.virtual_memory()
        now = Counters()
        values = {
            "cpu_percent": float(psutil.cpu_percent(interval=None)),
            "memory_used_gb": (memory.total - memory.available) / GB,
            "memory_percent": float(memory.percent),
            **now.rates_since(self.counters),
            **self.gpus.sample(),
        }
        self.counters = now
        return {f"{self.prefix}{name}": value for name, value in values.items()}

    def on_report(self, report: Report, local: dict[str, float]) -> None:
        report.figures.update(self.sample())

    def on_save(self, outcome: SaveOutcome) -> None:
        pass

    def close(self) -> None:
        self.gpus.close()


def system_hooks(config: Config) -> list[SystemMetrics]:
    """A SystemMetrics hook on the first worker of each node, when tracking wants system metrics."""
    import ray

    if not (config.tracking.enabled and config.tracking.system_metrics):
        return []
    if local_rank() != 0:
        return []
    return [SystemMetrics(ray.util.get_node_ip_address())]
