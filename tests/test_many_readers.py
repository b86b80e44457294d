"""Several browser sessions at once on one dashboard server while a run keeps logging: every page answers in every
session, and the server's memory stays bounded.

A small version of ``bench/bench_many_readers.py`` (its own functions): a copy of the shipped sample logs (a small
synthetic log while ``sample_logs/`` holds no run) with a live run logged into it a step a second, one fresh
``trustscope dashboard`` server, :data:`SESSIONS` headless Chromium sessions started together, each opening the
landing page and walking every other page of :data:`app.pages.PAGES` through the menu.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.pages import PAGES
from trustscope import runformat

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_LOGS = ROOT / "sample_logs"
CHROMIUM = Path("/usr/bin/chromium")
SESSIONS = 4
RSS_BOUND_MIB = 1536
"""The server with its children (the warm-up process, the SQL console's worker) stays under this many MiB while
the sessions read: 1.5x the peak of eight sessions over a 1M-token log and a live run (1011 MiB,
docs/performance.md, "Many readers at once")."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]


def _bench():
    """``bench/bench_many_readers.py`` as the module ``bench.bench_many_readers`` (its live writer re-runs it with
    ``python -m``)."""
    return importlib.import_module("bench.bench_many_readers")


def _logs(tmp_path: Path) -> Path:
    logdir = tmp_path / "logs"
    if runformat.run_dirs(SAMPLE_LOGS):
        shutil.copytree(SAMPLE_LOGS, logdir)
        return logdir
    from trustscope.synthetic import SyntheticConfig, generate_logdir

    return generate_logdir(logdir, runs=2, config=SyntheticConfig(tokens=20_000, steps=8))


def test_process_tree_rss_counts_the_children():
    bench = _bench()
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        alone, tree = bench.process_tree_rss(os.getpid())
        while tree - alone < 60 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
            alone, tree = bench.process_tree_rss(os.getpid())
        assert alone > 0
        assert tree - alone >= 60 << 20, (alone, tree)  # the child's 64 MiB, touched by bytearray's zeroing
    finally:
        child.kill()
        child.wait()


@pytest.mark.heavy  # minutes on 2 cores: .ci/run's heavy step
def test_sessions_at_once_read_every_page_while_a_run_logs(tmp_path):
    bench = _bench()
    logdir = _logs(tmp_path)
    writer = bench.LiveWriter(logdir, step_tokens=2000, interval_s=1.0)
    try:  # the writer's first step and the server's start overlap
        phase = bench.run_phase(logdir, SESSIONS, list(PAGES), walks=1, timeout_s=120, after_s=1.0,
                                baseline_s=1.0, ready=writer.wait_first_step)
        steps = writer.steps()
    finally:
        writer.close()
    assert not phase.failures, phase.failures
    per_page = phase.per_page()
    assert list(per_page) == [p.title for p in PAGES]
    assert all(row["answered"] == SESSIONS for row in per_page.values()), per_page
    assert steps >= 2, "the live run logged no step while the sessions read"
    baseline = phase.memory["baseline"]["tree_peak_mib"]
    peak = phase.peak_mib()
    assert 0 < baseline < peak, phase.memory  # the samples saw the server at work
    assert peak < RSS_BOUND_MIB, phase.memory
