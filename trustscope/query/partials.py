"""The kept aggregates: per tokens file, every partial view's rows, computed once and kept (the cold pass).

The overview and every per-step analysis merge these rows instead of reading the tokens, so they cost the same at
100M tokens as at 1M. A file's rows of a view are computed when a query first reads that view with the file in
the log (the views a query reads together from one pass; in memory, and on disk under the cache folder keyed by
the SQL, the parameters and the file's path, size and modification time, so a new process does not compute them
again): `trustscope report` reads the clipped tokens alone, so its cold pass leaves the other views to the first
query that reads them. The pass itself runs here (:class:`LocalAggregator`) or as Ray tasks
(:class:`trustscope.distributed.RayAggregator`), both behind :class:`Aggregator`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import runformat
from trustscope.query.catalogue import CACHED_PARTIALS, PARTIAL_WORDS, quote, render_rule_blocks, sql_rules
from trustscope.query.rules import bindable
from trustscope.query.runs import footer

P = TypeVar("P", Path, str)

BATCH_ROWS = 8_000_000
"""Token rows the cold pass aggregates in one query (see :func:`batch_flushes`): fewer, larger queries, at a few
hundred MB of DuckDB memory (measured in ``docs/performance.md``)."""


@dataclass(frozen=True)
class Variant:
    """How the cold pass reads ``rule_blocks`` for some files: ``sql``, the view with the rules whose logged
    ``blocked_rules`` bits hold read from those bits, and ``windows``: whether a sequence rule is still evaluated
    in SQL (its windows sort every row: computed once, the rows are worth materialising)."""

    sql: str
    windows: bool


def stored_variant(stored: Mapping[str, int]) -> Variant:
    """The :class:`Variant` reading the ``stored`` rules' bits (rule -> bit). Without windows, each partial view
    reading the tokens again costs less than materialising every column per token (``docs/performance.md``)."""
    windows = any(rule.sql.sequence and rule.name not in stored for rule in sql_rules())
    return Variant(render_rule_blocks(stored), windows)


def stored_rule_bits(files: Sequence[Path], rules: Mapping[str, dict[str, Any]]) -> dict[str, int]:
    """The rules whose ``blocked_rules`` bit (rule -> bit) the cold pass may read instead of evaluating the rule,
    for ``files`` (the parts of one flush, one run) and ``rules``, the parameters the views bind for that run (rule
    -> bindable parameters, see :meth:`LogDB._run_rule_sets`).

    A rule qualifies when every file's footer lists it (:data:`trustscope.runformat.layout.BLOCKED_RULES_META`) at the same
    bit and at exactly the bound parameters, and no row of any file lacks the bits (the column's statistics count
    no nulls). Anything else (files written before the column, by ``summaries=False``, from another rule list, a
    run that trained its rule at other parameters, a caller's counterfactual parameters) leaves the rule to its SQL.
    """
    common: dict[str, int] | None = None
    for f in files:
        meta = footer(f)
        if isinstance(meta, str):
            return {}
        listed = (meta.metadata or {}).get(runformat.BLOCKED_RULES_META.encode())
        names = meta.schema.to_arrow_schema().names
        if listed is None or "blocked_rules" not in names:
            return {}
        column = names.index("blocked_rules")
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            if stats is None or stats.null_count != 0:
                return {}
        try:
            entries = json.loads(listed)
        except ValueError:
            return {}
        here = {name: bit for bit, (name, params) in enumerate(entries)
                if name in rules and isinstance(params, dict) and bindable(params) == rules[name]}
        common = here if common is None else {k: v for k, v in common.items() if here.get(k) == v}
    return common or {}


def aggregate_partials(cur: duckdb.DuckDBPyConnection, files: Sequence[str],
                       variant: Variant | None = None, views: Sequence[str] | None = None) -> list[dict[str, pa.Table]]:
    """Every partial view's rows (or those of ``views``, partial view names) for each of ``files``, the tokens
    files ``cur`` has bound (one query of :func:`batch_flushes`: the parts of one flush, or flushes that read the
    same stored bits), from one pass.

    Materialises ``rule_blocks`` (every rule's flag, the sequence rules' windows computed once), only the columns
    the partial views read, into a temporary table of the same name; DuckDB finds the temporary table before the
    view, so each partial view then reads those rows instead of recomputing the metrics and the sequence windows
    once per partial view. A flush's parts go through together: the logger's encoders split a flush by row
    groups, so one response may lie in two parts, and its context (length, mean log-ratio, prefix sums) must see
    all of its tokens; every partial view groups by ``source_file``, so its rows are then split by file. Shared by
    the local pass and the Ray tasks (:mod:`trustscope.distributed`). ``variant``: the files' :func:`stored_variant`
    (the same columns, the logger's bits read for some rules), read instead of the view, as a temporary table or,
    when it needs no windows, a temporary view.
    """
    inputs = [quote(c) for c in cur.view("rule_blocks").columns if c in PARTIAL_WORDS or c.startswith("blocks_")]
    source, kind = ("rule_blocks", "table") if variant is None else (f"({variant.sql})", "table" if variant.windows else "view")
    cur.execute(f"create temp {kind} rule_blocks as select {', '.join(inputs)} from {source}")
    tables = {view: split_by_file(cur.view(view).to_arrow_table(), files) for view in CACHED_PARTIALS
              if views is None or view in views}
    return [{view: by_file[f] for view, by_file in tables.items()} for f in files]


def split_by_file(table: pa.Table, files: Sequence[str]) -> dict[str, pa.Table]:
    """``table``'s rows per ``source_file``, one for each of ``files`` (empty where it has none): one sort and
    zero-copy slices, not a filter per file."""
    import pyarrow.compute as pc

    if len(files) == 1:
        return {files[0]: table}
    codes = pc.dictionary_encode(table["source_file"].combine_chunks())
    ordered = table.take(pc.sort_indices(codes.indices))  # a stable sort: by file, rows in their order
    counted = pc.value_counts(codes.indices)
    counts = dict(zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True))
    by_name, start = {}, 0
    for code, name in enumerate(codes.dictionary.to_pylist()):
        by_name[name] = ordered.slice(start, counts.get(code, 0))
        start += counts.get(code, 0)
    return {f: by_name.get(f, table.slice(0, 0)) for f in files}


def batch_flushes(flushes: Sequence[list[P]], variants: Sequence[Variant | None]) -> list[tuple[list[P], Variant | None]]:
    """The cold pass's queries: ``(files, variant)``, flushes of one variant together, up to :data:`BATCH_ROWS`
    rows a query. A flush's parts always go together (see :func:`aggregate_partials`). Where the variant needs the
    windows (no stored bits, or a sequence rule left to SQL), a query holds flushes whose responses cannot meet in
    one window: a window is a response, ``(run_id, step, rank, sample_id)``, so flushes of one rank and run with
    overlapping steps go to different queries (:func:`flush_steps`)."""
    out: list[tuple[list[P], Variant | None]] = []
    open_batches: dict[Variant | None, tuple[list[P], int, dict[tuple[str, int], list[tuple[int, int]]]]] = {}
    for flush, variant in zip(flushes, variants, strict=True):
        rows = sum(0 if isinstance(meta := footer(f), str) else meta.num_rows for f in flush)
        files, have, steps = open_batches.get(variant, ([], 0, {}))
        windows = variant is None or variant.windows
        span = flush_steps(flush[0]) if windows else None
        if windows and span is None:
            out.append((list(flush), variant))  # a name without its steps: alone, as it always was
            continue
        clash = span is not None and any(lo <= span[2] and span[1] <= hi for lo, hi in steps.get(span[0], ()))
        if files and (have + rows > BATCH_ROWS or clash):
            out.append((files, variant))
            files, have, steps = [], 0, {}
        if span is not None:
            steps = {**steps, span[0]: [*steps.get(span[0], []), (span[1], span[2])]}
        open_batches[variant] = ([*files, *flush], have + rows, steps)
    out += [(files, variant) for variant, (files, _, _) in open_batches.items()]
    return out


_FLUSH_NAME = re.compile(r"r(\d+)-s(\d+)-(\d+)-[fc]\d+")


def flush_steps(file: Path | str) -> tuple[tuple[str, int], int, int] | None:
    """((run directory, rank), first step, last step) of a data file, from its name (``r<rank>-s<first>-<last>-
    f<flush>...``, or ``-c<flushes>`` for a compacted file), or None for a name that does not say."""
    path = Path(file)
    match = _FLUSH_NAME.match(path.name)
    if match is None:
        return None
    from trustscope.runformat.layout import run_of

    return (str(run_of(path)), int(match.group(1))), int(match.group(2)), int(match.group(3))


def flush_of(file: Path | str) -> tuple[str, str]:
    """The flush a data file belongs to: its directory and its name without the part suffix (``-p<part>``)."""
    path = Path(file)
    return str(path.parent), re.sub(r"-p\d+(?=\.parquet$)", "", path.name)


def flush_groups(files: Sequence[Path]) -> list[list[Path]]:
    """``files`` grouped by flush (:func:`flush_of`), in the order each flush first appears."""
    groups: dict[tuple[str, str], list[Path]] = {}
    for f in files:
        groups.setdefault(flush_of(f), []).append(f)
    return list(groups.values())


class Aggregator(Protocol):
    """Runs the cold pass over some tokens files: ``(file, every partial view's rows)`` for each, in any order.
    ``variants``: per flush (its first file's path, as text), the :class:`Variant` it reads; ``views``: only these
    partial views (None: all)."""

    def aggregate(self, files: Sequence[Path], *, rule_blocks: str, fingerprint: str, params: dict[str, Any],
                  variants: dict[str, Variant], views: Sequence[str] | None = None
                  ) -> Iterator[tuple[Path, dict[str, pa.Table]]]: ...


class LocalAggregator:
    """The cold pass here, one query per batch of flushes (:func:`batch_flushes`). ``cursor_for(files)`` gives a
    cursor with everything bound and only ``files`` in its tokens list."""

    def __init__(self, cursor_for: Callable[[Sequence[Path]], duckdb.DuckDBPyConnection]) -> None:
        self.cursor_for = cursor_for

    def aggregate(self, files: Sequence[Path], *, variants: dict[str, Variant], views: Sequence[str] | None = None,
                  **_: Any) -> Iterator[tuple[Path, dict[str, pa.Table]]]:
        flushes = flush_groups(files)
        for batch, variant in batch_flushes(flushes, [variants.get(str(f[0])) for f in flushes]):
            cur = self.cursor_for(batch)
            try:
                yield from zip(batch, aggregate_partials(cur, [str(f) for f in batch], variant, views), strict=True)
            finally:
                cur.close()


def compacted_sources(file: Path) -> list[str]:
    """The names of the files a compacted tokens file replaced, in its row order (none for a flush file)."""
    from trustscope.runformat.footers import SOURCES_META

    meta = footer(file)
    listed = None if isinstance(meta, str) else (meta.metadata or {}).get(SOURCES_META.encode())
    try:
        return [name for name, _ in json.loads(listed)] if listed else []
    except (TypeError, ValueError):
        return []


StatKey = tuple[int, int]
"""A file's size and modification time: what its kept rows are valid for."""


class KeptAggregates:
    """Every partial view's rows per tokens file, in memory and (with ``cache_dir``) on disk, and their merge: the
    tables the views read as :data:`~trustscope.query.catalogue.CACHED_PARTIALS`' names.

    ``enabled`` False recomputes every file at every update (nothing is reused, in memory or on disk).
    """

    def __init__(self, cache_dir: Path | None, enabled: bool = True) -> None:
        self.cache_dir = cache_dir if enabled else None
        self.enabled = enabled
        self.rows: dict[str, dict[Path, tuple[StatKey, pa.Table]]] = {v: {} for v in CACHED_PARTIALS}
        self.merged: dict[str, pa.Table] = {}
        """Kept aggregate name -> every file's rows, concatenated (what the views read)."""
        self.merged_files: list[Path] | None = None
        self.computed = 0
        """How many (tokens file, partial view) rows were aggregated (found neither in memory nor on disk): each
        file counts once per view a query read."""
        self.merged_from_sources = 0
        """How many compacted files took their rows from the rows kept of the files they replaced."""
        self._stores = _Stores() if self.cache_dir is not None else None

    def update(self, files: Sequence[Path],
               aggregate: Callable[[list[Path], list[str]], Iterator[tuple[Path, dict[str, pa.Table]]]],
               disk_key: Callable[[Path], str], views: Iterable[str] | None = None) -> bool:
        """Bring the rows of ``views`` (partial view names; None: every one) up to date with ``files``: drop files
        that are gone, read what is kept on disk, ``aggregate(files, views)`` the flushes of the files that still
        miss one of them (their parts together), then merge. A view left out stays as it was until a query reads
        it (a report reads one of the three: the cold pass computes that one alone). Returns whether the merged
        tables changed. ``disk_key(file)``: what else the rows depend on (the SQL, the bound parameters of the
        file's run)."""
        wanted = [v for v in CACHED_PARTIALS if views is None or v in views]
        changed = False
        current = {}
        for f in files:
            st = f.stat()
            current[f] = (st.st_size, st.st_mtime_ns)
        missing = {}
        for f, key in current.items():
            views = [v for v in wanted if not self.enabled or f not in self.rows[v] or self.rows[v][f][0] != key]
            if views:
                missing[f] = views
        changed = changed or bool(missing)
        if self.cache_dir is not None:
            self._read_stored(missing, current, disk_key)
        todo = []
        for f, views in missing.items():
            if views:
                self._merge_sources(f, current[f], disk_key, views)
            if views:
                todo.append(f)
        for kept in self.rows.values():  # after the merges, which read the rows of the files a compaction replaced
            for gone in set(kept) - set(current):
                del kept[gone]
                changed = True
        flushes = {flush_of(f) for f in todo}  # a flush's parts are aggregated together (see aggregate_partials)
        computing = sorted({v for f in todo for v in missing[f]}, key=list(CACHED_PARTIALS).index)
        for f, tables in aggregate([f for f in current if flush_of(f) in flushes], computing):
            self.computed += len(tables)
            prefix = disk_key(f) if self.cache_dir is not None else ""
            for view, table in tables.items():
                self.rows[view][f] = (current[f], table)
                if self._stores is not None:
                    self._stores.put(self._disk_path(prefix, view, f, current[f]), table)
        files = list(current)
        if not changed and self.merged_files == files:
            return False  # the merged tables stay the same objects (the SQL worker rewrites only what changed)
        self.merged_files = files
        for view, cache_name in CACHED_PARTIALS.items():
            empty = pa.Table.from_batches([], schema=self.merged[cache_name].schema)  # (empty_table imports pandas)
            parts = [self.rows[view][f][1] for f in files if f in self.rows[view]]
            self.merged[cache_name] = pa.concat_tables([empty, *parts], promote_options="permissive") if parts else empty
        return True

    def _read_stored(self, missing: dict[Path, list[str]], current: dict[Path, StatKey],
                     disk_key: Callable[[Path], str]) -> None:
        """Take what the disk keeps of the ``missing`` views' rows, removing each view found from ``missing``.
        The copies are read on a few threads (a Parquet read releases the GIL): a log of many files has one copy
        per file and view, read one after another in 1.4 ms each."""
        stored = []
        for f, views in missing.items():
            prefix = disk_key(f)
            stored += [(f, view, path) for view in views
                       if (path := self._disk_path(prefix, view, f, current[f])).is_file()]
        if not stored:
            return

        def read(item: tuple[Path, str, Path]) -> pa.Table | None:
            try:
                return pq.ParquetFile(item[2]).read()  # not read_table: it imports pandas
            except (OSError, pa.ArrowException):  # gone or cut short since it was listed: computed again
                return None

        with ThreadPoolExecutor(min(4, len(stored)), thread_name_prefix="trustscope-kept-read") as pool:
            for (f, view, _), table in zip(stored, pool.map(read, stored), strict=True):
                if table is not None:
                    self.rows[view][f] = (current[f], table)
                    missing[f].remove(view)

    def _merge_sources(self, file: Path, key: StatKey, disk_key: Callable[[Path], str], views: list[str]) -> None:
        """A compacted file's rows of ``views`` from the rows kept of the files it replaced (its footer lists them,
        :data:`~trustscope.runformat.footers.SOURCES_META`), relabelled with its name: every partial view's rows
        are mergeable (counts, sums, extremes by key), so the rows of the sources, together, are the file's own.
        Each view merged is removed from ``views``; a view whose sources' rows are not all kept here stays (the
        file is then aggregated for it)."""
        if not self.enabled:
            return
        sources = compacted_sources(file)
        if not sources:
            return
        prefix = disk_key(file) if self.cache_dir is not None else ""
        merged = False
        for view in list(views):
            kept = self.rows[view]
            if not all(file.parent / s in kept for s in sources):
                continue
            table = pa.concat_tables([kept[file.parent / s][1] for s in sources])
            column = table.schema.get_field_index("source_file")
            labels = pa.array([str(file)] * table.num_rows, type=table.schema.field(column).type)
            kept[file] = (key, table.set_column(column, "source_file", labels))
            if self._stores is not None:
                self._stores.put(self._disk_path(prefix, view, file, key), kept[file][1])
            views.remove(view)
            merged = True
        self.merged_from_sources += merged

    def flush(self) -> None:
        """Wait until every kept row handed to the disk is written (the connection's close, and exit, call it)."""
        if self._stores is not None:
            self._stores.drain()

    def _disk_path(self, prefix: str, view: str, file: Path, stat_key: StatKey) -> Path:
        key = hashlib.sha256(json.dumps([prefix, view, str(file), stat_key]).encode()).hexdigest()[:32]
        return self.cache_dir / view / f"{key}.parquet"


class _Stores:
    """The disk's copies of kept rows, written on a background thread: the rows are in memory at once, and a first
    pass does not wait on a Parquet file per tokens file and view (1.9 ms each; 192 of them were a third of the
    first pass over 64 compacted files). The thread ends when nothing is left to write. :meth:`drain` waits for
    the writes; it runs at exit too (:func:`_drain_all`), so a short-lived command leaves its rows on disk for the
    next."""

    def __init__(self) -> None:
        self._queue: list[tuple[Path, pa.Table]] = []
        self._lock = threading.Condition()
        self._writing = False

    def put(self, path: Path, table: pa.Table) -> None:
        with self._lock:
            self._queue.append((path, table))
            if not self._writing:
                self._writing = True
                _LIVE_STORES.add(self)
                threading.Thread(target=self._run, name="trustscope-kept-rows", daemon=True).start()

    def drain(self) -> None:
        with self._lock:
            while self._writing:
                self._lock.wait()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._writing = False
                    self._lock.notify_all()
                    return
                path, table = self._queue.pop(0)
            with contextlib.suppress(Exception):  # a copy that cannot be written is only a slower next start
                _store(path, table)


_LIVE_STORES: weakref.WeakSet[_Stores] = weakref.WeakSet()


@atexit.register
def _drain_all() -> None:
    for stores in list(_LIVE_STORES):
        stores.drain()


def _forget_in_child() -> None:
    """A forked child (the SQL worker) has no writer thread: it neither waits for its parent's writes nor makes
    them."""
    for stores in list(_LIVE_STORES):
        stores.__init__()
    _LIVE_STORES.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _store(path: Path, table: pa.Table) -> None:
    """Write atomically (temporary name, then rename); a cache that cannot be written is only slower.

    LZ4 without dictionaries or statistics: the partials are wide (four columns per rule) and read whole, so what
    those buy is size nobody needs (measured in ``docs/performance.md``)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        pq.write_table(table, tmp, compression="lz4", use_dictionary=False, write_statistics=False)
        tmp.replace(path)
    except OSError:
        pass
