"""The demo search (configs/tune_digits*.yaml), CI-sized, with each searcher and scheduler, on a real
local Ray: trial counts, the best trial, best.yaml, early stopping, PBT's exploit, resources."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import trainforge
from tests.helpers.faults import events_of, wait_until
from tests.helpers.sessions import assert_bit_identical
from trainforge.config import load_config

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "tune_digits.yaml"
DEMO_SPACE = ROOT / "configs" / "tune_digits_space.yaml"
TRIAL_KEYS = {"trial_id", "config", "status", "last_metric", "best_metric", "steps", "stopped_early", "wall_time_s"}


def search(tmp_path: Path, name: str, *overrides: str, **options: Any) -> trainforge.TuneResult:
    """The demo search, CI-sized: 60 steps per trial, a report every 10, a checkpoint every 30."""
    ci_sized = [
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        "tracking.enabled=false",
        "train.max_steps=60",
        "train.log_every_n_steps=10",
        "checkpoint.every_n_steps=30",
    ]
    return trainforge.tune(DEMO, DEMO_SPACE, [*ci_sized, *overrides], **options)


def check_search(result: trainforge.TuneResult, trials: int, *, train_best: bool = False) -> dict[str, Any]:
    """What every search promises: the trial count, the best trial, plots, and a best.yaml that is
    the best trial's complete config (with ``train_best``: and trains as it is; one search checks
    that, the others save the run)."""
    summary = json.loads((result.search_dir / "tune_summary.json").read_text())
    assert len(summary["trials"]) == trials
    assert all(trial.keys() >= TRIAL_KEYS for trial in summary["trials"])
    assert len({trial["trial_id"] for trial in summary["trials"]}) == trials
    finals = [t["last_metric"] for t in summary["trials"] if t["last_metric"] is not None]
    assert summary["best"]["last_metric"] == min(finals)
    best_trial = next(t for t in summary["trials"] if t["trial_id"] == summary["best"]["trial_id"])
    assert best_trial["last_metric"] == summary["best"]["last_metric"]
    for plot in ("metric_vs_hyperparameters.png", "learning_curves.png"):
        assert (result.search_dir / "plots" / plot).stat().st_size > 1000
    for trial in summary["trials"]:
        run = json.loads((Path(trial["run_dir"]) / "summary.json").read_text())
        assert run["status"] in ("finished", "stopped")
        if trial["status"] == "stopped":
            # A trial the scheduler stopped trains on until Ray ends its process (docs/tune.md): its
            # run may record steps past the last report the search counted, never fewer.
            assert trial["steps"] <= run["global_step"] <= trial["budget_steps"]
        else:
            assert run["global_step"] == trial["steps"]

    assert result.best_config == result.search_dir / "best.yaml"
    best = load_config(result.best_config).to_dict()  # a complete config, valid as it is
    for key, value in best_trial["config"].items():
        section, name = key.split(".")
        assert best[section][name] == (pytest.approx(value) if isinstance(value, float) else value), key
    if train_best:
        trained = trainforge.fit(result.best_config)
        assert trained.status == "finished"
        assert "val/loss" in trained.metrics
    return summary


def busy_resources() -> dict[str, Any]:
    """Each CPU/GPU/memory resource not all free, as (free, total), and the live placement groups."""
    import ray

    free, total = ray.available_resources(), ray.cluster_resources()
    busy: dict[str, Any] = {
        kind: (free.get(kind, 0.0), total.get(kind, 0.0))
        for kind in ("CPU", "memory", "GPU")
        if abs(free.get(kind, 0.0) - total.get(kind, 0.0)) > 1e-6
    }
    if busy:
        groups = ray.util.placement_group_table().values()
        busy["placement groups"] = [(g["placement_group_id"], g["state"]) for g in groups if g["state"] != "REMOVED"]
    return busy


def wait_all_resources_free(timeout_s: float) -> None:
    try:
        wait_until(lambda: not busy_resources(), timeout_s, "every CPU, GPU and byte of memory to be free")
    except TimeoutError as err:
        raise AssertionError(f"{err}; still held: {busy_resources()}") from None


def check_early_stopping(summary: dict[str, Any]) -> None:
    stopped = [t for t in summary["trials"] if t["stopped_early"]]
    assert stopped, "ASHA stopped no trial"
    assert all(t["status"] == "stopped" and t["steps"] < t["budget_steps"] for t in stopped)
    assert summary["compute"]["steps_run"] == sum(t["steps"] for t in summary["trials"])
    assert summary["compute"]["saved_fraction"] > 0


UNEXPECTED_DEATH = "A worker died or was killed while executing a task by an unexpected system error"


def check_no_death_noise(capfd: pytest.CaptureFixture[str]) -> None:
    """Ray prints on the driver's console each worker that died unexpectedly (its error channel,
    whatever log_to_driver says). The trials ASHA stopped, and their warm workers, ended as
    intended: none of that. A worker that really crashes still is reported; its line comes on the
    same channel after any of the search's, so once it is in, the search's would be too."""
    import ray

    @ray.remote(max_retries=0)
    def crash() -> None:
        os._exit(1)

    printed = [capfd.readouterr()]  # the search's output so far
    with pytest.raises(ray.exceptions.WorkerCrashedError):
        ray.get(crash.remote())

    def reported() -> bool:
        printed.append(capfd.readouterr())
        return UNEXPECTED_DEATH in "".join(p.out + p.err for p in printed[1:])

    # Were the search's stops reported too, Ray's deduplication would hold this one back as a repeat.
    wait_until(reported, 60, "Ray's line for a worker that crashed")
    text = "".join(p.out + p.err for p in printed)
    assert text.count(UNEXPECTED_DEATH) == 1, text  # the crash's; none of the search's


def check_mlflow(uri: str, summary: dict[str, Any]) -> None:
    """One parent run for the search, a nested run per trial with its params, metric history,
    final status and stopped-early flag."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (parent,) = client.search_runs(experiments, "tags.`trainforge.kind` = 'search'")
    assert parent.info.run_name == summary["name"] and parent.info.status == "FINISHED"
    assert parent.data.tags["best_trial"] == summary["best"]["trial_id"]
    assert parent.data.metrics["best/val/loss"] == pytest.approx(summary["best"]["last_metric"])
    children = client.search_runs(experiments, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_name = {run.info.run_name: run for run in children}
    assert set(by_name) == {t["trial_id"] for t in summary["trials"]}
    for trial in summary["trials"]:
        run = by_name[trial["trial_id"]]
        assert float(run.data.params["optim.lr"]) == pytest.approx(trial["config"]["optim.lr"])
        history = client.get_metric_history(run.info.run_id, "val/loss")
        assert len(history) >= 2 and history[-1].value == pytest.approx(trial["last_metric"])
        assert run.data.tags["trainforge.stopped_early"] == str(trial["stopped_early"]).lower()
        assert run.data.metrics["tune/stopped_early"] == float(trial["stopped_early"])
        assert run.info.status == ("KILLED" if trial["stopped_early"] else "FINISHED")


def test_optuna_search_with_asha_stops_trials_gives_their_resources_back_and_tracks_them(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Optuna proposes, ASHA stops: early-stopped trials give their CPUs back, and MLflow holds one
    parent run with a child per trial; the stops put no Ray worker-death lines on the console.
    (Random search runs end to end in the PBT test below.)

    Tune decides on a report while the trial trains on (reports reach Tune at most once a second,
    train.report_min_interval_s): a trial of 60 steps on a warm worker group ends in under a second,
    before a stop could land, so these trials are 1,000 steps, several reports long."""
    result = search(
        tmp_path,
        "optuna-asha",
        "train.max_steps=1000",
        "checkpoint.every_n_steps=250",
        "tune.scheduler_params.asha={grace_period: 20, reduction_factor: 2}",
        "tracking.enabled=true",  # the local MLflow store under run.output_dir
        trials=5,
        scheduler="asha",
        search="optuna",
    )
    summary = check_search(result, trials=5)
    check_early_stopping(summary)
    assert summary["search"] == "optuna" and summary["scheduler"] == "asha"
    # Every trial's worker group, early-stopped ones included, gave its CPUs back.
    wait_all_resources_free(60)
    check_mlflow(f"sqlite:///{tmp_path / 'mlflow.db'}", summary)
    check_no_death_noise(capfd)


def test_grid_search_runs_every_grid_point_once(tmp_path: Path) -> None:
    """One trial at a time: the second trains on the warm worker group the first left
    (tune.reuse_workers), and ends bit for bit as the same config run alone on Ray Train's group."""
    result = search(tmp_path, "grid", "tune.max_concurrent=1", trials=2, search="grid", scheduler="none")
    summary = check_search(result, trials=2, train_best=True)
    assert sorted(t["config"]["optim.name"] for t in summary["trials"]) == ["adamw", "sgd"]
    assert all(t["status"] == "finished" and t["steps"] == 60 for t in summary["trials"])

    second = max(summary["trials"], key=lambda t: t["started_at"])
    alone = load_config(Path(second["run_dir"]) / "config.yaml").to_dict()
    alone["run"]["name"] = "second-trial-alone"
    trainforge.fit(alone)
    trained = [
        load_file(str(d / "model.safetensors"))
        for d in (Path(second["run_dir"]), tmp_path / "grid" / "second-trial-alone")
    ]
    assert_bit_identical(*trained)


def test_pbt_exploit_continues_from_the_donor_with_its_own_mutated_lr(tmp_path: Path) -> None:
    result = search(
        tmp_path,
        "pbt",
        "schedule.name=constant",
        "tune.scheduler_params.pbt={perturbation_interval: 30, quantile_fraction: 0.5, synch: true}",
        # Two trials: at the synchronous perturbation at step 30 one is the bottom half and the other
        # the top, so the bottom one exploits the top one every time.
        trials=2,
        scheduler="pbt",
    )
    summary = check_search(result, trials=2)
    assert summary["search"] == "random" and summary["scheduler"] == "pbt"
    exploited = [Path(t["run_dir"]) for t in summary["trials"] if (Path(t["run_dir"]) / "adopted.json").is_file()]
    assert exploited, "PBT exploited no trial"
    for run_dir in exploited:
        adoption = json.loads((run_dir / "adopted.json").read_text())[0]
        donor_state = json.loads((Path(adoption["checkpoint"]) / "trainer_state.json").read_text())
        assert donor_state["components"]["progress"]["global_step"] == adoption["donor_step"]
        reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        resumed = next(
            r for r in reports if any(e.text.startswith(f"resumed from {adoption['checkpoint']}") for e in events_of(r))
        )
        # The weights came from the donor: training continues at the donor's step. Where the
        # exploit came at the donor's last step (PBT may perturb at max_steps too, as trials
        # finish in any order), nothing is left to train and the resumed run reports that step.
        last_step = json.loads((run_dir / "summary.json").read_text())["global_step"]
        continued = adoption["donor_step"] + 1 if adoption["donor_step"] < last_step else last_step
        assert resumed["step"] == continued
        # The lr in effect is the trial's own, mutated one, not the donor's.
        own_lr = json.loads((run_dir / "summary.json").read_text())["config"]["optim"]["lr"]
        assert resumed["train/lr"] == pytest.approx(own_lr)
        assert own_lr != pytest.approx(donor_state["config"]["optim"]["lr"])
