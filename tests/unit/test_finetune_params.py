"""``model.freeze`` and ``optim.param_groups``: parameters chosen by name for fine-tuning.

In one process: what is frozen and counted, which group a parameter goes to and with which LR and
weight decay, how schedules, ``optim.lr_scaling`` and a foreign checkpoint's restore treat each
group, and the one-line errors through the CLI. Then in 2-rank gloo groups without Ray, under ddp
and fsdp: frozen weights and a group with LR 0 never move, frozen parameters have no optimizer
state, the reports carry the counts, and a run that crashes after its step-8 checkpoint and
restarts ends bit-identical to the same run uninterrupted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from tests.helpers.console import without_startup
from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, assert_bit_identical, checkpoint_state, run_dir_of, sessions
from trainforge.config import Config, OptimConfig, ScheduleConfig, load_config
from trainforge.data import build_datasets
from trainforge.driver.summary import Recovery, RunRecord, build_summary
from trainforge.errors import ConfigError
from trainforge.models import build_model
from trainforge.protocol import ParameterCounts, Report
from trainforge.worker.build import check_parameter_names, seed_all
from trainforge.worker.optim import (
    apply_hyperparameters,
    build_optimizer,
    effective_lr,
    group_parameters,
    hyperparameters_differ,
    names_by_parameter,
)
from trainforge.worker.params import freeze
from trainforge.worker.schedule import build_scheduler


def net() -> nn.Module:
    """Names 0.weight, 0.bias, 1.weight, 1.bias (a norm), 2.weight, 2.bias."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def groups_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[tuple[list[str], float, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [([names[id(p)] for p in g["params"]], g["lr"], g["weight_decay"]) for g in optimizer.param_groups]


# --- freezing -----------------------------------------------------------------------------------


def test_freeze_holds_named_parameters_and_counts_them() -> None:
    model = net()
    counts = freeze(model, ["0.*", "1.bias"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"0.weight", "0.bias", "1.bias"}
    assert counts == ParameterCounts(trainable=6 + 6 * 3 + 3, frozen=4 * 6 + 6 + 6)
    optimizer = build_optimizer(OptimConfig(name="adamw", weight_decay=0.1), model, 1e-3)
    in_optimizer = {n for names, _, _ in groups_by_name(optimizer, model) for n in names}
    assert in_optimizer == {"1.weight", "2.weight", "2.bias"}


def test_freeze_refuses_a_glob_that_matches_nothing_and_freezing_everything() -> None:
    with pytest.raises(ConfigError) as caught:
        freeze(net(), ["0.*", "encoder.*"])
    message = str(caught.value)
    assert message.startswith("model.freeze: 'encoder.*' matches no parameter of the model")
    assert "it has 6 names, such as '0.weight', '1.weight', '1.bias', '2.bias'" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"freezes every parameter"):
        freeze(net(), ["*"])
    assert freeze(net(), []) == ParameterCounts(trainable=4 * 6 + 6 + 12 + 6 * 3 + 3, frozen=0)


# --- parameter groups ---------------------------------------------------------------------------


def test_a_parameter_goes_to_the_first_entry_that_matches_and_the_rest_keep_todays_groups() -> None:
    model = net()
    cfg = OptimConfig(
        name="adamw",
        lr=0.01,
        weight_decay=0.05,
        param_groups=[
            {"params": "2.*", "lr": 0.1},  # no weight_decay: matrices 0.05, the bias none
            {"params": ["2.weight", "1.*"], "lr": 0.2, "weight_decay": 0.3},  # 2.weight is taken already
        ],
    )
    optimizer = build_optimizer(cfg, model, cfg.lr)
    assert groups_by_name(optimizer, model) == [
        (["0.weight"], 0.01, 0.05),  # the parameters no entry takes first: group 0 is optim.lr's
        (["0.bias"], 0.01, 0.0),
        (["2.weight"], 0.1, 0.05),
        (["2.bias"], 0.1, 0.0),
        (["1.weight", "1.bias"], 0.2, 0.3),  # its own weight decay, on the norm too
    ]
    # Without entries: what build_optimizer always made.
    plain = groups_by_name(build_optimizer(OptimConfig(weight_decay=0.05), model, 0.01), model)
    assert plain == [(["0.weight", "2.weight"], 0.01, 0.05), (["0.bias", "1.weight", "1.bias", "2.bias"], 0.01, 0.0)]


def test_an_entry_that_matches_nothing_is_a_one_line_error() -> None:
    cfg = OptimConfig(param_groups=[{"params": "2.*"}, {"params": ["1.*", "head.*"]}])
    with pytest.raises(ConfigError) as caught:
        group_parameters(cfg, net().named_parameters())
    assert str(caught.value).startswith("optim.param_groups[1].params: 'head.*' matches no parameter")
    taken = OptimConfig(param_groups=[{"params": "2.*"}, {"params": "2.bias"}])
    with pytest.raises(ConfigError, match=r"^optim.param_groups\[1\].params: \['2.bias'\] matches only parameters"):
        group_parameters(taken, net().named_parameters())
    model = net()
    freeze(model, ["2.*"])
    with pytest.raises(ConfigError, match=r"frozen \(model.freeze\)"):
        group_parameters(OptimConfig(param_groups=[{"params": "2.*"}]), model.named_parameters())


