"""Compaction: a rank's many small committed files rewritten as a few large ones, inside the manifest design.

The logger writes one file per table per rank per flush, and real runs flush every step, so a run holds thousands
of small files and every reader pays per file (listing, footers, one DuckDB scan per file, one kept aggregate per
file). Compaction rewrites consecutive committed flushes of one rank into one file per table (bounded by
:data:`MAX_ROWS` rows and :data:`MAX_BYTES` bytes), with the logger's encodings (:data:`trustscope.runformat.layout.WRITE_OPTIONS`)
and row groups. It is committed by one atomic step that every reader of the folder sees, trustscope's or a plain
glob: the compacted file is written into ``<run>/_staging/`` beside hard links to the rank folder's other files,
the rank's manifest gets a record ``{"flushes": [first, last], "files": [...], "at": ...}``
(:data:`trustscope.runformat.commits.COMPACTED_KEY`), and the staged folder is swapped with the live rank folder
(:func:`trustscope.runformat.fsops.exchange`, ``renameat2(RENAME_EXCHANGE)``); readers list the flush files or the
compacted file, never both, never neither (:func:`trustscope.runformat.commits.committed_files` lets a record take effect in a
folder once its files are there). The old folder waits under ``<run>/_superseded/`` ``delete_after_s`` for readers
that hold it open. A process killed anywhere leaves a run every reader reads right; :func:`recover_rank` (the next
writer, ``trustscope compact``, ``validate --repair``) swaps in what was staged and recorded and removes the rest.
Where no swap exists (object stores, layout 1 runs, NFS) only :func:`compact_logdir` compacts, recording, putting
the compacted file in place and deleting the sources at once (``docs/logging.md`` states the window).

Files are merged only when their footers agree (the Arrow schema and every key but the flush's own counts): tokens
files written with different ``blocked_rules`` rule lists, or before that column existed, are never merged
together. A compacted file's footer keeps the metadata its sources agree on and adds :data:`SOURCES_META` (the
files it replaced, with their rows, in the order of its rows) and :data:`ORIGINALS_META` (every flush file it holds
rows of, with its flush, steps, rows and token counts), so the query layer can merge the kept aggregates of the
sources instead of recomputing them, and a run can still be cut back at a step (:func:`trustscope.logger.drop_steps_after`).

Two ways to run it: :class:`BackgroundCompactor`, the logger's own thread (``TokenLogger(compact_every=N)``, where
:func:`background_compaction` allows it), which
merges ``N`` consecutive units of the same size class at a time (an LSM-style tiering: each row is rewritten about
``log_N(flushes)`` times); and :func:`compact_logdir` (``trustscope compact``), which merges everything it can for
logs already written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trustscope.runformat.commits import compaction_records
from trustscope.runformat.errors import CompactionError, Stopped, describe_error
from trustscope.runformat.footers import (
    COUNTS,
    ORIGINALS_META,
    OWN_META_PREFIXES,
    SOURCES_META,
    file_sizes,
    opened_file,
    read_footer,
)
from trustscope.runformat.fsops import can_exchange, replace_file
from trustscope.runformat.layout import (
    FLUSH_META_PREFIX,
    TABLES,
    TMP_PREFIX,
    WRITE_OPTIONS,
    DataFileName,
    compacted_file_name,
    layout_of,
    parse_data_file,
    rank_dir_name,
    rank_folder,
    tmp_path,
)
from trustscope.runformat.stores import RunStore, where
from trustscope.runformat.swap import (
    _COMPACTED_TMP,
    DELETE_AFTER_S,
    drop_superseded,
    retire,
    staging_dir,
    swap_in,
)

MAX_ROWS = 4_000_000
"""Rows (of any table) a compaction puts into one file at most: the cold pass aggregates one file at a time
(``trustscope.db.BATCH_ROWS`` rows a query), and smaller files keep that memory bounded."""


MAX_BYTES = 256 << 20
"""Bytes of source files (all tables of the merged flushes) a compaction merges at most."""


FANIN = 10
"""Units of one size class the logger's background compaction merges at a time (its ``compact_every``)."""


ROW_GROUP_SIZE = 1 << 17
"""Rows per row group of a compacted file (the logger's default ``row_group_size``)."""


