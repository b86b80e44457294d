"""The repository's scripts as modules, for the tests that check their presets and worlds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def experiments():
    """``scripts/experiments.py``, loaded once per process under the name ``experiments``."""
    if "experiments" in sys.modules:
        return sys.modules["experiments"]
    spec = importlib.util.spec_from_file_location("experiments", ROOT / "scripts" / "experiments.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["experiments"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