def test_warmup_and_linear_scaling_scale_each_groups_own_lr() -> None:
    model = net()
    cfg = OptimConfig(
        name="sgd", lr=0.01, lr_scaling="linear", base_batch_size=64, param_groups=[{"params": "2.*", "lr": 0.1}]
    )
    lr = effective_lr(cfg, global_batch=128)  # twice the base batch: every group's LR doubles
    optimizer = build_optimizer(cfg, model, lr)
    scheduler = build_scheduler(ScheduleConfig(name="constant", warmup_steps=4), optimizer, total_steps=10)
    bases = [pytest.approx(0.02), pytest.approx(0.02), pytest.approx(0.2), pytest.approx(0.2)]
    assert scheduler.scheduler.base_lrs == bases
    for step in range(6):
        factor = min(1.0, (step + 1) / 4)
        assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(b * factor) for b in (0.02, 0.02, 0.2, 0.2)]
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()


def test_a_foreign_checkpoints_optimizer_takes_each_groups_own_lr_and_decay() -> None:
    """A PBT exploit or a fine-tune from another run's checkpoint: this run's groups' values."""
    donor_cfg = OptimConfig(name="adamw", lr=0.5, weight_decay=0.9, param_groups=[{"params": "2.*", "lr": 0.7}])
    donor_model = net()
    donor = build_optimizer(donor_cfg, donor_model, donor_cfg.lr)
    donor_schedule = build_scheduler(ScheduleConfig(warmup_steps=4), donor, 10)
    donor_model(torch.randn(2, 4)).sum().backward()
    donor.step()
    donor_schedule.step()

    cfg = OptimConfig(name="adamw", lr=0.01, weight_decay=0.05, param_groups=[{"params": "2.*", "lr": 0.1}])
    model = net()
    optimizer = build_optimizer(cfg, model, cfg.lr)
    scheduler = build_scheduler(ScheduleConfig(warmup_steps=4), optimizer, 10)
    optimizer.load_state_dict(donor.state_dict())
    scheduler.load_state_dict(donor_schedule.state_dict(), 1)
    assert optimizer.param_groups[2]["lr"] == pytest.approx(0.7 * 2 / 4)  # the donor's, so far

    apply_hyperparameters(optimizer, scheduler, cfg, cfg.lr, names_by_parameter(model.named_parameters()))

    assert [(g["initial_lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.01, 0.05),
        (0.01, 0.0),
        (0.1, 0.05),
        (0.1, 0.0),
    ]
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(x * 2 / 4) for x in (0.01, 0.01, 0.1, 0.1)]
    assert scheduler.scheduler.base_lrs == [0.01, 0.01, 0.1, 0.1]


def test_a_checkpoint_from_before_param_groups_existed_has_the_same_hyperparameters() -> None:
    cfg = load_config({"model": {"name": "mlp"}, "train": {"max_steps": 5}}, env={})
    saved = cfg.to_dict()
    old = {**saved, "optim": {k: v for k, v in saved["optim"].items() if k != "param_groups"}}
    assert not hyperparameters_differ(old, cfg.optim, cfg.schedule)
    grouped = cfg.optim.model_copy(update={"param_groups": OptimConfig(param_groups=[{"params": "x"}]).param_groups})
    assert hyperparameters_differ(old, grouped, cfg.schedule)


# --- what the driver gets -------------------------------------------------------------------------


def test_the_counts_travel_in_reports_and_land_in_summary_json() -> None:
    report = Report(step=3, parameters=ParameterCounts(trainable=10, frozen=5))
    again = Report.from_json(report.to_json())
    assert again is not None and again.parameters == ParameterCounts(trainable=10, frozen=5)
    assert Report.from_json({"step": 1, "parameters": {"trainable": "10", "frozen": 5}}).parameters is None  # type: ignore[union-attr]
    record = RunRecord("finished", again, Recovery(), 1.0, None, {}, 1)
    assert build_summary(record)["parameters"] == {"trainable": 10, "frozen": 5}
    assert "parameters" not in build_summary(RunRecord("finished", Report(step=3), Recovery(), 1.0, None, {}, 1))


# --- config errors through the CLI ----------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``trainforge ARGS`` in this process: exit code and the error lines of stderr."""
    from trainforge.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    err = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)
    return code, err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"model": {"name": "mlp", "freeze": ["1.*", "encoder.*"]}}, "model.freeze: 'encoder.*' matches no parameter"),
        ({"model": {"name": "mlp", "freeze": "*"}}, "model.freeze ['*'] freezes every parameter"),
        ({"optim": {"param_groups": [{"params": "head.*", "lr": 0.1}]}}, "optim.param_groups[0].params: 'head.*'"),
        ({"optim": {"param_groups": [{"params": "5.*", "lr": -1}]}}, "optim.param_groups.0.lr"),
        ({"optim": {"param_groups": [{"params": "5.*", "momentum": 0.5}]}}, "optim.param_groups.0.momentum"),
        ({"optim": {"param_groups": [{"params": []}]}}, "optim.param_groups.0.params"),
    ],
)
def test_config_errors_are_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: dict[str, Any], expected: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path, **override)))
    code, err = cli(capsys, "train", str(path))
    lines = without_startup(err)  # train's first line and start-up phases come before a check fails
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (tmp_path / "t").exists()  # refused before Ray started


