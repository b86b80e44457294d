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
