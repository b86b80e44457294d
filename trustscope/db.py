"""Open a log directory as a DuckDB database: the macros and views of ``trustscope/sql``, sandboxed user SQL, and
the named analyses the CLI, the report and the dashboard call.

    db = connect("logs/")                    # a log directory, one run directory, or a list of either
    db = connect("s3://bucket/logs")         # an object store prefix (read through a local mirror)
    db.step_summary()                        # pandas DataFrame, one row per (run, step)
    db.sql("select rule, count(*) from clipped_tokens group by rule")   # read-only, row limit, timeout

Views read the runs' Parquet files that the logger has committed (listed afresh for every cursor), so a run that
is still being written shows every step whose flush is complete, in every table at once. Per-step summaries come from
per-file partial aggregates that are computed once per new file and kept (``step_partials``), so the overview
costs the same at 100M tokens as at 1M; the token-level views stay for drill-down and ad-hoc SQL. Given a Ray
cluster (``connect(..., ray="auto")``), the new files are aggregated as Ray tasks (:mod:`trustscope.distributed`).

User SQL never runs on this connection: :meth:`LogDB.sql` checks its whole parse tree and runs it in the
worker of :mod:`trustscope.sandbox`, on a read-only copy of the views and macros that can write no file, within
a memory and a time limit. This connection is locked down too (only the log directories readable, no extension
loads, the configuration locked). Parameters (file lists, the rules' parameters: each run's own rule at the
parameters in its run.json, every other rule at the defaults of :mod:`trustscope.losses` or the caller's choice,
analysis settings) are bound through DuckDB variables, never formatted into SQL.

The rule catalogue drives the SQL: ``rule_blocks`` gets one generated ``blocks_<rule>`` column per registered rule
with a SQL mask family (:func:`rule_columns_sql`: identifiers only), and every per-rule aggregate reads those
columns, so a rule of an existing family needs no SQL.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trustscope import schema, storage
from trustscope.losses import LossRule, get_loss, list_losses
from trustscope.paths import cache_root
from trustscope.sandbox import QueryMemoryLimit as QueryMemoryLimit
from trustscope.sandbox import QueryRefused as QueryRefused
from trustscope.sandbox import QueryStopped as QueryStopped
from trustscope.sandbox import QueryTimeout as QueryTimeout
from trustscope.sandbox import Sandbox, check_statement, memory_limit_bytes

if TYPE_CHECKING:
    from trustscope.distributed import RayAggregator

SQL_DIR = Path(__file__).parent / "sql"
MACRO_DIR = SQL_DIR / "macros"
VIEW_DIR = SQL_DIR / "views"
QUERY_DIR = SQL_DIR / "queries"
"""Parameterised queries over the views (``$name`` parameters), run by :meth:`LogDB.query`."""

DEFAULT_MAX_ROWS = 10_000
"""Rows a user query may return before it is cut (the result says it was truncated)."""
DEFAULT_TIMEOUT_S = 30.0
"""Seconds a user query may run before it is interrupted."""
RULES_ENV = "TRUSTSCOPE_RULES"
"""Comma-separated dotted paths of rule modules (``my_pkg.rules``) to import before a log directory opens, so a
dashboard or report shows a user's rules. A log directory never imports code by itself."""
RULE_COLUMNS_MARKER = "/* rule columns */"
"""Where ``trustscope.db`` writes the generated ``blocks_<rule>`` columns into ``views/rule_blocks.sql``."""

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

VIEWS = tuple(sorted(p.stem for p in VIEW_DIR.glob("*.sql")))
QUERIES = tuple(sorted(p.stem for p in QUERY_DIR.glob("*.sql")))

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
_PARTIAL_WORDS = set().union(*(re.findall(r"[a-z_]+", _strip_comments((VIEW_DIR / f"{v}.sql").read_text()))
                               for v in _CACHED_PARTIALS))
"""Every name the partial views' SQL mentions: the ``rule_blocks`` columns among them (and every ``blocks_<rule>``
column, read through ``columns('^blocks_...')``) are the ones the cold pass materialises."""


@dataclass
class QueryResult:
    """Rows of a user query: ``table`` (at most ``max_rows`` rows) and whether rows were cut."""

    table: pa.Table
    truncated: bool
    max_rows: int

    def to_pandas(self) -> pd.DataFrame:
        return self.table.to_pandas()


OVERVIEW_COLUMNS = ("run_id", "step", "n_tokens", "n_samples", "reward_mean", "reward_std", "length_mean",
                    "mismatch_mean", "mismatch_max", "prob_diff_max", "prob_diff_min", "topk_tv_mean", "topk_tv_max",
                    "topk_kl_mean", "topk_kl_max", "entropy_mean", "n_positive", "n_negative", "n_zero_advantage",
                    "n_bad_negative", "bad_negative_rate", "bad_negative_delta", "n_nonzero_advantage",
                    "n_trainer_blocked", "trainer_blocked_frac")
"""The per-step columns of :attr:`Overview.steps`: ``sql/views/summary_steps.sql``'s, named and defined as in
``step_summary``."""
BLOCKED_COLUMNS = ("run_id", "step", "rule", "advantage_side", "n_blocked", "n_tokens", "blocked_frac")


