"""The SQL catalogue: the macros and views of ``trustscope/sql``, what each view reads, and how a DuckDB gets them.

One place for every connection that needs the catalogue: the reader (:class:`~trustscope.query.connection.LogDB`),
the SQL worker (:mod:`trustscope.sandbox`) and the Ray tasks (:mod:`trustscope.distributed`). The catalogue is
built once per definition into a DuckDB file (:func:`catalogue_file`: keyed by the SQL, the rendered rule columns
and DuckDB's version) and opened read-only after that, so opening a log directory binds no view: views bind when a
query reads them, with the file lists and parameters of that cursor.

The rule catalogue drives the SQL: ``rule_blocks`` gets one generated ``blocks_<rule>`` column per registered rule
with a SQL mask family (:func:`rule_columns_sql`: identifiers only), and every per-rule aggregate reads those
columns, so a rule of an existing family needs no SQL.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from trustscope import runformat
from trustscope.columns import builtin_token_columns_sql, dimension_buckets_sql, dimension_columns_sql
from trustscope.losses import LossRule, get_loss, list_losses
from trustscope.masks import FAMILY_DIR

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
MACRO_DIR = SQL_DIR / "macros"
"""One scalar macro per file: divergences, buckets, parameters. The mask families' macros are beside their modules
(:data:`trustscope.masks.FAMILY_DIR`); :func:`macro_files` lists both."""
VIEW_DIR = SQL_DIR / "views"
TABLE_MACRO_DIR = SQL_DIR / "table_macros"
"""Table macros over the views (``create macro <name>(...) as table``), each in ``<name>.sql``: the rows several
queries start from, written once. DuckDB binds a table macro when it is made, so they load after the views."""
QUERY_DIR = SQL_DIR / "queries"
"""Parameterised queries over the views (``$name`` parameters), run by :meth:`LogDB.query`."""
DOCTOR_DIR = SQL_DIR / "doctor"
CATALOGUE_DIR = SQL_DIR / "__catalogue__"
"""Where the catalogue files are built, beside the SQL they are built from (a read-only install builds them in
the cache folder instead)."""
RULE_COLUMNS_MARKER = "/* rule columns */"
"""Where the generated ``blocks_<rule>`` columns go in ``views/rule_blocks.sql``."""

VIEWS = tuple(sorted(p.stem for p in VIEW_DIR.glob("*.sql")))
TABLE_MACROS = tuple(sorted(p.stem for p in TABLE_MACRO_DIR.glob("*.sql")))
QUERIES = tuple(sorted(p.stem for p in QUERY_DIR.glob("*.sql")))

CACHED_PARTIALS = {
    "step_partials": "step_partials_cache",
    "clipped_partials": "clipped_partials_cache",
    "histogram_partials": "histogram_partials_cache",
}
"""Partial-aggregate views kept per tokens file, and the name their merged rows are read under."""

CONNECTION_CONFIG = {"autoload_known_extensions": False, "autoinstall_known_extensions": False,
                     "allow_community_extensions": False, "allow_persistent_secrets": False}
"""DuckDB settings of every trustscope connection: nothing loads or installs code, no secret is stored."""


def strip_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql).lower()


def words(sql: str) -> set[str]:
    """The lowercase names a SQL text mentions, comments left out, with the names each table macro it calls
    mentions (so the views a query reads through a table macro count as read)."""
    found = set(re.findall(r"[a-z_]+", strip_comments(sql)))
    for name in sorted(found & set(TABLE_MACROS)):
        found |= set(re.findall(r"[a-z_]+", strip_comments((TABLE_MACRO_DIR / f"{name}.sql").read_text())))
    return found


TOKEN_COLUMNS_MARKER = "/* built-in token columns */"
"""Where a view lists the built-in tokens columns (to pass a run's own columns through): generated from
:data:`trustscope.columns.TOKEN_COLUMNS`, names only."""


DIMENSION_COLUMNS_MARKER = "/* dimension columns */"
DIMENSION_BUCKETS_MARKER = "/* dimension buckets */"
"""Where ``token_dimensions`` lists the summary dimensions' token columns and buckets each token row by every
dimension: generated from :data:`trustscope.columns.DIMENSIONS`, so a new dimension needs no SQL here."""


def view_text(view: str) -> str:
    """A view's SQL, its generated parts filled in: the built-in token columns list (:data:`TOKEN_COLUMNS_MARKER`)
    and the summary dimensions (:data:`DIMENSION_BUCKETS_MARKER`)."""
    return ((VIEW_DIR / f"{view}.sql").read_text().replace(TOKEN_COLUMNS_MARKER, builtin_token_columns_sql())
            .replace(DIMENSION_COLUMNS_MARKER, dimension_columns_sql())
            .replace(DIMENSION_BUCKETS_MARKER, dimension_buckets_sql()))


def macro_files() -> list[Path]:
    """Every scalar macro's file: :data:`MACRO_DIR`'s and the mask families' (:data:`FAMILY_DIR`), by name."""
    return sorted([*MACRO_DIR.glob("*.sql"), *FAMILY_DIR.glob("*.sql")], key=lambda p: p.name)


SQL_FINGERPRINT = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted([*macro_files(), *VIEW_DIR.glob("*.sql"),
                                             *TABLE_MACRO_DIR.glob("*.sql")]))
    + builtin_token_columns_sql().encode() + dimension_buckets_sql().encode()
).hexdigest()
"""Changes whenever a macro or view changes, so kept aggregates of an older definition are never reused."""


