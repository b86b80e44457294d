"""A log directory as a locked-down DuckDB connection: :class:`LogDB` and :func:`connect`.

    db = connect("logs/")                    # a log directory, one run directory, or a list of either
    db = connect("s3://bucket/logs")         # an object store prefix (read through a local mirror)
    db.step_summary()                        # pandas DataFrame, one row per (run, step)
    db.sql("select rule, count(*) from clipped_tokens group by rule")   # read-only, row limit, timeout

Views read the runs' Parquet files that the logger has committed (listed afresh for every cursor), so a run that
is still being written shows every step whose flush is complete, in every table at once. The connection opens the
catalogue (:mod:`trustscope.query.catalogue`) read-only: nothing is bound until a query reads a view. Per-step
summaries come from the kept aggregates (:mod:`trustscope.query.partials`); the token-level views stay for
drill-down and ad-hoc SQL.

User SQL never runs on this connection: :meth:`LogDB.sql` checks its whole parse tree and runs it in the worker of
:mod:`trustscope.sandbox`, on the same read-only catalogue, in a process that can write no file, within a memory and
a time limit. This connection is locked down too (only the log directories readable, no extension loads, the
configuration locked). Parameters (file lists, the rules' parameters, analysis settings) are bound through DuckDB
variables, never formatted into SQL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import pyarrow as pa

from trustscope import runformat
from trustscope.paths import cache_root
from trustscope.query.analyses import NamedAnalyses
from trustscope.query.catalogue import (
    CACHED_PARTIALS,
    CATALOGUE_DIR,
    CONNECTION_CONFIG,
    QUERIES,
    QUERY_DIR,
    VIEWS,
    caches_read,
    catalogue_file,
    fingerprint,
    render_rule_blocks,
    words,
    write_empty_files,
)
from trustscope.query.partials import (
    Aggregator,
    KeptAggregates,
    LocalAggregator,
    Variant,
    flush_groups,
    stored_rule_bits,
    stored_variant,
)
from trustscope.query.rules import ANALYSIS_DEFAULTS, RuleBinding, load_rules, rule_parameters
from trustscope.query.runs import (
    check_run,
    data_files,
    in_words,
    listed,
    readable_dirs,
    run_dirs,
    run_problems,
)
from trustscope.sandbox import Sandbox, check_statement, memory_limit_bytes

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_MAX_ROWS = 10_000
"""Rows a user query may return before it is cut (the result says it was truncated)."""
DEFAULT_TIMEOUT_S = 30.0
"""Seconds a user query may run before it is interrupted."""


def default_cache_dir() -> Path:
    """The kept aggregates' folder: ``queries/`` under :func:`trustscope.paths.cache_root`."""
    return cache_root() / "queries"


@dataclass
class QueryResult:
    """Rows of a user query: ``table`` (at most ``max_rows`` rows) and whether rows were cut."""

    table: pa.Table
    truncated: bool
    max_rows: int

    def to_pandas(self) -> pd.DataFrame:
        return self.table.to_pandas()