@dataclass(frozen=True)
class _File:
    table: str
    name: str
    size: int
    parsed: DataFileName
    folder: str = ""
    """The folder it lies in, relative to the run (``tokens/r0000``; ``tokens`` in a layout 1 run)."""


@dataclass
class _Unit:
    """What compaction merges: one committed flush (its files of every table), or one compacted record."""

    lo: int
    hi: int
    files: list[_File]
    record: dict | None = None
    rows: int = 0
    """The most rows of one table's files (what :data:`MAX_ROWS` bounds)."""
    identity: dict[str, tuple] = field(default_factory=dict)
    """table -> what its files must share with another unit's to be merged (see :func:`_identity`)."""
    metas: dict[str, pq.FileMetaData] = field(default_factory=dict)
    """``<table>/<name>`` -> the file's footer, read once."""

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def flushes(self) -> int:
        """The flushes it spans (its size class is ``floor(log_fanin(flushes))``, see :func:`plan`)."""
        return self.hi - self.lo + 1


@dataclass
class RankResult:
    """What one compaction of one rank did."""

    run_dir: str
    rank: int
    files_before: int = 0
    files_after: int = 0
    merged: list[tuple[int, int]] = field(default_factory=list)
    """The flush ranges committed as compacted files."""
    deleted: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)


def _identity(meta: pq.FileMetaData) -> tuple:
    """What two files must share to be merged: the Parquet schema and every footer key but the flush's own counts
    and the compaction's records (so, for tokens files, the ``blocked_rules`` rule list)."""
    kv = tuple(sorted((k, v) for k, v in (meta.metadata or {}).items() if not k.startswith(OWN_META_PREFIXES)))
    return meta.schema.to_arrow_schema().remove_metadata().to_string(show_field_metadata=False), kv


def _originals(meta: pq.FileMetaData, f: _File) -> list[list]:
    """The :data:`ORIGINALS_META` entries of file ``f``: its own list when it is compacted, else itself."""
    kv = meta.metadata or {}
    if f.parsed.compacted is not None:
        return json.loads(kv.get(ORIGINALS_META.encode(), b"[]"))
    counts = [kv.get(f"{FLUSH_META_PREFIX}{k}".encode()) for k in COUNTS]
    return [[f.name, f.parsed.flush, f.parsed.first_step, f.parsed.last_step, meta.num_rows,
             *(None if c is None else int(c) for c in counts)]]


def _units(rank: int, mark: Any, records: list[dict], listing: dict[str, dict[str, int]],
           folders: dict[str, str]) -> list[_Unit]:
    """The rank's committed flushes (up to ``mark``) not yet compacted, and its compacted ``records``, in flush
    order. ``listing``: table -> name -> size of the rank's folder ``folders[table]``."""
    ranges = sorted((r["flushes"][0], r["flushes"][1]) for r in records)
    flushes: dict[int, list[_File]] = {}
    by_rel: dict[str, _File] = {}
    for table, names in listing.items():
        for name, size in names.items():
            parsed = parse_data_file(name)
            if parsed is None or parsed.rank != rank or name.startswith(TMP_PREFIX):
                continue
            f = _File(table, name, size, parsed, folders[table])
            if parsed.compacted is not None:
                by_rel[f"{f.folder}/{name}"] = f
            elif (parsed.flush is not None and isinstance(mark, int) and parsed.flush <= mark
                  and not any(lo <= parsed.flush <= hi for lo, hi in ranges)):
                flushes.setdefault(parsed.flush, []).append(f)
    units = [_Unit(n, n, sorted(files, key=lambda f: (f.table, f.name))) for n, files in flushes.items()]
    for record in records:
        files = [by_rel[rel] for rel in record["files"] if rel in by_rel]
        if len(files) == len(record["files"]):  # a record whose file is gone is left alone (validate says so)
            units.append(_Unit(record["flushes"][0], record["flushes"][1], files, record))
    units.sort(key=lambda u: u.lo)
    return units


