"""How long the suite waits: every timeout is a base figure (what a quiet 2-core machine needs,
with margin) times one factor, ``slowdown()``, so that a loaded machine (a user's laptop, CI beside
other work) waits longer instead of failing.

The factor is ``TRAINFORGE_TEST_SLOWDOWN`` when set (a number >= 1), else measured once per test
process: the seconds a fresh Python takes to import torch here, over what it takes on the quiet
reference machine. That import is what every worker, driver and CLI process of the suite starts
with, so it scales with what the suite's waits are made of. The conftest also scales every test's
pytest-timeout by it. A wait that runs out (``faults.wait_until``) asks once more with the last
minute's load (``rescaled``): the machine may have got busier since the factor was measured.
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


def load_factor() -> float:
    """How much busier the machine has been over the last minute than one runnable process per
    core: the 1-minute load average over the cores (>= 1). A process gets about cores/load of a
    core when more want one, so the wait for it to do something stretches by about this much."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on this platform
        return 1.0
    return max(load / (os.cpu_count() or 1), 1.0)


def rescaled(seconds: float) -> float:
    """``seconds`` on the quiet reference machine, for a wait that has run out: the factor measured
    at the start, or the last minute's load where the machine got busier since (capped as a measured
    factor is), unless ``TRAINFORGE_TEST_SLOWDOWN`` fixes it. Load that arrives after the
    measurement (another job starting beside the suite) then stretches the wait instead of failing it."""
    if os.environ.get(ENV):
        return scaled(seconds)
    return seconds * max(slowdown(), min(load_factor(), MAX_MEASURED))
