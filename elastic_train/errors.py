"""Exceptions that elastic_train raises to its users."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration is invalid; the message names the problem and the fix."""


class TrainingFailedError(RuntimeError):
    """The run failed: user code raised more often than `max_failures` allows, or capacity never came.

    `str(error)` carries the original traceback from the worker that raised.
    """


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written."""


class StorageError(CheckpointError):
    """Storage refused an operation (denied, missing bucket, bad credentials), or kept failing."""
