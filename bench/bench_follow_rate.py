"""``trustscope import --follow`` against a job that writes a 2M-token step a minute: is each step committed
before the next one is written?

    .venv/bin/python -m bench.bench_follow_rate                               # 3 steps of ~2M tokens, one a minute
    .venv/bin/python -m bench.bench_follow_rate --tokens 500000 --every 20    # a quick run

One step of a prime-rl token export (``bench_importers.py``'s generator: ``bench/prime_rl_export.py``'s
``PrimeRLExporter``, weight-stream layout, 2 ranks) of about ``--tokens`` trained tokens is generated once. A writer
thread then publishes it ``--steps`` times as steps 0, 1, ... of a live export, one every ``--every`` seconds, as
prime-rl's trainer does: each rank's file written into ``token_exports/step_<N>/`` (the records' step rewritten), then
``STABLE`` touched. The follower is the command a user runs, in its own process with the defaults (``--poll 2
--settle 2``): ``trustscope import --follow prime-rl SRC LOGDIR --stop-after-idle ...``. Reported per step: the
lag from ``STABLE`` to the follower's line saying the step is committed, and whether that came before the next
step's ``STABLE``; then the follower's peak resident memory (its proportional set size, sampled every 20 ms from ``/proc``)
and CPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.bench_importers import tree_rss, write_big_export

ROOT = Path(__file__).resolve().parents[1]


def publish(template: Path, live: Path, steps: int, every: float, stable_at: dict[int, float]) -> None:
    """Write the template step as steps 0..steps-1 of ``live``, one every ``every`` seconds."""
    files = sorted((template / "token_exports" / "step_0").glob("rank_*.jsonl"))
    data = {path.name: path.read_bytes() for path in files}
    start = time.monotonic()
    for step in range(steps):
        time.sleep(max(0.0, start + step * every - time.monotonic()))
        step_dir = live / "token_exports" / f"step_{step}"
        step_dir.mkdir(parents=True)
        for name, text in data.items():
            (step_dir / name).write_bytes(text.replace(b'"step":0,', f'"step":{step},'.encode()))
        stable_at[step] = time.monotonic()
        (step_dir / "STABLE").touch()


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2_000_000, help="trained tokens a step (about)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between two steps")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-follow-rate-"))
    try:
        template = work / "template"
        t0 = time.perf_counter()
        trained = write_big_export(template, args.tokens, steps=1)
        size = sum(p.stat().st_size for p in template.rglob("*.jsonl"))
        print(f"a step: {trained:,} trained tokens, {size / 1e6:.0f} MB of JSON lines (generated in "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        live = work / "live"
        (live / "token_exports").mkdir(parents=True)
        stable_at: dict[int, float] = {}
        committed_at: dict[int, float] = {}
        follower = subprocess.Popen(
            [sys.executable, "-m", "trustscope.cli", "import", "--follow", "prime-rl", str(live), str(work / "logs"),
             "--run-id", "live", "--stop-after-idle", str(args.every + 30)],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss(follower.pid))
                done.wait(0.02)

        def read_lines() -> None:
            for line in follower.stdout:  # type: ignore[union-attr]
                m = re.match(r"step (\d+): \d+ sequences, (\d+) token rows", line)
                if m:
                    committed_at[int(m.group(1))] = time.monotonic()
                    print(f"  {line.strip()}", flush=True)

        threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=read_lines, daemon=True),
                   threading.Thread(target=publish, args=(template, live, args.steps, args.every, stable_at))]
        for thread in threads:
            thread.start()
        threads[2].join()
        _, status, usage = os.wait4(follower.pid, 0)
        done.set()
        threads[1].join(5)
        print(f"\nfollower (poll 2 s, settle 2 s) on {args.steps} steps of {trained:,} tokens, one every "
              f"{args.every:.0f} s (load average now {os.getloadavg()[0]:.1f}):")
        lags = []
        figures: dict = {"trained_tokens_a_step": trained, "json_mb_a_step": size / 1e6, "steps": {}}
        for step in range(args.steps):
            if step not in committed_at:
                print(f"  step {step}: NOT committed")
                figures["steps"][str(step)] = "not committed"
                continue
            lag = committed_at[step] - stable_at[step]
            lags.append(lag)
            before = step + 1 not in stable_at or committed_at[step] < stable_at[step + 1]
            print(f"  step {step}: committed {lag:.1f} s after STABLE "
                  f"({'before' if before else 'AFTER'} the next step)")
            figures["steps"][str(step)] = {"lag_s": lag, "before_next": before}
        if lags:
            print(f"  lag median {statistics.median(lags):.1f} s, max {max(lags):.1f} s; every step committed "
                  f"before the next: {len(lags) == args.steps and max(lags) < args.every}")
            figures["lag"] = {"median_s": statistics.median(lags), "max_s": max(lags),
                              "every_step_before_the_next": len(lags) == args.steps and max(lags) < args.every}
        print(f"  follower: exit {os.waitstatus_to_exitcode(status)}, CPU {usage.ru_utime + usage.ru_stime:.1f} s, "
              f"peak RSS {peak[0] / 2**20:.0f} MB")
        figures["follower"] = {"exit": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime,
                               "peak_rss_mb": peak[0] / 2**20}
        return figures
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
