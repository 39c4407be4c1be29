"""A prepared token corpus on disk: its manifest, its verification, its token streams, and the
writers ``trainforge data prepare`` (data/corpus.py) fills it with.

Layout of a directory ``trainforge data prepare`` wrote (docs/data.md)::

    manifest.json         written last: tokenizer, dtype, splits, every other file's size and SHA-256
    train_00000.bin ...   the training documents' tokens, concatenated, each document followed by
                          the end-of-document id; raw little-endian uint16 (vocab <= 65536) or uint32
    val_00000.bin ...     the same for the validation documents
    train_index.npy       int64 offsets of the documents in the train stream (documents + 1 of them)
    val_index.npy
    sources.jsonl         one line per input file (or JSONL chunk): path, bytes, SHA-256, documents, tokens
    tokenizer.json        the tokenizer (absent for the bytes tokenizer)

The corpus is data read back from storage, so it is not trusted: the manifest is bounded and
schema-checked, only regular files are read, and sizes (always) and digests (``full``) must match.
"""

from __future__ import annotations

import bisect
import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainforge.checkpoint.hashing import SHA256, hash_file, open_hashing
from trainforge.errors import DataError

MANIFEST_FILE = "manifest.json"
SOURCES_FILE = "sources.jsonl"
FORMAT: Literal["trainforge-tokens/1"] = "trainforge-tokens/1"
MAX_MANIFEST_BYTES = 16 << 20
Split = Literal["train", "val"]
SPLITS: tuple[Split, Split] = ("train", "val")
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"  # a plain file name: no folders, no leading dot
UINT16_VOCAB = 1 << 16
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

