"""Credentials out of everything a run writes or prints.

A storage or tracking URI may carry its credentials: ``s3://KEY:SECRET@bucket/prefix``,
``https://user:pass@mlflow.example.com``, ``...?X-Amz-Signature=...&token=...``. The run itself
uses the real values (the config object handed to Ray and the workers is never redacted); every
record of the run (config.yaml, summary.json, trainer_state.json, MLflow params, the report, log
lines and the console) goes through this module first. docs/security.md lists where it applies.

Worker code imports this module too (trainer_state.json is written on a worker): it depends on
nothing but the standard library.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# ``scheme://userinfo@``: the userinfo ends at the last '@' before the host; it cannot contain an
# unencoded '/', '?', '#' or whitespace, so the match never runs past the authority.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s?#'\"<>]*)@")

# A query (or fragment) parameter whose name ends in one of these words carries a secret:
# token=, access_token=, X-Amz-Security-Token=, X-Amz-Signature=, X-Amz-Credential=, sig=,
# password=, secret_key=, access_key=, api_key=, key= (Google's API keys).
_SECRET_NAME = r"(?:token|secret|secret_key|password|passwd|pwd|signature|sig|credential|credentials|key|apikey)"
_QUERY_PARAM = re.compile(rf"(?P<name>[?&;#][\w.\-]*?{_SECRET_NAME})=(?P<value>[^&;#\s'\"<>]*)", re.IGNORECASE)

# Config keys whose value is a secret whatever it looks like (a factory's kwargs, say).
_SECRET_KEY = re.compile(
    r"(?:^|[_.\-])(?:password|passwd|secret|secret_key|secret_access_key|api_key|apikey|access_key|"
    r"auth_token|access_token|api_token|session_token|credentials?)$",
    re.IGNORECASE,
)


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
    return _QUERY_PARAM.sub(lambda m: f"{m.group('name')}={MASK}" if m.group("value") else m.group(0), text)


def is_secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.search(name))


def redact_config(tree: Any) -> Any:
    """A copy of a config dump (``Config.to_dict()``, or any JSON-like tree) fit to be written:
    strings go through ``redact_text``; values under secret-named keys are masked whole."""
    if isinstance(tree, Mapping):
        return {
            key: MASK if is_secret_key(str(key)) and _is_value(value) else redact_config(value)
            for key, value in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        return [redact_config(item) for item in tree]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def _is_value(value: Any) -> bool:
    return value is not None and value != "" and not isinstance(value, (Mapping, list, tuple))


class RedactFilter(logging.Filter):
    """On a handler: the formatted message of every record it emits (and its traceback) redacted.

    The record is rewritten in place, so the other handlers of the same record see the redacted
    text too: a secret that reaches any log line reaches none of them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


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
