"""What logging costs the training thread a step, and the memory it holds when the store is slower than training.

    nice -n 10 .venv/bin/python -m bench.bench_logger_step_cost                 # 512 x 4,096 tokens, 6 steps a case
    nice -n 10 .venv/bin/python -m bench.bench_logger_step_cost --responses 128 --steps 4 --json out.json

A step is ``--responses`` x ``--length`` tokens (default 2,097,152: a rank's share of a 100M-token step on 48
ranks), the arrays of ``bench/bench_logger_scale.py`` without top-K. The training loop is stood in for by a sleep
of ``--compute-s`` seconds a step (the forward and backward the logger must not delay); the calling thread's wall
time inside ``log_step`` + ``commit_step`` is what logging adds to a step, set beside ``--assume-step-s``, the step
time of a real 2M-token rank-step (default 60 s: the training compute alone of a 1.5B-parameter model, 8 N T
FLOPs for pi_old, forward and backward = 2.5e16 FLOPs, at 40% of an H100's 989 bf16 TFLOP/s; generating the same
tokens and a larger model only lengthen it, so 60 s is the short end). Cases, each in a fresh process:

- ``baseline``: build the arrays and sleep, log nothing: the peak memory every case also pays;
- ``keeps-up``: ``on_full="drop"``, a store as fast as the disk;
- ``slow-drop``: every file the store writes takes ``--slow-s`` seconds more (``LocalStore.publish`` throttled),
  so the writer falls behind, ``on_full="drop"``: the calls never wait, what does not fit the row bound is dropped
  whole (counted in ``run.json``'s ``buffer``);
- ``slow-block``: the same store, ``on_full="block"``: the calls wait for room (the training slows to the store),
  nothing is dropped;
- ``slow-unbounded``: the same store with no row or queue bound: the memory a logger without the bound would hold.

Reported per case: the calling thread's wall in ``log_step`` + ``commit_step`` a step (median and largest) and the
median as a share of ``--assume-step-s``; the peak RSS over the baseline's; the buffer's ``peak_rows``; rows dropped;
seconds blocked; the time ``close`` took (the writer draining what it still held). ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import common

common.one_thread()

CASES = ("baseline", "keeps-up", "slow-drop", "slow-block", "slow-unbounded")


def child(case: str, responses: int, length: int, steps: int, compute_s: float, slow_s: float, out: Path) -> dict:
    """One case, in this fresh process."""
    import numpy as np

    from bench.common import build_step

    data = build_step(0, responses, length, 0)
    mask = np.ones((responses, length), dtype=bool)
    samples = {"sample_id": np.arange(responses), "prompt_id": np.arange(responses) // 16}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result: dict = {"case": case, "tokens_per_step": responses * length, "steps": steps}
    if case == "baseline":
        for _ in range(steps):
            time.sleep(compute_s)
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return result
    from trustscope.logger import TokenLogger
    from trustscope.runformat.stores import LocalStore

    if case.startswith("slow"):
        publish = LocalStore.publish

        def slow_publish(self, tmp, final, fsync):
            time.sleep(slow_s)
            return publish(self, tmp, final, fsync)

        LocalStore.publish = slow_publish
    options = {"on_full": "block" if case == "slow-block" else "drop", "block_timeout_s": None}
    if case == "slow-unbounded":
        options.update(max_buffered_rows=2**62, max_queue=10**6)
    logger = TokenLogger(out, case, loss_rule="dppo_binary_tv", log_topk=False, **options)
    waits = []
    for step in range(steps):
        time.sleep(compute_s)  # the step's forward and backward
        t0 = time.perf_counter()
        logger.log_step(step, tokens=data, mask=mask, samples=samples)
        logger.commit_step()
        waits.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    buffer = logger.buffer
    logger.close()
    result.update({"wait_s": waits, "wait_median_s": statistics.median(waits), "wait_max_s": max(waits),
                   "close_s": time.perf_counter() - t0, "peak_rows": buffer["peak_rows"],
                   "dropped_rows": buffer["dropped_rows"], "blocked_s": buffer["blocked_s"],
                   "max_buffered_rows": buffer["max_buffered_rows"],
                   "rss_before_gib": rss_before / 2**20,
                   "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=512)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--compute-s", type=float, default=1.0, help="the stand-in training step's sleep")
    ap.add_argument("--slow-s", type=float, default=8.0, help="extra seconds for each file the slow store writes")
    ap.add_argument("--assume-step-s", type=float, default=60.0, help="a real 2M-token rank-step's time")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.responses, args.length, args.steps, args.compute_s, args.slow_s,
                               args.out)))
        return {}
    results = {}
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="ts-stepcost-") as tmp:
            cmd = [*common.module_cmd(__spec__), "--child", case, "--out", tmp, "--responses", str(args.responses),
                   "--length", str(args.length), "--steps", str(args.steps), "--compute-s", str(args.compute_s),
                   "--slow-s", str(args.slow_s)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"case {case} failed:\n{done.stderr[-3000:]}")
            results[case] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results.get("baseline", {}).get("peak_rss_gib")
    print(f"{args.responses} x {args.length} tokens a step, {args.steps} steps, a stand-in step of {args.compute_s} s; "
          f"shares of an assumed {args.assume_step_s:g} s step")
    print("| case | log_step + commit_step s, median / max | % of the step | peak RSS GiB | added GiB | peak rows "
          "| dropped rows | blocked s | close s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, r in results.items():
        if case == "baseline":
            print(f"| baseline | | | {r['peak_rss_gib']:.2f} | | | | | |")
            continue
        added = "" if base is None else f"{r['peak_rss_gib'] - base:+.2f}"
        print(f"| {case} | {r['wait_median_s']:.3f} / {r['wait_max_s']:.3f} | "
              f"{100 * r['wait_median_s'] / args.assume_step_s:.2f}% | {r['peak_rss_gib']:.2f} | {added} | "
              f"{r['peak_rows']:,} | {r['dropped_rows']:,} | {r['blocked_s']:.1f} | {r['close_s']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
