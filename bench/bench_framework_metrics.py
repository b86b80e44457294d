"""The frameworks' own figures over a log directory: each framework view against a plain scan of the token rows.

    .venv/bin/python -m bench.bench_framework_metrics --logdir sample_logs --repeat 3

Each query runs in a fresh process (``trustscope.db.connect`` on the log directory, one cursor, the query read into
Arrow), the queries taking turns, ``--repeat`` times; the figure is the median of the query's own seconds (connect
and imports apart). The baseline is a scan that reads the same token columns and does one aggregate per step
(``tokens``: the least any per-step figure of the token rows costs); each view's ratio is its median over the
baseline's, in the same command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUERIES = {
    "baseline: tokens scan": "select run_id, step, count(*), avg(coalesce(old_logprob, pi_logprob) - mu_logprob) "
                             "from tokens group by run_id, step",
    "verl_rollout_corr": "select * from verl_rollout_corr",
    "verl_rollout_is": "select * from verl_rollout_is",
    "prime_rl_mismatch_kl": "select * from prime_rl_mismatch_kl",
    "slime_mismatch": "select * from slime_mismatch",
    "trl_sampling": "select * from trl_sampling",
    "framework_metrics": "select * from framework_metrics",
}

RUN = """
import json, sys, time
from trustscope.db import connect
with connect(sys.argv[1]) as db:
    cur = db.cursor()
    started = time.perf_counter()
    rows = cur.sql(sys.argv[2]).to_arrow_table().num_rows
    print(json.dumps({"seconds": time.perf_counter() - started, "rows": rows}))
"""


QUICK = ["--repeat", "1"]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default=str(ROOT / "sample_logs"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in QUERIES}
    rows: dict[str, int] = {}
    for _ in range(args.repeat):
        for name, sql in QUERIES.items():
            out = subprocess.run([sys.executable, "-c", RUN, args.logdir, sql], check=True, capture_output=True,
                                 text=True, cwd=ROOT)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            seconds[name].append(result["seconds"])
            rows[name] = result["rows"]
    base = statistics.median(seconds["baseline: tokens scan"])
    figures = {}
    for name in QUERIES:
        median = statistics.median(seconds[name])
        print(f"{name:24s} {median:7.3f} s  {median / base:5.2f}x  ({rows[name]} rows)")
        figures[name] = {"median_s": median, "x_scan": median / base, "rows": rows[name]}
    return figures


if __name__ == "__main__":
    main()
