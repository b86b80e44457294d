"""Reading cost against the number of files: the same steps flushed every step, every 50 steps, and compacted.

    .venv/bin/python -m bench.bench_files --steps 400                       # one rank, four logs side by side
    .venv/bin/python -m bench.bench_files --scale --ranks 64 --steps 1000   # the at-scale log, built fast

Side by side (``--steps N``): one rank logs the same ``N`` steps (about 580 token rows each, top-8, summaries on)
four times through :class:`trustscope.logger.TokenLogger`: flushed after every step, flushed every 50 steps, flushed
every step and then compacted by ``trustscope compact``, and flushed every step with the logger's own background
compaction (``compact_every=10``, the default). Each log is then read in a new process with a new
``TRUSTSCOPE_CACHE`` through :func:`trustscope.db.connect`: ``connect``, ``overview()`` (cold), the first pass
(``step_summary()`` on the empty cache), then both again on the same connection (warm, median of ``--repeat``).
Ratios are against the every-50-steps log, in the same command. The answers are checked equal before any figure.

At scale (``--scale``): ``--ranks`` x ``--steps`` per-step flushes of a few token rows each, built fast: one step
is logged for real (summaries on), then its files are written again for every rank and step with the step, rank and
sample ids changed, each as its own committed flush with the logger's encodings and footers, and every rank's
manifest counts them; ``validate`` reads it as one run. Timed: the Runs overview in a new process, cold and warm,
before and after ``trustscope compact`` (timed too), and the first pass after it. ``--keep DIR`` keeps the log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

from trustscope import runformat  # noqa: E402

RUN_ID = "files"
K = 8


def step_data(step: int, batch: int, length: int) -> tuple[dict, np.ndarray, dict]:
    """One padded step of rollout-like rows ``(B, T)``, ragged lengths, top-K lists."""
    rng = np.random.default_rng(step)
    lengths = rng.integers(length // 2, length + 1, batch)
    mask = np.arange(length)[None, :] < lengths[:, None]
    topk = -np.sort(rng.exponential(2.0, (batch, length, K)).astype(np.float32), axis=-1)
    pi = np.minimum(topk + rng.normal(0, 0.02, topk.shape).astype(np.float32), 0)
    tokens = {"token_id": rng.integers(0, 32_000, (batch, length)), "mu_logprob": topk[..., 0],
              "pi_logprob": pi[..., 0], "advantage": rng.normal(size=batch).astype(np.float32),
              "entropy": rng.exponential(1.0, (batch, length)).astype(np.float32),
              "mu_topk_ids": rng.integers(0, 32_000, (batch, length, K)), "mu_topk_logprobs": topk,
              "pi_topk_logprobs": pi}
    samples = {"sample_id": np.arange(batch), "prompt_id": np.arange(batch) // 4, "reward": rng.random(batch)}
    return tokens, mask, samples


def log_run(logdir: Path, steps: int, flush_every: int, compact_every: int, batch: int = 8,
            length: int = 96) -> float:
    """Log ``steps`` steps, flushed every ``flush_every`` steps; returns the seconds it took (close included)."""
    from trustscope.logger import TokenLogger

    started = time.perf_counter()
    with TokenLogger(logdir, RUN_ID, loss_rule="dppo_binary_tv", flush_rows=10**12, flush_seconds=10**9,
                     fsync=False, compact_every=compact_every) as lg:
        for step in range(steps):
            tokens, mask, samples = step_data(step, batch, length)
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples, scalars={"loss": float(step)})
            if (step + 1) % flush_every == 0:
                lg.flush()
    return time.perf_counter() - started


READER = r"""
import json, statistics, sys, time
t0 = time.perf_counter()
from trustscope.db import connect
t1 = time.perf_counter()
db = connect(sys.argv[1])
t2 = time.perf_counter()
overview = db.overview()
t3 = time.perf_counter()
summary = db.step_summary() if sys.argv[3] == "1" else None
t4 = time.perf_counter()
warm_overview, warm_summary = [], []
for _ in range(int(sys.argv[2])):
    a = time.perf_counter(); db.overview(); b = time.perf_counter()
    if summary is not None:
        db.step_summary()
    warm_overview.append(b - a); warm_summary.append(time.perf_counter() - b)
