"""The suite's waits (tests/helpers/timing.py, faults.wait_until): a wait that runs out on a machine
that got busier after its slowdown was measured is stretched by the last minute's load, not failed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from tests.helpers import timing
from tests.helpers.faults import wait_until


@pytest.fixture
def measured_quiet(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The factor as measured on a quiet machine (1), no TRAINFORGE_TEST_SLOWDOWN."""
    monkeypatch.delenv(timing.ENV, raising=False)
    monkeypatch.setattr(timing, "slowdown", lambda: 1.0)
    return monkeypatch


def ready_after(seconds: float) -> Callable[[], bool]:
    ready_at = time.monotonic() + seconds
    return lambda: time.monotonic() >= ready_at


def test_a_wait_that_ran_out_while_the_machine_got_busy_is_stretched_by_the_load(
    measured_quiet: pytest.MonkeyPatch,
) -> None:
    cores = os.cpu_count() or 1
    measured_quiet.setattr(os, "getloadavg", lambda: (4.0 * cores, 1.0, 1.0))  # 4 runnable per core
    assert timing.load_factor() == 4.0 and timing.rescaled(0.1) == pytest.approx(0.4)
    assert wait_until(ready_after(0.2), 0.1, "the condition", interval_s=0.01)


def test_on_a_quiet_machine_the_wait_still_runs_out(measured_quiet: pytest.MonkeyPatch) -> None:
    measured_quiet.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert timing.load_factor() == 1.0
    with pytest.raises(TimeoutError, match="waiting for the condition"):
        wait_until(ready_after(5.0), 0.1, "the condition", interval_s=0.01)


def test_the_load_stretch_is_capped_and_a_given_factor_is_kept(measured_quiet: pytest.MonkeyPatch) -> None:
    measured_quiet.setattr(os, "getloadavg", lambda: (1000.0, 1.0, 1.0))
    assert timing.rescaled(1.0) == timing.MAX_MEASURED
    measured_quiet.setenv(timing.ENV, "2")
    measured_quiet.setattr(timing, "slowdown", lambda: 2.0)
    assert timing.rescaled(1.0) == 2.0  # TRAINFORGE_TEST_SLOWDOWN sets the factor: no stretch


def test_pytest_outside_the_project_environment_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run by a Python without the project (not the README's .venv), the suite stops at configure
    with one line naming what is missing, instead of a collection error per test file."""
    import importlib.util

    from tests import conftest

    assert conftest.missing_packages() == []  # this environment is the project's
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in {"torch", "ray"} else real(name))
    assert conftest.missing_packages() == ["torch", "ray"]
    with pytest.raises(pytest.UsageError, match=r"^torch, ray not importable by .*\.venv/bin/python -m pytest"):
        conftest.pytest_configure(None)  # type: ignore[arg-type]  # stops before it reads the config
