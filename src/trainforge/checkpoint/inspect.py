"""Read-only tools over checkpoints, behind ``trainforge ckpt list|verify|inspect``.

Everything goes through :class:`CheckpointStore`, so a local run directory and an ``s3://`` prefix
are read the same way. ``inspect`` reads JSON and the safetensors header only; ``verify`` and
``list`` also run restore's safe-load check (``weights_only`` unpickling, memory-mapped), so that
they call valid exactly what restore would restore.
"""

from __future__ import annotations

import io
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from trainforge.checkpoint.crypto import ENCRYPTED_HINT, MAGIC, OVERHEAD, FileCipher, is_sealed
from trainforge.checkpoint.names import RETIRED_PREFIX, TEMP_PREFIX, parse_checkpoint_name, step_of_hidden
from trainforge.checkpoint.render import LISTED_METRICS, human_bytes, human_time, inspection_view, list_table
from trainforge.checkpoint.saved import Saved, saved_from
from trainforge.checkpoint.schema import (
    FULL,
    MANIFEST,
    MAX_STATE_BYTES,
    SHARDED,
    SHARDED_METADATA,
    STATE_FILE,
    ComponentSchemas,
    Encryption,
    printable,
    shard_rank,
)
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.checkpoint.uris import first_line
from trainforge.checkpoint.verify import Verification, list_tree, open_file, read_capped
from trainforge.errors import CheckpointError, shown
from trainforge.files import SAFETENSORS_MAX_HEADER, SAFETENSORS_MAX_TENSORS, human_size
from trainforge.redact import redact_config

# Rendering lives in render.py; the CLI imports it from here, with the tools.
__all__ = ["STATE_FILE", "human_bytes", "human_time", "inspection_view", "list_table"]
INCOMPLETE = "incomplete save"  # a .tmp- staging dir of a save that never committed
RETIRED = "retired invalid"  # restore skipped it as invalid; a later save of its step set it aside
Schemas = Mapping[str, ComponentSchemas] | None  # the components' own (worker/registry.state_schemas)


# ---------------------------------------------------------------------------------------------
# Opening a location


def open_location(location: str, cipher: FileCipher | None = None) -> CheckpointStore:
    """The store at a run directory or URI; CheckpointError when nothing is there."""
    store = CheckpointStore.from_uri(location, cipher)
    kind = _file_type(store, store.root)
    if kind == pafs.FileType.NotFound:
        raise CheckpointError(f"{location} does not exist{_no_bucket(store, store.root)}")
    if kind != pafs.FileType.Directory:
        raise CheckpointError(f"{location} is not a directory (give a run directory or a storage URI)")
    return store


def open_checkpoint(path: str, cipher: FileCipher | None = None) -> tuple[CheckpointStore, str]:
    """The store holding the checkpoint directory ``path``, and its name; CheckpointError if absent."""
    store, name = CheckpointStore.for_checkpoint(path, cipher)
    kind = _file_type(store, store.path(name))
    if kind == pafs.FileType.NotFound:
        raise CheckpointError(f"{path} does not exist{_no_bucket(store, store.root)}")
    if kind != pafs.FileType.Directory:
        raise CheckpointError(f"{path} is not a checkpoint directory (a checkpoint is a folder with {MANIFEST})")
    return store, name


def _no_bucket(store: CheckpointStore, root: str) -> str:
    """`` (no such bucket)`` when ``root`` is on an object store whose bucket does not exist."""
    if store.is_local or "/" not in root:
        return ""
    bucket = root.split("/", 1)[0]
    return " (no such bucket)" if _file_type(store, bucket) == pafs.FileType.NotFound else ""


def _file_type(store: CheckpointStore, path: str) -> pafs.FileType:
    try:
        return store.fs.get_file_info(path).type
    except OSError as err:  # unreachable object store (within TRAINFORGE_STORAGE_TIMEOUT_S), bad credentials
        shown = store.uri(path[len(store.root) + 1 :]).rstrip("/")
        raise CheckpointError(f"cannot read {shown}: {first_line(err)}") from None


# ---------------------------------------------------------------------------------------------
# verify


def verify_checkpoint(path: str, schemas: Schemas = None, cipher: FileCipher | None = None) -> Verification:
    """Check one checkpoint directory as restore does (``CheckpointStore.verify``: the one
    verification, reading every byte and ending with the safe-load check; ``schemas``: the
    components' own, as restore passes them). An encrypted checkpoint without ``cipher``: its
    ciphertext's sizes and digests only."""
    store, name = open_checkpoint(path, cipher)
    return store.verify(name, schemas=schemas, contents=cipher is not None)


# ---------------------------------------------------------------------------------------------
# list


