"""``trainforge data prepare``: text files, directories and JSONL into a token corpus (data/shards.py).

What it does, in order: find the input documents (data/documents.py); train the BPE tokenizer on
the training documents if asked; tokenize the files in parallel processes; append each split's
tokens to its shards in input order, hashing while writing; write the indexes, the per-source
records and, last, the manifest; rename the finished folder into place. A failure leaves nothing at
the output: the work happens in a hidden folder beside it that is removed on any error.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.data.documents import (
    STDLIB,
    Skipped,
    Task,
    collect_tasks,
    in_validation,
    read_documents,
    training_texts,
)
from trainforge.data.sampler import LOADER_START_METHOD
from trainforge.data.shards import (
    FORMAT,
    MANIFEST_FILE,
    SOURCES_FILE,
    SPLITS,
    UINT16_VOCAB,
    CorpusManifest,
    FileEntry,
    Split,
    SplitWriter,
    TokenizerEntry,
    write_bytes,
    write_jsonl,
)
from trainforge.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    FileTokenizer,
    Tokenizer,
    TokenizerChoice,
    parse_tokenizer,
    read_tokenizer_file,
    train_bpe,
)
from trainforge.errors import DataError
from trainforge.files import check_output_path

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard
GROUP_BYTES = 8 << 20  # input tokenized in one batch (and sent to one process)
# Starting processes costs seconds (each imports torch through trainforge.data): below this much
# input, one process with the tokenizers library's threads is faster.
PROCESSES_MIN_BYTES = 64 << 20


@dataclass(frozen=True)
class Names:
    """How the options are named in messages: the CLI's flags or the config's keys."""

    inputs: str = "INPUT"
    output: str = "--output"
    tokenizer: str = "--tokenizer"
    val_fraction: str = "--val-fraction"


CLI_NAMES = Names()
CONFIG_NAMES = Names("data.prepare.inputs", "data.path", "data.prepare.tokenizer", "data.prepare.val_fraction")


@dataclass(frozen=True)
class PrepareOptions:
    inputs: list[str]
    output: Path
    tokenizer: str = "bytes"
    val_fraction: float = 0.05
    workers: int | None = None  # None: one per CPU
    max_files: int | None = None  # evenly spaced over all input files, in order
    include: list[str] = field(default_factory=list)  # file name patterns for directories ("*.py")
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    force: bool = False  # replace a corpus already at ``output``
    names: Names = CLI_NAMES


@dataclass(frozen=True)
class Prepared:
    manifest: CorpusManifest
    path: Path
    skipped: int  # files found in directories that are not UTF-8 text
    seconds: float


@dataclass
class TaskResult:
    """One task's documents, tokenized, by split; ``source`` is its line of sources.jsonl."""

    source: dict[str, Any]
    tokens: dict[Split, np.ndarray]  # per split, end-of-document ids included
    lengths: dict[Split, np.ndarray]  # tokens of each document, per split
    text_bytes: dict[Split, int]
    read_bytes: int  # input the task covered, for the progress bar
    skipped: bool = False


# ---------------------------------------------------------------------------------------------
# Tokenizing


@dataclass(frozen=True)
class Tokenizing:
    """What a tokenizing process needs: the tokenizer, the storage type and the split fraction."""

    tokenizer: Tokenizer
    dtype: np.dtype[Any]
    val_fraction: float


_PROCESS_STATE: Tokenizing | None = None  # set once per pool process by _start_process


def _start_process(tokenizer_json: str | None, dtype: str, val_fraction: float) -> None:
    global _PROCESS_STATE
    # One thread per process: the processes are the parallelism (tokenizers would start a thread per CPU each).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = ByteTokenizer() if tokenizer_json is None else FileTokenizer(tokenizer_json, "tokenizer")
    _PROCESS_STATE = Tokenizing(tokenizer, np.dtype(dtype), val_fraction)


def _pool_group(group: list[Task]) -> list[TaskResult]:
    assert _PROCESS_STATE is not None, "the pool's initializer sets the tokenizer"
    return tokenize_group(group, _PROCESS_STATE)


def tokenize_group(group: list[Task], state: Tokenizing) -> list[TaskResult]:
    """Read, split and tokenize a group of tasks, with one batch encode over all their documents
    (the tokenizers library spreads a batch over threads); each document ends with the end-of-document id."""
    read: list[tuple[Task, list[bytes], str | None, str | None]] = []
    for task in group:
        try:
            documents, digest = read_documents(task)
            read.append((task, documents, digest, None))
        except Skipped as why:
            read.append((task, [], None, str(why)))
    texts = [doc.decode("utf-8") for _, documents, _, _ in read for doc in documents]
    encoded = iter(state.tokenizer.encode_batch(texts))
    return [
        task_result(task, docs, [next(encoded) for _ in docs], digest, skipped, state)
        for task, docs, digest, skipped in read
    ]


