"""DCP's ``sharded/.metadata`` read without running code: it is a pickle, so it is unpickled with an
allow-list of torch.distributed.checkpoint's own metadata classes, bounded, and checked to point
only inside the shard files the manifest lists. Used by verification's safe-load check and by
``load_sharded`` (kept apart from ``sharded.py`` so that verification does not import the store).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from trainforge.checkpoint.schema import SHARDED_DIR, SHARDED_METADATA
from trainforge.errors import CheckpointError

MAX_METADATA_BYTES = 256 << 20  # DCP's metadata: a few hundred bytes per tensor chunk


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(raw: bytes) -> Metadata:
    """DCP's ``.metadata`` from its bytes, admitting its own classes only; CheckpointError otherwise."""
    if len(raw) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{SHARDED_METADATA} is larger than {MAX_METADATA_BYTES >> 20} MB")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"refused to load: {SHARDED_METADATA} holds pickled objects ({err})") from None
    except Exception as err:  # truncated or malformed pickles raise almost anything
        raise CheckpointError(f"refused to load: {SHARDED_METADATA} does not parse ({type(err).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"refused to load: {SHARDED_METADATA} is not DCP metadata")
    return metadata


def metadata_refusal(raw: bytes, sizes: dict[str, int]) -> str | None:
    """Why a sharded checkpoint whose files verify still must not be loaded (None if it can): its
    metadata must unpickle under the allow-list and point only into listed shard files, in bounds."""
    try:
        metadata = read_metadata(raw)
    except CheckpointError as err:
        return str(err)
    for index, info in (metadata.storage_data or {}).items():
        rel = f"{SHARDED_DIR}/{getattr(info, 'relative_path', '')}"
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if rel not in sizes or rel == SHARDED_METADATA:
            return f"refused to load: {SHARDED_METADATA} points at {rel}, which the manifest does not list"
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            return f"refused to load: {SHARDED_METADATA} gives {getattr(index, 'fqn', '?')} no valid byte range"
        if offset + length > sizes[rel]:
            return f"refused to load: {SHARDED_METADATA} reads past the end of {rel}"
    return None
