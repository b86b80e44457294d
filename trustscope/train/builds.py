"""Locally built toy worlds land in the cache whole or not at all.

Each builder (``toy_moe``, ``toy_tool``, ``toy_wide``) writes its model into a temporary directory beside its cache
entry and renames it into place once everything, ``trustscope_toy.json`` last, is written: a reader sees a finished
build or none, and two builders racing keep whichever renamed first.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

META_FILE = "trustscope_toy.json"  # the same name as trustscope.train.toy.META_FILE (its source is a cache key)


@contextlib.contextmanager
def staged_build(final: Path, *, force: bool = False) -> Iterator[Path]:
    """A temporary directory beside ``final`` to build into; renamed to ``final`` when the block ends without an
    error (replacing an existing build when ``force``), removed in every case that leaves it behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if force and final.exists():
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # another builder renamed its copy first: keep theirs
            if not (final / META_FILE).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
