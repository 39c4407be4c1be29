"""``model.pretrained``: weights read into the built model before the first step.

A warm start, not a resume: only the weights come in; the optimizer, the schedule, the data
position and the progress start fresh (``--resume`` continues a run instead). Sources are paths on
this machine, never downloaded:

* a Hugging Face model directory: ``config.json`` with ``model.safetensors`` or the shards a
  ``model.safetensors.index.json`` names (``pytorch_model.bin`` is a pickle and is not read);
* a ``.safetensors`` file;
* a trainforge checkpoint directory, verified before it is read (every byte against its
  manifest), or a run directory: its newest checkpoint that verifies.

The file's tensor names meet the model's ``state_dict`` names as they are, or with the ``model.``
prefix of trainforge's wrapper around a transformers model added or taken away, whichever matches
more: a Hugging Face directory loads into a built-in, and a built-in's weights into a factory that
returns the bare transformers model. Each rank reads only what it keeps: a parameter that FSDP or
tensor parallelism sharded is read as its local rows or columns, straight out of the
memory-mapped file.

Every file is untrusted input: a header is refused by its length before it is parsed
(``files.safetensors_header``), a name read from it is printed escaped (``errors.printable``), a
symbolic link in a model directory is followed only to a file inside it (or, in a Hugging Face
cache snapshot, into that cache's ``blobs/``), and a floating-point tensor that is not finite in the
model's dtype (NaN, an infinity, or a value beyond the dtype's range) is refused by name as it is read.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from trainforge.checkpoint.reader import read_whole, weights_file
from trainforge.checkpoint.saved import read_saved
from trainforge.checkpoint.schema import MANIFEST
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.errors import ModelError, printable, shown
from trainforge.files import file_kind, safetensors_header

log = logging.getLogger("trainforge.pretrained")

MODEL_FILE = "model.safetensors"  # the weights of a Hugging Face directory and of a trainforge run directory
MODEL_COMPONENT = "model"  # the checkpoint component whose weights a warm start reads (worker/components)
HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20
WRAPPER_PREFIX = "model."  # models/registry.HFLogits keeps the transformers model as ``.model``
SHOWN = 3  # names shown per kind of mismatch in a one-line error


@dataclass(frozen=True)
class Source:
    """Where the weights are: safetensors files (read lazily, a slice at a time), or the tensors of
    a sharded checkpoint read whole."""

    description: str
    files: tuple[Path, ...] = ()
    sharded_checkpoint: Path | None = None


def resolve(given: str) -> Source:
    """The weights ``model.pretrained`` names, or one line that says what to give instead."""
    key = f"model.pretrained {given!r}"
    if "://" in given:
        raise ModelError(f"{key}: a local path only (trainforge downloads nothing); copy the weights here first")
    path = Path(given).expanduser()
    if not path.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", given):
            raise ModelError(
                f"{key} is not a path on this machine and hub names are not fetched: download the model first "
                f"(huggingface-cli download {given} --local-dir DIR) and set model.pretrained: DIR"
            )
        raise ModelError(f"{key}: no such file or directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ModelError(
                f"{key}: a file must be .safetensors (trainforge loads no pickles); "
                "or give a Hugging Face model directory or a trainforge run or checkpoint directory"
            )
        return Source(f"safetensors file {path}", (path,))  # the file the config names, links and all
    if not path.is_dir():
        raise ModelError(f"{key}: {file_kind(path.stat().st_mode)}, neither a .safetensors file nor a directory")
    if (path / MANIFEST).is_file():
        return checkpoint_source(path, key)
    if (path / HF_CONFIG).is_file():
        return hf_source(path, key)
    checkpoints = sorted(p for p in path.glob("checkpoint_*") if (p / MANIFEST).is_file())
    if checkpoints:
        return run_source(path, checkpoints, key)
    if (path / MODEL_FILE).is_file():
        found = own_file(path, MODEL_FILE, key)
        return Source(f"run directory {path} ({MODEL_FILE}, no checkpoint to verify)", (found,))
    raise ModelError(
        f"{key}: a directory with neither {HF_CONFIG} (Hugging Face), {MANIFEST} (a checkpoint) nor "
        f"checkpoints or {MODEL_FILE} (a trainforge run)"
    )


def hf_source(path: Path, key: str) -> Source:
    index = path / HF_INDEX
    if index.is_file():
        with own_file(path, HF_INDEX, key).open("rb") as handle:
            raw = handle.read(MAX_INDEX_BYTES + 1)
        try:
            weight_map = json.loads(raw)["weight_map"] if len(raw) <= MAX_INDEX_BYTES else None
        except (ValueError, KeyError, TypeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise ModelError(f"{key}: {HF_INDEX} is not an index of safetensors shards (no weight_map)")
        names = sorted({str(v) for v in weight_map.values()})
        bad = [n for n in names if "/" in n or n.startswith(".") or not (path / n).is_file()]
        if bad:
            raise ModelError(f"{key}: {HF_INDEX} names {shown(bad[0])}, which is not a file of the directory")
        shards = tuple(own_file(path, n, key) for n in names)
        return Source(f"Hugging Face directory {path} ({len(names)} shards)", shards)
    if (path / MODEL_FILE).is_file():
        return Source(f"Hugging Face directory {path}", (own_file(path, MODEL_FILE, key),))
    raise ModelError(
        f"{key}: a Hugging Face directory without {MODEL_FILE} or {HF_INDEX} "
        "(pytorch_model.bin is a pickle and is not read: convert it to safetensors)"
    )


def own_file(folder: Path, name: str, key: str) -> Path:
    """``folder/name``, a file of the model directory: a symbolic link is followed only to a file
    inside ``folder``, or from a Hugging Face cache snapshot (``.../snapshots/<revision>/``) into
    that cache's ``blobs/``, where the hub keeps the files its snapshots link to; any other target
    (``/etc/...``, a home directory's key) is refused, as a checkpoint refuses every link."""
    path = folder / name
    if not path.is_symlink():
        return path
    base, target = folder.resolve(), path.resolve()
    cache_blobs = base.parent.parent / "blobs" if base.parent.name == "snapshots" else None
    if target.is_relative_to(base) or (cache_blobs is not None and target.is_relative_to(cache_blobs)):
        return path
    raise ModelError(
        f"{key}: {shown(name)} is a symbolic link to {shown(target)}, outside the model directory: "
        "copy the file into the directory"
    )


def run_source(path: Path, checkpoints: list[Path], key: str) -> Source:
    """A run directory: its newest checkpoint that verifies, saying which newer ones did not."""
    problems = []
    for checkpoint in reversed(checkpoints):
        try:
            return checkpoint_source(checkpoint, key)
        except ModelError as err:
            problems.append(str(err))
            log.warning("model.pretrained: skipping %s", err)
    raise ModelError(f"{key}: none of the run's {len(checkpoints)} checkpoints verifies ({problems[0]})")


def checkpoint_source(path: Path, key: str) -> Source:
    store, name = CheckpointStore.for_checkpoint(str(path))
    verification = store.verify(name)
    if not verification.ok:
        raise ModelError(f"{key}: checkpoint {path.name} does not verify: {verification.problems[0]}")
    saved = read_saved(path)
    where = f"checkpoint {path} (step {saved.step}, verified)"
    found = weights_file(path, saved, MODEL_COMPONENT)
    if found is not None:
        return Source(where, (found,))
    return Source(where, sharded_checkpoint=path)


# ---------------------------------------------------------------------------------------------
# Reading


class Weights:
    """The tensors of a source by name: shapes from the headers, and slices read on demand."""

    def __init__(self, source: Source) -> None:
        from safetensors import safe_open

        self.source = source
        self.where: dict[str, Any] = {}
        self.whole: dict[str, torch.Tensor] = {}
        if source.sharded_checkpoint is not None:
            self.whole = read_whole(source.sharded_checkpoint, MODEL_COMPONENT)
        self.spans: dict[str, tuple[Path, int, str]] = {}  # name -> (file, first data byte, dtype)
        for file in source.files:
            data_start, header = safetensors_header(file, f"model.pretrained: {file}", ModelError)  # bounded
            try:
                handle = safe_open(str(file), framework="pt")  # validates the header and the offsets
                names = list(handle.keys())
            except Exception as err:  # safetensors' header errors
                raise ModelError(
                    f"model.pretrained: {file} is not a readable safetensors file ({printable(str(err))[:300]})"
                ) from None
            for name in names:
                self.where[name] = handle
                entry = header[name]
                self.spans[name] = (file, data_start + int(entry["data_offsets"][0]), str(entry["dtype"]))

    def names(self) -> list[str]:
        return sorted([*self.where, *self.whole])

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.whole:
            return tuple(self.whole[name].shape)
        return tuple(self.where[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name in self.whole:
            return self.whole[name][index]
        part = self.where[name].get_slice(name)
        return part[index] if index else part[:]

    def read_into(self, name: str, index: tuple[slice, ...], local: torch.Tensor) -> int:
        """Fill ``local`` with the part ``index`` of tensor ``name``; the bytes read. A run of whole
        rows (FSDP's shards, a plain tensor) of a file's tensor in ``local``'s own dtype is read
        straight into ``local``: no memory map left resident, no copy in between."""
        span = self.spans.get(name)
        shape = self.shape(name)
        rows = rows_of(index, shape)
        if span is None or rows is None or SAFETENSORS_DTYPES.get(span[2]) != local.dtype or not local.is_contiguous():
            value = self.read(name, index)
            local.copy_(value.to(dtype=local.dtype))
            return value.numel() * value.element_size()
        file, offset, _ = span
        row_bytes = math.prod(shape[1:]) * local.element_size()
        target = local.view(-1).view(torch.uint8).numpy().data  # a writable view of local's bytes
        with file.open("rb", buffering=0) as handle:
            handle.seek(offset + rows[0] * row_bytes)
            done = 0
            while done < target.nbytes:  # readinto may return less than asked
                got = handle.readinto(target[done:])
                if not got:
                    raise ModelError(f"model.pretrained: {file} ends inside tensor {name!r}")
                done += got
        return target.nbytes


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def rows_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first, stop)`` when ``index`` takes whole rows of a tensor of ``shape`` (every dimension
    but the first in full), else None."""
    if not shape:
        return None
    if not index:
        return 0, shape[0]
    first, *rest = index
    if any(
        (s.start or 0) != 0 or (s.stop if s.stop is not None else d) != d for s, d in zip(rest, shape[1:], strict=True)
    ):
        return None
    return first.start or 0, first.stop if first.stop is not None else shape[0]


@dataclass
class Matching:
    """The model's names against the file's: ``pairs`` model name -> file name."""

    pairs: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: file (a, b) vs model (c, d)"

    @property
    def exact(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        parts = []
        for what, names in (
            ("missing from the file", self.missing),
            ("not in the model", self.unexpected),
            ("of another shape", self.mismatched),
        ):
            if names:
                listed = ", ".join(printable(n)[:200] for n in names[:SHOWN])  # a file's names are untrusted
                listed += f", ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else ""
                parts.append(f"{len(names)} {what} ({listed})")
        return "; ".join(parts)


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each of :func:`target_tensors`' names with every other name the same tensor has (GPT-2's
    ``transformer.wte.weight`` and ``lm_head.weight``): a file may keep a tied tensor under any."""
    keep = set(model.state_dict(keep_vars=True))
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in keep:
            owner = first.setdefault(id(tensor), name)
            aliases.setdefault(owner, []).append(name)
    return aliases


def target_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a pretrained file fills: the model's parameters and persistent buffers by name, one
    name per tensor (tied weights, such as GPT-2's output layer and input embedding, once)."""
    keep = set(model.state_dict(keep_vars=True))
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in keep and id(tensor) not in seen:
            seen.add(id(tensor))
            found[name] = tensor
    return found


NAMINGS = (
    lambda n: n,
    lambda n: WRAPPER_PREFIX + n,  # a transformers model's names into trainforge's built-in
    lambda n: n.removeprefix(WRAPPER_PREFIX),  # a built-in's names into the bare transformers model
)


def match(model: nn.Module, weights: Weights) -> Matching:
    """Pair the model's tensors with the file's under the naming that matches most."""
    targets = target_tensors(model)
    tied = set(model.state_dict(keep_vars=True)) - set(targets)  # names another name already holds
    names = weights.names()
    renamings = [{rename(n): n for n in names} for rename in NAMINGS]
    aliases = tied_names(model)
    everyone = [a for names in aliases.values() for a in names]
    chosen = max(renamings, key=lambda renamed: sum(t in renamed for t in everyone))
    pairs: dict[str, str] = {}
    for target in targets:  # a tied tensor under whichever of its names the file kept
        stored = [chosen[a] for a in aliases.get(target, [target]) if a in chosen]
        if stored:
            pairs[target] = stored[0]
    result = Matching()
    result.missing = sorted(t for t in targets if t not in pairs)
    # A file written from a whole state_dict also holds tied copies: those are not "unexpected".
    result.unexpected = sorted(n for t, n in chosen.items() if t not in pairs and t not in tied)
    for target, name in pairs.items():
        want, have = tuple(targets[target].shape), weights.shape(name)
        if want != have:
            result.mismatched.append(f"{target}: file {have} vs model {want}")
    result.mismatched.sort()
    result.pairs = {t: n for t, n in pairs.items() if tuple(targets[t].shape) == weights.shape(n)}
    return result


@dataclass(frozen=True)
class Loaded:
    """What one rank read: tensors filled, bytes read (its shards only), seconds, and the rest."""

    tensors: int
    bytes_read: int
    total_bytes: int
    seconds: float
    left: str  # what strict: false left out, "" when the file and the model match exactly
    source: str  # what was read, for people

    def line(self, peak_added: int | None = None) -> str:
        """One line for the worker's log; ``peak_added``: host memory the loading added at its peak."""
        text = (
            f"model.pretrained: {self.tensors} tensors from {self.source}; this rank read "
            f"{self.bytes_read / 1e6:.1f} of {self.total_bytes / 1e6:.1f} MB in {self.seconds:.2f} s"
        )
        if peak_added is not None:
            text += f", host memory +{peak_added / 1e6:.1f} MB at peak"
        return text + (f"; not loaded: {self.left}" if self.left else "")


class PeakMemory:
    """The largest resident set size of this process inside the ``with`` block, sampled every
    ``every_s`` by a thread (``added``: the peak over what it was on entry)."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s = every_s
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.every_s)

    def __enter__(self) -> PeakMemory:
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def added(self) -> int:
        return self.peak - self.before


def local_index(tensor: torch.Tensor) -> tuple[tuple[slice, ...], torch.Tensor]:
    """The part of the whole tensor this rank holds (its index into the global shape) and the
    local tensor to fill: all of it for a plain tensor, the shard for a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (), tensor.data
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    index = tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
    return index, tensor.to_local().data


def check_pretrained(model: nn.Module, given: str, *, strict: bool = True) -> None:
    """Before Ray starts: the source resolves, and its names and shapes fit ``model`` (built on the
    meta device: no memory) when ``strict``. Only headers are read; a sharded checkpoint without a
    full export is left to the workers, which read it whole."""
    source = resolve(given)
    if source.sharded_checkpoint is not None:
        return
    refuse_mismatch(match(model, Weights(source)), f"model.pretrained {given!r}", strict)


STRICT_HINT = "set model.pretrained_strict: false to load what matches"


def refuse_mismatch(found: Matching, key: str, strict: bool, hint: str = STRICT_HINT) -> None:
    """One line for weights that do not fit: ``hint`` says what to do about it."""
    if not found.pairs:
        raise ModelError(f"{key}: none of its tensors matches the model's names ({found.describe()})")
    if strict and not found.exact:
        raise ModelError(f"{key} does not fit the model: {found.describe()}; {hint}")


def load_pretrained(model: nn.Module, given: str, *, strict: bool = True) -> Loaded:
    """Fill ``model``'s tensors from the weights ``model.pretrained`` names (see :func:`load_weights`)."""
    return load_weights(model, resolve(given), strict=strict, key=f"model.pretrained {given!r}")


@torch.no_grad()
def load_weights(
    model: nn.Module, source: Source, *, strict: bool = True, key: str = "the weights", hint: str = STRICT_HINT
) -> Loaded:
    """Fill ``model``'s tensors from ``source`` (wrapped or not: FSDP's and tensor parallelism's
    shards are read as slices); one line naming what does not match, and ``hint``, unless ``strict``
    is off."""
    started = time.perf_counter()
    weights = Weights(source)
    found = match(model, weights)
    refuse_mismatch(found, key, strict, hint)
    targets = target_tensors(model)
    read = total = 0
    for target, name in found.pairs.items():
        index, local = local_index(targets[target])
        read += weights.read_into(name, index, local)
        refuse_not_finite(local, name, key)
        total += targets[target].numel() * local.element_size()
    elapsed = time.perf_counter() - started
    return Loaded(len(found.pairs), read, total, elapsed, "" if strict else found.describe(), source.description)


def refuse_not_finite(local: torch.Tensor, name: str, key: str) -> None:
    """One line naming tensor ``name`` when a floating-point value read into ``local`` is NaN or
    an infinity, whether the file held it or it lay beyond the range of the model's dtype (an F32
    1e10 read into float16). One pass over memory just read: cheap beside the read itself."""
    if (local.is_floating_point() or local.is_complex()) and not bool(torch.isfinite(local).all()):
        dtype = str(local.dtype).removeprefix("torch.")
        raise ModelError(
            f"{key}: tensor {shown(name)} holds values that are not finite as {dtype} "
            "(NaN, an infinity, or beyond the dtype's range): refused, the model would train on them"
        )


# ---------------------------------------------------------------------------------------------
# Building without the weights: a sharded model that pretrained weights fill completely


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside keep their parameters on the meta device (no memory; each is made on
    the CPU and dropped as it is registered, so one tensor at a time) and their buffers where
    they are: a buffer that no checkpoint holds (rotary frequencies) keeps the value its module
    computed. :func:`materialize` gives the parameters memory once the plan has sharded them."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Memory for parameters left on the meta device (only each rank's shards, after FSDP), their
    values unset until the pretrained weights are read; buffers keep the values they had."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
