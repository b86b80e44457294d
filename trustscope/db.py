"""Open a log directory as a DuckDB database: the query layer's public face.

    db = connect("logs/")                    # a log directory, one run directory, or a list of either
    db = connect("s3://bucket/logs")         # an object store prefix (read through a local mirror)
    db.step_summary()                        # pandas DataFrame, one row per (run, step)
    db.sql("select rule, count(*) from clipped_tokens group by rule")   # read-only, row limit, timeout

The layer lives in :mod:`trustscope.query`, one job a module: the SQL catalogue and its install
(:mod:`~trustscope.query.catalogue`), the rule bindings (:mod:`~trustscope.query.rules`), the runs and their
readable files (:mod:`~trustscope.query.runs`), the kept aggregates and their first pass
(:mod:`~trustscope.query.partials`), the connection (:mod:`~trustscope.query.connection`), the named analyses
(:mod:`~trustscope.query.analyses`) and the data contracts (:mod:`~trustscope.query.contracts`). This module names
what callers use.
"""

from trustscope.query.analyses import BLOCKED_COLUMNS, OVERVIEW_COLUMNS, Overview, source_sentence
from trustscope.query.catalogue import (
    CACHED_PARTIALS,
    MACRO_DIR,
    QUERIES,
    QUERY_DIR,
    SQL_DIR,
    VIEW_DIR,
    VIEWS,
    render_rule_blocks,
    rule_columns_sql,
    sql_rules,
    write_empty_files,
)
from trustscope.query.connection import (
    DEFAULT_MAX_ROWS,
    DEFAULT_TIMEOUT_S,
    LogDB,
    NoRunsFound,
    QueryResult,
    connect,
    connect_readable,
    default_cache_dir,
)
from trustscope.query.contracts import check_contracts, load_contracts
from trustscope.query.partials import (
    BATCH_ROWS,
    Variant,
    aggregate_partials,
    batch_flushes,
    flush_groups,
    flush_of,
    stored_rule_bits,
    stored_variant,
)
from trustscope.query.rules import ANALYSIS_DEFAULTS, RULES_ENV, load_rules, rule_parameters, run_rule
from trustscope.query.runs import data_files, footer, run_dirs, run_problems, unreadable_files
from trustscope.sandbox import QueryMemoryLimit, QueryRefused, QueryStopped, QueryTimeout

__all__ = [
    "ANALYSIS_DEFAULTS",
    "BATCH_ROWS",
    "BLOCKED_COLUMNS",
    "CACHED_PARTIALS",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_TIMEOUT_S",
    "MACRO_DIR",
    "OVERVIEW_COLUMNS",
    "QUERIES",
    "QUERY_DIR",
    "RULES_ENV",
    "SQL_DIR",
    "VIEWS",
    "VIEW_DIR",
    "LogDB",
    "NoRunsFound",
    "Overview",
    "QueryMemoryLimit",
    "QueryRefused",
    "QueryResult",
    "QueryStopped",
    "QueryTimeout",
    "Variant",
    "aggregate_partials",
    "batch_flushes",
    "check_contracts",
    "connect",
    "connect_readable",
    "data_files",
    "default_cache_dir",
    "flush_groups",
    "flush_of",
    "footer",
    "load_contracts",
    "load_rules",
    "render_rule_blocks",
    "rule_columns_sql",
    "rule_parameters",
    "run_dirs",
    "run_problems",
    "run_rule",
    "source_sentence",
    "sql_rules",
    "stored_rule_bits",
    "stored_variant",
    "unreadable_files",
    "write_empty_files",
]
