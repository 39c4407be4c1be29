"""metrics/: all-reduce timing on a real gloo process group, failure reasons, discovery files,
config keys, and the metric reference in docs/monitoring.md."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from tests.helpers.runs import tiny_run
from trainforge.config import MetricsConfig, load_config
from trainforge.errors import ConfigError
from trainforge.metrics import names
from trainforge.metrics.driver.session import check_cluster_options, link, local_ray_options, write_targets
from trainforge.metrics.worker.comm import CommReport, CommTimer, comm_hooks, union_length
from trainforge.metrics.worker.gpu import gpu_readings
from trainforge.observers.prometheus import failure_reason
from trainforge.protocol import Report

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group: DDP and its communication hooks run for real."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def train_steps(model: nn.Module, steps: int) -> list[torch.Tensor]:
    """Gradients of each step (no optimizer: the same weights every step)."""
    grads = []
    for step in range(steps):
        torch.manual_seed(step)
        model.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return grads


def test_comm_timer_times_every_bucket_and_keeps_ddps_gradients(gloo: None) -> None:
    reference = small_model()
    # Small buckets: several all-reduces per backward, like a real model's.
    ddp = DistributedDataParallel(copy.deepcopy(reference), bucket_cap_mb=0.04)
    timer = CommTimer.attach(ddp, torch.device("cpu"))
    assert timer is not None

    timed = train_steps(ddp, 3)
    # DDP starts with one 1 MB bucket and rebuilds smaller ones after the first backward.
    assert len(timer.spans) > 3
    assert sum(last for _, _, last in timer.spans) == 3  # one last bucket per backward
    in_flight, exposed = timer.take(steps=3)
    assert 0 < exposed <= in_flight
    assert timer.spans == [] and timer.take(steps=1) == (0.0, 0.0)
    for got, expected in zip(timed, train_steps(reference, 3), strict=True):
        torch.testing.assert_close(got, expected)


def test_comm_timer_steps_aside_for_a_hook_already_registered(gloo: None) -> None:
    ddp = DistributedDataParallel(small_model())
    ddp.register_comm_hook(None, allreduce_hook)
    assert CommTimer.attach(ddp, torch.device("cpu")) is None
    assert CommTimer.attach(small_model(), torch.device("cpu")) is None  # one worker: nothing to time


def test_every_report_carries_its_ranks_communication_per_step(gloo: None) -> None:
    ddp = DistributedDataParallel(small_model(), bucket_cap_mb=0.04)
    (hook,) = comm_hooks(True, world=2, model=ddp, device=torch.device("cpu"), chosen=None)
    train_steps(ddp, 4)
    report = Report(step=4)
    metrics = report.figures
    local = {"steps": 4.0, "compute_s": 0.01}
    hook.on_report(report, local)
    assert 0 < metrics["perf/comm_exposed_s"] <= metrics["perf/comm_s"]
    assert (local["comm_s"], local["comm_exposed_s"]) == (metrics["perf/comm_s"], metrics["perf/comm_exposed_s"])
    hook.on_report(report, {"steps": 0.0})  # a report without steps (the final one): says nothing new
    assert metrics["perf/comm_s"] == local["comm_s"]


def test_communication_figures_only_where_they_are_measured(gloo: None) -> None:
    one = small_model()
    (single,) = comm_hooks(True, world=1, model=one, device=torch.device("cpu"), chosen=None)
    report = Report(step=3)
    metrics = report.figures
    single.on_report(report, {"steps": 3.0})
    assert (metrics["perf/comm_s"], metrics["perf/comm_exposed_s"]) == (0.0, 0.0)  # one worker: nothing to send
    assert (
        comm_hooks(
            False, world=2, model=DistributedDataParallel(small_model()), device=torch.device("cpu"), chosen=None
        )
        == []
    )
    taken = DistributedDataParallel(small_model())
    taken.register_comm_hook(None, allreduce_hook)  # another hook: no timer, no figures (not a made-up 0)
    assert comm_hooks(True, world=2, model=taken, device=torch.device("cpu"), chosen=None) == []
    assert isinstance(single, CommReport)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA events cannot be recorded")
def test_a_timing_failure_never_breaks_the_all_reduce(gloo: None) -> None:
    reference = small_model()
    ddp = DistributedDataParallel(copy.deepcopy(reference))
    timer = CommTimer(cuda=True)  # CUDA events on a CPU-only machine: every mark fails
    ddp.register_comm_hook(None, timer.hook)
    for got, expected in zip(train_steps(ddp, 2), train_steps(reference, 2), strict=True):
        torch.testing.assert_close(got, expected)
    assert timer.broken and timer.take(steps=2) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("spans", "length"),
    [
        ([], 0.0),
        ([(0.0, 1.0)], 1.0),
        ([(0.0, 1.0), (2.0, 3.5)], 2.5),
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),
        ([(1.0, 3.0), (0.0, 4.0), (5.0, 6.0)], 5.0),
        ([(0.0, 1.0), (1.0, 2.0)], 2.0),
    ],
)
def test_union_length_counts_overlaps_once(spans: list[tuple[float, float]], length: float) -> None:
    assert union_length(spans) == pytest.approx(length)


def test_nvml_readings_become_gauges_in_base_units() -> None:
    sample = {  # the shape of metrics.nvml.Gpus.sample() on a two-GPU node
        "gpu0_util_percent": 87.0,
        "gpu0_memory_used_gb": 12.5,
        "gpu0_temperature_c": 71.0,
        "gpu0_power_w": 250.5,
        "gpu1_util_percent": 3.0,
        "gpu1_clock_mhz": 1410.0,  # a reading without a gauge
    }
    assert sorted(gpu_readings(sample)) == [
        ("trainforge_gpu_memory_used_bytes", 12.5e9, "0"),
        ("trainforge_gpu_power_watts", 250.5, "0"),
        ("trainforge_gpu_temperature_celsius", 71.0, "0"),
        ("trainforge_gpu_utilization_percent", 3.0, "1"),
        ("trainforge_gpu_utilization_percent", 87.0, "0"),
    ]
    assert {name for name, _, _ in gpu_readings(sample)} == set(names.CONDITIONAL_NAMES["gpu"])


@pytest.mark.parametrize(
    ("errors", "reason"),
    [
        (["OutOfMemoryError: Task was killed due to the node running low on memory."], "oom"),
        (["RuntimeError: ok", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"], "oom"),
        (["ActorDiedError: The actor died because its node has died. Node Id: 4a1c"], "node"),
        (["NodeDiedError: node 10.0.0.7 is dead"], "node"),
        (["RuntimeError: loss is nan"], "error"),
        (["ValueError: room for improvement in bloom filter"], "error"),
    ],
)
def test_failure_reason(errors: list[str], reason: str) -> None:
    assert failure_reason(errors) == reason


def test_discovery_file_is_prometheus_file_sd_and_replaced_atomically(tmp_path: Path) -> None:
    target = tmp_path / "session" / "sd.json"
    target.parent.mkdir()
    write_targets(target, ["10.0.0.2:8080", "10.0.0.3:8080"])
    assert json.loads(target.read_text()) == [{"labels": {"job": "ray"}, "targets": ["10.0.0.2:8080", "10.0.0.3:8080"]}]
    write_targets(target, [])
    assert json.loads(target.read_text())[0]["targets"] == []
    assert [p.name for p in target.parent.iterdir()] == ["sd.json"]  # no partial file left

    legacy = tmp_path / "sd-link.json"
    link(tmp_path / "old.json", legacy)
    link(target, legacy)  # another session's link is replaced
    assert legacy.resolve() == target.resolve()


def test_export_interval_reaches_ray_init_and_is_refused_for_a_cluster() -> None:
    assert local_ray_options(MetricsConfig()) == {}
    options = local_ray_options(MetricsConfig(export_interval_s=2.5))
    assert options == {"_system_config": {"metrics_report_interval_ms": 2500}}
    assert local_ray_options(MetricsConfig(enabled=False, export_interval_s=2.5)) == {}
    check_cluster_options(MetricsConfig())
    with pytest.raises(ConfigError, match=r"metrics\.export_interval_s applies to a local Ray only"):
        check_cluster_options(MetricsConfig(export_interval_s=2.0))


def test_metrics_config_keys(tmp_path: Path) -> None:
    config = load_config(tiny_run(tmp_path, metrics={"export_interval_s": 1, "trial": "t-0007", "comm_timing": False}))
    assert config.metrics.export_interval_s == 1.0 and config.metrics.trial == "t-0007"
    assert not config.metrics.comm_timing
    with pytest.raises(ConfigError, match=r"metrics\.export_interval_s = 0\.5"):
        load_config(tiny_run(tmp_path, metrics={"export_interval_s": 0.5}))
    with pytest.raises(ConfigError, match=r"unknown key metrics\.port"):
        load_config(tiny_run(tmp_path, metrics={"port": 9100}))


def test_metric_definitions_are_unique_labelled_and_documented() -> None:
    defined = [m.name for m in names.ALL]
    assert len(defined) == len(set(defined))
    assert all(name.startswith("trainforge_") for name in defined)
    assert all({"run", "trial"} <= set(m.labels) for m in names.ALL)
    reference = (ROOT / "docs" / "monitoring.md").read_text()
    assert [name for name in defined if f"`{name}`" not in reference] == []
