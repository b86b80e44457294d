"""Compaction: a rank's many small committed files rewritten as a few large ones, inside the manifest design.

The logger writes one file per table per rank per flush, and real runs flush every step, so a run holds thousands
of small files and every reader pays per file (listing, footers, one DuckDB scan per file, one kept aggregate per
file). Compaction rewrites consecutive committed flushes of one rank into one file per table (bounded by
:data:`MAX_ROWS` rows and :data:`MAX_BYTES` bytes), with the logger's encodings (:data:`trustscope.schema.WRITE_OPTIONS`)
and row groups. It is committed by one atomic step that every reader of the folder sees, trustscope's or a plain
glob: the compacted file is written into ``<run>/_staging/`` beside hard links to the rank folder's other files,
the rank's manifest gets a record ``{"flushes": [first, last], "files": [...], "at": ...}``
(:data:`trustscope.schema.COMPACTED_KEY`), and the staged folder is swapped with the live rank folder
(:func:`trustscope.storage.exchange`, ``renameat2(RENAME_EXCHANGE)``); readers list the flush files or the
compacted file, never both, never neither (:func:`trustscope.schema.committed_files` lets a record take effect in a
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
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import schema as S
from trustscope.storage import RunStore, can_exchange, exchange, replace_file

SOURCES_META = "trustscope.compacted.sources"
"""Footer key of a compacted file: JSON ``[[name, rows], ...]``, the files it replaced (flush files or earlier
compacted files of the same folder), in the order of its rows. Their kept aggregates, merged, are its own."""
ORIGINALS_META = "trustscope.compacted.originals"
"""Footer key of a compacted file: JSON ``[[name, flush, first_step, last_step, rows, tokens_generated,
tokens_logged, dropped_rows], ...]``, every flush file whose rows it holds, in row order (a flush's rows are
contiguous; the counts are the flush's, repeated in each of its files, None where a file had none)."""
_OWN_PREFIXES = (S.FLUSH_META_PREFIX.encode(), b"trustscope.compacted.", b"ARROW:schema")
COUNTS = ("tokens_generated", "tokens_logged", "dropped_rows")

MAX_ROWS = 4_000_000
"""Rows (of any table) a compaction puts into one file at most: the cold pass aggregates one file at a time
(``trustscope.db.BATCH_ROWS`` rows a query), and smaller files keep that memory bounded."""
MAX_BYTES = 256 << 20
"""Bytes of source files (all tables of the merged flushes) a compaction merges at most."""
FANIN = 10
"""Units of one size class the logger's background compaction merges at a time (its ``compact_every``)."""
DELETE_AFTER_S = 60.0
"""Seconds a rank folder swapped out by a compaction is kept (under ``<run>/_superseded/``) for readers that hold it
open; files superseded in place (layout 1, object stores) are deleted at once."""
ROW_GROUP_SIZE = 1 << 17
"""Rows per row group of a compacted file (the logger's default ``row_group_size``)."""

_COMPACTED_TMP = re.compile(r"^\.r(\d+)-s\d+-\d+-c\d+-\d+(?:-p\d+)?\.parquet" + re.escape(S.TMP_SUFFIX) + "$")


class CompactionError(OSError):
    """A compaction that could not be done; the log is left as it was. The message names the path and the cause."""


class Stopped(Exception):
    """The compaction was asked to stop (the logger is closing); nothing was committed."""


@dataclass(frozen=True)
class _File:
    table: str
    name: str
    size: int
    parsed: S.DataFileName
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


# ------------------------------------------------------------------------------------------------ storage


def _listing(store: RunStore, folder: Any) -> dict[str, int]:
    """name -> size of the files directly in ``folder`` (none when it does not exist)."""
    if store.remote:
        from pyarrow.fs import FileSelector, FileType

        infos = store.fs.get_file_info(FileSelector(str(folder), allow_not_found=True))
        return {PurePosixPath(i.path).name: i.size for i in infos if i.type == FileType.File}
    out = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                if entry.is_file():
                    out[entry.name] = entry.stat().st_size
    return out


@contextlib.contextmanager
def _opened(store: RunStore, path: Any, meta: pq.FileMetaData | None = None) -> Iterator[pq.ParquetFile]:
    """``path`` opened for reading; with ``meta``, its footer is not read again."""
    if store.remote:
        with store.fs.open_input_file(str(path)) as f:
            yield pq.ParquetFile(f, metadata=meta)
    else:
        with pq.ParquetFile(path, metadata=meta) as f:
            yield f


def read_footer(store: RunStore, path: Any) -> pq.FileMetaData:
    """The Parquet footer of ``path`` on ``store`` (local or an object store)."""
    with _opened(store, path) as f:
        return f.metadata


def _identity(meta: pq.FileMetaData) -> tuple:
    """What two files must share to be merged: the Parquet schema and every footer key but the flush's own counts
    and the compaction's records (so, for tokens files, the ``blocked_rules`` rule list)."""
    kv = tuple(sorted((k, v) for k, v in (meta.metadata or {}).items() if not k.startswith(_OWN_PREFIXES)))
    return meta.schema.to_arrow_schema().remove_metadata().to_string(show_field_metadata=False), kv


def _originals(meta: pq.FileMetaData, f: _File) -> list[list]:
    """The :data:`ORIGINALS_META` entries of file ``f``: its own list when it is compacted, else itself."""
    kv = meta.metadata or {}
    if f.parsed.compacted is not None:
        return json.loads(kv.get(ORIGINALS_META.encode(), b"[]"))
    counts = [kv.get(f"{S.FLUSH_META_PREFIX}{k}".encode()) for k in COUNTS]
    return [[f.name, f.parsed.flush, f.parsed.first_step, f.parsed.last_step, meta.num_rows,
             *(None if c is None else int(c) for c in counts)]]


# ------------------------------------------------------------------------------------------------ planning


def _units(rank: int, mark: Any, records: list[dict], listing: dict[str, dict[str, int]],
           folders: dict[str, str]) -> list[_Unit]:
    """The rank's committed flushes (up to ``mark``) not yet compacted, and its compacted ``records``, in flush
    order. ``listing``: table -> name -> size of the rank's folder ``folders[table]``."""
    ranges = sorted((r["flushes"][0], r["flushes"][1]) for r in records)
    flushes: dict[int, list[_File]] = {}
    by_rel: dict[str, _File] = {}
    for table, names in listing.items():
        for name, size in names.items():
            parsed = S.parse_data_file(name)
            if parsed is None or parsed.rank != rank or name.startswith(S.TMP_PREFIX):
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


# ------------------------------------------------------------------------------------------------ writing


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
              if not k.startswith(_OWN_PREFIXES) and k not in own}
    footer[SOURCES_META.encode()] = json.dumps([[f.name, metas[f.name].num_rows] for f in flat]).encode()
    footer[ORIGINALS_META.encode()] = json.dumps([o for f in flat for o in _originals(metas[f.name], f)]).encode()
    expected = sum(m.num_rows for m in metas.values())
    written = 0
    pending: list[pa.Table] = []
    pending_rows = 0
    with pq.ParquetWriter(tmp, schema, **S.WRITE_OPTIONS[table].writer_kwargs()) as writer:

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
                parts = [stack.enter_context(_opened(store, run_dir / f.folder / f.name, metas[f.name]))
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
        for table in S.TABLES:
            sources = [[f for f in unit.files if f.table == table] for unit in group]
            sources = [files for files in sources if files]
            if not sources:
                continue
            flat = [f for files in sources for f in files]
            name = S.compacted_file_name(rank, min(f.parsed.first_step for f in flat),
                                         max(f.parsed.last_step for f in flat), (lo, hi))
            final = run_dir / folders[table] / name
            if staging is not None:
                (staging / table).mkdir(parents=True, exist_ok=True)
                tmp = S.tmp_path(staging / table / name)
            else:
                tmp = S.tmp_path(store.spool(run_dir / table) / name)
            try:
                footers = {k: v for unit in group for k, v in unit.metas.items()}
                _rewrite(store, run_dir, table, sources, footers, tmp, row_group_size, stop)
                if staging is not None:
                    replace_file(tmp, staging / table / name, fsync)
                    tmp = None
            except OSError as err:
                raise CompactionError(f"cannot write {_where(store, final)}: {_why(err)}") from err
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


def _where(store: RunStore, path: Any) -> str:
    return store.url_of(path) if store.remote else str(path)


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------------------------ one rank


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
        files of ``folder`` all among ``names``), as readers decide (:meth:`trustscope.schema.Commits.select`):
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
                parsed = S.parse_data_file(name)
                if parsed is None or parsed.rank != rank or name.startswith(S.TMP_PREFIX):
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
                result.warnings.append(f"cannot delete {_where(store, path)}: {_why(err)}")
                continue
            del names[name]
            result.deleted += 1
    if not store.remote:
        result.deleted += drop_superseded(Path(run_dir), rank, delete_after_s, now, result.warnings)