# --- 2 gloo ranks, ddp and fsdp --------------------------------------------------------------------


FROZEN = ("1.weight", "1.bias")
STILL = ("5.weight", "5.bias")  # the group with lr 0


def config(tmp: Path, name: str, strategy: str) -> dict[str, Any]:
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model={"name": "mlp", "kwargs": {"hidden_sizes": [32, 32]}, "freeze": ["1.*"]},
        train={"max_steps": 20, "batch_size": 16, "log_every_n_steps": 4},
        optim={
            "name": "adamw",
            "lr": 3e-3,
            "weight_decay": 0.05,
            "param_groups": [{"params": "5.*", "lr": 0.0}, {"params": "3.weight", "lr": 0.01, "weight_decay": 0.1}],
        },
        schedule={"name": "cosine", "warmup_steps": 4},
        scaling={"num_workers": 2},
        parallel={"strategy": strategy},
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=5,
    )


def initial_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights every rank starts from: the model built under the run's seed."""
    cfg = Config.model_validate(config)
    _, _, spec = build_datasets(cfg.data, cfg.seed)
    seed_all(cfg.seed)
    return {k: v.detach().clone() for k, v in build_model(cfg.model, spec).state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Outcome]]:
    """Per strategy: a straight run, the same run crashed after its step-8 checkpoint, its restart;
    all six in one start-up of 2 ranks."""
    tmp = tmp_path_factory.mktemp("finetune")
    plans, names = [], []
    for strategy in ("ddp", "fsdp"):
        straight, crashed = config(tmp, f"{strategy}-straight", strategy), config(tmp, f"{strategy}-crashed", strategy)
        plans += [(straight, None), (crashed, 12), (crashed, None)]
        names += [f"{strategy}-straight", f"{strategy}-crashed", f"{strategy}-resumed"]
    outcomes = spawn_ranks(sessions, 2, plans)[0]
    return {name: (plan[0], outcome) for name, plan, outcome in zip(names, plans, outcomes, strict=True)}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_frozen_and_lr_zero_parameters_stay_and_resume_is_bit_identical(runs: dict, strategy: str) -> None:
    straight_cfg, straight = runs[f"{strategy}-straight"]
    crashed_cfg, crashed = runs[f"{strategy}-crashed"]
    _, resumed = runs[f"{strategy}-resumed"]
    assert crashed.crashed and straight.final["status"] == resumed.final["status"] == "finished"
    assert any("checkpoint_000000008" in event for event in resumed.events), resumed.events

    # Bit-identical after the restart: weights and optimizer state.
    final = checkpoint_state(run_dir_of(straight_cfg), 20)
    assert_bit_identical(final, checkpoint_state(run_dir_of(crashed_cfg), 20))

    # Frozen weights and the lr-0 group never moved; the others did.
    start = initial_weights(straight_cfg)
    for name in FROZEN + STILL:
        assert torch.equal(final[f"model/{name}"], start[name]), name
    for name in ("3.weight", "3.bias"):
        assert not torch.equal(final[f"model/{name}"], start[name]), name

    # No optimizer state for frozen parameters: 3.weight, 3.bias, 5.weight, 5.bias have moments.
    slots = {key.split("/")[1] for key in final if key.startswith("optim/")}
    if strategy == "ddp":  # torch's own state dict: by index over the optimizer's parameters
        assert slots == {"0", "1", "2", "3"}
    else:  # sharded: by parameter name
        assert slots == {"3.weight", "3.bias", "5.weight", "5.bias"}

    # What the driver gets: the counts, in every rank's final report.
    trainable = 32 * 32 + 32 + 10 * 32 + 10
    assert straight.parameters == resumed.parameters == {"trainable": trainable, "frozen": 32 * 64 + 32}


def test_the_preflight_matches_the_names_the_workers_see_with_lora() -> None:
    """With model.lora the workers match globs after the adapters are in: so does the preflight."""
    base = {"model": {"name": "mlp", "lora": {"target_modules": ["3"]}}, "train": {"max_steps": 5}}
    adapters = {"param_groups": [{"params": "*lora_B*", "lr": 0.01}]}
    check_parameter_names(load_config({**base, "optim": adapters}, env={}))
    with pytest.raises(ConfigError, match=r"'\*lora_C\*' matches no parameter"):
        check_parameter_names(load_config({**base, "optim": {"param_groups": [{"params": "*lora_C*"}]}}, env={}))
