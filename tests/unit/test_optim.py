"""Optimizers, LR schedules, linear LR scaling and the report stride."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from trainforge.config import OptimConfig, ScheduleConfig, load_config
from trainforge.errors import ConfigError
from trainforge.worker.loop import report_stride
from trainforge.worker.optim import (
    apply_hyperparameters,
    build_optimizer,
    check_optimizer,
    effective_lr,
    lr_multiplier,
)
from trainforge.worker.schedule import build_scheduler


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


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_any_torch_optim_class_by_name_with_its_own_keyword_arguments() -> None:
    cfg = OptimConfig(name="Adadelta", lr=1.0, weight_decay=0.01, kwargs={"rho": 0.95})
    optimizer = build_optimizer(cfg, tiny_model(), cfg.lr)
    assert type(optimizer) is torch.optim.Adadelta
    assert [group["rho"] for group in optimizer.param_groups] == [0.95, 0.95]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.01, 0.0]  # matrices only
    rms = build_optimizer(OptimConfig(name="RMSprop", kwargs={"alpha": 0.9, "centered": True}), tiny_model(), 0.01)
    assert type(rms) is torch.optim.RMSprop and rms.param_groups[0]["centered"] is True
    # trainforge's lower-case names keep their keys; torch's SGD takes torch's defaults and kwargs
    assert build_optimizer(OptimConfig(name="sgd"), tiny_model(), 0.1).param_groups[0]["momentum"] == 0.9
    plain = build_optimizer(OptimConfig(name="SGD", kwargs={"dampening": 0.1}), tiny_model(), 0.1)
    assert plain.param_groups[0]["momentum"] == 0 and plain.param_groups[0]["dampening"] == 0.1


@pytest.mark.parametrize(
    ("optim", "expected"),
    [
        ({"name": "Adadeltaa"}, "optim.name 'Adadeltaa' is not a torch.optim optimizer; did you mean 'Adadelta'?"),
        (
            {"name": "Adadelta", "kwargs": {"beta": 0.9}},
            "optim.kwargs ['beta'] are not arguments of torch.optim.Adadelta",
        ),
        ({"name": "LBFGS"}, "needs a closure"),
    ],
)
def test_an_optimizer_that_cannot_be_built_is_one_line(optim: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_optimizer(OptimConfig(**optim))
    assert expected in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("optim", "expected"),
    [
        ({"name": "Adadelta", "kwargs": {"lr": 1.0}}, "optim.kwargs ['lr']: set optim.lr and optim.weight_decay"),
        ({"name": "sgd", "kwargs": {"momentum": 0.5}}, "with optim.name sgd, set optim.momentum instead"),
        ({"name": "torch.optim.Adam"}, "optim.name = 'torch.optim.Adam': String should match pattern"),
    ],
)
def test_optim_kwargs_that_belong_to_other_keys_are_refused(optim: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config({"model": {"name": "mlp"}, "train": {"max_steps": 1}, "optim": optim})


def test_a_restored_optimizer_takes_this_runs_keyword_arguments() -> None:
    model = tiny_model()
    saved = OptimConfig(name="Adadelta", lr=1.0, kwargs={"rho": 0.9})
    optimizer = build_optimizer(saved, model, saved.lr)
    scheduler = build_scheduler(ScheduleConfig(), optimizer, 10)
    mine = OptimConfig(name="Adadelta", lr=0.5, kwargs={"rho": 0.8})
    apply_hyperparameters(optimizer, scheduler, mine, mine.lr)
    assert {group["rho"] for group in optimizer.param_groups} == {0.8}
    assert {group["lr"] for group in optimizer.param_groups} == {0.5}


def test_the_memory_planner_counts_a_named_optimizers_state() -> None:
    from trainforge.worker.capacity.estimate import optimizer_states

    def states(**optim: object) -> int:
        config = {"model": {"name": "mlp"}, "train": {"max_steps": 1}, "optim": optim}
        return optimizer_states(load_config(config))[0]

    assert states(name="Adadelta") == 2 and states(name="Adagrad") == 1
    assert states(name="SGD") == 0 and states(name="SGD", kwargs={"momentum": 0.9}) == 1
    assert states(name="adamw") == 2 and states(name="sgd") == 1


def test_train_refuses_optimizer_kwargs_before_ray_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.integration.test_cli import assert_user_error, in_process, write_config

    config = write_config(tmp_path, optim={"name": "RMSprop", "kwargs": {"beta": 0.9}})
    result = in_process("train", str(config), capsys=capsys)  # fails the test if Ray started
    assert_user_error(result, "optim.kwargs ['beta'] are not arguments of torch.optim.RMSprop: it takes [")


def test_an_optimizer_factory_builds_over_the_parameter_groups() -> None:
    cfg = OptimConfig(factory="tests.helpers.user_models:adadelta", lr=0.5, weight_decay=0.01, kwargs={"rho": 0.8})
    optimizer = build_optimizer(cfg, tiny_model(), cfg.lr)
    assert type(optimizer) is torch.optim.Adadelta
    settings = [(g["lr"], g["rho"], g["weight_decay"]) for g in optimizer.param_groups]
    assert settings == [(0.5, 0.8, 0.01), (0.5, 0.8, 0.0)]
    wrong = OptimConfig(factory="tests.helpers.user_models:not_an_optimizer")
    with pytest.raises(ConfigError, match=r"returned dict, expected a torch\.optim\.Optimizer"):
        build_optimizer(wrong, tiny_model(), 0.1)
    with pytest.raises(ConfigError, match=r"give one of optim.name \(a torch.optim class\) or optim.factory"):
        load_config({"model": {"name": "mlp"}, "train": {"max_steps": 1}, "optim": {"name": "sgd", "factory": "a:b"}})
    # The resolved config (config.yaml, the workers' payload) carries the default name beside the factory.
    resolved = load_config({"model": {"name": "mlp"}, "train": {"max_steps": 1}, "optim": {"factory": "a:b"}})
    assert load_config(resolved.to_dict()).optim.factory == "a:b"
