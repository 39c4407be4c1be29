"""What a checkpoint holds, read back as components: ``trainer_state.json`` (format 3,
``{component: state}``) and where each component's tensors are. No component is named here; an
earlier format is an ``OutdatedCheckpoint`` (``trainforge ckpt upgrade`` converts it).
No torch here: ``trainforge ckpt`` reads these without loading a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.checkpoint.opened import CheckpointFiles, as_files
from trainforge.checkpoint.schema import (
    FULL,
    MANIFEST,
    MAX_STATE_BYTES,
    SHARDED,
    SHARDED_DIR,
    STATE_FILE,
    ComponentFiles,
    ComponentSchemas,
    StateFile,
    check_components,
    parse_trainer_state,
)
from trainforge.errors import CheckpointError


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


def read_saved(
    directory: Path | CheckpointFiles,
    schemas: Mapping[str, ComponentSchemas] | None = None,
    layout: str | None = None,
) -> Saved:
    """``trainer_state.json`` of a local checkpoint directory (or a checkpoint's files, decrypted),
    bounded and schema-checked (each component's state too, when ``schemas`` are given);
    CheckpointError when it does not load. ``layout``: the manifest's (found from the files when
    not given)."""
    checkpoint = as_files(directory)
    with checkpoint.open(STATE_FILE) as handle:
        raw = handle.read(MAX_STATE_BYTES + 1)
    files = checkpoint.listing() - {MANIFEST}
    if layout is None:
        layout = SHARDED if any(rel.startswith(f"{SHARDED_DIR}/") for rel in files) else FULL
    return saved_from(raw, layout, files, schemas)


def saved_from(
    raw: bytes, layout: str, files: set[str], schemas: Mapping[str, ComponentSchemas] | None = None
) -> Saved:
    """The components of ``trainer_state.json``'s bytes, in a checkpoint of ``layout`` holding
    ``files``; CheckpointError naming what is wrong."""
    parsed, _ = parse_trainer_state(raw)
    saved = _from_state(parsed)
    missing = sorted(_listed(saved) - files)
    if missing:
        raise CheckpointError(f"{STATE_FILE} names {missing[0]}, which the checkpoint does not hold")
    if schemas is not None:
        check_components(saved.components, saved.ranks, schemas)
    return saved


def _listed(saved: Saved) -> set[str]:
    found = {where.tensors for where in saved.files.values() if where.tensors not in (None, SHARDED)}
    found |= set(saved.exports.values())
    return {name for name in found if name is not None}


def _from_state(state: StateFile) -> Saved:
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
