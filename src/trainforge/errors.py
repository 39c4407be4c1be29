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
    """Another trainforge run holds the run directory or its checkpoint folder (runlock.py)."""


class TrainingFailed(TrainforgeError):
    """Training stopped with an error after exhausting its retries."""

    exit_code = 1
