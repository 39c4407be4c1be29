"""How long the suite waits: every timeout is a base figure (what a quiet 2-core machine needs,
with margin) times one factor, ``slowdown()``, so that a loaded machine (a user's laptop, CI beside
other work) waits longer instead of failing.

The factor is ``TRAINFORGE_TEST_SLOWDOWN`` when set (a number >= 1), else measured once per test
process: the seconds a fresh Python takes to import torch here, over what it takes on the quiet
reference machine. That import is what every worker, driver and CLI process of the suite starts
with, so it scales with what the suite's waits are made of. The conftest also scales every test's
pytest-timeout by it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

ENV = "TRAINFORGE_TEST_SLOWDOWN"
# `python -c "import torch"` on the quiet reference machine (2 cores, docs/benchmarks.md): 1.0-1.3 s.
REFERENCE_IMPORT_S = 1.3
MAX_MEASURED = 8.0  # a measurement is one sample: never more than this from it alone


@functools.cache
def slowdown() -> float:
    """The factor every timeout of the suite is multiplied by (>= 1)."""
    given = os.environ.get(ENV)
    if given:
        try:
            factor = float(given)
        except ValueError:
            raise ValueError(f"{ENV}={given!r}: a number >= 1") from None
        if not factor >= 1:
            raise ValueError(f"{ENV}={given!r}: a number >= 1")
        return factor
    measured = torch_import_s()
    if measured is None:  # no torch in this interpreter: the tests' own imports say so, not this helper
        return 1.0
    return min(max(measured / REFERENCE_IMPORT_S, 1.0), MAX_MEASURED)


def torch_import_s() -> float | None:
    """Seconds a new Python process takes to start and import torch on this machine, now; None
    when this interpreter cannot import torch (pytest run outside the project's environment)."""
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return None
    return time.monotonic() - started


def scaled(seconds: float) -> float:
    """``seconds`` on the quiet reference machine, as long as this machine needs now."""
    return seconds * slowdown()
