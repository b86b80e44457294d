"""Errors and warnings of the log format: bad values and files, log directories that cannot be used, compactions that cannot be done.
"""

from __future__ import annotations


class SchemaError(ValueError):
    """A value, column or file that breaks the log schema. The message names the field and the value."""


class CompactionError(OSError):
    """A compaction that could not be done; the log is left as it was. The message names the path and the cause."""


class Stopped(Exception):
    """The compaction was asked to stop (the logger is closing); nothing was committed."""


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


class LogWarning(UserWarning):
    """Rows or calls dropped by a ``strict=False`` logger, or a write that failed in the background."""


class LogDirError(OSError):
    """The log directory cannot be created or written, or the run exists and ``resume`` was not asked for."""
