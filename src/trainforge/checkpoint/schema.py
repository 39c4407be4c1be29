"""Schemas of a checkpoint's JSON files (``manifest.json``, ``trainer_state.json``) and their parsers.

``trainer_state.json`` holds ``{component: state}`` (format 3), each component's own state checked
by that component's schema, which the caller passes (the worker's registry owns them); no component
is named here. Formats 1 and 2 kept fixed fields instead: reading one is an ``OutdatedCheckpoint``
that says to run ``trainforge ckpt upgrade`` (``checkpoint/upgrade.py``, the one module that knows them).

Checkpoints are read back from storage, so they are untrusted input: every byte string gets either
a parsed, typed value or a :class:`CheckpointError` with a one-line reason, never another exception.
The schemas are what makes "verifies" mean "loads": a ``trainer_state.json`` whose progress, RNG
states or schedule have the wrong JSON types is refused here, not by a TypeError deep in restore.
No torch here: ``trainforge ckpt`` uses these without importing it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, BinaryIO, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from trainforge import errors
from trainforge.checkpoint.problems import KeyProblem, OutdatedCheckpoint
from trainforge.errors import CheckpointError

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.json"
SHARDED_DIR = "sharded"
RANKS_DIR = "ranks"  # format 3: each rank's own tensor state, ranks/<rank>/<component>.pt
SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"  # torch.distributed.checkpoint's metadata (rank 0)
# Format 1: {size, sha256} per file, the full layout only. Format 2 names its hash ("hash") and its
# layout ("layout": "full" or "sharded"), with {size, digest} per file. Format 3 is format 2's
# manifest over a checkpoint of components (trainer_state.json's "components", a file per component
# with tensors, ranks/<rank>/ for each rank's own). All three are read.
FORMAT_VERSION = 3
READ_FORMATS = (1, 2, 3)
FULL = "full"
SHARDED = "sharded"
HASHES = ("sha256", "blake3")
# The files every checkpoint of a layout holds; the components' own files are named by trainer_state.json.
REQUIRED_FILES = frozenset({STATE_FILE})
REQUIRED_SHARDED = frozenset({STATE_FILE, SHARDED_METADATA})
# Read caps: a manifest lists a few files per rank; trainer_state.json holds the config and about
# 30 kB of RNG state per rank, so 64 MB covers thousands of ranks. Anything bigger is refused.
MAX_MANIFEST_BYTES = 8 << 20
MAX_STATE_BYTES = 64 << 20

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_MODEL_NAME = re.compile(r" or instance of \w+")  # pydantic's class names mean nothing to a user
_SAFE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_SHARD_FILE = re.compile(rf"{SHARDED_DIR}/__\d{{1,9}}_\d{{1,9}}\.distcp")
_COMPONENT = r"[a-z][a-z0-9_]{0,63}"
COMPONENT_NAME = re.compile(_COMPONENT)
_RANK_FILE = re.compile(rf"{RANKS_DIR}/(\d{{1,9}})/{_COMPONENT}\.pt")
_WEIGHTS_FILE = re.compile(rf"{_COMPONENT}\.safetensors")
Hex64 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]

NonNegative = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(ge=1)]
Number = StrictInt | StrictFloat
UInt32 = Annotated[StrictInt, Field(ge=0, lt=2**32)]
MAX_STEP = 10**10  # as the config's train.max_steps: a bigger step or epoch is no run's
MAX_RANKS = 100_000
Bounded = Annotated[StrictInt, Field(ge=0, le=MAX_STEP)]
Ranks = Annotated[StrictInt, Field(ge=1, le=MAX_RANKS)]
Count = Annotated[StrictInt, Field(ge=0, le=2**62)]  # samples, positions, bytes
# Seconds since 1970: up to the year 5138, finite (a record, yet a report and MLflow format it).
Timestamp = Annotated[StrictInt | StrictFloat, Field(ge=0, le=1e11, allow_inf_nan=False)]


_M = TypeVar("_M", bound=BaseModel)


def is_safe_name(rel: str) -> bool:
    """A plain relative path inside the checkpoint: no ``..``, no absolute path, no hidden or odd
    characters (backslashes, control characters, undecodable bytes), at most 8 levels deep."""
    parts = rel.split("/")
    return 0 < len(parts) <= 8 and all(_SAFE_PART.fullmatch(part) for part in parts)


def is_checkpoint_name(rel: str) -> bool:
    """A name a checkpoint may hold: a plain relative path, or the sharded layout's DCP metadata
    (the one hidden name, which torch.distributed.checkpoint chooses)."""
    return is_safe_name(rel) or rel == SHARDED_METADATA


def is_sharded_name(rel: str, format_version: int = FORMAT_VERSION) -> bool:
    """A file the sharded layout holds: trainer_state.json, sharded/.metadata,
    sharded/__<rank>_<n>.distcp, (a run's final checkpoint) a component's full weights
    (``<component>.safetensors``), and from format 3 each rank's own state
    (``ranks/<rank>/<component>.pt``)."""
    if rel in (STATE_FILE, SHARDED_METADATA) or _SHARD_FILE.fullmatch(rel) or _WEIGHTS_FILE.fullmatch(rel):
        return True
    return format_version >= 3 and rank_file(rel) is not None


def rank_file(rel: str) -> int | None:
    """The rank that wrote ``ranks/<rank>/<component>.pt`` (format 3); None for any other name."""
    found = _RANK_FILE.fullmatch(rel)
    return int(found.group(1)) if found else None


def shard_rank(rel: str) -> int | None:
    """The rank that wrote ``sharded/__<rank>_<n>.distcp``; None for any other name."""
    if _SHARD_FILE.fullmatch(rel) is None:
        return None
    return int(rel.split("__", 1)[1].split("_", 1)[0])


class Schema(BaseModel):
    # Keys a newer writer adds are ignored, so the readers of format 1 stay forward compatible.
    model_config = ConfigDict(extra="ignore", frozen=True)


class FileEntry(Schema):
    """One file's size and digest: ``sha256`` in format 1, ``digest`` (of the manifest's hash) in 2."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: Count
    sha256: Hex64 | None = None
    digest: Hex64 | None = None

    @model_validator(mode="after")
    def _one_digest(self) -> FileEntry:
        if (self.sha256 is None) == (self.digest is None):
            raise ValueError("needs exactly one of sha256 (format 1) and digest (format 2)")
        return self

    @property
    def hexdigest(self) -> str:
        return self.digest or self.sha256 or ""


