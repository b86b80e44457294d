"""Compaction: a rank's many small committed files rewritten as a few large ones, inside the manifest design.

The logger writes one file per table per rank per flush, and real runs flush every step, so a run holds thousands
of small files and every reader pays per file (listing, footers, one DuckDB scan per file, one kept aggregate per
file). Compaction rewrites consecutive committed flushes of one rank into one file per table (bounded by
:data:`MAX_ROWS` rows and :data:`MAX_BYTES` bytes), with the logger's encodings (:data:`trustscope.schema.WRITE_OPTIONS`)
and row groups, and commits it as the logger commits a flush: one atomic write of the rank's manifest adds a record
``{"flushes": [first, last], "files": [...], "at": ...}`` (:data:`trustscope.schema.COMPACTED_KEY`). From that write
on, readers (:func:`trustscope.schema.committed_files`) read the listed files instead of every flush file in the
range; before it, they read the sources. The sources are deleted only after the commit, and only
``delete_after_s`` later, so a reader that listed them just before still finds them; a process killed anywhere in
between leaves files that no reader sees, which the next compaction (or the logger's resume) removes.

Files are merged only when their footers agree (the Arrow schema and every key but the flush's own counts): tokens
files written with different ``blocked_rules`` rule lists, or before that column existed, are never merged
together. A compacted file's footer keeps the metadata its sources agree on and adds :data:`SOURCES_META` (the
files it replaced, with their rows, in the order of its rows) and :data:`ORIGINALS_META` (every flush file it holds
rows of, with its flush, steps, rows and token counts), so the query layer can merge the kept aggregates of the
sources instead of recomputing them, and a run can still be cut back at a step (:func:`trustscope.logger.drop_steps_after`).

Two ways to run it: :class:`BackgroundCompactor`, the logger's own thread (``TokenLogger(compact_every=N)``), which
merges ``N`` consecutive units of the same size class at a time (an LSM-style tiering: each row is rewritten about
``log_N(flushes)`` times); and :func:`compact_logdir` (``trustscope compact``), which merges everything it can for
logs already written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import schema as S
from trustscope.storage import RunStore, replace_file

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
"""Seconds a superseded file is kept after the commit that superseded it, for readers that listed it before."""
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
    superseded: list[Any] = field(default_factory=list)
    """Paths no reader sees any more, still on storage (deleted later, see ``delete_after_s``)."""
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


def _footer(store: RunStore, path: Any) -> pq.FileMetaData:
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


def _units(rank: int, mark: Any, records: list[dict], listing: dict[str, dict[str, int]]) -> list[_Unit]:
    """The rank's committed flushes (up to ``mark``) not yet compacted, and its compacted ``records``, in flush
    order."""
    ranges = sorted((r["flushes"][0], r["flushes"][1]) for r in records)
    flushes: dict[int, list[_File]] = {}
    by_rel: dict[str, _File] = {}
    for table, names in listing.items():
        for name, size in names.items():
            parsed = S.parse_data_file(name)
            if parsed is None or parsed.rank != rank or name.startswith(S.TMP_PREFIX):
                continue
            f = _File(table, name, size, parsed)
            if parsed.compacted is not None:
                by_rel[f"{table}/{name}"] = f
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
        meta = unit.metas[f"{f.table}/{f.name}"] = _footer(store, run_dir / f.table / f.name)
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
                parts = [stack.enter_context(_opened(store, run_dir / table / f.name, metas[f.name]))
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
           stop: threading.Event | None) -> tuple[dict, list[Any]]:
    """Write the group's compacted files under their final names (not yet visible: no manifest lists them);
    returns the manifest record and the files written. On any failure, what was written is removed."""
    lo, hi = group[0].lo, group[-1].hi
    record: dict[str, Any] = {"flushes": [lo, hi], "files": []}
    published: list[Any] = []
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
            final = run_dir / table / name
            tmp = S.tmp_path(store.spool(run_dir / table) / name)
            try:
                footers = {k: v for unit in group for k, v in unit.metas.items()}
                _rewrite(store, run_dir, table, sources, footers, tmp, row_group_size, stop)
            except OSError as err:
                raise CompactionError(f"cannot write {_where(store, final)}: {_why(err)}") from err
            try:
                store.publish(tmp, final, fsync)
            except OSError as err:
                raise CompactionError(f"cannot write {_where(store, final)}: {_why(err)}") from err
            tmp = None
            published.append(final)
            record["files"].append(f"{table}/{name}")
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        for path in published:
            with contextlib.suppress(OSError):
                store.delete(path)
        raise
    return record, published


def _where(store: RunStore, path: Any) -> str:
    return store.url_of(path) if store.remote else str(path)


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------------------------ one rank


def _cleanup(store: RunStore, run_dir: Any, rank: int, records: list[dict], listing: dict[str, dict[str, int]],
             delete_after_s: float, now: float, result: RankResult) -> None:
    """Delete what no reader sees and none will: a killed compaction's temporary and unlisted files at once, files
    superseded by a record once ``delete_after_s`` passed since its commit. Failures are warnings (retried at the
    next compaction; readers never see these files)."""
    listed = {rel for r in records for rel in r["files"]}
    spans = [(r["flushes"][0], r["flushes"][1], float(r.get("at") or 0.0)) for r in records]

    def superseded_at(lo: int, hi: int) -> float | None:
        return next((at for a, b, at in spans if a <= lo and hi <= b), None)

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
                    if f"{table}/{name}" in listed:
                        continue
                    at = superseded_at(*parsed.compacted)
                    old = at is None or now - at >= delete_after_s
                elif parsed.flush is not None:
                    at = superseded_at(parsed.flush, parsed.flush)
                    old = at is not None and now - at >= delete_after_s
                else:
                    old = False
            if not old:
                continue
            path = run_dir / table / name
            try:
                store.delete(path)
            except OSError as err:
                result.warnings.append(f"cannot delete {_where(store, path)}: {_why(err)}")
                continue
            del names[name]
            result.deleted += 1


def compact_rank(store: RunStore, run_dir: Any, rank: int, manifest: dict, save: Callable[[list[dict]], None], *,
                 full: bool, fanin: int = FANIN, max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES,
                 row_group_size: int = ROW_GROUP_SIZE, fsync: bool = True, delete_after_s: float = DELETE_AFTER_S,
                 stop: threading.Event | None = None) -> RankResult:
    """Compact the committed files of one rank (see :func:`plan`); ``manifest`` is the rank's manifest as last
    written, ``save(records)`` writes it with :data:`trustscope.schema.COMPACTED_KEY` replaced, atomically (the
    commit). The caller holds the rank: nobody else writes its manifest meanwhile.

    Each merged group is committed on its own (a compaction stopped or killed halfway keeps the groups committed
    so far). Superseded files are deleted ``delete_after_s`` after their commit, by a later call (``0``: at once).
    Raises :class:`CompactionError` naming the path when a file or the manifest cannot be written; what this call
    wrote is then removed and the log reads as before.
    """
    started = time.perf_counter()
    result = RankResult(str(run_dir), rank)
    records = [dict(r) for r in S.compaction_records(manifest)]
    try:
        listing = {t: _listing(store, run_dir / t) for t in S.TABLES}
    except OSError as err:
        raise CompactionError(f"cannot list {_where(store, run_dir)}: {_why(err)}") from err
    _cleanup(store, run_dir, rank, records, listing, delete_after_s, time.time(), result)
    units = _units(rank, manifest.get("committed_flush"), records, listing)
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
        try:
            record, written = _merge(store, run_dir, rank, group, row_group_size, fsync, stop)
        except Stopped:
            break
        record["at"] = time.time()
        replaced = {id(u.record) for u in group if u.record is not None}
        updated = sorted([r for r in records if id(r) not in replaced] + [record], key=lambda r: r["flushes"][0])
        try:
            save(updated)
        except OSError as err:
            for path in written:
                with contextlib.suppress(OSError):
                    store.delete(path)
            raise CompactionError(f"cannot write the manifest of {_where(store, run_dir)} rank {rank}: "
                                  f"{_why(err)}") from err
        records = updated
        sources = [run_dir / f.table / f.name for u in group for f in u.files]
        after += len(written) - len(sources)
        result.merged.append((record["flushes"][0], record["flushes"][1]))
        if delete_after_s <= 0:
            for path in sources:
                try:
                    store.delete(path)
                    result.deleted += 1
                except OSError as err:
                    result.warnings.append(f"cannot delete {_where(store, path)}: {_why(err)}")
        else:
            result.superseded += sources
    result.files_after = after
    result.seconds = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------------ the logger


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
                result = compact_rank(self.files.store, self.files.run_dir, self.files.rank, self.files.snapshot(),
                                      lambda records: self.files.save(**{S.COMPACTED_KEY: records}), full=False,
                                      fanin=self.every, row_group_size=self.row_group_size, fsync=self.fsync,
                                      delete_after_s=self.delete_after_s, stop=self._stop)
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
                    except SchemaError as err:
                        echo(f"{run_dir} rank {rank}: skipped, {err}")
                        continue

                def save(records: list[dict], path: Any = path, manifest: dict = manifest) -> None:
                    manifest[S.COMPACTED_KEY] = records
                    store.write_atomic(path, json.dumps(manifest, indent=2, default=str))

                result = compact_rank(store, run_dir, rank, manifest, save, full=True, max_rows=max_rows,
                                      max_bytes=max_bytes, row_group_size=row_group_size, delete_after_s=grace_s)
                results.append(result)
                if result.merged:
                    last_commit = time.monotonic()
        pending = [p for r in results for p in r.superseded]
        if pending:
            time.sleep(max(0.0, last_commit + grace_s - time.monotonic()))
        for result in results:
            for path in result.superseded:
                try:
                    store.delete(path)
                    result.deleted += 1
                except OSError as err:
                    result.warnings.append(f"cannot delete {_where(store, path)}: {_why(err)}")
            result.superseded = []
    finally:
        for lock in locks:
            lock.release()
        store.close()
    return results


# ------------------------------------------------------------------------------------------------ cutting back


def flush_firsts(paths: list[Path]) -> dict[int, tuple[int, list]]:
    """flush -> (its first step, its token counts) over the :data:`ORIGINALS_META` of one record's files."""
    out: dict[int, tuple[int, list]] = {}
    for path in paths:
        for entry in json.loads((pq.read_metadata(path).metadata or {}).get(ORIGINALS_META.encode(), b"[]")):
            flush, first, counts = entry[1], entry[2], entry[5:8]
            out[flush] = (min(first, out[flush][0]), out[flush][1]) if flush in out else (first, counts)
    return out


def cut_compacted(run_dir: Path, rank: int, record: dict, step: int, fsync: bool = True) -> tuple[dict | None, list[Path]]:
    """A local compacted record cut back to the flushes whose first step is at most ``step`` (what
    :func:`trustscope.logger.drop_steps_after` keeps of a run): the new record (None when no flush is kept) and
    the files written for it, under new names. A flush's rows are contiguous in a compacted file, so each file
    keeps a prefix of its rows. Nothing is deleted and no manifest written here."""
    paths = [run_dir / rel for rel in record["files"]]
    firsts = flush_firsts(paths)
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
                table = path.parent.name
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
            new["files"].append(f"{table}/{name}")
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return new, written