def drop_superseded(run_dir: Path, rank: int, older_than_s: float = 0.0, now: float | None = None,
                    warnings: list[str] | None = None) -> int:
    """Delete rank ``rank``'s folders under ``_superseded`` that were superseded ``older_than_s`` seconds ago or
    more; returns how many files went. No reader reaches them by path: a reader that listed one of them just
    before the swap finds the files it keeps under the live folder, and a file compacted away not at all (it
    retries); they are kept the grace period for readers that hold the old folder open."""
    now = time.time() if now is None else now
    gone = 0
    for path in sorted((Path(run_dir) / S.SUPERSEDED_DIR).glob(f"*-{S.rank_dir_name(rank)}-*")):
        ms = path.name.partition("-")[0]
        if ms.isdigit() and now - int(ms) / 1000 < older_than_s:
            continue
        files = sum(len(f) for _, _, f in os.walk(path))
        try:
            shutil.rmtree(path)
            gone += files
        except OSError as err:
            if warnings is not None:
                warnings.append(f"cannot delete {path}: {_why(err)}")
    with contextlib.suppress(OSError):
        (Path(run_dir) / S.SUPERSEDED_DIR).rmdir()  # empty: gone
    return gone


def _staging_dir(run_dir: Path, rank: int, flushes: tuple[int, int]) -> Path:
    return run_dir / S.STAGING_DIR / f"{S.rank_dir_name(rank)}-c{flushes[0]:08d}-{flushes[1]:08d}"


