"""A verified checkpoint's components read back as ``State`` (the one restore path's reading half).

Shared tensors come from their file (``model.safetensors``, ``optimizer.pt``, ...) or from DCP's
shards, resharded to this run's layout (one ``dcp.load`` for every sharded component: it is a
collective); each rank's own state only when the same ranks wrote it. Format 2's ``sync.pt``
(parallel.sync's state with every rank's own in one file) is read here into the same parts.
Nothing is unpickled but tensors and plain containers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from trainforge.checkpoint.saved import Saved
from trainforge.checkpoint.schema import SHARDED, SYNC_FILE, rank_path
from trainforge.checkpoint.sharded import load_sharded
from trainforge.checkpoint.state import State, read_tensors


def load_shards(directory: Path, saved: Saved, templates: Mapping[str, Any]) -> dict[str, Any]:
    """Fill ``templates`` (by component: this run's own tensors, DTensors under a sharded plan)
    from the checkpoint's shards, resharded by DCP; every rank calls it (a collective)."""
    keyed = {saved.shard_key(component): tree for component, tree in templates.items()}
    if keyed:
        load_sharded(directory, keyed)
    return {component: keyed[saved.shard_key(component)] for component in templates}


def load_state(
    directory: Path, saved: Saved, component: str, *, rank: int, same_ranks: bool, shards: Mapping[str, Any]
) -> State:
    """Component ``component``'s state in the checkpoint at ``directory``, as this rank sees it:
    each rank's own parts only when ``same_ranks`` (the writers were this run's ranks)."""
    if saved.legacy_sync and component == "sync":
        return _format_2_sync(directory / SYNC_FILE, rank, len(saved.ranks), same_ranks)
    where = saved.files.get(component)
    tensors = None
    if where is not None and where.tensors == SHARDED:
        tensors = shards.get(component)
    elif where is not None and where.tensors is not None:
        tensors = read_tensors(directory / where.tensors)
    rank_values = saved.ranks[rank].get(component) if same_ranks and rank < len(saved.ranks) else None
    rank_tensors = None
    if same_ranks and where is not None and where.rank_tensors:
        rank_tensors = read_tensors(directory / rank_path(rank, component))
    return State(dict(saved.components.get(component, {})), tensors, rank_values, rank_tensors)


def _format_2_sync(path: Path, rank: int, world: int, same_ranks: bool) -> State:
    saved = cast(dict[str, Any], torch.load(path, map_location="cpu", weights_only=True))
    ranks = saved["ranks"]
    mine = ranks[rank] if same_ranks and len(ranks) == world else None
    return State(
        values={"last_sync": int(saved["last_sync"]), "every_n_steps": int(saved["every_n_steps"])},
        tensors={"anchor": saved["anchor"], "outer": saved["outer"]},
        rank_tensors=mine,
    )
