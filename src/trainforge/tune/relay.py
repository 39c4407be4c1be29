"""Tune callbacks that survive ``Tuner.restore``.

Tune pickles its callbacks into the experiment (``tuner.pkl``) and, when a search is restored,
uses the pickled copies, not the ones the new driver made. So Tune holds a ``Relay``, which pickles
as a name only and forwards each hook to the listeners registered under that name in the current
process (the live table, the placement group releaser). A listener implements the hooks it wants:
``setup()``, ``on_trial_start(trial)``, ``on_trial_result(trial, result)``,
``on_trial_complete(trial)``, ``on_trial_error(trial)``, ``on_step_end()``, ``close()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ray.tune import Callback

_LISTENERS: dict[str, list[Any]] = {}


class Relay(Callback):
    """The Tune callback: forwards hooks to the listeners registered under ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _call(self, hook: str, *args: Any) -> None:
        for listener in _LISTENERS.get(self.name, []):
            method = getattr(listener, hook, None)
            if method is not None:
                method(*args)

    def setup(
        self, stop: Any = None, num_samples: int | None = None, total_num_samples: int | None = None, **info: Any
    ) -> None:
        self._call("setup")

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        self._call("on_step_end")

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._call("on_trial_start", trial)

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        self._call("on_trial_result", trial, result)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._call("on_trial_complete", trial)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._call("on_trial_error", trial)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self._call("close")


@contextmanager
def relayed(name: str, *listeners: Any) -> Iterator[Relay]:
    """Register listeners under ``name`` for the block; the Relay to hand to Tune."""
    _LISTENERS[name] = list(listeners)
    try:
        yield Relay(name)
    finally:
        for listener in _LISTENERS.pop(name, []):
            close = getattr(listener, "close", None)
            if close is not None:
                close()
