"""Terminal tables that read right at any width: figures to the digits their size needs, run ids without the prefix
they share, and tables fitted to the terminal by leaving out columns in a stated order (never cutting a cell).
Shared by the report's sections (:mod:`trustscope.report`, :mod:`trustscope.report_where`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
from rich import box
from rich.table import Table
from rich.text import Text


def fmt(value: float | None, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec``; ``-`` for None or NaN."""
    return "-" if value is None or pd.isna(value) else format(value, spec)


def short_names(run_ids: list[str]) -> tuple[str, dict[str, str]]:
    """The prefix every run id shares (cut at a ``-`` or ``_``) and each id without it, so narrow tables keep
    the part that tells runs apart."""
    if len(run_ids) < 2:
        return "", {r: r for r in run_ids}
    prefix = run_ids[0]
    for run_id in run_ids[1:]:
        while not run_id.startswith(prefix):
            prefix = prefix[:-1]
    cut = max(prefix.rfind("-"), prefix.rfind("_"))
    prefix = prefix[:cut + 1] if cut >= 0 else ""
    return prefix, {r: r[len(prefix):] or r for r in run_ids}


def sig(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, in scientific notation below 1e-3 or from 1e6 (so 0.000021
    reads ``2.1e-05``, never ``0.0000``); ``-`` for None or NaN."""
    if value is None or pd.isna(value):
        return "-"
    value = float(value)
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e6:
        return f"{value:#.{digits}g}".rstrip(".")
    return f"{value:.{digits - 1}e}"


@dataclass
class Column:
    """One column of a table fitted to the terminal (:func:`fitted_table`): its heading, cells, alignment, and
    ``drop``: the order in which columns are left out when the table is too wide (1 first; 0 never)."""

    name: str
    cells: list
    justify: str = "right"
    drop: int = 0


def cell_width(cell: object) -> int:
    """The terminal cells a table cell (markup text, rich Text or anything else) takes."""
    return Text.from_markup(cell).cell_len if isinstance(cell, str) else cell.cell_len if isinstance(cell, Text) \
        else len(str(cell))


def fitted_table(columns: list[Column], width: int | None, **options: Any) -> tuple[Table, list[str]]:
    """A rich table of ``columns`` that fits in ``width`` cells without cutting a cell: columns are left out in
    their ``drop`` order (1 first) until the widest cell of each, plus the padding, fits; no cell wraps or is cut.
    Returns the table and the names of the columns left out (for the caption). ``width`` None: every column."""
    kept = list(columns)
    dropped: list[str] = []

    def needed(cols: list[Column]) -> int:
        # no edges; between two columns a divider and a cell of padding on each side
        return sum(max(cell_width(c) for c in [col.name, *col.cells]) for col in cols) + 3 * (len(cols) - 1)

    while width is not None and needed(kept) > width and any(c.drop for c in kept):
        worst = min((c for c in kept if c.drop), key=lambda c: c.drop)
        kept.remove(worst)
        dropped.append(worst.name)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), **options)
    for col in kept:
        table.add_column(col.name, justify=col.justify, no_wrap=True)
    for i in range(len(columns[0].cells) if columns else 0):
        table.add_row(*(col.cells[i] for col in kept))
    return table, dropped


def left_out(dropped: list[str]) -> str:
    """The caption's clause naming the columns :func:`fitted_table` left out (empty when none was)."""
    return (f"; at this width left out: {', '.join(dropped)} (a wider terminal shows them; --format json has "
            "every figure)") if dropped else ""
