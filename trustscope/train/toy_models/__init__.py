"""Toy worlds shipped built, so a first run (``trustscope demo``) starts training at once instead of after a
warm start of one to four minutes on two CPU cores.

Each folder here is a cache entry of :func:`trustscope.train.toy.build_toy_model`, named as the cache names it,
``<task>-<key>``: ``addcol2-9b52d72f35573d24`` is ``toy-v2`` (the model of the old sample runs, now
``tests/data/legacy``, and the base that ``toy-v2-warm`` is warm-started from), and ``addcol2-4bb776a930b01b9d`` is ``toy-v2-warm``
(:mod:`trustscope.train.toy_warm`), the world of the shipped ``sample_logs/`` runs and the one ``trustscope demo``
trains in (its warm start is four to seven minutes on two busy cores). The
key hashes the configuration and the source of ``toy.py``, so a folder is used only while it is exactly what a
build would write (builds are deterministic: two builds of ``toy-v2`` wrote byte-identical weights); after a change
to ``toy.py`` the key moves, the folder is passed over and the model is built as before. To ship the new build::

    .venv/bin/python -c "from trustscope.train.toy import TOY_PRESETS; from trustscope.train.toy_warm import \\
        warm_config; from trustscope.train.toy_models import ship; \\
        print(ship(TOY_PRESETS['toy-v2']), ship(warm_config('toy-v2-warm')))"
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from trustscope.paths import cache_root

HERE = Path(__file__).resolve().parent
META_FILE = "trustscope_toy.json"  # trustscope.train.toy.META_FILE, without importing torch here


def entry_name(config) -> str:
    """The cache entry's folder name of a :class:`trustscope.train.toy.ToyConfig`: ``<task>-<key>``."""
    return f"{config.task}-{config.key()}"


def shipped(config) -> Path | None:
    """The shipped build of ``config``, when one ships whose key is the current one."""
    path = HERE / entry_name(config)
    return path if (path / META_FILE).is_file() else None


def seed_cache(config, cache_dir: str | Path | None = None) -> Path | None:
    """Copy the shipped build of ``config`` into the toy cache (``cache_dir`` or :func:`cache_root`) when the
    cache lacks it; return the entry then, else None (no shipped build, or the cache has one). The copy lands
    under a temporary name and is renamed into place, as a build is, so concurrent starts never see half of it."""
    source = shipped(config)
    final = (Path(cache_dir) if cache_dir is not None else cache_root()) / "toy" / entry_name(config)
    if source is None or (final / META_FILE).exists():
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        for f in source.iterdir():
            if f.is_file() and not f.name.startswith("."):
                shutil.copyfile(f, tmp / f.name)
        try:
            tmp.rename(final)
        except OSError:  # another process put it there first: keep theirs
            if not (final / META_FILE).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def ship(config) -> Path:
    """Build (or find) the toy world of :class:`trustscope.train.toy.ToyConfig` ``config`` and copy its cache entry
    here, replacing older builds of the same configuration (those of an older ``toy.py``; other worlds of the same
    task stay)."""
    from trustscope.train.toy import build_toy_model

    built = build_toy_model(config)
    fields = json.loads((built / META_FILE).read_text())["config"]
    for old in HERE.glob(f"{fields['task']}-*"):
        meta = old / META_FILE
        if old.name != built.name and meta.is_file() and json.loads(meta.read_text())["config"] == fields:
            shutil.rmtree(old)
    target = HERE / built.name
    target.mkdir(exist_ok=True)
    for f in built.iterdir():
        if f.is_file():
            shutil.copyfile(f, target / f.name)
    return target
