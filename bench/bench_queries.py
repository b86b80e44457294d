"""Time trustscope's named analyses over generated token logs, beside polars (lazy scan) and pandas doing the same.

    .venv/bin/python bench/bench_queries.py --tokens 10_000_000 [--tokens 100_000_000] [--workdir /tmp/ts_queries]

For every log size: a synthetic run (K = 20) is generated once under ``workdir`` (reused when present). Each
analysis is timed in DuckDB cold (a fresh cache: the per-file partial aggregates are computed) and warm (they are
kept, which is how the dashboard and a second report see them), then the same question is asked of polars and
pandas, which have no kept aggregates and scan the tokens every time. The peers compute a subset: two rules
(ppo_clip, dppo_binary_tv) where trustscope computes all 13. Ratios are DuckDB warm and cold against polars.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pyarrow.parquet as pq

from trustscope import db as tsdb
from trustscope.losses import get_loss
from trustscope.synthetic import SyntheticConfig, generate_run

SCALARS = ["run_id", "step", "token_id", "mu_logprob", "pi_logprob", "advantage", "kept"]
PPO = get_loss("ppo_clip").defaults
DPPO_TV = get_loss("dppo_binary_tv").defaults
DELTA_BAD = get_loss("minimal_negative_mask").defaults["delta"]


def _polars_tokens(glob: str) -> pl.LazyFrame:
    lf = pl.scan_parquet(glob).select(SCALARS)
    mu = pl.col("mu_logprob").cast(pl.Float64).exp()
    pi = pl.col("pi_logprob").cast(pl.Float64).exp()
    ratio = (pl.col("pi_logprob").cast(pl.Float64) - pl.col("mu_logprob").cast(pl.Float64)).clip(upper_bound=20).exp()
    adv = pl.col("advantage")
    return lf.with_columns(mu=mu, pi=pi, ratio=ratio).with_columns(
        ppo=((adv > 0) & (pl.col("ratio") > 1 + PPO["eps_high"])) | ((adv < 0) & (pl.col("ratio") < 1 - PPO["eps_low"])),
        dppo=((pl.col("pi") - pl.col("mu")).abs() > DPPO_TV["delta"])
        & (((adv > 0) & (pl.col("pi_logprob") > pl.col("mu_logprob")))
           | ((adv <= 0) & (pl.col("pi_logprob") < pl.col("mu_logprob")))),
        bad=(adv < 0) & (pl.col("mu") - pl.col("pi") >= DELTA_BAD),
    )


def polars_queries(glob: str) -> dict:
    t = lambda: _polars_tokens(glob)  # noqa: E731
    diff = pl.col("pi") - pl.col("mu")
    return {
        "step_summary": lambda: t().group_by("run_id", "step").agg(
            n=pl.len(), mismatch_mean=diff.abs().mean(), mismatch_max=diff.abs().max(), diff_max=diff.max(),
            diff_min=diff.min(), ppo=pl.col("ppo").mean(), dppo=pl.col("dppo").mean(), bad=pl.col("bad").mean(),
        ).collect(),
        "blocked_fractions": lambda: t().group_by("run_id", "step", pl.col("advantage") > 0).agg(
            ppo=pl.col("ppo").mean(), dppo=pl.col("dppo").mean()).collect(),
        "bad_negative_updates": lambda: t().group_by("run_id", "step").agg(
            bad=pl.col("bad").mean()).collect(),
        "clipped_tokens": lambda: t().filter(pl.col("ppo")).group_by("run_id", "token_id").agg(
            n=pl.len(), mu=pl.col("mu").mean()).sort("n", descending=True).head(30).collect(),
        "ratio_vs_divergence": lambda: t().with_columns(
            rb=((pl.col("ratio").log10() + 3) / 0.1).floor().clip(0, 59),
            db=(((diff.abs() + 1e-300).log10() + 8) / 0.125).floor().clip(0, 63),
        ).group_by("run_id", "rb", "db").agg(n=pl.len()).collect(),
    }


def pandas_queries(files: list[Path]) -> dict:
    def load() -> pd.DataFrame:
        df = pd.concat([pq.read_table(f, columns=SCALARS).to_pandas() for f in files], ignore_index=True)
        df["mu"] = np.exp(df.mu_logprob.astype(np.float64))
        df["pi"] = np.exp(df.pi_logprob.astype(np.float64))
        df["ratio"] = np.exp(np.minimum(df.pi_logprob.astype(np.float64) - df.mu_logprob.astype(np.float64), 20))
        a = df.advantage
        df["ppo"] = ((a > 0) & (df.ratio > 1 + PPO["eps_high"])) | ((a < 0) & (df.ratio < 1 - PPO["eps_low"]))
        df["dppo"] = ((df.pi - df.mu).abs() > DPPO_TV["delta"]) & (
            ((a > 0) & (df.pi_logprob > df.mu_logprob)) | ((a <= 0) & (df.pi_logprob < df.mu_logprob)))
        df["bad"] = (a < 0) & (df.mu - df.pi >= DELTA_BAD)
        df["absdiff"] = (df.pi - df.mu).abs()
        return df

    return {
        "step_summary": lambda: load().groupby(["run_id", "step"]).agg(
            mismatch_mean=("absdiff", "mean"), mismatch_max=("absdiff", "max"), ppo=("ppo", "mean"),
            dppo=("dppo", "mean"), bad=("bad", "mean")),
        "clipped_tokens": lambda: load().query("ppo").groupby(["run_id", "token_id"]).size().nlargest(30),
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_size(n_tokens: int, workdir: Path, repeat: int) -> list[dict]:
    logdir = workdir / f"logs_{n_tokens}"
    if not (logdir / "run0" / "run.json").exists():
        shutil.rmtree(logdir, ignore_errors=True)
        start = time.perf_counter()
        generate_run(logdir, "run0", SyntheticConfig(tokens=n_tokens, steps=50, edge_cases=False, drift=0.12))
        print(f"generated {n_tokens:,} tokens in {time.perf_counter() - start:.0f} s")
    files = sorted((logdir / "run0" / "tokens").glob("*.parquet"))
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    glob = str(logdir / "run0" / "tokens" / "*.parquet")
    cache = Path(tempfile.mkdtemp(prefix="ts-bench-cache-"))
    db = tsdb.connect(logdir, cache_dir=cache)
    analyses = {
        "runs": db.runs,
        "step_summary": db.step_summary,
        "blocked_fractions": db.blocked_fractions,
        "bad_negative_updates": db.bad_negative_updates,
        "clipped_tokens": db.clipped_tokens,
        "ratio_vs_divergence": db.ratio_vs_divergence,
        "sample_tokens": lambda: db.sample_tokens("run0", 25, 3),
    }
    peers_pl, peers_pd = polars_queries(glob), pandas_queries(files)
    results = []
    for name, fn in analyses.items():
        cold = timed(fn)
        warm = min(timed(fn) for _ in range(repeat))
        row = {"analysis": name, "rows": rows, "duckdb_cold_s": cold, "duckdb_warm_s": warm,
               "rows_per_s_cold": rows / cold}
        if name in peers_pl:
            row["polars_s"] = min(timed(peers_pl[name]) for _ in range(repeat))
        if name in peers_pd:
            row["pandas_s"] = timed(peers_pd[name])
        results.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    db.close()
    shutil.rmtree(cache, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), action="append")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ts_queries")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = args.tokens or [10_000_000]
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()}")
    table = pd.DataFrame([r for n in sizes for r in bench_size(n, args.workdir, args.repeat)])
    table["warm_vs_polars"] = table.polars_s / table.duckdb_warm_s
    table["cold_vs_polars"] = table.polars_s / table.duckdb_cold_s
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(index=False))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
