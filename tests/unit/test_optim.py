"""Optimizers, LR schedules, linear LR scaling and the report stride."""

from __future__ import annotations

import math

import pytest
import torch

from trainforge.config import OptimConfig, ScheduleConfig, load_config
from trainforge.worker.loop import report_stride
from trainforge.worker.optim import build_optimizer, build_scheduler, effective_lr, lr_multiplier


def test_linear_lr_scaling_follows_the_global_batch() -> None:
    assert effective_lr(OptimConfig(lr=0.1), 1024) == 0.1
    scaled = OptimConfig(lr=0.1, lr_scaling="linear", base_batch_size=256)
    assert effective_lr(scaled, 1024) == pytest.approx(0.4)
    assert effective_lr(scaled, 64) == pytest.approx(0.025)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_weight_decay_only_on_matrices(name: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = build_optimizer(OptimConfig(name=name, weight_decay=0.05), model, lr=0.01)
    decayed = [g for g in optimizer.param_groups if g["weight_decay"] > 0]
    assert [p.ndim for g in decayed for p in g["params"]] == [2]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 4
    assert type(optimizer).__name__.lower() == name


def test_schedules_shapes() -> None:
    warm = lr_multiplier(ScheduleConfig(name="constant", warmup_steps=4), 100)
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]

    cosine = lr_multiplier(ScheduleConfig(name="cosine", min_lr_ratio=0.1), 100)
    assert cosine(0) == pytest.approx(1.0)
    assert cosine(50) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cosine(100) == pytest.approx(0.1)

    linear = lr_multiplier(ScheduleConfig(name="linear", warmup_steps=10), 110)
    assert linear(10) == pytest.approx(1.0)
    assert linear(60) == pytest.approx(0.5)
    assert linear(110) == pytest.approx(0.0)

    step = lr_multiplier(ScheduleConfig(name="step", step_size=10, gamma=0.5), 100)
    assert [step(s) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]


def test_scheduler_drives_the_optimizer_lr() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(OptimConfig(name="sgd", lr=1.0), model, lr=1.0)
    scheduler = build_scheduler(ScheduleConfig(name="cosine"), optimizer, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(1.0)
    assert seen == sorted(seen, reverse=True)
    assert seen[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_report_stride_keeps_reports_apart_in_time() -> None:
    config = load_config(
        {"model": {"name": "mlp"}, "train": {"max_steps": 5, "log_every_n_steps": 10, "report_min_interval_s": 2.0}},
        env={},
    )
    assert report_stride(config, step_time_s=1.0) == 10  # 10 steps already take 10 s
    assert report_stride(config, step_time_s=0.01) == 200  # at least 2 s between reports
    assert report_stride(config, step_time_s=0.0) == 10
