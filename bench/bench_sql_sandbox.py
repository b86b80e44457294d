"""What the SQL sandbox costs and whether its limits hold: worker start, per-query overhead against the same
query on the analyses' own connection, and wall time and peak worker RSS of queries built to exceed the limits.

    .venv/bin/python -m bench.bench_sql_sandbox [--logdir sample_logs] [--memory 1e9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from trustscope import db as tsdb

LIMIT_QUERIES = [
    ("select length(repeat('x', 1000000000))", 3.0),
    ("select count(*) from (select unnest(range(100000000)) x)", 1.0),
    ("select count(*) from range(100000000000) a", 1.0),
]
MEMORY_QUERY = ("select max(length(s)) from (select repeat('ab', 100000) || i::varchar as s "
                "from range(20000) t(i)) group by s order by 1")


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


QUICK = ["--repeat", "1"]


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logdir", type=Path, default=Path(__file__).resolve().parent.parent / "sample_logs")
    parser.add_argument("--memory", type=float, default=1e9, help="memory limit of user SQL in bytes")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    query = "select run_id, count(*) as n, avg(mu_logprob) as m from tokens group by run_id"
    with tsdb.connect(args.logdir, cache=False, memory_limit=args.memory) as conn:
        start = time.perf_counter()
        conn.sql("select 1")
        first = time.perf_counter() - start
        print(f"first query (worker start + catalogue): {first:.2f} s")
        conn.sql(query)

        def direct():
            cur = conn.cursor()
            try:
                cur.sql(query).limit(conn.max_rows + 1).to_arrow_table()
            finally:
                cur.close()

        sandboxed = _median_s(lambda: conn.sql(query), args.repeat)
        plain = _median_s(direct, args.repeat)
        print(f"tokens group-by: sandbox {sandboxed * 1e3:.0f} ms, analyses' connection {plain * 1e3:.0f} ms, "
              f"x{sandboxed / plain:.2f}")
        warm = _median_s(lambda: conn.sql("select 1"), args.repeat)
        print(f"select 1 in a warm worker: {warm * 1e3:.0f} ms")
        figures: dict = {"first_query_s": first, "select_1_warm_s": warm,
                         "group_by": {"sandbox_s": sandboxed, "direct_s": plain, "x_direct": sandboxed / plain}}
        print("| query | limit | stopped by | wall s | peak worker RSS MiB |")
        for i, (q, timeout) in enumerate([*LIMIT_QUERIES, (MEMORY_QUERY, 60.0)], 1):
            conn.sql("select 1")
            start = time.perf_counter()
            try:
                conn.sql(q, timeout_s=timeout)
                how = "not stopped"
            except tsdb.QueryStopped as err:
                how = type(err).__name__
            wall = time.perf_counter() - start
            rss = conn._resources.sandbox.peak_rss / 2**20
            print(f"| `{q}` | {timeout:g} s, {args.memory / 2**20:.0f} MiB | {how} | {wall:.2f} | {rss:.0f} |")
            figures[f"limit query {i}"] = {"query": q, "timeout_s": timeout, "stopped_by": how, "wall_s": wall,
                                           "peak_worker_rss_mib": rss}
    return figures


if __name__ == "__main__":
    main()
