"""LR schedules (worker/schedule.py): trainforge's own names as they always were, any
torch.optim.lr_scheduler class by its name, warm-up in front, stepped per step, per epoch or on a
validation metric, and their state through a checkpoint's JSON and schema."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from trainforge.config import OptimConfig, ScheduleConfig, load_config
from trainforge.errors import ConfigError
from trainforge.worker.components.training import ScheduleState
from trainforge.worker.optim import apply_hyperparameters, build_optimizer, lr_multiplier
from trainforge.worker.schedule import LRSchedule, build_scheduler, check_schedule

SGD = OptimConfig(name="sgd", lr=1.0)


def schedule(total: int = 40, per_epoch: int = 5, optim: OptimConfig = SGD, **cfg: Any) -> LRSchedule:
    torch.manual_seed(0)
    optimizer = build_optimizer(optim, torch.nn.Linear(3, 2), optim.lr)
    return build_scheduler(ScheduleConfig(**cfg), optimizer, total, per_epoch)


def lrs(sched: LRSchedule, steps: int, per_epoch: int = 5, metric: list[float] | None = None) -> list[float]:
    """The LR of each optimizer step, as the loop drives the schedule (an epoch end every
    ``per_epoch`` steps; a validation with the next of ``metric`` at each)."""
    seen = []
    values = iter(metric or [])
    for step in range(1, steps + 1):
        seen.append(sched.lr)
        sched.optimizer.step()
        sched.step()
        if step % per_epoch == 0:
            sched.epoch_end()
            if metric is not None:
                sched.validated({"val/loss": next(values)})
    return seen


def through_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """A schedule's state as a checkpoint writes it and the component's schema reads it back."""
    raw = json.loads(json.dumps(state))
    return ScheduleState.model_validate(raw).model_dump(by_alias=True, exclude_none=True)


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({"name": "cosine", "kwargs": {"T_max": 3}}, "schedule.kwargs is for a torch.optim.lr_scheduler class"),
        ({"name": "step", "interval": "epoch"}, "schedule.interval epoch needs a torch.optim.lr_scheduler class"),
        ({"name": "StepLR", "gamma": 0.5}, "schedule ['gamma'] are for constant/step/cosine/linear"),
        ({"name": "ReduceLROnPlateau"}, "schedule.name ReduceLROnPlateau needs schedule.monitor"),
        ({"name": "ReduceLROnPlateau", "monitor": "val/loss", "interval": "epoch"}, "leave schedule.interval out"),
        ({"name": "StepLR", "kwargs": {"step_size": 1}, "monitor": "val/loss"}, "read by ReduceLROnPlateau only"),
        ({"warmup_steps": 5, "warmup_epochs": 1}, "give one of schedule.warmup_steps or schedule.warmup_epochs"),
        ({"name": "ReduceLROnPlateau", "monitor": "loss"}, "schedule.monitor = 'loss': 'loss' is not a validation"),
    ],
)
def test_schedule_keys_are_refused_where_the_named_schedule_ignores_them(cfg: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config({"model": {"name": "mlp"}, "train": {"max_steps": 1}, "schedule": cfg})


@pytest.mark.parametrize(
    ("cfg", "optim", "expected"),
    [
        ({"name": "StepLr"}, SGD, "schedule.name 'StepLr' is not an LR schedule; did you mean 'StepLR'?"),
        ({"name": "LambdaLR"}, SGD, "schedule.name 'LambdaLR' is not supported: it takes Python functions"),
        ({"name": "SequentialLR"}, SGD, "not supported: it takes other schedulers"),
        ({"name": "_LRScheduler"}, SGD, "schedule.name '_LRScheduler' is not an LR schedule"),
        (
            {"name": "StepLR", "kwargs": {"step_sise": 2}},
            SGD,
            "'step_sise' is not an argument of torch.optim.lr_scheduler.StepLR; did you mean 'step_size'?",
        ),
        ({"name": "StepLR"}, SGD, "schedule.kwargs needs step_size for torch.optim.lr_scheduler.StepLR"),
        ({"name": "StepLR", "kwargs": {"step_size": 1, "last_epoch": 3}}, SGD, "schedule.kwargs ['last_epoch']"),
        (
            {"name": "OneCycleLR", "kwargs": {"max_lr": 0.1}},
            OptimConfig(name="Adadelta"),
            "OneCycleLR(max_lr=0.1) with optim.name Adadelta raised ValueError: optimizer must support momentum",
        ),
        ({"name": "ReduceLROnPlateau", "monitor": "val/loss", "kwargs": {"mode": "up"}}, SGD, "raised ValueError"),
    ],
)
def test_a_torch_class_and_its_kwargs_are_checked_in_one_line(cfg: dict, optim: OptimConfig, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)) as err:
        check_schedule(ScheduleConfig(**cfg), optim)
    assert "\n" not in str(err.value)


def test_the_driver_refuses_a_bad_schedule_before_ray_starts() -> None:
    from trainforge.driver.run import preflight

    config = load_config(
        {"model": {"name": "mlp"}, "train": {"max_steps": 1}, "schedule": {"name": "ExponentialLr"}}, env={}
    )
    with pytest.raises(ConfigError, match=re.escape("did you mean 'ExponentialLR'?")):
        preflight(config, local=False)


@pytest.mark.parametrize("name", ["constant", "step", "cosine", "linear"])
def test_trainforges_own_schedules_are_lambdalr_over_steps_as_before(name: str) -> None:
    cfg = ScheduleConfig(name=name, warmup_steps=4, step_size=6, gamma=0.5, min_lr_ratio=0.1)
    optimizer = build_optimizer(SGD, torch.nn.Linear(3, 2), 1.0)
    plain = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, 30))
    expected = []
    for _ in range(30):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        plain.step()
    ours = schedule(total=30, name=name, warmup_steps=4, step_size=6, gamma=0.5, min_lr_ratio=0.1)
    assert lrs(ours, 30) == expected  # bit-identical: the same LambdaLR, epoch ends change nothing
    assert set(ours.state_dict()) == set(plain.state_dict()) - {"lr_lambdas"}  # the checkpoint's keys as before


def test_warmup_epochs_are_the_runs_steps_per_epoch() -> None:
    by_epochs = lrs(schedule(total=30, name="cosine", warmup_epochs=1.5), 30)
    assert by_epochs == lrs(schedule(total=30, name="cosine", warmup_steps=8), 30)  # round(1.5 x 5)


def test_a_warmup_runs_in_front_of_a_torch_class() -> None:
    seen = lrs(schedule(name="StepLR", kwargs={"step_size": 2, "gamma": 0.5}, warmup_steps=4), 10)
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25])


def test_interval_epoch_steps_at_epoch_ends_only() -> None:
    seen = lrs(schedule(name="StepLR", kwargs={"step_size": 1, "gamma": 0.7}, interval="epoch"), 15)
    assert seen == pytest.approx([1.0] * 5 + [0.7] * 5 + [0.49] * 5)
    warmed = lrs(schedule(name="ExponentialLR", kwargs={"gamma": 0.5}, interval="epoch", warmup_epochs=1), 15)
    assert warmed == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0] + [1.0] * 5 + [0.5] * 5)  # its epoch 0 after the warm-up


def test_reduce_lr_on_plateau_steps_on_the_monitored_metric() -> None:
    sched = schedule(name="ReduceLROnPlateau", monitor="val_loss", kwargs={"patience": 0, "factor": 0.5})
    seen = lrs(sched, 25, metric=[1.0, 0.8, 0.9, 0.95, 0.5])
    assert seen[::5] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.25])
    with pytest.raises(ConfigError, match=re.escape("schedule.monitor 'val_loss' is not a metric of this run's")):
        sched.validated({"val/mse": 1.0})


def test_the_run_length_fills_a_classs_length() -> None:
    steps = schedule(total=40, name="CosineAnnealingLR", warmup_steps=10)
    assert steps.scheduler.T_max == 30  # type: ignore[attr-defined]
    epochs = schedule(total=40, name="OneCycleLR", kwargs={"max_lr": 1.0}, interval="epoch", warmup_epochs=1)
    assert epochs.scheduler.total_steps == 7  # type: ignore[attr-defined]
    lrs(epochs, 40)  # stepped no more often than that: OneCycleLR raises past its total


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "StepLR", "kwargs": {"step_size": 3}, "warmup_steps": 4},
        {"name": "MultiStepLR", "kwargs": {"milestones": [3, 5, 9]}, "interval": "epoch"},
        {"name": "OneCycleLR", "kwargs": {"max_lr": 2.0}},
        {"name": "CosineAnnealingWarmRestarts", "kwargs": {"T_0": 4, "T_mult": 2}},
        {"name": "ReduceLROnPlateau", "monitor": "val/loss", "kwargs": {"patience": 1}},
    ],
)
def test_a_torch_class_continues_from_its_checkpointed_state(cfg: dict) -> None:
    metric = [1.0, 0.9, 0.95, 0.97, 0.99, 0.2, 0.3, 0.4]
    straight = schedule(**cfg)
    expected = lrs(straight, 40, metric=metric)
    first = schedule(**cfg)
    lrs(first, 17, metric=metric[:3])
    state = through_checkpoint(first.state_dict())
    resumed = schedule(**cfg)
    assert resumed.load_state_dict(state, 17) is None
    rest = []
    values = iter(metric[3:])
    for step in range(18, 41):
        rest.append(resumed.lr)
        resumed.optimizer.step()
        resumed.step()
        if step % 5 == 0:
            resumed.epoch_end()
            resumed.validated({"val/loss": next(values)})
    assert rest == expected[17:]
    assert straight.state_dict() == resumed.state_dict()


def test_an_old_lambdalr_state_loads_and_a_foreign_one_is_refused() -> None:
    old = {"base_lrs": [1.0, 1.0], "last_epoch": 7, "_step_count": 8, "_last_lr": [0.5, 0.5], "_is_initial": False}
    sched = schedule(name="linear")
    sched.load_state_dict(through_checkpoint(old), 7)
    assert sched.steps == 7 and sched.scheduler.last_epoch == 7
    step_lr = schedule(name="StepLR", kwargs={"step_size": 3})
    bad = {**step_lr.state_dict()}
    bad["state"] = {**bad["state"], "gamma": "fast"}
    with pytest.raises(ValueError, match=re.escape("schedule state StepLR.gamma: 'fast' where a float goes")):
        schedule(name="StepLR", kwargs={"step_size": 3}).load_state_dict(through_checkpoint(bad), 0)
    with pytest.raises(ValueError, match="scheduler StepLR needs steps and state"):
        ScheduleState.model_validate({"scheduler": "StepLR"})


def test_another_schedules_checkpoint_starts_this_one_where_training_stands() -> None:
    donor = schedule(name="StepLR", kwargs={"step_size": 2})
    lrs(donor, 9)
    mine = schedule(total=40, name="linear")
    note = mine.load_state_dict(through_checkpoint(donor.state_dict()), 9)
    assert note is not None and "StepLR" in note
    assert mine.lr == pytest.approx(lr_multiplier(ScheduleConfig(name="linear"), 40)(9))


def test_a_changed_lr_rebases_a_torch_class_where_it_stands() -> None:
    sched = schedule(name="StepLR", kwargs={"step_size": 1, "gamma": 0.5}, interval="epoch")
    lrs(sched, 10)  # two epochs: 0.25 of the base
    apply_hyperparameters(sched.optimizer, sched, OptimConfig(name="sgd", lr=0.1), 0.1)
    assert [group["lr"] for group in sched.optimizer.param_groups] == pytest.approx([0.025, 0.025])
    sched.epoch_end()
    assert sched.lr == pytest.approx(0.0125)
    cycle = schedule(name="OneCycleLR", kwargs={"max_lr": 2.0})
    lrs(cycle, 5)
    before = cycle.lr
    apply_hyperparameters(cycle.optimizer, cycle, OptimConfig(name="sgd", lr=0.1), 0.1)
    assert cycle.lr == before  # its LRs come from schedule.kwargs max_lr


def lr_session(rank: int, world: int, runs: list[tuple[dict[str, Any], int | None]]) -> list[dict[str, Any]]:
    """Each run's Session in this gloo rank (as tests/helpers/sessions.py runs one), with the LR of
    every step its reports' history holds."""
    from tests.helpers.sessions import Crash, ListChannel
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    outcomes = []
    for config_dict, crash_at in runs:
        cfg = Config.model_validate(config_dict)
        run = build(cfg, ranks=(rank, world))
        checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
        restored = restore(run, checkpointing.store)
        channel = ListChannel(crash_at)
        crashed = False
        try:
            Session(run, checkpointing, restored, channel=channel).train()
        except Crash:
            crashed = True
        finally:
            checkpointing.close()
        history = [point for report in channel.reports for point in report.history]
        outcomes.append(
            {
                "lrs": {int(p["step"]): float(p["train/lr"]) for p in history if "train/lr" in p},
                "crashed": crashed,
                "events": [e.text for r in channel.reports for e in r.events],
                "steps_per_epoch": run.data.steps_per_epoch,
                "step": run.components["progress"].state_dict().values["global_step"],  # type: ignore[attr-defined]
            }
        )
    return outcomes


