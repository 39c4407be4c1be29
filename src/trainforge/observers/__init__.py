"""The driver-side consumers of a run's reports (observers), one module per sink."""
