"""Time every dashboard page in a real headless Chromium, cold and warm, over the sample logs and a demo run.

    .venv/bin/python -m bench.bench_dashboard                         # sample_logs/ and a fresh 12-step demo run
    .venv/bin/python -m bench.bench_dashboard --demo runs/demo        # that demo log (trained there when missing)
    .venv/bin/python -m bench.bench_dashboard --no-demo --pages runs,rules
    .venv/bin/python -m bench.bench_dashboard --app /tmp/before/app/main.py     # another checkout's dashboard
    .venv/bin/python -m bench.bench_dashboard --no-demo --browser-cache        # a returning browser
    .venv/bin/python -m bench.bench_dashboard --no-demo --pages runs --settle 10   # opened 10 s after the start

For each log directory and each page of :data:`app.pages.PAGES`:
  cold     a fresh ``trustscope dashboard`` server with a new, empty ``TRUSTSCOPE_CACHE`` (a log never opened
           before): from the browser's request of the page in a new tab to the page drawn,
  menu     warm: back to the page from another one through the sidebar's menu, in the same tab (the server's
           caches and the browser's scripts loaded: how a user moves between pages),
  new tab  warm: the page opened again in a new tab (a new session; the browser loads Streamlit's and plotly's
           scripts again);
each as wall seconds with the server's and the browser's CPU seconds over the visit beside them (the machine's
load does not inflate those).
Beside the pages, in the same command: **floor**, a bare Streamlit page (a heading and a line of text) served
with the same flags and timed the same way: what Streamlit's frontend alone costs this browser on this machine,
the part of every first render no page can remove. With ``--browser-cache`` every server of the command listens on
one port and the pages open in one persistent browser profile visited once before (Streamlit's hashed scripts in
the browser's HTTP cache, as for anyone who opened the dashboard before): **cold** is then a new server with a new
``TRUSTSCOPE_CACHE`` on a log never opened, met by a returning browser. With ``--settle S`` the first request waits
S seconds after the health check answers (a user who opens the printed link a few seconds after the server
prints it): what the server prepares while it starts (``app/serve.py``) is then ready, or not, by the request.
"Drawn" is: the page's script run over, the page's ready selector shown (:attr:`app.pages.Page.ready`) and every
plotly chart laid out by plotly.js in the browser. The server's own start (to its health check answering) is
reported apart. Needs Debian's chromium (``/usr/bin/chromium``) and playwright (``setup.sh --test``).
"""

from __future__ import annotations

import argparse
import contextlib
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

