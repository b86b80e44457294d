"""Size and CPU cost of the summaries' dimension rows (position bucket, turn, staleness) per step.

    .venv/bin/python -m bench.bench_summaries                  # B = 64 responses x T = 1024, K = 20, 5 repeats
    .venv/bin/python -m bench.bench_summaries --tokens 1024 --repeat 3

One step of an asynchronous multi-turn rollout (4 turns a response; each response sampled 0-2 versions behind,
switching to a newer version part-way) goes through the logger's own summaries (``summarize_call``: every
registered rule's mask, the moments and histograms). Reported per step:

- rows and Parquet bytes of the ``summaries`` table (the logger's encodings), the sign x mu rows alone (what the
  table held before the dimensions: the baseline) against all rows, and the rows each dimension adds;
- CPU seconds of ``summarize_call`` with the dimensions against without them (``trustscope.columns.DIMENSIONS``
  emptied), each in a fresh process, the two alternating ``--repeat`` times; the median of the per-pair ratios.

The same step without ``turn`` and ``policy_version`` (a synchronous single-turn run: position rows only) is
reported beside it.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import common


def step(B: int, T: int, K: int, turns: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Flat token columns of one checked step (as ``log_step`` hands them to the summaries)."""
    rng = np.random.default_rng(seed)
    mu_topk = -np.sort(rng.exponential(2.0, (B, T, K)).astype(np.float32), axis=-1)  # (B, T, K)
    mu_topk[..., 0] = np.log(rng.uniform(1e-4, 1.0, (B, T))).astype(np.float32)
    mu_topk = -np.sort(-mu_topk, axis=-1)
    pi_topk = np.minimum(mu_topk + rng.normal(0, 0.02, (B, T, K)).astype(np.float32), 0)
    pos = np.tile(np.arange(T, dtype=np.int32), B)  # (N,)
    cols = {"token_id": rng.integers(0, 150_000, B * T).astype(np.int32), "pos": pos,
            "sample_id": np.repeat(np.arange(B, dtype=np.int64), T), "prompt_id": np.repeat(np.arange(B) // 8, T),
            "mu_logprob": mu_topk[..., 0].reshape(-1), "pi_logprob": pi_topk[..., 0].reshape(-1),
            "old_logprob": pi_topk[..., 0].reshape(-1).copy(),
            "entropy": rng.exponential(1.0, B * T).astype(np.float32),
            "advantage": np.repeat(rng.normal(size=B).astype(np.float32), T), "kept": rng.random(B * T) > 0.1,
            "mu_topk_ids": rng.integers(0, 150_000, (B * T, K)).astype(np.int32),
            "mu_topk_logprobs": mu_topk.reshape(-1, K), "pi_topk_logprobs": pi_topk.reshape(-1, K)}
    if turns:
        cols["turn"] = (pos * 4 // T).astype(np.int32)
        step_ = 10
        start = np.repeat(step_ - rng.integers(0, 3, B), T)  # each response began 0-2 versions behind
        cols["policy_version"] = np.where(pos > np.repeat(rng.integers(0, T, B), T), np.minimum(start + 1, step_),
                                          start).astype(np.int64)
    return cols


def table_bytes(rows: list[dict]) -> int:
    """Parquet bytes of ``rows`` as one summaries file, with the logger's schema and encodings."""
    from trustscope import runformat as S

    n = len(rows)
    given = {"run_id": ["run"] * n, "step": [10] * n, "rank": [0] * n, "part": [0] * n}
    data = pa.table({f.name: given.get(f.name) or [r.get(f.name) for r in rows] for f in S.SUMMARIES},
                    schema=S.with_metadata("summaries"))
    buf = io.BytesIO()
    pq.write_table(data, buf, **S.WRITE_OPTIONS["summaries"].writer_kwargs())
    return buf.tell()


def worker(args: argparse.Namespace) -> None:
    """One fresh process: summarize the step ``--calls`` times, print rows, bytes and CPU seconds as JSON."""
    import torch

    torch.set_num_threads(1)
    from trustscope import columns
    from trustscope.logger.summaries import blocked_rule_list, summarize_call

    if args.worker == "base":
        columns.DIMENSIONS = ()
    bits = tuple(name for name, _ in blocked_rule_list())
    cols = step(args.B, args.tokens, args.k, args.turns)
    summarize_call({k: v.copy() for k, v in cols.items()}, bits, step=10)  # warm-up: torch, the rules
    cpu = []
    for _ in range(args.calls):
        fresh = {k: v.copy() for k, v in cols.items()}
        start = time.process_time()
        rows = summarize_call(fresh, bits, step=10)
        cpu.append(time.process_time() - start)
    base = [r for r in rows if r.get("dimension") is None]
    per_dim = {d: sum(r.get("dimension") == d for r in rows) for d in ("position", "turn", "staleness")}
    print(json.dumps({"rows": len(rows), "base_rows": len(base), "bytes": table_bytes(rows),
                      "base_bytes": table_bytes(base), "per_dimension": per_dim, "cpu_s": statistics.median(cpu)}))


def run(args: argparse.Namespace, mode: str, turns: bool) -> dict:
    cmd = [*common.module_cmd(__spec__), "--worker", mode, "--B", str(args.B), "--tokens", str(args.tokens), "--k",
           str(args.k), "--calls", str(args.calls)] + (["--turns"] if turns else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


QUICK = ["--B", "16", "--tokens", "256", "--repeat", "1"]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--B", type=int, default=64, help="responses in the step")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per response (T)")
    parser.add_argument("--k", type=int, default=20, help="top-K")
    parser.add_argument("--calls", type=int, default=3, help="summaries timed per process (median)")
    parser.add_argument("--repeat", type=int, default=5, help="fresh-process pairs")
    parser.add_argument("--worker", choices=("base", "dims"), help=argparse.SUPPRESS)
    parser.add_argument("--turns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return {}
    print(f"one step: B = {args.B} x T = {args.tokens} = {args.B * args.tokens:,} tokens, K = {args.k}")
    figures = {}
    for turns in (True, False):
        label = "async multi-turn (position, turn, staleness)" if turns else "sync single-turn (position only)"
        ratios, pairs = [], []
        for i in range(args.repeat):
            order = ("base", "dims") if i % 2 == 0 else ("dims", "base")
            got = {mode: run(args, mode, turns) for mode in order}
            ratios.append(got["dims"]["cpu_s"] / got["base"]["cpu_s"])
            pairs.append(got)
        d = pairs[-1]["dims"]
        print(f"\n{label}")
        print(f"  rows a step:  {d['base_rows']:,} sign x mu  ->  {d['rows']:,} with the dimensions "
              f"(x{d['rows'] / d['base_rows']:.2f}); added per dimension {d['per_dimension']}")
        print(f"  bytes a step: {d['base_bytes']:,}  ->  {d['bytes']:,} (x{d['bytes'] / d['base_bytes']:.2f}); "
              f"per token {d['base_bytes'] / (args.B * args.tokens):.3f} -> {d['bytes'] / (args.B * args.tokens):.3f}")
        base_cpu = [p["base"]["cpu_s"] for p in pairs]
        dims_cpu = [p["dims"]["cpu_s"] for p in pairs]
        print(f"  summaries CPU s a step: {statistics.median(base_cpu):.3f} without, {statistics.median(dims_cpu):.3f}"
              f" with; ratio per pair {', '.join(f'{r:.2f}' for r in ratios)}; median x{statistics.median(ratios):.2f}")
        figures[label] = {"base_rows": d["base_rows"], "rows": d["rows"], "rows_per_dimension": d["per_dimension"],
                          "base_bytes": d["base_bytes"], "bytes": d["bytes"],
                          "cpu_s_without": statistics.median(base_cpu), "cpu_s_with": statistics.median(dims_cpu),
                          "x_cpu": statistics.median(ratios)}
    return figures


if __name__ == "__main__":
    main()
