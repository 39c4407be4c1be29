"""A run's model and its corpus's tokenizer as the Hugging Face ecosystem reads them.

``trainforge export --format hf`` writes the transformers model with its own class's
``save_pretrained`` (a built-in's, or a factory's ``transformers.PreTrainedModel``) and, for a run
trained on a prepared corpus, the corpus's tokenizer beside it (``tokenizer.json`` and
``tokenizer_config.json``): ``AutoTokenizer.from_pretrained(DIR)`` gives the corpus's ids for any
text and ``pipeline("text-generation", model=DIR)`` generates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from trainforge.checkpoint.hashing import SHA256, hash_file
from trainforge.config import Config, TokensData
from trainforge.data.shards import CorpusManifest, read_manifest
from trainforge.data.tokenizer import END_OF_DOCUMENT, ByteTokenizer, FileTokenizer, Tokenizer, load_corpus_tokenizer
from trainforge.errors import DataError, ModelError
from trainforge.models.registry import HFLogits


def transformers_model(model: nn.Module) -> Any | None:
    """The ``transformers.PreTrainedModel`` that ``model`` is (a factory's) or wraps (a
    built-in's), or None for any other module."""
    from transformers import PreTrainedModel

    inner = model.model if isinstance(model, HFLogits) else model
    return inner if isinstance(inner, PreTrainedModel) else None


def require_transformers_model(model: nn.Module) -> Any:
    """:func:`transformers_model`, or one line that says which models ``--format hf`` takes."""
    inner = transformers_model(model)
    if inner is None:
        raise ModelError(
            f"--format hf needs a transformers model (a built-in such as gpt2_* or llama_*, or a model.factory "
            f"that returns a transformers.PreTrainedModel), not {type(model).__qualname__}: use --format safetensors"
        )
    return inner


def token_data(config: Config) -> TokensData:
    """The run's data section, which must be a prepared corpus's."""
    if not isinstance(config.data, TokensData) or config.data.path is None:
        raise DataError(
            f"generate needs a run trained on data.name tokens (a prepared corpus); this one used data.name "
            f"{config.data.name}"
        )
    return config.data


def run_tokenizer(config: Config) -> tuple[Tokenizer, CorpusManifest]:
    """The tokenizer of the corpus the run trained on, its file checked against the manifest."""
    path = Path(str(token_data(config).path)).expanduser()
    origin = "the run's data.path"
    manifest = read_manifest(path, origin)
    entry = manifest.tokenizer
    if entry.file is not None:
        file = path / entry.file
        if not file.is_file() or hash_file(file, SHA256).digest != manifest.files[entry.file].sha256:
            raise DataError(f"{origin} {path}: {entry.file} is missing or fails its SHA-256 check")
    return load_corpus_tokenizer(path, entry.kind, f"{origin} {path}"), manifest


def byte_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: the alphabet of ``tokenizers``' ByteLevel
    pre-tokenizer, so byte ``b`` of the text arrives at the model as the symbol ``byte_unicode()[b]``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b if b in printable else next(shifted)) for b in range(256)}


def hf_tokenizer(tokenizer: Tokenizer, seq_len: int | None = None) -> Any:
    """A ``transformers`` fast tokenizer with the corpus tokenizer's ids for every text, its
    end-of-document token as ``eos_token``, and ``seq_len`` as its ``model_max_length``.

    Bytes: a byte-level BPE without merges whose symbol for byte ``b`` is id ``b``, the end token
    id 256; like the corpus's, it encodes the end token's text as its bytes
    (``split_special_tokens``). A tokenizers file (``bpe:N`` or a path) is itself; an end token the
    corpus appended after its vocabulary is added as the next id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    limit: dict[str, Any] = {"model_max_length": seq_len} if seq_len else {}
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {symbol: b for b, symbol in byte_unicode().items()}
        vocab[END_OF_DOCUMENT] = tokenizer.eod_id
        inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        inner.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(
            tokenizer_object=inner, eos_token=END_OF_DOCUMENT, split_special_tokens=True, **limit
        )
    if isinstance(tokenizer, FileTokenizer):
        inner = HFTokenizer.from_str(tokenizer.json_text)
        end = inner.id_to_token(tokenizer.eod_id)
        fast = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=end or END_OF_DOCUMENT, **limit)
        if fast.eos_token_id != tokenizer.eod_id:
            raise ModelError(
                f"the corpus's end token (id {tokenizer.eod_id}) took id {fast.eos_token_id} in the exported "
                "tokenizer; prepare the corpus with a tokenizer file that has an end token (e.g. <|endoftext|>)"
            )
        return fast
    raise ModelError(f"--format hf: no Hugging Face form for the corpus's {type(tokenizer).__name__}")


def corpus_hf_tokenizer(config: Config) -> Any | None:
    """:func:`hf_tokenizer` of the prepared corpus the run trained on; None for other data."""
    if not isinstance(config.data, TokensData) or config.data.path is None:
        return None
    return hf_tokenizer(run_tokenizer(config)[0], config.data.seq_len)


def mark_special_tokens(model: Any, tokenizer: Any) -> None:
    """The model's config and generation config name the tokenizer's end token as its end of
    text and padding: generation stops there, and ``pipeline`` needs no pad token of its own."""
    eos = int(tokenizer.eos_token_id)
    if eos >= model.config.get_text_config().vocab_size:
        raise ModelError(
            f"--format hf: the corpus's end token id {eos} is outside the model's vocabulary of "
            f"{model.config.get_text_config().vocab_size}"
        )
    for config in (model.config, model.generation_config):
        config.eos_token_id = eos
        config.pad_token_id = eos


def write_hf(model: nn.Module, folder: Path, tokenizer: Any | None = None) -> None:
    """transformers' own ``save_pretrained`` of the model's class (config.json, model.safetensors,
    tied weights once) and, given ``tokenizer`` (from :func:`hf_tokenizer`), the tokenizer beside it."""
    inner = require_transformers_model(model)
    if tokenizer is not None:
        mark_special_tokens(inner, tokenizer)
        tokenizer.save_pretrained(str(folder))
    inner.save_pretrained(str(folder), safe_serialization=True)
