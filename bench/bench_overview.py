"""Time the Runs overview's queries on a 10M- or 100M-token log whose summaries table exists.

    .venv/bin/python -m bench.bench_overview --tokens 10_000_000
    .venv/bin/python -m bench.bench_overview --tokens 100_000_000 --rows-baseline   # + the token-rows path

The log is built quickly: a few steps are logged for real by :class:`trustscope.logger.TokenLogger` (summaries on,
every token row kept, two micro-batches a step), then their files (tokens, samples, summaries) are written again
under new step numbers, only the ``step`` column changed, each as its own committed flush, and the manifest's
counts are set to match; ``validate`` reads the result as one run. The log is deleted at the end unless ``--keep``.

Timed, each in a new process with an empty query cache (cold: a new connection, DuckDB's own caches empty; the OS
file cache is whatever the build left) and then again on the same connection (warm, median of ``--repeat``):

  overview   what the Runs page asks the query layer for: :func:`trustscope.report.run_table`,
             :meth:`LogDB.overview` (exact, from the summaries table), the collapse warning and the blocked totals
             over it;
  polars     the baseline: the same per-step figures (tokens, mismatch, bad negative rate, every rule's blocked
             count and share of the A != 0 tokens, reward) computed by polars from the summaries and samples
             Parquet files, in the same process;
  rows       with ``--rows-baseline``: the token-rows path the overview took before summaries existed
             (``LogDB.step_summary`` on an empty disk cache: one pass over every token row).
The overview's numbers are checked against polars' (and the rows path's) before any figure is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import common

ROOT = Path(__file__).resolve().parent.parent

from trustscope import runformat  # noqa: E402

RUN_ID = "big"
K = 8
"""Top-K of the logged rows (the logger stores K ids and two K log-prob lists per token)."""
COPIED_TABLES = ("tokens", "samples", "summaries")


def rollout(seed: int, batch: int, length: int) -> tuple[dict, np.ndarray, dict]:
    """One padded step ``(B, T)`` of rollout-like rows: mu over every bucket, pi near mu with a few far tokens,
    advantages of both signs and some zero, ragged response lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, batch)
    mask = np.arange(length)[None, :] < lengths[:, None]  # (B, T)
    mu_topk = -np.sort(rng.exponential(2.0, (batch, length, K)).astype(np.float32), axis=-1)  # (B, T, K)
    mu_topk[..., 0] = np.log(rng.uniform(1e-4, 1.0, (batch, length))).astype(np.float32)
    mu_topk = -np.sort(-mu_topk, axis=-1)
    far = rng.random((batch, length, K)) < 0.02
    shift = np.where(far, rng.normal(0, 1.0, far.shape), rng.normal(0, 0.01, far.shape)).astype(np.float32)
    pi_topk = np.minimum(mu_topk + shift, 0)
    adv = rng.normal(size=batch).astype(np.float32)
    adv[: batch // 8] = 0.0
    tokens = {
        "token_id": rng.integers(0, 32_000, (batch, length)),
        "mu_logprob": mu_topk[..., 0], "pi_logprob": pi_topk[..., 0],
        "entropy": rng.exponential(1.0, (batch, length)).astype(np.float32),
        "advantage": adv,
        "mu_topk_ids": rng.integers(0, 32_000, (batch, length, K)),
        "mu_topk_logprobs": mu_topk, "pi_topk_logprobs": pi_topk,
        "kept": rng.random((batch, length)) > 0.05,
    }
    samples = {"sample_id": np.arange(batch), "prompt_id": np.arange(batch) // 16, "reward": rng.random(batch)}
    return tokens, mask, samples


def log_template(logdir: Path, steps: int, tokens_per_step: int) -> None:
    """``steps`` steps logged for real, two micro-batches each, every token row kept, summaries on."""
    from trustscope.logger import TokenLogger

    length = 1024
    batch = max(2, round(tokens_per_step / (0.75 * length)) // 2 * 2)
    with TokenLogger(logdir, RUN_ID, loss_rule="dppo_binary_tv", flush_rows=1, fsync=False) as lg:
        for step in range(steps):
            tokens, mask, samples = rollout(step, batch, length)
            half = batch // 2
            for part in (slice(0, half), slice(half, batch)):
                lg.log_step(step, tokens={k: v[part] for k, v in tokens.items()}, mask=mask[part],
                            samples={k: v[part] for k, v in samples.items()})


def replicate(run: Path, total_steps: int) -> None:
    """Write the logged steps' files again under steps ``logged .. total_steps - 1`` (step ``s`` copies logged
    step ``s % logged``), only the ``step`` column rewritten, one committed flush per step; then the manifest's
    counts. Requires one flush per logged step (``flush_rows=1``)."""
    files = runformat.committed_files(run)
    by_step: dict[int, dict[str, list[tuple[Path, pa.Table]]]] = {}
    for table in COPIED_TABLES:
        for f in files[table]:
            name = runformat.parse_data_file(f.name)
            if name.first_step != name.last_step:
                raise RuntimeError(f"{f}: a flush holds steps {name.first_step}..{name.last_step}; need one a step")
            by_step.setdefault(name.first_step, {}).setdefault(table, []).append((f, pq.read_table(f)))
    logged = sorted(by_step)
    manifest = json.loads((run / runformat.MANIFEST).read_text())
    flush = int(manifest["committed_flush"])
    rows = dict(manifest["rows"])
    for step in range(len(logged), total_steps):
        flush += 1
        for table, parts in by_step[logged[step % len(logged)]].items():
            for f, data in parts:
                part = f.stem.rsplit("-p", 1)[1] if "-p" in f.stem else None
                target = f.parent / runformat.data_file_name(0, step, step, flush, None if part is None else int(part))
                column = data.schema.get_field_index("step")
                moved = data.set_column(column, data.schema.field(column), pa.array(np.full(len(data), step)))
                pq.write_table(moved, target, compression="zstd", row_group_size=131_072)
                rows[table] += len(data)
    scale = rows["tokens"] / manifest["rows"]["tokens"]
    manifest.update(committed_flush=flush, last_step=total_steps - 1, rows=rows,
                    tokens_generated=round(manifest["tokens_generated"] * scale),
                    tokens_logged=round(manifest["tokens_logged"] * scale))
    tmp = run / f".{runformat.MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.replace(run / runformat.MANIFEST)


def build(logdir: Path, total_tokens: int, tokens_per_step: int, logged_steps: int, validate: bool) -> dict:
    start = time.perf_counter()
    log_template(logdir, logged_steps, tokens_per_step)
    logged_s = time.perf_counter() - start
    run = logdir / RUN_ID
    per_step = json.loads((run / runformat.MANIFEST).read_text())["tokens_logged"] / logged_steps
    total_steps = max(logged_steps, round(total_tokens / per_step))
    replicate(run, total_steps)
    size = sum(f.stat().st_size for f in run.rglob("*.parquet"))
    manifest = json.loads((run / runformat.MANIFEST).read_text())
    return {"steps": total_steps, "tokens": manifest["tokens_logged"], "bytes": size, "logged_s": logged_s,
            "build_s": time.perf_counter() - start,
            "problems": len(runformat.validate_run(run)) if validate else "not validated"}


# ------------------------------------------------------------------------------------------------ timings


def overview_queries(db) -> dict:
    """What the Runs page asks the query layer for."""
    from trustscope import report

    table = report.run_table(db)
    overview = db.overview()
    warnings = report.collapse_warnings(overview, table["run_id"].tolist())
    totals = overview.blocked_totals()
    return {"overview": overview, "warnings": warnings, "totals": totals}


def polars_overview(run: Path):
    """The same per-step figures from the summaries and samples files, by polars (the baseline)."""
    import polars as pl

    summ = pl.scan_parquet(str(run / "summaries" / "**" / "*.parquet")).filter(pl.col("dimension").is_null())
    tokens = summ.filter(pl.col("metric") == "tokens").group_by("step").agg(
        n_tokens=pl.col("count").sum(),
        n_grad=pl.col("count").filter(pl.col("advantage_sign") != "zero").sum())
    moments = summ.filter(pl.col("metric").is_in(["abs_prob_diff", "bad_negative", "entropy"])).group_by(
        "step").agg(
        mismatch_sum=pl.col("sum").filter(pl.col("metric") == "abs_prob_diff").sum(),
        mismatch_n=pl.col("count").filter(pl.col("metric") == "abs_prob_diff").sum(),
        n_bad=pl.col("count").filter(pl.col("metric") == "bad_negative").sum(),
        entropy_sum=pl.col("sum").filter(pl.col("metric") == "entropy").sum(),
        entropy_n=pl.col("count").filter(pl.col("metric") == "entropy").sum())
    blocked = summ.filter(pl.col("metric") == "blocked").group_by("step", "rule").agg(n_blocked=pl.col("count").sum())
    rewards = pl.scan_parquet(str(run / "samples" / "**" / "*.parquet")).group_by("step").agg(
        reward_mean=pl.col("reward").mean())
    steps = tokens.join(moments, on="step").join(rewards, on="step").with_columns(
        mismatch_mean=pl.col("mismatch_sum") / pl.col("mismatch_n"), bad_rate=pl.col("n_bad") / pl.col("n_tokens"),
        entropy_mean=pl.col("entropy_sum") / pl.col("entropy_n"))
    rules = blocked.join(tokens, on="step").with_columns(blocked_frac=pl.col("n_blocked") / pl.col("n_grad"))
    steps, rules = pl.collect_all([steps.sort("step"), rules.sort("step", "rule")])
    return steps, rules


def check(result: dict, steps, rules) -> None:
    """The overview's numbers are polars' numbers."""
    ov = result["overview"]
    mine = ov.steps.sort_values("step")
    assert mine["n_tokens"].tolist() == steps["n_tokens"].to_list(), "n_tokens"
    assert mine["n_bad_negative"].tolist() == steps["n_bad"].to_list(), "n_bad_negative"
    np.testing.assert_allclose(mine["mismatch_mean"], steps["mismatch_mean"].to_numpy(), rtol=1e-9)
    np.testing.assert_allclose(mine["reward_mean"], steps["reward_mean"].to_numpy(), rtol=1e-6)  # float32 rewards
    side = ov.blocked[ov.blocked["advantage_side"] == "all"].sort_values(["step", "rule"])
    side = side[side["n_blocked"] > 0]
    assert side["n_blocked"].tolist() == rules["n_blocked"].to_list(), "n_blocked"
    assert bool(ov.sources["exact"].all()), "every run exact"


def time_once(logdir: Path, repeat: int, rows: bool) -> dict:
    """In this (new) process: the overview cold then warm, polars, and optionally the token-rows path."""
    from trustscope import db as tsdb

    out = {}
    cache = Path(tempfile.mkdtemp(prefix="bench-overview-cache-"))
    start = time.perf_counter()
    conn = tsdb.connect(logdir, cache_dir=cache)
    out["connect_s"] = time.perf_counter() - start
    start = time.perf_counter()
    result = overview_queries(conn)
    out["overview_cold_s"] = time.perf_counter() - start
    warm = []
    for _ in range(repeat):
        start = time.perf_counter()
        overview_queries(conn)
        warm.append(time.perf_counter() - start)
    out["overview_warm_s"] = statistics.median(warm)
    start = time.perf_counter()
    steps, rules = polars_overview(logdir / RUN_ID)
    out["polars_s"] = time.perf_counter() - start
    check(result, steps, rules)
    out["partials_computed"] = conn.partials_computed  # token files aggregated by the overview: 0
    if rows:
        start = time.perf_counter()
        summary = conn.step_summary()
        out["rows_cold_s"] = time.perf_counter() - start
        assert summary["n_tokens"].tolist() == result["overview"].steps["n_tokens"].tolist(), "rows path n_tokens"
    conn.close()
    shutil.rmtree(cache, ignore_errors=True)
    return out


QUICK = ["--tokens", "2000000", "--tokens-per-step", "500000", "--repeat", "1", "--cold-runs", "1"]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000_000, help="token rows of the log")
    parser.add_argument("--tokens-per-step", type=int, default=1_000_000)
    parser.add_argument("--logged-steps", type=int, default=2, help="steps logged for real before copying")
    parser.add_argument("--dir", type=Path, help="where to build the log (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the log afterwards")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cold-runs", type=int, default=3, choices=range(1, 11), metavar="N", help="new processes timed cold (1..10)")
    parser.add_argument("--validate", action="store_true", help="validate the built run (reads every key)")
    parser.add_argument("--rows-baseline", action="store_true", help="also time the token-rows path once")
    parser.add_argument("--time-once", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_once:
        print(json.dumps(time_once(args.time_once, args.repeat, args.rows_baseline)))
        return {}

    logdir = (args.dir or Path(tempfile.mkdtemp(prefix="bench-overview-"))) / "logs"
    try:
        if (logdir / RUN_ID / runformat.MANIFEST).is_file():
            built = {"reused": str(logdir)}
        else:
            built = build(logdir, args.tokens, args.tokens_per_step, args.logged_steps, args.validate)
        print(f"log: {json.dumps(built)}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
              flush=True)
        runs = []
        for i in range(args.cold_runs):
            cmd = [*common.module_cmd(__spec__), "--time-once", str(logdir), "--repeat", str(args.repeat)]
            if args.rows_baseline and i == 0:
                cmd.append("--rows-baseline")
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            runs.append({**json.loads(done.stdout.strip().splitlines()[-1]),
                         "process_s": time.perf_counter() - start})
            print(f"  cold run {i + 1}: {json.dumps(runs[-1])}; load {os.getloadavg()[0]:.1f}", flush=True)
        med = {k: statistics.median(r[k] for r in runs) for k in ("connect_s", "overview_cold_s",
                                                                   "overview_warm_s", "polars_s")}
        print(f"median over {len(runs)} new processes: connect {med['connect_s']:.3f} s, overview cold "
              f"{med['overview_cold_s']:.3f} s, warm {med['overview_warm_s']:.3f} s; polars from the summaries "
              f"files {med['polars_s']:.3f} s" + (f"; token-rows path {runs[0]['rows_cold_s']:.1f} s"
                                                  if "rows_cold_s" in runs[0] else ""))
    finally:
        if not args.keep:
            shutil.rmtree(logdir.parent if args.dir is None else logdir, ignore_errors=True)
    return {"log": built, "cold_runs": len(runs), **med,
            **({"rows_cold_s": runs[0]["rows_cold_s"]} if "rows_cold_s" in runs[0] else {})}


if __name__ == "__main__":
    main()
