"""Real checkpoints for tests: what a run's components hand the writer (a ``Snapshot``), and a
full-layout checkpoint directory written from one by hand, as the writer lays it out: the shared
tensor files, ``trainer_state.json``, the manifest last."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from torch import nn

from trainforge.checkpoint.format import write_json_hashed, write_manifest
from trainforge.checkpoint.schema import FULL, STATE_FILE
from trainforge.checkpoint.state import (
    Record,
    Snapshot,
    State,
    capture_rng,
    model_snapshot,
    snapshot_tensors,
    tensor_file,
    write_tensors,
)
from trainforge.checkpoint.writer import state_file

# The files the model and optimizer components write in the full layout (checkpoint/ names none).
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
# The record of the config that wrote the test checkpoints (a small part of one).
CONFIG = {"model": {"name": "mlp"}, "train": {"batch_size": 8}, "seed": 0}
BATCH = 8  # samples per step of the one worker


def snapshot(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, metrics: dict[str, float] | None = None
) -> Snapshot:
    """What the components of a one-worker ddp run (``worker/registry.py``, in its order) give at
    ``step``: host copies of the weights and the optimizer's state, the RNG of this process."""
    states = {
        "progress": State({"global_step": step, "samples_seen": step * BATCH}),
        "data": State(
            {"epoch": step // 10, "position": BATCH, "world_size": 1, "micro_batch_size": BATCH, "grad_accum_steps": 1}
        ),
        "model": State(tensors=model_snapshot(model)),
        "optimizer": State({"name": type(optimizer).__name__.lower()}, snapshot_tensors(optimizer.state_dict())),
        "schedule": State({"last_epoch": step, "base_lrs": [0.01], "_step_count": step + 1, "_last_lr": [0.01]}),
        "scaler": State({}),
        "rng": State(rank_values=capture_rng()),
    }
    record = Record(plan="ddp", metrics=dict(metrics or {}), config=CONFIG, versions={"torch": torch.__version__})
    return Snapshot(step, step // 10, FULL, states, record=record, exports={MODEL_FILE: "model"})


def write_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A complete full-layout checkpoint of ``model`` and ``optimizer`` at ``step`` in
    ``directory``; returns its manifest. ``metrics`` go into the manifest only (what rotation and
    listings read), so a test may give values no writer would."""
    written = snapshot(model, optimizer, step)
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, state in written.states.items():
        if state.tensors is not None:
            rel = tensor_file(name, state.tensors)
            files[rel] = write_tensors(directory / rel, state.tensors)
    ranks = [{name: state.rank_values for name, state in written.states.items() if state.rank_values is not None}]
    write_json_hashed(directory / STATE_FILE, state_file(written, ranks, files))
    meta = {"global_step": step, "epoch": written.epoch, "metrics": metrics or {}, "created_at": time.time()}
    return write_manifest(directory, meta)


def load_weights(directory: Path, model: nn.Module) -> None:
    """The model component's weights of a full-layout checkpoint into ``model`` (strict; tied
    weights restored from the one stored copy)."""
    load_model(model, str(directory / MODEL_FILE), strict=True)


def load_optimizer(directory: Path, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer component's state of a full-layout checkpoint into ``optimizer``."""
    optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
