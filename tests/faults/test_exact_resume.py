"""A run killed mid-epoch and resumed ends bit-identical to the same run uninterrupted.

Faults are real: SIGKILL of one Ray Train worker process (Ray restarts the group, trainforge
restores the newest valid checkpoint), and SIGTERM of the driver followed by re-running the
same command. Both on the richest variant (2 workers, accumulation, bf16, loader workers).

The other layouts resume bit-identical in the worker's Session in gloo ranks without Ray, crashed
by an exception out of the loop and restarted in new processes (the restore and the arithmetic
are the same code; Ray would add ~18 s of start-up per run): 1 worker and tensor parallel below,
FSDP in tests/unit/test_session.py, a custom step under DDP below (under FSDP through Ray).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

import trainforge
from tests.helpers.faults import events_of, kill_a_worker_after, paced_run, wait_until
from tests.helpers.ranks import spawn_ranks
from tests.helpers.sessions import assert_bit_identical, checkpoint_state, run_dir_of, sessions, train
from tests.helpers.timing import scaled
from trainforge.cli.run import STOPPED_EXIT

ROOT = Path(__file__).resolve().parents[2]
# checkpoint.encryption's key, read by the workers from their environment: set before this module's
# Ray starts (ray_local), so the workers inherit it as they would a node's.
KEY_ENV = "TRAINFORGE_TEST_CHECKPOINT_KEY"
os.environ.setdefault(KEY_ENV, bytes(range(32)).hex())


def paced_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    """``paced_run`` with a checkpoint every 20 steps: step 20 is mid-epoch in every variant below."""
    config = paced_run(tmp_path, checkpoint={"every_n_steps": 20})
    config["model"]["kwargs"] = {"delay_s": 0.03}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    return config


TWO_WORKERS = {
    "scaling": {"num_workers": 2},
    "train": {"grad_accum_steps": 2},
    "precision": "bf16",
    "data": {"num_workers": 2},
}


# Tensor parallel over both workers, with the user's own plan for the paced model.
TWO_WORKERS_TP = {
    "scaling": {"num_workers": 2},
    "parallel": {"tensor_parallel": 2, "tp_plan": "tests.helpers.user_models:paced_tp_plan"},
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, dict], trainforge.RunResult]:
    """The uninterrupted run of a variant, trained once per module (two tests compare with it)."""
    done: dict[str, trainforge.RunResult] = {}

    def run(label: str, sections: dict) -> trainforge.RunResult:
        if label not in done:
            done[label] = trainforge.fit(paced_config(tmp_path_factory.mktemp(f"straight-{label}"), **sections))
        return done[label]

    return run


def state_at(run_dir: Path, step: int, key_env: str | None) -> dict[str, torch.Tensor]:
    """``checkpoint_state`` of the run's checkpoint at ``step``, through a decrypted copy when the
    run encrypted its checkpoints with the key in ``key_env``."""
    if key_env is None:
        return checkpoint_state(run_dir, step)
    from trainforge.checkpoint.crypto import FileCipher
    from trainforge.checkpoint.storage import CheckpointStore

    store = CheckpointStore.from_uri(str(run_dir), FileCipher.from_env(key_env))
    opened = run_dir.parent / "opened"
    with store.opened(run_dir / f"checkpoint_{step:09d}") as plain:
        for rel in plain.listing():  # the test's own plaintext copy, to read as a directory
            (opened / plain.name / rel).parent.mkdir(parents=True, exist_ok=True)
            with plain.open(rel) as source:
                (opened / plain.name / rel).write_bytes(source.read())
    return checkpoint_state(opened, step)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    ("key_env", "warm", "replace"),
    [(None, False, "worker"), (KEY_ENV, True, "group")],
    ids=["replaced", "warm-encrypted"],
)
def test_worker_killed_mid_epoch_resumes_bit_identical(
    tmp_path: Path,
    straight: Callable[[str, dict], trainforge.RunResult],
    key_env: str | None,
    warm: bool,
    replace: str,
) -> None:
    """Replaced (failure.replace: worker): Ray Train replaces the killed worker alone; the other
    keeps its process, rejoins the process group with the replacement (worker/rejoin.py), and the
    run is the uninterrupted one's, bit for bit. Warm and encrypted (scaling.reuse_workers,
    checkpoint.encryption): the run trains on a warm worker group (driver/warm.py), one of whose
    workers is killed; it continues under Ray Train's new group from the newest checkpoint, sealed
    and decrypted with the key from the workers' environment, bit for bit the uninterrupted
    plaintext Ray Train run. (One case for the two: each alone was a run of its own.)

    Correctness only: the run records one recovery (``recovery_s``) and how long it took is not
    judged here, since it depends on how loaded the machine is. Recovery time is a benchmark's
    (docs/operations.md, "Measured recovery times"); ``pytest -s`` prints this run's."""
    label, sections = "2-workers-accum-bf16-loader-workers", TWO_WORKERS
    reference = straight(label, sections)  # plaintext, uninterrupted, Ray Train's worker group
    run_dir = tmp_path / "killed" / "t"
    killed = kill_a_worker_after(run_dir / "checkpoint_000000020")
    if key_env is not None:
        sections = {**sections, "checkpoint": {"every_n_steps": 20, "encryption": {"key_env": key_env}}}
    if warm:
        sections = {**sections, "scaling": {**sections["scaling"], "reuse_workers": True}}
    sections = {**sections, "failure": {"replace": replace}}
    resumed = trainforge.fit(paced_config(tmp_path / "killed", **sections))
    if warm:
        assert "WarmWorker" in killed.get("title", ""), killed
    if replace == "worker":
        rejoined = [line for line in (run_dir / "workers.log").read_text().splitlines() if "rejoining" in line]
        assert len(rejoined) == 1, rejoined  # the survivor kept its process: one of the workers that was not killed
        said = re.search(r"\(pid (\d+)\)", rejoined[0])
        assert said is not None and int(said.group(1)) in set(killed["pids"]) - {killed["pid"]}, (rejoined, killed)

    assert killed, "no worker was killed"
    summary = resumed.summary
    assert summary["status"] == "finished"
    assert summary["restarts"] == 1
    assert len(summary["recovery_s"]) == 1, summary["recovery_s"]
    print(
        f"\nworker killed ({'warm' if warm else 'Ray Train'} group, failure.replace {replace}): "
        f"recovery_s {summary['recovery_s']}"
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    events = [e.text for line in lines for e in events_of(json.loads(line))]
    assert any(e.startswith("resumed from") and "checkpoint_0000000" in e for e in events), events
    # The epoch is 1438 / world / (batch x accum) steps long: step 20 is mid-epoch in every variant.
    assert_bit_identical(checkpoint_state(reference.run_dir, 60), state_at(run_dir, 60, key_env))
    # The run directory's weights are the run's product: decrypted, as the plaintext run's.
    assert torch.equal(
        load_file(str(reference.model_path))["inner.4.weight"], load_file(str(resumed.model_path))["inner.4.weight"]
    )
    if key_env is not None:
        from trainforge.checkpoint.crypto import MAGIC

        for name in ("model.safetensors", "trainer_state.json"):
            assert (run_dir / "checkpoint_000000060" / name).read_bytes().startswith(MAGIC), name
        key = os.environ[key_env]
        for path in (tmp_path / "killed").rglob("*"):
            if path.is_file():
                assert key.encode() not in path.read_bytes() and bytes(range(32)) not in path.read_bytes(), path


# A model that owns its step (model.task: custom) on dict batches, through real Ray workers.
CUSTOM_STEP = {
    "scaling": {"num_workers": 2},
    "model": {
        "name": None,
        "factory": "tests.helpers.user_models:paced_own_step",
        "kwargs": {"delay_s": 0.03},
        "task": "custom",
    },
    "data": {"name": "factory", "factory": "tests.helpers.user_data:digits_dicts"},
}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_custom_step_worker_killed_mid_epoch_resumes_bit_identical(
    tmp_path: Path, straight: Callable[[str, dict], trainforge.RunResult]
) -> None:
    """Under FSDP, through Ray; under DDP in gloo ranks without Ray (the session test below)."""
    sections = {**CUSTOM_STEP, "parallel": {"strategy": "fsdp"}}
    reference = straight("custom-step-fsdp", sections)
    run_dir = tmp_path / "killed" / "t"
    killed = kill_a_worker_after(run_dir / "checkpoint_000000020")
    resumed = trainforge.fit(paced_config(tmp_path / "killed", **sections))

    assert killed, "no worker was killed"
    assert resumed.summary["status"] == "finished" and resumed.summary["restarts"] == 1
    assert {"train/accuracy", "val/accuracy"} <= resumed.summary["final_metrics"].keys()
    assert_bit_identical(checkpoint_state(reference.run_dir, 60), checkpoint_state(run_dir, 60))


PHASES = ("torch and Ray imported", "Ray ready")  # the console's lines for two start-up phases


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_driver_stopped_and_rerun_resumes_bit_identical(
    tmp_path: Path, straight: Callable[[str, dict], trainforge.RunResult]
) -> None:
    """SIGTERM to `trainforge train` checkpoints and stops, exit code 3, its last line the command
    that resumes it; that command then finishes the run. The console's first line comes before the
    imports and Ray's start, then a line per start-up phase; validations are said as they start."""
    config = paced_config(tmp_path / "cli", **TWO_WORKERS)
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    command = [sys.executable, "-m", "trainforge", "train", str(path)]
    run_dir = tmp_path / "cli" / "t"

    log = tmp_path / "first.log"  # a file, not a pipe nobody reads while the run goes on
    with log.open("w") as sink:
        first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=sink, text=True)

    def saved_at_20() -> bool:
        if first.poll() is not None:
            raise RuntimeError(f"the run exited with {first.returncode} before step 20: {log.read_text()[-3000:]}")
        return (run_dir / "checkpoint_000000020").exists()

    wait_until(saved_at_20, 180, "the checkpoint at step 20")
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=scaled(180))
    said = log.read_text().splitlines()
    assert first.returncode == STOPPED_EXIT, said[-20:]
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["status"] == "stopped"
    assert 20 <= stopped["global_step"] < 60
    assert said[0].startswith("trainforge: training t on 2 worker(s)"), said[:5]
    imported, ray_ready = (next(i for i, line in enumerate(said) if line.endswith(f"  {phase}")) for phase in PHASES)
    assert 0 < imported < ray_ready, said[: ray_ready + 1]  # the first line before the imports ended
    resume = f"trainforge train {path}"
    assert said[-1] == f"stopped at step {stopped['global_step']}; to resume: {resume}", said[-5:]

    second = subprocess.run(
        [*command[:3], *shlex.split(resume)[1:]],  # the command it said, as `python -m trainforge`
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
        check=False,
    )
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr
    assert "validating at step 60…" in second.stderr and "validation at step 60: loss " in second.stderr
    finished = json.loads((run_dir / "summary.json").read_text())
    assert finished["status"] == "finished" and finished["global_step"] == 60

    reference = straight("2-workers-accum-bf16-loader-workers", TWO_WORKERS)
    assert_bit_identical(checkpoint_state(reference.run_dir, 60), checkpoint_state(run_dir, 60))


