"""Prometheus metrics through Ray's own metrics pipeline (docs/monitoring.md).

Workers record ``ray.util.metrics`` gauges (``names.py`` defines every one) from a worker hook
(``hook.py``, registered in worker/hooks.py ``build_hooks``); the driver records worker-group
failures (``observer.py``, an observe.py observer that ``api.fit`` adds). Each Ray node's metrics
agent serves them with Ray's own node metrics; Prometheus finds the agents through Ray's service
discovery file, which trainforge writes itself for a local Ray (``session.py``).

Worker-side modules (hook, comm, gpu, export, names) import nothing from the driver side.
"""
