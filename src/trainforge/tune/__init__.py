"""Hyperparameter search with Ray Tune: every trial is a complete trainforge run.

``space`` parses and checks search space files, ``schedulers`` builds Tune's searchers and
schedulers from the ``tune`` config section, ``trial`` is the function each Tune trial runs,
``runner`` assembles the Tuner on the driver, ``summary``/``plots``/``table`` show and record it.

``trainforge.tune(config, space)`` is both this package and the search function (DESIGN's Python
contract): the package's module object is made callable and forwards to ``search.search`` (which
``trainforge.api`` exports as ``tune``), so ``trainforge.tune(...)`` works however the package was
imported first.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainforge.tune.search import TuneResult


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> TuneResult:
        # Here, not at the top: the package stays light for what imports only space files or schedulers.
        from trainforge.tune.search import search

        return search(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
