"""A run killed mid-epoch and resumed ends bit-identical to the same run uninterrupted.

Faults are real: SIGKILL of one Ray Train worker process (Ray restarts the group, trainforge
restores the newest valid checkpoint), and SIGTERM of the driver followed by re-running the
same command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import trainforge
from tests.helpers.faults import kill_a_worker_after, paced_run

ROOT = Path(__file__).resolve().parents[2]


def paced_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    """``paced_run`` with a checkpoint every 20 steps: step 20 is mid-epoch in every variant below."""
    config = paced_run(tmp_path, checkpoint={"every_n_steps": 20})
    config["model"]["kwargs"] = {"delay_s": 0.03}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    return config


def final_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the checkpoint at ``step``, flattened to one dict (a sharded
    checkpoint's shards merged on this process)."""
    checkpoint = run_dir / f"checkpoint_{step:09d}"
    state = {f"model/{k}": v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    if (checkpoint / "sharded").is_dir():
        merged = run_dir / f"merged-{step}.pt"
        dcp_to_torch_save(checkpoint / "sharded", merged)
        sharded = torch.load(merged, weights_only=False)
        state.update({f"shards/model/{k}": v for k, v in sharded["model"].items()})
        slots_by_param = sharded["optim"]["state"]
    else:
        slots_by_param = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    for index, slots in slots_by_param.items():
        for key, value in slots.items():
            state[f"optim/{index}/{key}"] = torch.as_tensor(value)
    return state


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differs after resume: {different[:5]}"


TWO_WORKERS = {
    "scaling": {"num_workers": 2},
    "train": {"grad_accum_steps": 2},
    "precision": "bf16",
    "data": {"num_workers": 2},
}


TWO_WORKERS_FSDP = {"scaling": {"num_workers": 2}, "parallel": {"strategy": "fsdp"}}
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


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    ("label", "sections"),
    [
        ("1-worker", {"scaling": {"num_workers": 1}}),
        ("2-workers-accum-bf16-loader-workers", TWO_WORKERS),
        ("2-workers-fsdp", TWO_WORKERS_FSDP),
        ("2-workers-tp2", TWO_WORKERS_TP),
    ],
)
def test_worker_killed_mid_epoch_resumes_bit_identical(
    tmp_path: Path, label: str, sections: dict, straight: Callable[[str, dict], trainforge.RunResult]
) -> None:
    reference = straight(label, sections)
    run_dir = tmp_path / "killed" / "t"
    killed = kill_a_worker_after(run_dir / "checkpoint_000000020")
    resumed = trainforge.fit(paced_config(tmp_path / "killed", **sections))

    assert killed, "no worker was killed"
    summary = resumed.summary
    assert summary["status"] == "finished"
    assert summary["restarts"] == 1
    assert len(summary["recovery_s"]) == 1 and summary["recovery_s"][0] < 60
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    events = [e for line in lines for e in json.loads(line).get("events", [])]
    assert any(e.startswith("resumed from") and "checkpoint_0000000" in e for e in events), events
    # The epoch is 1438 / world / (batch x accum) steps long: step 20 is mid-epoch in every variant.
    assert_bit_identical(final_state(reference.run_dir, 60), final_state(run_dir, 60))
    assert torch.equal(
        load_file(str(reference.model_path))["inner.4.weight"], load_file(str(resumed.model_path))["inner.4.weight"]
    )


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_driver_stopped_and_rerun_resumes_bit_identical(
    tmp_path: Path, straight: Callable[[str, dict], trainforge.RunResult]
) -> None:
    """SIGTERM to `trainforge train` checkpoints and stops; the same command then finishes the run."""
    config = paced_config(tmp_path / "cli", **TWO_WORKERS)
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    command = [sys.executable, "-m", "trainforge", "train", str(path)]
    run_dir = tmp_path / "cli" / "t"

    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoint_000000020").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=180)
    assert first.returncode == 0, stderr
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["status"] == "stopped"
    assert 20 <= stopped["global_step"] < 60

    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr
    finished = json.loads((run_dir / "summary.json").read_text())
    assert finished["status"] == "finished" and finished["global_step"] == 60

    reference = straight("2-workers-accum-bf16-loader-workers", TWO_WORKERS)
    assert_bit_identical(final_state(reference.run_dir, 60), final_state(run_dir, 60))
