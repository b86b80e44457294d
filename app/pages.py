"""The dashboard's pages in menu order: the one list the router, the browser test, the benchmark and
``docs/architecture.md`` read. A new page is a file in ``app/views/`` and a line here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VIEWS = Path(__file__).resolve().parent / "views"
HEADING = "[data-testid='stMain'] h1"
PLOT = ".js-plotly-plot"


@dataclass(frozen=True)
class Page:
    """One page of the menu."""

    title: str
    file: str
    """The page's script, under ``app/views/``."""
    icon: str
    section: str
    """The menu heading the page is listed under."""
    ready: str = HEADING
    """A CSS selector that shows only once the page's data is in (the browser test and the benchmark wait for it)."""
    default: bool = False
    """The page ``/`` opens on."""

    @property
    def script(self) -> str:
        """The script's path as ``st.Page`` and ``st.switch_page`` take it (relative to ``app/main.py``)."""
        return f"views/{self.file}"

    @property
    def url_path(self) -> str:
        """The page's address under the server's root ('' for the default page)."""
        return "" if self.default else Path(self.file).stem


PAGES = (
    Page("Runs", "runs.py", ":material/monitoring:", "Training", PLOT, default=True),
    Page("Live", "live.py", ":material/autorenew:", "Training", PLOT),
    Page("Bad negative updates", "bad_updates.py", ":material/trending_down:", "Training", PLOT),
    Page("Ratio vs divergence", "ratio_divergence.py", ":material/scatter_plot:", "Trust region", PLOT),
    Page("Rules side by side", "rules.py", ":material/compare:", "Trust region", PLOT),
    Page("Counterfactual", "counterfactual.py", ":material/difference:", "Trust region",
         "[data-testid='stMetric']"),
    Page("Clipped tokens", "clipped_tokens.py", ":material/content_cut:", "Trust region"),
    Page("Where the mismatch lives", "mismatch_where.py", ":material/stacked_line_chart:", "Trust region"),
    Page("Explain the mismatch", "explain.py", ":material/troubleshoot:", "Trust region", PLOT),
    Page("Token explorer", "token_explorer.py", ":material/text_fields:", "Drill down", "span.tok"),
    Page("SQL console", "sql_console.py", ":material/terminal:", "Drill down", "[data-testid='stDataFrame']"),
)


def by_file(file: str) -> Page:
    """The page whose script is ``app/views/<file>``."""
    return next(p for p in PAGES if p.file == file)


def navigation() -> dict[str, list]:
    """The menu for ``st.navigation``: section -> its ``st.Page`` entries, in table order."""
    import streamlit as st

    menu: dict[str, list] = {}
    for page in PAGES:
        menu.setdefault(page.section, []).append(
            st.Page(page.script, title=page.title, icon=page.icon, default=page.default))
    return menu


def markdown_table() -> str:
    """The page table of ``docs/architecture.md`` (a test holds the two equal)."""
    rows = [f"| {p.title} | {p.section} | `app/views/{p.file}` |" for p in PAGES]
    return "\n".join(["| page | menu | file |", "|---|---|---|", *rows])