@functools.cache
def view_reads() -> dict[str, set[str]]:
    """For every view, the views and kept-aggregate names its SQL names directly."""
    names = set(VIEWS) | set(CACHED_PARTIALS.values())
    return {v: words((VIEW_DIR / f"{v}.sql").read_text()) & names - {v} for v in VIEWS}


def views_read(views: Iterable[str]) -> set[str]:
    """``views`` and every view they read, directly or through other views."""
    seen: set[str] = set()
    todo = [v for v in views if v in VIEWS]
    while todo:
        view = todo.pop()
        if view not in seen:
            seen.add(view)
            todo += [d for d in view_reads()[view] if d in VIEWS]
    return seen


def caches_read(views: Iterable[str]) -> set[str]:
    """The kept-aggregate names ``views`` read, directly or through other views."""
    cached = set(CACHED_PARTIALS.values())
    return {d for v in views_read(views) for d in view_reads()[v] if d in cached}


def load_order(views: Iterable[str] = VIEWS) -> list[str]:
    """``views`` and what they read, each after the views it reads (a view reading a kept aggregate after the
    partial view the aggregate is made from)."""
    partial_of = {cache: view for view, cache in CACHED_PARTIALS.items()}
    order: list[str] = []

    def visit(view: str, path: tuple[str, ...] = ()) -> None:
        if view in order:
            return
        if view in path:
            raise RuntimeError(f"views read each other in a circle: {' -> '.join((*path, view))}")
        for dep in sorted(view_reads()[view]):
            visit(partial_of.get(dep, dep), (*path, view))
        order.append(view)

    for view in sorted(views_read(views)):
        visit(view)
    return order


PARTIAL_WORDS = set().union(*(words((VIEW_DIR / f"{v}.sql").read_text()) for v in CACHED_PARTIALS))
"""Every name the partial views' SQL mentions: the ``rule_blocks`` columns among them (and every ``blocks_<rule>``
column, read through ``columns('^blocks_...')``) are the ones the cold pass materialises."""


def sql_rules() -> list[LossRule]:
    """The registered rules that declare a SQL mask family (the ones the views can show), sorted by name.

    Raises ValueError naming the rule when its family has no macro file ``masks/<family>_blocks.sql``."""
    rules = [get_loss(name) for name in list_losses() if get_loss(name).sql is not None]
    for rule in rules:
        if not (FAMILY_DIR / f"{rule.sql.family}_blocks.sql").is_file():
            raise ValueError(f"loss rule {rule.name!r}: sql family {rule.sql.family!r} has no macro "
                             f"{FAMILY_DIR / (rule.sql.family + '_blocks.sql')}")
    return rules


def quote(identifier: str) -> str:
    """A validated identifier, double-quoted for SQL (names come from the registry: lowercase, digits, '_')."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", identifier):
        raise ValueError(f"{identifier!r} is not a valid SQL identifier here")
    return f'"{identifier}"'


def quote_any(name: str) -> str:
    """Any column name DuckDB reports, double-quoted (its quotes doubled): for DDL generated from a view's own
    columns, never from user input."""
    return '"' + name.replace('"', '""') + '"'


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
            if not 0 <= bit < runformat.MAX_BLOCKED_RULES:
                raise ValueError(f"rule {rule.name!r}: bit {bit} is outside blocked_rules' 0..{runformat.MAX_BLOCKED_RULES - 1}")
            lines.append(f",\n        (blocked_rules & {1 << bit}) != 0 as {quote('blocks_' + rule.name)}")
            continue
        mask = rule.sql
        args = ["null" if c is None else quote(c) for c in mask.columns]
        args += ["null" if p is None else f"rule_values().{quote(rule.name)}.{quote(p)}[rule_set]"
                 for p in mask.params]
        call = f"{mask.family}_blocks({', '.join(args)})"
        lines.append(f",\n        coalesce({call}, false) as {quote('blocks_' + rule.name)}")
    return "".join(lines) + score_columns_sql()


def score_columns_sql() -> str:
    """The generated ``score_<rule>`` columns of ``rule_blocks``: for every rule with a scalar threshold
    (:class:`trustscope.losses.Threshold`), the scale at which it starts to block the token, from its family's
    ``<family>_score`` macro with the same arguments as its ``_blocks`` macro (null: blocked at no scale). Read by
    the equal-budget queries only: the cold pass does not materialise them."""
    lines = []
    for rule in sql_rules():
        mask = rule.sql
        if mask.threshold is None:
            continue
        if not (FAMILY_DIR / f"{mask.family}_score.sql").is_file():
            raise ValueError(f"loss rule {rule.name!r}: sql family {mask.family!r} declares a threshold but has no "
                             f"macro {FAMILY_DIR / (mask.family + '_score.sql')}")
        args = ["null" if c is None else quote(c) for c in mask.columns]
        args += ["null" if p is None else f"rule_values().{quote(rule.name)}.{quote(p)}[rule_set]"
                 for p in mask.params]
        lines.append(f",\n        {mask.family}_score({', '.join(args)})::double as {quote('score_' + rule.name)}")
    return "".join(lines)


def render_rule_blocks(stored: Mapping[str, int] | None = None) -> str:
    """The ``rule_blocks`` view's SQL with its generated rule columns (``stored``: see :func:`rule_columns_sql`)."""
    return (VIEW_DIR / "rule_blocks.sql").read_text().replace(RULE_COLUMNS_MARKER, rule_columns_sql(stored))


