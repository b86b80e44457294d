"""Start the dashboard server: ``trustscope dashboard [LOGDIR]`` calls :func:`launch`.

Kept free of Streamlit imports so the command line starts fast; Streamlit runs in the process this one becomes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"
SERVE = MAIN.with_name("serve.py")
LOGDIR_ENV = "TRUSTSCOPE_LOGDIR"
FOCUS_ENV = "TRUSTSCOPE_FOCUS_RUN"
"""A run the dashboard opens on: first in the Runs page's default comparison, so the drill-down pages open on it."""
CACHE_DATA_BUDGET = "256mb"
"""The most every ``st.cache_data`` entry together may hold, serialized, across functions and sessions (Streamlit's
``server.maxCacheDataSize``: least recently used entries go first). A live run changes the log directory's version
with every file it commits, which keys every cached read afresh: without a budget the entries of past versions stay
until each function's ``max_entries``, at a size that grows with the log."""


def default_logdir() -> Path:
    """The sample logs of the checkout (``<repo>/sample_logs``), else those shipped inside the package."""
    import trustscope

    candidates = [MAIN.parent.parent / "sample_logs", Path(trustscope.__file__).resolve().parent / "sample_logs"]
    for path in candidates:
        if path.is_dir():
            return path
    return candidates[0]


def streamlit_command(logdir: Path | str, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The ``streamlit run`` command line serving the dashboard over ``logdir`` on ``host:port``."""
    return [
        sys.executable, str(SERVE), "run", str(MAIN),
        "--server.address", host,
        "--server.port", str(port),
        "--server.headless", "true",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
        "--server.maxCacheDataSize", CACHE_DATA_BUDGET,
        "--", "--logdir", str(logdir),
    ]


def launch(logdir: Path | str | None, host: str = "127.0.0.1", port: int = 8501, token: str | None = None,
           no_auth: bool = False) -> None:
    """Replace this process with the Streamlit server (so signals reach it directly); never returns. An
    ``s3://`` prefix is passed on as it is (the dashboard checks it when it opens).

    Who may read it is :func:`app.auth.plan`'s call: on an address other than loopback, an access token (``token``,
    ``$TRUSTSCOPE_DASHBOARD_TOKEN``, or one generated and printed with the URL when stderr is a terminal) or the
    OIDC provider of ``.streamlit/secrets.toml``; else :class:`app.auth.AuthError` unless ``no_auth``. The token
    reaches Streamlit in its environment, never on its command line (which ``ps`` shows to every user)."""
    from app import auth

    if not (isinstance(logdir, str) and logdir.startswith("s3://")):
        logdir = Path(logdir or default_logdir()).resolve()
        if not logdir.exists():
            raise FileNotFoundError(f"log directory {logdir} does not exist")
        if not logdir.is_dir():
            raise NotADirectoryError(f"log directory {logdir} is not a directory")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    chosen = auth.plan(host, token=token, no_auth=no_auth, interactive=sys.stderr.isatty())
    cmd = streamlit_command(logdir, host, port)
    env = {**os.environ, LOGDIR_ENV: str(logdir)}
    for name, value in chosen.env.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    for warning in chosen.warnings:
        print(warning, file=sys.stderr, flush=True)
    url = f"http://{auth.display_host(host)}:{port}"
    if chosen.generated:  # only ever printed to a terminal (plan generates none otherwise)
        url += f"/?{auth.TOKEN_PARAM}={env[auth.TOKEN_ENV]}"
    signed = {"token": f" (asks for the access token of --token / {auth.TOKEN_ENV})" if not chosen.generated
              else " (the link carries the access token: share it only with those who may read every run)",
              "oidc": " (sign-in through the [auth] provider of .streamlit/secrets.toml)"}.get(chosen.mode, "")
    print(f"trustscope dashboard: {url} over {logdir}{signed}", file=sys.stderr, flush=True)
    if isinstance(logdir, Path):
        warm_up(logdir, env)
    os.execve(cmd[0], cmd, env)


def warm_up(logdir: Path, env: dict[str, str]) -> subprocess.Popen:
    """Open ``logdir`` once in a background process while the server starts: the SQL catalogue is built and every
    kept aggregate computed and stored in the cache (``TRUSTSCOPE_CACHE``), so the first page a browser asks for
    reads them instead of computing them. Its own session, at a lower priority than the server, its output and
    failures dropped: a page computes whatever it did not. It ends when done."""
    return subprocess.Popen([sys.executable, "-c", WARM_UP, str(logdir)], env=env, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


WARM_UP = """
import os, sys
os.nice(10)
from trustscope.db import VIEWS, connect
with connect(sys.argv[1]) as db:
    db.refresh(VIEWS)
"""