def _describe(store: RunStore, run_dir: Any, unit: _Unit) -> None:
    """Fill in the unit's rows and identities from its files' footers."""
    rows: dict[str, int] = {}
    for f in unit.files:
        meta = unit.metas[f"{f.table}/{f.name}"] = read_footer(store, run_dir / f.folder / f.name)
        rows[f.table] = rows.get(f.table, 0) + meta.num_rows
        unit.identity.setdefault(f.table, _identity(meta))
    unit.rows = max(rows.values(), default=0)


def _fits(group: list[_Unit], unit: _Unit, max_rows: int, max_bytes: int) -> bool:
    shared = {}
    for u in group:
        for table, ident in u.identity.items():
            shared.setdefault(table, ident)
    if any(shared.get(t, ident) != ident for t, ident in unit.identity.items()):
        return False
    return (sum(u.rows for u in group) + unit.rows <= max_rows
            and sum(u.size for u in group) + unit.size <= max_bytes)


def _size_class(flushes: int, fanin: int) -> int:
    level = 0
    while flushes >= fanin:
        flushes //= fanin
        level += 1
    return level


def plan(units: list[_Unit], *, full: bool, fanin: int = FANIN, max_rows: int = MAX_ROWS,
         max_bytes: int = MAX_BYTES) -> list[list[_Unit]]:
    """The groups of consecutive units to merge, each into one file per table.

    ``full``: merge every run of compatible units as far as the bounds allow (``trustscope compact``). Else
    (the logger's tiering) merge ``fanin`` consecutive compatible units of the same size class (flush count
    ``fanin**L`` up to ``fanin**(L+1)``): each row is rewritten about once per class, so a run of ``n`` flushes
    costs ``log_fanin(n)`` rewrites of its rows and keeps at most ``fanin - 1`` files per class and table.
    Units whose merge would pass ``max_rows`` or ``max_bytes`` are big enough and stay as they are.
    """
    if fanin < 2:
        raise ValueError(f"fanin must be >= 2, got {fanin}")
    groups: list[list[_Unit]] = []
    run: list[_Unit] = []
    for unit in units:
        same_class = not run or full or _size_class(run[0].flushes, fanin) == _size_class(unit.flushes, fanin)
        if run and same_class and _fits(run, unit, max_rows, max_bytes):
            run.append(unit)
        else:
            if full and len(run) > 1:
                groups.append(run)
            run = [unit] if _fits([], unit, max_rows, max_bytes) else []
        if not full and len(run) == fanin:
            groups.append(run)
            run = []
    if full and len(run) > 1:
        groups.append(run)
    return groups


def _rewrite(store: RunStore, run_dir: Any, table: str, sources: list[list[_File]], footers: dict[str, pq.FileMetaData],
             tmp: Path, row_group_size: int, stop: threading.Event | None) -> None:
    """Write the rows of ``sources`` (per unit: its files of ``table``, ``footers`` by ``<table>/<name>``) into
    the local file ``tmp``, in order: a flush's parts interleaved by row group, as the writer dealt them out, so the
    rows keep their logged order."""
    flat = [f for files in sources for f in files]
    metas = {f.name: footers[f"{table}/{f.name}"] for f in flat}
    schema = metas[flat[0].name].schema.to_arrow_schema()
    own = set((schema.metadata or {}).keys())
    footer = {k: v for k, v in (metas[flat[0].name].metadata or {}).items()
              if not k.startswith(OWN_META_PREFIXES) and k not in own}
    footer[SOURCES_META.encode()] = json.dumps([[f.name, metas[f.name].num_rows] for f in flat]).encode()
    footer[ORIGINALS_META.encode()] = json.dumps([o for f in flat for o in _originals(metas[f.name], f)]).encode()
    expected = sum(m.num_rows for m in metas.values())
    written = 0
    pending: list[pa.Table] = []
    pending_rows = 0
    with pq.ParquetWriter(tmp, schema, **WRITE_OPTIONS[table].writer_kwargs()) as writer:

        def drain(whole: bool) -> None:
            nonlocal pending, pending_rows, written
            data = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
            keep = data.num_rows % row_group_size if whole else 0
            for start in range(0, data.num_rows - keep, row_group_size):
                group = data.slice(start, min(row_group_size, data.num_rows - keep - start))
                writer.write_table(group, row_group_size=row_group_size)
                written += group.num_rows
            pending = [data.slice(data.num_rows - keep)] if keep else []
            pending_rows = keep

        for files in sources:
            with contextlib.ExitStack() as stack:
                parts = [stack.enter_context(opened_file(store, run_dir / f.folder / f.name, metas[f.name]))
                         for f in files]
                for g in range(max(p.num_row_groups for p in parts)):
                    if stop is not None and stop.is_set():
                        raise Stopped
                    for part in parts:
                        if g < part.num_row_groups:
                            data = part.read_row_group(g)
                            pending.append(data)
                            pending_rows += data.num_rows
                    if pending_rows >= row_group_size:
                        drain(whole=True)
        if pending_rows:
            drain(whole=False)
        writer.add_key_value_metadata(footer)
    if written != expected:
        raise CompactionError(f"{tmp}: wrote {written} row(s) of {expected}")


