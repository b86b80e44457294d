"""Peak memory of a logging loop against a store slower than the trainer, with and without the memory bound.

    .venv/bin/python -m bench.bench_logger_memory                  # 40 steps of 64 x 512 tokens, K = 20
    .venv/bin/python -m bench.bench_logger_memory --steps 10       # a quick run

Each variant runs in its own process (peak RSS, ``VmHWM`` of ``/proc/self/status``, is per process). The trainer
logs one step every ``--step-ms`` milliseconds; every flush file the store writes takes ``--store-s`` seconds more
(``LocalStore.publish`` throttled with a sleep), so the store keeps up with a fraction of the logging rate.
Variants: ``unbounded`` (no row bound and no queue bound: the memory a logger without them would hold),
``block`` and ``drop`` (``max_buffered_rows=--bound``). Reported per variant: peak RSS over the RSS before the
first ``log_step`` (the step's arrays and the logger already in place), the buffer's ``peak_rows``, the rows
dropped, the seconds spent in ``log_step`` and the time to ``close``; and the unbounded peak over each bounded one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from bench import common


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    import numpy as np

    from trustscope.logger import TokenLogger
    from trustscope.runformat.stores import LocalStore

    publish = LocalStore.publish

    def slow(self, tmp, final, fsync):
        time.sleep(args.store_s)
        publish(self, tmp, final, fsync)

    LocalStore.publish = slow
    rng = np.random.default_rng(0)
    B, T, K = args.batch, args.tokens, args.k
    topk = np.sort(-rng.random((B, T, K)).astype(np.float32) * 8, axis=-1)[..., ::-1].copy()  # (B, T, K)
    ids = rng.integers(0, 152_064, (B, T, K)).astype(np.int32)  # (B, T, K)
    tokens = {"token_id": ids[..., 0], "mu_logprob": topk[..., 0], "pi_logprob": topk[..., 0] - 1e-3,
              "advantage": rng.normal(size=B).astype(np.float32), "mu_topk_ids": ids, "mu_topk_logprobs": topk,
              "pi_topk_logprobs": topk - 1e-3}
    samples = {"sample_id": np.arange(B), "prompt_id": np.arange(B) // 8, "reward": rng.random(B)}
    bound = {"unbounded": {"max_buffered_rows": 10**12, "max_queue": 10**9},
             "block": {"max_buffered_rows": args.bound, "on_full": "block", "block_timeout_s": None},
             "drop": {"max_buffered_rows": args.bound, "on_full": "drop"}}[args.child]
    with tempfile.TemporaryDirectory() as logdir:
        lg = TokenLogger(logdir, args.child, flush_rows=B * T, flush_seconds=3600, summaries=False,
                         compact_every=0, fsync=False, **bound)
        base = rss_kb("VmRSS")
        in_log = 0.0
        t0 = time.perf_counter()
        for step in range(args.steps):
            t = time.perf_counter()
            lg.log_step(step, tokens=tokens, mask=None, samples=samples, scalars={"loss": float(step)})
            in_log += time.perf_counter() - t
            time.sleep(args.step_ms / 1000)
        lg.close()
        total = time.perf_counter() - t0
        buffer = lg.buffer
    print(json.dumps({"variant": args.child, "base_mb": base / 1024, "peak_over_base_mb": (rss_kb("VmHWM") - base) / 1024,
                      "peak_rows": buffer["peak_rows"], "dropped_rows": buffer["dropped_rows"],
                      "log_step_s": in_log, "total_s": total}))


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--bound", type=int, default=4 * 32768, help="max_buffered_rows of the bounded variants")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the trainer's time between log_step calls")
    ap.add_argument("--store-s", type=float, default=0.25, help="extra seconds per flush file stored")
    ap.add_argument("--child", choices=["unbounded", "block", "drop"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return {}
    rows = args.steps * args.batch * args.tokens
    print(f"{args.steps} steps of {args.batch} x {args.tokens} tokens, K = {args.k} ({rows:,} token rows); a step "
          f"logged every {args.step_ms:g} ms, each flush file stored {args.store_s:g} s late; bound "
          f"{args.bound:,} rows")
    out = {}
    for variant in ("unbounded", "block", "drop"):
        cmd = [*common.module_cmd(__spec__), "--child", variant, *sys.argv[1:]]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        out[variant] = json.loads(line)
    print("| variant | peak RSS over base, MB | buffer peak_rows | rows dropped | s in log_step | s to close |")
    print("|---|---|---|---|---|---|")
    for variant, r in out.items():
        print(f"| {variant} | {r['peak_over_base_mb']:.0f} | {r['peak_rows']:,} | {r['dropped_rows']:,} | "
              f"{r['log_step_s']:.2f} | {r['total_s']:.2f} |")
    figures: dict = {variant: {key: r[key] for key in ("peak_over_base_mb", "peak_rows", "dropped_rows", "log_step_s",
                                                       "total_s")} for variant, r in out.items()}
    for variant in ("block", "drop"):
        ratio = out["unbounded"]["peak_over_base_mb"] / max(out[variant]["peak_over_base_mb"], 1e-9)
        print(f"unbounded / {variant} peak over base: x{ratio:.1f}")
        figures[variant]["x_unbounded_peak"] = ratio
    return figures


if __name__ == "__main__":
    main()
