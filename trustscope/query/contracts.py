"""The data contracts of the views (``sql/contracts.yml``): key columns unique and not null, accepted values, ranges.

Checked on ``sample_logs/`` and synthetic logs by the tests (:func:`check_contracts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from trustscope.losses import list_losses
from trustscope.query.catalogue import SQL_DIR, sql_rules

if TYPE_CHECKING:
    from trustscope.query.connection import LogDB

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

        def read(cur: duckdb.DuckDBPyConnection, view: str = view, spec: dict[str, Any] = spec) -> pa.Table | str:
            rel = cur.view(view)
            wanted = [*spec.get("unique", []), *spec.get("not_null", []), *spec.get("accepted", {}),
                      *spec.get("between", {})]
            missing = sorted(set(wanted) - set(rel.columns))
            if missing:
                return f"{view}: contract names missing column(s) {missing}"
            return rel.select(*(duckdb.ColumnExpression(c) for c in dict.fromkeys(wanted))).to_arrow_table()

        data = db.read(read)  # listed again when a compaction swaps a rank folder under the read
        if isinstance(data, str):
            problems.append(data)
            continue
        problems += table_problems(view, spec, data)
    return problems


def table_problems(view: str, spec: dict[str, Any], data: pa.Table) -> list[str]:
    import pyarrow.compute as pc

    problems = []
    keys = spec.get("unique", [])
    nullable = set(spec.get("nullable_keys", []))
    for column in [*(k for k in keys if k not in nullable), *spec.get("not_null", [])]:
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