@dataclass
class Overview:
    """The overview figures of some runs, exact where a run has a summaries table (see :meth:`LogDB.overview`).

    ``steps``: one row per (run, step), :data:`OVERVIEW_COLUMNS`. ``blocked``: one row per (run, step, rule,
    advantage side), :data:`BLOCKED_COLUMNS`: n_blocked of n_tokens, side 'all' over the tokens with A != 0,
    'positive' A > 0, 'negative' A < 0. ``sources``: one row per run: run_id, exact (from the summaries table,
    over every token) and token_fraction (what the logger kept of the token rows, from run.json), and ``source``,
    a sentence saying which, for captions.
    """

    steps: pd.DataFrame
    blocked: pd.DataFrame
    sources: pd.DataFrame

    def blocked_totals(self, labels: dict[str, str] | None = None) -> pd.DataFrame:
        """``run_id, rule, n_blocked, n_tokens, blocked_frac`` over every step (tokens with A != 0), one row per
        run (or label of ``labels``) and rule that blocks anything: counts summed, then divided (a run's fraction
        is never a mean of its steps' fractions)."""
        per_step = self.blocked_by_rule(labels)
        out = per_step.groupby(["run_id", "rule"], as_index=False)[["n_blocked", "n_tokens"]].sum()
        out["blocked_frac"] = out["n_blocked"] / out["n_tokens"].where(out["n_tokens"] > 0)
        return out

    def blocked_by_rule(self, labels: dict[str, str] | None = None) -> pd.DataFrame:
        """``run_id, step, rule, n_blocked, n_tokens, blocked_frac`` over the tokens with A != 0, for the rules
        that block at least one token here. ``labels`` maps run_id -> a label (a seed group): the runs of one
        label are added up per step (counts summed, then divided), and ``run_id`` holds the label."""
        df = self.blocked[self.blocked["advantage_side"] == "all"]
        blocking = df.groupby("rule")["n_blocked"].sum()
        df = df[df["rule"].isin(blocking[blocking > 0].index)]
        if labels:
            df = df.assign(run_id=df["run_id"].map(lambda r: labels.get(r, r)))
        out = df.groupby(["run_id", "rule", "step"], as_index=False)[["n_blocked", "n_tokens"]].sum()
        out["blocked_frac"] = out["n_blocked"] / out["n_tokens"].where(out["n_tokens"] > 0)
        return out[["run_id", "step", "rule", "n_blocked", "n_tokens", "blocked_frac"]]

    def bad_updates(self) -> pd.DataFrame:
        """Per run and step, the ``bad_negative_updates`` view's columns: n_tokens, n_negative, n_bad_negative,
        bad_negative_rate (of all the step's tokens), reward_mean, reward_std, reward_change (|reward_mean -
        the previous step's|)."""
        df = self.steps[["run_id", "step", "n_tokens", "n_negative", "n_bad_negative", "bad_negative_rate",
                         "reward_mean", "reward_std"]].sort_values(["run_id", "step"])
        return df.assign(reward_change=df.groupby("run_id")["reward_mean"].diff().abs()).reset_index(drop=True)


def source_sentence(exact: bool, token_fraction: float | None) -> str:
    """How a run's overview figures were obtained, for captions and tables."""
    if exact:
        return "exact: every token (summaries table)"
    if token_fraction is not None and token_fraction < 1:
        return f"from logged rows: a sample of {token_fraction:.0%} of tokens"
    return "from logged rows (every token logged)"


def _bindable(params: dict[str, Any]) -> dict[str, Any]:
    """Numbers as floats (one SQL type per parameter across runs), everything else as it is; a rule without
    parameters gets a placeholder field (a SQL struct needs one)."""
    out = {k: float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in params.items()}
    return out or {"none": None}


def rule_parameters(overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every registered rule's parameters, ready to bind: the defaults (from :mod:`trustscope.losses`), with
    ``overrides`` (rule -> parameters, validated by the rule) on top."""
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(list_losses()))
    if unknown:
        raise ValueError(f"rule_params names unknown rule(s) {unknown}; registered: {list_losses()}")
    return {name: _bindable(get_loss(name).resolve(**overrides.get(name, {}))) for name in list_losses()}


def sql_rules() -> list[LossRule]:
    """The registered rules that declare a SQL mask family (the ones the views can show), sorted by name.

    Raises ValueError naming the rule when its family has no macro file ``sql/macros/<family>_blocks.sql``."""
    rules = [get_loss(name) for name in list_losses() if get_loss(name).sql is not None]
    for rule in rules:
        if not (MACRO_DIR / f"{rule.sql.family}_blocks.sql").is_file():
            raise ValueError(f"loss rule {rule.name!r}: sql family {rule.sql.family!r} has no macro "
                             f"{MACRO_DIR / (rule.sql.family + '_blocks.sql')}")
    return rules


def _quote(identifier: str) -> str:
    """A validated identifier, double-quoted for SQL (names come from the registry: lowercase, digits, '_')."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", identifier):
        raise ValueError(f"{identifier!r} is not a valid SQL identifier here")
    return f'"{identifier}"'


def rule_columns_sql(stored: Mapping[str, int] | None = None) -> str:
    """The generated ``blocks_<rule>`` columns of ``rule_blocks``: one family macro call per rule. Only
    identifiers are generated (validated, quoted); every parameter is read from the bound ``rule_values()``, a
    list per (rule, parameter) indexed by the token's ``rule_set`` (1: the defaults or the caller's choice; a run's
    own set: its own rule at the parameters it trained with). A rule in ``stored`` (rule -> bit) reads its bit of
    the logger's ``blocked_rules`` instead (see :func:`stored_rule_bits`)."""
    lines = []
    for rule in sql_rules():
        if stored and rule.name in stored:
            bit = int(stored[rule.name])
            if not 0 <= bit < schema.MAX_BLOCKED_RULES:
                raise ValueError(f"rule {rule.name!r}: bit {bit} is outside blocked_rules' 0..{schema.MAX_BLOCKED_RULES - 1}")
            lines.append(f",\n        (blocked_rules & {1 << bit}) != 0 as {_quote('blocks_' + rule.name)}")
            continue
        mask = rule.sql
        args = ["null" if c is None else _quote(c) for c in mask.columns]
        args += ["null" if p is None else f"rule_values().{_quote(rule.name)}.{_quote(p)}[rule_set]"
                 for p in mask.params]
        call = f"{mask.family}_blocks({', '.join(args)})"
        lines.append(f",\n        coalesce({call}, false) as {_quote('blocks_' + rule.name)}")
    return "".join(lines)


