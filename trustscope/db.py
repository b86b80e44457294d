"""Open a log directory as a DuckDB database: the macros and views of ``trustscope/sql``, sandboxed user SQL, and
the named analyses the CLI, the report and the dashboard call.

    db = connect("logs/")                    # a log directory, one run directory, or a list of either
    db.step_summary()                        # pandas DataFrame, one row per (run, step)
    db.sql("select rule, count(*) from clipped_tokens group by rule")   # read-only, row limit, timeout

Views read the runs' Parquet files that the logger has committed (listed afresh for every cursor), so a run that
is still being written shows every step whose flush is complete, in every table at once. Per-step summaries come from
per-file partial aggregates that are computed once per new file and kept (``step_partials``), so the overview
costs the same at 100M tokens as at 1M; the token-level views stay for drill-down and ad-hoc SQL.

The database is locked down before any user SQL runs: only the log directories are readable, nothing else on
disk or the network is, no extension can load, and the configuration is locked. User SQL must be a single
SELECT; its rows are capped and it is interrupted after a timeout. Parameters (file lists, the rules' defaults
from :mod:`trustscope.losses`, analysis settings) are bound through DuckDB variables, never formatted into SQL.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trustscope import schema
from trustscope.losses import get_loss, list_losses
from trustscope.paths import cache_root

SQL_DIR = Path(__file__).parent / "sql"
MACRO_DIR = SQL_DIR / "macros"
VIEW_DIR = SQL_DIR / "views"

DEFAULT_MAX_ROWS = 10_000
"""Rows a user query may return before it is cut (the result says it was truncated)."""
DEFAULT_TIMEOUT_S = 30.0
"""Seconds a user query may run before it is interrupted."""

ANALYSIS_DEFAULTS: dict[str, float] = {
    "bad_negative_delta": float(get_loss("minimal_negative_mask").defaults["delta"]),
    "ratio_log10_min": -3.0,
    "ratio_log10_max": 3.0,
    "ratio_bins": 60,
    "divergence_log10_min": -8.0,
    "divergence_log10_max": 0.0,
    "divergence_bins": 64,
}
"""Settings of the analysis views. The bad negative-update delta is minimal_negative_mask's own default."""

ALLOWED_STATEMENTS = frozenset({duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN})
"""Statement types user SQL may run (DESCRIBE, SUMMARIZE, FROM-first queries parse as SELECT)."""

VIEWS = tuple(sorted(p.stem for p in VIEW_DIR.glob("*.sql")))
MACROS = tuple(sorted(p.stem for p in MACRO_DIR.glob("*.sql")))

_CACHED_PARTIALS = {
    "step_partials": "step_partials_cache",
    "clipped_partials": "clipped_partials_cache",
    "histogram_partials": "histogram_partials_cache",
}
"""Partial-aggregate views kept per tokens file, and the name their merged rows are read under."""


def _strip_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql).lower()


def default_cache_dir() -> Path:
    """The kept aggregates' folder: ``queries/`` under :func:`trustscope.paths.cache_root`."""
    return cache_root() / "queries"


_SQL_FINGERPRINT = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted([*MACRO_DIR.glob("*.sql"), *VIEW_DIR.glob("*.sql")]))
).hexdigest()
"""Changes whenever a macro or view changes, so kept aggregates of an older definition are never reused."""


