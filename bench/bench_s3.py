"""Logs on object storage: what s3:// costs next to local disk, against a local S3 endpoint (moto, 127.0.0.1).

    .venv/bin/python -m bench.bench_s3                      # 20 steps of 64 x 512 tokens, K = 20
    .venv/bin/python -m bench.bench_s3 --steps 5 --repeat 1  # a quick run

Reports, per repeat (local and s3 runs interleaved): the logger's wall time from the first ``log_step`` to
``close`` for a local directory and for ``s3://``, the time of the open-time check (``TokenLogger`` construction),
and the readers' mirror: the first sync of the prefix (every committed object downloaded), a sync with nothing
new (listings and manifests only: objects whose ETag is unchanged are not downloaded) and ``connect`` over it.
moto is a Python server on the same 2 cores: its throughput says nothing about real S3, the request counts and the
split between listing and downloading do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from moto.server import ThreadedMotoServer

from trustscope import runformat
from trustscope.db import connect
from trustscope.logger import TokenLogger


def step_data(rng: np.random.Generator, B: int, T: int, K: int) -> dict:
    topk = np.sort(-rng.random((B, T, K)).astype(np.float32) * 8, axis=-1)[..., ::-1].copy()
    ids = rng.integers(0, 152_064, (B, T, K))
    tokens = {"token_id": ids[..., 0], "mu_logprob": topk[..., 0], "pi_logprob": topk[..., 0] - 1e-3,
              "advantage": rng.normal(size=B), "mu_topk_ids": ids, "mu_topk_logprobs": topk,
              "pi_topk_logprobs": topk - 1e-3}
    return {"tokens": tokens, "mask": np.ones((B, T), bool),
            "samples": {"sample_id": np.arange(B), "prompt_id": np.arange(B) // 8, "reward": rng.random(B)}}


def log(logdir, run_id: str, steps: list[dict]) -> tuple[float, float]:
    """(seconds to open, seconds from the first log_step to close)."""
    t0 = time.perf_counter()
    lg = TokenLogger(logdir, run_id, flush_seconds=3600)
    t1 = time.perf_counter()
    for i, data in enumerate(steps):
        lg.log_step(i, **data)
        lg.flush()
    lg.close()
    return t1 - t0, time.perf_counter() - t1


QUICK = ["--steps", "4", "--batch", "16", "--tokens", "128", "--repeat", "1"]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    runformat.s3_filesystem().mkdir("bench")
    rng = np.random.default_rng(0)
    steps = [step_data(rng, args.batch, args.tokens, args.k) for _ in range(args.steps)]
    rows = args.steps * args.batch * args.tokens
    scratch = Path(tempfile.mkdtemp(prefix="trustscope-bench-s3-"))
    results: dict[str, list[float]] = {}
    try:
        for r in range(args.repeat):
            _, local = log(scratch / "local", f"run{r}", steps)
            url = f"s3://bench/logs{r}"
            opened, remote = log(url, f"run{r}", steps)
            mirror = scratch / f"mirror{r}"
            t0 = time.perf_counter()
            runformat.mirror(url, mirror)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            runformat.mirror(url, mirror)
            again = time.perf_counter() - t0
            t0 = time.perf_counter()
            with connect(url, cache=False, mirror_dir=mirror) as db:
                db.runs()
            opened_db = time.perf_counter() - t0
            for name, value in (("local log s", local), ("s3 log s", remote), ("s3 open check s", opened),
                                ("mirror first sync s", first), ("mirror sync, nothing new s", again),
                                ("connect + runs() s", opened_db)):
                results.setdefault(name, []).append(value)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()
    print(f"{rows:,} token rows in {args.steps} flushes, K = {args.k}; medians of {args.repeat} repeat(s)")
    figures = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        print(f"  {name:<28} {statistics.median(values):8.3f}   (all: {', '.join(f'{v:.3f}' for v in values)})")
    figures["x_s3_over_local_log"] = figures["s3 log s"] / figures["local log s"]
    print(f"  s3 / local logging time     {figures['x_s3_over_local_log']:8.2f}x")
    return figures


if __name__ == "__main__":
    main()
