"""The driver half of Prometheus export: the service-discovery file of a local Ray (``session.py``)
and the PromQL name check of deploy/'s rules and dashboards (``promql.py``). The observer that
records worker-group failures and the run's progress is observers/prometheus.py."""
