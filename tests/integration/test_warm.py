"""Warm worker groups (driver/warm.py) on a real local Ray: a second run of the same shape starts on
the group the first left warm and trains exactly what Ray Train's own group trains, whatever ran
on the group before; a run whose driver is gone loses its group; a pool's end gives every CPU and
placement group back. (A warm worker killed mid-run: tests/faults/test_exact_resume.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import ray
from rich.console import Console
from safetensors.torch import load_file

from tests.helpers.faults import wait_until
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical
from trainforge.config import validate
from trainforge.driver.events import start_mailbox
from trainforge.driver.run import run_env, train
from trainforge.driver.warm import Shape, shutdown_pool, start_pool

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]


def two_workers(tmp_path: Path, name: str, **sections: Any) -> dict[str, Any]:
    config = tiny_run(
        tmp_path,
        run={"name": name, "output_dir": str(tmp_path)},
        scaling={"num_workers": 2},
        train={"max_steps": 24, "batch_size": 16, "log_every_n_steps": 6, "report_min_interval_s": 0},
        checkpoint={"every_n_steps": 12},
        seed=7,
    )
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def weights(tmp_path: Path, name: str) -> dict[str, Any]:
    return load_file(str(tmp_path / name / "model.safetensors"))


def live_groups() -> list[str]:
    return [g for g, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]


def all_cpus_free() -> bool:
    return ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


def test_a_run_on_a_used_warm_group_trains_what_ray_trains_own_group_does(tmp_path: Path) -> None:
    """Run A on a fresh group; run B (another seed, optimizer, deterministic kernels, accumulation)
    on the same group; run A again on it: bit for bit the first A, and the A of Ray Train's group."""
    pool = start_pool()
    quiet = Console(quiet=True)
    try:
        first = train(validate(two_workers(tmp_path, "a-fresh")), console=quiet, pool=pool)
        other = two_workers(
            tmp_path,
            "b",
            seed=11,
            optim={"name": "adamw", "lr": 0.01},
            deterministic=True,
            train={"grad_accum_steps": 2},
        )
        train(validate(other), console=quiet, pool=pool)
        again = train(validate(two_workers(tmp_path, "a-used")), console=quiet, pool=pool)
        counts = ray.get(pool.counts.remote())
        assert counts == {"idle": 1, "leased": 0, "started": 1}, counts  # one group served all three
    finally:
        shutdown_pool(pool)
    ray_train = train(validate(two_workers(tmp_path, "a-ray-train")), console=quiet)

    assert first["status"] == again["status"] == ray_train["status"] == "finished"
    assert_bit_identical(weights(tmp_path, "a-fresh"), weights(tmp_path, "a-used"))
    assert_bit_identical(weights(tmp_path, "a-fresh"), weights(tmp_path, "a-ray-train"))
    wait_until(all_cpus_free, 30, "the pool's CPUs to be given back")
    assert not live_groups()


def test_a_group_whose_run_is_gone_is_killed_and_the_pool_gives_everything_back(tmp_path: Path) -> None:
    """A lease whose run's mailbox died (its driver, a trial's actor, ended) is reaped: workers
    killed, placement group removed; a group of another shape makes way for a new one."""
    pool = start_pool()
    config = validate(two_workers(tmp_path, "shape"))
    shape = Shape.of(config, run_env(config))
    try:
        mailbox = start_mailbox()
        group_id, workers, joined, runs = ray.get(pool.lease.remote(shape, mailbox))
        assert (joined, runs, len(workers)) == (False, 0, 2)
        assert ray.get([w.ping.remote() for w in workers]) == [0, 0]
        assert len(live_groups()) == 1
        assert ray.get(pool.reap.remote()) == 0  # its run is alive
        ray.kill(mailbox)  # what happens to a run's mailbox when its driver ends
        wait_until(lambda: ray.get(pool.reap.remote()) or None, 30, "the abandoned group to be reaped")
        assert ray.get(pool.counts.remote()) == {"idle": 0, "leased": 0, "started": 1}
        wait_until(lambda: not live_groups(), 30, "the reaped group's placement group to be removed")

        # An idle group of another shape gives its CPUs back to a lease that needs new workers.
        mailbox = start_mailbox()
        group_id, _, _, _ = ray.get(pool.lease.remote(shape, mailbox))
        ray.get(pool.give_back.remote(group_id, True))
        wider = validate(two_workers(tmp_path, "wider", scaling={"num_workers": 3}))
        ray.get(pool.lease.remote(Shape.of(wider, run_env(wider)), mailbox))
        assert ray.get(pool.counts.remote()) == {"idle": 0, "leased": 1, "started": 3}
        wait_until(lambda: len(live_groups()) == 1, 30, "the idle group's placement group to be removed")
    finally:
        shutdown_pool(pool)
    wait_until(lambda: not live_groups() and all_cpus_free(), 30, "every CPU and placement group given back")


