"""Domain errors: user mistakes, each message says what was expected and what was found."""

from __future__ import annotations


class AntdtError(Exception):
    """Base class of every error antdt raises for bad input or bad use."""


class ConfigError(AntdtError):
    """A job config, schema or dask-config value is malformed (names the key and the value)."""


class DataError(AntdtError):
    """A data file does not match its schema or cannot be read (names file, row group, column)."""


class LedgerError(AntdtError):
    """A sharding-service call is invalid: unknown job, wrong token, offset out of range."""


class SyncError(AntdtError):
    """A model-sync call is invalid: unknown worker or job, a cursor the log can no longer serve,
    a peer's entries or snapshot that do not fit this replica."""


class JobError(AntdtError):
    """A job call is invalid (unknown job id, a malformed plan) or the job cannot run (no
    workers, a task of its own that failed); the message names what was expected."""


class JobFailed(AntdtError):
    """A job ended as failed on the cluster; the message carries its error."""


class JobCancelled(AntdtError):
    """A job was cancelled before its end."""


class CheckpointError(AntdtError):
    """A checkpoint cannot be written, found or used: torn or corrupt files, none to resume
    from, or a job file that differs from the checkpoint's (the message names the key)."""