def _merge(store: RunStore, run_dir: Any, rank: int, group: list[_Unit], row_group_size: int, fsync: bool,
           stop: threading.Event | None, folders: dict[str, str],
           staging: Path | None) -> tuple[dict, list[tuple[Any, Any]]]:
    """Write the group's compacted files, invisible to every reader: with ``staging`` (a local folder outside the
    table folders) as ``staging/<table>/<name>``, else under temporary names, to be put in place after the
    record is saved. Returns the manifest record and ``(temporary file or None, final path)`` per file. On any
    failure, what was written is removed."""
    lo, hi = group[0].lo, group[-1].hi
    record: dict[str, Any] = {"flushes": [lo, hi], "files": []}
    written: list[tuple[Any, Any]] = []
    tmp: Path | None = None
    try:
        for table in TABLES:
            sources = [[f for f in unit.files if f.table == table] for unit in group]
            sources = [files for files in sources if files]
            if not sources:
                continue
            flat = [f for files in sources for f in files]
            name = compacted_file_name(rank, min(f.parsed.first_step for f in flat),
                                         max(f.parsed.last_step for f in flat), (lo, hi))
            final = run_dir / folders[table] / name
            if staging is not None:
                (staging / table).mkdir(parents=True, exist_ok=True)
                tmp = tmp_path(staging / table / name)
            else:
                tmp = tmp_path(store.spool(run_dir / table) / name)
            try:
                footers = {k: v for unit in group for k, v in unit.metas.items()}
                _rewrite(store, run_dir, table, sources, footers, tmp, row_group_size, stop)
                if staging is not None:
                    replace_file(tmp, staging / table / name, fsync)
                    tmp = None
            except OSError as err:
                raise CompactionError(f"cannot write {where(store, final)}: {describe_error(err)}") from err
            written.append((tmp, final))
            tmp = None
            record["files"].append(f"{folders[table]}/{name}")
    except BaseException:
        for path in [tmp, *(t for t, _ in written)]:
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return record, written


def _cleanup(store: RunStore, run_dir: Any, rank: int, records: list[dict], listing: dict[str, dict[str, int]],
             folders: dict[str, str], delete_after_s: float, now: float, result: RankResult,
             mark: Any = None) -> None:
    """Delete what trustscope does not read and never will: a killed compaction's temporary and unlisted files,
    flush files above the rank's committed flush ``mark`` (a writer of an older version that died before its
    commit), at once; files superseded by a record still in the rank's folders (older versions, or a deletion that
    failed) once ``delete_after_s`` passed since its commit, and the rank's superseded folders as old. Failures are
    warnings (retried at the next compaction)."""
    listed = {rel for r in records for rel in r["files"]}
    spans = [(r["flushes"][0], r["flushes"][1], float(r.get("at") or 0.0), r["files"]) for r in records]

    def superseded_at(lo: int, hi: int, folder: str | None = None, names: Any = ()) -> float | None:
        """When a record covering ``lo..hi`` was committed; with ``folder``, only a record in effect there (its
        files of ``folder`` all among ``names``), as readers decide (:meth:`trustscope.runformat.commits.Commits.select`):
        a flush file whose compacted file has not landed in its folder (a swap not finished) is still read."""
        return next((at for a, b, at, files in spans if a <= lo and hi <= b and (
            folder is None or all(rel.rpartition("/")[2] in names for rel in files
                                  if rel.rpartition("/")[0] == folder))), None)

    for table, names in listing.items():
        for name in list(names):
            m = _COMPACTED_TMP.match(name)
            if m is not None:
                old = int(m[1]) == rank
            else:
                parsed = parse_data_file(name)
                if parsed is None or parsed.rank != rank or name.startswith(TMP_PREFIX):
                    continue
                if parsed.compacted is not None:
                    if f"{folders[table]}/{name}" in listed:
                        continue
                    at = superseded_at(*parsed.compacted)
                    old = at is None or now - at >= delete_after_s
                elif parsed.flush is not None and isinstance(mark, int) and parsed.flush > mark:
                    old = True
                elif parsed.flush is not None:
                    at = superseded_at(parsed.flush, parsed.flush, folders[table], names)
                    old = at is not None and now - at >= delete_after_s
                else:
                    old = False
            if not old:
                continue
            path = run_dir / folders[table] / name
            try:
                store.delete(path)
            except OSError as err:
                result.warnings.append(f"cannot delete {where(store, path)}: {describe_error(err)}")
                continue
            del names[name]
            result.deleted += 1
    if not store.remote:
        result.deleted += drop_superseded(Path(run_dir), rank, delete_after_s, now, result.warnings)


