"""The dashboard's server process: Streamlit's own command line (``serve.py run app/main.py ...``), with the
modules every page imports loaded on a background thread while the server starts.

A page's first script run would otherwise import pandas, plotly, the app and the query layer itself (about a CPU
second on two cores) after the browser asked for it; here that work overlaps the server's start and the browser's
own (loading Streamlit's frontend takes it longer than that). The thread only imports: a page that runs before it is
done waits on Python's import lock for the module it needs, as it would have imported it anyway.
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRELOAD = ("pandas", "plotly.graph_objects", "trustscope.db", "trustscope.figures", "app.data", "app.widgets",
           "app.pages", "app.auth")
"""What the router and the pages import before they draw anything, heaviest first."""


def preload(modules: tuple[str, ...] = PRELOAD) -> threading.Thread:
    """Import ``modules`` on a daemon thread; a module that fails to import is left for the page to report."""
    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # the page that needs it raises the same error where the user sees it
                continue

    thread = threading.Thread(target=load, name="trustscope-preload", daemon=True)
    thread.start()
    return thread


def main() -> None:
    from streamlit.web import cli  # streamlit itself first: the thread then imports only what it does not

    preload()
    sys.argv[0] = "streamlit"
    cli.main()


if __name__ == "__main__":
    main()
