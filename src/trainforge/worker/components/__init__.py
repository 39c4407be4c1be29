"""A worker's stateful components, each owning one piece of state under a name
(``base.py``: what a component is; ``worker/registry.py``: which exist, in restore order):
``training.py`` progress, schedule, scaler and RNG; ``weights.py`` the model and the optimizer;
``data.py`` the data source. Components of other modules: ``worker/sync.py`` (local SGD),
``worker/compression.py`` (PowerSGD), ``worker/ema.py`` (the weights' moving average)."""