def _retire(run_dir: Path, staging: Path) -> None:
    """Move a staging folder, which holds the swapped-out rank folders, under ``_superseded`` (its name starts
    with the time of the swap, in ms)."""
    done = run_dir / S.SUPERSEDED_DIR / f"{int(time.time() * 1000)}-{staging.name}"
    done.parent.mkdir(exist_ok=True)
    os.rename(staging, done)
    with contextlib.suppress(OSError):
        staging.parent.rmdir()


def _in_range(name: str, rank: int, lo: int, hi: int) -> bool:
    parsed = S.parse_data_file(name)
    if parsed is None or parsed.rank != rank:
        return False
    if parsed.compacted is not None:
        return lo <= parsed.compacted[0] and parsed.compacted[1] <= hi
    return parsed.flush is not None and lo <= parsed.flush <= hi


def _swap(run_dir: Path, rank: int, record: dict, staging: Path) -> list[str]:
    """Swap each table's live rank folder with its staged one (built for ``record``) where the live folder does
    not hold the record's files yet; returns the tables swapped. A staged folder that is not the live one less the
    record's sources plus its files (the live folder changed since) is not swapped: CompactionError."""
    lo, hi = record["flushes"]
    swapped = []
    for table in S.TABLES:
        staged = staging / table
        if not staged.is_dir():
            continue
        live = S.rank_folder(run_dir, table, rank)
        mine = {rel.rpartition("/")[2] for rel in record["files"] if rel.rpartition("/")[0] == f"{table}/{live.name}"}
        have = set(os.listdir(live)) if live.is_dir() else set()
        if mine and mine <= have:
            continue  # swapped already
        expected = {n for n in have if not _in_range(n, rank, lo, hi)} | mine
        if set(os.listdir(staged)) != expected:
            raise CompactionError(f"{staged} does not match {live} (it changed since the compaction staged it); "
                                  f"nothing swapped")
        exchange(staged, live)
        swapped.append(table)
    return swapped


