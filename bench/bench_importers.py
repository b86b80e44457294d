"""Importer throughput: ``trustscope import prime-rl`` on a generated prime-rl token export of about 1M tokens.

    .venv/bin/python bench/bench_importers.py                       # ~1M trained tokens, 3 repeats
    .venv/bin/python bench/bench_importers.py --tokens 200000 --repeat 1   # a quick run

The export is written by the test suite's ``PrimeRLExporter`` (``tests/test_importers_prime_rl.py``, the layout
of prime-rl's ``TokenExporter``: packed micro-batches, one compact JSON line per sequence, weight-stream layout)
over 8 steps x 2 ranks, completions of 256-768 tokens after 64-token prompts. Reported: rows/s of the whole import
(parse + check + write through TokenLogger + rename), and the parse and write phases apart, plus the export's
JSONL bytes per token row. Rows are token rows of the imported run (trained, scored tokens).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_importers_prime_rl import PrimeRLExporter, make_rollouts, pack

from trustscope.importers import read_source
from trustscope.importers.base import write_run

STEPS, RANKS = 8, 2


def write_big_export(out: Path, tokens: int, seed: int = 0) -> int:
    """Write an export of about ``tokens`` trained tokens; returns the trained-token count."""
    rng = np.random.default_rng(seed)
    per_call = max(1, tokens // (STEPS * RANKS * 2 * 512))  # sequences per micro-batch (mean completion ~500)
    trained = 0
    exporters = [PrimeRLExporter(out, rank) for rank in range(RANKS)]
    for step in range(STEPS):
        for exp in exporters:
            for micro in range(2):
                rollouts = make_rollouts(rng, per_call, prompt_len=64, completion_len=768)
                trained += sum(sum(r.trained) for r in rollouts)
                total = sum(len(r.prompt) + len(r.completion) for r in rollouts)
                exp.export(step, micro, *pack(rollouts, pad_to=total + 16))
        for exp in exporters:
            exp.mark_stable(step)
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-importers-"))
    try:
        src = work / "prime"
        t0 = time.perf_counter()
        trained = write_big_export(src, args.tokens)
        size = sum(p.stat().st_size for p in src.rglob("*.jsonl"))
        print(f"export: {trained:,} trained tokens, {size / 1e6:.1f} MB JSONL, written in "
              f"{time.perf_counter() - t0:.1f} s")
        results = []
        for i in range(args.repeat):
            t0 = time.perf_counter()
            run = read_source("prime-rl", src)
            t1 = time.perf_counter()
            run_dir = write_run(run, work / "logs", run_id=f"r{i}")
            t2 = time.perf_counter()
            rows = sum(pq.read_metadata(p).num_rows for p in (run_dir / "tokens").glob("*.parquet"))
            results.append((rows, t1 - t0, t2 - t1))
            print(f"repeat {i}: {rows:,} rows  parse {t1 - t0:.2f} s  write {t2 - t1:.2f} s  "
                  f"total {t2 - t0:.2f} s  -> {rows / (t2 - t0):,.0f} rows/s")
        rows = results[0][0]
        total = float(np.median([r[1] + r[2] for r in results]))
        parse = float(np.median([r[1] for r in results]))
        write = float(np.median([r[2] for r in results]))
        print(f"\nmedians of {args.repeat}: {rows / total:,.0f} rows/s whole import "
              f"(parse {rows / parse:,.0f} rows/s, write {rows / write:,.0f} rows/s); "
              f"{size / rows:.0f} JSONL bytes per row")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
