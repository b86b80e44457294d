"""Time `trustscope report` against `sql` and `doctor` on the same logs, each in a fresh process.

    .venv/bin/python -m bench.bench_report                      # sample_logs/, 5 rounds
    .venv/bin/python -m bench.bench_report --logdir runs/demo --rounds 3

Each round runs, one after the other so that the machine's load meets them alike: ``sql`` (a count of the token
rows) and ``doctor`` with a new, empty ``TRUSTSCOPE_CACHE``; ``report`` with a new cache ("cold": logs never opened
before, every kept aggregate and the kept report computed), then again with the cache it left ("warm": the kept
report read back), and ``report --format json`` warm. Printed: the median wall seconds of each over the rounds,
and each as a ratio to ``sql`` of the same rounds, with the load average before and after (on a busy machine every
figure grows, the ratios less).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRUSTSCOPE = Path(sys.executable).parent / "trustscope"


def run_once(args: list[str], cache: Path) -> float:
    """Wall seconds of ``trustscope ARGS`` in a fresh process with ``TRUSTSCOPE_CACHE=cache``; raises on a
    failure (``doctor`` exits 2 on a run it warns about: counted as done)."""
    env = {**os.environ, "TRUSTSCOPE_CACHE": str(cache), "COLUMNS": "80"}
    start = time.perf_counter()
    done = subprocess.run([str(TRUSTSCOPE), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, cwd="/")
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 2):
        raise RuntimeError(f"trustscope {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds

QUICK = ["--rounds", "1"]


def one_round(logdir: str, scratch: Path, i: int) -> dict[str, float]:
    """One round of every command, each cold one with a cache folder of its own."""
    fresh = lambda name: scratch / f"{name}-{i}"  # noqa: E731
    report_cache = fresh("report")
    return {
        "sql": run_once(["sql", logdir, "select count(*) from tokens"], fresh("sql")),
        "doctor": run_once(["doctor", logdir], fresh("doctor")),
        "report, cold": run_once(["report", logdir], report_cache),
        "report, warm": run_once(["report", logdir], report_cache),
        "report --format json, warm": run_once(["report", logdir, "--format", "json"], report_cache),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, default=ROOT / "sample_logs")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logdir = str(args.logdir.resolve())
    scratch = Path(tempfile.mkdtemp(prefix="bench-report-"))
    load_before = os.getloadavg()[0]
    try:
        rounds = [one_round(logdir, scratch, i) for i in range(args.rounds)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()[0]
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    base = medians["sql"]
    print(f"{logdir}: {args.rounds} rounds of fresh processes, load average {load_before:.1f} before, "
          f"{load_after:.1f} after")
    print(f"{'command':<30} {'median s':>9} {'x sql':>7}   all rounds")
    for name, value in medians.items():
        every = " ".join(f"{r[name]:.2f}" for r in rounds)
        print(f"{name:<30} {value:>9.3f} {value / base:>7.2f}   {every}")
    return medians


if __name__ == "__main__":
    main()
