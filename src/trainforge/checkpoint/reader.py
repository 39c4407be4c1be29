"""A verified checkpoint's components read back as ``State`` (the one restore path's reading half).

Shared tensors come from the component's file (``<component>.safetensors`` or ``.pt``) or from
DCP's shards, resharded to this run's layout (one ``dcp.load`` for every sharded component: it is
a collective); each rank's own state only when the same ranks wrote it. Nothing is unpickled but
tensors and plain containers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainforge.checkpoint.opened import CheckpointFiles, as_files
from trainforge.checkpoint.saved import Saved
from trainforge.checkpoint.schema import SHARDED, rank_path
from trainforge.checkpoint.state import State, read_tensors


def load_shards(directory: Path | CheckpointFiles, saved: Saved, templates: Mapping[str, Any]) -> dict[str, Any]:
    """Fill ``templates`` (by component: this run's own tensors, DTensors under a sharded plan)
    from the checkpoint's shards, resharded by DCP; every rank calls it (a collective)."""
    keyed = dict(templates)
    if keyed:
        from trainforge.checkpoint.sharded import load_sharded  # torch.distributed.checkpoint: sharded runs only

        load_sharded(directory, keyed)
    return keyed


def load_state(
    directory: Path | CheckpointFiles,
    saved: Saved,
    component: str,
    *,
    rank: int,
    same_ranks: bool,
    shards: Mapping[str, Any],
) -> State:
    """Component ``component``'s state in the checkpoint at ``directory`` (or its files, decrypted),
    as this rank sees it: each rank's own parts only when ``same_ranks`` (the writers were this
    run's ranks)."""
    checkpoint = as_files(directory)
    where = saved.files.get(component)
    tensors = None
    if where is not None and where.tensors == SHARDED:
        tensors = shards.get(component)
    elif where is not None and where.tensors is not None:
        tensors = read_file_tensors(checkpoint, where.tensors)
    rank_values = saved.ranks[rank].get(component) if same_ranks and rank < len(saved.ranks) else None
    rank_tensors = None
    if same_ranks and where is not None and where.rank_tensors:
        rank_tensors = read_file_tensors(checkpoint, rank_path(rank, component))
    return State(dict(saved.components.get(component, {})), tensors, rank_values, rank_tensors)


def read_file_tensors(checkpoint: CheckpointFiles, rel: str) -> Any:
    """The tensors of the checkpoint's file ``rel``: safetensors maps the file by name, a ``.pt``
    file is read as a stream (``weights_only``)."""
    if rel.endswith(".safetensors"):
        return read_tensors(Path(checkpoint.path(rel)), safetensors=True)
    with checkpoint.open(rel) as stream:
        return read_tensors(stream, safetensors=False)


def weights_file(directory: Path, saved: Saved, component: str) -> Path | None:
    """The safetensors file holding ``component``'s full weights in the checkpoint at ``directory``:
    the component's own file, or (a sharded run's last save) the full weights it exported beside
    its shards; None when only DCP's shards hold them (:func:`read_whole` reads those)."""
    where = saved.files.get(component)
    if where is not None and where.tensors not in (None, SHARDED) and where.tensors.endswith(".safetensors"):
        return directory / where.tensors
    exported = f"{component}.safetensors"  # as the writer names a component's full weights
    return directory / exported if exported in saved.exports.values() else None


def read_whole(directory: Path | CheckpointFiles, component: str) -> dict[str, Any]:
    """``component``'s tensors in a verified sharded checkpoint, whole, in this process (no
    process group): every rank's shards read and joined."""
    from trainforge.checkpoint.sharded import read_sharded_whole  # torch.distributed.checkpoint: sharded only

    return read_sharded_whole(directory, component)
