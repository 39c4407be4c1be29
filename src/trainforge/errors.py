"""Errors a user can cause. The CLI prints them in one line and exits with code 2.

Names read from files (a tensor's name in a safetensors header, a manifest's entry, a corpus file,
a data column) are untrusted text: a message quotes them with :func:`shown`, and the CLI passes
every message through :func:`printable`, so no control character, terminal escape or
bidirectional override reaches the console or a log, and an error stays one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_SHOWN = 200  # characters of one name in a message: a name read from a file may be megabytes long


def _unmasked(text: str) -> str:
    return text


# How a message is masked as the error is made: trainforge.redact installs its redact_text here
# when it is imported (it imports this module, so this module cannot import it).
_mask_message: Callable[[str], str] = _unmasked


def mask_messages_with(mask: Callable[[str], str]) -> None:
    """Every TrainforgeError made from now on has its message (each string argument) passed
    through ``mask``: an exception's text holds no secret, in the CLI or in ``trainforge.fit``."""
    global _mask_message
    _mask_message = mask


class TrainforgeError(Exception):
    """Base class for user-facing errors: the message says what is wrong and what to do. Its text is
    masked as it is made (``mask_messages_with``): credentials never reach ``str(err)``."""

    exit_code = 2

    def __init__(self, *args: object) -> None:
        super().__init__(*(_mask_message(arg) if isinstance(arg, str) else arg for arg in args))


class ConfigError(TrainforgeError):
    """A config file, override or environment variable is invalid."""


class DataError(TrainforgeError):
    """A data set cannot be found or read."""


class ModelError(TrainforgeError):
    """A model name or factory cannot be resolved or does not build an nn.Module."""


class ClusterError(TrainforgeError):
    """The Ray cluster cannot be reached or started."""


class CheckpointError(TrainforgeError):
    """A checkpoint is missing, corrupt or refused."""


class RunLockedError(TrainforgeError):
    """Another trainforge run holds the run directory or its checkpoint folder (driver/runlock.py)."""


class UserCodeError(TrainforgeError):
    """The user's code (a factory, the data, the model's forward) raised on every worker before the
    first step: the same on any attempt, so the run is not retried (worker/user_code.py)."""


class TrainingFailed(TrainforgeError):
    """Training stopped with an error after exhausting its retries."""

    exit_code = 1


# The kinds a worker may name when it returns a user's error (protocol.UserError) instead of
# raising it; the driver raises the class of that name. An explicit table: a name that is not in
# it (a newer worker's, a corrupted record) is a plain TrainforgeError, never a lookup on the module.
ERROR_KINDS: dict[str, type[TrainforgeError]] = {
    cls.__name__: cls
    for cls in (
        TrainforgeError,
        ConfigError,
        DataError,
        ModelError,
        ClusterError,
        CheckpointError,
        RunLockedError,
        UserCodeError,
        TrainingFailed,
    )
}


def kind_of(err: TrainforgeError) -> str:
    """The kind of ``err``: its own class's name, or its nearest ancestor's in ERROR_KINDS (a
    subclass defined elsewhere, such as safeyaml's YamlRefused, travels as ConfigError)."""
    for cls in type(err).__mro__:
        if ERROR_KINDS.get(cls.__name__) is cls:
            return cls.__name__
    return TrainforgeError.__name__


def error_for(kind: str, message: str) -> TrainforgeError:
    """The error a worker named by kind, to raise on the driver."""
    return ERROR_KINDS.get(kind, TrainforgeError)(message)


def printable(text: str) -> str:
    """``text`` on one line with nothing a terminal acts on: every character that is not printable
    (C0 and C1 controls such as newline, CR and ESC, DEL, line separators, format characters such
    as the bidirectional override U+202E, surrogates of undecodable bytes) escaped as Python's
    ``repr`` writes it (``\\n``, ``\\x1b``, ``\\u202e``); everything else as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable_lines(text: str) -> str:
    """:func:`printable` line by line: a table or a page printed on purpose keeps its line breaks."""
    return "\n".join(printable(line) for line in text.split("\n"))


def shown_names(names: Iterable[object], most: int = 8) -> str:
    """Names read from files, listed for a message: each :func:`shown`, at most ``most`` of them
    and how many more, so a folder of thousands of entries still makes a short line."""
    items = list(names)
    listed = ", ".join(shown(name) for name in items[:most])
    return listed + (f" and {len(items) - most} more" if len(items) > most else "")


def shown(name: object, limit: int = MAX_SHOWN) -> str:
    """A name read from a file, quoted for a message or a log line: ``'encoder.weight'``, with
    :func:`printable`'s escapes and cut to ``limit`` characters (``...`` says it was cut)."""
    text = printable(str(name))
    return f"'{text[:limit]}...'" if len(text) > limit else f"'{text}'"
