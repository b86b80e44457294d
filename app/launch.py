"""Start the dashboard server: ``trustscope dashboard [LOGDIR]`` calls :func:`launch`.

Kept free of Streamlit imports so the command line starts fast; Streamlit runs in the process this one becomes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"
LOGDIR_ENV = "TRUSTSCOPE_LOGDIR"


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
        sys.executable, "-m", "streamlit", "run", str(MAIN),
        "--server.address", host,
        "--server.port", str(port),
        "--server.headless", "true",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
        "--", "--logdir", str(logdir),
    ]


def launch(logdir: Path | str | None, host: str = "127.0.0.1", port: int = 8501) -> None:
    """Replace this process with the Streamlit server (so signals reach it directly); never returns. An
    ``s3://`` prefix is passed on as it is (the dashboard checks it when it opens)."""
    if not (isinstance(logdir, str) and logdir.startswith("s3://")):
        logdir = Path(logdir or default_logdir()).resolve()
        if not logdir.exists():
            raise FileNotFoundError(f"log directory {logdir} does not exist")
        if not logdir.is_dir():
            raise NotADirectoryError(f"log directory {logdir} is not a directory")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    cmd = streamlit_command(logdir, host, port)
    env = {**os.environ, LOGDIR_ENV: str(logdir)}
    print(f"trustscope dashboard: http://{host}:{port} over {logdir}", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, env)