class Encryption(Schema):
    """How an encrypted checkpoint's files were encrypted (``checkpoint/crypto.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Literal["aes-256-gcm"]
    key_id: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{16}$")]


class Manifest(Schema):
    """``manifest.json``: every file's size and digest, plus what rotation and listings show."""

    format_version: StrictInt
    files: dict[str, FileEntry]
    hash: Literal["sha256", "blake3"] = "sha256"
    layout: Literal["full", "sharded"] = "full"
    global_step: Bounded | None = None
    epoch: Bounded | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    created_at: Timestamp | None = None
    world_size: Ranks | None = None
    encryption: Encryption | None = None

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value not in READ_FORMATS:
            readable = " and ".join(str(v) for v in READ_FORMATS)
            raise ValueError(f"format_version {value} is not one this trainforge reads ({readable})")
        return value

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for rel in files:
            if not is_checkpoint_name(rel) or rel == MANIFEST:
                raise ValueError(f"{printable(rel)} is not a plain relative file name inside the checkpoint")
        return files

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        key = "sha256" if self.format_version == 1 else "digest"
        if self.format_version == 1 and ({"hash", "layout"} & self.model_fields_set):
            raise ValueError("format 1 has no hash or layout keys (SHA-256 and the full layout only)")
        for rel, entry in self.files.items():
            if getattr(entry, key) is None:
                raise ValueError(f"files.{printable(rel)}: format {self.format_version} gives each file a {key}")
        if self.layout == SHARDED:
            odd = sorted(rel for rel in self.files if not is_sharded_name(rel, self.format_version))
            if odd:
                raise ValueError(f"{printable(odd[0])} is not a file of the sharded layout")
            if self.world_size is None:
                raise ValueError("a sharded checkpoint needs its world_size")
            writers = {rank for rel in self.files for rank in (shard_rank(rel), rank_file(rel)) if rank is not None}
            if writers and max(writers) >= self.world_size:
                raise ValueError(f"lists files of rank {max(writers)}, but its world_size is {self.world_size}")
        else:
            strays = sorted(rel for rel in self.files if not is_safe_name(rel))
            if strays:
                raise ValueError(f"{printable(strays[0])} is not a plain relative file name inside the checkpoint")
        if self.encryption is not None and self.format_version < 3:
            raise ValueError(f"format {self.format_version} has no encryption")
        required = REQUIRED_SHARDED if self.layout == SHARDED else REQUIRED_FILES
        missing = sorted(required - self.files.keys())
        if missing:
            raise ValueError(f"does not list {', '.join(missing)}")
        return self


