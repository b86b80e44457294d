"""``trustscope import --follow`` against a one-shot import: catch-up throughput and per-step lag.

    .venv/bin/python -m bench.bench_follow                          # ~1M trained tokens, 8 steps x 2 ranks
    .venv/bin/python -m bench.bench_follow --tokens 200000          # a quick run

The export is ``bench_importers.py``'s (``bench/prime_rl_export.py``'s ``PrimeRLExporter``, weight-stream
layout). Reported:

- *catch-up*: the follower started on the finished export (every step ``STABLE``) until it is idle, against
  ``import_run`` of the same export: the cost of reading and committing step by step (one ``TokenLogger`` flush
  per rank and step, each fsynced) instead of once.
- *lag*: the export published one step at a time (each ``step_<N>/`` moved into place, then ``STABLE`` touched,
  ``--gap`` seconds apart) while the follower polls every ``--poll`` seconds with ``--settle 0``: the seconds from
  ``STABLE`` to the step's commit, median and max over the steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.bench_importers import write_big_export
from trustscope.importers import follow_run, import_run


def catch_up(src: Path, work: Path) -> tuple[float, float, int]:
    """Seconds of a one-shot import and of a follow of the same finished export, and the steps followed."""
    t0 = time.perf_counter()
    import_run("prime-rl", src, work / "one-shot", run_id="one")
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = follow_run("prime-rl", src, work / "followed", run_id="live", poll_s=0.0, settle_s=0.0,
                        stop_after_idle_s=0.0)
    return one, time.perf_counter() - t0, len(result.imported)


def lag(src: Path, work: Path, poll_s: float, gap_s: float) -> list[float]:
    """Seconds from each step's ``STABLE`` to its commit, the export published step by step."""
    live = work / "live-src"
    (live / "token_exports").mkdir(parents=True)
    steps = sorted(int(p.name.split("_")[1]) for p in (src / "token_exports").iterdir())
    stable_at: dict[int, float] = {}
    committed_at: dict[int, float] = {}

    def publish() -> None:
        for step in steps:
            staged = src / "token_exports" / f"step_{step}"
            (staged / "STABLE").unlink()
            shutil.copytree(staged, live / "token_exports" / f"step_{step}")
            stable_at[step] = time.monotonic()
            (live / "token_exports" / f"step_{step}" / "STABLE").touch()
            time.sleep(gap_s)

    writer = threading.Thread(target=publish)
    writer.start()
    follow_run("prime-rl", live, work / "lag", run_id="live", poll_s=poll_s, settle_s=0.0,
               stop_after_idle_s=max(3 * gap_s, 2.0),
               on_step=lambda step, seqs, rows: committed_at.setdefault(step, time.monotonic()))
    writer.join()
    return [committed_at[s] - stable_at[s] for s in steps]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--poll", type=float, default=0.5)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between two published steps")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-follow-"))
    try:
        src = work / "prime"
        trained = write_big_export(src, args.tokens)
        print(f"export: {trained:,} trained tokens, load {os.getloadavg()[0]:.1f}")
        one, followed, steps = catch_up(src, work)
        print(f"catch-up: one-shot import {one:.2f} s, follow {followed:.2f} s ({steps} steps): "
              f"x{followed / one:.2f}, load {os.getloadavg()[0]:.1f}")
        lags = lag(src, work, args.poll, args.gap)
        print(f"lag (poll {args.poll} s, settle 0): median {statistics.median(lags):.2f} s, max {max(lags):.2f} s "
              f"over {len(lags)} steps, load {os.getloadavg()[0]:.1f}")
        return {"trained_tokens": trained,
                "catch_up": {"one_shot_s": one, "follow_s": followed, "steps": steps, "x_one_shot": followed / one},
                "lag": {"median_s": statistics.median(lags), "max_s": max(lags), "steps": len(lags)}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
