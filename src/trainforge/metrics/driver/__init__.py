"""The driver half of Prometheus export: the observer that records worker-group failures and the
run's progress (``observer.py``), the service-discovery file of a local Ray (``session.py``), and
the PromQL name check of deploy/'s rules and dashboards (``promql.py``)."""
