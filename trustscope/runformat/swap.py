"""The compaction's folder swap: staged rank folders swapped with the live ones in one atomic exchange each, and the
swapped-out folders kept under ``_superseded`` for a grace period, then deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path

from trustscope.runformat.errors import CompactionError, describe_error
from trustscope.runformat.fsops import exchange
from trustscope.runformat.layout import (
    STAGING_DIR,
    SUPERSEDED_DIR,
    TABLES,
    TMP_SUFFIX,
    parse_data_file,
    rank_dir_name,
    rank_folder,
)

DELETE_AFTER_S = 60.0
"""Seconds a rank folder swapped out by a compaction is kept (under ``<run>/_superseded/``) for readers that hold it
open; files superseded in place (layout 1, object stores) are deleted at once."""


_COMPACTED_TMP = re.compile(r"^\.r(\d+)-s\d+-\d+-c\d+-\d+(?:-p\d+)?\.parquet" + re.escape(TMP_SUFFIX) + "$")


def drop_superseded(run_dir: Path, rank: int, older_than_s: float = 0.0, now: float | None = None,
                    warnings: list[str] | None = None) -> int:
    """Delete rank ``rank``'s folders under ``_superseded`` that were superseded ``older_than_s`` seconds ago or
    more; returns how many files went. No reader reaches them by path: a reader that listed one of them just
    before the swap finds the files it keeps under the live folder, and a file compacted away not at all (it
    retries); they are kept the grace period for readers that hold the old folder open."""
    now = time.time() if now is None else now
    gone = 0
    for path in sorted((Path(run_dir) / SUPERSEDED_DIR).glob(f"*-{rank_dir_name(rank)}-*")):
        ms = path.name.partition("-")[0]
        if ms.isdigit() and now - int(ms) / 1000 < older_than_s:
            continue
        files = sum(len(f) for _, _, f in os.walk(path))
        try:
            shutil.rmtree(path)
            gone += files
        except OSError as err:
            if warnings is not None:
                warnings.append(f"cannot delete {path}: {describe_error(err)}")
    with contextlib.suppress(OSError):
        (Path(run_dir) / SUPERSEDED_DIR).rmdir()  # empty: gone
    return gone


def staging_dir(run_dir: Path, rank: int, flushes: tuple[int, int]) -> Path:
    return run_dir / STAGING_DIR / f"{rank_dir_name(rank)}-c{flushes[0]:08d}-{flushes[1]:08d}"


def retire(run_dir: Path, staging: Path) -> None:
    """Move a staging folder, which holds the swapped-out rank folders, under ``_superseded`` (its name starts
    with the time of the swap, in ms)."""
    done = run_dir / SUPERSEDED_DIR / f"{int(time.time() * 1000)}-{staging.name}"
    done.parent.mkdir(exist_ok=True)
    os.rename(staging, done)
    with contextlib.suppress(OSError):
        staging.parent.rmdir()


def in_range(name: str, rank: int, lo: int, hi: int) -> bool:
    parsed = parse_data_file(name)
    if parsed is None or parsed.rank != rank:
        return False
    if parsed.compacted is not None:
        return lo <= parsed.compacted[0] and parsed.compacted[1] <= hi
    return parsed.flush is not None and lo <= parsed.flush <= hi


def swap_in(run_dir: Path, rank: int, record: dict, staging: Path) -> list[str]:
    """Swap each table's live rank folder with its staged one (built for ``record``) where the live folder does
    not hold the record's files yet; returns the tables swapped. A staged folder that is not the live one less the
    record's sources plus its files (the live folder changed since) is not swapped: CompactionError."""
    lo, hi = record["flushes"]
    swapped = []
    for table in TABLES:
        staged = staging / table
        if not staged.is_dir():
            continue
        live = rank_folder(run_dir, table, rank)
        mine = {rel.rpartition("/")[2] for rel in record["files"] if rel.rpartition("/")[0] == f"{table}/{live.name}"}
        have = set(os.listdir(live)) if live.is_dir() else set()
        if mine and mine <= have:
            continue  # swapped already
        expected = {n for n in have if not in_range(n, rank, lo, hi)} | mine
        if set(os.listdir(staged)) != expected:
            raise CompactionError(f"{staged} does not match {live} (it changed since the compaction staged it); "
                                  f"nothing swapped")
        exchange(staged, live)
        swapped.append(table)
    return swapped
