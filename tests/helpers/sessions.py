"""The worker's Session in gloo ranks without Ray: what a Ray Train worker group runs, minus the
~18 s of Ray start-up per run (controller, worker actors, gloo init through Ray).

``train(config, workers)`` runs one Session per rank in fresh processes (spawn_ranks) and returns
every rank's outcome; several configs in one call run one after another in the same processes
(one start-up for a batch of reference runs). A crash is a real exception out of the loop at a
report (``crash_at``: the first report at or after that step), as a killed worker group ends in
Ray; the restart is the next call: a new set of processes restoring from the run's checkpoints.
Each run writes its checkpoints under ``<run.output_dir>/<run.name>`` as a Ray run does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.ranks import spawn_ranks
from trainforge.protocol import Report


class Crash(Exception):
    pass


class ListChannel:
    """Reports kept in a list; raises at ``crash_at`` (a step) as a lost worker would end the loop."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.reports: list[Report] = []
        self.crash_at = crash_at

    def report(self, report: Report) -> None:
        self.reports.append(report)
        if self.crash_at is not None and report.step >= self.crash_at:
            raise Crash(f"crashed at step {report.step}")

    def preempted(self) -> bool:
        return False


@dataclass
class Outcome:
    """One rank's view of one run: its last metrics (scalars), the events and per-step losses of
    its reports, and whether it crashed."""

    final: dict[str, Any]
    events: list[str] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    crashed: bool = False
    parameters: dict[str, int] | None = None  # the final report's trainable and frozen counts
    report: dict[str, Any] = field(default_factory=dict)  # the final report, as metrics.jsonl has it
    val_losses: dict[int, float] = field(default_factory=dict)  # val/loss by step
    notes: list[str] = field(default_factory=list)  # how the parallel plan laid the model out


def session(rank: int, world: int, config_dict: dict[str, Any], crash_at: int | None = None) -> Outcome:
    """One rank's Session, built and restored as ``run_worker`` does in a Ray Train worker."""
    from trainforge.checkpoint.storage import CheckpointStore
    from trainforge.config import Config
    from trainforge.worker.build import build
    from trainforge.worker.loop import Session
    from trainforge.worker.saving import Checkpointing, restore

    cfg = Config.model_validate(config_dict)
    run = build(cfg, ranks=(rank, world))
    checkpointing = Checkpointing(run, CheckpointStore.for_run(cfg.storage_path, cfg.run.name))
    restored = restore(run, checkpointing.store)
    channel = ListChannel(crash_at)
    crashed = False
    final: dict[str, Any]
    try:
        final = Session(run, checkpointing, restored, channel=channel).train().to_json()
    except Crash as err:
        final, crashed = {"crashed": str(err)}, True
    finally:
        checkpointing.close()
    losses = {
        int(point["step"]): float(point["train/loss"])
        for report in channel.reports
        for point in report.history
        if "train/loss" in point
    }
    val_losses = {
        int(point["step"]): float(point["val/loss"])
        for report in channel.reports
        for point in report.history
        if "val/loss" in point
    }
    return Outcome(
        final={k: v for k, v in final.items() if isinstance(v, (int, float, str))},
        events=[e.text for r in channel.reports for e in r.events],
        losses=losses,
        crashed=crashed,
        parameters=final.get("parameters"),
        report=final,
        val_losses=val_losses,
        notes=list(run.plan.notes),
    )


def sessions(rank: int, world: int, runs: list[tuple[dict[str, Any], int | None]]) -> list[Outcome]:
    return [session(rank, world, config, crash_at) for config, crash_at in runs]


def train(config: dict[str, Any], workers: int, crash_at: int | None = None) -> list[Outcome]:
    """One run in ``workers`` gloo ranks; every rank's outcome, in rank order."""
    return [by_rank[0] for by_rank in spawn_ranks(sessions, workers, [(config, crash_at)])]


def train_all(configs: list[dict[str, Any]], workers: int) -> list[Outcome]:
    """Several runs one after another in the same ``workers`` processes; rank 0's outcome of each."""
    return spawn_ranks(sessions, workers, [(config, None) for config in configs])[0]


@dataclass
class Trained:
    """A run of a module's shared set: its config and rank 0's outcome."""

    config: dict[str, Any]
    outcome: Outcome

    @property
    def run_dir(self) -> Path:
        return run_dir_of(self.config)


def train_each_once(configs: dict[str, dict[str, Any]]) -> dict[str, Trained]:
    """Every run once, those of one world size (``scaling.num_workers``) one after another in the
    same ranks: one process start-up per world size, not per run (each run builds and seeds itself
    afresh, so the order changes nothing)."""
    trained = {}
    for world in sorted({workers(config) for config in configs.values()}):
        names = [name for name, config in configs.items() if workers(config) == world]
        for name, outcome in zip(names, train_all([configs[name] for name in names], world), strict=True):
            trained[name] = Trained(configs[name], outcome)
    return trained


def workers(config: dict[str, Any]) -> int:
    return int(config.get("scaling", {}).get("num_workers", 1))


def run_dir_of(config: dict[str, Any]) -> Path:
    return Path(config["run"]["output_dir"]) / config["run"]["name"]


def final_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full weights of the run's last checkpoint: what the driver copies to ``model.safetensors``."""
    last = sorted(run_dir_of(config).glob("checkpoint_*"))[-1]
    return load_file(str(last / "model.safetensors"))


def checkpoint_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the checkpoint at ``step``, flattened to one dict (a sharded
    checkpoint's shards merged on this process)."""
    checkpoint = run_dir / f"checkpoint_{step:09d}"
    state = {f"model/{k}": v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    if (checkpoint / "sharded").is_dir():
        merged = run_dir / f"merged-{step}.pt"
        dcp_to_torch_save(checkpoint / "sharded", merged)
        sharded = torch.load(merged, weights_only=False)
        state.update({f"shards/model/{k}": v for k, v in sharded["model"].items()})
        slots_by_param = (sharded.get("optimizer") or sharded["optim"])["state"]  # format 3 or 2
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