Name = Annotated[str, Field(pattern=f"^{NAME_PATTERN}$")]
Count = Annotated[int, Field(ge=0, le=1 << 62)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(Strict):
    size: Count
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class SplitEntry(Strict):
    tokens: Count
    documents: Count
    bytes: Count  # UTF-8 bytes of the split's documents, for bits per byte
    shards: Annotated[list[Name], Field(max_length=1 << 20)]
    index: Name


class TokenizerEntry(Strict):
    kind: Literal["bytes", "bpe", "file"]
    spec: str  # as given: bytes, bpe:4096, or the path of the file that was copied
    vocab_size: Annotated[int, Field(ge=2, le=1 << 32)]
    eod_id: Annotated[int, Field(ge=0)]
    file: Name | None = None


class CorpusManifest(Strict):
    """What ``manifest.json`` says; cross-field checks make a manifest that parses a consistent one."""

    format: Literal["trainforge-tokens/1"]
    tokenizer: TokenizerEntry
    dtype: Literal["uint16", "uint32"]
    val_fraction: Annotated[float, Field(ge=0.0, lt=1.0)]
    inputs: list[str]
    include: list[str] = []
    max_files: Annotated[int, Field(ge=1)] | None = None
    splits: dict[Split, SplitEntry]
    files: dict[Name, FileEntry]

    @model_validator(mode="after")
    def _consistent(self) -> CorpusManifest:
        if set(self.splits) != set(SPLITS):
            raise ValueError("splits must be train and val")
        if self.tokenizer.eod_id >= self.tokenizer.vocab_size:
            raise ValueError("tokenizer.eod_id must be below tokenizer.vocab_size")
        wanted = "uint16" if self.tokenizer.vocab_size <= UINT16_VOCAB else "uint32"
        if self.dtype != wanted:
            raise ValueError(f"dtype {self.dtype} does not fit vocab_size {self.tokenizer.vocab_size}")
        if (self.tokenizer.kind == "bytes") != (self.tokenizer.file is None):
            raise ValueError("tokenizer.file is required except for the bytes tokenizer")
        named = [self.tokenizer.file] if self.tokenizer.file else []
        for split in self.splits.values():
            named += [*split.shards, split.index]
            size = sum(self.files[s].size for s in split.shards if s in self.files)
            if size != split.tokens * DTYPES[self.dtype].itemsize:
                raise ValueError(f"the shards {split.shards} do not hold {split.tokens} tokens of {self.dtype}")
        missing = sorted(set(named) - set(self.files))
        if missing:
            raise ValueError(f"files {missing} are named but not listed with a size and digest")
        return self

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


def prepare_hint(path: Path | str) -> str:
    return f"prepare one with: trainforge data prepare INPUT... --output {path}"


def read_manifest(directory: Path, origin: str = "data.path") -> CorpusManifest:
    """``manifest.json`` of a prepared corpus, bounded and schema-checked; DataError naming ``origin``."""
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise DataError(f"{origin} {directory} {what}; {prepare_hint(directory)}")
    path = directory / MANIFEST_FILE
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise DataError(
            f"{origin} {directory} holds no {MANIFEST_FILE}: not a prepared token corpus; {prepare_hint(directory)}"
        ) from None
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
        raise DataError(
            f"{origin} {directory}: {MANIFEST_FILE} is not a regular file of at most {MAX_MANIFEST_BYTES} bytes"
        )
    try:
        raw: Any = json.loads(path.read_bytes())
        return CorpusManifest.model_validate(raw)
    except (ValueError, UnicodeDecodeError) as err:  # json and pydantic errors are ValueErrors
        detail = first_problem(err)
        raise DataError(
            f"{origin} {directory}: {MANIFEST_FILE} is not a token corpus manifest ({detail}); "
            f"{prepare_hint(directory)}"
        ) from None


def first_problem(err: Exception) -> str:
    """One line out of a pydantic or json error."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return " ".join(str(err).split())[:300]


def verify_corpus(directory: Path, *, full: bool, origin: str = "data.path") -> CorpusManifest:
    """The manifest of the corpus at ``directory`` once every file it lists is a regular file of the
    listed size and, with ``full``, the listed SHA-256; else a one-line DataError naming the file.

    Sizes cost a ``stat`` per file (every training worker checks them); digests read every byte
    (done once, on the driver, before Ray starts, and by ``trainforge data verify``).
    """
    manifest = read_manifest(directory, origin)
    again = f"prepare it again: trainforge data prepare INPUT... --output {directory} --force"
    for name, entry in sorted(manifest.files.items()):
        try:
            info = (directory / name).lstat()
        except FileNotFoundError:
            raise DataError(f"{origin} {directory}: {name} is missing; {again}") from None
        if not stat.S_ISREG(info.st_mode):
            raise DataError(f"{origin} {directory}: {name} is not a regular file")
        if info.st_size != entry.size:
            raise DataError(
                f"{origin} {directory}: {name} is {info.st_size} bytes, the manifest says {entry.size} "
                f"(truncated or changed); {again}"
            )
    if full:
        for name, entry in sorted(manifest.files.items()):
            if hash_file(directory / name, SHA256).digest != entry.sha256:
                raise DataError(f"{origin} {directory}: {name} fails its SHA-256 check (corrupted); {again}")
        for split in SPLITS:
            check_split(directory, manifest, split, f"{origin} {directory}")
    return manifest


def check_split(directory: Path, manifest: CorpusManifest, split: Split, where: str) -> None:
    """What hashes cannot tell of a corpus that someone else prepared (the digests are theirs): the
    index is plain int64 offsets from 0 to the split's tokens, never decreasing, and every token id
    is below the vocabulary (an id at or above it fails the model's embedding at some step)."""
    entry = manifest.splits[split]
    offsets = document_offsets(directory, manifest, split)
    if offsets[0] != 0 or offsets[-1] != entry.tokens or bool(np.any(np.diff(offsets) < 0)):
        raise DataError(f"{where}: {entry.index} is not document offsets from 0 to {entry.tokens}, never decreasing")
    stream = split_stream(directory, manifest, split)
    chunk = 1 << 24
    for start in range(0, len(stream), chunk):
        tokens = stream.read(start, min(chunk, len(stream) - start))
        if tokens.size and int(tokens.max()) >= manifest.vocab_size:
            at = start + int(np.argmax(tokens >= manifest.vocab_size))
            raise DataError(
                f"{where}: {split} token {at} is id {int(tokens.max())}, at or above the vocabulary of "
                f"{manifest.vocab_size}"
            )


class TokenStream:
    """One split's tokens as one sequence over its shards, memory-mapped (read-only) on first use.

    Pickling (to a DataLoader worker) carries the paths, not the mapped pages: each process maps
    the files itself and the pages are shared through the page cache.
    """

    def __init__(self, directory: Path, shards: list[str], dtype: str, tokens: int) -> None:
        self.paths = [directory / name for name in shards]
        self.dtype = DTYPES[dtype]
        self.length = tokens
        sizes = [os.stat(path).st_size // self.dtype.itemsize for path in self.paths]
        self.starts = [0]
        for size in sizes:
            self.starts.append(self.starts[-1] + size)
        if self.starts[-1] != tokens:
            raise DataError(f"the shards {shards} hold {self.starts[-1]} tokens, the manifest says {tokens}")
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def _mapped(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [
                np.memmap(path, dtype=self.dtype, mode="r") if end > start else np.zeros(0, self.dtype)
                for path, start, end in zip(self.paths, self.starts, self.starts[1:], strict=False)
            ]
        return self._maps

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``start .. start + count - 1`` as int64, across shard boundaries."""
        if start < 0 or count < 0 or start + count > self.length:
            raise IndexError(f"tokens {start}..{start + count} out of range for {self.length}")
        maps = self._mapped()
        pieces = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while count > 0:
            offset = start - self.starts[shard]
            piece = maps[shard][offset : offset + count]
            pieces.append(piece)
            start += len(piece)
            count -= len(piece)
            shard += 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)


def split_stream(directory: Path, manifest: CorpusManifest, split: Split) -> TokenStream:
    entry = manifest.splits[split]
    return TokenStream(directory, entry.shards, manifest.dtype, entry.tokens)


def document_offsets(directory: Path, manifest: CorpusManifest, split: Split) -> np.ndarray:
    """Where each document of ``split`` starts in its stream, and where the last one ends (int64)."""
    entry = manifest.splits[split]
    wrong = f"{directory / entry.index} is not {entry.documents + 1} int64 document offsets"
    try:
        offsets = np.load(directory / entry.index, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:  # pickled objects, not an .npy file
        raise DataError(f"{wrong} ({first_problem(err)})") from None
    if not isinstance(offsets, np.ndarray) or offsets.dtype != np.int64 or offsets.shape != (entry.documents + 1,):
        raise DataError(wrong)
    return offsets


# ---------------------------------------------------------------------------------------------
# Writing (trainforge data prepare, data/corpus.py)


class SplitWriter:
    """Appends one split's tokens to shards of at most ``shard_tokens`` tokens, hashing as it writes."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype[Any], shard_tokens: int) -> None:
        self.directory = directory
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.files: dict[str, FileEntry] = {}
        self.shards: list[str] = []
        self.lengths: list[np.ndarray] = []
        self.tokens = 0
        self.text_bytes = 0
        self._writer: Any = None
        self._in_shard = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: int) -> None:
        self.lengths.append(lengths)
        self.text_bytes += text_bytes
        self.tokens += len(tokens)
        while len(tokens):
            if self._writer is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self.shards.append(name)
                self._writer = open_hashing(self.directory / name, SHA256)
                self._in_shard = 0
            room = self.shard_tokens - self._in_shard
            self._writer.write(np.ascontiguousarray(tokens[:room], dtype=self.dtype.newbyteorder("<")).view(np.uint8))
            self._in_shard += min(room, len(tokens))
            tokens = tokens[room:]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        record = self._writer.finish()
        self.files[self.shards[-1]] = FileEntry(size=record.size, sha256=record.digest)
        self._writer = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def finish(self) -> SplitEntry:
        if self._writer is not None:
            self._close_shard()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        index = f"{self.split}_index.npy"
        writer = open_hashing(self.directory / index, SHA256)
        np.save(writer, offsets, allow_pickle=False)
        record = writer.finish()
        self.files[index] = FileEntry(size=record.size, sha256=record.digest)
        return SplitEntry(
            tokens=self.tokens, documents=len(lengths), bytes=self.text_bytes, shards=self.shards, index=index
        )


def write_jsonl(path: Path, lines: list[dict[str, Any]], files: dict[str, FileEntry]) -> None:
    text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    write_bytes(path, text.encode(), files)


def write_bytes(path: Path, data: bytes, files: dict[str, FileEntry] | None) -> None:
    writer = open_hashing(path, SHA256)
    writer.write(data)
    record = writer.finish()
    if files is not None:
        files[path.name] = FileEntry(size=record.size, sha256=record.digest)
