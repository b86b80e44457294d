"""Time trustscope's named analyses over generated token logs, beside polars (lazy scan) and pandas doing the same.

    .venv/bin/python -m bench.bench_queries --tokens 10_000_000 [--tokens 100_000_000] [--workdir /tmp/ts_queries]
    .venv/bin/python -m bench.bench_queries --cold-only --tokens 50_000_000 --tokens 100_000_000 --timeout 900

For every log size: a synthetic run (K = 20) is written once under ``workdir`` (reused when present): one base of
``--base-tokens`` generated tokens, then copies of its tokens, samples and steps tables under new step numbers until
the size is reached (generating 100M tokens one by one would take hours). Each analysis is timed in DuckDB cold (a
fresh cache: the first analysis computes every partial aggregate of every file, in one pass per file) and warm (they
are kept, which is how the dashboard and a second report see them), then the same question is asked of polars and
pandas, which have no kept aggregates and scan the tokens every time. polars computes every rule with a mask at its
defaults, the sequence rules (gspo, geo_mask, cppo) from each response's context as trustscope does; pandas only
ppo_clip and dppo_binary_tv. ``cold_pass`` is the whole first pass: DuckDB's partials of every file against polars
answering step_summary, clipped_tokens and ratio_vs_divergence together (``collect_all``, shared scan).
``--cold-only`` times that first pass alone, each engine in a new process (so each one's peak memory is its own),
each given ``--timeout`` seconds, and compares their per-step blocked counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import common
from trustscope import db as tsdb
from trustscope import runformat
from trustscope.losses import get_loss
from trustscope.synthetic import SyntheticConfig, generate_run

COLUMNS = ["run_id", "step", "rank", "sample_id", "pos", "token_id", "mu_logprob", "old_logprob", "pi_logprob",
           "advantage", "entropy", "topk_tv", "topk_kl", "kept"]
RESPONSE = ["run_id", "step", "rank", "sample_id"]


SCALARS = ["run_id", "step", "token_id", "mu_logprob", "pi_logprob", "advantage", "kept"]
PPO = get_loss("ppo_clip").defaults
DPPO_TV = get_loss("dppo_binary_tv").defaults
DELTA_BAD = get_loss("minimal_negative_mask").defaults["delta"]
POLARS_RULES = [r.name for r in tsdb.sql_rules() if r.sql.family != "none"]


def _rule(name: str) -> dict:
    return get_loss(name).defaults


def _polars_all_rules(glob: str) -> pl.LazyFrame:
    """The tokens with every rule's flag at its defaults (all 17 rules with a mask; cispo, pg_is and token_tis
    never block), the sequence rules' context computed per response, as trustscope's rule_blocks does."""
    f64 = lambda c: pl.col(c).cast(pl.Float64)  # noqa: E731
    lf = pl.scan_parquet(glob).select(COLUMNS).with_columns(
        mu=f64("mu_logprob").exp(), pi=f64("pi_logprob").exp(), old=f64("old_logprob").exp(),
        log_ratio=f64("pi_logprob") - f64("mu_logprob"),
        ratio=(f64("pi_logprob") - f64("mu_logprob")).clip(upper_bound=20).exp(),
        old_ratio=(f64("pi_logprob") - f64("old_logprob")).clip(upper_bound=20).exp(),
        topk_tv=f64("topk_tv"), topk_kl=f64("topk_kl"))
    one_minus = lambda p: (1 - pl.col(p)).clip(lower_bound=1e-12)  # noqa: E731
    lf = lf.with_columns(
        binary_tv=(pl.col("pi") - pl.col("mu")).abs(),
        binary_kl=(pl.col("mu") * (f64("mu_logprob") - f64("pi_logprob"))
                   + one_minus("mu") * (one_minus("mu") / one_minus("pi")).log()).clip(lower_bound=0),
        old_binary_kl=(pl.col("old") * (f64("old_logprob") - f64("pi_logprob"))
                       + one_minus("old") * (one_minus("old") / one_minus("pi")).log()).clip(lower_bound=0),
    )
    ordered = lf.sort(*RESPONSE, "pos")
    tv = pl.col("binary_tv")
    lf = ordered.with_columns(
        seq_log_ratio=pl.col("log_ratio").mean().over(RESPONSE), seq_len=pl.len().over(RESPONSE),
        seq_p90=tv.quantile(0.9, "linear").over(RESPONSE),
        prefix_tv=(tv.cum_sum() - tv).over(RESPONSE),
        prefix_pos_tv=(pl.col("pos") * tv).cum_sum().over(RESPONSE) - pl.col("pos") * tv)
    adv, r = pl.col("advantage"), pl.col("ratio")

    def ppo_mask(r, low, high):
        return ((adv > 0) & (r > 1 + high)) | ((adv <= 0) & (r < 1 - low))

    def dppo(div, anchor, delta):
        return (pl.col(div) > delta) & (((adv > 0) & (pl.col("pi_logprob") > pl.col(anchor)))
                                        | ((adv <= 0) & (pl.col("pi_logprob") < pl.col(anchor))))

    flags = {}
    for name in ("ppo_clip", "grpo"):
        flags[name] = ppo_mask(r, _rule(name)["eps_low"], _rule(name)["eps_high"])
    for name in ("minirl", "minirl_tis"):
        flags[name] = ppo_mask(pl.col("old_ratio"), _rule(name)["eps_low"], _rule(name)["eps_high"])
    for name in ("dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl"):
        flags[name] = dppo(_rule(name)["divergence"], "mu_logprob", _rule(name)["delta"])
    flags["dppo_decoupled"] = dppo("old_binary_kl", "old_logprob", _rule("dppo_decoupled")["delta"])
    d = _rule("drpo")["delta"]
    flags["drpo"] = ((adv > 0) & (pl.col("pi") - pl.col("mu") >= d)) | ((adv <= 0) & (pl.col("mu") - pl.col("pi") >= d))
    for name in ("icepop", "token_mis"):
        flags[name] = (r < _rule(name)["low"]) | (r > _rule(name)["high"])
    flags["minimal_negative_mask"] = (adv <= 0) & (pl.col("mu") - pl.col("pi") >= DELTA_BAD)
    lp = _rule("ppo_lowprob_relax")
    flags["ppo_lowprob_relax"] = (((adv > 0) & (r > 1 + lp["eps_high"]) & (pl.col("mu") >= lp["alpha_high"]))
                                  | ((adv <= 0) & (r < 1 - lp["eps_low"]) & (pl.col("mu") >= lp["alpha_low"])))
    gs = _rule("gspo")
    flags["gspo"] = ppo_mask(pl.col("seq_log_ratio").clip(upper_bound=10).exp(), gs["eps_low"], gs["eps_high"])
    geo = _rule("geo_mask")
    seq_r = pl.col("seq_log_ratio").exp()
    flags["geo_mask"] = (seq_r < geo["low"]) | (seq_r > geo["high"])
    c = _rule("cppo")
    m = (pl.col("seq_len") - 1).clip(lower_bound=1)
    pos, n = pl.col("pos"), pl.col("seq_len")
    w = c["w_min"] + (1 - c["w_min"]) * (n - 1 - pos) / m
    w_prev = pos * c["w_min"] + (1 - c["w_min"]) / m * (pos * (n - 1) - pos * (pos - 1) / 2)
    s = (c["w_min"] + (1 - c["w_min"]) * (n - 1) / m) * pl.col("prefix_tv") - (1 - c["w_min"]) / m * pl.col("prefix_pos_tv")
    b = pl.col("seq_p90").clip(c["delta_b"], 2 * c["delta_b"])
    flags["cppo"] = (w * tv > pl.min_horizontal(pl.lit(c["delta"]), c["delta"] + b * w_prev - s)) & (
        ((adv > 0) & (pl.col("pi_logprob") > pl.col("mu_logprob")))
        | ((adv <= 0) & (pl.col("pi_logprob") < pl.col("mu_logprob"))))
    return lf.with_columns(**{f"blocks_{k}": v.fill_null(False) for k, v in flags.items()})


def _blocked_aggs() -> list:
    adv = pl.col("advantage")
    out = []
    for rule in POLARS_RULES:
        flag = pl.col(f"blocks_{rule}")
        out += [(flag & (adv != 0)).sum().alias(f"n_blocked__{rule}"),
                (flag & (adv > 0)).sum().alias(f"n_blocked_pos__{rule}"),
                (flag & (adv < 0)).sum().alias(f"n_blocked_neg__{rule}")]
    return out



def polars_queries(glob: str) -> dict:
    t = lambda: _polars_all_rules(glob)  # noqa: E731
    diff = pl.col("pi") - pl.col("mu")
    adv = pl.col("advantage")

    def step_summary(lf: pl.LazyFrame) -> pl.LazyFrame:
        return lf.group_by("run_id", "step").agg(
            *_blocked_aggs(), n=pl.len(), mismatch_mean=diff.abs().mean(), mismatch_max=diff.abs().max(), diff_max=diff.max(),
            diff_min=diff.min(), binary_kl_mean=pl.col("binary_kl").mean(), topk_tv_mean=pl.col("topk_tv").mean(),
            topk_kl_mean=pl.col("topk_kl").mean(), ratio_max=pl.col("ratio").max(), ratio_min=pl.col("ratio").min(),
            entropy_mean=pl.col("entropy").mean(), bad=((adv < 0) & (-diff >= DELTA_BAD)).sum(),
            trainer_blocked=(~pl.col("kept") & (adv != 0)).sum())

    def clipped_tokens(lf: pl.LazyFrame) -> pl.LazyFrame:
        per_token = lf.filter(adv != 0).group_by("run_id", "token_id").agg(
            pl.len().alias("n"), *[pl.col(f"blocks_{r}").sum().alias(r) for r in POLARS_RULES],
            *[pl.col("mu").filter(pl.col(f"blocks_{r}")).mean().alias(f"mu__{r}") for r in POLARS_RULES])
        long = per_token.unpivot(index=["run_id", "token_id", "n"], on=POLARS_RULES, variable_name="rule",
                                 value_name="n_blocked")
        return long.filter(pl.col("n_blocked") > 0).sort("n_blocked", descending=True).group_by(
            "run_id", "rule").head(30)

    def ratio_vs_divergence(lf: pl.LazyFrame) -> pl.LazyFrame:
        bins = lambda c: (((pl.col(c) + 1e-300).log10() + 8) / 0.125).floor().clip(0, 63)  # noqa: E731
        return lf.with_columns(rb=((pl.col("ratio").log10() + 3) / 0.1).floor().clip(0, 59)).unpivot(
            index=["run_id", "rb"], on=["binary_tv", "binary_kl", "topk_tv", "topk_kl"], variable_name="divergence"
        ).with_columns(db=bins("value")).group_by("run_id", "divergence", "rb", "db").agg(n=pl.len())

    return {
        "step_summary": lambda: step_summary(t()).collect(),
        "blocked_fractions": lambda: t().group_by("run_id", "step").agg(*_blocked_aggs()).collect(),
        "bad_negative_updates": lambda: t().group_by("run_id", "step").agg(
            bad=((adv < 0) & (-diff >= DELTA_BAD)).mean()).collect(),
        "clipped_tokens": lambda: clipped_tokens(t()).collect(),
        "ratio_vs_divergence": lambda: ratio_vs_divergence(t()).collect(),
        "cold_pass": lambda: pl.collect_all([q(t()) for q in (step_summary, clipped_tokens, ratio_vs_divergence)]),
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


BASE_STEPS = 50


def write_log(logdir: Path, n_tokens: int, base_tokens: int) -> None:
    """A run of about ``n_tokens`` tokens: ``base_tokens`` generated over BASE_STEPS steps, then copies of its tokens,
    samples and steps tables under the next step numbers (each copy its own files, named without a flush number so
    that readers take them as committed, one copy per file of the base: the logger writes a flush as two parts)."""
    start = time.perf_counter()
    generate_run(logdir, "run0", SyntheticConfig(tokens=min(base_tokens, n_tokens), steps=BASE_STEPS,
                                                 edge_cases=False, drift=0.12))
    run = logdir / "run0"
    base = {table: sorted((run / table).rglob("*.parquet")) for table in ("tokens", "samples", "steps")}
    copies = max(1, round(n_tokens / sum(pq.read_metadata(f).num_rows for f in base["tokens"])))
    manifest = json.loads((run / runformat.MANIFEST).read_text())
    flush, rows = int(manifest["committed_flush"]), dict(manifest["rows"])
    for k in range(1, copies):
        flush += 1  # each copy a committed flush of its own, as the logger numbers them
        for table, files in base.items():
            for f in files:
                data = pq.read_table(f)
                # the footer's own keys too (the flush counts, the tokens' blocked_rules list), as the logger wrote them
                footer = {k: v for k, v in (pq.read_metadata(f).metadata or {}).items() if not k.startswith(b"ARROW:")}
                data = data.replace_schema_metadata({**(data.schema.metadata or {}), **footer})
                step = data.column("step")
                shifted = data.set_column(data.schema.get_field_index("step"), "step",
                                          pc.add(step, k * BASE_STEPS).cast(step.type))
                part = int(f.stem.rsplit("-p", 1)[1]) if "-p" in f.stem else None  # the encoders' parts kept
                name = runformat.data_file_name(0, k * BASE_STEPS, (k + 1) * BASE_STEPS - 1, flush, part)
                pq.write_table(shifted, f.parent / name, compression="zstd")  # beside its source: the rank folder
                rows[table] += len(data)
    manifest.update(committed_flush=flush, last_step=copies * BASE_STEPS - 1, rows=rows)
    tmp = run / f".{runformat.MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.replace(run / runformat.MANIFEST)
    print(f"wrote {n_tokens:,} tokens ({copies} copies of the base) in {time.perf_counter() - start:.0f} s")


def bench_size(n_tokens: int, workdir: Path, repeat: int, base_tokens: int) -> list[dict]:
    logdir = workdir / f"logs_{n_tokens}"
    if not (logdir / "run0" / "run.json").exists():
        shutil.rmtree(logdir, ignore_errors=True)
        write_log(logdir, n_tokens, base_tokens)
    files = sorted((logdir / "run0" / "tokens").rglob("*.parquet"))
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    glob = str(logdir / "run0" / "tokens" / "**" / "*.parquet")
    cache = Path(tempfile.mkdtemp(prefix="ts-bench-cache-"))
    db = tsdb.connect(logdir, cache_dir=cache)
    analyses = {
        "cold_pass": lambda: db.refresh(["step_summary"]),
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
    check_same_counts(db.step_summary(), peers_pl["step_summary"]())
    db.close()
    shutil.rmtree(cache, ignore_errors=True)
    return results


def check_same_counts(duck: pd.DataFrame, polars: pl.DataFrame) -> None:
    """The polars baseline answers the same question: every rule's blocked counts per step equal DuckDB's."""
    columns = [c for c in duck.columns if c.startswith("n_blocked") and c.split("__")[1] in POLARS_RULES]
    got = polars.to_pandas().set_index(["run_id", "step"]).sort_index()[columns]
    want = duck.set_index(["run_id", "step"]).sort_index()[columns]
    differ = (got.to_numpy() != want.to_numpy()).sum()
    print(f"polars vs duckdb: {len(columns)} blocked-count columns x {len(want)} steps, {differ} cell(s) differ")


def cold_pass_once(engine: str, logdir: Path, out: Path) -> None:
    """One cold pass in this (new) process: DuckDB's ``refresh`` on a fresh cache, or polars' ``collect_all`` of
    the three questions. Prints one JSON line (wall s, CPU s, peak RSS) and writes the step summary to ``out``."""
    import json
    import resource

    start, cpu = time.perf_counter(), time.process_time()
    if engine == "duckdb":
        cache = Path(tempfile.mkdtemp(prefix="ts-bench-cache-"))
        with tsdb.connect(logdir, cache_dir=cache) as db:
            start, cpu = time.perf_counter(), time.process_time()
            db.refresh(["step_summary"])
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            extra = {"files_reading_logged_bits": db.stored_bits_files, "files": db.partials_computed}
            db.step_summary().to_parquet(out)
        shutil.rmtree(cache, ignore_errors=True)
    else:
        steps = polars_queries(str(logdir / "run0" / "tokens" / "**" / "*.parquet"))["cold_pass"]()[0]
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        extra = {}
        steps.write_parquet(out)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"engine": engine, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                      "peak_rss_mb": round(rss), **extra}), flush=True)


def bench_cold_only(n_tokens: int, workdir: Path, base_tokens: int, timeout_s: float) -> dict:
    """The first pass alone, DuckDB and polars each in a new process (peak memory apart), polars given
    ``timeout_s``; their per-step blocked counts compared when both answer. Each engine's figures (the line its
    process printed)."""
    import subprocess

    logdir = workdir / f"logs_{n_tokens}"
    if not (logdir / "run0" / "run.json").exists():
        shutil.rmtree(logdir, ignore_errors=True)
        write_log(logdir, n_tokens, base_tokens)
    answers, figures = {}, {}
    for engine in ("duckdb", "polars"):
        out = workdir / f"cold_{engine}_{n_tokens}.parquet"
        out.unlink(missing_ok=True)
        try:
            done = subprocess.run([*common.module_cmd(__spec__), "--cold-once", engine, str(logdir), str(out)],
                                  check=True, timeout=timeout_s, stdout=subprocess.PIPE, text=True)
        except subprocess.TimeoutExpired:
            print(f"{engine}: no answer within {timeout_s:.0f} s (killed)", flush=True)
            figures[engine] = f"no answer within {timeout_s:.0f} s"
            continue
        print(done.stdout, end="", flush=True)
        figures[engine] = json.loads(done.stdout.strip().splitlines()[-1])
        answers[engine] = out
    if len(answers) == 2:
        check_same_counts(pd.read_parquet(answers["duckdb"]), pl.read_parquet(answers["polars"]))
    return figures


QUICK = ["--tokens", "200_000", "--base-tokens", "100_000", "--repeat", "1", "--workdir", "/tmp/ts_queries_quick"]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), action="append")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ts_queries")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--base-tokens", type=lambda s: int(s.replace("_", "")), default=1_000_000)
    parser.add_argument("--cold-only", action="store_true",
                        help="only the first pass, DuckDB and polars each in a new process, with peak memory")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each --cold-only process may take")
    parser.add_argument("--cold-once", nargs=3, metavar=("ENGINE", "LOGDIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_once:
        cold_pass_once(args.cold_once[0], Path(args.cold_once[1]), Path(args.cold_once[2]))
        return {}
    sizes = args.tokens or [10_000_000]
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()}")
    figures: dict = {}
    if args.cold_only:
        for n in sizes:
            print(f"{n:,} tokens:", flush=True)
            figures[f"{n} tokens"] = bench_cold_only(n, args.workdir, args.base_tokens, args.timeout)
        print(f"load average after: {os.getloadavg()}")
        return figures
    by_size = {n: bench_size(n, args.workdir, args.repeat, args.base_tokens) for n in sizes}
    table = pd.DataFrame([r for rows in by_size.values() for r in rows])
    table["warm_vs_polars"] = table.polars_s / table.duckdb_warm_s
    table["cold_vs_polars"] = table.polars_s / table.duckdb_cold_s
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(index=False))
    print(f"load average after: {os.getloadavg()}")
    for n, rows in by_size.items():
        figures[f"{n} tokens"] = {r["analysis"]: {k: v for k, v in r.items() if k != "analysis"} for r in rows}
        for r in figures[f"{n} tokens"].values():
            if "polars_s" in r:
                r["warm_vs_polars"] = r["polars_s"] / r["duckdb_warm_s"]
                r["cold_vs_polars"] = r["polars_s"] / r["duckdb_cold_s"]
    return figures


if __name__ == "__main__":
    main()