def recover_rank(store: RunStore, run_dir: Any, rank: int, manifest: dict) -> list[str]:
    """Finish or undo what a killed writer or compaction of rank ``rank`` left half done; returns what it did, in
    words. The caller holds the rank (its lock): nothing else writes it meanwhile.

    * A flush the manifest commits whose files were not all renamed into place (``publishing``): renamed now
      (rolled forward); a file whose temporary is gone too (an object store's local spool) is dropped from the
      manifest's ``rows`` and counted as lost.
    * A compaction recorded in the manifest whose staged folders were not all swapped in: swapped now (rolled
      forward). A record none of whose files exists, with nothing staged: dropped (the flush files it would have
      replaced are still read). A staged folder no record names: removed.
    * Superseded folders older than :data:`DELETE_AFTER_S`: removed.
    """
    done: list[str] = []
    changes: dict[str, Any] = {}
    rows = dict(manifest.get("rows") or {})
    lost_rows: dict[str, int] = {}
    for tmp, final, n in S.publishing_entries(manifest):
        final_path = run_dir / final
        parsed = S.parse_data_file(final_path.name)
        compacted = parsed is not None and parsed.flush is not None and any(
            r["flushes"][0] <= parsed.flush <= r["flushes"][1] for r in S.compaction_records(manifest))
        if compacted or store.exists(final_path):
            continue
        if tmp is not None and not store.remote and (run_dir / tmp).exists():
            store.prepare_folder(final_path.parent)
            replace_file(run_dir / tmp, final_path, True)
            done.append(f"renamed {run_dir / tmp} to {final_path} (a committed flush a killed writer had not put "
                        f"in place)")
            continue
        table = S.table_of(PurePosixPath(final))
        if table in rows and isinstance(n, int):
            rows[table] = max(0, int(rows[table]) - n)
            lost_rows[table] = lost_rows.get(table, 0) + n
        done.append(f"{_where(store, final_path)}: a committed file that never landed; its {n} row(s) are "
                    f"counted as lost")
    if lost_rows:
        lost = dict(manifest.get("lost") or {"rows": dict.fromkeys(S.TABLES, 0), "first_step": None,
                                             "last_step": None, "errors": []})
        lost["rows"] = {t: int((lost.get("rows") or {}).get(t, 0)) + lost_rows.get(t, 0) for t in S.TABLES}
        lost["errors"] = [*(lost.get("errors") or []), "the writer was killed before its last flush landed"][:10]
        changes.update(rows=rows, lost=lost)
    if done:  # every committed file is in place now, or counted as lost
        changes["publishing"] = []
    records = [dict(r) for r in S.compaction_records(manifest)]
    whole = [r for r in records if all(store.exists(run_dir / rel) for rel in r["files"])]
    nested = [r for r in records if any(o is not r and o["flushes"][0] <= r["flushes"][0]
                                        and r["flushes"][1] <= o["flushes"][1] for o in whole)]
    for record in nested:  # replaced by a compaction killed before it wrote its manifest the last time
        done.append(f"dropped the record of flushes {record['flushes']}: a larger compaction replaced it")
    if nested:
        records = [r for r in records if not any(r is n for n in nested)]
        changes[S.COMPACTED_KEY] = records
    if not store.remote:
        run_dir = Path(run_dir)
        staged = {p.name: p for p in (run_dir / S.STAGING_DIR).glob(f"{S.rank_dir_name(rank)}-c*")}
        kept = []
        for record in records:
            staging = _staging_dir(run_dir, rank, tuple(record["flushes"]))
            if staging.name in staged:
                del staged[staging.name]
                try:
                    tables = _swap(run_dir, rank, record, staging)
                except (OSError, CompactionError) as err:
                    done.append(f"cannot finish the compaction of flushes {record['flushes']}: {_why(err)}")
                    kept.append(record)
                    continue
                _retire(run_dir, staging)
                if tables:
                    done.append(f"swapped in the compacted files of flushes {record['flushes']} in "
                                f"{', '.join(tables)} (a compaction killed before its swap)")
            elif not any((run_dir / rel).exists() for rel in record["files"]):
                done.append(f"dropped the record of flushes {record['flushes']}: none of its files exists, "
                            f"the flush files it would replace are read")
                continue
            kept.append(record)
        for table in S.TABLES:  # a publish of several files killed before its swap (its temporaries are kept)
            staged[f"{table}-{S.rank_dir_name(rank)}-publish"] = run_dir / S.STAGING_DIR / \
                f"{table}-{S.rank_dir_name(rank)}-publish"
        for path in staged.values():
            if not path.exists():
                continue
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path} (staged by a compaction killed before its commit)")
        with contextlib.suppress(OSError):
            (run_dir / S.STAGING_DIR).rmdir()
        if len(kept) != len(records) or nested:
            changes[S.COMPACTED_KEY] = kept
        gone = drop_superseded(run_dir, rank, DELETE_AFTER_S)
        if gone:
            done.append(f"removed {gone} superseded file(s) of rank {rank} under {run_dir / S.SUPERSEDED_DIR}")
    if changes:
        from trustscope.logger.runfiles import rank_file

        manifest.update(changes)
        store.write_atomic(rank_file(run_dir, rank), json.dumps(manifest, indent=2, default=str))
    return done


