"""Time every dashboard page under Streamlit's AppTest, over the sample logs and over a large log.

    .venv/bin/python bench/bench_dashboard.py                          # sample_logs/ (or a small synthetic log)
    .venv/bin/python bench/bench_dashboard.py --big /tmp/logs_10m      # also a large log (made if missing)

For each log directory it reports, per page:
  first  the page's first visit on a freshly opened query-layer handle (its queries uncached, DuckDB's file cache
         cold; the kept per-file aggregates come from the disk cache, as after a server restart),
  cached a revisit (results served from st.cache_data),
and once per log directory the cost of opening the query layer and building its kept per-file aggregates, with an
empty disk cache (a log never opened before: the first page a fresh server shows pays it) and with a warm one. The baseline, timed in the same process, is a page that only writes a title: the
ratio column says how many times the framework's own floor a page costs.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from app import data  # noqa: E402
from app.launch import LOGDIR_ENV  # noqa: E402
from trustscope import db, schema  # noqa: E402

MAIN = ROOT / "app" / "main.py"
PAGES = ["runs", "live", "bad_updates", "ratio_divergence", "rules", "counterfactual", "clipped_tokens",
         "token_explorer", "sql_console"]


def _timed_run(at: AppTest) -> float:
    start = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - start
    if at.exception or at.error:
        raise RuntimeError(f"page failed: {[e.message for e in at.exception]} {[e.value for e in at.error]}")
    return elapsed


def warm_up(logdir: Path) -> None:
    """Render every page once so imports (torch through the loss registry, plotly) stay out of the timings."""
    os.environ[LOGDIR_ENV] = str(logdir)
    at = AppTest.from_file(str(MAIN), default_timeout=120)
    _timed_run(at)
    for page in PAGES[1:]:
        at.switch_page(f"views/{page}.py")
        _timed_run(at)


def baseline(repeat: int) -> float:
    """Median seconds of an AppTest run of a page that only writes a title."""
    times = []
    for _ in range(repeat):
        at = AppTest.from_string("import streamlit as st\nst.title('baseline')", default_timeout=60)
        times.append(_timed_run(at))
    return statistics.median(times)


def _clear_results() -> None:
    st.cache_data.clear()
    data._analysis.clear()
    data._query.clear()
    data._run_table.clear()


def open_costs(logdir: Path) -> tuple[float, float]:
    """Seconds to open a query-layer handle and build every kept per-file aggregate: with an empty disk cache
    (a log never opened before), then again with the disk cache the first open left."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with db.connect(logdir) as handle:
            handle.step_summary()
            handle.clipped_tokens(top=1)
            handle.ratio_vs_divergence(divergences=["binary_tv"])
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def bench_logdir(logdir: Path, repeat: int) -> tuple[tuple[float, float], dict[str, tuple[float, float]]]:
    """Per page: the first visit on a fresh query-layer handle (DuckDB's file cache cold, the kept per-file
    aggregates read from the disk cache, as after a server restart), then a cached revisit."""
    os.environ[LOGDIR_ENV] = str(logdir)
    opened = open_costs(logdir)
    results = {}
    for page in PAGES:
        firsts, cached = [], []
        for _ in range(repeat):
            st.cache_resource.clear()
            _clear_results()
            data._db(str(logdir.resolve())).refresh()
            at = AppTest.from_file(str(MAIN), default_timeout=300)
            if page != "runs":
                _timed_run(at)
                at.switch_page(f"views/{page}.py")
                _clear_results()
            firsts.append(_timed_run(at))
            cached.append(_timed_run(at))
        results[page] = (statistics.median(firsts), statistics.median(cached))
    return opened, results


def report(name: str, floor: float, opened: tuple[float, float], results: dict[str, tuple[float, float]],
           limit: float) -> None:
    print(f"\n{name}: open + per-file aggregates {opened[0]:.2f} s with an empty disk cache, "
          f"{opened[1]:.2f} s with the disk cache")
    print(f"{'page':<18}{'first s':>9}{'cached s':>10}{'x floor':>9}  under {limit:g} s")
    for page, (first, cached) in results.items():
        print(f"{page:<18}{first:>9.2f}{cached:>10.2f}{first / floor:>9.1f}  {'yes' if first < limit else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, default=ROOT / "sample_logs")
    parser.add_argument("--big", type=Path, help="a large log directory (generated with 10M tokens if missing)")
    parser.add_argument("--big-tokens", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ["TRUSTSCOPE_CACHE"] = tempfile.mkdtemp(prefix="bench-dashboard-cache-")

    logdir = args.logdir
    if not (logdir.is_dir() and schema.run_dirs(logdir)):
        from trustscope.synthetic import SyntheticConfig, generate_logdir

        logdir = generate_logdir(Path(tempfile.mkdtemp()) / "logs", runs=2, config=SyntheticConfig(tokens=50_000))
        print(f"{args.logdir} holds no runs: using a synthetic log of 2 x 50k tokens at {logdir}")
    logging.getLogger("streamlit").setLevel(logging.ERROR)
    warm_up(logdir)
    floor = baseline(args.repeat)
    print(f"baseline (a page with one title): {floor * 1000:.0f} ms; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    opened, results = bench_logdir(logdir, args.repeat)
    report(f"{logdir}", floor, opened, results, 2.0)
    if args.big:
        if not (args.big.is_dir() and schema.run_dirs(args.big)):
            from trustscope.synthetic import SyntheticConfig, generate_logdir

            print(f"generating {args.big_tokens:,} tokens into {args.big} ...")
            generate_logdir(args.big, runs=1, config=SyntheticConfig(tokens=args.big_tokens, steps=50))
        opened, results = bench_logdir(args.big, max(1, args.repeat - 1))
        report(f"{args.big}", floor, opened, results, 5.0)


if __name__ == "__main__":
    main()
