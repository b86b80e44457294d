"""Maintenance of written logs: ``trustscope compact`` (:func:`compact_logdir`) and ``validate --repair``
(:func:`repair_run`).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from trustscope.runformat.commits import COMPACTED_KEY, stray_files
from trustscope.runformat.compaction import MAX_BYTES, MAX_ROWS, ROW_GROUP_SIZE, RankResult, compact_rank
from trustscope.runformat.errors import CompactionError, LogDirError, SchemaError, describe_error
from trustscope.runformat.footers import file_sizes
from trustscope.runformat.layout import (
    RANKS_DIR,
    SUPERSEDED_DIR,
    TABLES,
    TMP_PREFIX,
    TMP_SUFFIX,
    parse_data_file,
    rank_file,
)
from trustscope.runformat.locks import RunLock
from trustscope.runformat.manifest import read_json
from trustscope.runformat.recovery import recover_rank
from trustscope.runformat.stores import LocalStore, ObjectStore, is_remote, remote_runs, where
from trustscope.runformat.swap import drop_superseded
from trustscope.runformat.validation import run_dirs


def compact_logdir(location: str | os.PathLike, *, grace_s: float = 5.0, force: bool = False,
                   max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES, row_group_size: int = ROW_GROUP_SIZE,
                   storage_options: dict | None = None,
                   echo: Callable[[str], None] = lambda line: None) -> list[RankResult]:
    """Compact every rank of every run under ``location`` (a log directory, one run directory, or an ``s3://``
    prefix) as far as the bounds allow; returns what was done per rank.

    A local rank is compacted under its lock (:class:`trustscope.runformat.locks.RunLock`): a rank a live logger
    writes is skipped (said through ``echo``; that logger compacts its own files with ``compact_every``). Object
    stores have no locks: a rank whose manifest reads ``running`` is skipped unless ``force``. The files a
    compaction supersedes are deleted ``grace_s`` seconds after the last commit, for readers that listed them just
    before; files an earlier compaction left are deleted at once. Raises :class:`CompactionError` naming the path.
    """

    if is_remote(location):
        store: Any = ObjectStore(str(location), storage_options)
        runs = [PurePosixPath(r) for r in remote_runs(store.fsspec, str(store.logdir))]
    else:
        store = LocalStore(location)
        if not Path(location).is_dir():
            raise FileNotFoundError(f"{location} is not a directory")
        runs = run_dirs(Path(location))
    results: list[RankResult] = []
    locks = []
    last_commit = 0.0
    try:
        for run_dir in runs:
            ranks = [0, *sorted(int(n[4:-5]) for n in file_sizes(store, run_dir / RANKS_DIR)
                                if re.fullmatch(r"rank\d+\.json", n))]
            for rank in ranks:
                path = rank_file(run_dir, rank)
                if not store.exists(path):
                    continue
                if store.remote:
                    try:
                        manifest = read_json(path, store)
                    except SchemaError as err:
                        echo(f"{where(store, run_dir)} rank {rank}: skipped, {err}")
                        continue
                    if manifest.get("status") == "running" and not force:
                        echo(f"{where(store, run_dir)} rank {rank}: skipped, its manifest reads running (a live "
                             f"logger compacts its own files; --force if none writes it)")
                        continue
                    try:
                        for line in recover_rank(store, run_dir, rank, manifest):
                            echo(f"{where(store, run_dir)} rank {rank}: {line}")
                    except OSError as err:
                        raise CompactionError(f"cannot recover {where(store, run_dir)} rank {rank}: "
                                              f"{describe_error(err)}") from err
                else:
                    lock = RunLock(Path(run_dir), rank)
                    try:
                        lock.acquire(Path(run_dir).name, rank)
                    except LogDirError as err:
                        echo(f"{run_dir} rank {rank}: skipped, {err}")
                        continue
                    except OSError as err:
                        raise CompactionError(f"cannot lock {lock.path}: {describe_error(err)}") from err
                    locks.append(lock)
                    try:
                        manifest = read_json(path)
                        for line in recover_rank(store, run_dir, rank, manifest):
                            echo(f"{run_dir} rank {rank}: {line}")
                    except SchemaError as err:
                        echo(f"{run_dir} rank {rank}: skipped, {err}")
                        continue
                    except (OSError, CompactionError) as err:
                        raise CompactionError(f"cannot recover {run_dir} rank {rank}: {describe_error(err)}") from err

                def save(records: list[dict], path: Any = path, manifest: dict = manifest) -> None:
                    manifest[COMPACTED_KEY] = records
                    store.write_atomic(path, json.dumps(manifest, indent=2, default=str))

                result = compact_rank(store, run_dir, rank, manifest, save, full=True, max_rows=max_rows,
                                      max_bytes=max_bytes, row_group_size=row_group_size, delete_after_s=grace_s)
                results.append(result)
                if result.merged:
                    last_commit = time.monotonic()
        if not store.remote and any(r.merged for r in results):  # the folders swapped out, after the grace
            time.sleep(max(0.0, last_commit + grace_s - time.monotonic()))
            for result in results:
                result.deleted += drop_superseded(Path(result.run_dir), result.rank, 0.0, None, result.warnings)
    finally:
        for lock in locks:
            lock.release()
        store.close()
    return results


def repair_run(run_dir: str | os.PathLike) -> list[str]:
    """Remove what a killed writer or compaction left in a local run, and say what, one line each: the work
    :func:`recover_rank` finishes, the files of :func:`trustscope.runformat.commits.stray_files` that are provably
    superseded or orphaned, the temporary files of writers that are gone, and every superseded folder. A file
    the logger never writes (copied in by hand) is only named, never removed. Each rank is repaired under its
    lock: a rank a live logger writes is skipped (said)."""

    run_dir = Path(run_dir)
    store = LocalStore(run_dir.parent)
    said: list[str] = []
    ranks = [0, *sorted(int(n[4:-5]) for n in file_sizes(store, run_dir / RANKS_DIR)
                        if re.fullmatch(r"rank\d+\.json", n))]
    held = []
    try:
        for rank in ranks:
            path = rank_file(run_dir, rank)
            if not path.exists():
                continue
            lock = RunLock(run_dir, rank)
            try:
                lock.acquire(run_dir.name, rank)
            except LogDirError as err:
                said.append(f"rank {rank}: skipped, {err}")
                continue
            held.append((rank, lock))
            try:
                said += [f"rank {rank}: {line}" for line in recover_rank(store, run_dir, rank, read_json(path))]
            except SchemaError as err:
                said.append(f"rank {rank}: skipped, {err}")
                continue
            said += [f"rank {rank}: removed {n} superseded file(s) under {run_dir / SUPERSEDED_DIR}"
                     for n in [drop_superseded(run_dir, rank)] if n]
            prefix = f"{TMP_PREFIX}r{rank:04d}-"
            for table in TABLES:
                for folder in [run_dir / table, *(run_dir / table).glob("r[0-9]*")]:
                    for name in file_sizes(store, folder):
                        if name.startswith(prefix) and name.endswith(TMP_SUFFIX):
                            (folder / name).unlink(missing_ok=True)
                            said.append(f"rank {rank}: removed {folder / name} (a temporary file of a writer "
                                        f"that is gone)")
        mine = {rank for rank, _ in held}
        for stray in stray_files(run_dir):
            name = parse_data_file(stray.path.name)
            if not stray.removable or name is None or name.rank not in mine:
                said.append(f"kept {stray.path}: {stray.why}")
                continue
            stray.path.unlink(missing_ok=True)
            said.append(f"removed {stray.path}: {stray.why}")
    finally:
        for _, lock in held:
            lock.release()
    return said