from app.launch import MAIN, streamlit_command  # noqa: E402
from app.pages import PAGES, Page  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TRUSTSCOPE = Path(sys.executable).with_name("trustscope")
DRAWN = """() => [...document.querySelectorAll('.js-plotly-plot')].every(gd => gd._fullLayout && gd._fullData)"""
LIMIT = {"cold": 2.0, "warm": 1.0}
VIEWPORT = {"width": 1400, "height": 2000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int | str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu(pid: int | str) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def browser_cpu_seconds() -> float:
    """CPU seconds used so far by the browser: every process descended from this one but the servers (Chromium's
    processes under playwright's driver)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = (int(_stat(entry.name)[1]), (entry / "cmdline").read_bytes())
            except (OSError, IndexError):
                continue
    total, me = 0.0, os.getpid()
    for pid, (_, cmdline) in parents.items():
        ancestor = pid
        while ancestor in parents and ancestor != me:
            ancestor = parents[ancestor][0]
        if ancestor == me and pid != me and b"chrom" in cmdline:
            with contextlib.suppress(OSError):
                total += _cpu(pid)
    return total


class Server:
    """``trustscope dashboard LOGDIR`` on a free port with a new, empty cache; ``started`` is the seconds from
    the command to its health check answering."""

    def __init__(self, logdir: Path, main: Path | None = None, port: int | None = None,
                 script: Path | None = None, settle: float = 0.0) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = tempfile.mkdtemp(prefix="bench-dashboard-cache-")
        env = {**os.environ, "TRUSTSCOPE_CACHE": cache, "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        command = [str(TRUSTSCOPE), "dashboard", str(logdir), "--port", str(self.port)]
        if main is not None or script is not None:  # another app: Streamlit's own command, this server's flags
            command = streamlit_command(logdir.resolve(), port=self.port)
            command[command.index(str(MAIN))] = str(main or script)
            if script is not None:
                command[1:2] = ["-m", "streamlit"]
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
        time.sleep(settle)

    def cpu_seconds(self) -> float:
        """User and system CPU seconds the server process has used so far (its threads included): a figure the
        machine's load does not inflate, unlike the wall time."""
        return _cpu(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wait_drawn(tab, page: Page) -> None:
    tab.get_by_role("heading", name=page.title).first.wait_for(timeout=120_000)
    tab.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=120_000)
    tab.wait_for_selector(page.ready, timeout=60_000)
    tab.wait_for_function(DRAWN, timeout=60_000)
    if tab.locator("[data-testid='stException']").count():
        raise RuntimeError(f"/{page.url_path}: exception on the page")


def open_page(browser, url: str, page: Page):
    """A new tab on ``page`` and the seconds from its request to the page drawn."""
    # a persistent profile (--browser-cache) is one context, its viewport set at launch
    tab = browser.new_page(**({} if hasattr(browser, "browser") else {"viewport": VIEWPORT}))
    start = time.monotonic()
    tab.goto(f"{url}/{page.url_path}", wait_until="commit")
    _wait_drawn(tab, page)
    return tab, time.monotonic() - start


def navigate(tab, page: Page) -> float:
    """Seconds from a click on ``page`` in the sidebar's menu to the page drawn (the same tab: no reload)."""
    start = time.monotonic()
    tab.locator("[data-testid='stSidebarNav']").get_by_role("link", name=page.title, exact=True).click()
    _wait_drawn(tab, page)
    return time.monotonic() - start


COLUMNS = ("cold s", "server", "browser", "menu s", "server", "browser", "new tab s", "server", "browser")


def visit(browser, server: Server, page: Page, away: Page) -> list[float]:
    """The page cold (a new tab on the new server), then warm twice: from another page of the same tab through
    the menu, and in a new tab (a new session); each as wall seconds, then the server's and the browser's CPU
    seconds."""
    def timed(action) -> list[float]:
        cpu, seen = server.cpu_seconds(), browser_cpu_seconds()
        wall = action()
        return [wall, server.cpu_seconds() - cpu, browser_cpu_seconds() - seen]

    tabs = []

    def fresh() -> float:
        tab, wall = open_page(browser, server.url, page)
        tabs.append(tab)
        return wall

    times = timed(fresh)
    navigate(tabs[0], away)
    times += timed(lambda: navigate(tabs[0], page))
    times += timed(fresh)
    for tab in tabs:
        tab.close()
    return times


FLOOR = Page("Floor", "floor.py", "", "", "[data-testid='stMarkdown']")
FLOOR_APP = """import streamlit as st
st.title("Floor")
st.write("A bare Streamlit page: what the frontend costs before any page of the dashboard draws.")
"""


def floor(browser, repeat: int, port: int | None, settle: float = 0.0) -> list[float]:
    """The bare page's cold first render (wall, server and browser CPU seconds), medians over ``repeat`` servers."""
    script = Path(tempfile.mkdtemp(prefix="bench-dashboard-floor-")) / "floor.py"
    script.write_text(FLOOR_APP)
    runs = []
    for _ in range(repeat):
        server = Server(script.parent, port=port, script=script, settle=settle)
        try:
            cpu, seen = server.cpu_seconds(), browser_cpu_seconds()
            tab, wall = open_page(browser, server.url, FLOOR)
            runs.append([wall, server.cpu_seconds() - cpu, browser_cpu_seconds() - seen])
            tab.close()
        finally:
            server.close()
    return [statistics.median(column) for column in zip(*runs, strict=True)]


def bench_logdir(browser, logdir: Path, pages: list[Page], repeat: int, main: Path | None = None,
                 port: int | None = None, settle: float = 0.0) -> tuple[float, dict[str, list[float]]]:
    """Per page, the medians over ``repeat`` fresh servers of :func:`visit`'s figures; and the median start."""
    started, results = [], {}
    for page in pages:
        runs = []
        for _ in range(repeat):
            server = Server(logdir, main, port, settle=settle)
            try:
                started.append(server.started)
                runs.append(visit(browser, server, page, PAGES[-1] if page is PAGES[0] else PAGES[0]))
            finally:
                server.close()
        results[page.title] = [statistics.median(column) for column in zip(*runs, strict=True)]
        print(f"  {page.title:<22}" + "".join(f"{t:>{len(c) + 2}.2f}" for c, t in zip(COLUMNS, results[page.title],
                                                                                       strict=True)), flush=True)
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


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, default=ROOT / "sample_logs")
    parser.add_argument("--demo", type=Path, help="a demo run's log directory (trained there when missing)")
    parser.add_argument("--demo-steps", type=int, default=12)
    parser.add_argument("--no-demo", action="store_true", help="only the --logdir")
    parser.add_argument("--pages", help="comma-separated page files' stems (default: every page)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--app", type=Path, help="another checkout's app/main.py to serve (a before/after)")
    parser.add_argument("--browser-cache", action="store_true",
                        help="one port and one browser profile visited before: a returning browser")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds between the server answering and the first request (default 0)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    pages = [p for p in PAGES if not args.pages or Path(p.file).stem in args.pages.split(",")]
    logdirs = [args.logdir] + ([] if args.no_demo else [demo_logdir(args.demo, args.demo_steps)])
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with sync_playwright() as pw:
        port = None
        if args.browser_cache:
            port = _free_port()
            browser = pw.chromium.launch_persistent_context(tempfile.mkdtemp(prefix="bench-dashboard-profile-"),
                                                            executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                            viewport=VIEWPORT)
            server = Server(args.logdir, args.app, port)
            try:  # the visit before: Streamlit's and plotly's scripts into the profile's cache
                open_page(browser, server.url, PAGES[0])[0].close()
            finally:
                server.close()
        else:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        wall, server_cpu, browser_cpu = floor(browser, args.repeat, port, args.settle)
        figures: dict = {"floor": {"cold_s": wall, "server_cpu_s": server_cpu, "browser_cpu_s": browser_cpu}}
        print(f"floor (a bare Streamlit page, cold): {wall:.2f} s, server {server_cpu:.2f} / browser "
              f"{browser_cpu:.2f} CPU s", flush=True)
        for logdir in logdirs:
            print(f"\n{logdir}\n  {'page':<22}" + "".join(f"{c:>{len(c) + 2}}" for c in COLUMNS), flush=True)
            started, results = bench_logdir(browser, logdir, pages, args.repeat, args.app, port, args.settle)
            slow = [f"{title} {kind} {t:.2f} s" for title, times in results.items()
                    for kind, t in (("cold", times[0]), ("warm", times[3])) if t >= LIMIT[kind]]
            print(f"  server start (to healthy): {started:.2f} s; over the {LIMIT['cold']:g} s cold / "
                  f"{LIMIT['warm']:g} s warm budget: {', '.join(slow) or 'none'}")
            keys = ("cold_s", "cold_server_cpu_s", "cold_browser_cpu_s", "menu_s", "menu_server_cpu_s",
                    "menu_browser_cpu_s", "new_tab_s", "new_tab_server_cpu_s", "new_tab_browser_cpu_s")
            figures[str(logdir)] = {"server_start_s": started, **{
                title: dict(zip(keys, map(float, times), strict=True)) for title, times in results.items()}}
        browser.close()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return figures


if __name__ == "__main__":
    main()
