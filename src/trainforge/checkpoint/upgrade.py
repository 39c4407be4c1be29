"""``trainforge ckpt upgrade PATH``: a checkpoint of formats 1 and 2 rewritten as format 3.

Formats 1 and 2 kept fixed fields (progress, scheduler, scaler, every rank's RNG) and fixed files
(``model.safetensors``, ``optimizer.pt``, format 2's ``sync.pt`` of parallel.sync, the optimizer's
shards under ``optim``). This is the one module that knows them: the read path reads format 3
only, and says to run this on anything older. The upgrade maps each field onto the component that
holds it now, keeps every tensor's bytes as they are, verifies the result with the components' own
schemas, and only then puts it in the old one's place (which is kept beside it, hidden, as
``.format<N>-checkpoint_<step>``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, cast

from pydantic import ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from trainforge.checkpoint.format import write_json_atomic, write_manifest_of
from trainforge.checkpoint.hashing import FileRecord, hash_file
from trainforge.checkpoint.problems import OUTDATED
from trainforge.checkpoint.schema import (
    FORMAT_VERSION,
    FULL,
    MANIFEST,
    MAX_STATE_BYTES,
    SHARDED,
    SHARDED_METADATA,
    STATE_FILE,
    Bounded,
    ComponentSchemas,
    Count,
    Number,
    Ranks,
    Schema,
    StateFile,
    open_regular,
    parse_json,
    rank_path,
)
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.errors import CheckpointError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SYNC_FILE = "sync.pt"  # format 2's parallel.sync: anchor, outer optimizer and every rank's own in one
SHARD_KEYS = {"optim": "optimizer"}  # format 2's keys in DCP's shards -> the component's name


class _Progress(Schema):
    epoch: Bounded
    global_step: Bounded
    samples_seen: Count
    epoch_position: Count
    world_size: Ranks
    micro_batch_size: Annotated[StrictInt, Field(ge=1, le=2**31)] | None = None
    grad_accum_steps: Annotated[StrictInt, Field(ge=1, le=2**31)] | None = None


class _Scheduler(Schema):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    last_epoch: StrictInt | None = None
    base_lrs: list[Number] | None = None
    step_count: StrictInt | None = Field(None, alias="_step_count")
    last_lr: list[Number] | None = Field(None, alias="_last_lr")


class _Scaler(Schema):
    scale: Number | None = None
    growth_factor: Number | None = None
    backoff_factor: Number | None = None
    growth_interval: StrictInt | None = None
    growth_tracker: StrictInt | None = Field(None, alias="_growth_tracker")


class OldStateFile(Schema):
    """``trainer_state.json`` of formats 1 and 2: the fixed fields (each RNG state is checked by the
    component that holds it now, once upgraded)."""

    progress: _Progress
    scheduler: _Scheduler
    scaler: _Scaler
    rng: list[dict[str, Any]]
    metrics: dict[str, Number] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, StrictStr] = Field(default_factory=dict)

    @field_validator("config")
    @classmethod
    def _sections_are_tables(cls, config: dict[str, Any]) -> dict[str, Any]:
        for section in ("optim", "schedule", "parallel"):
            if section in config and not isinstance(config[section], dict):
                raise ValueError(f"config.{section} is not a table")
        return config

    @model_validator(mode="after")
    def _one_rng_state_per_rank(self) -> OldStateFile:
        if len(self.rng) != self.progress.world_size:
            raise ValueError(f"holds {len(self.rng)} RNG states for {self.progress.world_size} ranks")
        return self


@dataclass(frozen=True)
class Upgraded:
    """What ``upgrade`` did: the checkpoint's format before, and where the old one was kept."""

    path: Path
    old_format: int
    kept: Path


def upgrade(path: Path, schemas: Mapping[str, ComponentSchemas]) -> Upgraded:
    """Rewrite the local checkpoint directory ``path`` of format 1 or 2 as format 3, in place;
    ``schemas``: the components' own, which the result must pass. CheckpointError (one line) when
    it is not an old checkpoint that verifies."""
    store, name = CheckpointStore.for_checkpoint(str(path))
    if not store.is_local:
        raise CheckpointError(f"{path}: ckpt upgrade works on a local directory; copy the checkpoint here first")
    check = store.verify(name, schemas=schemas)
    if check.ok:
        raise CheckpointError(f"{path} is already of format {FORMAT_VERSION}: nothing to upgrade")
    if check.kinds != {OUTDATED}:
        raise CheckpointError(f"{path} does not verify, so it is not upgraded: {check.problems[0]}")
    manifest = check.manifest or {}
    old_format = int(manifest.get("format_version", 1))
    layout = str(manifest.get("layout", FULL))
    files = set(manifest.get("files", {}))
    with open_regular(path / STATE_FILE, STATE_FILE) as handle:
        raw = handle.read(MAX_STATE_BYTES + 1)
    staging = path.with_name(f".upgrade-{name}-{time.time_ns()}")
    try:
        staging.mkdir()
        state = _convert(path, staging, raw, layout, files)
        written = {rel: _durable(staging / rel) for rel in _files_under(staging)}
        meta: dict[str, Any] = {
            k: manifest[k] for k in ("global_step", "epoch", "metrics", "created_at") if k in manifest
        }
        meta["world_size"] = state["world_size"]
        write_manifest_of(staging, written, meta, layout=layout)
        result = CheckpointStore(store.fs, store.root).verify(staging.name, schemas=schemas)
        if not result.ok:
            raise CheckpointError(f"{path}: its upgrade does not verify ({result.problems[0]}); nothing was changed")
        kept = path.with_name(f".format{old_format}-{name}")
        path.rename(kept)
        staging.rename(path)
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Upgraded(path, old_format, kept)