@dataclass(frozen=True)
class Listed:
    """One directory of a run's checkpoint storage, as ``ckpt list`` shows it."""

    name: str
    uri: str
    kind: str  # "checkpoint", "incomplete" (a .tmp- staging dir) or "retired" (a .invalid- dir)
    step: int | None = None
    epoch: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    size_bytes: int = 0
    created_at: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        return self.kind == "checkpoint" and not self.problems

    @property
    def status(self) -> str:
        if self.kind == "incomplete":
            return INCOMPLETE
        if self.kind == "retired":
            return RETIRED
        return "valid" if not self.problems else "; ".join(self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uri": self.uri,
            "kind": self.kind,
            "step": self.step,
            "epoch": self.epoch,
            "metrics": self.metrics,
            "size_bytes": self.size_bytes,
            "created_at": self.created_at,
            "valid": self.valid,
            "status": self.status,
            "problems": list(self.problems),
        }


def list_checkpoints(location: str, schemas: Schemas = None, cipher: FileCipher | None = None) -> list[Listed]:
    """Every checkpoint under a run directory (verified), plus leftover staging and retired dirs.

    ``location`` may also be a storage root holding several runs (each run's checkpoints are listed
    as ``run/checkpoint_...``) or one checkpoint directory. CheckpointError when there are none.
    """
    store = open_location(location, cipher)
    step = parse_checkpoint_name(store.root.rsplit("/", 1)[-1])
    if step is not None and not store.entries():
        parent, _, name = store.root.rpartition("/")
        return [_listed_checkpoint(CheckpointStore(store.fs, parent, cipher), name, step, schemas=schemas)]
    found = _list_run(store, "", schemas)
    if not found:
        for child in _child_dirs(store):
            if not child.startswith("."):
                found.extend(_list_run(CheckpointStore(store.fs, store.path(child), cipher), f"{child}/", schemas))
    if not found:
        raise CheckpointError(f"{location} holds no checkpoints (expected checkpoint_<step> directories)")
    return found


def _list_run(store: CheckpointStore, prefix: str, schemas: Schemas) -> list[Listed]:
    rows = [_listed_checkpoint(store, entry.name, entry.step, prefix, schemas) for entry in store.entries()]
    for hidden in _child_dirs(store):
        if hidden.startswith(TEMP_PREFIX):
            kind = "incomplete"
        elif hidden.startswith(RETIRED_PREFIX):
            kind = "retired"
        else:
            continue
        rows.append(
            Listed(
                name=prefix + hidden,
                uri=store.uri(hidden),
                kind=kind,
                step=step_of_hidden(hidden),
                size_bytes=_tree_size(store, hidden),
            )
        )
    return sorted(rows, key=lambda r: (r.step if r.step is not None else -1, r.kind != "checkpoint", r.name))


def _listed_checkpoint(
    store: CheckpointStore, name: str, step: int, prefix: str = "", schemas: Schemas = None
) -> Listed:
    check = store.verify(name, schemas=schemas, contents=store.cipher is not None)
    manifest = check.manifest or {}
    found = manifest.get("metrics")
    metrics: dict[str, Any] = found if isinstance(found, dict) else {}
    return Listed(
        name=prefix + name,
        uri=store.uri(name),
        kind="checkpoint",
        step=_as_int(manifest.get("global_step"), step),
        epoch=_as_int(manifest.get("epoch"), None),
        metrics={k: float(metrics[k]) for k in LISTED_METRICS if isinstance(metrics.get(k), (int, float))},
        size_bytes=_tree_size(store, name),
        created_at=float(manifest["created_at"]) if isinstance(manifest.get("created_at"), (int, float)) else None,
        problems=check.problems,
    )


def _child_dirs(store: CheckpointStore) -> list[str]:
    return sorted(child.name for child in store.children())


def _tree_size(store: CheckpointStore, name: str) -> int:
    try:
        return sum(list_tree(store.fs, store.path(name), store.is_local).files.values())
    except OSError:
        return 0


def _as_int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# ---------------------------------------------------------------------------------------------
# inspect


