"""Importer throughput: ``trustscope import prime-rl`` on a generated token export, against another trustscope's code.

    git archive main trustscope | (mkdir -p /tmp/base && tar -x -C /tmp/base)      # today's code, once
    .venv/bin/python bench/bench_importers.py --baseline /tmp/base                   # ~1.1M trained tokens, 3 rounds
    .venv/bin/python bench/bench_importers.py --tokens 200000 --repeat 1             # a quick run, this code only

The export is written by the test suite's ``PrimeRLExporter`` (``tests/test_importers_prime_rl.py``, the layout of
prime-rl's ``TokenExporter``: packed micro-batches, one compact JSON line per sequence, weight-stream layout) over
8 steps x 2 ranks, completions of 256-768 tokens after 64-token prompts.

Every import runs in a fresh process (``python -c``, the code under test first on ``PYTHONPATH``): with
``--baseline DIR`` (a directory holding another ``trustscope`` package, e.g. main's) each round imports the same
export once with that code and once with this one (and once per ``--workers`` value given), in turn. Reported per
import: token rows/s of ``import_run`` in the process (after its imports), the process's wall time and CPU time
(user + system, its workers included), and memory: the importing process's peak resident size (``VmHWM``, its
own: ``getrusage``'s survives ``exec`` and would count this script's), and, workers included, the process tree's
proportional set size sampled every 20 ms from ``/proc`` (a lower bound: short peaks fall between samples); then
medians over the rounds and each variant's rows/s as a ratio of the baseline's.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_importers_prime_rl import PrimeRLExporter, make_rollouts, pack

ROOT = Path(__file__).resolve().parents[1]
STEPS, RANKS = 8, 2

RUNNER = """
import json, sys, time
t0 = time.perf_counter()
from trustscope.importers import import_run
t1 = time.perf_counter()
run_dir = import_run("prime-rl", sys.argv[1], sys.argv[2], run_id="r", **json.loads(sys.argv[3]))
t2 = time.perf_counter()
manifests = [run_dir / "run.json", *sorted((run_dir / "ranks").glob("rank*.json"))]
rows = sum(json.loads(p.read_text())["rows"]["tokens"] for p in manifests)
status = open("/proc/self/status").read().splitlines()  # VmHWM: this process's own peak (getrusage's is not:
hwm = int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) / 1024  # it survives exec)
print(json.dumps({"rows": rows, "import_s": t2 - t1, "startup_s": t1 - t0, "hwm_mb": hwm}))
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


def run_one(code_dir: Path, src: Path, out: Path, kwargs: dict) -> dict:
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
    shutil.rmtree(out, ignore_errors=True)
    return {**report, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": peak[0] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="trained tokens in the export (about)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps in the export")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each variant once a round)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a directory holding the trustscope package to compare with (e.g. main's)")
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also run this code with import_run(workers=N) for each N given (default: its own)")
    parser.add_argument("--src", type=Path, default=None, help="import this export instead of generating one")
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "trustscope" / "importers").is_dir():
        parser.error(f"--baseline {args.baseline}: no trustscope/importers package in it")
    work = Path(tempfile.mkdtemp(prefix="bench-importers-"))
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
            [("this code", ROOT, {})] + [(f"this code, workers={n}", ROOT, {"workers": n}) for n in args.workers]
        results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        for i in range(args.repeat):
            for name, code_dir, kwargs in variants:
                r = run_one(code_dir, src, work / "logs", kwargs)
                results[name].append(r)
                print(f"round {i} {name:22s} {r['rows']:,} rows  import {r['import_s']:.2f} s "
                      f"({r['rows'] / r['import_s']:,.0f} rows/s)  process wall {r['wall_s']:.2f} s  "
                      f"cpu {r['cpu_s']:.2f} s  peak RSS {r['hwm_mb']:.0f} MB (workers included, sampled: "
                      f"{r['peak_mb']:.0f} MB)", flush=True)
        print(f"\nmedians of {args.repeat} round(s) (load average now {os.getloadavg()[0]:.1f}):")
        base = None
        for name, _, _ in variants:
            rs = results[name]
            rate = statistics.median(r["rows"] / r["import_s"] for r in rs)
            wall = statistics.median(r["wall_s"] for r in rs)
            base = rate if base is None else base
            print(f"  {name:22s} {rate:>12,.0f} rows/s (x{rate / base:.2f})  process wall {wall:.2f} s  cpu "
                  f"{statistics.median(r['cpu_s'] for r in rs):.2f} s  peak RSS "
                  f"{statistics.median(r['hwm_mb'] for r in rs):.0f} MB (workers included, sampled: "
                  f"{statistics.median(r['peak_mb'] for r in rs):.0f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
