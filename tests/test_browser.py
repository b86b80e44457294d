"""The dashboard in a real headless Chromium: every page renders, reads right, and raises nothing.

Starts ``trustscope dashboard`` on a free localhost port over the sample logs (a synthetic log while
``sample_logs/`` holds no run) and over a short demo run (``TRUSTSCOPE_DEMO_LOGDIR`` when set, else a freshly
trained 4-step demo), and keeps a screenshot of every page under ``test-artifacts/browser/<logs>/``. Every page
fails on a Streamlit exception or error box, a JavaScript error, a plot without a single point, a log axis whose
tick labels are not of the form {1, 2, 5} x 10^k, or a rule drawn in two colours anywhere on the dashboard.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from app.pages import PAGES
from trustscope import runformat

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_LOGS = ROOT / "sample_logs"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# every plot of the page: whether it holds a point, its log axes' tick labels, and each rule trace's colour
READ_PLOTS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => {
  const layout = gd._fullLayout || {};
  const axes = Object.keys(layout).filter(k => /^[xy]axis\\d*$/.test(k) && layout[k].type === 'log'
                                             && layout[k].visible !== false);
  const points = (gd._fullData || []).some(t => ['x', 'y', 'z'].some(k => t[k] && t[k].length > 0));
  const colour = t => t.type === 'bar' ? t.marker.color : (t.line && t.line.color) || t.marker.color;
  const rules = (gd._fullData || []).filter(t => t.meta && t.meta.rule).map(t => [
      t.meta.rule, typeof colour(t) === 'string' ? colour(t) : JSON.stringify(colour(t))]);
  return {points, rules,
          logTicks: axes.map(k => [k, (layout[k]._vals || []).map(v => String(v.text).replace(/<[^>]+>/g, ''))])};
})"""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]


def _sample_logs(tmp_path_factory) -> Path:
    if runformat.run_dirs(SAMPLE_LOGS):
        return SAMPLE_LOGS
    from trustscope.synthetic import SyntheticConfig, generate_logdir

    return generate_logdir(tmp_path_factory.mktemp("logs"), runs=2, config=SyntheticConfig(tokens=20_000, steps=8))


def _demo_logs(tmp_path_factory) -> Path:
    """A short real demo run: the demo's own settings and world (toy-v2-warm, which ships built; bf16 vLLM
    rollouts, lag 1, eight mini-batches, 16 x 16)."""
    given = os.environ.get("TRUSTSCOPE_DEMO_LOGDIR")
    if given:
        return Path(given)
    import dataclasses

    from trustscope.demo import demo_config
    from trustscope.train.loop import train

    logdir = tmp_path_factory.mktemp("demo")
    train(dataclasses.replace(demo_config(logdir, steps=4), eval_every=2, eval_problems=16))
    return logdir


@pytest.fixture(scope="module", params=["sample_logs", pytest.param("demo", marks=pytest.mark.heavy)])
def logdir(request, tmp_path_factory) -> tuple[str, Path]:
    make = _sample_logs if request.param == "sample_logs" else _demo_logs
    return request.param, make(tmp_path_factory)


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
def server(logdir) -> tuple[str, str]:
    name, path = logdir
    port = _free_port()
    exe = Path(sys.executable).with_name("trustscope")
    proc = subprocess.Popen([str(exe), "dashboard", str(path), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield name, url
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


def _artifacts(name: str) -> Path:
    folder = ARTIFACTS / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _settle(page, timeout_ms: int = 60_000) -> None:
    """Wait until Streamlit's script run is over (the app root says so in ``data-test-script-state``)."""
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


def is_125_tick(label: str) -> bool:
    """Whether a tick label reads as 1, 2 or 5 times a power of ten (``0.002``, ``5e-5``, ``100``)."""
    try:
        value = float(label.replace("\u2212", "-"))
    except ValueError:
        return False
    if value <= 0:
        return False
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5))


def test_tick_check_tells_good_labels_from_bad():
    assert all(map(is_125_tick, ["0.002", "5e-5", "100", "1", "0.5"]))
    assert not any(map(is_125_tick, ["9", "0.3", "100µ", "150n", ""]))


def test_every_page_renders_and_reads_right_in_chromium(server, browser):
    name, url = server
    artifacts = _artifacts(name)
    page = browser.new_page(viewport={"width": 1400, "height": 4000})  # tall: the main pane scrolls itself
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    timings, colours, problems = {}, {}, []
    for shown in PAGES:
        start = time.monotonic()
        page.goto(f"{url}/{shown.url_path}", wait_until="domcontentloaded")
        page.get_by_role("heading", name=shown.title).first.wait_for(timeout=60_000)
        _settle(page)
        page.wait_for_selector(shown.ready, timeout=30_000)
        stem = Path(shown.file).stem
        timings[stem] = time.monotonic() - start
        page.wait_for_timeout(500)  # plotly draws after the script run ends
        page.screenshot(path=str(artifacts / f"{stem}.png"), full_page=True)
        where = f"/{shown.url_path} over {name}"
        assert page.locator("[data-testid='stException']").count() == 0, f"exception on {where}"
        assert page.locator("[data-testid='stAlertContentError']").count() == 0, f"error box on {where}"
        for i, plot in enumerate(page.evaluate(READ_PLOTS)):
            if not plot["points"]:
                problems.append(f"{where}: plot {i} is empty")
            for axis, labels in plot["logTicks"]:
                bad = [t for t in labels if not is_125_tick(t)]
                if bad or not labels:
                    problems.append(f"{where}: plot {i} {axis} log ticks {labels}")
            for rule, colour in plot["rules"]:
                colours.setdefault(rule, set()).add(colour)
    (artifacts / "timings.txt").write_text("".join(f"{k} {v:.2f}\n" for k, v in timings.items()))
    problems += [f"{rule} drawn in colours {sorted(c)}" for rule, c in colours.items() if len(c) > 1]
    assert not problems, problems
    assert colours, "no rule drawn on any page"
    assert not errors, f"JavaScript errors: {errors}"
    page.close()


def test_token_explorer_hover_shows_topk_alternatives(server, browser):
    _, url = server
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/token_explorer", wait_until="domcontentloaded")
    token = page.locator("span.tok").first
    token.wait_for(timeout=60_000)
    tip = token.get_attribute("title")
    assert "mu " in tip and " pi " in tip
    page.close()
