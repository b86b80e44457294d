"""Errors and warnings of the logger."""

from __future__ import annotations


class LogWarning(UserWarning):
    """Rows or calls dropped by a ``strict=False`` logger, or a write that failed in the background."""


class LogDirError(OSError):
    """The log directory cannot be created or written, or the run exists and ``resume`` was not asked for."""


# Columns the caller may pass; the rest are filled in by the logger.
# Where mu_logprob came from: the inference engine's own log-probs (the real behaviour policy), or, for
# frameworks that keep none, the trainer's recompute (then mu == pi_old and no mismatch can be measured).
