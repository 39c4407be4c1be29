"""What runs on the driver: a run (``run.py``: config checks, the TorchTrainer, its outcome), its
Ray (``ray_session.py``: a cluster or a local Ray on loopback), the mailbox the events of the
workers and the controller arrive in and the pump that hands them to the observers (``events.py``;
the observers themselves are trainforge.observers), the run's record (``summary.py``) and bill
(``cost.py``), the run lock (``runlock.py``), and Ray jobs (``jobs.py``, a submitted run's
secrets: ``job_secrets.py``).

The driver never touches the run's tensors; it talks to the workers through ``trainforge.protocol``.
"""
