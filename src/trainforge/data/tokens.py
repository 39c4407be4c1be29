"""``data.name: tokens``: causal language modelling on a prepared token corpus (data/shards.py).

A sample is a window of ``data.seq_len + 1`` consecutive tokens of a split's stream, as
``(window[:-1], window[1:])``: the target is the input shifted by one. Training windows start at
random offsets (``data.windows: random``; the offset of sample ``i`` is a hash of the run seed and
``i``, so the same index is the same window on every rank and every restart) or one after another
(``sequential``); an epoch has as many windows as fit the stream end to end. Validation always
reads its split's windows one after another, so every validation token is predicted once.
Windows run across document boundaries: each document ends with the end-of-document token, which
the model learns to predict and to read as "a new document starts".

Resume needs nothing more: ``__getitem__`` is a pure function of the index, and the resumable
sampler (data/sampler.py) knows which indices a rank has consumed.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from trainforge.config import DataConfig, TokensData
from trainforge.data.corpus import CONFIG_NAMES, PrepareOptions, prepare_corpus
from trainforge.data.shards import MANIFEST_FILE, CorpusManifest, TokenStream, split_stream, verify_corpus
from trainforge.data.sources import Pair, PairDataset, Splits, mix_seed
from trainforge.data.spec import DataSpec
from trainforge.errors import DataError

log = logging.getLogger("trainforge.data")


class TokenWindows(PairDataset):
    """Windows of ``seq_len`` (input, target) tokens over one split's stream."""

    def __init__(self, stream: TokenStream, seq_len: int, vocab_size: int, *, random: bool, seed: int) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.random = random
        self.seed = seed
        self.length = (len(stream) - 1) // seq_len

    def __len__(self) -> int:
        return self.length

    def start(self, index: int) -> int:
        """Where window ``index`` starts in the stream."""
        if self.random:
            return mix_seed(self.seed, index) % (len(self.stream) - self.seq_len)
        return index * self.seq_len

    def __getitem__(self, index: int) -> Pair:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} windows")
        window = torch.from_numpy(self.stream.read(self.start(index), self.seq_len + 1))
        # The manifest's digests prove the shards are the ones written, not that their writer was
        # benign: an id the embedding does not have would fail deep inside the model.
        if int(window.max()) >= self.vocab_size:
            raise DataError(f"token id {int(window.max())} in the corpus is >= its vocab_size {self.vocab_size}")
        return window[:-1], window[1:]


def corpus_path(cfg: TokensData) -> Path:
    if cfg.path is None:
        raise DataError(
            "data.name tokens needs data.path: a folder written by trainforge data prepare "
            "(or data.prepare, to have trainforge train write it)"
        )
    return Path(cfg.path).expanduser()


def build_tokens(cfg: TokensData, seed: int) -> Splits:
    """Training and validation windows of ``data.seq_len`` tokens from the corpus at ``data.path``.

    Sizes are checked against the manifest here, on every worker (a stat per file); the digests
    were checked once on the driver before Ray started (``prepare_or_verify``).
    """
    path = corpus_path(cfg)
    manifest = verify_corpus(path, full=False)
    train_stream = split_stream(path, manifest, "train")
    val_stream = split_stream(path, manifest, "val")
    need = cfg.seq_len + 1
    if len(train_stream) < need:
        raise DataError(
            f"data.path {path}: the training split has {len(train_stream)} tokens, fewer than "
            f"data.seq_len + 1 = {need}; lower data.seq_len or prepare more text"
        )
    if 0 < len(val_stream) < need:
        raise DataError(
            f"data.path {path}: the validation split has {len(val_stream)} tokens, fewer than "
            f"data.seq_len + 1 = {need}; lower data.seq_len or prepare with a larger validation fraction"
        )
    vocab = manifest.vocab_size
    train = TokenWindows(train_stream, cfg.seq_len, vocab, random=cfg.windows == "random", seed=seed)
    val = TokenWindows(val_stream, cfg.seq_len, vocab, random=False, seed=seed) if len(val_stream) else None
    spec = DataSpec(
        kind="tokens",
        input_shape=(cfg.seq_len,),
        vocab_size=vocab,
        seq_len=cfg.seq_len,
        train_size=len(train),
        val_size=len(val) if val is not None else 0,
    )
    return train, val, spec


def prepare_or_verify(cfg: DataConfig) -> CorpusManifest | None:
    """On the driver, before Ray starts: for ``data.name: tokens``, prepare the corpus ``data.prepare``
    describes at ``data.path`` unless one made from the same inputs and options is there, then
    check every byte of it against its manifest. Other sources: None, nothing done."""
    if not isinstance(cfg, TokensData):
        return None
    path = corpus_path(cfg)
    if not path.is_absolute():
        raise DataError(
            f"data.path {cfg.path} is relative, but Ray's workers do not run in this directory: give "
            f"data.name tokens an absolute path or one under ~ (here: {path.resolve()})"
        )
    wanted = cfg.prepare
    if wanted is None or (path / MANIFEST_FILE).exists():
        manifest = verify_corpus(path, full=True)
        if wanted is not None:
            check_same_preparation(path, manifest, cfg)
        return manifest
    log.info("preparing the token corpus at %s from %s (data.prepare)", path, ", ".join(wanted.inputs))
    options = PrepareOptions(
        inputs=list(wanted.inputs),
        output=path,
        tokenizer=wanted.tokenizer,
        val_fraction=wanted.val_fraction,
        workers=wanted.workers,
        max_files=wanted.max_files,
        include=list(wanted.include),
        names=CONFIG_NAMES,
    )
    try:
        prepared = prepare_corpus(options, show_progress=sys.stderr.isatty())
    except DataError:
        if not (path / MANIFEST_FILE).exists():
            raise
        # Another run (a search's trials start together) prepared it first: use theirs, checked.
        manifest = verify_corpus(path, full=True)
        check_same_preparation(path, manifest, cfg)
        return manifest
    log.info("prepared %s in %.1f s: %s", path, prepared.seconds, describe(prepared.manifest))
    return prepared.manifest


def check_same_preparation(path: Path, manifest: CorpusManifest, cfg: TokensData) -> None:
    """A corpus already at ``data.path`` must be the one ``data.prepare`` describes: never train on
    another tokenizer or other inputs than the config says."""
    wanted = cfg.prepare
    assert wanted is not None
    have = {
        "inputs": manifest.inputs,
        "tokenizer": manifest.tokenizer.spec,
        "val_fraction": manifest.val_fraction,
        "max_files": manifest.max_files,
        "include": manifest.include,
    }
    asked = {
        "inputs": list(wanted.inputs),
        "tokenizer": wanted.tokenizer,
        "val_fraction": wanted.val_fraction,
        "max_files": wanted.max_files,
        "include": list(wanted.include),
    }
    differ = [key for key in asked if asked[key] != have[key]]
    if differ:
        shown = ", ".join(f"data.prepare.{key} {asked[key]!r} (the corpus: {have[key]!r})" for key in differ)
        raise DataError(
            f"data.path {path} holds a corpus prepared otherwise than data.prepare asks: {shown}; "
            "remove that folder to prepare it again, or point data.path at a new one"
        )


def describe(manifest: CorpusManifest) -> str:
    train, val = manifest.splits["train"], manifest.splits["val"]
    return (
        f"{train.documents} training documents ({train.tokens:,} tokens), {val.documents} validation documents "
        f"({val.tokens:,} tokens); vocabulary {manifest.vocab_size} ({manifest.tokenizer.spec}), {manifest.dtype}"
    )