ComponentName = Annotated[StrictStr, Field(pattern=rf"^{_COMPONENT}$")]


class ComponentFiles(Schema):
    """Where a component's tensors are (format 3): a file of the checkpoint, or ``sharded`` (in
    torch.distributed.checkpoint's shards, under the component's name); ``rank_tensors``: every rank
    wrote ``ranks/<rank>/<component>.pt``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensors: StrictStr | None = None
    rank_tensors: StrictBool = False


class StateFile(Schema):
    """``trainer_state.json`` of format 3: ``{component: state}`` (the same on every rank: rank 0's),
    each rank's own ``{component: state}`` in ``ranks``, where each component's tensors are, which
    files a finished run exports, and the record (metrics, config, versions). The components'
    states are checked by their own schemas (``check_components``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[3]
    global_step: Bounded
    epoch: Bounded
    world_size: Ranks
    layout: Literal["full", "sharded"]
    plan: Annotated[StrictStr, Field(max_length=100)]
    tensor_parallel: Ranks = 1
    components: dict[ComponentName, dict[str, Any]]
    ranks: list[dict[ComponentName, dict[str, Any]]]
    files: dict[ComponentName, ComponentFiles] = Field(default_factory=dict)
    exports: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    metrics: dict[str, Number] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, StrictStr] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> StateFile:
        if len(self.ranks) != self.world_size:
            raise ValueError(f"holds {len(self.ranks)} rank states for {self.world_size} ranks")
        named = set(self.components)
        for index, mine in enumerate(self.ranks):
            strays = sorted(set(mine) - named)
            if strays:
                raise ValueError(f"ranks.{index}: {strays[0]} is not one of the checkpoint's components")
        for name, where in self.files.items():
            if name not in named:
                raise ValueError(f"files: {name} is not one of the checkpoint's components")
            if where.tensors is None:
                continue
            if where.tensors == SHARDED:
                if self.layout != SHARDED:
                    raise ValueError(f"files.{name}: a full checkpoint holds no shards")
            elif not is_safe_name(where.tensors) or where.tensors in (STATE_FILE, MANIFEST):
                raise ValueError(f"files.{name}: {printable(where.tensors)} is not a tensor file of the checkpoint")
        for target, source in self.exports.items():
            if not (_WEIGHTS_FILE.fullmatch(target) and _WEIGHTS_FILE.fullmatch(source)):
                raise ValueError(f"exports: {printable(target)} <- {printable(source)} are not weights files")
        return self

    def listed_files(self) -> set[str]:
        """The tensor files this state refers to (each rank's own included), which the manifest must list."""
        found = {w.tensors for w in self.files.values() if w.tensors not in (None, SHARDED)}
        found |= set(self.exports.values())
        for name, where in self.files.items():
            if where.rank_tensors:
                found |= {rank_path(rank, name) for rank in range(self.world_size)}
        return {name for name in found if name is not None}


def rank_path(rank: int, component: str) -> str:
    """Where rank ``rank`` keeps ``component``'s own tensors (format 3)."""
    return f"{RANKS_DIR}/{rank}/{component}.pt"


def check_components(
    components: Mapping[str, dict[str, Any]],
    ranks: list[dict[str, dict[str, Any]]],
    schemas: Mapping[str, ComponentSchemas],
) -> None:
    """Each component's state against its own schema (strict: unknown keys and wrong types are
    refused before anything is applied); a component this trainforge does not know is refused too.
    CheckpointError with a one-line reason."""
    for name, values in components.items():
        known = schemas.get(name)
        if known is None:
            raise CheckpointError(
                f"{STATE_FILE} is malformed: components.{name}: a component this trainforge does not know"
            )
        _check_part(known.schema, values, f"components.{name}")
    for index, mine in enumerate(ranks):
        for name, values in mine.items():
            _check_part(schemas[name].rank_schema, values, f"ranks.{index}.{name}")


def _check_part(schema: type[BaseModel] | None, values: dict[str, Any], where: str) -> None:
    if schema is None:
        if values:
            raise CheckpointError(f"{STATE_FILE} is malformed: {where}: holds state its component does not keep")
        return
    try:
        schema.model_validate(values)
    except ValidationError as err:
        raise CheckpointError(f"{STATE_FILE} is malformed: {where}.{describe(err)}") from None
    except RecursionError:
        raise CheckpointError(f"{STATE_FILE} is malformed: {where}: nested too deeply") from None


@dataclass(frozen=True)
class ComponentSchemas:
    """A component's schemas: of its state (the same on every rank) and of each rank's own."""

    schema: type[BaseModel] | None = None
    rank_schema: type[BaseModel] | None = None


def parse_manifest(raw: bytes) -> tuple[Manifest, dict[str, Any]]:
    """A manifest from its bytes: the validated schema and the raw JSON object; CheckpointError
    saying what is wrong otherwise."""
    return parse_json(raw, MANIFEST, MAX_MANIFEST_BYTES, Manifest)


def parse_trainer_state(raw: bytes) -> tuple[StateFile, dict[str, Any]]:
    """``trainer_state.json`` from its bytes, as :func:`parse_manifest`; an ``OutdatedCheckpoint``
    when it is of formats 1 or 2 (no ``format_version``: fixed fields)."""
    if raw.startswith(b"TFENC1"):  # crypto.MAGIC: a reader that was not given the key
        raise KeyProblem(f"{STATE_FILE} is encrypted (checkpoint.encryption): reading it needs the key")
    data = _json_object(raw, STATE_FILE, MAX_STATE_BYTES)
    if "format_version" not in data:
        raise OutdatedCheckpoint(
            f"{STATE_FILE} is of an earlier trainforge's format: convert the checkpoint with "
            "`trainforge ckpt upgrade PATH` first"
        )
    return _checked(data, STATE_FILE, StateFile), data


def parse_json(raw: bytes, what: str, cap: int, schema: type[_M]) -> tuple[_M, dict[str, Any]]:
    """A checkpoint's JSON file ``what`` from its bytes (at most ``cap``), checked by ``schema``."""
    data = _json_object(raw, what, cap)
    return _checked(data, what, schema), data


def _json_object(raw: bytes, what: str, cap: int) -> dict[str, Any]:
    if len(raw) > cap:
        raise CheckpointError(f"{what} is larger than {cap >> 20} MB: not a file trainforge wrote")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, digit limits
        raise CheckpointError(f"{what} is malformed: {_first_line(err)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} is malformed: not a JSON object")
    return data


def _checked(data: dict[str, Any], what: str, schema: type[_M]) -> _M:
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise CheckpointError(f"{what} is malformed: {describe(err)}") from None
    except RecursionError:
        raise CheckpointError(f"{what} is malformed: nested too deeply") from None


def describe(err: ValidationError) -> str:
    """A pydantic error on one line: the first few fields and what is wrong with each."""
    parts = []
    for item in err.errors()[:3]:
        where = ".".join(str(p) for p in item["loc"]) or "top level"
        parts.append(f"{printable(where)}: {_MODEL_NAME.sub('', item['msg'])}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def printable(name: str) -> str:
    """A name safe to print on one line: undecodable bytes and control characters escaped
    (``errors.printable``), at most ``errors.MAX_SHOWN`` characters."""
    return errors.printable(name)[: errors.MAX_SHOWN]


def open_regular(path: str | os.PathLike[str], name: str) -> BinaryIO:
    """A local regular file opened for reading; a link is never followed and a FIFO never blocks."""
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW: the last component is a symbolic link
            raise CheckpointError(f"{name} is a symbolic link, not a regular file") from None
        raise
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise CheckpointError(f"{name} is {kind_of(mode)}, not a regular file")
    return os.fdopen(descriptor, "rb")


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, for a message."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"
