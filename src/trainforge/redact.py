"""Credentials out of everything a run writes or prints.

A storage or tracking URI may carry its credentials: ``s3://KEY:SECRET@bucket/prefix``,
``https://user:pass@mlflow.example.com``, ``...?X-Amz-Signature=...&token=...``. The run itself
uses the real values (the config object handed to Ray and the workers is never redacted); every
record of the run (config.yaml, summary.json, trainer_state.json, MLflow params, the report, log
lines and the console) goes through this module first. docs/security.md lists where it applies.

Worker code imports this module too (trainer_state.json is written on a worker): it depends on
nothing but the standard library and ``errors`` (a leaf).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from trainforge.errors import printable

MASK = "***"

# ``scheme://userinfo@``: the userinfo ends at the last '@' before the host; it cannot contain an
# unencoded '/', '?', '#' or whitespace, so the match never runs past the authority.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s?#'\"<>]*)@")

# A config key or a query parameter is secret when its name, split into lower-case words at
# separators and camelCase boundaries (``hf_token`` -> hf token, ``secretKey`` -> secret key,
# ``X-Amz-Security-Token`` -> x amz security token), ends with a secret word or phrase. A name that
# only says where a secret is (``token_file``, ``private_key_path``, ``key_env``) ends with another
# word: its value is a path or a variable's name, kept. A false positive hides a harmless value from
# the records, a false negative writes a credential into them: when in doubt, a word is secret.
_SECRET_WORDS = frozenset(
    {"token", "password", "passwd", "pass", "pwd", "passphrase", "secret", "credential", "auth", "signature"}
    | {"passwords", "passphrases", "secrets", "credentials", "signatures"}
)
# "<q> key" is a secret (secret_key, privateKey, API-KEY); "key" alone is not (a dict key, a path).
_KEY_QUALIFIERS = frozenset({"secret", "private", "api", "access", "encryption", "signing", "master", "subscription"})
# "<v> token" names a word of a tokenizer's vocabulary (eos_token: "</s>"), not a credential.
_VOCABULARY = frozenset(
    {"bos", "eos", "sos", "eot", "pad", "padding", "unk", "unknown", "cls", "sep", "mask", "start", "end", "stop"}
    | {"begin", "special"}
)
# "tokens" is mostly a count or a list of vocabulary words (max_tokens); "<q> tokens" is credentials.
_TOKENS_QUALIFIERS = frozenset({"access", "auth", "api", "refresh", "session", "bearer", "id"})
# Run-together names (``dbpassword``, ``APIKEY`` of an environment variable) that cannot be split:
# a last word ending in one of these. Only suffixes no harmless word ends with.
_SECRET_SUFFIXES = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "credential",
    "credentials",
    *(f"{q}key" for q in _KEY_QUALIFIERS),
    *(f"{q}keys" for q in _KEY_QUALIFIERS),
    *(f"{q}token" for q in _TOKENS_QUALIFIERS),
)
# Query parameters only: Azure's SAS signature (sig=) and Google's API keys (key=), whole names.
_SECRET_PARAMETERS = frozenset({"sig", "key"})

_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
_QUERY_PARAM = re.compile(r"(?P<name>[?&;#](?P<key>[\w.\-]+))=(?P<value>[^&;#\s'\"<>]*)")


def _name_words(name: str) -> list[str]:
    """``name`` as lower-case words: split at every character that is not a letter or a digit and at
    camelCase boundaries (``APIKey`` -> api key); numbers at the end dropped (``password2``)."""
    words = [word.lower() for word in _WORD.findall(name)]
    while words and words[-1].isdigit():
        words.pop()
    return words


def is_secret_key(name: str) -> bool:
    """Whether a value under the config key (or query parameter) ``name`` is a secret, whatever it looks like."""
    words = _name_words(name)
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else ""
    if last == "token":
        return before not in _VOCABULARY
    if last == "tokens":
        return before in _TOKENS_QUALIFIERS
    if last in ("key", "keys"):
        return before in _KEY_QUALIFIERS
    return last in _SECRET_WORDS or last.endswith(_SECRET_SUFFIXES)


def _is_secret_parameter(name: str) -> bool:
    return name.lower() in _SECRET_PARAMETERS or is_secret_key(name)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, colon, _password = match.group("userinfo").partition(":")
    # user:password keeps the user (who connected says something); a lone name is a token.
    masked = f"{user}:{MASK}" if colon and user else MASK
    return f"{match.group('scheme')}{masked}@"


def redact_text(text: str) -> str:
    """``text`` with the userinfo of every URI in it and every secret-named query parameter masked."""
    if "@" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(_mask_userinfo, text)
    return _QUERY_PARAM.sub(_mask_parameter, text)


def _mask_parameter(match: re.Match[str]) -> str:
    if match.group("value") and _is_secret_parameter(match.group("key")):
        return f"{match.group('name')}={MASK}"
    return match.group(0)


def redact_config(tree: Any) -> Any:
    """A copy of a config dump (``Config.to_dict()``, or any JSON-like tree) fit to be written:
    strings go through ``redact_text``; everything under a secret-named key (``is_secret_key``) is
    masked whole: each of its values, however deep, becomes ``***`` (None and "" stay: no secret)."""
    if isinstance(tree, Mapping):
        return {key: _masked(value) if is_secret_key(str(key)) else redact_config(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact_config(item) for item in tree]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def _masked(tree: Any) -> Any:
    """``tree`` with its structure kept and every value in it masked."""
    if isinstance(tree, Mapping):
        return {key: _masked(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_masked(item) for item in tree]
    return tree if tree is None or tree == "" else MASK


class RedactFilter(logging.Filter):
    """On a handler: the formatted message of every record it emits (and its traceback) redacted.

    The record is rewritten in place, so the other handlers of the same record see the redacted
    text too: a secret that reaches any log line reaches none of them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = _escaped_lines(redact_text(message), one_line=record.name.partition(".")[0] == "trainforge")
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _escaped_lines(redact_text(record.exc_text), one_line=False)
        return True


def _escaped_lines(text: str, one_line: bool) -> str:
    """No terminal escape or other control character reaches a log (errors.printable): trainforge's
    own lines stay one line; another library's message and a traceback keep their line breaks."""
    if one_line:
        return printable(text)
    return "\n".join(printable(line) for line in text.split("\n"))


def redacting(handler: logging.Handler) -> logging.Handler:
    """``handler`` with a ``RedactFilter`` (once); returns it for chaining."""
    if not any(isinstance(f, RedactFilter) for f in handler.filters):
        handler.addFilter(RedactFilter())
    return handler


def install_on_logger(name: str = "trainforge") -> None:
    """A ``RedactFilter`` on the logger ``name`` itself: its records are redacted before any
    handler (the console's, a run's file, pytest's capture) sees them. Idempotent."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactFilter) for f in logger.filters):
        logger.addFilter(RedactFilter())
