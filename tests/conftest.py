"""Shared fixtures: one local Ray per test module (never per test), gloo workers, 1 thread each."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A 4-logical-CPU Ray for the whole module; workers import tests.* from the repo root."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()
