"""The documents of ``trainforge data prepare``'s inputs: which files, and what text each holds.

A document is a text file (UTF-8, read whole) or the ``text`` of one line of a ``.jsonl`` file.
Inputs are files, directories (walked recursively in sorted order, hidden entries and links left
out) and ``stdlib``, the Python standard library's own ``.py`` files (``sysconfig``'s ``stdlib``
folder, without its tests and installed packages). A file named as an input must be text; one
found in a directory that is not (binary, not UTF-8) is skipped and counted.

Which split a document lands in depends only on its content (a hash compared with the validation
fraction): the split is deterministic, does not change when files are added or reordered, and
identical documents never straddle the two splits.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainforge.errors import DataError
from trainforge.files import read_user_file

STDLIB = "stdlib"
STDLIB_SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
JSONL_CHUNK_BYTES = 32 << 20  # a JSONL file is tokenized in pieces of about this size, in parallel
MAX_TEXT_FILE_BYTES = 1 << 30  # a text file is one document, read whole
BPE_SAMPLE_BYTES = 1 << 30  # the BPE trains on at most about this much of the training text


@dataclass(frozen=True)
class Task:
    """One unit of parallel work: a text file, or a byte range of a JSONL file."""

    path: Path
    shown: str  # the path as messages and sources.jsonl give it
    jsonl: bool
    named: bool  # named as an input (a binary file is an error) or found in a directory (skipped)
    size: int
    start: int = 0
    end: int = 0  # JSONL: lines starting in [start, end)

    @property
    def read_bytes(self) -> int:
        """The bytes of input this task covers."""
        return self.end - self.start if self.jsonl else self.size


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_tasks(inputs: list[str], include: list[str], max_files: int | None, key: str = "INPUT") -> list[Task]:
    """Every input file, in the order given (directories walked in sorted order), as tasks."""
    found: list[tuple[Path, str, bool]] = []  # (path, shown, named)
    for given in inputs:
        if given == STDLIB:
            root = stdlib_root()
            files = walk(root, ["*.py"], STDLIB_SKIPPED)
            if not files:
                raise DataError(f"{key} stdlib: no .py files under {root} (the standard library's folder)")
            found += [(path, str(path), False) for path in files]
            continue
        path = Path(given).expanduser()
        if not path.exists():
            raise DataError(f"{key} {given}: no such file or directory")
        if path.is_dir():
            files = walk(path, include, {"__pycache__"})
            if not files:
                what = f"holds no files matching {include}" if include else "is an empty directory"
                raise DataError(f"{key} {given}: {what}")
            found += [(file, str(file), False) for file in files]
        elif path.is_file():
            found.append((path, given, True))
        else:
            raise DataError(f"{key} {given}: not a regular file or a directory")
    if max_files is not None and len(found) > max_files:
        step = len(found) / max_files
        found = [found[int(i * step)] for i in range(max_files)]
    tasks: list[Task] = []
    for path, shown, named in found:
        try:
            size = path.stat().st_size
        except OSError as err:
            raise DataError(f"{key} {shown}: cannot be read ({err.strerror or err})") from None
        if path.suffix == ".jsonl":
            bounds = [*range(0, size, JSONL_CHUNK_BYTES), size]
            tasks += [Task(path, shown, True, named, size, lo, hi) for lo, hi in itertools.pairwise(bounds)]
            if size == 0:
                tasks.append(Task(path, shown, True, named, 0))
        else:
            tasks.append(Task(path, shown, False, named, size))
    return tasks


def walk(root: Path, include: list[str], skipped_dirs: set[str]) -> list[Path]:
    """Regular files under ``root`` whose names match ``include`` (all if empty), sorted; hidden
    files and folders and ``skipped_dirs`` are left out, links are not followed."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skipped_dirs)
        for name in sorted(names):
            path = Path(folder) / name
            if name.startswith(".") or path.is_symlink() or not path.is_file():
                continue
            if include and not any(fnmatch.fnmatch(name, pattern) for pattern in include):
                continue
            files.append(path)
    return files


