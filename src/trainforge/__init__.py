"""trainforge: distributed PyTorch training on Ray Train."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Config", "RunResult", "TrainforgeError", "TuneResult", "fit", "load_config", "tune"]

if TYPE_CHECKING:
    from trainforge.api import RunResult, TuneResult, fit, tune
    from trainforge.config import Config, load_config
    from trainforge.errors import TrainforgeError


def __getattr__(name: str) -> Any:
    # Lazy: `import trainforge` stays cheap (Ray and torch load on first use).
    if name in {"fit", "RunResult", "TuneResult"}:
        from trainforge import api

        return getattr(api, name)
    if name == "tune":
        # The tune package, callable as the search function (see trainforge/tune/__init__.py).
        import importlib

        return importlib.import_module("trainforge.tune")
    if name in {"Config", "load_config"}:
        from trainforge import config

        return getattr(config, name)
    if name == "TrainforgeError":
        from trainforge.errors import TrainforgeError

        return TrainforgeError
    raise AttributeError(name)
