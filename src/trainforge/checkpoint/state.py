"""Training state to and from a checkpoint directory, without pickle.

Tensors go through safetensors (model) or ``torch.save``/``torch.load(weights_only=True)``
(optimizer); everything else is JSON, RNG byte states base64-encoded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import random
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch
import torch.utils.serialization as torch_serialization
from safetensors import safe_open
from safetensors.torch import _TYPES, _remove_duplicate_names, load_model
from torch import nn

from trainforge.checkpoint.format import write_json_hashed
from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, in_parallel, open_hashing
from trainforge.checkpoint.schema import (
    MAX_STATE_BYTES,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    SYNC_FILE,
    open_regular,
    parse_trainer_state,
)

__all__ = ["MODEL_FILE", "OPTIMIZER_FILE", "STATE_FILE", "Progress", "TrainerState"]
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _TYPES.items()}


@dataclass
class Progress:
    """Where training stands: enough to continue with the next sample of the same epoch."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    epoch_position: int = 0  # samples this rank has consumed in the current epoch
    world_size: int = 1
    # The data source's split of a step when saved (auto batch size reuses it on resume); None in
    # checkpoints written before it was recorded.
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None


@dataclass
class TrainerState:
    """Everything in trainer_state.json."""

    progress: Progress
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    rng: list[dict[str, Any]]  # one entry per rank
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)


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


def snapshot_tensors(tree: Any, reuse: Any = None) -> Any:
    """A host copy of every tensor in a (nested) state dict, so training can go on while it is written.

    ``reuse``: the previous snapshot of the same structure, whose buffers are overwritten in place
    when shapes and dtypes match. Allocating (and page-faulting) fresh host memory on every save
    costs several times more than the copy itself.
    """
    if isinstance(tree, torch.Tensor):
        return _copy_to_host(tree, reuse if isinstance(reuse, torch.Tensor) else None)
    if isinstance(tree, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot_tensors(v, old.get(k)) for k, v in tree.items()}
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
    state = model.state_dict()
    aliases = {name for names in _remove_duplicate_names(state).values() for name in names}
    old = reuse or {}
    return {k: _copy_to_host(v, old.get(k)) for k, v in state.items() if k not in aliases}


def write_state(
    directory: Path,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    state: TrainerState,
    *,
    algorithm: str = DEFAULT_HASH,
    extra: dict[str, Any] | None = None,
) -> dict[str, FileRecord]:
    """Write model, optimizer and trainer state files (not the manifest) into ``directory``, each
    hashed as it is written and fsynced, the large ones in parallel; ``{file name: record}``.
    ``extra``: more ``torch.save`` files by name (``sync.pt``), read back with ``weights_only``."""
    directory.mkdir(parents=True, exist_ok=True)
    jobs = {MODEL_FILE: lambda: write_safetensors(directory / MODEL_FILE, model_state, algorithm)}
    if optimizer_state is not None:
        jobs[OPTIMIZER_FILE] = lambda: write_torch(directory / OPTIMIZER_FILE, optimizer_state, algorithm)
    for name, tree in (extra or {}).items():
        jobs[name] = lambda name=name, tree=tree: write_torch(directory / name, tree, algorithm)  # type: ignore[misc]
    jobs[STATE_FILE] = lambda: write_trainer_state(directory, state, algorithm)
    return dict(zip(jobs, in_parallel(jobs.values()), strict=True))


def write_trainer_state(directory: Path, state: TrainerState, algorithm: str = DEFAULT_HASH) -> FileRecord:
    """``trainer_state.json``, hashed while written and fsynced."""
    return write_json_hashed(directory / STATE_FILE, _state_to_json(state), algorithm)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], algorithm: str = DEFAULT_HASH) -> FileRecord:
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
    writer = open_hashing(path, algorithm)
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


def write_torch(path: Path, obj: Any, algorithm: str = DEFAULT_HASH) -> FileRecord:
    """``torch.save`` of ``obj`` through a hashing writer (readable with ``weights_only=True``)."""
    writer = open_hashing(path, algorithm)
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


def read_trainer_state(directory: Path) -> TrainerState:
    """``trainer_state.json``, bounded and schema-checked; CheckpointError when it is not loadable."""
    with open_regular(directory / STATE_FILE, STATE_FILE) as handle:
        raw = handle.read(MAX_STATE_BYTES + 1)
    schema, data = parse_trainer_state(raw)
    return TrainerState(
        progress=Progress(**schema.progress.model_dump()),
        scheduler=data["scheduler"],
        scaler=data["scaler"],
        rng=data["rng"],
        metrics={k: float(v) for k, v in schema.metrics.items()},
        config=schema.config,
        versions=dict(schema.versions),
    )


def load_weights(directory: Path, model: nn.Module) -> None:
    """Weights into ``model``; strict, with tied weights restored from the one stored copy."""
    load_model(model, str(directory / MODEL_FILE), strict=True)


def load_optimizer(directory: Path, optimizer: torch.optim.Optimizer) -> None:
    # weights_only=True: tensors and plain containers only, never arbitrary pickled objects.
    optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True))


def check_loadable(directory: Path) -> str | None:
    """Why a verified checkpoint still cannot be loaded safely (None if it can), without loading tensors.

    A manifest proves the files are the ones written, not that whoever wrote them was benign:
    ``optimizer.pt`` (and ``sync.pt``, parallel.sync) must unpickle under ``weights_only``
    (tensors and plain containers only). (``trainer_state.json`` is checked against its schema by
    the verification itself.)
    """
    name = MODEL_FILE
    try:
        with safe_open(str(directory / MODEL_FILE), framework="pt") as handle:
            handle.keys()
        for name in (OPTIMIZER_FILE, SYNC_FILE):
            if (directory / name).exists():
                torch.load(directory / name, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        return (
            f"refused to load: {name} holds pickled objects other than tensors and plain "
            "containers (it could run code); it was not unpickled"
        )
    except Exception as err:  # safetensors header errors, torch's unpickler errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"refused to load: {type(err).__name__}: {first[:300]}"
    return None


def _state_to_json(state: TrainerState) -> dict[str, Any]:
    data = asdict(state)
    data["scheduler"] = {k: v for k, v in state.scheduler.items() if k != "lr_lambdas"}
    return data


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