steps = overview.steps if hasattr(overview, "steps") else None
print(json.dumps({"import": t1 - t0, "connect": t2 - t1, "overview": t3 - t2, "first_pass": t4 - t3,
                  "warm_overview": statistics.median(warm_overview),
                  "warm_step_summary": statistics.median(warm_summary) if summary is not None else None,
                  "answer": None if summary is None else summary.round(9).to_json(),
                  "overview_rows": None if steps is None else int(len(steps))}))
"""


def read_times(logdir: Path, repeat: int, first_pass: bool = True, timeout: float | None = None) -> dict | None:
    """The reads above in a new process with an empty cache; None when it took more than ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="bench-files-cache-") as cache:
        env = {**os.environ, "TRUSTSCOPE_CACHE": cache, "PYTHONPATH": str(ROOT)}
        try:
            out = subprocess.run([sys.executable, "-c", READER, str(logdir), str(repeat),
                                  "1" if first_pass else "0"], capture_output=True, text=True, env=env,
                                 check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


POLARS_READER = r"""
import json, sys, time
t0 = time.perf_counter()
import polars as pl
from bench.bench_queries import polars_queries
files = json.loads(open(sys.argv[1]).read())
t1 = time.perf_counter()
per_step = (pl.scan_parquet(files).group_by("step")
            .agg(pl.len(), pl.col("mu_logprob").sum(), (pl.col("pi_logprob") - pl.col("mu_logprob")).mean())
            .collect())
t2 = time.perf_counter()
first_pass = polars_queries(files)["cold_pass"]()
print(json.dumps({"import": t1 - t0, "scan": t2 - t1, "first_pass": time.perf_counter() - t2,
                  "steps": per_step.height, "first_pass_steps": first_pass[0].height}))
"""


def polars_scan(files: list[Path]) -> dict:
    """polars (lazy ``scan_parquet``) over ``files`` in a new process, its import timed apart: one per-step
    aggregate of every token row (the bare scan rate), then the first pass's own three questions over every rule
    (``bench_queries.polars_queries``' ``cold_pass``: the step summary, the clipped tokens, ratio vs divergence)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as listing:
        json.dump([str(f) for f in files], listing)
    try:
        out = subprocess.run([sys.executable, "-c", POLARS_READER, listing.name],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(listing.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def n_files(logdir: Path) -> int:
    return sum(len(f) for run in runformat.run_dirs(logdir) for f in runformat.committed_files(run).values())


def side_by_side(steps: int, repeat: int, work: Path) -> dict:
    from trustscope.runformat.maintenance import compact_logdir

    log_run(work / "warm-up", 2, 1, 0)  # torch and the rule masks imported before any log is timed
    logs: dict[str, Path] = {name: work / name for name in ("every_50", "every_step", "compacted", "logger_compacts")}
    written = {
        "every_50": log_run(logs["every_50"], steps, 50, 0),
        "every_step": log_run(logs["every_step"], steps, 1, 0),
        "logger_compacts": log_run(logs["logger_compacts"], steps, 1, 10),
    }
    shutil.copytree(logs["every_step"], logs["compacted"])
    started = time.perf_counter()
    compact_logdir(logs["compacted"], grace_s=0)
    compaction_s = time.perf_counter() - started
    rows = json.loads((logs["every_step"] / RUN_ID / runformat.MANIFEST).read_text())["rows"]
    size = sum(f.stat().st_size for f in (logs["every_step"] / RUN_ID).rglob("*.parquet"))
    print(f"{steps} steps, {rows['tokens']:,} token rows, {size / 1e6:.1f} MB per log; "
          f"trustscope compact of the every-step log: {compaction_s:.2f} s")
    times = {name: read_times(path, repeat) for name, path in logs.items()}
    answers = {name: t.pop("answer") for name, t in times.items()}
    assert len(set(answers.values())) == 1, "the logs answer step_summary() differently"
    base = times["every_50"]
    columns = ["connect", "overview", "first_pass", "warm_overview", "warm_step_summary"]
    print(f"{'log':<16} {'files':>6} {'write s':>8} " + " ".join(f"{c:>18}" for c in columns))
    figures: dict = {"token_rows": rows["tokens"], "mb_per_log": size / 1e6, "compaction_s": compaction_s}
    for name, t in times.items():
        cells = [f"{t[c]:7.3f} (x{t[c] / base[c]:5.2f})" for c in columns]
        print(f"{name:<16} {n_files(logs[name]):>6} {written.get(name, float('nan')):8.2f} " + " ".join(
            f"{c:>18}" for c in cells))
        figures[name] = {"files": n_files(logs[name]), **{f"{c}_s": t[c] for c in columns},
                         **{f"{c}_x_every_50": t[c] / base[c] for c in columns}}
        if name in written:
            figures[name]["write_s"] = written[name]
    return figures


# ------------------------------------------------------------------------------------------------ at scale


def template(logdir: Path) -> dict[str, tuple[pa.Schema, dict, pa.Table]]:
    """One small step logged for real: per table, its Arrow schema, footer and rows."""
    from trustscope.logger import TokenLogger

    with TokenLogger(logdir, RUN_ID, loss_rule="dppo_binary_tv", flush_rows=1, fsync=False, compact_every=0,
                     write_threads=1) as lg:
        tokens, mask, samples = step_data(0, 2, 6)
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples, scalars={"loss": 0.0})
    out = {}
    for table, [path] in runformat.committed_files(logdir / RUN_ID).items():
        with pq.ParquetFile(path) as f:
            meta = {k: v for k, v in (f.metadata.metadata or {}).items() if k != b"ARROW:schema"
                    and k not in (f.schema_arrow.metadata or {})}
            out[table] = (f.schema_arrow, meta, f.read())
    return out


STEP_MARK = 0x5EED_0000_5EED_0001
"""Stand-ins written into the template files, replaced byte for byte in each copy: the step (int64), the rank
(int32, also the high word of every sample id) and the flush number (eight ASCII digits in the footer)."""
RANK_MARK = 0x5EED_FACE
FLUSH_MARK = b"99999999"


def template_bytes(templates: dict[str, tuple[pa.Schema, dict, pa.Table]]) -> dict[str, bytes]:
    """Each table's template step as the bytes of a file whose step, rank and sample ids are the marks above,
    uncompressed and PLAIN in those columns (so the marks appear as such, in the pages and the statistics) and
    as the logger writes it everywhere else."""
    out = {}
    for table, (arrow_schema, meta, data) in templates.items():
        n = data.num_rows
        data = data.set_column(data.schema.get_field_index("step"), "step", pa.array(np.full(n, STEP_MARK)))
        data = data.set_column(data.schema.get_field_index("rank"), "rank", pa.array(np.full(n, RANK_MARK, np.int32)))
        if "sample_id" in data.column_names:
            low = pa.compute.bit_wise_and(data["sample_id"], pa.scalar(2**32 - 1, pa.int64()))
            ids = pa.compute.add(low, pa.scalar(RANK_MARK << 32, pa.int64()))
            data = data.set_column(data.schema.get_field_index("sample_id"), "sample_id", ids)
        options = runformat.WRITE_OPTIONS[table].writer_kwargs()
        leaves = [f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name for f in arrow_schema]
        options.pop("compression_level")  # zstd's default level is the logger's (1); NONE takes no level
        options["compression"] = {c: "NONE" if c in ("step", "rank", "sample_id") else options["compression"]
                                  for c in leaves}
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, arrow_schema, **options) as w:
            w.write_table(data.cast(arrow_schema))
            w.add_key_value_metadata({**meta, f"{runformat.FLUSH_META_PREFIX}flush".encode(): FLUSH_MARK})
        out[table] = sink.getvalue().to_pybytes()
        for mark in (STEP_MARK.to_bytes(8, "little"), RANK_MARK.to_bytes(4, "little"), FLUSH_MARK):
            assert mark in out[table], (table, mark)
    return out


def write_rank(args: tuple) -> dict[str, int]:
    """Every step of one rank, one committed flush a step (the template's bytes with its marks replaced), and
    the rank's manifest."""
    run, rank, steps, files, rows_per_step, head = args
    step_mark, rank_mark = STEP_MARK.to_bytes(8, "little"), RANK_MARK.to_bytes(4, "little")
    for step in range(steps):
        flush = step + 1
        for table, data in files.items():
            data = data.replace(step_mark, step.to_bytes(8, "little")).replace(rank_mark, rank.to_bytes(4, "little"))
            data = data.replace(FLUSH_MARK, f"{flush:08d}".encode())
            (run / table / runformat.data_file_name(rank, step, step, flush)).write_bytes(data)
    rows = {t: n * steps for t, n in rows_per_step.items()}
    manifest = {**head, "rank": rank, "committed_flush": steps, "last_step": steps - 1, "rows": rows,
                "status": "finished", "tokens_generated": rows["tokens"], "tokens_logged": rows["tokens"]}
    path = run / (runformat.MANIFEST if rank == 0 else f"{runformat.RANKS_DIR}/rank{rank:04d}.json")
    path.write_text(json.dumps(manifest, indent=2))
    return rows


def build_at_scale(logdir: Path, ranks: int, steps: int) -> float:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-files-template-") as tmp:
        templates = template(Path(tmp))
        head = json.loads((Path(tmp) / RUN_ID / runformat.MANIFEST).read_text())
        run = logdir / RUN_ID
        for sub in (*runformat.TABLES, runformat.RANKS_DIR):
            (run / sub).mkdir(parents=True, exist_ok=True)
        vocab = Path(tmp) / RUN_ID / runformat.VOCAB_FILE
        if vocab.exists():
            shutil.copy(vocab, run)
    head = {**head, "world_size": ranks, "resumes": []}
    files = template_bytes(templates)
    rows = {t: data.num_rows for t, (_, _, data) in templates.items()}
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(write_rank, [(run, r, steps, files, rows, head) for r in range(ranks)]))
    return time.perf_counter() - started


def at_scale(ranks: int, steps: int, repeat: int, work: Path, raw_timeout: float) -> dict:
    import importlib.util

    from trustscope.runformat.maintenance import compact_logdir

    if importlib.util.find_spec("polars") is None:  # said before the build, not after minutes of it
        raise SystemExit("--scale compares the first pass with polars: pip install 'trustscope[bench]'")
    built = build_at_scale(work, ranks, steps)
    files = n_files(work)
    print(f"{ranks} ranks x {steps} steps: {files:,} files built in {built:.0f} s")
    raw = read_times(work, repeat, first_pass=False, timeout=raw_timeout)
    started = time.perf_counter()
    compact_logdir(work, grace_s=0)
    compaction_s = time.perf_counter() - started
    problems = runformat.validate_logdir(work)
    assert not problems, problems[:3]
    packed = read_times(work, repeat, first_pass=True)
    print(f"trustscope compact: {compaction_s:.1f} s, {files:,} -> {n_files(work):,} files")
    run = work / RUN_ID
    token_files = runformat.committed_files(run)["tokens"]
    token_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in token_files)
    scan = polars_scan(token_files)
    assert scan["steps"] == steps, scan
    rate = lambda s: f"{s:.2f} s = {token_rows / s:,.0f} rows/s"  # noqa: E731
    print(f"first pass against polars over the same {token_rows:,} token rows (compacted files, new processes; "
          f"polars' import, {scan['import']:.2f} s, apart): trustscope {rate(packed['first_pass'])} (every kept "
          f"aggregate of every rule); polars, the same three questions over every rule {rate(scan['first_pass'])}; "
          f"polars, one per-step aggregate of three columns {rate(scan['scan'])}")
    figures: dict = {"files": files, "build_s": built, "compaction_s": compaction_s, "files_compacted": n_files(work),
                     "token_rows": token_rows, "trustscope_first_pass_s": packed["first_pass"],
                     "polars": {"import_s": scan["import"], "first_pass_s": scan["first_pass"],
                                "one_aggregate_s": scan["scan"]}}
    if raw is None:
        print(f"per-step files   connect + overview did not finish in {raw_timeout:.0f} s")
        figures["per-step files"] = f"connect + overview did not finish in {raw_timeout:.0f} s"
    for name, t in (("per-step files", raw), ("compacted", packed)):
        if t is None:
            continue
        print(f"{name:<16} connect {t['connect']:.2f} s, overview cold {t['overview']:.2f} s, "
              f"warm {t['warm_overview']:.3f} s" + (f", first pass {t['first_pass']:.2f} s"
                                                    if name == "compacted" else ""))
        figures[name] = {"connect_s": t["connect"], "overview_cold_s": t["overview"],
                         "overview_warm_s": t["warm_overview"]}
    return figures


