"""The driver-side consumers of a run's reports (observers), one module per sink.

``base.py``: the ``Observer`` interface, its firing order and the fan-out (``Observers``);
``registry.py``: the run's sinks in order (``build_observers``). Sinks: ``console.py`` (progress
on the terminal), ``metrics_log.py`` (metrics.jsonl), ``worker_log.py`` (workers.log),
``prometheus.py`` (the driver's gauges), ``tensorboard.py`` (event files), ``report.py`` (the run
report), ``mlflow.py`` (one MLflow run per job), ``tune.py`` (a search trial's reports to Tune,
added by the trial). The libraries they drive stay where they are: report/, tracking/, metrics/.
"""

from trainforge.observers.base import Observer, Observers, SinkSetup

__all__ = ["Observer", "Observers", "SinkSetup"]
