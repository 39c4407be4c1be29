"""Which runs a warm worker group takes, what makes two runs' groups interchangeable, and what a
warm worker resets between runs (driver/warm.py, worker/warm.py), without Ray."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.runs import tiny_run
from trainforge.config import validate
from trainforge.driver.warm import Shape, why_not
from trainforge.worker.warm import reset


def config_of(tmp_path: Path, **sections: Any) -> Any:
    return validate(tiny_run(tmp_path, **sections))


@pytest.mark.parametrize(
    ("sections", "reason"),
    [
        ({"scaling": {"num_workers": [1, 2]}}, "scaling.num_workers is elastic"),
        ({"scaling": {"use_gpu": True}}, "scaling.use_gpu"),
        ({"parallel": {"strategy": "fsdp"}}, "parallel.strategy fsdp"),
        ({"scaling": {"num_workers": 2}, "parallel": {"tensor_parallel": 2}}, "parallel.tensor_parallel"),
    ],
)
def test_runs_that_need_ray_trains_own_group_say_why(tmp_path: Path, sections: dict, reason: str) -> None:
    assert reason in (why_not(config_of(tmp_path, **sections)) or "")


def test_a_plain_data_parallel_run_takes_a_warm_group(tmp_path: Path) -> None:
    assert why_not(config_of(tmp_path, scaling={"num_workers": 2})) is None


def test_streamed_data_needs_ray_trains_dataset_shards(tmp_path: Path) -> None:
    config = config_of(tmp_path, data={"name": "jsonl", "path": str(tmp_path / "rows")})
    assert "streams through Ray Data" in (why_not(config) or "")


def test_groups_are_shared_only_by_runs_of_the_same_shape_and_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "my_models.py"
    module.write_text("def net(**kwargs):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    factory = {"name": None, "factory": "my_models:net"}
    env = {"OMP_NUM_THREADS": "1"}

    def key(**sections: Any) -> str:
        return Shape.of(config_of(tmp_path, model=factory, **sections), env).key

    base = key()
    assert key(optim={"lr": 0.5}, seed=3, train={"max_steps": 7}) == base  # what a run trains is not the shape
    assert key(scaling={"num_workers": 2}) != base
    assert key(scaling={"resources_per_worker": {"CPU": 2}}) != base
    assert key(failure={"collective_timeout_s": 60}) != base
    assert Shape.of(config_of(tmp_path, model=factory), {**env, "NCCL_DEBUG": "INFO"}).key != base
    # A worker keeps the modules it imported: an edited factory module needs new workers.
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert key() != base


def test_a_warm_worker_resets_torchs_global_switches_between_runs() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True
    try:
        reset()
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False