def compact_rank(store: RunStore, run_dir: Any, rank: int, manifest: dict | Callable[[], dict],
                 save: Callable[[list[dict]], None], *,
                 full: bool, fanin: int = FANIN, max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES,
                 row_group_size: int = ROW_GROUP_SIZE, fsync: bool = True, delete_after_s: float = DELETE_AFTER_S,
                 stop: threading.Event | None = None, lock: Any = None) -> RankResult:
    """Compact the committed files of one rank (see :func:`plan`); ``manifest`` is the rank's manifest as last
    written (or a function that returns it, called under ``lock``), ``save(records)`` writes it with :data:`trustscope.schema.COMPACTED_KEY` replaced, atomically. The
    caller holds the rank: nobody else writes its manifest meanwhile; ``lock`` (the writer's
    :attr:`RunFiles.folder_lock`) is held while a rank folder is swapped, so no flush lands in a folder being
    retired.

    Each merged group is committed on its own (a compaction stopped or killed halfway keeps the groups committed
    so far), in one of two ways:

    * a local layout 2 run on a file system that can swap (:func:`trustscope.storage.can_exchange`): the
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
            layout = S.layout_of(manifest)
            folders = {t: (f"{t}/{S.rank_dir_name(rank)}" if layout >= 2 else t) for t in S.TABLES}
            listing = {t: _listing(store, run_dir / folders[t]) for t in S.TABLES}
        swapping = not store.remote and layout >= 2 and can_exchange(run_dir)
    except OSError as err:
        raise CompactionError(f"cannot list {_where(store, run_dir)}: {_why(err)}") from err
    records = [dict(r) for r in S.compaction_records(manifest)]
    _cleanup(store, run_dir, rank, records, listing, folders, delete_after_s, time.time(), result,
             manifest.get("committed_flush"))
    units = _units(rank, manifest.get("committed_flush"), records, listing, folders)
    result.files_before = sum(len(u.files) for u in units)
    try:
        for unit in units:
            _describe(store, run_dir, unit)
    except OSError as err:
        raise CompactionError(f"cannot read the footers of {_where(store, run_dir)}: {_why(err)}") from err
    groups = plan(units, full=full, fanin=fanin, max_rows=max_rows, max_bytes=max_bytes)
    after = result.files_before
    for group in groups:
        if stop is not None and stop.is_set():
            break
        staging = _staging_dir(Path(run_dir), rank, (group[0].lo, group[-1].hi)) if swapping else None
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
                result.warnings.append(f"cannot write the manifest of {_where(store, run_dir)} rank {rank}: "
                                       f"{_why(err)}")
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
            for table in S.TABLES:
                staged = staging / table
                if not staged.is_dir():
                    continue
                live = S.rank_folder(run_dir, table, rank)
                for name in os.listdir(live):
                    if (table, name) not in sources:
                        os.link(live / name, staged / name)
            save(updated)
        except OSError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise CompactionError(f"cannot stage or record the compaction of {run_dir} rank {rank}: "
                                  f"{_why(err)}") from err
        try:
            _swap(run_dir, rank, record, staging)
            _retire(run_dir, staging)
        except OSError as err:  # recorded: the next writer, compact or validate --repair finishes the swap
            raise CompactionError(f"cannot swap in the compacted files of {run_dir} rank {rank}: "
                                  f"{_why(err)}") from err


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
        raise CompactionError(f"cannot write the manifest of {_where(store, run_dir)} rank {rank}: "
                              f"{_why(err)}") from err
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
        raise CompactionError(f"cannot write {_where(store, written[len(landed)][1])}: {_why(err)}") from err
    for path in sources:
        try:
            store.delete(path)
            result.deleted += 1
        except OSError as err:
            result.warnings.append(f"cannot delete {_where(store, path)}: {_why(err)}")


# ------------------------------------------------------------------------------------------------ the logger


def background_compaction(files: Any, every: int) -> bool:
    """Whether the logger of ``files`` (a :class:`RunFiles`) compacts in the background with ``every``: only where
    a compaction swaps the rank folder atomically (a local layout 2 run on a file system with
    ``RENAME_EXCHANGE``), so that a plain reader never counts a row twice. Elsewhere it does not, with a
    warning on a local file system that cannot swap; ``trustscope compact`` compacts such logs later."""
    if not every:
        return False
    if files.store.remote:
        return False  # object stores: no swap; said in docs/logging.md, not at every open
    if files.layout < 2:
        return False  # a run of layout 1, resumed: its folders hold every rank's files, no folder to swap
    if not can_exchange(files.run_dir):
        import warnings

        from trustscope.logger.errors import LogWarning

        warnings.warn(f"trustscope: {files.run_dir} is on a file system that cannot swap folders atomically "
                      f"(renameat2 RENAME_EXCHANGE: NFS, or not Linux); background compaction is off, so that "
                      f"readers of the folders never count a row twice. Run `trustscope compact` when no one reads.",
                      LogWarning, stacklevel=4)
        return False
    return True


class BackgroundCompactor:
    """The logger's compaction thread (``TokenLogger(compact_every=N)``): after every ``N`` commits of the rank it
    merges ``N`` units of a size class (:func:`plan`), beside the writer thread, which goes on writing and
    committing flushes. Both write the rank's manifest through :meth:`RunFiles.save` (serialised there): the writer
    its flushes, this thread only :data:`trustscope.schema.COMPACTED_KEY`. A failure leaves the log as it was and is
    kept for the training thread to warn about (:meth:`take_error`); the next round tries again."""

    def __init__(self, files: Any, every: int, row_group_size: int, fsync: bool,
                 delete_after_s: float = DELETE_AFTER_S):
        self.files, self.every = files, every
        self.row_group_size, self.fsync, self.delete_after_s = row_group_size, fsync, delete_after_s
        self.rounds = 0
        self.results: list[RankResult] = []
        self._commits = 0
        self._due = threading.Event()
        self._stop = threading.Event()
        self._finishing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"trustscope-compact-r{files.rank}", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Called by the writer thread after each commit."""
        self._commits += 1
        if self._commits >= self.every:
            self._due.set()

    def tidy(self) -> None:
        """At the logger's close: delete every folder the rank's compactions swapped out (no reader reaches them by
        path; whoever comes next would delete them anyway, and nobody may come)."""
        warnings: list[str] = []
        drop_superseded(Path(self.files.run_dir), self.files.rank, 0.0, None, warnings)
        if warnings and self._error is None:
            self._error = CompactionError("; ".join(warnings[:3]))

    def take_error(self) -> BaseException | None:
        err, self._error = self._error, None
        return err

    def stop(self, finish: bool = True) -> None:
        """End the thread. ``finish``: after the round in progress and one last round over the commits since
        (the logger's close leaves its files tidy); else at the next row group (an unfinished merge is dropped,
        nothing half-committed)."""
        if finish:
            self._finishing = True
        else:
            self._stop.set()
        self._due.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._stop.is_set():
                return
            if self._finishing:
                if self._commits:
                    self._round()
                return
            self._commits = 0
            self._round()

    def _round(self) -> None:
        """Merge until nothing is left to merge: ``fanin`` units just merged may complete a class above."""
        try:
            while not self._stop.is_set():
                result = compact_rank(self.files.store, self.files.run_dir, self.files.rank, self.files.snapshot,
                                      lambda records: self.files.save(**{S.COMPACTED_KEY: records}), full=False,
                                      fanin=self.every, row_group_size=self.row_group_size, fsync=self.fsync,
                                      delete_after_s=self.delete_after_s, stop=self._stop,
                                      lock=self.files.folder_lock)
                self.rounds += 1
                self.results = [*self.results[-9:], result]
                if result.warnings:
                    self._error = CompactionError("; ".join(result.warnings[:3]))
                if not result.merged:
                    return
        except Exception as err:  # the log is as it was; the training thread hears of it
            self._error = err


