"""Warm worker groups (driver/warm.py) on a real local Ray: a second run of the same shape starts on
the group the first left warm and trains exactly what Ray Train's own group trains, whatever ran
on the group before; a run whose driver is gone loses its group; a pool's end gives every CPU and
placement group back. (A warm worker killed mid-run: tests/faults/test_exact_resume.py.)"""

from __future__ import annotations

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