class Skipped(Exception):
    """A file found in a directory that is not UTF-8 text: left out, counted."""


def in_validation(document: bytes, fraction: float) -> bool:
    """The document's split, from its content alone: a 64-bit hash below ``fraction`` of its range."""
    if fraction <= 0:
        return False
    value = int.from_bytes(hashlib.blake2b(document, digest_size=8).digest(), "little")
    return value < fraction * 2.0**64


def read_text_file(task: Task) -> tuple[list[bytes], str]:
    """The file as one document, and its SHA-256; binary or non-UTF-8 files are refused or skipped."""
    if task.size > MAX_TEXT_FILE_BYTES:
        raise DataError(
            f"{task.shown} is {task.size} bytes: a text file is one document, read whole (at most "
            f'{MAX_TEXT_FILE_BYTES}); split it, or give JSONL with one {{"text": ...}} document per line'
        )
    raw = read_user_file(task.path, task.shown, MAX_TEXT_FILE_BYTES, DataError)
    problem = None
    nul = raw.find(b"\x00")
    if nul >= 0:
        problem = f"a binary file (NUL byte at offset {nul})"
    else:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problem = f"not UTF-8 text (invalid byte at offset {err.start})"
    if problem is not None:
        if not task.named:
            raise Skipped(problem)
        raise DataError(f"{task.shown}: {problem}; inputs are UTF-8 text files, directories of them, or .jsonl files")
    return ([raw] if raw else []), hashlib.sha256(raw).hexdigest()


def read_jsonl_chunk(task: Task) -> tuple[list[bytes], str]:
    """The ``text`` of every line starting in the task's byte range, and the range's SHA-256."""
    digest = hashlib.sha256()
    documents = []
    with _opened(task) as handle:
        position = task.start
        if task.start > 0:  # the line that runs into the range belongs to the previous task
            handle.seek(task.start - 1)
            position = task.start - 1 + len(handle.readline())
        line_number = 0
        while position < task.end:
            line = handle.readline()
            if not line:
                break
            digest.update(line)
            line_number += 1
            where = f"{task.shown} line {line_number}" if task.start == 0 else f"{task.shown} (line at byte {position})"
            position += len(line)
            if not line.strip():
                continue
            documents.append(jsonl_text(line, where))
    return [doc for doc in documents if doc], digest.hexdigest()


def _opened(task: Task) -> BinaryIO:
    """A JSONL input open for reading, or a DataError naming it (a file that cannot be read)."""
    try:
        return task.path.open("rb")
    except OSError as err:
        raise DataError(f"{task.shown}: cannot be read ({err.strerror or err})") from None


def jsonl_text(line: bytes, where: str) -> bytes:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        reasons = {RecursionError: "nested too deeply", UnicodeDecodeError: "not UTF-8"}
        reason = err.msg if isinstance(err, json.JSONDecodeError) else reasons.get(type(err), "not JSON")
        raise DataError(
            f'{where}: not a JSON object ({reason}); JSONL inputs hold one {{"text": ...}} object per line'
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f'{where}: no "text" string field; JSONL inputs hold one {{"text": ...}} object per line')
    return str(record["text"]).encode("utf-8")


def read_documents(task: Task) -> tuple[list[bytes], str]:
    return read_jsonl_chunk(task) if task.jsonl else read_text_file(task)


def training_texts(tasks: list[Task], val_fraction: float) -> Iterator[str]:
    """The training documents of about BPE_SAMPLE_BYTES of the input, spread evenly over it."""
    total = sum(task.size for task in tasks) or 1
    stride = max(1, -(-total // BPE_SAMPLE_BYTES))
    for task in tasks[::stride]:
        try:
            documents, _ = read_documents(task)
        except Skipped:
            continue
        for document in documents:
            if not in_validation(document, val_fraction):
                yield document.decode("utf-8")
