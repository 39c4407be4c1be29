"""A checkpoint's content in memory (a component's ``State``, one rank's ``Snapshot``) and its
tensor files, without pickle.

Tensors go through safetensors (flat weights) or ``torch.save``/``torch.load(weights_only=True)``
(optimizer state and the like); everything else is JSON (``checkpoint/writer.py`` writes it),
RNG byte states base64-encoded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import random
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeGuard, cast

import numpy as np
import torch
import torch.utils.serialization as torch_serialization
from safetensors import safe_open
from safetensors.torch import _TYPES, _remove_duplicate_names, load_file
from torch import nn

from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, Sealing, open_hashing
from trainforge.checkpoint.schema import STATE_FILE
from trainforge.errors import CheckpointError, TrainforgeError
from trainforge.files import safetensors_header

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["STATE_FILE", "Record", "Snapshot", "State"]
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _TYPES.items()}


@dataclass
class State:
    """One component's state, in up to four parts, each kept where it belongs in a checkpoint:

    * ``values``: JSON, the same on every rank (rank 0's is saved) -> ``trainer_state.json``;
    * ``tensors``: tensors (and plain values) the same on every rank, or sharded like the model ->
      ``<component>.safetensors`` / ``<component>.pt`` (written by rank 0), or the DCP shards;
    * ``rank_values``: JSON, this rank's own -> ``trainer_state.json``'s ``ranks``;
    * ``rank_tensors``: tensors, this rank's own -> ``ranks/<rank>/<component>.pt``.
    """

    values: dict[str, Any] = field(default_factory=dict)
    tensors: Any = None
    rank_values: dict[str, Any] | None = None
    rank_tensors: Any = None


@dataclass
class Record:
    """What rank 0 writes beside the components: the writers' layout (``plan``: ``ddp``, ``fsdp x
    tp2``, for people; ``tensor_parallel``: the size of their tensor-parallel groups), the metrics at
    save time, the resolved config (redacted: a record) and library versions."""

    plan: str
    tensor_parallel: int = 1
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class Snapshot:
    """One rank's part of a checkpoint at one step: host copies, so training goes on while it is written.

    ``layout``: full (rank 0 writes the shared tensors) or sharded (every rank writes its shards).
    ``exports``: the run directory's weights files and the component whose full weights each is
    (``<file>.safetensors`` <- ``<component>``); ``full_weights``: rank 0's gathered full weights of a
    sharded run's final save, by component."""

    step: int
    epoch: int
    layout: str
    states: dict[str, State]
    rank: int = 0
    world: int = 1
    record: Record | None = None
    exports: dict[str, str] = field(default_factory=dict)
    full_weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and CUDA generator states, as JSON."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert not isinstance(keys, str)  # legacy=True always gives the MT19937 key array
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor, without importing torch.distributed.tensor where nothing has
    (importing it is about 0.5 s of every worker's start; a process that never imported it holds none)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def snapshot_tensors(tree: Any, reuse: Any = None) -> Any:
    """A host copy of every tensor in a (nested) state dict, so training can go on while it is written.

    A DTensor (a shard under FSDP or tensor parallelism) stays a DTensor over the same mesh and
    placements, its local shard copied, as torch.distributed.checkpoint needs them to plan a save.
    ``reuse``: the previous snapshot of the same structure, whose buffers are overwritten in place
    when shapes and dtypes match. Allocating (and page-faulting) fresh host memory on every save
    costs several times more than the copy itself.
    """
    if is_dtensor(tree):
        copy = cast(Any, tree.detach())
        buffer = reuse.to_local() if is_dtensor(reuse) else None
        copy._local_tensor = _copy_to_host(tree.to_local(), buffer)  # as torch's own staging does
        return copy
    if isinstance(tree, torch.Tensor):
        return _copy_to_host(tree, reuse if isinstance(reuse, torch.Tensor) else None)
    if isinstance(tree, dict):
        previous = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot_tensors(v, previous.get(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        old_items = list(reuse) if isinstance(reuse, (list, tuple)) and len(reuse) == len(tree) else [None] * len(tree)
        return type(tree)(snapshot_tensors(v, o) for v, o in zip(tree, old_items, strict=True))
    return tree


def _copy_to_host(tensor: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    source = tensor.detach()
    if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
        # Pinned host memory makes the device-to-host copy of GPU tensors fast (and async-capable).
        buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
    buffer.copy_(source)
    return buffer


def model_snapshot(model: nn.Module, reuse: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors copied to host memory, one entry per storage (tied weights once), as
    safetensors keeps them; ``reuse`` as in :func:`snapshot_tensors`."""
    return weights_snapshot(model.state_dict(), reuse)


def weights_snapshot(
    weights: dict[str, torch.Tensor], reuse: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Flat weights (name -> tensor) copied to host memory, tensors sharing storage (tied weights)
    once, as safetensors keeps them; ``reuse`` as in :func:`snapshot_tensors`."""
    aliases = {name for names in _remove_duplicate_names(weights).values() for name in names}
    old = reuse or {}
    return {k: _copy_to_host(v, old.get(k)) for k, v in weights.items() if k not in aliases}


def is_flat_weights(tree: Any) -> bool:
    """A plain ``{name: tensor}`` dict (of whole tensors): what safetensors stores."""
    return (
        isinstance(tree, dict)
        and bool(tree)
        and all(isinstance(k, str) and type(v) is torch.Tensor for k, v in tree.items())
    )


def tensor_file(component: str, tree: Any) -> str:
    """The file a component's shared tensors are written to: ``<name>.safetensors`` for flat
    weights, else ``<name>.pt`` (``torch.save``, read back ``weights_only``)."""
    return f"{component}.safetensors" if is_flat_weights(tree) else f"{component}.pt"


def write_tensors(path: Path, tree: Any, algorithm: str = DEFAULT_HASH, sealer: Sealing | None = None) -> FileRecord:
    """A component's tensors into ``path``: safetensors for ``.safetensors``, else ``torch.save``
    (encrypted on the way with ``sealer``)."""
    if path.suffix == ".safetensors":
        return write_safetensors(path, tree, algorithm, sealer)
    return write_torch(path, tree, algorithm, sealer)


def read_tensors(path: Path | IO[bytes], *, safetensors: bool | None = None) -> Any:
    """What :func:`write_tensors` wrote (safetensors by the file's suffix unless ``safetensors``
    says; a stream is read by ``torch.load``); nothing is unpickled but tensors and plain containers."""
    if safetensors is None:
        safetensors = isinstance(path, Path) and path.suffix == ".safetensors"
    if safetensors:
        safetensors_header(str(path), Path(str(path)).name, CheckpointError)  # its length bounded before parsing
        return load_file(str(path))
    # weights_only=True: tensors and plain containers only, never arbitrary pickled objects.
    return torch.load(path, map_location="cpu", weights_only=True)


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], algorithm: str = DEFAULT_HASH, sealer: Sealing | None = None
) -> FileRecord:
    """A safetensors file (8-byte header length, JSON header, then the tensors' bytes), written
    straight from the tensors' memory through a hashing writer: no copy of the whole file in memory
    and no read-back. Tensors sharing storage must be deduplicated first (``model_snapshot`` does)."""
    header: dict[str, Any] = {}
    payloads = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: safetensors cannot store {tensor.dtype}")
        data = tensor.to("cpu").contiguous()
        size = data.numel() * data.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[data.dtype],
            "shape": list(data.shape),
            "data_offsets": [offset, offset + size],
        }
        payloads.append(data)
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    writer = open_hashing(path, algorithm, sealer)
    try:
        writer.write(struct.pack("<Q", len(encoded)))
        writer.write(encoded)
        for data in payloads:
            if data.numel():
                writer.write(data.reshape(-1).view(torch.uint8).numpy())
    except BaseException:
        writer.close()
        raise
    return writer.finish()


def write_torch(path: Path, obj: Any, algorithm: str = DEFAULT_HASH, sealer: Sealing | None = None) -> FileRecord:
    """``torch.save`` of ``obj`` through a hashing writer (readable with ``weights_only=True``)."""
    writer = open_hashing(path, algorithm, sealer)
    try:
        # The manifest's digest covers the file; torch's own CRC32 pass would only add its cost.
        with _torch_save_crc32(False):
            torch.save(obj, cast(IO[bytes], writer))
    except BaseException:
        writer.close()
        raise
    return writer.finish()


@contextlib.contextmanager
def _torch_save_crc32(enabled: bool) -> Iterator[None]:
    config = torch_serialization.config.save
    before = config.compute_crc32
    config.compute_crc32 = enabled
    try:
        yield
    finally:
        config.compute_crc32 = before


def check_loadable(directory: Path, files: Iterable[str]) -> str | None:
    """Why a verified checkpoint still cannot be loaded safely (None if it can), without loading tensors.

    A manifest proves the files are the ones written, not that whoever wrote them was benign: every
    ``.safetensors`` file's header must parse, and every ``.pt`` file (a component's state, each
    rank's own) must unpickle under ``weights_only`` (tensors and plain containers only).
    ``files``: the checkpoint's files by relative name.
    """
    names = sorted(files)
    name = names[0] if names else ""
    try:
        for name in names:
            path = directory / name
            if name.endswith(".safetensors") and path.exists():
                safetensors_header(path, name, CheckpointError)  # its length bounded before it is parsed
                with safe_open(str(path), framework="pt") as handle:
                    handle.keys()
            elif name.endswith(".pt") and path.exists():
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except TrainforgeError as err:
        return f"refused to load: {err}"
    except pickle.UnpicklingError:
        return (
            f"refused to load: {name} holds pickled objects other than tensors and plain "
            "containers (it could run code); it was not unpickled"
        )
    except Exception as err:  # safetensors header errors, torch's unpickler errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"refused to load: {type(err).__name__}: {first[:300]}"
    return None


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
