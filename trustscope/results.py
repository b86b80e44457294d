"""A user query's rows as text or a file: ``trustscope sql``'s output (table, csv, json, parquet)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from rich.table import Table

    from trustscope.query.connection import QueryResult

FORMATS = ("table", "csv", "json", "parquet")


def _float32_text(value: float) -> str:
    """A float32 value at float32 precision (its shortest text as a float32)."""
    import numpy as np

    return str(np.float32(value))


def _cell(value: object, float32: bool) -> str:
    if value is None:
        return "NULL"
    if float32 and isinstance(value, float):
        return _float32_text(value)
    return str(value)


def _float32_columns(table: pa.Table) -> list[bool]:
    return [pa.types.is_float32(f.type) for f in table.schema]


def result_table(result: QueryResult) -> Table:
    """A user query's rows as a rich table (float32 columns at float32 precision), with a caption when rows
    were cut."""
    from rich.table import Table

    table = Table(show_lines=False)
    for name in result.table.column_names:
        table.add_column(name, overflow="fold")
    narrow = _float32_columns(result.table)
    for row in result.table.to_pylist():
        table.add_row(*(_cell(v, f) for v, f in zip(row.values(), narrow, strict=True)))
    if result.truncated:
        table.caption = f"first {result.max_rows} rows shown (--max-rows)"
    return table


def _json_rows(table: pa.Table) -> list[dict[str, Any]]:
    narrow = dict(zip(table.column_names, _float32_columns(table), strict=True))
    return [{k: float(_float32_text(v)) if narrow[k] and isinstance(v, float) else v for k, v in row.items()}
            for row in table.to_pylist()]


def preload(fmt: str) -> None:
    """Import what :func:`write_result` needs for ``fmt`` (rich's table and console take 30 ms), so that a caller
    can have it loaded while it waits for the rows."""
    if fmt == "table":
        import rich.console
        import rich.table  # noqa: F401
    elif fmt == "csv":
        import pyarrow.csv  # noqa: F401


def write_result(result: QueryResult, fmt: str, out: Path | None = None) -> None:
    """Write a user query's rows as ``fmt`` (table, csv, json, parquet) to ``out`` or stdout."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
    from rich.console import Console

    if fmt == "parquet":
        if out is None:
            raise ValueError("parquet output needs a file (--out)")
        pq.write_table(result.table, out)
    elif fmt == "csv":
        buf = io.BytesIO()
        pacsv.write_csv(result.table, buf)
        _emit(buf.getvalue().decode(), out)
    elif fmt == "json":
        _emit(json.dumps(_json_rows(result.table), default=str, indent=1) + "\n", out)
    elif fmt == "table":
        if out is None:
            Console().print(result_table(result))
        else:
            console = Console(record=True, width=200, file=io.StringIO())
            console.print(result_table(result))
            out.write_text(console.export_text())
    else:
        raise ValueError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    if result.truncated and fmt != "table":
        print(f"note: output cut at {result.max_rows} rows (--max-rows)", file=sys.stderr)


def _emit(text: str, out: Path | None) -> None:
    if out is None:
        print(text, end="")
    else:
        Path(out).write_text(text)
