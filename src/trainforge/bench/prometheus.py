"""Micro-benchmark: what Prometheus export costs the training thread.

``python -m trainforge.bench.prometheus`` prints

* the worker hook's ``on_report`` (every gauge of rank 0, the busiest rank), per report;
* the DDP communication hook: process CPU time of a backward with DDP's built-in all-reduce
  against one with the timed all-reduce, on a one-rank gloo group (paired repeats in random
  order, medians; CPU time, because wall time on a shared machine mostly measures the others).

It starts a local Ray (the gauges record into a Ray core worker) and needs no GPU.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainforge.metrics.worker.comm import CommTimer
from trainforge.metrics.worker.hook import PrometheusHook
from trainforge.protocol import Report


def report_cost(reports: int) -> float:
    """Seconds per ``on_report`` call."""
    hook = PrometheusHook({"run": "bench", "trial": "", "rank": "0", "node": "127.0.0.1"}, rank=0)
    figures = {
        "train/loss": 0.5,
        "val/loss": 0.6,
        "val/accuracy": 0.9,
        "perf/samples_per_s": 1000.0,
        "train/lr": 1e-3,
        "train/grad_norm": 1.0,
        "checkpoint/stall_s": 0.1,
    }
    report = Report(step=10, world_size=8, time=time.time(), figures=figures)
    local = {"data_s": 0.01, "compute_s": 0.1, "optim_s": 0.02, "step_s": 0.13, "steps": 10.0}
    hook.on_report(report, local)  # creates the series
    started = time.perf_counter()
    for _ in range(reports):
        hook.on_report(report, local)
    return (time.perf_counter() - started) / reports


def backward_cost(steps: int, repeats: int) -> tuple[float, float, int]:
    """Median process CPU seconds per backward with DDP's built-in all-reduce, the median extra
    CPU seconds per backward with the timed one (paired repeats in random order: the machine's
    load hits both alike), and the buckets per step."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.Sequential(*layers)
    variants = {
        "builtin": DistributedDataParallel(model, bucket_cap_mb=1),
        "timed": DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1),
    }
    timer = CommTimer.attach(variants["timed"], torch.device("cpu"))
    assert timer is not None
    batch = torch.randn(64, 512)
    for ddp in variants.values():
        ddp(batch).square().mean().backward()  # DDP rebuilds its buckets after the first backward
    timer.take(steps=1)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    shuffle = random.Random(0)
    for _ in range(repeats):
        shuffle.shuffle(order)
        for name in order:
            started = time.process_time()
            for _ in range(steps):
                variants[name](batch).square().mean().backward()
            seconds[name].append((time.process_time() - started) / steps)
    buckets = len(timer.spans) // (steps * repeats)
    extra = [timed - plain for timed, plain in zip(seconds["timed"], seconds["builtin"], strict=True)]
    return statistics.median(seconds["builtin"]), statistics.median(extra), buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=5000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()

    import ray

    from trainforge.driver.ray_session import LOOPBACK, bound_to

    torch.set_num_threads(1)
    with bound_to(LOOPBACK):
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        per_report = report_cost(args.reports)
    finally:
        ray.shutdown()
    print(f"on_report (rank 0, every gauge): {per_report * 1e6:.1f} us per report")

    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group("gloo", store=dist.FileStore(f"{scratch}/store", 1), rank=0, world_size=1)
        try:
            plain, extra, buckets = backward_cost(args.steps, args.repeats)
        finally:
            dist.destroy_process_group()
    print(
        f"backward of 8 x Linear(512, 512) in {buckets} buckets: {plain * 1e3:.2f} ms CPU with DDP's built-in "
        f"all-reduce; timed all-reduce {extra * 1e6:+.0f} us CPU per step"
    )


if __name__ == "__main__":
    main()