# ------------------------------------------------------------------------------------------------ logs written


def compact_logdir(location: str | os.PathLike, *, grace_s: float = 5.0, force: bool = False,
                   max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES, row_group_size: int = ROW_GROUP_SIZE,
                   storage_options: dict | None = None,
                   echo: Callable[[str], None] = lambda line: None) -> list[RankResult]:
    """Compact every rank of every run under ``location`` (a log directory, one run directory, or an ``s3://``
    prefix) as far as the bounds allow; returns what was done per rank.

    A local rank is compacted under its lock (:class:`trustscope.logger.runfiles.RunLock`): a rank a live logger
    writes is skipped (said through ``echo``; that logger compacts its own files with ``compact_every``). Object
    stores have no locks: a rank whose manifest reads ``running`` is skipped unless ``force``. The files a
    compaction supersedes are deleted ``grace_s`` seconds after the last commit, for readers that listed them just
    before; files an earlier compaction left are deleted at once. Raises :class:`CompactionError` naming the path.
    """
    from trustscope import storage
    from trustscope.logger.errors import LogDirError
    from trustscope.logger.runfiles import RunLock, rank_file, read_json
    from trustscope.schema import SchemaError

    if storage.is_remote(location):
        store: Any = storage.ObjectStore(str(location), storage_options)
        runs = [PurePosixPath(r) for r in storage._remote_runs(store.fsspec, str(store.logdir))]
    else:
        store = storage.LocalStore(location)
        if not Path(location).is_dir():
            raise FileNotFoundError(f"{location} is not a directory")
        runs = S.run_dirs(Path(location))
    results: list[RankResult] = []
    locks = []
    last_commit = 0.0
    try:
        for run_dir in runs:
            ranks = [0, *sorted(int(n[4:-5]) for n in _listing(store, run_dir / S.RANKS_DIR)
                                if re.fullmatch(r"rank\d+\.json", n))]
            for rank in ranks:
                path = rank_file(run_dir, rank)
                if not store.exists(path):
                    continue
                if store.remote:
                    try:
                        manifest = read_json(path, store)
                    except SchemaError as err:
                        echo(f"{_where(store, run_dir)} rank {rank}: skipped, {err}")
                        continue
                    if manifest.get("status") == "running" and not force:
                        echo(f"{_where(store, run_dir)} rank {rank}: skipped, its manifest reads running (a live "
                             f"logger compacts its own files; --force if none writes it)")
                        continue
                    try:
                        for line in recover_rank(store, run_dir, rank, manifest):
                            echo(f"{_where(store, run_dir)} rank {rank}: {line}")
                    except OSError as err:
                        raise CompactionError(f"cannot recover {_where(store, run_dir)} rank {rank}: "
                                              f"{_why(err)}") from err
                else:
                    lock = RunLock(Path(run_dir), rank)
                    try:
                        lock.acquire(Path(run_dir).name, rank)
                    except LogDirError as err:
                        echo(f"{run_dir} rank {rank}: skipped, {err}")
                        continue
                    except OSError as err:
                        raise CompactionError(f"cannot lock {lock.path}: {_why(err)}") from err
                    locks.append(lock)
                    try:
                        manifest = read_json(path)
                        for line in recover_rank(store, run_dir, rank, manifest):
                            echo(f"{run_dir} rank {rank}: {line}")
                    except SchemaError as err:
                        echo(f"{run_dir} rank {rank}: skipped, {err}")
                        continue
                    except (OSError, CompactionError) as err:
                        raise CompactionError(f"cannot recover {run_dir} rank {rank}: {_why(err)}") from err

                def save(records: list[dict], path: Any = path, manifest: dict = manifest) -> None:
                    manifest[S.COMPACTED_KEY] = records
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


