"""Tokenizers of token corpora: raw UTF-8 bytes, a byte-level BPE trained here, or a tokenizer file.

Every tokenizer maps a document's text to ids without special tokens and has one end-of-document
id, which ``trainforge data prepare`` puts after every document. ``bytes`` needs no file; the
others are a Hugging Face ``tokenizers`` JSON file stored beside the shards (``tokenizer.json``),
so that training and ``trainforge generate`` read the very tokenizer the corpus was made with.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from trainforge.errors import DataError
from trainforge.files import read_user_file

TOKENIZER_FILE = "tokenizer.json"
END_OF_DOCUMENT = "<|endoftext|>"
# End tokens of common published tokenizers, tried in order when a tokenizer file has no END_OF_DOCUMENT.
KNOWN_END_TOKENS = (END_OF_DOCUMENT, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
BYTE_VOCAB = 257  # 256 byte values and the end-of-document id 256
MIN_BPE_VOCAB = 257  # the 256 byte symbols of the initial alphabet and the end-of-document token
MAX_BPE_VOCAB = 1 << 20
MAX_TOKENIZER_FILE_BYTES = 256 << 20
SPEC_HELP = "bytes, bpe:VOCAB (e.g. bpe:4096) or the path of a tokenizer.json file"

TokenizerKind = Literal["bytes", "bpe", "file"]


@dataclass(frozen=True)
class TokenizerChoice:
    """What ``--tokenizer`` / ``data.prepare.tokenizer`` asked for, parsed and checked."""

    kind: TokenizerKind
    vocab: int = 0  # bpe: the vocabulary to train, special token included
    path: Path | None = None  # file: the tokenizer.json to load


def parse_tokenizer(text: str, key: str) -> TokenizerChoice:
    """``bytes``, ``bpe:VOCAB`` or an existing file; a DataError naming ``key`` otherwise."""
    if text == "bytes":
        return TokenizerChoice("bytes")
    if text.startswith("bpe:"):
        match = re.fullmatch(r"bpe:(\d{1,8})", text)
        vocab = int(match.group(1)) if match else -1
        if not MIN_BPE_VOCAB <= vocab <= MAX_BPE_VOCAB:
            raise DataError(
                f"{key} {text!r}: the BPE vocabulary must be a whole number from {MIN_BPE_VOCAB} to {MAX_BPE_VOCAB}"
            )
        return TokenizerChoice("bpe", vocab=vocab)
    path = Path(text).expanduser()
    if not path.is_file():
        raise DataError(f"{key} {text!r}: not {SPEC_HELP} ({'not a file' if path.exists() else 'no such file'})")
    return TokenizerChoice("file", path=path)


class Tokenizer:
    """Text -> ids (no special tokens) and back; ``eod_id`` ends each document; ids < ``vocab_size``."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """One id per UTF-8 byte (0-255) and 256 for the end of a document."""

    vocab_size = BYTE_VOCAB
    eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class FileTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer; its end token is one it knows, else a new id after its vocabulary."""

    def __init__(self, json_text: str, origin: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.inner = HFTokenizer.from_str(json_text)
        except Exception as err:  # the library raises its own Exception for any malformed file
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise DataError(f"{origin} is not a tokenizers JSON file ({first})") from None
        self.json_text = json_text
        size = self.inner.get_vocab_size(with_added_tokens=True)
        known = [self.inner.token_to_id(token) for token in KNOWN_END_TOKENS]
        found = [i for i in known if i is not None]
        self.eod_id = found[0] if found else size
        self.vocab_size = max(size, self.eod_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.inner.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.inner.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        kept = [i for i in ids if i != self.eod_id]
        return str(self.inner.decode(kept, skip_special_tokens=True))


def read_tokenizer_file(path: Path, origin: str) -> FileTokenizer:
    """A tokenizer file, bounded in size (tokenizer files are data, not trusted code)."""
    raw = read_user_file(path, f"{origin} {path}", MAX_TOKENIZER_FILE_BYTES, DataError)  # no FIFO, no /dev/zero
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{origin} {path} cannot be read: {err}") from None
    return FileTokenizer(text, f"{origin} {path}")


def train_bpe(texts: Iterator[str], vocab: int) -> FileTokenizer:
    """A byte-level BPE of ``vocab`` ids (END_OF_DOCUMENT included) trained on ``texts``, offline.

    Byte-level: every byte has a symbol in the initial alphabet, so any text encodes without an
    unknown token and decodes back to itself.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[END_OF_DOCUMENT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    return FileTokenizer(inner.to_str(), f"bpe:{vocab}")


def load_corpus_tokenizer(directory: Path, kind: TokenizerKind, origin: str) -> Tokenizer:
    """The tokenizer a prepared corpus was made with (``tokenizer.json`` beside its shards, or bytes)."""
    if kind == "bytes":
        return ByteTokenizer()
    return read_tokenizer_file(directory / TOKENIZER_FILE, origin)