def write_empty_files(folder: Path) -> dict[str, list[str]]:
    """An empty file of every table in ``folder``, always first in each file list: the views have every column
    even before the first file of a table lands, and a glob list is never empty. Returns the file lists that
    hold only them (table -> [its empty file]; ``manifests`` -> [an empty run.json])."""
    lists = {}
    for table in (*runformat.TABLES, "vocab"):
        lists[table] = [str(folder / f"empty_{table}.parquet")]
        pq.ParquetWriter(lists[table][0], runformat.with_metadata(table)).close()  # no Table: pyarrow's imports pandas
    (folder / "empty_run.json").write_text("")
    return {**lists, "manifests": [str(folder / "empty_run.json")]}


def load_macros(con: duckdb.DuckDBPyConnection) -> None:
    """Every scalar macro (:func:`macro_files`); a macro that names one not loaded yet waits for it."""
    files = {p.stem: p for p in macro_files()}
    pending = {name: path.read_text() for name, path in files.items()}
    while pending:
        errors, loaded = {}, 0
        for name, text in list(pending.items()):
            try:
                con.execute(text)
            except duckdb.CatalogException as err:
                errors[name] = err
                continue
            del pending[name]
            loaded += 1
        if errors and not loaded:
            name, err = next(iter(errors.items()))
            raise RuntimeError(f"cannot load macro {name!r} from {files[name]}: {err}")


def install(con: duckdb.DuckDBPyConnection, rule_blocks: str, views: Iterable[str] = VIEWS,
            on_partial: Callable[[str], None] | None = None) -> None:
    """The macros and ``views`` (with what they read) on ``con``, in dependency order. ``rule_blocks``: the
    rendered ``rule_blocks`` view (:func:`render_rule_blocks`). ``con`` has the file lists and parameters bound
    (any will do: views bind again whenever a query reads them). ``on_partial(view)`` is called after each partial
    view loads, before the views reading its kept aggregate (default: an empty table of its columns under the
    kept aggregate's name)."""
    load_macros(con)
    installed = load_order(views)
    for view in installed:
        text = rule_blocks if view == "rule_blocks" else view_text(view)
        con.execute(f"create or replace view {view} as\n{text}")
        if view in CACHED_PARTIALS:
            if on_partial is not None:
                on_partial(view)
            else:  # an empty table of the partial view's columns, from its bound types (nothing is run)
                columns = ", ".join(f"{quote_any(name)} {kind}" for name, kind, *_ in
                                    con.execute(f"describe {view}").fetchall())
                con.execute(f"create or replace table {CACHED_PARTIALS[view]} ({columns})")
    for name in TABLE_MACROS:  # the views they read are there (one that reads a view left out is left out)
        text = (TABLE_MACRO_DIR / f"{name}.sql").read_text()
        if words(text) & set(VIEWS) <= set(installed):
            con.execute(text)


def fingerprint(rule_blocks: str) -> str:
    """What the catalogue and every kept aggregate depend on: the SQL files and the rendered rule columns."""
    return hashlib.sha256((SQL_FINGERPRINT + rule_blocks).encode()).hexdigest()


def catalogue_file(rule_blocks: str, params: Mapping[str, object], folder: Path) -> Path:
    """A DuckDB file holding the macros, the views and empty kept-aggregate tables, under ``folder``: built once
    per :func:`fingerprint` and DuckDB version (written under a temporary name, then renamed), then reused by every
    connection and process. ``params``: any bindable parameters (the views bind them at creation only).
    """
    key = hashlib.sha256(f"{fingerprint(rule_blocks)}\0{duckdb.__version__}".encode()).hexdigest()[:24]
    path = folder / f"catalogue-{key}.duckdb"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as build:
        lists = write_empty_files(Path(build))
        tmp = Path(build) / path.name
        con = duckdb.connect(str(tmp), config=CONNECTION_CONFIG)
        try:
            con.execute("set variable trustscope_files = ?", [lists])
            con.execute("set variable trustscope_params = ?", [dict(params)])
            install(con, rule_blocks)
            con.execute("checkpoint")
        finally:
            con.close()
        os.replace(tmp, path)
    return path

