"""Importer throughput: ``trustscope import prime-rl`` on a generated token export, against another trustscope's code.

    git archive 99d4cb0 trustscope | (mkdir -p /tmp/base && tar -x -C /tmp/base)   # the importers before step-by-step
    .venv/bin/python -m bench.bench_importers --baseline /tmp/base                   # ~1.1M trained tokens, 3 rounds
    .venv/bin/python -m bench.bench_importers --baseline /tmp/base --out /dev/shm --floor   # no disk; each stage alone
    .venv/bin/python -m bench.bench_importers --tokens 200000 --repeat 1             # a quick run, this code only

``99d4cb0`` is the code the import throughput target is a multiple of (whole-source reads with orjson, padded
``log_step`` calls); ``--also DIR ...`` adds other packages (e.g. another branch's) as variants of their own.

The export is written by ``bench/prime_rl_export.py``'s ``PrimeRLExporter`` (a copy of the test suite's in
``tests/test_importers_prime_rl.py``, the layout of prime-rl's ``TokenExporter``: packed micro-batches, one compact
JSON line per sequence, weight-stream layout) over 8 steps x 2 ranks, completions of 256-768 tokens after 64-token
prompts.

Every import runs in a fresh process (``python -c``, the code under test first on ``PYTHONPATH``): with
``--baseline DIR`` (a directory holding another ``trustscope`` package, e.g. main's) each round imports the same
export once with that code and once with this one (and once per ``--workers`` value given), in turn. Reported per
import: token rows/s of ``import_run`` in the process (after its imports), the process's wall time and CPU time
(user + system, its workers included), and memory: the importing process's peak resident size (``VmHWM``, its
own: ``getrusage``'s survives ``exec`` and would count this script's), and, workers included, the process tree's
proportional set size sampled every 20 ms from ``/proc`` (a lower bound: short peaks fall between samples); then
medians over the rounds and each variant's rows/s as a ratio of the baseline's, and the CPU a row inside
``import_run`` (the process's and its reaped workers' user + system time). ``--floor`` then times each stage alone
in fresh processes: the parse by DuckDB's C++ ``read_json`` (the lists a row is made of, to Arrow), by this code's
decoder alone and by its whole read, and the Parquet encode of the imported token rows with the logger's options;
the cheaper parse to arrays plus the encode, split perfectly over two cores, is the least wall time a row can take.
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
import threading
import time
from pathlib import Path

import numpy as np

from bench.prime_rl_export import PrimeRLExporter, make_rollouts, pack

ROOT = Path(__file__).resolve().parents[1]
STEPS, RANKS = 8, 2

RUNNER = """
import json, resource, sys, time
def cpu():  # this process's and its reaped workers' user + system seconds
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                         resource.RUSAGE_CHILDREN)))
t0 = time.perf_counter()
from trustscope.importers import import_run
t1, c1 = time.perf_counter(), cpu()
run_dir = import_run("prime-rl", sys.argv[1], sys.argv[2], run_id="r", **json.loads(sys.argv[3]))
t2, c2 = time.perf_counter(), cpu()
manifests = [run_dir / "run.json", *sorted((run_dir / "ranks").glob("rank*.json"))]
rows = sum(json.loads(p.read_text())["rows"]["tokens"] for p in manifests)
status = open("/proc/self/status").read().splitlines()  # VmHWM: this process's own peak (getrusage's is not:
hwm = int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) / 1024  # it survives exec)
print(json.dumps({"rows": rows, "import_s": t2 - t1, "import_cpu_s": c2 - c1, "startup_s": t1 - t0, "hwm_mb": hwm}))
"""


def write_big_export(out: Path, tokens: int, seed: int = 0, steps: int = STEPS) -> int:
    """Write an export of about ``tokens`` trained tokens over ``steps`` steps; returns the trained-token count."""
    rng = np.random.default_rng(seed)
    per_call = max(1, tokens // (steps * RANKS * 2 * 512))  # sequences per micro-batch (mean completion ~500)
    trained = 0
    exporters = [PrimeRLExporter(out, rank) for rank in range(RANKS)]
    for step in range(steps):
        for exp in exporters:
            for micro in range(2):
                rollouts = make_rollouts(rng, per_call, prompt_len=64, completion_len=768)
                trained += sum(sum(r.trained) for r in rollouts)
                total = sum(len(r.prompt) + len(r.completion) for r in rollouts)
                exp.export(step, micro, *pack(rollouts, pad_to=total + 16))
        for exp in exporters:
            exp.mark_stable(step)
    return trained


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants, now (0 for a process that is gone): their proportional set
    sizes (``Pss``), so pages a forked child shares with its parent count once."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("Pss:"))) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


FLOOR = """
import glob, json, resource, sys, time
from pathlib import Path
which, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
files = sorted(glob.glob(str(src / "token_exports" / "step_*" / "rank_*.jsonl")))
if which == "duckdb":  # C++ JSON reader, the lists a row is made of, to Arrow (its threads: the process's cores)
    import duckdb
    lists = {"token_ids": "BIGINT[]", "loss_mask": "BOOLEAN[]", "is_masked": "BOOLEAN[]",
             **{c: "FLOAT[]" for c in ("advantages", "inference_logprobs", "trainer_logprobs", "entropy",
                                       "rl_weights")}}
    con = duckdb.connect()
    c0, t0 = cpu(), time.perf_counter()
    for f in files:
        con.sql("select * from read_json(?, format='newline_delimited', columns=?, maximum_object_size=1e9)",
                params=[f, {"step": "BIGINT", "rank": "BIGINT", **lists}]).to_arrow_table()