def compact_rank(store: RunStore, run_dir: Any, rank: int, manifest: dict | Callable[[], dict],
                 save: Callable[[list[dict]], None], *,
                 full: bool, fanin: int = FANIN, max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES,
                 row_group_size: int = ROW_GROUP_SIZE, fsync: bool = True, delete_after_s: float = DELETE_AFTER_S,
                 stop: threading.Event | None = None, lock: Any = None) -> RankResult:
    """Compact the committed files of one rank (see :func:`plan`); ``manifest`` is the rank's manifest as last
    written (or a function that returns it, called under ``lock``), ``save(records)`` writes it with :data:`trustscope.runformat.commits.COMPACTED_KEY` replaced, atomically. The
    caller holds the rank: nobody else writes its manifest meanwhile; ``lock`` (the writer's
    :attr:`RunFiles.folder_lock`) is held while a rank folder is swapped, so no flush lands in a folder being
    retired.

    Each merged group is committed on its own (a compaction stopped or killed halfway keeps the groups committed
    so far), in one of two ways:

    * a local layout 2 run on a file system that can swap (:func:`trustscope.runformat.fsops.can_exchange`): the
      compacted files are written into ``_staging/r<rank>-c<first>-<last>/<table>/`` beside hard links to the
      rank folder's other files, the record is saved, and each table's staged folder is swapped with the live
      one in one atomic step; the old folder waits under ``_superseded`` ``delete_after_s`` for readers that hold
      it open. Every reader sees the flush files or the compacted file, never both, never neither.
    * elsewhere (an object store, a layout 1 run, a file system without ``RENAME_EXCHANGE``): the record is saved,
      then the compacted file put in place (renamed, or uploaded), then the files it replaces deleted at once.
      trustscope's readers switch when the compacted file lands; a plain lister that lists in between the
      landing and the deletions counts those rows twice, or fails on a deleted file (see ``docs/logging.md``).

    Raises :class:`CompactionError` naming the path when a file or the manifest cannot be written; the log then
    reads as before (a swap interrupted halfway is finished by :func:`recover_rank`).
    """
    started = time.perf_counter()
    result = RankResult(str(run_dir), rank)
    try:
        # Under the lock: the writer commits a flush and renames its files while holding it, so every flush
        # the manifest commits here has all its files in the listing.
        with lock if lock is not None else contextlib.nullcontext():
            if callable(manifest):
                manifest = manifest()
            layout = layout_of(manifest)
            folders = {t: (f"{t}/{rank_dir_name(rank)}" if layout >= 2 else t) for t in TABLES}
            listing = {t: file_sizes(store, run_dir / folders[t]) for t in TABLES}
        swapping = not store.remote and layout >= 2 and can_exchange(run_dir)
    except OSError as err:
        raise CompactionError(f"cannot list {where(store, run_dir)}: {describe_error(err)}") from err
    records = [dict(r) for r in compaction_records(manifest)]
    _cleanup(store, run_dir, rank, records, listing, folders, delete_after_s, time.time(), result,
             manifest.get("committed_flush"))
    units = _units(rank, manifest.get("committed_flush"), records, listing, folders)
    result.files_before = sum(len(u.files) for u in units)
    try:
        for unit in units:
            _describe(store, run_dir, unit)
    except OSError as err:
        raise CompactionError(f"cannot read the footers of {where(store, run_dir)}: {describe_error(err)}") from err
    groups = plan(units, full=full, fanin=fanin, max_rows=max_rows, max_bytes=max_bytes)
    after = result.files_before
    for group in groups:
        if stop is not None and stop.is_set():
            break
        staging = staging_dir(Path(run_dir), rank, (group[0].lo, group[-1].hi)) if swapping else None
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        try:
            record, written = _merge(store, run_dir, rank, group, row_group_size, fsync, stop, folders, staging)
        except Stopped:
            break
        record["at"] = time.time()
        replaced = {id(u.record) for u in group if u.record is not None}
        updated = sorted([r for r in records if id(r) not in replaced] + [record], key=lambda r: r["flushes"][0])
        sources = [run_dir / f.folder / f.name for u in group for f in u.files]
        # The records it replaces stay listed until its files are in place: readers go on reading their files.
        both = sorted([*records, record], key=lambda r: r["flushes"][0])
        if staging is not None:
            _commit_swap(run_dir, rank, group, record, both, staging, save, lock)
        else:
            _commit_in_place(store, run_dir, rank, written, records, both, sources, save, result)
        if len(both) != len(updated):
            try:
                save(updated)
            except OSError as err:  # the old records list files no longer there: the next save drops them
                result.warnings.append(f"cannot write the manifest of {where(store, run_dir)} rank {rank}: "
                                       f"{describe_error(err)}")
        records = updated
        after += len(written) - len(sources)
        result.merged.append((record["flushes"][0], record["flushes"][1]))
    result.files_after = after
    result.seconds = time.perf_counter() - started
    return result


