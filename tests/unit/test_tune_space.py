"""Search space files and the search settings: every mistake is one ConfigError that names the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray import tune

from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.tune.runner import default_concurrency, trial_demand
from trainforge.tune.schedulers import default_metric, make_settings
from trainforge.tune.space import apply_params, load_space, parse_space

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"name": "mlp"}, "train": {"max_steps": 90}}
DEMO_SPACE = {
    "optim.lr": {"loguniform": [1.0e-5, 0.1]},
    "optim.weight_decay": {"uniform": [0, 0.1]},
    "train.batch_size": {"choice": [32, 64, 128]},
    "optim.name": {"grid": ["sgd", "adamw"]},
    "schedule.warmup_steps": {"randint": [0, 1000]},
    "optim.momentum": {"quniform": [0.8, 0.99, 0.01]},
}


def config(**tune: object):
    return load_config({**BASE, "tune": tune}, env={})


def test_the_issue_example_parses_into_tune_domains() -> None:
    space = parse_space(DEMO_SPACE, config())
    assert space.keys == list(DEMO_SPACE)
    assert space.grid_points == 2
    enumerated = space.param_space(enumerate_grid=True)
    assert isinstance(enumerated["optim.lr"], tune.search.sample.Float)
    assert isinstance(enumerated["schedule.warmup_steps"], tune.search.sample.Integer)
    assert enumerated["optim.name"] == {"grid_search": ["sgd", "adamw"]}
    assert isinstance(space.param_space(enumerate_grid=False)["optim.name"], tune.search.sample.Categorical)


def test_the_bundled_demo_space_fits_the_bundled_demo_config() -> None:
    demo = load_config(ROOT / "configs" / "tune_digits.yaml", env={})
    space = load_space(ROOT / "configs" / "tune_digits_space.yaml", demo)
    assert set(space.keys) == {"optim.lr", "optim.weight_decay", "train.batch_size", "optim.name"}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"optim.lrr": {"uniform": [0, 1]}}, "unknown config key optim.lrr — did you mean optim.lr?"),
        ({"optim.lr": {"logunifrom": [1e-4, 1]}}, "unknown domain 'logunifrom' — did you mean loguniform?"),
        ({"optim.lr": {"uniform": [0.1]}}, "optim.lr: uniform takes [lo, hi] with lo < hi, got [0.1]"),
        ({"optim.lr": {"uniform": [0.1, 0.01]}}, "uniform takes [lo, hi] with lo < hi, got [0.1, 0.01]"),
        ({"optim.lr": {"loguniform": [0, 0.1]}}, "loguniform takes [lo, hi] with 0 < lo < hi"),
        ({"optim.momentum": {"quniform": [0.8, 0.9, 0]}}, "quniform takes [lo, hi, q]"),
        ({"schedule.warmup_steps": {"randint": [0, 9.5]}}, "randint takes [lo, hi] integers"),
        ({"optim.name": {"grid": []}}, "optim.name: grid needs at least one value, got an empty list"),
        ({"optim.name": {"choice": []}}, "choice needs at least one value"),
        (
            {"optim.name": {"grid": ["sgd", "rmsprop"]}},
            "value 'rmsprop' is rejected: optim.name 'rmsprop' is not a torch.optim optimizer; did you mean 'RMSprop'",
        ),
        ({"optim.momentum": {"uniform": [0.5, 1.5]}}, "value 1.5 is rejected: optim.momentum = 1.5"),
        ({"train.batch_size": {"uniform": [16, 64]}}, "train.batch_size = 33.76: Input should be a valid integer"),
        ({"optim.lr": [0.1, 0.2]}, "optim.lr: expected one domain such as {uniform: [lo, hi]}"),
        ({"optim.lr": {"uniform": [0, 1], "choice": [1]}}, "expected one domain"),
        ({"optim": {"choice": [1]}}, "optim is a section; name one of its keys"),
        ({"optim.lr.x": {"choice": [1]}}, "optim.lr is a value, not a section"),
        ({"run.name": {"choice": ["a"]}}, "run.name cannot be tuned"),
        ({"scaling.num_workers": {"choice": [1, 2]}}, "use tune.workers_per_trial"),
    ],
)
def test_bad_spaces_name_the_key_and_what_is_allowed(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_space(entry, config(), source="space.yaml")
    text = str(caught.value)
    assert message in text
    assert text.startswith("space.yaml: ") and "\n" not in text


def test_keys_inside_dict_valued_keys_are_tunable() -> None:
    space = parse_space({"model.kwargs.hidden_sizes": {"choice": [[64], [128, 64]]}}, config())
    raw = apply_params(config().to_dict(), {"model.kwargs.hidden_sizes": [64]})
    assert space.keys == ["model.kwargs.hidden_sizes"]
    assert raw["model"]["kwargs"] == {"hidden_sizes": [64]}


def test_a_space_file_must_exist_and_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_space(tmp_path / "nope.yaml", config())
    (tmp_path / "list.yaml").write_text("- optim.lr\n")
    with pytest.raises(ConfigError, match="expected a mapping of config keys to domains"):
        load_space(tmp_path / "list.yaml", config())


def test_pbt_perturbations_are_clamped_into_the_domain() -> None:
    space = parse_space(DEMO_SPACE, config())
    clamped = space.clamp(
        {"optim.lr": 0.5, "optim.weight_decay": -0.01, "schedule.warmup_steps": 1500.4, "optim.momentum": 0.999}
    )
    assert clamped == {
        "optim.lr": 0.1,
        "optim.weight_decay": 0.0,
        "schedule.warmup_steps": 999,
        "optim.momentum": pytest.approx(0.99),
    }
    assert space.mutations()["train.batch_size"] == [32, 64, 128]


def test_grid_search_runs_every_point_and_num_trials_must_fit_the_grid() -> None:
    space = parse_space(DEMO_SPACE, config())
    settings = make_settings(config(search="grid"), space)
    assert (settings.num_samples, settings.num_trials) == (1, 2)
    assert make_settings(config(search="grid", num_trials=6), space).num_samples == 3
    with pytest.raises(ConfigError, match="num_trials must be a multiple of 2"):
        make_settings(config(search="grid", num_trials=3), space)
    no_grid = parse_space({"optim.lr": {"uniform": [0.01, 0.1]}}, config())
    with pytest.raises(ConfigError, match="needs at least one"):
        make_settings(config(search="grid"), no_grid)
    assert make_settings(config(), space).num_trials == 8  # random: the default trial count


@pytest.mark.parametrize(
    ("tune_section", "message"),
    [
        (
            {"scheduler": "asha", "scheduler_params": {"asha": {"grace": 5}}},
            "asha.grace is not a parameter of asha — did you mean grace_period?",
        ),
        ({"scheduler": "asha", "scheduler_params": {"asha": {"grace_period": 500}}}, "exceeds the budget of 90 steps"),
        ({"scheduler": "asha", "scheduler_params": {"asha": {"reduction_factor": 1}}}, "must be a number > 1"),
        ({"scheduler": "pbt", "scheduler_params": {"pbt": {"quantile_fraction": 0.8}}}, "must be in (0, 0.5]"),
        ({"scheduler": "pbt", "scheduler_params": {"pbt": {"synch": 1}}}, "must be true or false"),
        ({"scheduler": "pbt", "search": "optuna"}, "use tune.search random or grid"),
        ({"scheduler_params": {"ashaa": {}}}, "tune.scheduler_params.ashaa: not a scheduler — did you mean asha?"),
        ({"scheduler_params": {"asha": {"grace": 1}}}, "is not a parameter of asha"),  # checked when not chosen too
        ({"scheduler_params": {"asha": 5}}, "tune.scheduler_params.asha must be a mapping of parameters"),
    ],
)
def test_bad_scheduler_settings_are_config_errors(tune_section: dict, message: str) -> None:
    space = parse_space({"optim.lr": {"uniform": [0.01, 0.1]}}, config())
    with pytest.raises(ConfigError) as caught:
        make_settings(config(**tune_section), space)
    assert message in str(caught.value)


def test_schedulers_need_a_step_budget_and_default_to_it() -> None:
    space = parse_space({"optim.lr": {"uniform": [0.01, 0.1]}}, config())
    settings = make_settings(config(scheduler="asha"), space)
    assert settings.scheduler_params == {"max_t": 90, "grace_period": 10, "reduction_factor": 3.0, "brackets": 1}
    both = {"asha": {"grace_period": 30}, "pbt": {"perturbation_interval": 45}}
    assert make_settings(config(scheduler="asha", scheduler_params=both), space).scheduler_params["grace_period"] == 30
    assert make_settings(config(scheduler="none", scheduler_params=both), space).scheduler_params == {}
    epochs_only = load_config({**BASE, "train": {"epochs": 3}, "tune": {"scheduler": "median"}}, env={})
    with pytest.raises(ConfigError, match="needs a step budget"):
        make_settings(epochs_only, space)


def test_pbt_checkpoints_at_every_perturbation_step() -> None:
    space = parse_space({"optim.lr": {"uniform": [0.01, 0.1]}}, config())
    params = {"pbt": {"perturbation_interval": 30}}
    assert make_settings(config(scheduler="pbt", scheduler_params=params), space).checkpoint_every == 30
    with_every = load_config(
        {**BASE, "checkpoint": {"every_n_steps": 20}, "tune": {"scheduler": "pbt", "scheduler_params": params}}, env={}
    )
    with pytest.raises(ConfigError, match=r"must be a multiple of checkpoint\.every_n_steps 20"):
        make_settings(with_every, space)


def test_the_default_metric_is_validation_loss_where_there_is_validation_data() -> None:
    assert default_metric(config()) == "val/loss"  # digits has its own validation split
    synthetic = load_config({**BASE, "data": {"name": "synthetic", "val_fraction": 0}}, env={})
    assert default_metric(synthetic) == "train/loss"


def test_concurrency_follows_free_resources_per_trial() -> None:
    one = trial_demand(config(workers_per_trial=1))
    two = trial_demand(config(workers_per_trial=2))
    assert one["CPU"] == pytest.approx(1.01) and two["CPU"] == pytest.approx(2.01)
    assert default_concurrency(one, {"CPU": 4.0}) == 3  # each trial's driver takes a sliver too
    assert default_concurrency(two, {"CPU": 4.0}) == 1
    gpu = trial_demand(load_config({**BASE, "scaling": {"use_gpu": True}, "tune": {"workers_per_trial": 2}}, env={}))
    assert gpu["GPU"] == 2
    assert default_concurrency(gpu, {"CPU": 32.0, "GPU": 8.0}) == 4
    assert default_concurrency(gpu, {"CPU": 32.0}) == 1  # none fit: one at a time, waiting for resources


@pytest.mark.parametrize(
    ("scheduler", "kind"),
    [
        ("none", "FIFOScheduler"),
        ("asha", "AsyncHyperBandScheduler"),
        ("median", "MedianStoppingRule"),
        ("pbt", "PopulationBasedTraining"),
    ],
)
def test_every_scheduler_is_built_with_the_step_as_its_clock(scheduler: str, kind: str) -> None:
    from trainforge.tune.schedulers import build_scheduler

    space = parse_space(DEMO_SPACE, config())
    built = build_scheduler(make_settings(config(scheduler=scheduler), space), space)
    assert type(built).__name__ == kind
    if scheduler != "none":
        assert built._time_attr == "step"


@pytest.mark.parametrize(("search", "kind"), [("random", "BasicVariantGenerator"), ("optuna", "ConcurrencyLimiter")])
def test_searchers_cap_their_own_concurrency(search: str, kind: str) -> None:
    from trainforge.tune.schedulers import build_search_alg

    space = parse_space({"optim.lr": {"uniform": [0.01, 0.1]}}, config())
    built = build_search_alg(make_settings(config(search=search), space), max_concurrent=3)
    assert type(built).__name__ == kind
    assert built.max_concurrent == 3


def test_peak_overlap_counts_trials_running_together() -> None:
    from trainforge.bench.tune import peak_overlap

    assert peak_overlap([(0, 10), (1, 5), (2, 3), (6, 9)]) == 3
    assert peak_overlap([(0, 1), (1, 2)]) == 1  # one ends as the next starts


@pytest.mark.parametrize(
    ("wall_s", "share", "verdict"),
    [(74.5, 0.017, ": pass"), (74.5, 0.12, ": miss"), (58.0, 0.018, ": not judged: trials under 60 s, raise --steps")],
)
def test_bench_tune_judges_overhead_only_on_trials_of_a_minute(wall_s: float, share: float, verdict: str) -> None:
    from rich.console import Console

    from trainforge.bench.tune import print_report

    overhead = {
        "median_share": share,
        "median_wall_s": wall_s,
        "median_overhead_s": share * wall_s,
        "median_before_loop_s": 0.1,
        "median_after_loop_s": 1.0,
    }
    console = Console(record=True, width=400)
    print_report(console, {"measures": {"overhead": overhead}})
    (line,) = [line for line in console.export_text().splitlines() if line.startswith("trial overhead")]
    assert line.endswith(verdict)
