"""Facts about this machine that benchmarks and predictions print beside their figures."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, for the machine line every benchmark prints."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def device_name(use_gpu: bool) -> str:
    """The device a measurement runs on: the first CUDA GPU's name when asked for and present, else the CPU's."""
    if use_gpu:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    return cpu_model()
