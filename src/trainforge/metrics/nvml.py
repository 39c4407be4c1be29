"""The node's GPUs through NVML: one reading for both the per-node system metrics (``system.py``,
recorded by MLflow) and the Prometheus GPU gauges (``gpu.py``). Runs inside workers.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("trainforge.worker")

GB = 1e9


class Gpus:
    """The node's GPUs through NVML, or none when NVML does not initialise (no driver, no GPU)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except Exception as err:  # NVML absent or unusable: CPU-only node, stay quiet
            log.debug("NVML unavailable, no GPU metrics: %s", err)
            self.handles = []

    def sample(self) -> dict[str, float]:
        found: dict[str, float] = {}
        nvml = self.nvml
        readings = {
            "util_percent": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
            "memory_used_gb": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / GB,
            "temperature_c": lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            "power_w": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
        }
        for index, handle in enumerate(self.handles):
            for name, read in readings.items():
                try:
                    found[f"gpu{index}_{name}"] = float(read(handle))
                except Exception:  # a reading this GPU does not support (power on some boards)
                    continue
        return found

    def close(self) -> None:
        if self.handles:
            try:
                self.nvml.nvmlShutdown()
            except Exception as err:
                log.debug("nvmlShutdown: %s", err)