elif which == "msgspec":  # this code's decoder alone: the fields read, to Python objects, no arrays
    import msgspec, orjson
    from trustscope.importers.prime_rl import _decoder
    c0, t0 = cpu(), time.perf_counter()
    for f in files:
        data = Path(f).read_bytes()
        _decoder(frozenset(orjson.loads(data[:data.index(b"\\n")]))).decode_lines(data)
elif which == "parse":  # this code's whole read of every step, in this process: decoding, arrays, checks
    from trustscope.importers import read_steps
    c0, t0 = cpu(), time.perf_counter()
    for part in read_steps("prime-rl", src, workers=1):
        pass
elif which == "parquet":  # the Parquet encode of the imported token rows alone, with the logger's options
    import pyarrow as pa, pyarrow.parquet as pq
    from trustscope import runformat as S
    table = pa.concat_tables([pq.read_table(f) for f in sorted(out.glob("tokens/*/*.parquet"))]).combine_chunks()
    c0, t0 = cpu(), time.perf_counter()
    with pq.ParquetWriter(out / "floor.parquet", table.schema, **S.WRITE_OPTIONS["tokens"].writer_kwargs()) as w:
        for i in range(0, table.num_rows, 1 << 17):
            w.write_table(table.slice(i, 1 << 17))
print(json.dumps({"cpu_s": cpu() - c0, "wall_s": time.perf_counter() - t0}))
"""


def floor(src: Path, out: Path) -> dict[str, dict]:
    """CPU and wall of each stage alone (fresh processes, this code): parse (DuckDB's C++ reader, this code's
    decoder alone, this code's whole read) and the Parquet encode of the imported rows (``out``: an imported run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = {}
    for which in ("duckdb", "msgspec", "parse", "parquet"):
        done = subprocess.run([sys.executable, "-c", FLOOR, which, str(src), str(out)], env=env, check=True,
                              capture_output=True, text=True)
        res[which] = json.loads(done.stdout.strip().splitlines()[-1])
    return res


def run_one(code_dir: Path, src: Path, out: Path, kwargs: dict, keep: bool = False) -> dict:
    """One import in a fresh process with ``code_dir``'s trustscope: its report, wall and CPU seconds, peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(code_dir), "OMP_NUM_THREADS": "1"}
    log = out.with_name(out.name + ".log")
    t0 = time.perf_counter()
    with log.open("w") as stderr_file:
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(src), str(out), json.dumps(kwargs)], env=env,
                                stdout=subprocess.PIPE, stderr=stderr_file, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout = proc.stdout.read()  # type: ignore[union-attr]  # a few lines: read to the end, then reap
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"import with {code_dir} failed ({proc.returncode}):\n{log.read_text()}")
    report = json.loads(stdout.strip().splitlines()[-1])
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return {**report, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": peak[0] / 2**20}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="trained tokens in the export (about)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps in the export")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each variant once a round)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a directory holding the trustscope package to compare with (e.g. main's)")
    parser.add_argument("--also", type=Path, nargs="*", default=[],
                        help="more directories holding a trustscope package, each run as a variant of its own")
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also run this code with import_run(workers=N) for each N given (default: its own)")
    parser.add_argument("--src", type=Path, default=None, help="import this export instead of generating one")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the imports under this directory (e.g. /dev/shm: no disk) instead of beside the "
                             "export")
    parser.add_argument("--floor", action="store_true",
                        help="also time each stage alone (parse by DuckDB, by this code's decoder, this code's "
                             "whole read; the Parquet encode of the rows) in fresh processes")
    args = parser.parse_args()
    for code in filter(None, [args.baseline, *args.also]):
        if not (code / "trustscope" / "importers").is_dir():
            parser.error(f"{code}: no trustscope/importers package in it")
    work = Path(tempfile.mkdtemp(prefix="bench-importers-"))
    out_root = Path(tempfile.mkdtemp(prefix="bench-importers-", dir=args.out)) if args.out is not None else work
    try:
        src = args.src
        if src is None:
            src = work / "prime"
            t0 = time.perf_counter()
            trained = write_big_export(src, args.tokens, steps=args.steps)
            print(f"export: {trained:,} trained tokens over {args.steps} steps x {RANKS} ranks, written in "
                  f"{time.perf_counter() - t0:.1f} s")
        size = sum(p.stat().st_size for p in src.rglob("*.jsonl"))
        print(f"export: {size / 1e6:.1f} MB of JSON lines in {src}")
        variants = ([("baseline", args.baseline, {})] if args.baseline is not None else []) + \
            [(code.name, code, {}) for code in args.also] + \
            [("this code", ROOT, {})] + [(f"this code, workers={n}", ROOT, {"workers": n}) for n in args.workers]
        results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        for i in range(args.repeat):
            for name, code_dir, kwargs in variants:
                r = run_one(code_dir, src, out_root / "logs", kwargs)
                results[name].append(r)
                print(f"round {i} {name:22s} {r['rows']:,} rows  import {r['import_s']:.2f} s "
                      f"({r['rows'] / r['import_s']:,.0f} rows/s)  process wall {r['wall_s']:.2f} s  "
                      f"cpu {r['cpu_s']:.2f} s  peak RSS {r['hwm_mb']:.0f} MB (workers included, sampled: "
                      f"{r['peak_mb']:.0f} MB)", flush=True)
        print(f"\nmedians of {args.repeat} round(s) (load average now {os.getloadavg()[0]:.1f}):")
        base = base_cpu = None
        import_cpu: dict[str, float] = {}
        figures: dict = {"export_mb": size / 1e6}
        for name, _, _ in variants:
            rs = results[name]
            rate = statistics.median(r["rows"] / r["import_s"] for r in rs)
            wall = statistics.median(r["wall_s"] for r in rs)
            cpu = statistics.median(r["cpu_s"] for r in rs)
            import_cpu[name] = statistics.median(r["import_cpu_s"] / r["rows"] for r in rs)
            base = rate if base is None else base
            base_cpu = cpu if base_cpu is None else base_cpu
            print(f"  {name:22s} {rate:>12,.0f} rows/s (x{rate / base:.2f})  process wall {wall:.2f} s  cpu "
                  f"{cpu:.2f} s (x{base_cpu / cpu:.2f}; in import_run {import_cpu[name] * 1e6:.2f} us a row)  peak RSS "
                  f"{statistics.median(r['hwm_mb'] for r in rs):.0f} MB (workers included, sampled: "
                  f"{statistics.median(r['peak_mb'] for r in rs):.0f} MB)")
            figures[name] = {"rows": rs[-1]["rows"], "rows_per_s": rate, "x_first_rows_per_s": rate / base,
                             "wall_s": wall, "cpu_s": cpu, "x_first_cpu": base_cpu / cpu,
                             "import_cpu_us_per_row": import_cpu[name] * 1e6,
                             "peak_rss_mb": statistics.median(r["hwm_mb"] for r in rs),
                             "peak_tree_pss_mb": statistics.median(r["peak_mb"] for r in rs)}
        if args.floor:
            rows = results[variants[-1][0]][-1]["rows"]
            run_one(ROOT, src, out_root / "floor", {"workers": 1}, keep=True)
            stages = floor(src, out_root / "floor" / "r")
            print(f"\neach stage alone, this code, fresh processes ({rows:,} token rows; load average now "
                  f"{os.getloadavg()[0]:.1f}):")
            for which, what in (("duckdb", "parse: DuckDB read_json of the lists read (C++), to Arrow"),
                                ("msgspec", "parse: this code's decoder alone (fields read, no arrays)"),
                                ("parse", "parse: this code's whole read (arrays, checks)"),
                                ("parquet", "write: Parquet encode of the token rows alone (logger's options)")):
                r = stages[which]
                print(f"  {what:66s} cpu {r['cpu_s']:.2f} s ({r['cpu_s'] / rows * 1e6:.2f} us a row)  wall "
                      f"{r['wall_s']:.2f} s")
            figures["floor"] = {which: {"cpu_s": r["cpu_s"], "cpu_us_per_row": r["cpu_s"] / rows * 1e6,
                                        "wall_s": r["wall_s"]} for which, r in stages.items()}
            least = min(stages["duckdb"]["cpu_s"], stages["parse"]["cpu_s"]) + stages["parquet"]["cpu_s"]
            bound = (f"; against the baseline's {import_cpu['baseline'] * 1e6:.2f} CPU us a row in import_run (one "
                     f"core), x{import_cpu['baseline'] * rows / (least / 2):.2f} at most" if args.baseline else "")
            print(f"  floor: the cheaper parse to arrays (DuckDB's, this code's) plus the encode, {least / rows * 1e6:.2f} CPU us a row: "
                  f"{least / 2 / rows * 1e6:.2f} us of wall a row on 2 idle cores, nothing else done{bound}")
            figures["floor"]["least_cpu_us_per_row"] = least / rows * 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if out_root != work:
            shutil.rmtree(out_root, ignore_errors=True)
    return figures


if __name__ == "__main__":
    main()