def probed(tmp_path: Path, name: str, helper: Path, *callbacks: dict[str, Any]) -> Any:
    """A run of one worker with the callbacks of tests/helpers/warm_probe.py."""
    config = tiny_run(
        tmp_path,
        run={"name": name, "output_dir": str(tmp_path)},
        train={"max_steps": 8, "batch_size": 16, "log_every_n_steps": 4, "report_min_interval_s": 0},
        callbacks=list(callbacks),
        seed=3,
    )
    return validate(config)


def dirty(helper: Path, **kwargs: Any) -> dict[str, Any]:
    return {"path": "tests.helpers.warm_probe:LeaveEverythingBehind", "kwargs": {"helper_dir": str(helper), **kwargs}}


def record(path: Path, helper: Path) -> dict[str, Any]:
    return {
        "path": "tests.helpers.warm_probe:RecordWhatTheRunSees",
        "kwargs": {"path": str(path), "helper_dir": str(helper)},
    }


def test_a_run_on_a_reused_worker_sees_what_it_would_on_a_new_one(tmp_path: Path) -> None:
    """Run A leaves behind a secret and other environment changes, another working directory,
    torch's settings, seeded RNGs, and an imported user module whose file is then edited; run B on
    A's worker trains bit for bit what B trains on a new worker, and sees what a new worker sees."""
    helper = tmp_path / "helper"
    helper.mkdir()
    (helper / "warm_helper.py").write_text("VALUE = 'v1'\n")
    quiet = Console(quiet=True)
    pool = start_pool()
    try:
        train(probed(tmp_path, "a", helper, dirty(helper)), console=quiet, pool=pool)
        (helper / "warm_helper.py").write_text("VALUE = 'v2, edited after run A'\n")
        reused = train(
            probed(tmp_path, "b-reused", helper, record(tmp_path / "reused.json", helper)), console=quiet, pool=pool
        )
        assert ray.get(pool.counts.remote())["started"] == 1  # B ran on A's group
    finally:
        shutdown_pool(pool)
    pool = start_pool()
    try:
        fresh = train(
            probed(tmp_path, "b-fresh", helper, record(tmp_path / "fresh.json", helper)), console=quiet, pool=pool
        )
    finally:
        shutdown_pool(pool)

    assert reused["status"] == fresh["status"] == "finished"
    seen, new = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("reused", "fresh"))
    assert seen == new
    assert seen["secret"] is None and seen["env"]["OMP_NUM_THREADS"] == "1" and seen["env"]["RANK"] == "0"
    assert seen["helper"] == "v2, edited after run A"
    assert seen["torch"]["matmul_precision"] == "highest" and seen["torch"]["default_dtype"] == "torch.float32"
    assert_bit_identical(weights(tmp_path, "b-fresh"), weights(tmp_path, "b-reused"))


def test_a_worker_whose_state_cannot_be_put_back_is_not_reused_and_the_run_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """torch cannot change its inter-op thread count back: the next run gets new workers, with one line."""
    helper = tmp_path / "helper"
    helper.mkdir()
    (helper / "warm_helper.py").write_text("VALUE = 1\n")
    quiet = Console(quiet=True)
    pool = start_pool()
    try:
        train(probed(tmp_path, "a", helper, dirty(helper, interop_threads=3)), console=quiet, pool=pool)
        with caplog.at_level(logging.WARNING, logger="trainforge"):
            after = train(probed(tmp_path, "b", helper), console=quiet, pool=pool)
        assert ray.get(pool.counts.remote()) == {"idle": 1, "leased": 0, "started": 2}
    finally:
        shutdown_pool(pool)
    assert after["status"] == "finished"
    said = [r.getMessage() for r in caplog.records if "not reused" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "inter-op threads to 3" in said[0], said
