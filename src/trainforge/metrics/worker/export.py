"""Recording through Ray's metrics pipeline: ``ray.util.metrics`` gauges, buffered in-process.

A ``set`` stores the value in the process's Ray core worker; a core-worker thread pushes the
latest values to the node's metrics agent every ``metrics_report_interval_ms`` (Ray's default
10 s), and Prometheus scrapes the agent. Nothing here waits on the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from trainforge.metrics.names import MetricDef


class Gauges:
    """One Ray gauge per definition, with this process's constant labels (run, rank, ...) preset."""

    def __init__(self, defs: Iterable[MetricDef], constant: Mapping[str, str]) -> None:
        from ray.util.metrics import Gauge

        self._gauges = {}
        for spec in defs:
            gauge = Gauge(spec.name, spec.help, tag_keys=spec.labels)
            gauge.set_default_tags({key: value for key, value in constant.items() if key in spec.labels})
            self._gauges[spec.name] = gauge

    def set(self, name: str, value: float, **labels: str) -> None:
        """``labels`` are the per-sample ones (phase, gpu, reason); the constant ones are preset."""
        self._gauges[name].set(float(value), tags=labels or None)  # type: ignore[arg-type]  # None: preset only
