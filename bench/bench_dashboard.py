"""Time every dashboard page in a real headless Chromium, cold and warm, over the sample logs and a demo run.

    .venv/bin/python bench/bench_dashboard.py                         # sample_logs/ and a fresh 12-step demo run
    .venv/bin/python bench/bench_dashboard.py --demo runs/demo        # that demo log (trained there when missing)
    .venv/bin/python bench/bench_dashboard.py --no-demo --pages runs,rules
    .venv/bin/python bench/bench_dashboard.py --app /tmp/before/app/main.py     # another checkout's dashboard

For each log directory and each page of :data:`app.pages.PAGES`:
  cold  a fresh ``trustscope dashboard`` server with a new, empty ``TRUSTSCOPE_CACHE`` (a log never opened
        before): from the browser's request of the page to the page drawn,
  warm  the same page opened again in a new tab of the same server (its caches filled, a new session);
each with the server process's CPU seconds over the visit beside it (the machine's load does not inflate those).
"Drawn" is: the page's script run over, the page's ready selector shown (:attr:`app.pages.Page.ready`) and every
plotly chart laid out by plotly.js in the browser. The server's own start (to its health check answering) is
reported apart. Needs Debian's chromium (``/usr/bin/chromium``) and playwright (``setup.sh --test``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.launch import MAIN, streamlit_command  # noqa: E402
from app.pages import PAGES, Page  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TRUSTSCOPE = Path(sys.executable).with_name("trustscope")
DRAWN = """() => [...document.querySelectorAll('.js-plotly-plot')].every(gd => gd._fullLayout && gd._fullData)"""
LIMIT = {"cold": 2.0, "warm": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``trustscope dashboard LOGDIR`` on a free port with a new, empty cache; ``started`` is the seconds from
    the command to its health check answering."""

    def __init__(self, logdir: Path, main: Path | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = tempfile.mkdtemp(prefix="bench-dashboard-cache-")
        env = {**os.environ, "TRUSTSCOPE_CACHE": cache, "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        command = [str(TRUSTSCOPE), "dashboard", str(logdir), "--port", str(self.port)]
        if main is not None:  # another checkout's app: its streamlit command, with this server's flags
            command = streamlit_command(logdir.resolve(), port=self.port)
            command[command.index(str(MAIN))] = str(main)
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = start + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the dashboard exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2) as resp:
                    if resp.read().strip() == b"ok":
                        break
            except OSError:
                time.sleep(0.05)
        self.started = time.monotonic() - start

    def cpu_seconds(self) -> float:
        """User and system CPU seconds the server process has used so far (its threads included): a figure the
        machine's load does not inflate, unlike the wall time."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def open_page(browser, url: str, page: Page) -> float:
    """Seconds from requesting ``page`` in a new tab to it being drawn."""
    tab = browser.new_page(viewport={"width": 1400, "height": 2000})
    try:
        start = time.monotonic()
        tab.goto(f"{url}/{page.url_path}", wait_until="commit")
        tab.get_by_role("heading", name=page.title).first.wait_for(timeout=120_000)
        tab.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=120_000)
        tab.wait_for_selector(page.ready, timeout=60_000)
        tab.wait_for_function(DRAWN, timeout=60_000)
        elapsed = time.monotonic() - start
        if tab.locator("[data-testid='stException']").count():
            raise RuntimeError(f"/{page.url_path}: exception on the page")
        return elapsed
    finally:
        tab.close()


def bench_logdir(browser, logdir: Path, pages: list[Page], repeat: int,
                 main: Path | None = None) -> tuple[float, dict[str, tuple[float, float]]]:
    """Per page, the median over ``repeat`` fresh servers of the cold and the warm visit (wall seconds, and the
    server's CPU seconds beside them); and the median start."""
    started, results = [], {}
    for page in pages:
        times: list[tuple[float, float, float, float]] = []
        for _ in range(repeat):
            server = Server(logdir, main)
            try:
                started.append(server.started)
                visits = []
                for _visit in ("cold", "warm"):
                    cpu = server.cpu_seconds()
                    visits += [open_page(browser, server.url, page), server.cpu_seconds() - cpu]
                times.append(tuple(visits))
            finally:
                server.close()
        cold, cold_cpu, warm, warm_cpu = (statistics.median(column) for column in zip(*times, strict=True))
        results[page.title] = (cold, warm)
        print(f"  {page.title:<22}{cold:>7.2f}{cold_cpu:>7.2f}{warm:>7.2f}{warm_cpu:>7.2f}", flush=True)
    return statistics.median(started), results


def demo_logdir(path: Path | None, steps: int) -> Path:
    """``path`` when it holds a run, else a demo run of ``steps`` steps trained there (a temporary folder when
    ``path`` is None)."""
    path = path or Path(tempfile.mkdtemp(prefix="bench-dashboard-demo-"))
    if not any(path.glob("*/run.json")):
        print(f"training a {steps}-step demo run into {path} ...", flush=True)
        subprocess.run([str(TRUSTSCOPE), "demo", "--logdir", str(path), "--steps", str(steps), "--no-serve"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, default=ROOT / "sample_logs")
    parser.add_argument("--demo", type=Path, help="a demo run's log directory (trained there when missing)")
    parser.add_argument("--demo-steps", type=int, default=12)
    parser.add_argument("--no-demo", action="store_true", help="only the --logdir")
    parser.add_argument("--pages", help="comma-separated page files' stems (default: every page)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--app", type=Path, help="another checkout's app/main.py to serve (a before/after)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    pages = [p for p in PAGES if not args.pages or Path(p.file).stem in args.pages.split(",")]
    logdirs = [args.logdir] + ([] if args.no_demo else [demo_logdir(args.demo, args.demo_steps)])
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for logdir in logdirs:
            print(f"\n{logdir}\n  {'page':<22}{'cold s':>7}{'cpu s':>7}{'warm s':>7}{'cpu s':>7}", flush=True)
            started, results = bench_logdir(browser, logdir, pages, args.repeat, args.app)
            slow = [f"{title} {kind} {t:.2f} s" for title, times in results.items()
                    for kind, t in zip(LIMIT, times, strict=True) if t >= LIMIT[kind]]
            print(f"  server start (to healthy): {started:.2f} s; over the {LIMIT['cold']:g} s cold / "
                  f"{LIMIT['warm']:g} s warm budget: {', '.join(slow) or 'none'}")
        browser.close()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
