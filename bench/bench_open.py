"""Opening a run whose logger compacted in the background: this checkout against a baseline checkout.

    .venv/bin/python -m bench.bench_open --baseline /work/main --steps 300 --repeat 5

For each checkout, in fresh processes whose ``PYTHONPATH`` is that checkout: one rank logs ``--steps`` steps of
8 x 16 tokens (top-K off, summaries on), flushed after every step, with the logger's default background compaction
(``compact_every=10``), and closes. Then, each in a new process: the files under the run's table folders (what a
plain reader lists, and what ``committed_files`` scans), the committed files, the rows a DuckDB glob of the tokens
folder counts against the rows logged, ``trustscope.runformat.commits.committed_files`` (median of ``--repeat``), and
``trustscope.db.connect`` plus ``runs()`` on an empty cache, imports (pandas included) apart (median of ``--repeat``, a new process
each, the two checkouts taking turns). Ratios are this checkout's seconds over the baseline's, in the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B, T = 8, 16

LOG = """
import sys, time, numpy as np
from trustscope.logger import TokenLogger
logdir, steps = sys.argv[1], int(sys.argv[2])
started = time.perf_counter()
with TokenLogger(logdir, "run", log_topk=False) as lg:
    for step in range(steps):
        rng = np.random.default_rng(step)
        lp = -rng.random((B, T)).astype(np.float32)
        lg.log_step(step, tokens={"token_id": rng.integers(0, 50, lp.shape), "mu_logprob": lp, "pi_logprob": lp,
                                  "advantage": rng.normal(size=lp.shape[0])},
                    mask=np.ones(lp.shape, dtype=bool), samples={"sample_id": np.arange(lp.shape[0]),
                    "prompt_id": np.arange(lp.shape[0])}, scalars={"loss": 1.0})
        lg.flush()
print(time.perf_counter() - started)
""".replace("B, T", f"{B}, {T}")

SHAPE = """
import glob, json, os, sys, duckdb
from trustscope import runformat as S
run = sys.argv[1]
listed = sum(len(files) for t in S.TABLES for _, _, files in os.walk(os.path.join(run, t)))
live = sum(len(files) for files in S.committed_files(run).values())
flat = os.path.join(run, "tokens", "*.parquet")
deep = os.path.join(run, "tokens", "**", "*.parquet")
rows = duckdb.sql(f"select count(*) from read_parquet('{deep}')").fetchall()[0][0]
assert S.__file__.startswith(sys.argv[2]), (S.__file__, sys.argv[2])
print(json.dumps({"listed": listed, "live": live, "glob_rows": rows, "flat_files": len(glob.glob(flat))}))
"""

LISTING = """
import sys, time
from trustscope import runformat as S
run, repeat = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(repeat):
    started = time.perf_counter()
    S.committed_files(run)
    times.append(time.perf_counter() - started)
print(sorted(times)[len(times) // 2])
"""

CONNECT = """
import sys, time
import pandas  # noqa: F401  (runs() answers as pandas: its import, 0.6 s, is not the run's opening)
from trustscope.db import connect
started = time.perf_counter()
with connect(sys.argv[1], cache_dir=sys.argv[2]) as db:
    db.runs()
print(time.perf_counter() - started)
"""


def run(code: Path, script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir())  # not a checkout: `-c` puts the working directory first
    return out.stdout.strip().splitlines()[-1]


def measure(code: Path, steps: int, repeat: int, where: Path) -> dict:
    logdir = where / "logs"
    logged = float(run(code, LOG, str(logdir), str(steps)))
    shape = json.loads(run(code, SHAPE, str(logdir / "run"), str(code.resolve())))
    listing = float(run(code, LISTING, str(logdir / "run"), str(repeat)))
    return {"log_s": logged, **shape, "rows_logged": steps * B * T, "committed_files_s": listing}


def connects(sides: list[tuple[Path, Path]], repeat: int) -> list[float]:
    """The median ``connect`` + ``runs()`` of each (checkout, log directory), the sides taking turns (a load that
    drifts meets both alike)."""
    times: list[list[float]] = [[] for _ in sides]
    for i in range(repeat):
        for side, (code, where) in enumerate(sides):
            times[side].append(float(run(code, CONNECT, str(where / "logs" / "run"), str(where / f"cache{i}"))))
    return [statistics.median(t) for t in times]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-open-") as tmp:
        before = measure(args.baseline, args.steps, args.repeat, Path(tmp) / "before")
        after = measure(ROOT, args.steps, args.repeat, Path(tmp) / "after")
        before["connect_s"], after["connect_s"] = connects([(args.baseline, Path(tmp) / "before"),
                                                            (ROOT, Path(tmp) / "after")], args.repeat)
    print(f"{'':28s} {'baseline':>12s} {'this checkout':>14s} {'ratio':>7s}")
    figures = {}
    for key in before:
        ratio = f"x{after[key] / before[key]:.2f}" if key.endswith("_s") and before[key] else ""
        print(f"{key:28s} {before[key]:>12.4g} {after[key]:>14.4g} {ratio:>7s}")
        figures[key] = {"baseline": before[key], "this checkout": after[key]}
        if ratio:
            figures[key]["x_baseline"] = after[key] / before[key]
    return figures


if __name__ == "__main__":
    main()