def _convert(source: Path, target: Path, raw: bytes, layout: str, files: set[str]) -> dict[str, Any]:
    """The checkpoint at ``source`` written into ``target`` as format 3; its ``trainer_state.json``."""
    old, data = parse_json(raw, STATE_FILE, MAX_STATE_BYTES, OldStateFile)
    state = _state_of(old, data, layout, files)
    for rel in files - {STATE_FILE, SYNC_FILE, SHARDED_METADATA}:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, target / rel)
    if SYNC_FILE in files:
        _split_sync(source / SYNC_FILE, target, state)
    if layout == SHARDED:
        _rename_shard_keys(source / SHARDED_METADATA, target / SHARDED_METADATA)
    write_json_atomic(target / STATE_FILE, state)
    StateFile.model_validate(state)  # an invariant: what this module writes is format 3
    return state


def _state_of(old: OldStateFile, data: dict[str, Any], layout: str, files: set[str]) -> dict[str, Any]:
    """The fixed fields as the components that hold them now (the values as written: ``data`` is
    the parsed JSON, ``old`` its checked schema)."""
    progress = old.progress
    parallel = old.config.get("parallel", {})
    tp = parallel.get("tensor_parallel", 1)
    tp = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else 1
    optimizer_name = old.config.get("optim", {}).get("name")
    position = {
        "epoch": progress.epoch,
        "position": progress.epoch_position,
        "world_size": max(1, progress.world_size // tp),  # the data was split over data-parallel ranks
        "micro_batch_size": progress.micro_batch_size,
        "grad_accum_steps": progress.grad_accum_steps,
    }
    components: dict[str, dict[str, Any]] = {
        "progress": {"global_step": progress.global_step, "samples_seen": progress.samples_seen},
        "data": {k: v for k, v in position.items() if v is not None},
        "model": {},
        "optimizer": {"name": optimizer_name} if isinstance(optimizer_name, str) else {},
        "schedule": {k: v for k, v in data["scheduler"].items() if k != "lr_lambdas"},
        "scaler": dict(data["scaler"]),
        "rng": {},  # each rank's own, in ranks
    }
    where = SHARDED if layout == SHARDED else None
    tensor_files: dict[str, dict[str, Any]] = {
        "model": {"tensors": where or MODEL_FILE},
        "optimizer": {"tensors": where or OPTIMIZER_FILE},
    }
    if SYNC_FILE in files:
        components["sync"] = {}  # its values are in sync.pt: _split_sync fills them in
        tensor_files["sync"] = {"tensors": SYNC_FILE, "rank_tensors": True}
    return {
        "format_version": FORMAT_VERSION,
        "global_step": progress.global_step,
        "epoch": progress.epoch,
        "world_size": progress.world_size,
        "layout": layout,
        "plan": str(parallel.get("strategy", "ddp")) + (f" x tp{tp}" if tp > 1 else ""),
        "tensor_parallel": tp,
        "components": components,
        "ranks": [{"rng": dict(rng)} for rng in old.rng],
        "files": tensor_files,
        "exports": {MODEL_FILE: MODEL_FILE} if MODEL_FILE in files else {},
        "metrics": dict(old.metrics),
        "config": old.config,
        "versions": dict(old.versions),
    }


def _split_sync(source: Path, target: Path, state: dict[str, Any]) -> None:
    """Format 2's ``sync.pt`` as the sync component writes it now: the shared tensors in
    ``sync.pt``, each rank's own in ``ranks/<rank>/sync.pt``, the values in the state."""
    from trainforge.checkpoint.state import read_tensors, write_tensors  # torch

    saved = cast(dict[str, Any], read_tensors(source))
    try:
        ranks, values = saved["ranks"], {k: int(saved[k]) for k in ("last_sync", "every_n_steps")}
        shared = {"anchor": saved["anchor"], "outer": saved["outer"]}
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{SYNC_FILE} is malformed: not parallel.sync's state of format 2") from None
    if not isinstance(ranks, list) or len(ranks) != state["world_size"]:
        raise CheckpointError(f"{SYNC_FILE} is malformed: not one state per rank")
    state["components"]["sync"] = values
    write_tensors(target / SYNC_FILE, shared)
    for rank, mine in enumerate(ranks):
        (target / rank_path(rank, "sync")).parent.mkdir(parents=True, exist_ok=True)
        write_tensors(target / rank_path(rank, "sync"), mine)


def _rename_shard_keys(source: Path, target: Path) -> None:
    """DCP's metadata with format 2's keys (``optim.*``) under the components' names; the shard
    files, which the metadata points into by offset, stay as they are."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from trainforge.checkpoint.dcp_metadata import MAX_METADATA_BYTES, read_metadata  # torch

    with open_regular(source, SHARDED_METADATA) as handle:
        metadata = read_metadata(handle.read(MAX_METADATA_BYTES + 1))

    def renamed(fqn: str) -> str:
        head, dot, rest = fqn.partition(".")
        return SHARD_KEYS.get(head, head) + dot + rest

    planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
    upgraded = dataclasses.replace(
        metadata,
        state_dict_metadata={renamed(k): v for k, v in metadata.state_dict_metadata.items()},
        planner_data=(
            {renamed(k): (SHARD_KEYS.get(p[0], p[0]), *p[1:]) if p else p for k, p in planner.items()}
            if planner is not None
            else metadata.planner_data
        ),
        storage_data={
            MetadataIndex(renamed(i.fqn), i.offset, i.index): info for i, info in (metadata.storage_data or {}).items()
        },
    )
    with target.open("wb") as out:
        pickle.dump(upgraded, out)


def _durable(path: Path) -> FileRecord:
    """A file's record once it is on disk: the manifest vouches only for what is durable."""
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
    return hash_file(path)


def _files_under(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".tmp")
    )


def _fsync_dir(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
