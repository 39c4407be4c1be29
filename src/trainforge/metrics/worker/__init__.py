"""The worker half of Prometheus export: hooks that run inside Ray Train workers (``hook.py``: the
training gauges; ``comm.py``: the gradient all-reduce timer; ``gpu.py``: NVML gauges; ``system.py``:
the per-node sampler MLflow records) and the gauge holder they share (``export.py``)."""