# ------------------------------------------------------------------------------------------------ cutting back


def flush_firsts(footers: list[pq.FileMetaData]) -> dict[int, tuple[int, list]]:
    """flush -> (its first step, its token counts) over the :data:`ORIGINALS_META` of one record's files' footers."""
    out: dict[int, tuple[int, list]] = {}
    for meta in footers:
        for entry in json.loads((meta.metadata or {}).get(ORIGINALS_META.encode(), b"[]")):
            flush, first, counts = entry[1], entry[2], entry[5:8]
            out[flush] = (min(first, out[flush][0]), out[flush][1]) if flush in out else (first, counts)
    return out


def cut_compacted(run_dir: Path, rank: int, record: dict, step: int, fsync: bool = True) -> tuple[dict | None, list[Path]]:
    """A local compacted record cut back to the flushes whose first step is at most ``step`` (what
    :func:`trustscope.logger.drop_steps_after` keeps of a run): the new record (None when no flush is kept) and
    the files written for it, under new names. A flush's rows are contiguous in a compacted file, so each file
    keeps a prefix of its rows. Nothing is deleted and no manifest written here."""
    paths = [run_dir / rel for rel in record["files"]]
    firsts = flush_firsts([pq.read_metadata(p) for p in paths])
    kept = sorted(f for f, (first, _) in firsts.items() if first <= step)
    if not kept:
        return None, []
    if len(kept) == len(firsts):
        return record, []
    keep = set(kept)
    new = {"flushes": [record["flushes"][0], kept[-1]], "files": [], "at": time.time()}
    written: list[Path] = []
    try:
        for path in paths:
            meta = pq.read_metadata(path)
            originals = json.loads((meta.metadata or {}).get(ORIGINALS_META.encode(), b"[]"))
            taken = [o for o in originals if o[1] in keep]
            if not taken:
                continue
            rows = sum(o[4] for o in taken)
            name = S.compacted_file_name(rank, min(o[2] for o in taken), max(o[3] for o in taken),
                                         (new["flushes"][0], new["flushes"][1]))
            final = path.parent / name
            tmp = S.tmp_path(final)
            with pq.ParquetFile(path) as source:
                footer = {k: v for k, v in (meta.metadata or {}).items()
                          if not k.startswith(_OWN_PREFIXES) and k not in (source.schema_arrow.metadata or {})}
                footer[SOURCES_META.encode()] = json.dumps([[path.name, rows]]).encode()
                footer[ORIGINALS_META.encode()] = json.dumps(taken).encode()
                table = S.table_of(path)
                left = rows
                with pq.ParquetWriter(tmp, source.schema_arrow, **S.WRITE_OPTIONS[table].writer_kwargs()) as out:
                    for g in range(source.num_row_groups):
                        if left <= 0:
                            break
                        data = source.read_row_group(g).slice(0, left)
                        out.write_table(data, row_group_size=max(1, data.num_rows))
                        left -= data.num_rows
                    out.add_key_value_metadata(footer)
            replace_file(tmp, final, fsync)
            written.append(final)
            new["files"].append(f"{path.parent.relative_to(run_dir).as_posix()}/{name}")
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return new, written


