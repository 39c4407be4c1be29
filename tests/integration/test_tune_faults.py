"""Faults during a search: a trial's worker killed (the trial resumes from its own checkpoint) and the
search driver killed (running the command again continues the search)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import yaml
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

import trainforge
from tests.helpers.faults import Fault, checkpoints, events_of, paced_run, signal_a_worker, wait_until
from tests.helpers.timing import scaled
from trainforge.tune.placement import RecordPlacementGroups, release, start_ledger

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SPACE = {"optim.lr": {"loguniform": [1.0e-3, 1.0e-2]}}


def trial_dirs(search_dir: Path) -> list[Path]:
    return sorted(p for p in search_dir.glob("*_*") if p.is_dir() and not p.name.startswith("."))


def resumes(run_dir: Path) -> list[str]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    texts = [e.text for line in lines for e in events_of(json.loads(line))]
    return [text for text in texts if text.startswith("resumed from")]


@pytest.mark.usefixtures("ray_local")
def test_a_trial_whose_worker_dies_resumes_from_its_own_checkpoint(tmp_path: Path) -> None:
    config = paced_run(tmp_path, run={"name": "faulty"}, tracking={"enabled": False})
    search_dir = tmp_path / "faulty"

    def two_checkpoints() -> bool:
        return any(len(checkpoints(run_dir)) >= 2 for run_dir in trial_dirs(search_dir))

    with Fault(two_checkpoints, lambda: signal_a_worker(signal.SIGKILL)) as fault:
        result = trainforge.tune(config, SPACE, trials=1)
        fault.join()

    (trial,) = result.trials
    assert trial["status"] == "finished" and trial["steps"] == 60
    run_dir = Path(trial["run_dir"])
    assert json.loads((run_dir / "summary.json").read_text())["restarts"] >= 1
    assert resumes(run_dir) and all(e.startswith(f"resumed from {run_dir}/checkpoint_") for e in resumes(run_dir))


def test_an_interrupted_search_continues_when_the_command_runs_again(tmp_path: Path) -> None:
    config = paced_run(
        tmp_path,
        run={"name": "interrupted"},
        model={"kwargs": {"delay_s": 0.1}},
        tracking={"enabled": False},
        tune={"num_trials": 2, "max_concurrent": 2},  # both at once: one start-up's wait, not two
    )
    (tmp_path / "search.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    command = [
        sys.executable,
        "-m",
        "trainforge",
        "tune",
        str(tmp_path / "search.yaml"),
        "--space",
        str(tmp_path / "space.yaml"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    search_dir = tmp_path / "interrupted"

    def first_checkpointed_trial() -> Path | None:
        """The trial directory that saved first, once the search has recorded its state."""
        if driver.poll() is not None:  # the event can no longer come: say why now, not at the timeout
            raise RuntimeError(f"the search exited with {driver.returncode} first: {log.read_text()[-3000:]}")
        if not list(search_dir.glob("experiment_state-*.json")):
            return None
        return next((d for d in trial_dirs(search_dir) if checkpoints(d)), None)

    # Its output to a file: a pipe nobody reads fills up (64 KiB) and blocks the search mid-start.
    log = tmp_path / "first-driver.log"
    with log.open("w") as sink:
        driver = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=sink, text=True)
    try:
        interrupted: Path = wait_until(first_checkpointed_trial, 300, "a trial's first checkpoint")
        ray_processes = psutil.Process(driver.pid).children(recursive=True)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=scaled(30))
    finally:
        if driver.poll() is None:
            driver.kill()
    for leftover in ray_processes:  # the killed driver's local Ray, whatever did not die with it
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    assert not (search_dir / "tune_summary.json").exists()

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(900), check=False)

    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing 2 trial(s)" in again.stderr
    # Not a terminal: one line per trial event instead of the live table, and the final table.
    assert f"trial {interrupted.name} started" in again.stderr
    assert again.stderr.count("finished at step 60") >= 1
    assert "steps run 120 of 120 without early stopping" in again.stderr
    summary = json.loads((search_dir / "tune_summary.json").read_text())
    assert len(summary["trials"]) == 2
    assert all(t["status"] == "finished" and t["steps"] == 60 for t in summary["trials"])
    assert any(e.startswith(f"resumed from {interrupted}/checkpoint_") for e in resumes(interrupted))


class HoldWorkerGroupStart(WorkerGroupCallback):
    """Keeps a worker group's start open after its placement group was created, as a loaded
    machine does while workers import torch: the window in which a stopped trial's controller
    dies before it could record its group."""

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        time.sleep(300)
        return {}


@ray.remote(num_cpus=0.01)
class StandInTrial:
    """What Tune runs for a trial: an actor that is the driver of a Ray Train run."""

    def run(self, ledger: Any, storage: str) -> None:
        from ray.train.v2.api.config import RunConfig, ScalingConfig
        from ray.train.v2.torch.torch_trainer import TorchTrainer

        callbacks = [RecordPlacementGroups(ledger, "stand-in"), HoldWorkerGroupStart()]
        run_config = RunConfig(name="held", storage_path=storage, callbacks=callbacks)
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1), run_config=run_config).fit()


@pytest.mark.usefixtures("ray_local")
def test_a_trial_stopped_before_its_worker_group_started_gives_its_group_back(tmp_path: Path) -> None:
    """The group was created but never recorded (the controller died first): release still finds
    it, through the GCS's record of its dead creator, every time."""
    ledger = start_ledger()
    trial = StandInTrial.remote()  # type: ignore[attr-defined]
    trial.run.remote(ledger, str(tmp_path))

    def live_groups() -> list[str]:
        return [g for g, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]

    (group,) = wait_until(live_groups, 120, "the trial's worker group to create its placement group")
    ray.kill(trial)  # Tune stopping the trial: its controller dies with it, the group stays
    release(ledger, ["stand-in"])
    assert ray.util.placement_group_table()[group]["state"] == "REMOVED"
    try:
        wait_until(
            lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"], 30, "every CPU to be free"
        )
    except TimeoutError as err:  # once in a loaded CI run (86 s); not reproduced: say what holds them
        raise AssertionError(f"{err}: {cpu_holders()}") from None


def cpu_holders() -> str:
    """The Ray's free and total resources, its live actors and placement groups: what a failure names."""
    from ray._private import state

    actors = [
        f"{a['ActorClassName']} {a['State']} pid {a['Pid']}" for a in state.actors().values() if a["State"] != "DEAD"
    ]
    groups = {group: info["state"] for group, info in ray.util.placement_group_table().items()}
    return f"available {ray.available_resources()}, total {ray.cluster_resources()}; actors {actors}; groups {groups}"