def _commit_swap(run_dir: Path, rank: int, group: list[_Unit], record: dict, updated: list[dict], staging: Path,
                 save: Callable[[list[dict]], None], lock: Any) -> None:
    """Stage the rank folders of ``record`` (hard links to every other file), save the record, swap them in."""
    sources = {(f.table, f.name) for u in group for f in u.files}
    with lock if lock is not None else contextlib.nullcontext():
        try:
            for table in TABLES:
                staged = staging / table
                if not staged.is_dir():
                    continue
                live = rank_folder(run_dir, table, rank)
                for name in os.listdir(live):
                    if (table, name) not in sources:
                        os.link(live / name, staged / name)
            save(updated)
        except OSError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise CompactionError(f"cannot stage or record the compaction of {run_dir} rank {rank}: "
                                  f"{describe_error(err)}") from err
        try:
            swap_in(run_dir, rank, record, staging)
            retire(run_dir, staging)
        except OSError as err:  # recorded: the next writer, compact or validate --repair finishes the swap
            raise CompactionError(f"cannot swap in the compacted files of {run_dir} rank {rank}: "
                                  f"{describe_error(err)}") from err


def _commit_in_place(store: RunStore, run_dir: Any, rank: int, written: list[tuple[Any, Any]], records: list[dict],
                     updated: list[dict], sources: list[Any], save: Callable[[list[dict]], None],
                     result: RankResult) -> None:
    """Save the record, put the compacted files in place, delete the files they replace at once."""
    try:
        save(updated)
    except OSError as err:
        for tmp, _ in written:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        raise CompactionError(f"cannot write the manifest of {where(store, run_dir)} rank {rank}: "
                              f"{describe_error(err)}") from err
    landed: list[Any] = []
    try:
        for tmp, final in written:
            store.publish(tmp, final, True)
            landed.append(final)
    except OSError as err:
        for tmp, final in written:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                store.delete(final)
        with contextlib.suppress(OSError):
            save(records)
        raise CompactionError(f"cannot write {where(store, written[len(landed)][1])}: {describe_error(err)}") from err
    for path in sources:
        try:
            store.delete(path)
            result.deleted += 1
        except OSError as err:
            result.warnings.append(f"cannot delete {where(store, path)}: {describe_error(err)}")