def run_rule(manifest: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The rule a run trained with and its parameters, from its manifest: top-level ``loss_rule`` (else the
    trainer config's ``loss``), and top-level ``loss_params`` (else the config's ``loss_params`` when the config
    names the same rule). A dotted path names the rule by its last part. Parameters are not validated here."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    rule = manifest.get("loss_rule") or config.get("loss")
    if not isinstance(rule, str) or not rule:
        return None, {}
    params = manifest.get("loss_params")
    if not isinstance(params, dict):
        same = config.get("loss") in (None, rule) or str(config.get("loss")).rsplit(":", 1)[-1] == rule
        params = config.get("loss_params") if same and isinstance(config.get("loss_params"), dict) else {}
    return rule.replace(":", ".").rsplit(".", 1)[-1], dict(params)


def _run_dirs(paths: Sequence[Path]) -> list[Path]:
    """The runs under ``paths``; a run directory that is a symlink is followed (its target is read)."""
    runs: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(f"log directory {str(path)!r} does not exist or is not a directory")
        runs += schema.run_dirs(path)
    return sorted(set(runs))


def _readable(paths: Sequence[Path], runs: Sequence[Path]) -> list[Path]:
    """The resolved directories the views may read: the log directories and the targets of symlinked runs."""
    resolved = {p.resolve() for p in paths}
    for run in runs:
        target = run.resolve()
        if not any(target.is_relative_to(p) for p in resolved):
            resolved.add(target)
    return sorted(resolved)


def _in_words(problems: list[str], shown: int = 3) -> str:
    """A run's problems as one line: the first ``shown``, then how many more."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f" (+{more} more)" if more > 0 else "")


def _manifest_problem(path: Path) -> str | None:
    """Why a run's ``run.json`` cannot be read as a JSON object, or None when it can."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"unreadable {schema.MANIFEST} ({err})"
    return None if isinstance(manifest, dict) else f"{schema.MANIFEST} is not a JSON object"


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


def _data_files(run: Path, table: str) -> list[Path]:
    return schema.committed_files(run)[table]


@functools.lru_cache(maxsize=4096)
def _read_footer(path: str, size: int, mtime_ns: int) -> pq.FileMetaData | str:
    try:
        return pq.read_metadata(path)
    except (OSError, pa.ArrowException) as exc:
        return f"{Path(path).name}: not a readable Parquet file ({str(exc).splitlines()[0][:200]})"


def footer(path: Path | str) -> pq.FileMetaData | str:
    """The Parquet footer of a data file, or why it cannot be read. Read once per path, size and modification
    time (a committed file does not change; one that does is read again), so every check of the same file
    (readability at each cursor, the stored bits, the batch sizes of the first pass) costs one read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{Path(path).name}: cannot be read ({exc.strerror or exc})"
    return _read_footer(str(path), st.st_size, st.st_mtime_ns)


def unreadable_files(files: Iterable[Path]) -> dict[Path, str]:
    """The ``files`` whose Parquet footer does not read (truncated, not Parquet, gone), with why."""
    return {f: problem for f in files if isinstance(problem := footer(f), str)}


def run_problems(run_dir: Path, files: Mapping[str, Sequence[Path]] | None = None) -> list[str]:
    """What a reader cannot read of a run: a ``run.json`` that is not a JSON object, committed data files
    (``files``: :func:`trustscope.schema.committed_files`, listed when None) and a vocabulary whose Parquet footer
    does not read. The one check behind :attr:`LogDB.broken_runs`, the dashboard's and the CLI's."""
    return _listed(*_check_run(run_dir, schema.committed_files(run_dir) if files is None else files))


def _listed(manifest: str | None, unreadable: Mapping[Path, str]) -> list[str]:
    return [p for p in [manifest] if p] + list(unreadable.values())


def _check_run(run_dir: Path, files: Mapping[str, Sequence[Path]]) -> tuple[str | None, dict[Path, str]]:
    """:func:`run_problems` as (the manifest's problem, the unreadable files with theirs)."""
    manifest = run_dir / schema.MANIFEST
    vocab = [run_dir / schema.VOCAB_FILE] if (run_dir / schema.VOCAB_FILE).is_file() else []
    return (_manifest_problem(manifest) if manifest.is_file() else None,
            unreadable_files([*vocab, *(f for table in files.values() for f in table)]))


def _load_sql(con: duckdb.DuckDBPyConnection, files: Iterable[Path], kind: str,
              on_stuck: Callable[[], None] | None = None, texts: dict[str, str] | None = None) -> None:
    """Run every ``.sql`` file, in dependency order: a file that names one not loaded yet waits for it.

    ``on_stuck`` is called once when no file can load (it may create what they wait for). ``texts`` replaces the
    text of the named files (the rendered ``rule_blocks``).
    """
    pending = {p.stem: p for p in files}
    texts = texts or {}
    while pending:
        errors, loaded = {}, 0
        for name, path in list(pending.items()):
            text = texts.get(name) or path.read_text()
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


def write_empty_files(folder: Path) -> dict[str, list[str]]:
    """An empty file of every table in ``folder``, always first in each file list: the views have every column
    even before the first file of a table lands, and a glob list is never empty. Returns the file lists that
    hold only them (table -> [its empty file]; ``manifests`` -> [an empty run.json])."""
    lists = {}
    for table in (*schema.TABLES, "vocab"):
        lists[table] = [str(folder / f"empty_{table}.parquet")]
        pq.write_table(schema.with_metadata(table).empty_table(), lists[table][0])
    (folder / "empty_run.json").write_text("")
    return {**lists, "manifests": [str(folder / "empty_run.json")]}


def render_rule_blocks(stored: Mapping[str, int] | None = None) -> str:
    """The ``rule_blocks`` view's SQL with its generated rule columns (``stored``: see :func:`rule_columns_sql`)."""
    return (VIEW_DIR / "rule_blocks.sql").read_text().replace(RULE_COLUMNS_MARKER, rule_columns_sql(stored))


def stored_variant(stored: Mapping[str, int]) -> tuple[str, bool]:
    """The ``rule_blocks`` SQL reading the ``stored`` rules' bits, and whether the cold pass should materialise it:
    only while a sequence rule is still evaluated in SQL (its windows sort every row; computed once, they are
    worth keeping). Without windows, each partial view reading the tokens again costs less than materialising
    35 columns per token (measured in ``docs/performance.md``)."""
    windows = any(rule.sql.sequence and rule.name not in stored for rule in sql_rules())
    return render_rule_blocks(stored), windows


def stored_rule_bits(files: Sequence[Path], rules: Mapping[str, dict[str, Any]]) -> dict[str, int]:
    """The rules whose ``blocked_rules`` bit (rule -> bit) the cold pass may read instead of evaluating the rule,
    for ``files`` (the parts of one flush, one run) and ``rules``, the parameters the views bind for that run (rule
    -> bindable parameters, see :meth:`LogDB._run_rule_sets`).

    A rule qualifies when every file's footer lists it (:data:`trustscope.schema.BLOCKED_RULES_META`) at the same
    bit and at exactly the bound parameters, and no row of any file lacks the bits (the column's statistics count
    no nulls). Anything else (files written before the column, by ``summaries=False``, from another rule list, a
    run that trained its rule at other parameters, a caller's counterfactual parameters) leaves the rule to its SQL.
    """
    common: dict[str, int] | None = None
    for f in files:
        meta = footer(f)
        if isinstance(meta, str):
            return {}
        listed = (meta.metadata or {}).get(schema.BLOCKED_RULES_META.encode())
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
                if name in rules and isinstance(params, dict) and _bindable(params) == rules[name]}
        common = here if common is None else {k: v for k, v in common.items() if here.get(k) == v}
    return common or {}


def aggregate_partials(cur: duckdb.DuckDBPyConnection, files: Sequence[str],
                       variant: tuple[str, bool] | None = None) -> list[dict[str, pa.Table]]:
    """Every partial view's rows for each of ``files``, the tokens files ``cur`` has bound (one query of
    :func:`batch_flushes`: the parts of one flush, or flushes that read the same stored bits), from one pass.

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
    inputs = [_quote(c) for c in cur.view("rule_blocks").columns if c in _PARTIAL_WORDS or c.startswith("blocks_")]
    source, kind = ("rule_blocks", "table") if variant is None else (f"({variant[0]})", "table" if variant[1] else "view")
    cur.execute(f"create temp {kind} rule_blocks as select {', '.join(inputs)} from {source}")
    tables = {view: _split_by_file(cur.view(view).to_arrow_table(), files) for view in _CACHED_PARTIALS}
    return [{view: by_file[f] for view, by_file in tables.items()} for f in files]


def _split_by_file(table: pa.Table, files: Sequence[str]) -> dict[str, pa.Table]:
    """``table``'s rows per ``source_file``, one for each of ``files`` (empty where it has none): one sort and
    zero-copy slices, not a filter per file."""
    if len(files) == 1:
        return {files[0]: table}
    codes = pc.dictionary_encode(table["source_file"].combine_chunks())
    index = codes.indices.to_numpy(zero_copy_only=False)  # (rows,) the row's file, as a dictionary code
    ordered = table.take(pa.array(np.argsort(index, kind="stable")))
    counts = np.bincount(index, minlength=len(codes.dictionary))
    starts = np.concatenate([[0], np.cumsum(counts)])
    by_name = {name: ordered.slice(starts[i], counts[i]) for i, name in enumerate(codes.dictionary.to_pylist())}
    return {f: by_name.get(f, table.slice(0, 0)) for f in files}


P = TypeVar("P", Path, str)

BATCH_ROWS = 8_000_000
"""Token rows the cold pass aggregates in one query when their flushes read the same stored bits without windows
(see :func:`batch_flushes`): fewer, larger queries, at a few hundred MB of DuckDB memory (measured in
``docs/performance.md``)."""


def batch_flushes(flushes: Sequence[list[P]], variants: Sequence[tuple[str, bool] | None]
                  ) -> list[tuple[list[P], tuple[str, bool] | None]]:
    """The cold pass's queries: ``(files, variant)``. A flush that needs the windows (no stored bits, or a
    sequence rule left to SQL) is one query, its parts together (see :func:`aggregate_partials`); flushes whose
    :func:`stored_variant` is the same and windowless share a query, up to :data:`BATCH_ROWS` rows, since no
    figure then depends on which file a response's other tokens are in."""
    out: list[tuple[list[P], tuple[str, bool] | None]] = []
    open_batches: dict[tuple[str, bool], tuple[list[P], int]] = {}
    for flush, variant in zip(flushes, variants, strict=True):
        if variant is None or variant[1]:
            out.append((list(flush), variant))
            continue
        rows = sum(0 if isinstance(meta := footer(f), str) else meta.num_rows for f in flush)
        files, have = open_batches.get(variant, ([], 0))
        if files and have + rows > BATCH_ROWS:
            out.append((files, variant))
            files, have = [], 0
        open_batches[variant] = ([*files, *flush], have + rows)
    out += [(files, variant) for variant, (files, _) in open_batches.items()]
    return out


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


