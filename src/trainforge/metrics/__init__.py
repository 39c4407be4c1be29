"""Prometheus metrics through Ray's own metrics pipeline (docs/monitoring.md).

``worker/``: hooks inside Ray Train workers record ``ray.util.metrics`` gauges (training figures,
gradient communication, GPUs) and sample each node (CPU, memory, network, disk, GPUs) for MLflow.
``driver/``: the driver records worker-group failures and the run's progress, and writes a local
Ray's service-discovery file. ``names.py`` defines every metric and ``nvml.py`` is the one NVML
reading; both halves use them. The worker half imports nothing of the driver's (pyproject.toml's
import contracts check it).
"""
