"""Time the read commands as a user meets them: each in a fresh process, with a new cache, beside the engine alone.

    .venv/bin/python -m bench.bench_cli                       # sample_logs/, 5 repeats
    .venv/bin/python -m bench.bench_cli --logdir runs/demo --repeat 3

For each command: the median wall seconds of ``--repeat`` fresh processes (``trustscope ...`` as the console script
runs it), each with a new, empty ``TRUSTSCOPE_CACHE`` ("cold": a log never opened before), and for ``sql`` and
``report`` also with the cache the previous run left ("warm"). The baseline, run in the same command and
interleaved with the others so that the machine's load meets both alike: a fresh Python process asking DuckDB the
same query over the same Parquet files (``select count(*) from '<logdir>/*/tokens/**/*.parquet'``). ``sql`` is
reported as a ratio to it. The machine's load average is printed with the figures: on a busy machine every figure
grows, the ratios less.
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

QUICK = ["--repeat", "1"]

BASELINE = "import duckdb, sys; duckdb.sql(f\"select count(*) from '{sys.argv[1]}/*/tokens/**/*.parquet'\").fetchall()"


def timed(cmd: list[str], cache: Path) -> float:
    """Wall seconds of ``cmd`` in a fresh process with ``TRUSTSCOPE_CACHE=cache``; raises on a failure."""
    env = {**os.environ, "TRUSTSCOPE_CACHE": str(cache)}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/")
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 2):  # doctor exits 2 on a run it warns about
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, default=ROOT / "sample_logs")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    logdir = str(args.logdir.resolve())
    query = "select count(*) from tokens"
    commands = {
        "--help": [str(TRUSTSCOPE), "--help"],
        "sql": [str(TRUSTSCOPE), "sql", logdir, query],
        "validate": [str(TRUSTSCOPE), "validate", logdir],
        "doctor": [str(TRUSTSCOPE), "doctor", logdir],
        "report": [str(TRUSTSCOPE), "report", logdir],
    }
    warm = ("sql", "report")
    times: dict[str, list[float]] = {name: [] for name in ["duckdb alone", *commands, *(f"{w} warm" for w in warm)]}
    root = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        for i in range(args.repeat):
            times["duckdb alone"].append(timed([sys.executable, "-c", BASELINE, logdir], root / "none"))
            for name, cmd in commands.items():
                cache = root / f"{name.strip('-')}-{i}"
                times[name].append(timed(cmd, cache))
                if name in warm:
                    times[f"{name} warm"].append(timed(cmd, cache))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(times["duckdb alone"])
    print(f"{logdir}: {args.repeat} fresh processes each, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'command':14s} {'median s':>9s} {'min s':>7s} {'x duckdb':>9s}")
    figures = {}
    for name, values in times.items():
        ratio = statistics.median(values) / base
        print(f"{name:14s} {statistics.median(values):9.3f} {min(values):7.3f} {ratio:9.2f}")
        figures[name] = {"median_s": statistics.median(values), "x_duckdb": ratio}
    return figures


if __name__ == "__main__":
    main()
