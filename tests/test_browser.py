"""The dashboard in a real headless Chromium: every page renders its key elements and no exception.

Starts ``trustscope dashboard`` on a free localhost port over the sample logs (a synthetic log while
``sample_logs/`` holds no run) and keeps a screenshot of every page under ``test-artifacts/browser/``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trustscope import schema

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_LOGS = ROOT / "sample_logs"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# url path -> (page title, a selector that only renders once the page's data is in)
PAGES = {
    "": ("Runs", ".js-plotly-plot"),
    "live": ("Live", ".js-plotly-plot"),
    "bad_updates": ("Bad negative updates", ".js-plotly-plot"),
    "ratio_divergence": ("Ratio vs divergence", ".js-plotly-plot"),
    "rules": ("Rules side by side", ".js-plotly-plot"),
    "clipped_tokens": ("Clipped tokens", ".js-plotly-plot"),
    "token_explorer": ("Token explorer", "span.tok"),
    "sql_console": ("SQL console", "[data-testid='stDataFrame']"),
}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """sample_logs/ when it holds runs, else a small synthetic log."""
    if schema.run_dirs(SAMPLE_LOGS):
        return SAMPLE_LOGS
    from trustscope.synthetic import SyntheticConfig, generate_logdir

    return generate_logdir(tmp_path_factory.mktemp("logs"), runs=2, config=SyntheticConfig(tokens=20_000, steps=8))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dashboard exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                if resp.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"dashboard at {url} not healthy after {timeout} s")


@pytest.fixture(scope="module")
def server(logdir) -> str:
    port = _free_port()
    exe = Path(sys.executable).with_name("trustscope")
    proc = subprocess.Popen([str(exe), "dashboard", str(logdir), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    return ARTIFACTS


def _settle(page, timeout_ms: int = 30_000) -> None:
    """Wait until Streamlit's script run is over (the app root says so in ``data-test-script-state``)."""
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


def test_every_page_renders_in_chromium(server, browser, artifacts):
    page = browser.new_page(viewport={"width": 1400, "height": 2200})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    timings = {}
    for path, (title, selector) in PAGES.items():
        start = time.monotonic()
        page.goto(f"{server}/{path}", wait_until="domcontentloaded")
        page.get_by_role("heading", name=title).first.wait_for(timeout=30_000)
        page.wait_for_selector(selector, timeout=30_000)
        _settle(page)
        timings[path or "runs"] = time.monotonic() - start
        page.screenshot(path=str(artifacts / f"{path or 'runs'}.png"), full_page=True)
        assert page.locator("[data-testid='stException']").count() == 0, f"exception on page /{path}"
        assert page.locator("[data-testid='stAlertContentError']").count() == 0, f"error box on page /{path}"
    (artifacts / "timings.txt").write_text("".join(f"{k} {v:.2f}\n" for k, v in timings.items()))
    assert not errors, f"JavaScript errors: {errors}"
    page.close()


def test_token_explorer_hover_shows_topk_alternatives(server, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{server}/token_explorer", wait_until="domcontentloaded")
    token = page.locator("span.tok").first
    token.wait_for(timeout=30_000)
    assert "<- sampled" in token.get_attribute("title")
    page.close()
