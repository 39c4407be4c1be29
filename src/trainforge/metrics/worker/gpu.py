"""The node's GPUs (NVML) as Prometheus gauges, sampled by the first worker of each node.

The NVML reading itself is ``nvml.Gpus`` (shared with the system metrics MLflow records);
this module only maps its readings to metric names and units. Without NVML (CPU-only node, no
driver) there are no GPUs and nothing is recorded.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from trainforge.metrics.names import GPU
from trainforge.metrics.nvml import Gpus
from trainforge.metrics.worker.export import Gauges

# Gpus.sample() key suffix -> (metric, factor to the metric's unit)
READINGS = {
    "util_percent": ("trainforge_gpu_utilization_percent", 1.0),
    "memory_used_gb": ("trainforge_gpu_memory_used_bytes", 1e9),
    "temperature_c": ("trainforge_gpu_temperature_celsius", 1.0),
    "power_w": ("trainforge_gpu_power_watts", 1.0),
}
KEY = re.compile(r"gpu(\d+)_(.+)")


def gpu_readings(sample: Mapping[str, float]) -> Iterator[tuple[str, float, str]]:
    """(metric, value in the metric's unit, GPU index) for each reading of ``Gpus.sample()``."""
    for key, value in sample.items():
        match = KEY.fullmatch(key)
        if match and match.group(2) in READINGS:
            name, factor = READINGS[match.group(2)]
            yield name, value * factor, match.group(1)


class NodeGpus:
    """Records every GPU NVML sees on this node (all of them, not just this worker's)."""

    def __init__(self, constant: Mapping[str, str]) -> None:
        self.gpus = Gpus()
        self.gauges = Gauges(GPU, constant) if self.gpus.handles else None

    def record(self) -> None:
        if self.gauges is None:
            return
        for name, value, gpu in gpu_readings(self.gpus.sample()):
            self.gauges.set(name, value, gpu=gpu)

    def close(self) -> None:
        self.gpus.close()
