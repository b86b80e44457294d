"""Where the dashboard's package ``app`` lives, and how the command line reaches it.

A checkout keeps it at the top of the repository (``<repo>/app``); the wheel ships it here, as
``trustscope/_dashboard/app`` (``setup.py``), so that nothing named ``app`` lands top-level in site-packages. The
dashboard's modules import one another as ``app`` (``from app import data``): :func:`load` puts the folder that holds
``app`` first on this process's ``sys.path`` and on ``PYTHONPATH``, which the Streamlit server this process becomes
(:func:`app.launch.launch`) and its helpers inherit. No other process sees a top-level ``app``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def app_root() -> Path:
    """The folder holding the dashboard's ``app`` package: this one in a wheel's install, else the checkout's
    root (the folder above ``trustscope/``)."""
    for root in (HERE, HERE.parent.parent):
        if (root / "app" / "main.py").is_file():
            return root
    raise FileNotFoundError(f"the dashboard (app/main.py) is neither in {HERE} nor in {HERE.parent.parent}: "
                            f"reinstall trustscope")


def load(module: str = "app.launch") -> ModuleType:
    """Import the dashboard's ``module`` (``app.launch``, ``app.pages`` ...) from :func:`app_root`."""
    root = str(app_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
    return importlib.import_module(module)