def task_result(
    task: Task,
    documents: list[bytes],
    encoded: list[np.ndarray],
    digest: str | None,
    skipped: str | None,
    state: Tokenizing,
) -> TaskResult:
    source: dict[str, Any] = {"path": task.shown}
    if task.jsonl:
        source.update(start=task.start, end=task.end)
    if skipped is not None:
        source["skipped"] = skipped
    chosen: dict[Split, list[int]] = {split: [] for split in SPLITS}
    for number, document in enumerate(documents):
        chosen["val" if in_validation(document, state.val_fraction) else "train"].append(number)
    tokens: dict[Split, np.ndarray] = {}
    lengths: dict[Split, np.ndarray] = {}
    text_bytes: dict[Split, int] = {}
    eod = np.array([state.tokenizer.eod_id], dtype=np.int64)
    for split, numbers in chosen.items():
        pieces = [part for n in numbers for part in (encoded[n], eod)]
        tokens[split] = np.concatenate(pieces).astype(state.dtype) if pieces else np.zeros(0, state.dtype)
        lengths[split] = np.array([len(encoded[n]) + 1 for n in numbers], dtype=np.int64)
        text_bytes[split] = sum(len(documents[n]) for n in numbers)
    if skipped is None:
        source.update(
            bytes=task.read_bytes,
            sha256=digest,
            documents={split: len(numbers) for split, numbers in chosen.items()},
            tokens={split: len(tokens[split]) for split in SPLITS},
        )
    return TaskResult(source, tokens, lengths, text_bytes, task.read_bytes, skipped is not None)


def groups(tasks: list[Task], group_bytes: int) -> Iterator[list[Task]]:
    """Consecutive tasks in groups of about ``group_bytes`` of input."""
    group: list[Task] = []
    size = 0
    for task in tasks:
        group.append(task)
        size += task.read_bytes
        if size >= group_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def tokenized(tasks: list[Task], state: Tokenizing, workers: int) -> Iterator[TaskResult]:
    """Every task's result, in task order.

    Small inputs (under PROCESSES_MIN_BYTES) are tokenized here, one batch encode per group (on
    the tokenizers library's threads); larger ones in ``workers`` processes, a group at a time,
    where reading, hashing and encoding all run in parallel. The processes come from a fork
    server (as the data loaders' do): a fresh process that has run no tokenizer threads and holds
    no locks of the caller's threads is what is safe to fork.
    """
    total = sum(task.read_bytes for task in tasks)
    if workers <= 1 or total < PROCESSES_MIN_BYTES:
        for group in groups(tasks, GROUP_BYTES):
            yield from tokenize_group(group, state)
        return
    context = multiprocessing.get_context(LOADER_START_METHOD)
    if LOADER_START_METHOD == "forkserver":
        context.set_forkserver_preload(["trainforge.data.corpus"])  # no effect once the server runs
    tokenizer = state.tokenizer
    json_text = tokenizer.json_text if isinstance(tokenizer, FileTokenizer) else None
    initargs = (json_text, state.dtype.str, state.val_fraction)
    with context.Pool(workers, initializer=_start_process, initargs=initargs) as pool:
        for results in pool.imap(_pool_group, groups(tasks, GROUP_BYTES)):
            yield from results


# ---------------------------------------------------------------------------------------------
# The whole preparation


def prepare_corpus(options: PrepareOptions, *, show_progress: bool = False) -> Prepared:
    """Prepare the corpus ``options`` describe at ``options.output``; DataError on bad input,
    with nothing left at ``output``."""
    started = time.monotonic()
    names = options.names
    choice = parse_tokenizer(options.tokenizer, names.tokenizer)
    if not 0.0 <= options.val_fraction < 1.0:
        raise DataError(f"{names.val_fraction} {options.val_fraction}: must be >= 0 and < 1")
    if not options.inputs:
        raise DataError(f"{names.inputs}: give at least one file, directory, .jsonl file or {STDLIB}")
    output = options.output.expanduser()
    check_output(output, options)
    tasks = collect_tasks(options.inputs, options.include, options.max_files, names.inputs)
    staging = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as err:
        raise DataError(f"{names.output} {output}: cannot create a folder there ({err.strerror or err})") from None
    try:
        manifest, skipped = write_corpus(staging, tasks, choice, options, show_progress)
        move_into_place(staging, output, options.force)
    except OSError as err:  # the disk filled, the folder was taken away: nothing is left at the output
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"{names.output} {output}: writing the corpus failed ({err.strerror or err})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Prepared(manifest, output, skipped, time.monotonic() - started)


def check_output(output: Path, options: PrepareOptions) -> None:
    """``output`` may be new, an empty folder, or (with ``force``) a corpus prepared before; never
    a link (``files.check_output_path``)."""
    flag = options.names.output
    check_output_path(output, flag, "folder", DataError)
    if not output.exists():
        return
    if not output.is_dir() or output.is_symlink():
        raise DataError(f"{flag} {output} exists and is not a directory: give a new folder")
    try:
        empty = not any(output.iterdir())
    except OSError as err:
        raise DataError(
            f"{flag} {output} cannot be read ({err.strerror or err}): give a folder you can write"
        ) from None
    if empty:
        return
    if not (output / MANIFEST_FILE).is_file():
        raise DataError(f"{flag} {output} is a folder that is not empty and holds no prepared corpus: give a new one")
    if not options.force:
        raise DataError(f"{flag} {output} already holds a prepared corpus: give a new folder, or --force to replace it")