@pytest.mark.slow
@pytest.mark.parametrize(
    "sections",
    [{"scaling": {"num_workers": 1}}, TWO_WORKERS_TP, {**CUSTOM_STEP, "parallel": {"strategy": "ddp"}}],
    ids=["1-worker", "2-workers-tp2", "2-workers-custom-step-ddp"],
)
def test_session_crashed_mid_epoch_restarts_bit_identical(tmp_path: Path, sections: dict) -> None:
    def config(where: str) -> dict[str, Any]:
        unpaced = paced_config(tmp_path / where, **sections)
        unpaced["model"]["kwargs"] = {"delay_s": 0.0}  # nothing acts mid-run from outside
        return unpaced

    straight, crashed = config("straight"), config("crashed")
    workers = sections["scaling"]["num_workers"]
    # The straight run, then the same run crashing at its first report after step 20's checkpoint.
    first = spawn_ranks(sessions, workers, [(straight, None), (crashed, 21)])[0]
    assert first[0].final["status"] == "finished"
    assert first[1].crashed and first[1].final["crashed"] == "crashed at step 25"
    resumed = train(crashed, workers)[0]

    assert resumed.final["status"] == "finished" and resumed.final["step"] == 60
    assert any(e.startswith("resumed from") and "checkpoint_000000020" in e for e in resumed.events), resumed.events
    assert_bit_identical(checkpoint_state(run_dir_of(straight), 60), checkpoint_state(run_dir_of(crashed), 60))