def _view_dependencies() -> dict[str, set[str]]:
    """For every view, the kept-aggregate names it reads, directly or through other views."""
    names = set(VIEWS) | set(_CACHED_PARTIALS.values())
    direct = {
        v: set(re.findall(r"[a-z_]+", _strip_comments((VIEW_DIR / f"{v}.sql").read_text()))) & names - {v}
        for v in VIEWS
    }

    def caches(view: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set()
        for dep in direct.get(view, ()):
            if dep in _CACHED_PARTIALS.values():
                out.add(dep)
            elif dep not in seen:
                out |= caches(dep, seen | {view})
        return out

    return {v: caches(v) for v in VIEWS}


_CACHES_READ_BY = _view_dependencies()


class QueryRefused(ValueError):
    """User SQL that the sandbox does not run; the message says what was refused and why."""


class QueryTimeout(RuntimeError):
    """User SQL interrupted after its time limit."""


@dataclass
class QueryResult:
    """Rows of a user query: ``table`` (at most ``max_rows`` rows) and whether rows were cut."""

    table: pa.Table
    truncated: bool
    max_rows: int

    def to_pandas(self) -> pd.DataFrame:
        return self.table.to_pandas()


def rule_parameters() -> dict[str, dict[str, Any]]:
    """Every registered rule's default parameters (from :mod:`trustscope.losses`), ready to bind."""
    out: dict[str, dict[str, Any]] = {}
    for name in list_losses():
        params = {}
        for key, value in get_loss(name).defaults.items():
            params[key] = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        out[name] = params or {"none": None}
    return out


def _run_dirs(paths: Sequence[Path]) -> list[Path]:
    runs: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(f"log directory {str(path)!r} does not exist or is not a directory")
        runs += schema.run_dirs(path)
    return sorted(set(runs))


def _data_files(run: Path, table: str) -> list[Path]:
    return schema.committed_files(run)[table]


def _load_sql(con: duckdb.DuckDBPyConnection, files: Iterable[Path], kind: str,
              on_stuck: Callable[[], None] | None = None) -> None:
    """Run every ``.sql`` file, in dependency order: a file that names one not loaded yet waits for it.

    ``on_stuck`` is called once when no file can load (it may create what they wait for).
    """
    pending = {p.stem: p for p in files}
    while pending:
        errors, loaded = {}, 0
        for name, path in list(pending.items()):
            text = path.read_text()
            try:
                con.execute(text if kind == "macro" else f"create or replace view {name} as\n{text}")
            except duckdb.CatalogException as err:
                errors[name] = err
                continue
            del pending[name]
            loaded += 1
        if errors and not loaded:
            if on_stuck is not None:
                on_stuck()
                on_stuck = None
                continue
            name, err = next(iter(errors.items()))
            raise RuntimeError(f"cannot load {kind} {name!r} from {pending[name]}: {err}")


class LogDB:
    """A DuckDB connection over one or many runs, with trustscope's macros, views and named analyses.

    Use :func:`connect`. Every method opens its own cursor, so one ``LogDB`` may serve several threads.
    """

    def __init__(self, paths: Sequence[Path], *, max_rows: int = DEFAULT_MAX_ROWS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache: bool = True,
                 cache_dir: Path | None = None) -> None:
        self.paths = [Path(p).resolve() for p in paths]
        self.max_rows = max_rows
        self.timeout_s = timeout_s
        self.cache_enabled = cache
        self.partials_computed = 0
        """How many (view, file) partial aggregates this connection computed (not found in memory or on disk)."""
        self.cache_dir = (cache_dir or default_cache_dir()) if cache else None
        self._lock = threading.Lock()
        self._partials: dict[str, dict[Path, tuple[tuple[int, int], pa.Table]]] = {v: {} for v in _CACHED_PARTIALS}
        self._merged: dict[str, pa.Table] = {}
        self._private = Path(tempfile.mkdtemp(prefix="trustscope-db-"))
        self._write_empty_files()
        self.runs_dirs = _run_dirs(self.paths)
        self.con = duckdb.connect(config={"autoload_known_extensions": False,
                                          "autoinstall_known_extensions": False,
                                          "allow_community_extensions": False,
                                          "allow_persistent_secrets": False})
        self._prepare(self.con)
        _load_sql(self.con, sorted(MACRO_DIR.glob("*.sql")), "macro")
        _load_sql(self.con, sorted(VIEW_DIR.glob("*.sql")), "view", on_stuck=self._register_empty_caches)
        self._lock_down()

    def _register_empty_caches(self) -> None:
        """Register each kept-aggregate name, empty, with its partial view's columns (views reading it can load)."""
        for view, cache_name in _CACHED_PARTIALS.items():
            self._merged[cache_name] = self.con.view(view).limit(0).to_arrow_table()
            self.con.register(cache_name, self._merged[cache_name])

    # ------------------------------------------------------------------------------------------- set-up

    def _write_empty_files(self) -> None:
        """An empty file of every table, always first in each file list: the views have every column even
        before the first file of a table lands, and a glob list is never empty."""
        for table in (*schema.TABLES, "vocab"):
            empty = schema.with_metadata(table).empty_table()
            pq.write_table(empty, self._private / f"empty_{table}.parquet")
        (self._private / "empty_run.json").write_text("")

    def _file_lists(self) -> dict[str, list[str]]:
        """The files of each table a reader should see (committed flushes only, see :func:`schema.committed_files`)."""
        lists: dict[str, list[str]] = {}
        committed = [schema.committed_files(run) for run in self.runs_dirs]
        for table in schema.TABLES:
            files = [str(f) for run_files in committed for f in run_files[table]]
            lists[table] = [str(self._private / f"empty_{table}.parquet"), *files]
        lists["vocab"] = [str(self._private / "empty_vocab.parquet")] + [
            str(run / schema.VOCAB_FILE) for run in self.runs_dirs if (run / schema.VOCAB_FILE).is_file()
        ]
        lists["manifests"] = [str(self._private / "empty_run.json")] + [
            str(run / schema.MANIFEST) for run in self.runs_dirs if (run / schema.MANIFEST).is_file()
        ]
        return lists

    def _params(self, **analysis: float) -> dict[str, Any]:
        unknown = set(analysis) - set(ANALYSIS_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown analysis parameter(s) {sorted(unknown)}; known: {sorted(ANALYSIS_DEFAULTS)}")
        return {"rules": rule_parameters(), "analysis": {**ANALYSIS_DEFAULTS, **analysis}}

    def _prepare(self, con: duckdb.DuckDBPyConnection, **analysis: float) -> None:
        """Bind the file lists and parameters on ``con`` (DuckDB variables live per connection)."""
        con.execute("set variable trustscope_files = ?", [self._file_lists()])
        con.execute("set variable trustscope_params = ?", [self._params(**analysis)])

    def _lock_down(self) -> None:
        """Only the log directories (and the private empty files) stay readable; then lock the configuration."""
        allowed = [str(p) + os.sep for p in self.paths] + [str(self._private) + os.sep]
        self.con.execute("set allowed_directories = ?", [allowed])
        self.con.execute("set enable_external_access = false")
        self.con.execute("set lock_configuration = true")

    def cursor(self, **analysis: float) -> duckdb.DuckDBPyConnection:
        """A fresh cursor with the file lists, parameters and kept partial aggregates bound.

        ``analysis`` overrides :data:`ANALYSIS_DEFAULTS` for this cursor only.
        """
        cur = self.con.cursor()
        self._prepare(cur, **analysis)
        for name, table in self._merged.items():
            cur.register(name, table)
        return cur

    def refresh(self, views: Iterable[str] = ()) -> None:
        """Pick up new runs and new files; for the kept aggregates that ``views`` read, compute the partial
        aggregates of files not seen before (once per file)."""
        needed = {c for v in views for c in _CACHES_READ_BY.get(v, ())}
        with self._lock:
            self.runs_dirs = _run_dirs(self.paths)
            self._prepare(self.con)
            files = [f for run in self.runs_dirs for f in _data_files(run, "tokens")]
            for view, cache_name in _CACHED_PARTIALS.items():
                if cache_name in needed:
                    self._merged[cache_name] = self._update_partials(view, files)
                    self.con.register(cache_name, self._merged[cache_name])

    def _update_partials(self, view: str, files: list[Path]) -> pa.Table:
        kept = self._partials[view]
        current = {}
        for f in files:
            st = f.stat()
            current[f] = (st.st_size, st.st_mtime_ns)
        for gone in set(kept) - set(current):
            del kept[gone]
        todo = [f for f, key in current.items() if not self.cache_enabled or f not in kept or kept[f][0] != key]
        if self.cache_dir is not None and todo:
            for f in list(todo):
                stored = self._disk_path(view, f, current[f])
                if stored.is_file():
                    kept[f] = (current[f], pq.read_table(stored))
                    todo.remove(f)
        self.partials_computed += len(todo)
        if todo:
            cur = self.cursor()
            names = [str(f) for f in todo]
            rel = cur.view(view).filter(
                duckdb.ColumnExpression("source_file").isin(*(duckdb.ConstantExpression(n) for n in names))
            )
            fresh = rel.to_arrow_table()
            cur.close()
            for f, name in zip(todo, names, strict=True):
                kept[f] = (current[f], fresh.filter(pc.equal(fresh.column("source_file"), name)))
                if self.cache_dir is not None:
                    self._store(self._disk_path(view, f, current[f]), kept[f][1])
        empty = self._merged[_CACHED_PARTIALS[view]].schema.empty_table()
        parts = [kept[f][1] for f in files if f in kept]
        return pa.concat_tables([empty, *parts], promote_options="permissive") if parts else empty

    def _disk_path(self, view: str, file: Path, stat_key: tuple[int, int]) -> Path:
        """Where the partial aggregates of ``view`` over ``file`` are kept on disk: keyed by the view's SQL (and
        everything it reads), the bound parameters, the file's path, size and modification time."""
        key = hashlib.sha256(
            json.dumps([_SQL_FINGERPRINT, self._params(), view, str(file), stat_key], default=str).encode()
        ).hexdigest()[:32]
        return self.cache_dir / view / f"{key}.parquet"

    @staticmethod
    def _store(path: Path, table: pa.Table) -> None:
        """Write atomically (temporary name, then rename); a cache that cannot be written is only slower."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            pq.write_table(table, tmp)
            tmp.replace(path)
        except OSError:
            pass

    def close(self) -> None:
        """Close the connection and remove the private empty-table files."""
        self.con.close()
        shutil.rmtree(self._private, ignore_errors=True)

    def __enter__(self) -> LogDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- user SQL

    def sql(self, query: str, *, max_rows: int | None = None, timeout_s: float | None = None) -> QueryResult:
        """Run one read-only SELECT from a user; at most ``max_rows`` rows, interrupted after ``timeout_s``.

        Raises :class:`QueryRefused` for anything but a single SELECT (and for reads outside the log
        directories, extension loads, settings changes), :class:`QueryTimeout` when time runs out.
        """
        max_rows = self.max_rows if max_rows is None else max_rows
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        check_statement(query)
        words = set(re.findall(r"[a-z_]+", query.lower()))
        self.refresh(words & set(VIEWS))
        cur = self.cursor()
        timer = threading.Timer(timeout_s, cur.interrupt)
        timer.start()
        try:
            table = cur.sql(query).limit(max_rows + 1).to_arrow_table()
        except duckdb.InterruptException:
            raise QueryTimeout(f"query interrupted after the time limit of {timeout_s:g} s") from None
        except duckdb.PermissionException as err:
            raise QueryRefused(f"refused: the query reads outside the log directories ({err})") from None
        finally:
            timer.cancel()
            cur.close()
        truncated = table.num_rows > max_rows
        return QueryResult(table.slice(0, max_rows), truncated, max_rows)

    # ------------------------------------------------------------------------------------------- analyses

    def _frame(self, view: str, *, where: dict[str, Sequence[Any] | None] | None = None,
               refresh: bool = False, limit: int | None = None, **analysis: float) -> pd.DataFrame:
        """Rows of ``view`` whose columns take one of the given values (bound as constants), as pandas."""
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

    def runs(self) -> pd.DataFrame:
        """One row per run: run_id, status, schema_version, n_steps, first_step, last_step, n_samples,
        n_response_tokens, mean_reward, manifest (JSON text)."""
        return self._frame("runs", refresh=True)

    def step_summary(self, run_ids: Sequence[str] | str | None = None) -> pd.DataFrame:
        """One row per (run, step), from the kept per-file aggregates (see ``sql/views/step_summary.sql``).

        Columns: run_id, step, n_tokens, n_samples, reward_mean, reward_std, length_mean, mismatch_mean
        (mean |pi - mu|), mismatch_max, prob_diff_max / prob_diff_min (signed pi - mu), binary_kl_mean/_max,
        topk_tv_mean/_max, topk_kl_mean/_max, ratio_min/_max, entropy_mean, n_positive, n_negative,
        n_zero_advantage, n_bad_negative, bad_negative_rate, trainer_blocked_frac, and per registered rule R:
        blocked_frac__R, blocked_frac_pos__R (A > 0), blocked_frac_nonpos__R (A <= 0).
        """
        return self._frame("step_summary", where={"run_id": run_ids}, refresh=True)

    def summaries(self, run_ids: Sequence[str] | str | None = None,
                  metrics: Sequence[str] | str | None = None) -> pd.DataFrame:
        """The exact per-step summaries the logger computed over every token (whatever ``token_fraction`` kept),
        merged over micro-batches and ranks (see ``sql/views/summaries.sql`` and :mod:`trustscope.logger.summaries`).

        Columns: run_id, step, metric, rule, advantage_sign, mu_bucket, mu_low, bin_low, bin_high, threshold,
        count, sum, sum_sq, min, max, mean, fraction, cum_fraction, step_tokens. For example the blocked fraction
        of rule R on A < 0 tokens of mu bucket b is ``fraction`` of the row (metric 'blocked', rule R, advantage_sign
        'negative', mu_bucket b); the median |pi - mu| is the bin_high of the first 'abs_prob_diff_hist' row with
        cum_fraction >= 0.5. Runs logged before the summaries table existed have no rows.
        """
        return self._frame("summaries", where={"run_id": run_ids, "metric": metrics}, refresh=True)

    def blocked_fractions(self, run_ids: Sequence[str] | str | None = None,
                          rules: Sequence[str] | str | None = None) -> pd.DataFrame:
        """Long form of the blocked fractions: run_id, step, rule, advantage_side ('all', 'positive',
        'non_positive'), blocked_frac. Every registered rule at its default parameters, on the same tokens."""
        return self._frame("blocked_fractions", where={"run_id": run_ids, "rule": rules}, refresh=True)

    def bad_negative_updates(self, run_ids: Sequence[str] | str | None = None,
                             delta: float | None = None) -> pd.DataFrame:
        """Per step: the rate of bad negative updates (A < 0 and mu - pi >= delta) beside the reward's level and
        fluctuation. ``delta`` defaults to minimal_negative_mask's default (0.5); the default is read from the
        kept aggregates, any other value scans the tokens.

        Columns: run_id, step, n_tokens, n_negative, n_bad_negative, bad_negative_rate, reward_mean, reward_std,
        reward_change (|reward_mean - previous step's|).
        """
        if delta is None or delta == ANALYSIS_DEFAULTS["bad_negative_delta"]:
            return self._frame("bad_negative_updates", where={"run_id": run_ids}, refresh=True)
        if not (isinstance(delta, int | float) and math.isfinite(delta) and delta >= 0):
            raise ValueError(f"delta={delta!r} must be a finite number >= 0")
        return self._frame("bad_negative_updates_scan", where={"run_id": run_ids}, refresh=True,
                           bad_negative_delta=float(delta))

    def clipped_tokens(self, run_ids: Sequence[str] | str | None = None, rules: Sequence[str] | str | None = None,
                       top: int = 30) -> pd.DataFrame:
        """Token texts ranked by how often each rule blocks them (the ``top`` first per run and rule).

        Columns: run_id, rule, rank, token_id, token_text, n_blocked, n_occurrences, block_rate, block_share,
        mu_prob_mean, mu_bucket, entropy_mean.
        """
        if top < 1:
            raise ValueError(f"top={top} must be >= 1")
        df = self._frame("clipped_tokens", where={"run_id": run_ids, "rule": rules}, refresh=True)
        return df[df["rank"] <= top].reset_index(drop=True)

    def ratio_vs_divergence(self, run_ids: Sequence[str] | str | None = None,
                            divergences: Sequence[str] | str | None = None) -> pd.DataFrame:
        """Binned 2-D histogram of the ratio against each divergence by mu bucket (log10 bins).

        Columns: run_id, mu_bucket, divergence ('binary_tv', 'binary_kl', 'topk_tv', 'topk_kl'), ratio_bin,
        ratio_lo, ratio_hi, divergence_bin, divergence_lo, divergence_hi, n.
        """
        return self._frame("ratio_vs_divergence", where={"run_id": run_ids, "divergence": divergences},
                           refresh=True)

    def sample_tokens(self, run_id: str, step: int, sample_id: int) -> pd.DataFrame:
        """Every token of one response in order, for a token explorer: token_metrics columns (token_text,
        mu_prob, pi_prob, ratio, binary_tv/kl, topk_tv/kl, advantage, entropy, kept, ...) plus blocks_<rule>."""
        df = self._frame("sample_tokens", where={"run_id": [run_id], "step": [int(step)],
                                                 "sample_id": [int(sample_id)]}, refresh=True)
        return df.sort_values("pos").reset_index(drop=True)

    def samples(self, run_ids: Sequence[str] | str | None = None, steps: Sequence[int] | int | None = None,
                limit: int = 1000) -> pd.DataFrame:
        """Responses: run_id, step, rank, sample_id, prompt_id, prompt, response, reward, advantage, length,
        finish_reason, source_file (at most ``limit`` rows)."""
        return self._frame("samples", where={"run_id": run_ids, "step": steps}, refresh=True, limit=limit)


def connect(logdir_or_runs: str | Path | Sequence[str | Path], *, max_rows: int = DEFAULT_MAX_ROWS,
            timeout_s: float = DEFAULT_TIMEOUT_S, cache: bool = True, cache_dir: str | Path | None = None) -> LogDB:
    """Open a log directory, one run directory, or a list of them, as a locked-down :class:`LogDB`.

    ``db.con`` is the DuckDB connection (views: tokens, samples, steps, runs, vocab, token_metrics, rule_blocks,
    step_summary, clipped_tokens, ratio_vs_divergence, ...); ``db.cursor()`` gives a cursor with everything bound.
    Per-file partial aggregates are kept in memory and under ``cache_dir`` (default :func:`default_cache_dir`),
    so a new process does not recompute them; ``cache=False`` recomputes them on every refresh.
    """
    paths = [logdir_or_runs] if isinstance(logdir_or_runs, str | Path) else list(logdir_or_runs)
    if not paths:
        raise ValueError("connect: no log directory given")
    return LogDB([Path(p) for p in paths], max_rows=max_rows, timeout_s=timeout_s, cache=cache,
                 cache_dir=Path(cache_dir) if cache_dir is not None else None)


def check_statement(query: str) -> None:
    """Refuse anything but one SELECT (or EXPLAIN): COPY, ATTACH, INSTALL/LOAD, EXPORT, SET, PRAGMA, CALL,
    CREATE, INSERT, ... The message names the statement type that was refused."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as err:
        raise QueryRefused(f"refused: the query does not parse ({err})") from None
    if len(statements) != 1:
        raise QueryRefused(f"refused: expected exactly one statement, got {len(statements)}")
    kind = statements[0].type
    if kind not in ALLOWED_STATEMENTS:
        name = str(kind).rsplit(".", 1)[-1]
        raise QueryRefused(f"refused: {name} statements are not allowed; user SQL is read-only (one SELECT)")


CONTRACTS_FILE = SQL_DIR / "contracts.yml"


def load_contracts() -> dict[str, dict[str, Any]]:
    """The data contracts of ``sql/contracts.yml``, with ``"@rules"`` expanded to the registered rules."""
    import yaml

    contracts = yaml.safe_load(CONTRACTS_FILE.read_text())
    for spec in contracts.values():
        for column, values in spec.get("accepted", {}).items():
            if values == "@rules":
                spec["accepted"][column] = list_losses()
    return contracts


def check_contracts(db: LogDB, views: Iterable[str] | None = None) -> list[str]:
    """Every broken contract of ``views`` (default: all with a contract), one message each naming the view,
    the column and an offending value. Reads the key columns into memory: meant for tests and validation."""
    contracts = load_contracts()
    problems = []
    for view in views or contracts:
        spec = contracts[view]
        db.refresh([view])
        cur = db.cursor()
        try:
            rel = cur.view(view)
            columns = set(rel.columns)
            wanted = [*spec.get("unique", []), *spec.get("not_null", []), *spec.get("accepted", {}),
                      *spec.get("between", {})]
            missing = sorted(set(wanted) - columns)
            if missing:
                problems.append(f"{view}: contract names missing column(s) {missing}")
                continue
            data = rel.select(*(duckdb.ColumnExpression(c) for c in dict.fromkeys(wanted))).to_arrow_table()
        finally:
            cur.close()
        problems += _table_problems(view, spec, data)
    return problems


def _table_problems(view: str, spec: dict[str, Any], data: pa.Table) -> list[str]:
    problems = []
    keys = spec.get("unique", [])
    for column in [*keys, *spec.get("not_null", [])]:
        nulls = data.column(column).null_count
        if nulls:
            problems.append(f"{view}.{column}: {nulls} null value(s)")
    if keys and data.num_rows:
        counts = data.select(keys).group_by(keys).aggregate([([], "count_all")])
        dup = counts.filter(pc.greater(counts.column("count_all"), 1))
        if dup.num_rows:
            example = {k: dup.column(k)[0].as_py() for k in keys}
            problems.append(f"{view}: {dup.num_rows} duplicate key(s) {tuple(keys)}, e.g. {example}")
    for column, allowed in spec.get("accepted", {}).items():
        seen = set(pc.unique(data.column(column)).to_pylist())
        bad = sorted(seen - set(allowed), key=str)
        if bad:
            problems.append(f"{view}.{column}: value(s) {bad[:5]} not among {allowed}")
    for column, (low, high) in spec.get("between", {}).items():
        col = data.column(column)
        if col.null_count == len(col):
            continue
        lo, hi = pc.min(col).as_py(), pc.max(col).as_py()
        if lo < low or hi > high:
            problems.append(f"{view}.{column}: values span [{lo}, {hi}], outside [{low}, {high}]")
    return problems