def move_into_place(staging: Path, output: Path, force: bool) -> None:
    """Rename the finished folder to ``output``; a corpus already there (``force``) goes only after.

    Another preparation of the same ``output`` that finished first (two runs started together)
    wins: this one fails with a DataError instead of replacing it.
    """
    old = None
    try:
        if output.exists() and any(output.iterdir()) and force:
            old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
            output.rename(old)
        elif output.exists():
            output.rmdir()  # empty (check_output)
        staging.rename(output)
    except OSError as err:
        raise DataError(f"{output} was written by another preparation meanwhile ({err.strerror}); kept that") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_tokenizer(choice: TokenizerChoice, tasks: list[Task], options: PrepareOptions, progress: Any) -> Tokenizer:
    """The tokenizer ``choice`` names; a BPE is trained here on the training documents."""
    if choice.kind == "bytes":
        return ByteTokenizer()
    if choice.kind == "file":
        assert choice.path is not None
        return read_tokenizer_file(choice.path, options.names.tokenizer)
    step = progress.add_task(f"training a {choice.vocab}-token BPE", total=None) if progress is not None else None
    texts = training_texts(tasks, options.val_fraction)
    first = next(texts, None)
    if first is None:
        raise DataError(
            f"{options.names.inputs} {' '.join(options.inputs)}: no training document to train the BPE on "
            f"(no UTF-8 text, or every document fell into the validation split: see {options.names.val_fraction})"
        )
    tokenizer = train_bpe(itertools.chain([first], texts), choice.vocab)
    if progress is not None:
        progress.remove_task(step)
    return tokenizer


def write_corpus(
    staging: Path, tasks: list[Task], choice: TokenizerChoice, options: PrepareOptions, show_progress: bool
) -> tuple[CorpusManifest, int]:
    """Tokenizer, shards, indexes, sources and, last, the manifest in ``staging``."""
    with progress_bar(show_progress) as progress:
        tokenizer = build_tokenizer(choice, tasks, options, progress)
        dtype = np.dtype("<u2" if tokenizer.vocab_size <= UINT16_VOCAB else "<u4")
        files: dict[str, FileEntry] = {}
        tokenizer_file = None
        if isinstance(tokenizer, FileTokenizer):
            tokenizer_file = TOKENIZER_FILE
            write_bytes(staging / TOKENIZER_FILE, tokenizer.json_text.encode(), files)
        writers = {split: SplitWriter(staging, split, dtype, options.shard_tokens) for split in SPLITS}
        sources, skipped = [], 0
        total = sum(task.read_bytes for task in tasks)
        bar = progress.add_task("tokenizing", total=total) if progress is not None else None
        workers = options.workers or available_cpus()
        try:
            for result in tokenized(tasks, Tokenizing(tokenizer, dtype, options.val_fraction), workers):
                skipped += result.skipped
                sources.append(result.source)
                for split, writer in writers.items():
                    writer.add(result.tokens[split], result.lengths[split], result.text_bytes[split])
                if progress is not None:
                    progress.advance(bar, result.read_bytes)
        except BaseException:
            for writer in writers.values():
                writer.close()
            raise
    splits = {split: writer.finish() for split, writer in writers.items()}
    for writer in writers.values():
        files.update(writer.files)
    if splits["train"].documents == 0:
        raise DataError(no_text_message(options, splits["val"].documents, skipped))
    write_jsonl(staging / SOURCES_FILE, sources, files)
    manifest = CorpusManifest(
        format=FORMAT,
        tokenizer=TokenizerEntry(
            kind=choice.kind,
            spec=options.tokenizer,
            vocab_size=tokenizer.vocab_size,
            eod_id=tokenizer.eod_id,
            file=tokenizer_file,
        ),
        dtype="uint16" if dtype.itemsize == 2 else "uint32",
        val_fraction=options.val_fraction,
        inputs=list(options.inputs),
        include=list(options.include),
        max_files=options.max_files,
        splits=splits,
        files=files,
    )
    write_bytes(staging / MANIFEST_FILE, (manifest.model_dump_json(indent=1) + "\n").encode(), None)
    return manifest, skipped


def no_text_message(options: PrepareOptions, val_documents: int, skipped: int) -> str:
    if val_documents:
        return (
            f"all {val_documents} documents fell into the validation split: give more documents "
            f"or a smaller {options.names.val_fraction}"
        )
    why = f" ({skipped} files skipped: binary or not UTF-8)" if skipped else ""
    return f"{options.names.inputs} {' '.join(options.inputs)}: no text documents found{why}"


def progress_bar(show: bool) -> Any:
    """A rich progress bar on stderr while preparing, or a null context when not shown."""
    if not show:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform tells)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
