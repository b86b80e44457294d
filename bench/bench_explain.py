"""Time ``trustscope explain`` on a large run whose summaries exist, against one scan of its token rows.

    .venv/bin/python -m bench.bench_explain --tokens 100_000_000 --fraction 0.01

The run is built quickly: a few steps with injected causes (stale responses, misrouted tokens; the summaries over
every token, ``--fraction`` of the responses' token rows kept) are logged for real by
:func:`trustscope.explain.inject.write_run`, then their files are written again under new step numbers until the run
holds ``--tokens`` tokens (``bench/bench_overview.py``'s ``replicate``: only the ``step`` column changed, one
committed flush a step). ``explain``'s totals come from the summaries of every token; its allocation reads the kept
token rows, so its time follows the logged rows, not the tokens.

Timed, each in a new process (a new connection, no query cache), ``--repeat`` times, the median printed:

  explain    :func:`trustscope.explain.analysis.explain` over the run (200 bootstrap replicates), connect included;
  scan       the baseline: the same connection's ``select count(*), sum(pi_logprob - mu_logprob) from tokens``, one
             pass over the logged token rows, connect included.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN_ID = "big"
TIMED = {
    "explain": "from trustscope.explain.analysis import explain\n"
               "r = explain(db, replicates=200).runs[0]\n"
               "out = {'tokens': r.run.tokens, 'logged': r.run.tokens_logged,\n"
               "       'top': max(r.run.causes, key=lambda c: c.share).source}",
    "scan": "n, s = db.cursor().sql('select count(*), sum(pi_logprob - mu_logprob) from tokens').fetchall()[0]\n"
            "out = {'logged': n}",
}


def _keeping_bits(write_table, bits: bytes):
    """``pq.write_table`` that writes the logger's ``blocked_rules`` list into every tokens file's footer, as the
    logger does (the copies of bench_overview's ``replicate`` keep the table's own metadata only)."""
    def write(table, where, **options):
        if "/tokens/" in str(where):
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), BITS_KEY: bits})
        return write_table(table, where, **options)

    return write


BITS_KEY = b"trustscope.blocked_rules"


def build(logdir: Path, tokens: int, fraction: float, steps: int) -> dict:
    import pyarrow.parquet as pq

    from bench import bench_overview
    from trustscope.explain.inject import InjectConfig, write_run

    start = time.perf_counter()
    cfg = InjectConfig(causes={"stale": 0.3, "routing": 0.1}, steps=steps, responses=256, length=256, vocab=128,
                       token_fraction=fraction, seed=0)
    run = write_run(logdir, RUN_ID, cfg, flush_steps=True)
    per_step = cfg.responses * cfg.length
    total_steps = max(steps, round(tokens / per_step))
    first = next(iter(sorted((run / "tokens").rglob("*.parquet"))))
    bits = pq.read_metadata(first).metadata[BITS_KEY]
    plain = bench_overview.pq.write_table
    bench_overview.pq.write_table = _keeping_bits(plain, bits)
    try:
        bench_overview.replicate(run, total_steps)
    finally:
        bench_overview.pq.write_table = plain
    return {"steps": total_steps, "tokens": total_steps * per_step, "build_s": time.perf_counter() - start}


def time_once(logdir: Path, what: str) -> dict:
    code = ("import time, json, sys\nstart = time.perf_counter()\nfrom trustscope.db import connect\n"
            f"db = connect({str(logdir)!r}, cache=False)\n{TIMED[what]}\n"
            "out['seconds'] = time.perf_counter() - start\nprint(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--fraction", type=float, default=0.01, help="token_fraction: the share of responses kept")
    parser.add_argument("--steps", type=int, default=8, help="steps logged for real before the copies")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the built log")
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="bench-explain-"))
    try:
        built = build(logdir, args.tokens, args.fraction, args.steps)
        print(f"built {built['tokens']:,} tokens in {built['steps']} steps in {built['build_s']:.0f} s: {logdir}")
        runs = {what: [time_once(logdir, what) for _ in range(args.repeat)] for what in ("scan", "explain")}
        med = {what: statistics.median(r["seconds"] for r in rs) for what, rs in runs.items()}
        got = runs["explain"][0]
        print(f"explain: {got['tokens']:,} tokens (summaries), {got['logged']:,} logged rows, largest share "
              f"{got['top']}")
        print(f"scan     {med['scan']:.2f} s (median of {args.repeat}, fresh processes)")
        print(f"explain  {med['explain']:.2f} s = {med['explain'] / med['scan']:.1f} x the scan")
    finally:
        if not args.keep:
            shutil.rmtree(logdir, ignore_errors=True)
    return {"tokens": got["tokens"], "logged_rows": got["logged"], "largest_share": got["top"], "scan_s": med["scan"],
            "explain_s": med["explain"], "x_scan": med["explain"] / med["scan"]}


if __name__ == "__main__":
    main()