def inspect_checkpoint(path: str, cipher: FileCipher | None = None) -> dict[str, Any]:
    """Everything worth knowing about one checkpoint without loading a tensor; JSON-ready.

    Generic: each component's values and files as the checkpoint's own ``trainer_state.json``
    records them (a safetensors file's header summarised), whatever components the run had.
    Sizes are compared with the manifest (cheap); ``verify`` is the full digest check. Files are
    read as verification reads them: regular files only, bounded, schema-checked. An encrypted
    checkpoint needs ``cipher`` (its key): without it, one line.
    """
    store, name = open_checkpoint(path, cipher)
    try:
        tree = list_tree(store.fs, store.path(name), store.is_local)
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {printable(str(err))}") from None
    files = {printable(rel): size for rel, size in tree.files.items()}
    if not {MANIFEST, STATE_FILE} & files.keys():
        raise CheckpointError(f"{path} is not a checkpoint: it holds neither {MANIFEST} nor {STATE_FILE}")
    problems: list[str] = list(tree.problems)
    problems.extend(f"{printable(rel)} is {kind}, not a regular file" for rel, kind in sorted(tree.others.items()))
    manifest, manifest_problem = store.read_manifest(name)
    if manifest_problem:
        problems.append(manifest_problem)
    encryption = (manifest or {}).get("encryption")
    if encryption and cipher is None:
        raise CheckpointError(
            f"{path} is encrypted ({encryption['scheme']}, key {encryption['key_id']}): {ENCRYPTED_HINT}"
        )
    if encryption and cipher is not None:
        cipher.check_key(Encryption.model_validate(encryption), path)
    if manifest is not None:
        problems.extend(_size_problems(manifest, files))
    sharding = _sharding(manifest, files)
    saved = _read_state(store, name, tree.files, sharding["layout"], problems)
    return {
        "path": store.uri(name),
        "manifest": _manifest_summary(manifest) if manifest is not None else None,
        "sizes_match_manifest": manifest is not None and not problems,
        "files": files,
        "step": saved.step if saved is not None else (manifest or {}).get("global_step"),
        "epoch": saved.epoch if saved is not None else (manifest or {}).get("epoch"),
        "world_size": saved.world if saved is not None else (manifest or {}).get("world_size"),
        "plan": saved.plan if saved is not None else None,
        "components": _components(store, name, saved, files, problems) if saved is not None else {},
        "exports": saved.exports if saved is not None else {},
        "versions": saved.versions if saved is not None else {},
        "metrics": (saved.metrics if saved is not None else {}) or (manifest or {}).get("metrics", {}),
        "config": _config_sections(saved.config if saved is not None else {}),
        "sharding": sharding,
        "problems": problems,
    }


def _sharding(manifest: dict[str, Any] | None, files: dict[str, int]) -> dict[str, Any]:
    """The layout; for a sharded checkpoint also its world size and each rank's shard files and bytes."""
    layout = (manifest or {}).get("layout", FULL)
    found: dict[str, Any] = {"layout": layout, "world_size": (manifest or {}).get("world_size")}
    if layout != SHARDED:
        return found
    ranks: dict[str, dict[str, int]] = {}
    for rel, size in sorted(files.items()):
        rank = shard_rank(rel)
        if rank is not None:
            slot = ranks.setdefault(str(rank), {"files": 0, "bytes": 0})
            slot["files"] += 1
            slot["bytes"] += size
    found["ranks"] = dict(sorted(ranks.items(), key=lambda item: int(item[0])))
    found["metadata_bytes"] = files.get(SHARDED_METADATA)
    return found


def _size_problems(manifest: dict[str, Any], files: dict[str, int]) -> list[str]:
    problems = []
    for rel, entry in manifest["files"].items():
        if rel not in files:
            problems.append(f"{rel} is missing")
        elif files[rel] != entry["size"]:
            problems.append(f"{rel} has {files[rel]} bytes, manifest says {entry['size']} (truncated?)")
    return problems


def _manifest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    keys = ("format_version", "global_step", "epoch", "world_size", "created_at")
    # Format 1 names neither: SHA-256 and the full layout.
    extra = {"hash": manifest.get("hash", "sha256"), "layout": manifest.get("layout", FULL)}
    return {**{k: manifest.get(k) for k in keys}, **extra, "files": manifest["files"]}


def _read_state(
    store: CheckpointStore, name: str, files: dict[str, int], layout: str, problems: list[str]
) -> Saved | None:
    """``trainer_state.json`` as components, if it is a regular file that matches its schema; None
    and a problem if not."""
    if STATE_FILE not in files:
        problems.append(f"{STATE_FILE} is missing or not a regular file")
        return None
    try:
        raw = read_capped(store.fs, f"{store.path(name)}/{STATE_FILE}", store.is_local, MAX_STATE_BYTES + OVERHEAD)
        if store.cipher is not None and is_sealed(raw):
            raw = store.cipher.open_bytes(STATE_FILE, raw)
        return saved_from(raw, layout, set(files))
    except CheckpointError as err:
        problems.append(str(err))
    except OSError as err:
        problems.append(f"{STATE_FILE} is unreadable: {printable(str(err))}")
    return None


