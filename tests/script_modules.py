"""The studies as modules, for the tests that check their presets and worlds."""

from __future__ import annotations

import importlib


def experiments():
    """``studies/experiments.py`` as the module ``studies.experiments``."""
    return importlib.import_module("studies.experiments")
