"""Toy worlds that are a preset of :mod:`trustscope.train.toy` warm-started further: ``toy-v2-warm``.

``toy-v2-warm`` is ``toy-v2``'s model and task (650k parameters, two-digit column addition worked out in 15-26
tokens) with a supervised warm start that runs until the expected temperature-1 accuracy of the canonical worked
answer reaches 0.6 instead of 0.3 (the check runs every 25 steps: it stops at 0.74, after 375 steps against
toy-v2's 325), so that RL starts from a model that already solves most problems, as the paper's sanity set does.
It is the world of the ``sanity-climb-warm`` sweep (``studies/experiments.py``, docs/experiments.md), where every
trust-region rule climbs to a 10-step reward of 0.9, of its ``sanity-climb-stale`` variant that the shipped
``sample_logs/`` runs come from, and of ``trustscope demo``.

The build is :func:`trustscope.train.toy.build_toy_model` on the preset with the fields of :data:`WARM_PRESETS`
changed, cached as any toy build is, under ``$TRUSTSCOPE_CACHE/toy/<task>-<key>``. Its ``addcol2`` build ships with
trustscope (:mod:`trustscope.train.toy_models`) and is copied into an empty cache; on another task, or after a
change to ``toy.py`` moves the key, it is built locally (4-7 minutes on two busy CPU cores, nothing downloaded).
The presets themselves are untouched, so the shipped ``toy-v2`` build keeps its key.

    from trustscope.train.toy_warm import build_warm_model
    model_dir = build_warm_model("toy-v2-warm")

``trustscope train --model toy-v2-warm --task addcol2`` trains it like any toy world.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

WARM_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "toy-v2-warm": ("toy-v2", {"target_accuracy": 0.6}),
}
"""Named warm worlds: (the :data:`trustscope.train.toy.TOY_PRESETS` preset, the
:class:`trustscope.train.toy.ToyConfig` fields changed)."""


def warm_config(name: str, task: str | None = None):
    """The :class:`trustscope.train.toy.ToyConfig` of warm world ``name`` (warm-started on ``task`` when given,
    else on its preset's task). Raises ``ValueError`` naming the world and the known ones."""
    from trustscope.train.toy import TOY_PRESETS

    if name not in WARM_PRESETS:
        raise ValueError(f"toy world {name!r}: no warm world of that name; known: {', '.join(WARM_PRESETS)}")
    base, change = WARM_PRESETS[name]
    config = dataclasses.replace(TOY_PRESETS[base], **change)
    return config if task is None else dataclasses.replace(config, task=task)


def describe(name: str) -> str:
    """``toy-v2 warm-started to target_accuracy=0.6``: what warm world ``name`` is, for messages."""
    base, change = WARM_PRESETS[name]
    return f"{base} warm-started to " + ", ".join(f"{k}={v}" for k, v in change.items())


def build_warm_model(name: str, task: str | None = None, *, cache_dir: str | Path | None = None) -> Path:
    """Build (or find in the cache) warm world ``name``; return its directory. A warm start that ends short of its
    target raises :class:`trustscope.train.config.ConfigError` naming the world, its target and the accuracy the
    build reached."""
    from trustscope.train.config import ConfigError
    from trustscope.train.toy import build_toy_model
    from trustscope.train.toy_models import seed_cache

    config = warm_config(name, task)
    seed_cache(config, cache_dir)  # the build shipped with trustscope, when the cache lacks it
    try:
        return build_toy_model(config, cache_dir=cache_dir)
    except RuntimeError as exc:
        if "target_accuracy" not in str(exc):
            raise
        raise ConfigError(f"model={name!r} ({describe(name)}) with task={config.task!r}: {exc}") from None


def cached(name: str, task: str | None = None) -> Path | None:
    """The cache entry of warm world ``name`` when it is built, else None."""
    from trustscope.paths import cache_root
    from trustscope.train.toy import META_FILE
    from trustscope.train.toy_models import entry_name

    entry = cache_root() / "toy" / entry_name(warm_config(name, task))
    return entry if (entry / META_FILE).exists() else None