# ------------------------------------------------------------------------------------------------ repair


def repair_run(run_dir: str | os.PathLike) -> list[str]:
    """Remove what a killed writer or compaction left in a local run, and say what, one line each: the work
    :func:`recover_rank` finishes, the files of :func:`trustscope.schema.stray_files` that are provably
    superseded or orphaned, the temporary files of writers that are gone, and every superseded folder. A file
    the logger never writes (copied in by hand) is only named, never removed. Each rank is repaired under its
    lock: a rank a live logger writes is skipped (said)."""
    from trustscope.logger.errors import LogDirError
    from trustscope.logger.runfiles import RunLock, rank_file, read_json
    from trustscope.schema import SchemaError
    from trustscope.storage import LocalStore

    run_dir = Path(run_dir)
    store = LocalStore(run_dir.parent)
    said: list[str] = []
    ranks = [0, *sorted(int(n[4:-5]) for n in _listing(store, run_dir / S.RANKS_DIR)
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
            said += [f"rank {rank}: removed {n} superseded file(s) under {run_dir / S.SUPERSEDED_DIR}"
                     for n in [drop_superseded(run_dir, rank)] if n]
            prefix = f"{S.TMP_PREFIX}r{rank:04d}-"
            for table in S.TABLES:
                for folder in [run_dir / table, *(run_dir / table).glob("r[0-9]*")]:
                    for name in _listing(store, folder):
                        if name.startswith(prefix) and name.endswith(S.TMP_SUFFIX):
                            (folder / name).unlink(missing_ok=True)
                            said.append(f"rank {rank}: removed {folder / name} (a temporary file of a writer "
                                        f"that is gone)")
        mine = {rank for rank, _ in held}
        for stray in S.stray_files(run_dir):
            name = S.parse_data_file(stray.path.name)
            if not stray.removable or name is None or name.rank not in mine:
                said.append(f"kept {stray.path}: {stray.why}")
                continue
            stray.path.unlink(missing_ok=True)
            said.append(f"removed {stray.path}: {stray.why}")
    finally:
        for _, lock in held:
            lock.release()
    return said