class _Resources:
    """What a :class:`LogDB` must release even when it is never closed: the private folder and the worker.
    Held apart from the LogDB so that a finaliser can release it (see ``weakref.finalize`` in LogDB)."""

    def __init__(self, private: Path) -> None:
        self.private = private
        self.sandbox: Sandbox | None = None

    def release(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        shutil.rmtree(self.private, ignore_errors=True)


class LogDB(NamedAnalyses):
    """A DuckDB connection over one or many runs, with trustscope's macros, views and named analyses.

    Use :func:`connect`. Every method opens its own cursor, so one ``LogDB`` may serve several threads.
    """

    def __init__(self, paths: Sequence[Path | str], *, max_rows: int = DEFAULT_MAX_ROWS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache: bool = True,
                 cache_dir: Path | None = None, rule_params: dict[str, dict[str, Any]] | None = None,
                 memory_limit: float | None = None, storage_options: dict[str, Any] | None = None,
                 mirror_dir: Path | None = None, aggregator: Aggregator | None = None) -> None:
        self._private = Path(tempfile.mkdtemp(prefix="trustscope-db-"))
        self._resources = _Resources(self._private)
        self._finalizer = weakref.finalize(self, self._resources.release)
        self.mirror_dir = mirror_dir or (runformat.default_mirror_root() if cache else self._private / "s3")
        """Where ``s3://`` paths are mirrored (see :func:`trustscope.runformat.mirrors.mirror`)."""
        self._stores = [runformat.ObjectStore(str(p), storage_options, write=False)
                        for p in paths if runformat.is_remote(p)]
        """The object store prefixes among ``paths``, mirrored again at every refresh."""
        mirrors = iter(self._sync_mirrors())
        self.paths = [(next(mirrors) if runformat.is_remote(p) else Path(p)).resolve() for p in paths]
        self.rule_params = rule_parameters(rule_params)
        """Parameters of every rule where a run did not train with it: the defaults, or the caller's choice."""
        self.binding = RuleBinding(self.rule_params)
        self._rule_blocks = render_rule_blocks()
        """The ``rule_blocks`` view with one column per rule of the catalogue (the SQL worker reads it too)."""
        self._fingerprint = fingerprint(self._rule_blocks)
        self.max_rows = max_rows
        self.timeout_s = timeout_s
        self.memory_bytes = memory_limit_bytes(memory_limit)
        """Resident memory user SQL may use (see :func:`trustscope.sandbox.memory_limit_bytes`)."""
        self.broken_runs: dict[str, str] = {}
        """Runs that cannot be read whole: run directory name -> why (:func:`~trustscope.query.runs.run_problems`:
        a manifest that is not JSON, data files whose Parquet footer does not read; a symlinked run created after
        the connection). What still reads of such a run is shown (its unreadable files are left out of every
        view); the other runs are unaffected."""
        self.cache_enabled = cache
        self.cache_dir = (cache_dir or default_cache_dir()) if cache else None
        self.kept = KeptAggregates(self.cache_dir, enabled=cache)
        """The kept aggregates of every tokens file seen (see :class:`~trustscope.query.partials.KeptAggregates`)."""
        self.stored_bits_files = 0
        """How many tokens files aggregated here read some rules' blocks from the logger's ``blocked_rules`` bits."""
        self.ray = aggregator
        """The Ray cluster the cold pass runs on (:class:`trustscope.distributed.RayAggregator`), or None: here."""
        self.aggregator: Aggregator = aggregator or LocalAggregator(self._cursor_for)
        """Where the cold pass runs."""
        self._lock = threading.Lock()
        self._cache_files: dict[str, tuple[pa.Table, int, str]] = {}
        """Kept aggregate name -> (the table last written for the SQL worker, its version, its file)."""
        self._late_links: dict[str, str] = {}
        self._unreadable: dict[Path, str] = {}
        """Committed data files whose Parquet footer does not read, left out of every file list."""
        write_empty_files(self._private)
        self.runs_dirs = run_dirs(self.paths)
        self.catalogue = self._catalogue()
        """The read-only DuckDB file of the macros and views this connection (and its SQL worker) opens."""
        self.con = duckdb.connect(str(self.catalogue), read_only=True, config=CONNECTION_CONFIG)
        self.kept.merged = {name: self.con.table(name).to_arrow_table() for name in CACHED_PARTIALS.values()}
        self._prepare(self.con)
        self._lock_down()

    @property
    def partials_computed(self) -> int:
        """How many (tokens file, partial view) rows this connection aggregated (found neither in memory nor on
        disk): a file counts once for each partial view a query read."""
        return self.kept.computed

    @property
    def _merged(self) -> dict[str, pa.Table]:
        return self.kept.merged

    def _catalogue(self) -> Path:
        """This connection's catalogue file: a link to (or a copy of) the one built beside the SQL files it is built
        from (``sql/__catalogue__/``, as Python keeps its bytecode), or in the cache folder where the package
        cannot be written, shared by every process; built in the private folder when neither can be. A path of
        its own, because DuckDB keeps one database instance per path in a process, and each connection locks its
        own configuration (its readable directories)."""
        params = self._params()
        shared = None
        for folder in (CATALOGUE_DIR, *([self.cache_dir / "catalogue"] if self.cache_dir is not None else [])):
            with contextlib.suppress(OSError, duckdb.IOException):
                shared = catalogue_file(self._rule_blocks, params, folder)
                break
        if shared is None:
            return catalogue_file(self._rule_blocks, params, self._private / "catalogue")
        own = self._private / shared.name
        try:
            os.link(shared, own)
        except OSError:
            shutil.copyfile(shared, own)
        return own

    def _sync_mirrors(self) -> list[Path]:
        """Bring the local mirror of every object store path up to date (raises StorageError naming the URL)."""
        return [runformat.mirror(store.url, self.mirror_dir, store=store) for store in self._stores]

    def _file_lists(self) -> dict[str, list[str]]:
        """The files of each table a reader should see (committed flushes only, see :func:`runformat.committed_files`).
        A run with a listed file gone by the time it is checked is listed once more: a compaction committed in
        between and deleted the files it replaced (after its grace period), which is no damage."""
        lists: dict[str, list[str]] = {}
        committed = {run: runformat.committed_files(run) for run in self.runs_dirs}
        checked = {run: check_run(run, files) for run, files in committed.items()}
        for run, (_, bad) in list(checked.items()):
            if any(not f.exists() for f in bad):
                committed[run] = runformat.committed_files(run)
                checked[run] = check_run(run, committed[run])
        self._unreadable = {f: problem for _, bad in checked.values() for f, problem in bad.items()}
        problems = {run.name: listed(*found) for run, found in checked.items()}
        for table in runformat.TABLES:
            files = [str(f) for run_files in committed.values() for f in run_files[table] if f not in self._unreadable]
            lists[table] = [str(self._private / f"empty_{table}.parquet"), *files]
        lists["vocab"] = [str(self._private / "empty_vocab.parquet")] + [
            str(run / runformat.VOCAB_FILE) for run in self.runs_dirs
            if (run / runformat.VOCAB_FILE).is_file() and run / runformat.VOCAB_FILE not in self._unreadable
        ]
        self.broken_runs = {**{run: in_words(found) for run, found in problems.items() if found}, **self._late_links}
        lists["manifests"] = [str(self._private / "empty_run.json")] + [
            str(run / runformat.MANIFEST) for run, (manifest, _) in checked.items()
            if (run / runformat.MANIFEST).is_file() and manifest is None and run.name not in self._late_links
        ]
        return lists

    def _params(self, **analysis: float) -> dict[str, Any]:
        return self.binding.params(self.runs_dirs, **analysis)

    def _run_rule_sets(self) -> dict[Path, tuple[str, dict[str, dict[str, Any]]]]:
        return self.binding.rule_sets(self.runs_dirs)

    def rules(self) -> pd.DataFrame:
        """The rule catalogue as the views see it (see :meth:`RuleBinding.catalogue_rows`), as pandas."""
        import pandas as pd

        return pd.DataFrame(self.binding.catalogue_rows())

    def run_rules(self) -> pd.DataFrame:
        """Per run, the rule it trained with and the parameters the SQL binds for it (see
        :meth:`RuleBinding.run_rule_rows`), as pandas."""
        import pandas as pd

        return pd.DataFrame(self.binding.run_rule_rows(self.runs_dirs),
                            columns=["run_id", "loss_rule", "parameters", "source"])

    def _prepare(self, con: duckdb.DuckDBPyConnection, tokens: Sequence[Path] | None = None,
                 **analysis: float) -> None:
        """Bind the file lists and parameters on ``con`` (DuckDB variables live per connection); ``tokens``, when
        given, replaces the tokens files (one query of the cold pass)."""
        lists = self._file_lists()
        if tokens is not None:
            lists = {**lists, "tokens": [lists["tokens"][0], *map(str, tokens)]}
        con.execute("set variable trustscope_files = ?", [lists])
        con.execute("set variable trustscope_params = ?", [self._params(**analysis)])

    def _lock_down(self) -> None:
        """Only the log directories, the targets of symlinked runs (the runs of this moment, kept in
        ``_allowed``) and the private empty files stay readable; then lock the configuration."""
        self._allowed = readable_dirs(self.paths, self.runs_dirs)
        allowed = [str(p) + os.sep for p in self._allowed] + [str(self._private) + os.sep]
        self.con.execute("set allowed_directories = ?", [allowed])
        self.con.execute("set enable_external_access = false")
        self.con.execute("set lock_configuration = true")

    def cursor(self, **analysis: float) -> duckdb.DuckDBPyConnection:
        """A fresh cursor with the file lists, parameters and kept partial aggregates bound.

        ``analysis`` overrides :data:`ANALYSIS_DEFAULTS` for this cursor only.
        """
        return self._cursor(None, **analysis)

    def read(self, read: Callable[[duckdb.DuckDBPyConnection], _R], **analysis: float) -> _R:
        """``read(cursor)`` on a fresh :meth:`cursor` (``analysis`` as there), closed after; run again on a new
        cursor, its files listed again, when a file it listed went in the meantime (a compaction swapped a rank
        folder between the listing and the read, see :func:`again_if_swapped`). The way to read through SQL of
        one's own while a run may be compacting."""

        def once() -> _R:
            cur = self.cursor(**analysis)
            try:
                return read(cur)
            finally:
                cur.close()

        return again_if_swapped(once)

    def _cursor(self, tokens: Sequence[Path] | None, **analysis: float) -> duckdb.DuckDBPyConnection:
        cur = self.con.cursor()
        self._prepare(cur, tokens, **analysis)
        for name, table in self.kept.merged.items():
            cur.register(name, table)
        return cur

    def refresh(self, views: Iterable[str] = ()) -> None:
        """Pick up new runs and new files; when ``views`` read any kept aggregate, compute the partial aggregates
        they read of the files not seen before (once per file and view; the views wanted together from one pass
        over the parts of its flush, see :func:`~trustscope.query.partials.aggregate_partials`)."""
        needed = caches_read(views)
        with self._lock:
            self._sync_mirrors()
            self.runs_dirs = self._reachable(run_dirs(self.paths))
            self._prepare(self.con)
            if not needed:
                return
            files = [f for run in self.runs_dirs for f in data_files(run, "tokens") if f not in self._unreadable]
            partials = [view for view, cache in CACHED_PARTIALS.items() if cache in needed]
            if self.kept.update(files, self._aggregate, self._disk_key(), partials):
                for name, table in self.kept.merged.items():
                    self.con.register(name, table)

    def _aggregate(self, files: list[Path], views: Sequence[str] | None = None
                   ) -> Iterator[tuple[Path, dict[str, pa.Table]]]:
        """``(file, the rows of every partial view of views)`` for each of ``files``, by :attr:`aggregator`."""
        if not files:
            return iter(())
        flushes = flush_groups(files)
        rule_sets, rendered = self._run_rule_sets(), {}
        variants = {str(flush[0]): v for flush in flushes
                    if (v := self._stored_variant(flush, rule_sets, rendered)) is not None}
        return self.aggregator.aggregate(files, rule_blocks=self._rule_blocks, fingerprint=self._fingerprint,
                                         params=self._params(), variants=variants, views=views)

    def _stored_variant(self, files: list[Path], rule_sets: dict[Path, tuple[str, dict[str, dict[str, Any]]]],
                        rendered: dict[tuple, Variant]) -> Variant | None:
        """The :func:`~trustscope.query.partials.stored_variant` for ``files`` (one flush): the rules whose logged
        bits hold at this connection's parameters read them; None when no rule's do. ``rendered`` keeps the
        variants already rendered, by their stored bits."""
        run = rule_sets.get(runformat.run_of(files[0]))
        stored = stored_rule_bits(files, run[1] if run else self.rule_params)
        if not stored:
            return None
        self.stored_bits_files += len(files)
        key = tuple(sorted(stored.items()))
        if key not in rendered:
            rendered[key] = stored_variant(stored)
        return rendered[key]

    def _cursor_for(self, files: Sequence[Path]) -> duckdb.DuckDBPyConnection:
        """A cursor whose tokens list holds only ``files`` (one query of the cold pass)."""
        return self._cursor(files)

    def _disk_key(self) -> Any:
        """``file -> key``: what a file's kept rows on disk depend on besides the file itself (the SQL, the bound
        parameters, its run's own rule), worked out once per run."""
        rule_sets, prefixes = self._run_rule_sets(), {}
        shared = {"rules": self.rule_params, "analysis": dict(ANALYSIS_DEFAULTS)}

        def key(file: Path) -> str:
            run = runformat.run_of(file)
            if run not in prefixes:
                own = rule_sets.get(run)
                prefixes[run] = json.dumps([self._fingerprint, {**shared, "own": own}], default=str)
            return prefixes[run]

        return key

    def _reachable(self, runs: list[Path]) -> list[Path]:
        """``runs`` less the symlinked runs created after connect, whose targets this connection cannot read
        (its allowed directories are locked): they are listed in :attr:`broken_runs` until a reconnect."""
        late = {r for r in runs if not any(r.resolve().is_relative_to(a) for a in self._allowed)}
        self._late_links = {r.name: "a symlinked run created after the log directory was opened; reopen it"
                            for r in late}
        return [r for r in runs if r not in late]

    def close(self) -> None:
        """Close the connection, end the SQL worker and remove the private files (also done when a LogDB that
        was never closed is collected, or at exit)."""
        self.kept.flush()
        self.con.close()
        self._finalizer()

    def __enter__(self) -> LogDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- user SQL

    # ------------------------------------------------------------------------------------------- user SQL

    def sql(self, query: str, *, max_rows: int | None = None, timeout_s: float | None = None) -> QueryResult:
        """Run one read from a user in the sandbox worker; at most ``max_rows`` rows, stopped after ``timeout_s``
        or at :attr:`memory_bytes` of memory.

        Raises :class:`QueryRefused` for anything but a read (the whole parse tree is checked: EXPLAIN ANALYZE,
        CTEs and subqueries included) and for file paths, :class:`QueryTimeout` / :class:`QueryMemoryLimit`
        when a limit stops it, DuckDB's own error for a query that does not bind or run.
        """
        max_rows = self.max_rows if max_rows is None else max_rows
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        check_statement(query, self._allowed)
        self._sandbox().start()  # the worker starts while the views' inputs are brought up to date
        return again_if_swapped(lambda: self._run_in_sandbox(query, max_rows, timeout_s))

    def _run_in_sandbox(self, query: str, max_rows: int, timeout_s: float) -> QueryResult:
        """Run ``query`` in the worker, unchecked (its engine cannot write either way: see the tests)."""
        self.refresh(words(query) & set(VIEWS))
        with self._lock:
            sandbox = self._sandbox()
            request = {"roots": [*self._allowed, self._private], "files": self._file_lists(),
                       "params": self._params(), "caches": self._write_caches()}
        table = sandbox.run(query, max_rows=max_rows, timeout_s=timeout_s, **request)
        truncated = table.num_rows > max_rows
        return QueryResult(table.slice(0, max_rows), truncated, max_rows)

    # ------------------------------------------------------------------------------------------- queries

    def query(self, name: str, **params: Any) -> pd.DataFrame:
        """Run ``sql/queries/<name>.sql`` with ``params`` bound to its ``$name`` parameters, as pandas.

        The kept aggregates the query's views read are brought up to date first. Unknown names raise ValueError.
        """
        if name not in QUERIES:
            raise ValueError(f"unknown query {name!r}; known: {', '.join(QUERIES)}")
        text = (QUERY_DIR / f"{name}.sql").read_text()

        def run() -> pd.DataFrame:
            self.refresh(words(text) & set(VIEWS))
            cur = self.cursor()
            try:
                return cur.execute(text, params).df()
            finally:
                cur.close()

        return again_if_swapped(run)

    def version(self) -> str:
        """A hash of every run file's path, size and modification time: it changes whenever a file lands,
        grows or goes, so callers may cache results under it."""
        h = hashlib.blake2b(digest_size=12)
        with self._lock:
            self._sync_mirrors()
        for run in run_dirs(self.paths):
            files = [run / runformat.MANIFEST, run / runformat.VOCAB_FILE]
            files += [f for table in runformat.TABLES for f in data_files(run, table)]
            for f in files:
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def _sandbox(self) -> Sandbox:
        """The SQL worker, reading this connection's catalogue file (read-only)."""
        if self._resources.sandbox is None:
            (self._private / "sandbox").mkdir(exist_ok=True)
            self._resources.sandbox = Sandbox(self.catalogue, self.memory_bytes)
        return self._resources.sandbox

    def _write_caches(self) -> dict[str, tuple[int, str]]:
        """The kept aggregates as Arrow files the worker maps: name -> (version, path); rewritten on change."""
        out = {}
        for name, table in self.kept.merged.items():
            written, version, path = self._cache_files.get(name, (None, 0, ""))
            if written is not table:
                if path:
                    Path(path).unlink(missing_ok=True)
                version += 1
                path = str(self._private / "sandbox" / f"{name}.{version}.arrow")
                with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                    writer.write_table(table)
                self._cache_files[name] = (table, version, path)
            out[name] = (version, path)
        return out

    # ------------------------------------------------------------------------------------------- analyses

    # ------------------------------------------------------------------------------------------- analyses

    def _frame(self, view: str, *, where: dict[str, Sequence[Any] | None] | None = None,
               refresh: bool = False, limit: int | None = None, **analysis: float) -> pd.DataFrame:
        """Rows of ``view`` whose columns take one of the given values (bound as constants), as pandas."""
        return again_if_swapped(lambda: self._frame_once(view, where=where, refresh=refresh, limit=limit,
                                                         **analysis))

    def _frame_once(self, view: str, *, where: dict[str, Sequence[Any] | None] | None = None,
                    refresh: bool = False, limit: int | None = None, **analysis: float) -> pd.DataFrame:
        if refresh:
            self.refresh([view])
        cur = self.cursor(**analysis)
        try:
            rel = cur.view(view)
            for column, values in (where or {}).items():
                if values is None:
                    continue
                values = [values] if isinstance(values, str | int | float) else list(values)
                if not values:
                    raise ValueError(f"{view}: empty list of {column} values")
                rel = rel.filter(duckdb.ColumnExpression(column).isin(*map(duckdb.ConstantExpression, values)))
            if limit is not None:
                rel = rel.limit(limit)
            return rel.to_df()
        finally:
            cur.close()


_R = TypeVar("_R")
SWAP_RETRIES = 3
"""How often a read is run again when a file it listed went in the meantime (a compaction swapped a rank folder
between the listing and the read: see ``docs/logging.md``)."""


def again_if_swapped(read: Callable[[], _R]) -> _R:
    """``read()``, run again (listing the files again) when it fails on a file that vanished after it was listed;
    the last failure is raised."""
    for attempt in range(SWAP_RETRIES + 1):
        try:
            return read()
        except Exception as err:
            if attempt == SWAP_RETRIES or not runformat.is_vanished_file_error(err):
                raise
    raise AssertionError("unreachable")


def connect(logdir_or_runs: str | Path | Sequence[str | Path], *, max_rows: int = DEFAULT_MAX_ROWS,
            timeout_s: float = DEFAULT_TIMEOUT_S, cache: bool = True, cache_dir: str | Path | None = None,
            rule_params: dict[str, dict[str, Any]] | None = None,
            rules: str | Sequence[str] | None = None, memory_limit: float | None = None,
            storage_options: dict[str, Any] | None = None, mirror_dir: str | Path | None = None,
            ray: str | None = None, ray_fallback: str = "warn") -> LogDB:
    """Open a log directory, one run directory, or a list of them, as a locked-down :class:`LogDB`.

    Any of them may be an object store prefix, ``s3://bucket/prefix`` (``storage_options`` for
    ``s3fs.S3FileSystem``, else the usual AWS variables): its committed objects are mirrored into ``mirror_dir``
    (default :func:`trustscope.runformat.mirrors.default_mirror_root`; with ``cache=False`` a private folder) keyed by
    ETag, again at every refresh, and read there. A store that cannot be reached, or a missing bucket, raises
    :class:`trustscope.runformat.retry.StorageError` naming the URL and the cause.

    ``rules``: rule modules to import first (see :func:`load_rules`; default ``$TRUSTSCOPE_RULES``).
    ``rule_params``: rule -> parameters for the counterfactual columns (default: each rule's defaults); a run's
    own rule always uses the parameters recorded in its run.json.

    ``db.con`` is the DuckDB connection (views: tokens, samples, steps, runs, vocab, token_metrics, rule_blocks,
    step_summary, clipped_tokens, ratio_vs_divergence, ...); ``db.cursor()`` gives a cursor with everything bound.
    Per-file partial aggregates are kept in memory and under ``cache_dir`` (default :func:`default_cache_dir`),
    so a new process does not recompute them; ``cache=False`` recomputes them on every refresh.
    ``memory_limit`` bounds user SQL (:meth:`LogDB.sql`): a fraction of physical memory up to 1, else bytes
    (default ``$TRUSTSCOPE_SQL_MEMORY``, else a quarter of the memory).
    ``ray``: ``"auto"``, ``HOST:PORT`` or ``ray://HOST:PORT`` aggregates the files that miss partial aggregates as
    Ray tasks on that cluster (see :mod:`trustscope.distributed`); a cluster that cannot be reached warns and
    aggregates here (``ray_fallback="warn"``) or raises :class:`~trustscope.distributed.RayUnavailable` now
    (``"error"``).
    """
    paths = [logdir_or_runs] if isinstance(logdir_or_runs, str | Path) else list(logdir_or_runs)
    if not paths:
        raise ValueError("connect: no log directory given")
    load_rules(rules)
    cluster = None
    if ray is not None or ray_fallback not in ("warn", "error"):  # an optional backend, imported when named
        from trustscope.distributed import attach_ray

        cluster = attach_ray(ray, fallback=ray_fallback)
    return LogDB([p if runformat.is_remote(p) else Path(p) for p in paths], max_rows=max_rows, timeout_s=timeout_s,
                 cache=cache, cache_dir=Path(cache_dir) if cache_dir is not None else None, rule_params=rule_params,
                 memory_limit=memory_limit, storage_options=storage_options,
                 mirror_dir=Path(mirror_dir) if mirror_dir is not None else None, aggregator=cluster)


class NoRunsFound(Exception):
    """A log directory with no readable run; the message says where and what to do."""


def connect_readable(logdir: Path | str, **kwargs: Any) -> tuple[LogDB, dict[str, list[str]]]:
    """Open the runs of ``logdir`` that read cleanly; return the handle and ``{run: problems}`` of those left out.

    The check is :func:`~trustscope.query.runs.run_problems`, the one behind :attr:`LogDB.broken_runs`; a report leaves a
    broken run out whole (and says so), where the dashboard shows what still reads of it, marked broken.

    Raises :class:`NoRunsFound` when ``logdir`` holds no run at all, or only unreadable ones, and
    FileNotFoundError when it does not exist. An ``s3://`` prefix is read through its local mirror
    (:func:`trustscope.runformat.mirrors.mirror`; StorageError when the store cannot be read).
    """
    logdir = runformat.mirror(logdir) if runformat.is_remote(logdir) else Path(logdir)
    if not logdir.is_dir():
        raise FileNotFoundError(f"log directory {str(logdir)!r} does not exist or is not a directory")
    dirs = runformat.run_dirs(logdir)
    broken = {d.name: p for d in dirs if (p := run_problems(d))}  # the check LogDB.broken_runs makes
    readable = [d for d in dirs if d.name not in broken]
    if not readable:
        named = "; ".join(f"{run}: {in_words(problems)}" for run, problems in sorted(broken.items()))
        where = f"{logdir}: " + (f"every run is unreadable ({named})" if broken
                                 else "no runs found (no <run>/run.json)")
        raise NoRunsFound(f"{where}; point at a directory a trainer with a TokenLogger writes to"
                          + (f", or run `trustscope validate {logdir}`" if broken else ""))
    return connect(readable, **kwargs), broken