# ------------------------------------------------------------------------------------------------ Delta Lake


READ_SQL = ("select count(*), count(distinct step), sum(mu_logprob), avg(pi_logprob - mu_logprob) "
            "from read_parquet(?)")


def duckdb_read_s(files: list[str], repeat: int) -> float:
    """Median seconds of one aggregate over every token row of ``files`` (a fresh DuckDB connection each time)."""
    import duckdb

    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        con = duckdb.connect()
        con.execute(READ_SQL, [files]).fetchall()
        con.close()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def table_format(steps: int, repeat: int, work: Path) -> dict:
    """The same per-step flushes written and compacted by trustscope and by Delta Lake (``pip install deltalake``,
    not a dependency), then read by DuckDB: write rate, compaction time, files, bytes and read time after."""
    from deltalake import DeltaTable, WriterProperties, write_deltalake

    from trustscope.runformat.maintenance import compact_logdir

    log_run(work / "warm-up", 2, 1, 0)
    ours = work / "trustscope"
    written_s = log_run(ours, steps, 1, 0)
    run = ours / RUN_ID
    flushes: dict[int, dict[str, pa.Table]] = {}
    for table, files in runformat.committed_files(run).items():
        for f in files:
            flushes.setdefault(runformat.parse_data_file(f.name).flush, {})[table] = pq.read_table(f)
    tokens_rows = sum(f["tokens"].num_rows for f in flushes.values())
    read_before = duckdb_read_s([str(f) for f in runformat.committed_files(run)["tokens"]], repeat)
    started = time.perf_counter()
    compact_logdir(ours, grace_s=0)
    compact_s = time.perf_counter() - started
    our_files = [str(f) for f in runformat.committed_files(run)["tokens"]]
    started = time.perf_counter()
    for _ in range(repeat):
        runformat.committed_files(run)
    list_s = (time.perf_counter() - started) / repeat
    figures = {"trustscope": {"write_s": written_s, "compact_s": compact_s, "read_before_s": read_before,
                              "read_after_s": duckdb_read_s(our_files, repeat), "list_s": list_s,
                              "files_after": len(our_files),
                              "bytes_after": sum(Path(f).stat().st_size for f in our_files)}}

    delta = work / "delta"
    props = WriterProperties(compression="ZSTD", compression_level=1)
    started = time.perf_counter()
    for _flush, tables in sorted(flushes.items()):  # the same rows, one append (one commit) per table per flush
        for table, data in tables.items():
            write_deltalake(delta / table, data, mode="append", writer_properties=props)
    delta_write_s = time.perf_counter() - started
    tokens = DeltaTable(delta / "tokens")
    read_before = duckdb_read_s(tokens.file_uris(), repeat)
    started = time.perf_counter()
    for table in runformat.TABLES:
        dt = DeltaTable(delta / table)
        dt.optimize.compact(writer_properties=props)
        dt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
    delta_compact_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeat):
        files = DeltaTable(delta / "tokens").file_uris()
    delta_list_s = (time.perf_counter() - started) / repeat
    figures["deltalake"] = {"write_s": delta_write_s, "compact_s": delta_compact_s, "read_before_s": read_before,
                            "read_after_s": duckdb_read_s(files, repeat), "list_s": delta_list_s,
                            "files_after": len(files), "bytes_after": sum(Path(f.removeprefix("file://")).stat().st_size
                                                                          for f in files)}
    print(f"{steps} per-step flushes of one rank, {tokens_rows:,} token rows (trustscope's write includes its "
          f"checks and summaries; Delta's, the appends of the same Arrow tables alone)")
    print(f"{'':<12} {'write s':>8} {'flushes/s':>9} {'compact s':>9} {'read before':>11} {'read after':>10} "
          f"{'list s':>7} {'files':>5} {'MB':>6}")
    for name, f in figures.items():
        print(f"{name:<12} {f['write_s']:8.2f} {steps / f['write_s']:9.1f} {f['compact_s']:9.2f} "
              f"{f['read_before_s']:11.3f} {f['read_after_s']:10.3f} {f['list_s']:7.4f} {f['files_after']:>5} "
              f"{f['bytes_after'] / 1e6:6.1f}")
    return figures


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scale", action="store_true", help="the at-scale log instead of the side-by-side logs")
    parser.add_argument("--table-format", action="store_true", help="trustscope's compaction against Delta Lake's "
                        "on --steps per-step flushes (needs `pip install deltalake`)")
    parser.add_argument("--raw-timeout", type=float, default=900.0, help="--scale: seconds the read of the "
                        "uncompacted log may take")
    parser.add_argument("--keep", type=Path, help="build the logs here and keep them")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-files-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.scale:
            figures = at_scale(args.ranks, args.steps, args.repeat, work, args.raw_timeout)
        elif args.table_format:
            figures = table_format(args.steps, args.repeat, work)
        else:
            figures = side_by_side(args.steps, args.repeat, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average: {os.getloadavg()[0]:.1f}")
    return figures


if __name__ == "__main__":
    main()
