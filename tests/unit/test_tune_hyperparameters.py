"""Restoring another run's checkpoint (a PBT exploit): its weights and moments, this run's hyperparameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainforge.checkpoint.state import State
from trainforge.config import OptimConfig, ScheduleConfig, load_config
from trainforge.worker.components.base import Restore
from trainforge.worker.components.training import Schedule
from trainforge.worker.components.weights import OptimizerState
from trainforge.worker.optim import (
    apply_hyperparameters,
    build_optimizer,
    effective_lr,
    hyperparameters_differ,
    lr_multiplier,
)
from trainforge.worker.plan import ParallelPlan
from trainforge.worker.schedule import LRSchedule, build_scheduler

TOTAL = 100
SCHEDULE = ScheduleConfig(name="cosine", warmup_steps=5)


def trained(cfg: OptimConfig, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, LRSchedule]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = build_optimizer(cfg, model, cfg.lr)
    scheduler = build_scheduler(SCHEDULE, optimizer, TOTAL)
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def test_restored_state_runs_with_this_runs_lr_and_decay() -> None:
    donor_cfg = OptimConfig(name="adamw", lr=0.01, weight_decay=0.05, betas=(0.9, 0.999))
    _, donor, donor_schedule = trained(donor_cfg, steps=12)
    mine = OptimConfig(name="adamw", lr=0.002, weight_decay=0.1, betas=(0.8, 0.99))
    model, optimizer, scheduler = trained(mine, steps=0)
    optimizer.load_state_dict(donor.state_dict())
    scheduler.load_state_dict(donor_schedule.state_dict(), 12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(donor.param_groups[0]["lr"])  # the donor's, so far

    apply_hyperparameters(optimizer, scheduler, mine, mine.lr)

    factor = lr_multiplier(SCHEDULE, TOTAL)(12)
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(0.002 * factor)
        assert group["betas"] == (0.8, 0.99)
        decays = any(p.ndim >= 2 for p in group["params"])
        assert group["weight_decay"] == (0.1 if decays else 0.0)
    assert scheduler.scheduler.get_last_lr() == [pytest.approx(0.002 * factor)] * len(optimizer.param_groups)
    # The moments and the step count are the donor's.
    first = next(iter(donor.state.values()))
    assert torch.equal(next(iter(optimizer.state.values()))["exp_avg"], first["exp_avg"])
    assert scheduler.scheduler.last_epoch == 12
    # The schedule goes on from there with this run's base LR.
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.002 * lr_multiplier(SCHEDULE, TOTAL)(13))


def test_hyperparameters_differ_compares_optim_and_schedule() -> None:
    cfg = load_config({"model": {"name": "mlp"}, "train": {"max_steps": 5}}, env={})
    saved = cfg.to_dict()
    assert not hyperparameters_differ(saved, cfg.optim, cfg.schedule)
    assert hyperparameters_differ({**saved, "optim": {**saved["optim"], "lr": 0.5}}, cfg.optim, cfg.schedule)
    assert hyperparameters_differ(
        {**saved, "schedule": {**saved["schedule"], "warmup_steps": 7}}, cfg.optim, cfg.schedule
    )


def restore_optimizer(
    cfg_dict: dict, optimizer: torch.optim.Optimizer, scheduler: Any, saved: tuple[State, State, dict]
) -> list[str]:
    """The optimizer and schedule components of a run with ``cfg_dict`` (a DDP plan, fp32) loaded
    from a donor's saved states, as restore loads them; the notes restore made."""
    config = load_config(cfg_dict, env={})
    plan = ParallelPlan(config.parallel, torch.device("cpu"))
    optim_state, schedule_state, donor_config = saved
    restore = Restore(step=0, world=1, plan="ddp", config=donor_config, same_ranks=True)
    OptimizerState(plan, torch.nn.Identity(), optimizer, config.optim).load_state_dict(optim_state, restore)
    lr = effective_lr(config.optim, config.train.batch_size * config.train.grad_accum_steps)
    Schedule(scheduler, optimizer, config.optim, config.schedule, lr).load_state_dict(schedule_state, restore)
    return restore.notes


def saved_state(optimizer: torch.optim.Optimizer, scheduler: Any, config: dict) -> tuple[State, State, dict]:
    """A donor's optimizer and schedule as its checkpoint holds them, and its config."""
    optim = State({"name": config["optim"]["name"]}, optimizer.state_dict())
    schedule = State({k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"})
    return optim, schedule, config


def test_restore_from_another_optimizer_kind_keeps_fresh_moments(tmp_path: Path) -> None:
    base = {"model": {"name": "mlp"}, "train": {"max_steps": TOTAL}, "schedule": SCHEDULE.model_dump()}
    sgd_cfg = {**base, "optim": {"name": "sgd", "lr": 0.1}}
    _, donor, donor_schedule = trained(OptimConfig(name="sgd", lr=0.1), steps=6)
    state = saved_state(donor, donor_schedule, load_config(sgd_cfg, env={}).to_dict())

    adam_cfg = {**base, "optim": {"name": "adamw", "lr": 0.003}}
    _, optimizer, scheduler = trained(OptimConfig(name="adamw", lr=0.003), steps=0)
    notes = restore_optimizer(adam_cfg, optimizer, scheduler, state)

    assert not optimizer.state  # no SGD momentum buffers in an AdamW
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.003 * lr_multiplier(SCHEDULE, TOTAL)(6))
    assert any("optimizer state not restored" in note for note in notes)
    assert any("hyperparameters from this run's config" in note for note in notes)


def test_restore_of_the_same_run_changes_nothing(tmp_path: Path) -> None:
    cfg = {"model": {"name": "mlp"}, "train": {"max_steps": TOTAL}, "schedule": SCHEDULE.model_dump()}
    optim = OptimConfig(name="adamw", lr=0.01)
    _, donor, donor_schedule = trained(optim, steps=7)
    state = saved_state(donor, donor_schedule, load_config({**cfg, "optim": optim.model_dump()}, env={}).to_dict())
    _, optimizer, scheduler = trained(optim, steps=0)
    notes = restore_optimizer({**cfg, "optim": optim.model_dump()}, optimizer, scheduler, state)
    assert notes == []
    assert optimizer.state_dict()["param_groups"] == donor.state_dict()["param_groups"]
