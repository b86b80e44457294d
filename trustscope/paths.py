"""Where trustscope keeps what it can rebuild: the toy model and the query layer's kept aggregates."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TRUSTSCOPE_CACHE"


def cache_root() -> Path:
    """``$TRUSTSCOPE_CACHE``, else ``$XDG_CACHE_HOME/trustscope``, else ``~/.cache/trustscope``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trustscope"


def sample_logdir() -> Path:
    """The sample runs: a checkout's ``sample_logs/`` (all of them), else the two the wheel ships inside the package
    (``trustscope/sample_logs``, ``setup.py``). What ``trustscope dashboard``, ``sql`` and ``report`` open when no
    log directory is given."""
    package = Path(__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "sample_logs").is_dir():
        return checkout / "sample_logs"
    return package / "sample_logs"
