"""Errors a user can cause. The CLI prints them in one line and exits with code 2."""

from __future__ import annotations


class TrainforgeError(Exception):
    """Base class for user-facing errors: the message says what is wrong and what to do."""

    exit_code = 2


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
