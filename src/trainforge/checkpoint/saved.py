"""What a checkpoint holds, read back as components, whatever format wrote it.

Format 3 is ``{component: state}`` already. Formats 1 and 2 kept fixed fields (progress, scheduler,
scaler, every rank's RNG) and fixed files (``model.safetensors``, ``optimizer.pt``, format 2's
``sync.pt``): :func:`saved_from` maps them onto the same components, so restore has one path and
a checkpoint written by an earlier release resumes as it did (tests/unit/test_checkpoint_format2.py).
No torch here: ``trainforge ckpt`` reads these without loading a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.checkpoint.schema import (
    FULL,
    MANIFEST,
    MAX_STATE_BYTES,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SHARDED,
    SHARDED_DIR,
    STATE_FILE,
    SYNC_FILE,
    ComponentFiles,
    ComponentSchemas,
    StateFile,
    TrainerStateFile,
    check_components,
    open_regular,
    parse_trainer_state,
)
from trainforge.errors import CheckpointError

# Format 2's sharded checkpoints keep the optimizer's state under "optim" in DCP's shards.
FORMAT_2_SHARD_KEYS = {"optimizer": "optim"}


@dataclass(frozen=True)
class Saved:
    """A checkpoint's ``trainer_state.json`` as components: each component's state (the same on
    every rank), each rank's own, where the tensors are, and the record."""

    format_version: int
    step: int
    epoch: int
    world: int  # the workers that wrote it
    layout: str  # full or sharded
    plan: str  # the writers' parallel layout, for people: ddp, fsdp, ddp x tp2
    tensor_parallel: int  # the size of their tensor-parallel groups
    components: dict[str, dict[str, Any]]
    ranks: list[dict[str, dict[str, Any]]]
    files: dict[str, ComponentFiles] = field(default_factory=dict)
    exports: dict[str, str] = field(default_factory=dict)  # run-directory file <- checkpoint file
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def shard_key(self, component: str) -> str:
        """The key a component's tensors have in the DCP shards."""
        return FORMAT_2_SHARD_KEYS.get(component, component) if self.format_version < 3 else component

    @property
    def legacy_sync(self) -> bool:
        """Format 2's ``sync.pt``: parallel.sync's state with every rank's own in one file."""
        return self.format_version < 3 and SYNC_FILE in {f.tensors for f in self.files.values()}


def read_saved(
    directory: Path, schemas: Mapping[str, ComponentSchemas] | None = None, layout: str | None = None
) -> Saved:
    """``trainer_state.json`` of a local checkpoint directory, bounded and schema-checked (each
    component's state too, when ``schemas`` are given); CheckpointError when it does not load.
    ``layout``: the manifest's (found from the directory when not given)."""
    with open_regular(directory / STATE_FILE, STATE_FILE) as handle:
        raw = handle.read(MAX_STATE_BYTES + 1)
    if layout is None:
        layout = SHARDED if (directory / SHARDED_DIR).is_dir() else FULL
    files = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {MANIFEST}
    return saved_from(raw, layout, files, schemas)


def saved_from(
    raw: bytes, layout: str, files: set[str], schemas: Mapping[str, ComponentSchemas] | None = None
) -> Saved:
    """The components of ``trainer_state.json``'s bytes, in a checkpoint of ``layout`` holding
    ``files``; CheckpointError naming what is wrong."""
    parsed, data = parse_trainer_state(raw)
    format_3 = isinstance(parsed, StateFile)
    saved = _from_format_3(parsed) if format_3 else _from_format_2(parsed, data, layout, files)  # type: ignore[arg-type]
    missing = sorted(_listed(saved) - files)
    if missing:
        raise CheckpointError(f"{STATE_FILE} names {missing[0]}, which the checkpoint does not hold")
    if schemas is not None:
        # format 2's sync.pt holds that component's values too: its load checks them (checkpoint/reader.py)
        own = {n: v for n, v in saved.components.items() if not (saved.legacy_sync and n == "sync")}
        check_components(own, saved.ranks, schemas)
    return saved


def _listed(saved: Saved) -> set[str]:
    found = {where.tensors for where in saved.files.values() if where.tensors not in (None, SHARDED)}
    found |= set(saved.exports.values())
    return {name for name in found if name is not None}


def _from_format_3(state: StateFile) -> Saved:
    return Saved(
        format_version=3,
        step=state.global_step,
        epoch=state.epoch,
        world=state.world_size,
        layout=state.layout,
        plan=state.plan,
        tensor_parallel=state.tensor_parallel,
        components={name: dict(values) for name, values in state.components.items()},
        ranks=[{name: dict(values) for name, values in mine.items()} for mine in state.ranks],
        files=dict(state.files),
        exports=dict(state.exports),
        metrics={k: float(v) for k, v in state.metrics.items()},
        config=state.config,
        versions=dict(state.versions),
    )


def _from_format_2(state: TrainerStateFile, data: dict[str, Any], layout: str, files: set[str]) -> Saved:
    """Format 1 and 2's fixed fields as the components that hold them now (the values as written:
    ``data`` is the parsed JSON, ``state`` its checked schema)."""
    progress = state.progress
    parallel = state.config.get("parallel", {})
    parallel = parallel if isinstance(parallel, dict) else {}
    tp = parallel.get("tensor_parallel", 1)
    tp = tp if isinstance(tp, int) and tp >= 1 else 1
    plan = str(parallel.get("strategy", "ddp")) + (f" x tp{tp}" if tp > 1 else "")
    optim = state.config.get("optim", {})
    position = {
        "epoch": progress.epoch,
        "position": progress.epoch_position,
        # the data was split over the writer's data-parallel ranks
        "world_size": max(1, progress.world_size // tp),
        "micro_batch_size": progress.micro_batch_size,
        "grad_accum_steps": progress.grad_accum_steps,
    }
    components: dict[str, dict[str, Any]] = {
        "progress": {"global_step": progress.global_step, "samples_seen": progress.samples_seen},
        "data": {k: v for k, v in position.items() if v is not None},
        "model": {},
        "optimizer": {"name": optim["name"]} if isinstance(optim.get("name"), str) else {},
        "schedule": {k: v for k, v in data["scheduler"].items() if k != "lr_lambdas"},
        "scaler": dict(data["scaler"]),
        "rng": {},  # each rank's own, below
    }
    where = SHARDED if layout == SHARDED else None
    tensor_files = {
        "model": ComponentFiles(tensors=where or MODEL_FILE),
        "optimizer": ComponentFiles(tensors=where or OPTIMIZER_FILE),
    }
    if SYNC_FILE in files:
        components["sync"] = {}
        tensor_files["sync"] = ComponentFiles(tensors=SYNC_FILE)
    exports = {MODEL_FILE: MODEL_FILE} if MODEL_FILE in files else {}
    return Saved(
        format_version=2,
        step=progress.global_step,
        epoch=progress.epoch,
        world=progress.world_size,
        layout=layout,
        plan=plan,
        tensor_parallel=tp,
        components=components,
        ranks=[{"rng": dict(rng)} for rng in data["rng"]],
        files=tensor_files,
        exports=exports,
        metrics={k: float(v) for k, v in state.metrics.items()},
        config=state.config,
        versions=dict(state.versions),
    )