def final_schedule(run_dir: Any, step: int) -> dict[str, Any]:
    state = json.loads((run_dir / f"checkpoint_{step:09d}" / "trainer_state.json").read_text())
    return dict(state["components"]["schedule"])


@pytest.mark.slow  # two runs straight, crashed and resumed, in one pair of gloo ranks (12-20 s)
def test_step_lr_per_epoch_and_plateau_resume_bit_identical(tmp_path: Any) -> None:
    """StepLR(step_size=1, gamma=0.7) stepped at epoch ends reports lr0 x 0.7**epoch; it and a
    ReduceLROnPlateau on val/loss resume from a mid-run checkpoint to the same weights, moments
    and schedule state as the run that was not interrupted."""
    from tests.helpers.ranks import spawn_ranks
    from tests.helpers.runs import tiny_run
    from tests.helpers.sessions import assert_bit_identical, checkpoint_state

    def step_lr(tmp: Any) -> dict[str, Any]:
        return tiny_run(
            tmp,
            train={"max_steps": None, "epochs": 3, "batch_size": 64, "log_every_n_steps": 1},
            optim={"name": "sgd", "lr": 0.1},
            schedule={"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.7}, "interval": "epoch"},
            scaling={"num_workers": 2},
            checkpoint={"every_n_steps": 8, "keep_last": 8},
            seed=3,
        )

    def plateau(tmp: Any) -> dict[str, Any]:
        return tiny_run(
            tmp,
            train={"max_steps": 24, "batch_size": 16, "log_every_n_steps": 1, "eval_every_n_steps": 3},
            optim={"name": "sgd", "lr": 0.1},
            schedule={
                "name": "ReduceLROnPlateau",
                "monitor": "val/loss",
                "kwargs": {"patience": 0, "factor": 0.5, "threshold": 0.2},  # only a 20% gain counts
                "warmup_steps": 2,
            },
            scaling={"num_workers": 2},
            checkpoint={"every_n_steps": 8, "keep_last": 8},
            seed=3,
        )

    runs = {"step_lr": step_lr, "plateau": plateau}
    straight = {name: make(tmp_path / f"{name}-straight") for name, make in runs.items()}
    crashed = {name: make(tmp_path / f"{name}-crashed") for name, make in runs.items()}
    first = spawn_ranks(
        lr_session,
        2,
        [(straight["step_lr"], None), (straight["plateau"], None), (crashed["step_lr"], 20), (crashed["plateau"], 20)],
    )[0]
    resumed = spawn_ranks(lr_session, 2, [(crashed["step_lr"], None), (crashed["plateau"], None)])[0]
    assert first[2]["crashed"] and first[3]["crashed"]

    lrs_by_step, per_epoch = first[0]["lrs"], first[0]["steps_per_epoch"]
    assert first[0]["step"] == 3 * per_epoch
    assert lrs_by_step == {s: pytest.approx(0.1 * 0.7 ** ((s - 1) // per_epoch)) for s in range(1, 3 * per_epoch + 1)}
    assert min(first[1]["lrs"].values()) < 0.1  # the plateau reduced the LR
    for index, name in enumerate(runs):
        outcome = resumed[index]
        assert any(e.startswith("resumed from") and "checkpoint_000000016" in e for e in outcome["events"]), name
        assert outcome["lrs"] == {s: first[index]["lrs"][s] for s in outcome["lrs"]}, name
        step = first[index]["step"]
        a = checkpoint_state(tmp_path / f"{name}-straight" / "t", step)
        b = checkpoint_state(tmp_path / f"{name}-crashed" / "t", step)
        assert_bit_identical(a, b)
        assert final_schedule(tmp_path / f"{name}-straight" / "t", step) == final_schedule(
            tmp_path / f"{name}-crashed" / "t", step
        )


def test_a_search_space_is_checked_against_the_schedule() -> None:
    from trainforge.tune.space import parse_space

    base = load_config(
        {
            "model": {"name": "mlp"},
            "train": {"max_steps": 10},
            "optim": {"name": "sgd"},
            "schedule": {"name": "OneCycleLR", "kwargs": {"max_lr": 0.1}},
        },
        env={},
    )
    with pytest.raises(ConfigError, match=re.escape("sets the LR from schedule.kwargs max_lr: search those")):
        parse_space({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, base)
    with pytest.raises(ConfigError, match=re.escape("schedule.kwargs 'max_lrs' is not an argument")):
        parse_space({"schedule.kwargs": {"choice": [{"max_lrs": 0.1}]}}, base)
    assert parse_space({"schedule.kwargs.max_lr": {"uniform": [0.01, 0.1]}}, base)


def test_a_resolved_schedule_config_validates_again() -> None:
    """The driver sends the resolved config (every key, defaults included) to the workers, and
    checkpoints and search trials hold it: it must pass the same checks again."""
    from trainforge.config import Config

    for cfg in (
        {"name": "ReduceLROnPlateau", "monitor": "val/loss", "warmup_epochs": 0.5},
        {"name": "StepLR", "kwargs": {"step_size": 2}, "interval": "epoch", "warmup_epochs": 1},
    ):
        config = load_config({"model": {"name": "mlp"}, "train": {"max_steps": 1}, "schedule": cfg}, env={})
        assert Config.model_validate(config.to_dict()).schedule == config.schedule


def test_an_exploited_checkpoint_keeps_this_runs_class_arguments() -> None:
    """A PBT exploit of a trial with another schedule.kwargs: the donor's position, this run's gamma."""
    donor = schedule(name="StepLR", kwargs={"step_size": 1, "gamma": 0.5}, interval="epoch")
    lrs(donor, 10)
    mine = schedule(name="StepLR", kwargs={"step_size": 1, "gamma": 0.9}, interval="epoch")
    mine.load_state_dict(through_checkpoint(donor.state_dict()), 10, keep_arguments=True)
    assert mine.lr == pytest.approx(0.25) and mine.scheduler.last_epoch == 2
    mine.epoch_end()
    assert mine.lr == pytest.approx(0.225)
