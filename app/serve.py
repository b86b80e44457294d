"""The dashboard's server process: Streamlit's own command line (``serve.py run app/main.py ...``), with the
modules every page imports loaded on a background thread while the server starts.

A page's first script run would otherwise import pandas, plotly, the app and the query layer itself (about a CPU
second on two cores) after the browser asked for it; here that work overlaps the server's start and the browser's
own (loading Streamlit's frontend takes it longer than that). Then it computes what the first page (Runs) reads
(:func:`app.data.prepare`: the run table, the overview, the default comparison's scalars and signals) into the
caches that page's session hits. A page that runs before the thread is done waits on Python's import lock for the
module it needs, or computes a read itself, as it would have anyway.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRELOAD = ("pandas", "plotly.graph_objects", "trustscope.db", "trustscope.figures", "app.data", "app.widgets",
           "app.pages", "app.auth")
"""What the router and the pages import before they draw anything, heaviest first."""


def served_logdir(argv: list[str]) -> str:
    """The log directory the server is started on: ``--logdir`` after the script's ``--``, else
    ``$TRUSTSCOPE_LOGDIR``, else the sample logs (as :func:`app.data.resolve_logdir` reads it in a session)."""
    from app.launch import LOGDIR_ENV, default_logdir

    args = argv[argv.index("--") + 1:] if "--" in argv else []
    given = args[args.index("--logdir") + 1] if "--logdir" in args[:-1] else None
    return str(given or os.environ.get(LOGDIR_ENV) or default_logdir())


def preload(modules: tuple[str, ...] = PRELOAD, logdir: str | None = None) -> threading.Thread:
    """Import ``modules`` on a daemon thread, then (with ``logdir``) compute what the first page reads
    (:func:`app.data.prepare`) into the caches its session then hits; a module that fails to import, or a log
    directory that cannot be read, is left for the page to report."""
    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # the page that needs it raises the same error where the user sees it
                continue
        if logdir is not None:
            try:
                from app import data
                from app.sections import doctor

                data.prepare(logdir, then=(("doctor", doctor.panel_of),))
            except Exception:  # the page computes it and reports what went wrong
                pass

    thread = threading.Thread(target=load, name="trustscope-preload", daemon=True)
    thread.start()
    return thread


def main() -> None:
    from streamlit.web import cli  # streamlit itself first: the thread then imports only what it does not

    preload(logdir=served_logdir(sys.argv))
    sys.argv[0] = "streamlit"
    cli.main()


if __name__ == "__main__":
    main()