def _components(
    store: CheckpointStore, name: str, saved: Saved, files: dict[str, int], problems: list[str]
) -> dict[str, Any]:
    """Each component as its record has it: its values (the same on every rank), whether each
    rank keeps its own, and its tensor file (a weights file's header summarised) or DCP's shards."""
    found: dict[str, Any] = {}
    for component, values in saved.components.items():
        where = saved.files.get(component)
        tensors = where.tensors if where is not None else None
        entry: dict[str, Any] = {
            "values": values,
            "tensors": tensors,
            "rank_values": sum(1 for mine in saved.ranks if component in mine),
            "rank_tensors": bool(where is not None and where.rank_tensors),
        }
        if tensors is not None and tensors != SHARDED:
            entry["size_bytes"] = files.get(tensors)
            if tensors.endswith(".safetensors"):
                entry["weights"] = _weights_summary(store, name, tensors, files, problems)
        found[component] = entry
    for target, source in saved.exports.items():  # a sharded run's last save: full weights beside the shards
        owner = next((c for c, w in saved.files.items() if w.tensors == SHARDED and f"{c}.safetensors" == source), None)
        if owner is not None:
            found[owner]["export"] = {"file": source, "as": target, "size_bytes": files.get(source)}
            found[owner]["weights"] = _weights_summary(store, name, source, files, problems)
    return found


def _config_sections(config: dict[str, Any]) -> dict[str, Any]:
    """The recorded config's sections and top-level values, redacted again: a checkpoint another
    trainforge wrote may hold what today's rule masks (trainforge.redact)."""
    return {k: v for k, v in redact_config(config).items() if v is not None and v != {}}


def _weights_summary(
    store: CheckpointStore, name: str, rel: str, files: dict[str, int], problems: list[str]
) -> dict[str, Any] | None:
    """A safetensors file's tensor, parameter and dtype counts, from its header alone (an
    encrypted file decrypted and authenticated whole first)."""
    if rel not in files:
        return None
    try:
        path = f"{store.path(name)}/{rel}"
        with open_file(store.fs, path, store.is_local) as stream:
            sealed = store.cipher is not None and is_sealed(stream.read(len(MAGIC)))
        if store.cipher is not None and sealed:
            plain = io.BytesIO()  # the whole file, authenticated, before its header is believed
            with open_file(store.fs, path, True) if store.is_local else store.fs.open_input_file(path) as source:
                store.cipher.open_stream(rel, source, files[rel], plain)
            plain.seek(0)
            return safetensors_summary(read_safetensors_header(plain))
        with open_file(store.fs, path, store.is_local) as stream:
            return safetensors_summary(read_safetensors_header(stream))
    except (OSError, ValueError, TypeError, CheckpointError) as err:
        problems.append(f"{rel} header is unreadable: {err}")
    return None


def read_safetensors_header(stream: Any) -> dict[str, Any]:
    """The JSON header of a safetensors stream: 8 bytes of little-endian length, then the JSON."""
    head = stream.read(8)
    if len(head) < 8:
        raise ValueError("shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", head)
    if length > SAFETENSORS_MAX_HEADER:  # the limit every reader of a safetensors file keeps (files.py)
        raise ValueError(
            f"header of {length} bytes, more than the {human_size(SAFETENSORS_MAX_HEADER)} trainforge reads "
            "(SAFETENSORS_MAX_HEADER)"
        )
    raw = stream.read(length)
    if len(raw) < length:
        raise ValueError(f"header is cut short ({len(raw)} of {length} bytes)")
    if raw.count(b'"data_offsets"') > SAFETENSORS_MAX_TENSORS:
        raise ValueError(f"header lists more than {SAFETENSORS_MAX_TENSORS} tensors (SAFETENSORS_MAX_TENSORS)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, nested too deeply
        raise ValueError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def safetensors_summary(header: dict[str, Any]) -> dict[str, Any]:
    """Tensor count, parameter count and per-dtype counts from a safetensors header."""
    dtypes: dict[str, dict[str, int]] = {}
    parameters = data_bytes = 0
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, info in tensors.items():
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise ValueError(f"header entry {shown(key)} has no shape")
        count = math.prod(int(n) for n in info["shape"])
        start, end = info.get("data_offsets", (0, 0))
        parameters += count
        data_bytes += int(end) - int(start)
        slot = dtypes.setdefault(str(info.get("dtype")), {"tensors": 0, "parameters": 0})
        slot["tensors"] += 1
        slot["parameters"] += count
    return {
        "tensors": len(tensors),
        "parameters": parameters,
        "data_bytes": data_bytes,
        "dtypes": dtypes,
        "metadata": header.get("__metadata__") or {},
    }