class LogDB:
    """A DuckDB connection over one or many runs, with trustscope's macros, views and named analyses.

    Use :func:`connect`. Every method opens its own cursor, so one ``LogDB`` may serve several threads.
    """

    def __init__(self, paths: Sequence[Path | str], *, max_rows: int = DEFAULT_MAX_ROWS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache: bool = True,
                 cache_dir: Path | None = None, rule_params: dict[str, dict[str, Any]] | None = None,
                 memory_limit: float | None = None, storage_options: dict[str, Any] | None = None,
                 mirror_dir: Path | None = None, ray: RayAggregator | None = None) -> None:
        self.ray = ray
        """The Ray cluster the files that miss partial aggregates are aggregated on, or None: here."""
        self._private = Path(tempfile.mkdtemp(prefix="trustscope-db-"))
        self._resources = _Resources(self._private)
        self._finalizer = weakref.finalize(self, self._resources.release)
        self.mirror_dir = mirror_dir or (storage.default_mirror_root() if cache else self._private / "s3")
        """Where ``s3://`` paths are mirrored (see :func:`trustscope.storage.mirror`)."""
        self._stores = [storage.ObjectStore(str(p), storage_options, write=False)
                        for p in paths if storage.is_remote(p)]
        """The object store prefixes among ``paths``, mirrored again at every refresh."""
        mirrors = iter(self._sync_mirrors())
        self.paths = [(next(mirrors) if storage.is_remote(p) else Path(p)).resolve() for p in paths]
        self.rule_params = rule_parameters(rule_params)
        """Parameters of every rule where a run did not train with it: the defaults, or the caller's choice."""
        self._manifests: dict[Path, tuple[int, tuple[str | None, dict[str, Any]]]] = {}
        rendered = render_rule_blocks()
        self._rule_blocks = rendered
        """The ``rule_blocks`` view with one column per rule of the catalogue (the SQL worker loads it too)."""
        self._fingerprint = hashlib.sha256((_SQL_FINGERPRINT + rendered).encode()).hexdigest()
        self.max_rows = max_rows
        self.timeout_s = timeout_s
        self.memory_bytes = memory_limit_bytes(memory_limit)
        """Resident memory user SQL may use (see :func:`trustscope.sandbox.memory_limit_bytes`)."""
        self.broken_runs: dict[str, str] = {}
        """Runs that cannot be read whole: run directory name -> why (:func:`run_problems`: a manifest that is not
        JSON, data files whose Parquet footer does not read; a symlinked run created after the connection). What
        still reads of such a run is shown (its unreadable files are left out of every view); the other runs are
        unaffected."""
        self.cache_enabled = cache
        self.partials_computed = 0
        """How many tokens files this connection aggregated (their partials not found in memory or on disk)."""
        self.stored_bits_files = 0
        """How many of them read some rules' blocks from the logger's ``blocked_rules`` bits."""
        self.cache_dir = (cache_dir or default_cache_dir()) if cache else None
        self._lock = threading.Lock()
        self._partials: dict[str, dict[Path, tuple[tuple[int, int], pa.Table]]] = {v: {} for v in _CACHED_PARTIALS}
        self._merged: dict[str, pa.Table] = {}
        self._merged_files: list[Path] | None = None
        """The tokens files the merged kept aggregates were last built from."""
        self._cache_files: dict[str, tuple[pa.Table, int, str]] = {}
        """Kept aggregate name -> (the table last written for the SQL worker, its version, its file)."""
        self._late_links: dict[str, str] = {}
        self._unreadable: dict[Path, str] = {}
        """Committed data files whose Parquet footer does not read, left out of every file list (see :func:`footer`)."""
        write_empty_files(self._private)
        self.runs_dirs = _run_dirs(self.paths)
        self.con = duckdb.connect(config={"autoload_known_extensions": False,
                                          "autoinstall_known_extensions": False,
                                          "allow_community_extensions": False,
                                          "allow_persistent_secrets": False})
        self._prepare(self.con)
        _load_sql(self.con, sorted(MACRO_DIR.glob("*.sql")), "macro")
        _load_sql(self.con, sorted(VIEW_DIR.glob("*.sql")), "view", on_stuck=self._register_empty_caches,
                  texts={"rule_blocks": rendered})
        self._lock_down()

    def _sync_mirrors(self) -> list[Path]:
        """Bring the local mirror of every object store path up to date (raises StorageError naming the URL)."""
        return [storage.mirror(store.url, self.mirror_dir, store=store) for store in self._stores]

    def _register_empty_caches(self) -> None:
        """Register each kept-aggregate name, empty, with its partial view's columns (views reading it can load)."""
        for view, cache_name in _CACHED_PARTIALS.items():
            self._merged[cache_name] = self.con.view(view).limit(0).to_arrow_table()
            self.con.register(cache_name, self._merged[cache_name])

    # ------------------------------------------------------------------------------------------- set-up

    def _file_lists(self) -> dict[str, list[str]]:
        """The files of each table a reader should see (committed flushes only, see :func:`schema.committed_files`)."""
        lists: dict[str, list[str]] = {}
        committed = {run: schema.committed_files(run) for run in self.runs_dirs}
        checked = {run: _check_run(run, files) for run, files in committed.items()}
        self._unreadable = {f: problem for _, bad in checked.values() for f, problem in bad.items()}
        problems = {run.name: _listed(*found) for run, found in checked.items()}
        for table in schema.TABLES:
            files = [str(f) for run_files in committed.values() for f in run_files[table] if f not in self._unreadable]
            lists[table] = [str(self._private / f"empty_{table}.parquet"), *files]
        lists["vocab"] = [str(self._private / "empty_vocab.parquet")] + [
            str(run / schema.VOCAB_FILE) for run in self.runs_dirs
            if (run / schema.VOCAB_FILE).is_file() and run / schema.VOCAB_FILE not in self._unreadable
        ]
        self.broken_runs = {**{run: _in_words(found) for run, found in problems.items() if found}, **self._late_links}
        lists["manifests"] = [str(self._private / "empty_run.json")] + [
            str(run / schema.MANIFEST) for run, (manifest, _) in checked.items()
            if (run / schema.MANIFEST).is_file() and manifest is None and run.name not in self._late_links
        ]
        return lists

    def _params(self, **analysis: float) -> dict[str, Any]:
        unknown = set(analysis) - set(ANALYSIS_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown analysis parameter(s) {sorted(unknown)}; known: {sorted(ANALYSIS_DEFAULTS)}")
        runs = list(self._run_rule_sets().values())  # (run_id, its rule set)
        sets = [self.rule_params, *(rules for _, rules in runs)]
        run_sets = [{"run_id": "", "rule_set": 1}]  # set 1: the defaults or the caller's choice
        run_sets += [{"run_id": run_id, "rule_set": i} for i, (run_id, _) in enumerate(runs, start=2)]
        values = {rule: {param: [s[rule][param] for s in sets] for param in self.rule_params[rule]}
                  for rule in self.rule_params}
        return {"rules": self.rule_params, "rule_values": values, "run_sets": run_sets,
                "analysis": {**ANALYSIS_DEFAULTS, **analysis}}

    def _run_rule(self, run: Path) -> tuple[str | None, dict[str, Any]]:
        """The rule and parameters run ``run`` trained with (see :func:`run_rule`), re-read when run.json changes."""
        path = run / schema.MANIFEST
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return None, {}
        if run not in self._manifests or self._manifests[run][0] != stamp:
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                manifest = {}
            self._manifests[run] = (stamp, (manifest.get("run_id") or run.name, *run_rule(manifest)))
        return self._manifests[run][1]

    def _run_rule_sets(self) -> dict[Path, tuple[str, dict[str, dict[str, Any]]]]:
        """Per run directory: (run_id, every rule's parameters): the run's own rule with the parameters it trained
        with (its defaults where run.json records none, whatever the caller chose for counterfactuals), every other
        rule with :attr:`rule_params`. Parameters the rule rejects leave its defaults (see :meth:`run_rules`)."""
        out = {}
        for run in self.runs_dirs:
            run_id, rule, params = self._run_rule(run)
            rules = self.rule_params
            if rule in self.rule_params:
                try:
                    own = get_loss(rule).resolve(**params)
                except (TypeError, ValueError):
                    own = get_loss(rule).defaults
                rules = {**rules, rule: _bindable(own)}
            out[run] = (run_id, rules)
        return out

    def rules(self) -> pd.DataFrame:
        """The rule catalogue as the views see it: rule, family, sequence (reads the whole response), parameters
        (the counterfactual parameters, JSON), summary, and sql (False: the rule has no SQL mask family, so the
        views have no ``blocks_<rule>`` column for it). One row per registered rule, sorted by name."""
        rows = []
        for name in list_losses():
            rule = get_loss(name)
            rows.append({"rule": name, "family": rule.sql.family if rule.sql else None,
                         "sequence": bool(rule.sql and rule.sql.sequence),
                         "parameters": json.dumps({k: v for k, v in self.rule_params[name].items()
                                                   if k in rule.defaults}, default=str),
                         "summary": rule.doc, "sql": rule.sql is not None})
        return pd.DataFrame(rows)

    def run_rules(self) -> pd.DataFrame:
        """Per run: run_id, loss_rule (the rule it trained with, from run.json), parameters (JSON: those the SQL
        binds for that rule), and source: 'run' (the run's own parameters), 'defaults' (none recorded), 'unknown
        rule' (not registered in this process) or the error the rule raised on the recorded parameters."""
        rows = []
        for run in self.runs_dirs:
            run_id, rule, params = self._run_rule(run)
            if rule not in self.rule_params:
                rows.append({"run_id": run_id, "loss_rule": rule, "parameters": json.dumps(params, default=str),
                             "source": "unknown rule" if rule else "defaults"})
                continue
            try:
                bound, source = get_loss(rule).resolve(**params), "run" if params else "defaults"
            except (TypeError, ValueError) as err:
                bound, source = get_loss(rule).defaults, str(err)
            rows.append({"run_id": run_id, "loss_rule": rule, "parameters": json.dumps(bound, default=str),
                         "source": source})
        return pd.DataFrame(rows, columns=["run_id", "loss_rule", "parameters", "source"])

    def _prepare(self, con: duckdb.DuckDBPyConnection, **analysis: float) -> None:
        """Bind the file lists and parameters on ``con`` (DuckDB variables live per connection)."""
        con.execute("set variable trustscope_files = ?", [self._file_lists()])
        con.execute("set variable trustscope_params = ?", [self._params(**analysis)])

    def _lock_down(self) -> None:
        """Only the log directories, the targets of symlinked runs (the runs of this moment, kept in
        ``_allowed``) and the private empty files stay readable; then lock the configuration."""
        self._allowed = _readable(self.paths, self.runs_dirs)
        allowed = [str(p) + os.sep for p in self._allowed] + [str(self._private) + os.sep]
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
        """Pick up new runs and new files; when ``views`` read any kept aggregate, compute every partial aggregate
        of the files not seen before (once per file, all partial views from one pass over the parts of its flush,
        see :meth:`_aggregate_files`)."""
        needed = {c for v in views for c in _CACHES_READ_BY.get(v, ())}
        with self._lock:
            self._sync_mirrors()
            self.runs_dirs = self._reachable(_run_dirs(self.paths))
            self._prepare(self.con)
            if not needed:
                return
            files = [f for run in self.runs_dirs for f in _data_files(run, "tokens") if f not in self._unreadable]
            if not self._update_partials(files) and self._merged_files == files:
                return  # the merged tables stay the same objects (the sandbox rewrites only what changed)
            self._merged_files = files
            for view, cache_name in _CACHED_PARTIALS.items():
                empty = self._merged[cache_name].schema.empty_table()
                parts = [self._partials[view][f][1] for f in files if f in self._partials[view]]
                self._merged[cache_name] = (pa.concat_tables([empty, *parts], promote_options="permissive")
                                            if parts else empty)
                self.con.register(cache_name, self._merged[cache_name])

    def _update_partials(self, files: list[Path]) -> bool:
        """Bring every partial view's kept rows up to date with ``files``: drop files that are gone, read what is
        kept on disk, aggregate the files that still miss a view. Returns whether any kept rows changed."""
        changed = False
        current, todo = {}, []
        for f in files:
            st = f.stat()
            current[f] = (st.st_size, st.st_mtime_ns)
        for kept in self._partials.values():
            for gone in set(kept) - set(current):
                del kept[gone]
                changed = True
        for f, key in current.items():
            missing = [v for v, kept in self._partials.items()
                       if not self.cache_enabled or f not in kept or kept[f][0] != key]
            changed = changed or bool(missing)
            if self.cache_dir is not None:
                for view in list(missing):
                    stored = self._disk_path(view, f, key)
                    if stored.is_file():
                        self._partials[view][f] = (key, pq.read_table(stored))
                        missing.remove(view)
            if missing:
                todo.append(f)
        flushes = {flush_of(f) for f in todo}  # a flush's parts are aggregated together (see aggregate_partials)
        for f, tables in self._aggregate_files([f for f in current if flush_of(f) in flushes]):
            self.partials_computed += 1
            for view, table in tables.items():
                self._partials[view][f] = (current[f], table)
                if self.cache_dir is not None:
                    self._store(self._disk_path(view, f, current[f]), table)
        return changed

    def _aggregate_files(self, files: list[Path]) -> Iterator[tuple[Path, dict[str, pa.Table]]]:
        """``(file, every partial view's rows)`` for each of ``files``: as Ray tasks when a cluster is attached
        (in the order they finish), else here, one file after the other."""
        flushes = flush_groups(files)
        rule_sets, rendered = self._run_rule_sets(), {}
        variants = [self._stored_variant(flush, rule_sets, rendered) for flush in flushes]
        if self.ray is not None and files:
            yield from self.ray.aggregate(files, rule_blocks=self._rule_blocks, fingerprint=self._fingerprint,
                                          params=self._params(), variants={
                                              str(flush[0]): v for flush, v in zip(flushes, variants, strict=True)
                                              if v is not None})
            return
        for batch, variant in batch_flushes(flushes, variants):
            yield from zip(batch, self._aggregate_batch(batch, variant), strict=True)

    def _stored_variant(self, files: list[Path], rule_sets: dict[Path, tuple[str, dict[str, dict[str, Any]]]],
                        rendered: dict[tuple, tuple[str, bool]]) -> tuple[str, bool] | None:
        """The :func:`stored_variant` for ``files`` (one flush): the rules whose logged bits hold at this
        connection's parameters (:func:`stored_rule_bits`; ``rule_sets``: :meth:`_run_rule_sets`) read them; None
        when no rule's do. ``rendered`` keeps the variants already rendered, by their stored bits."""
        run = rule_sets.get(files[0].parent.parent)
        stored = stored_rule_bits(files, run[1] if run else self.rule_params)
        if not stored:
            return None
        self.stored_bits_files += len(files)
        key = tuple(sorted(stored.items()))
        if key not in rendered:
            rendered[key] = stored_variant(stored)
        return rendered[key]

    def _aggregate_batch(self, files: list[Path], variant: tuple[str, bool] | None) -> list[dict[str, pa.Table]]:
        """Every partial view's rows for each of ``files`` (one query of :func:`batch_flushes`), from one pass over
        them (:func:`aggregate_partials` on a cursor whose token list holds only ``files``)."""
        cur = self.cursor()
        try:
            lists = self._file_lists()
            cur.execute("set variable trustscope_files = ?",
                        [{**lists, "tokens": [lists["tokens"][0], *map(str, files)]}])
            return aggregate_partials(cur, [str(f) for f in files], variant)
        finally:
            cur.close()

    def _disk_path(self, view: str, file: Path, stat_key: tuple[int, int]) -> Path:
        """Where the partial aggregates of ``view`` over ``file`` are kept on disk: keyed by the view's SQL (and
        everything it reads), the bound parameters, the file's path, size and modification time."""
        own = self._run_rule_sets().get(file.parent.parent)
        params = {"rules": self.rule_params, "analysis": self._params()["analysis"], "own": own}
        key = hashlib.sha256(
            json.dumps([self._fingerprint, params, view, str(file), stat_key], default=str).encode()
        ).hexdigest()[:32]
        return self.cache_dir / view / f"{key}.parquet"

    @staticmethod
    def _store(path: Path, table: pa.Table) -> None:
        """Write atomically (temporary name, then rename); a cache that cannot be written is only slower.

        LZ4 without dictionaries or statistics: the partials are wide (four columns per rule) and read whole, so
        what those buy is size nobody needs. Measured on a 10M-row pass's 60 files (236k rows): writing 0.59 ->
        0.29 CPU s, reading 0.67 -> 0.40 s, 11.1 -> 12.2 MB (``docs/performance.md``)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            pq.write_table(table, tmp, compression="lz4", use_dictionary=False, write_statistics=False)
            tmp.replace(path)
        except OSError:
            pass

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
        self.con.close()
        self._finalizer()

    def __enter__(self) -> LogDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        return self._run_in_sandbox(query, max_rows, timeout_s)

    def _run_in_sandbox(self, query: str, max_rows: int, timeout_s: float) -> QueryResult:
        """Run ``query`` in the worker, unchecked (its engine cannot write either way: see the tests)."""
        words = set(re.findall(r"[a-z_]+", query.lower()))
        self.refresh(words & set(VIEWS))
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
        self.refresh(set(re.findall(r"[a-z_]+", _strip_comments(text))) & set(VIEWS))
        cur = self.cursor()
        try:
            return cur.execute(text, params).df()
        finally:
            cur.close()

    def version(self) -> str:
        """A hash of every run file's path, size and modification time: it changes whenever a file lands,
        grows or goes, so callers may cache results under it."""
        h = hashlib.blake2b(digest_size=12)
        with self._lock:
            self._sync_mirrors()
        for run in _run_dirs(self.paths):
            files = [run / schema.MANIFEST, run / schema.VOCAB_FILE]
            files += [f for table in schema.TABLES for f in _data_files(run, table)]
            for f in files:
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def _sandbox(self) -> Sandbox:
        """The SQL worker, with its read-only catalogue (this connection's macros and views, stored once)."""
        if self._resources.sandbox is None:
            folder = self._private / "sandbox"
            folder.mkdir()
            database = folder / "catalogue.duckdb"
            con = duckdb.connect(str(database), config={"autoload_known_extensions": False,
                                                        "autoinstall_known_extensions": False})
            try:
                self._prepare(con)
                for name, table in self._merged.items():
                    con.register(name, table.schema.empty_table())
                _load_sql(con, sorted(MACRO_DIR.glob("*.sql")), "macro")
                _load_sql(con, sorted(VIEW_DIR.glob("*.sql")), "view", texts={"rule_blocks": self._rule_blocks})
            finally:
                con.close()
            self._resources.sandbox = Sandbox(database, self.memory_bytes)
        return self._resources.sandbox

    def _write_caches(self) -> dict[str, tuple[int, str]]:
        """The kept aggregates as Arrow files the worker maps: name -> (version, path); rewritten on change."""
        out = {}
        for name, table in self._merged.items():
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
        n_response_tokens, mean_reward, manifest (JSON text). A run whose manifest cannot be read has status
        ``broken`` (the reason is in :attr:`broken_runs`); the other runs are unaffected."""
        df = self._frame("runs", refresh=True)
        if not self.broken_runs:
            return df
        missing = sorted(set(self.broken_runs) - set(df["run_id"]))
        df = pd.concat([df, pd.DataFrame({"run_id": missing, "n_steps": 0, "n_samples": 0,
                                                            "n_response_tokens": 0})], ignore_index=True) if missing else df
        df.loc[df["run_id"].isin(list(self.broken_runs)), "status"] = "broken"
        df["manifest"] = df["manifest"].astype(object).where(df["manifest"].notna(), None)  # no NaN for "none"
        return df.sort_values("run_id").reset_index(drop=True)

    def step_summary(self, run_ids: Sequence[str] | str | None = None) -> pd.DataFrame:
        """One row per (run, step), from the kept per-file aggregates (see ``sql/views/step_summary.sql``).

        Columns: run_id, step, n_tokens, n_samples, reward_mean, reward_std, length_mean, mismatch_mean
        (mean |pi - mu|), mismatch_max, prob_diff_max / prob_diff_min (signed pi - mu), binary_kl_mean/_max,
        topk_tv_mean/_max, topk_kl_mean/_max, ratio_min/_max, entropy_mean, n_positive, n_negative,
        n_zero_advantage, n_bad_negative, bad_negative_rate, n_nonzero_advantage, n_trainer_blocked,
        trainer_blocked_frac, and per rule R: n_blocked__R and blocked_frac__R (over the tokens with A != 0, which
        carry gradient), n_blocked_pos__R / blocked_frac_pos__R (A > 0), n_blocked_neg__R / blocked_frac_neg__R
        (A < 0).
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

    def overview(self, run_ids: Sequence[str] | str | None = None) -> Overview:
        """The overview figures of every run with a logged step (or of ``run_ids``), the one source of the Runs
        page and of ``trustscope report``: exact from the summaries table where a run has one (``summary_steps``,
        ``summary_blocked``: a few hundred rows a step, whatever the run's token count), else from its logged
        token rows (``step_summary``, ``blocked_fractions``: a sample when ``token_fraction`` < 1, which
        :attr:`Overview.sources` says). Token rows are read only for the runs without summaries.
        """
        wanted = None if run_ids is None else [run_ids] if isinstance(run_ids, str) else list(run_ids)
        self.refresh()
        fractions = {}
        for run in self.runs_dirs:  # run.json only: the overview reads no samples or token file to list runs
            try:
                manifest = json.loads((run / schema.MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict):
                fractions[manifest.get("run_id") or run.name] = _logged_fraction(manifest)
        ids = [r for r in fractions if wanted is None or r in wanted]
        if not ids:
            return Overview(pd.DataFrame(columns=list(OVERVIEW_COLUMNS)), pd.DataFrame(columns=list(BLOCKED_COLUMNS)),
                            pd.DataFrame(columns=["run_id", "exact", "token_fraction", "source"]))
        steps = [self._frame("summary_steps", where={"run_id": ids})]
        blocked = [self._frame("summary_blocked", where={"run_id": ids})]
        exact = set(steps[0]["run_id"])
        rest = [r for r in ids if r not in exact]
        if rest:
            logged = self.step_summary(rest).assign(bad_negative_delta=ANALYSIS_DEFAULTS["bad_negative_delta"])
            steps.append(logged[list(OVERVIEW_COLUMNS)])
            blocked.append(self.blocked_fractions(rest)[list(BLOCKED_COLUMNS)])
        shown = sorted(exact | set(steps[-1]["run_id"] if rest else ()))
        sources = pd.DataFrame({"run_id": shown, "exact": [r in exact for r in shown],
                                "token_fraction": [fractions[r] for r in shown]})
        sources["source"] = [source_sentence(e, f) for e, f in zip(sources["exact"], sources["token_fraction"],
                                                                   strict=True)]
        frames = [f for f in steps if len(f)]
        return Overview(
            steps=(pd.concat(frames, ignore_index=True) if frames else steps[0]).sort_values(["run_id", "step"])
            .reset_index(drop=True),
            blocked=pd.concat([f for f in blocked if len(f)] or blocked[:1], ignore_index=True),
            sources=sources)

    def blocked_fractions(self, run_ids: Sequence[str] | str | None = None,
                          rules: Sequence[str] | str | None = None) -> pd.DataFrame:
        """Long form of the blocked counts: run_id, step, rule, advantage_side ('all': A != 0, 'positive',
        'negative'), n_blocked, n_tokens, blocked_frac. Every rule on the same tokens (a run's own rule at its
        parameters, the others at their defaults or the caller's choice)."""
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
        """Token texts ranked by how often each rule blocks them (the ``top`` first per run and rule), counted over
        the tokens that carry gradient (A != 0).

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


def _logged_fraction(manifest: dict[str, Any]) -> float | None:
    """The ``token_fraction`` a run's logger kept (run.json's ``logging``), None when the manifest does not say."""
    logging = manifest.get("logging")
    value = logging.get("token_fraction") if isinstance(logging, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def load_rules(modules: str | Sequence[str] | None = None) -> list[str]:
    """Import rule modules by dotted path (``my_pkg.rules``, or ``my_pkg.rules:my_rule`` for one rule) so their
    ``@register_loss`` rules join the catalogue; ``modules`` defaults to ``$TRUSTSCOPE_RULES`` (comma-separated).
    Returns the registered rule names afterwards."""
    import importlib

    if modules is None:
        modules = os.environ.get(RULES_ENV, "")
    names = [m.strip() for m in modules.split(",")] if isinstance(modules, str) else list(modules)
    for name in filter(None, names):
        if ":" in name:
            get_loss(name)
            continue
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"{RULES_ENV}: cannot import rule module {name!r} ({err})") from None
    return list_losses()


def connect(logdir_or_runs: str | Path | Sequence[str | Path], *, max_rows: int = DEFAULT_MAX_ROWS,
            timeout_s: float = DEFAULT_TIMEOUT_S, cache: bool = True, cache_dir: str | Path | None = None,
            rule_params: dict[str, dict[str, Any]] | None = None,
            rules: str | Sequence[str] | None = None, memory_limit: float | None = None,
            storage_options: dict[str, Any] | None = None, mirror_dir: str | Path | None = None,
            ray: str | None = None, ray_fallback: str = "warn") -> LogDB:
    """Open a log directory, one run directory, or a list of them, as a locked-down :class:`LogDB`.

    Any of them may be an object store prefix, ``s3://bucket/prefix`` (``storage_options`` for
    ``s3fs.S3FileSystem``, else the usual AWS variables): its committed objects are mirrored into ``mirror_dir``
    (default :func:`trustscope.storage.default_mirror_root`; with ``cache=False`` a private folder) keyed by
    ETag, again at every refresh, and read there. A store that cannot be reached, or a missing bucket, raises
    :class:`trustscope.storage.StorageError` naming the URL and the cause.

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
    from trustscope.distributed import attach_ray  # here: it imports this module (and ray only when named)

    cluster = attach_ray(ray, fallback=ray_fallback)
    return LogDB([p if storage.is_remote(p) else Path(p) for p in paths], max_rows=max_rows, timeout_s=timeout_s,
                 cache=cache, cache_dir=Path(cache_dir) if cache_dir is not None else None, rule_params=rule_params,
                 memory_limit=memory_limit, storage_options=storage_options,
                 mirror_dir=Path(mirror_dir) if mirror_dir is not None else None, ray=cluster)


CONTRACTS_FILE = SQL_DIR / "contracts.yml"


def load_contracts() -> dict[str, dict[str, Any]]:
    """The data contracts of ``sql/contracts.yml``, generated from the rule catalogue where they say so:
    ``"@rules"`` (a column's accepted values) is every registered rule; ``"@rule_columns"`` (a column list) is
    every ``blocks_<rule>`` column of the rules with a SQL mask family, and each of those whose family is ``none``
    accepts only false."""
    import yaml

    contracts = yaml.safe_load(CONTRACTS_FILE.read_text())
    rules = sql_rules()
    for spec in contracts.values():
        for key in ("unique", "not_null"):
            if spec.get(key) == "@rule_columns":
                spec[key] = [f"blocks_{r.name}" for r in rules]
        for column, values in spec.get("accepted", {}).items():
            if values == "@rules":
                spec["accepted"][column] = list_losses()
        if spec.pop("never_blocking", None) == "@rule_columns":
            for r in rules:
                if r.sql.family == "none":
                    spec.setdefault("accepted", {})[f"blocks_{r.name}"] = [False]
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

