"""Prometheus metrics through Ray's own metrics pipeline (docs/monitoring.md).

Workers record ``ray.util.metrics`` gauges (``names.py`` defines every one) from a worker hook
(``hook.py``, registered in worker/hooks.py ``build_hooks``); the driver records worker-group
failures (``observer.py``, an observe.py observer that ``launch.train`` adds). Each Ray node's metrics
agent serves them with Ray's own node metrics; Prometheus finds the agents through Ray's service
discovery file, which trainforge writes itself for a local Ray (``session.py``).

The package also holds the per-node system sampler (``system.py``: CPU, memory, network, disk and
GPUs into the report, which MLflow records) and the one NVML reading (``nvml.py``) that it and the
GPU gauges share. Worker-side modules (hook, comm, gpu, system, nvml, export, names) import nothing
from the driver side; pyproject.toml's import contracts check it.
"""
