"""Time the kept aggregates' first pass over N tokens files here and as Ray tasks, in one process.

    .venv/bin/python -m bench.bench_ray [--tokens 400_000] [--files 16] [--cpus 2] [--repeats 3] [--workdir DIR]

A synthetic run (K = 20) of ``--tokens`` tokens in ``--files`` tokens files (one per step) is written once under
``workdir`` and reused. Then, in this process: the local first pass (``connect(cache=False)``, then
``step_summary()``, which computes every partial aggregate of every file), Ray's start-up
(``ray.init(address="local", num_cpus=--cpus)``), the first pass on Ray (its workers start and import trustscope),
then ``--repeats`` rounds of a local pass and a pass on Ray with warm workers, alternated so that both see the
same load. Every pass checks that the step summaries match the local ones. Printed: the seconds of each, the
medians, the seconds the Ray tasks spent inside their workers, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from trustscope import db as tsdb
from trustscope.synthetic import SyntheticConfig, generate_run

ROOT = Path(__file__).resolve().parents[1]


def make_log(workdir: Path, tokens: int, files: int) -> Path:
    """The benchmark's log directory (written once): one run, ``files`` steps of ``tokens / files`` tokens, one
    tokens file per step."""
    logdir = workdir / f"logs-{tokens}-{files}"
    if not (logdir / "bench" / "run.json").is_file():
        per_step = tokens // files
        generate_run(logdir, "bench", SyntheticConfig(tokens=tokens, steps=files, rows_per_file=per_step // 2,
                                                      edge_cases=False, seed=5))
    return logdir


def cold_pass(logdir: Path, **connect: object) -> tuple[float, object, tsdb.LogDB]:
    """Seconds of one first pass (no kept aggregates), the step summary, and the closed connection."""
    db = tsdb.connect(logdir, cache=False, **connect)
    try:
        start = time.perf_counter()
        summary = db.step_summary()
        return time.perf_counter() - start, summary, db
    finally:
        db.close()


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ts_bench_ray")
    args = parser.parse_args()

    logdir = make_log(args.workdir, args.tokens, args.files)
    n_files = sum(len(tsdb.data_files(run, "tokens")) for run in tsdb.run_dirs([logdir]))
    load_before = os.getloadavg()
    print(f"{n_files} tokens files, {args.tokens:,} tokens; load average {load_before[0]:.1f} "
          f"on {os.cpu_count()} cores")

    first_local, want, _ = cold_pass(logdir)
    start = time.perf_counter()
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    ray_start = time.perf_counter() - start
    try:
        first_ray, got, db = cold_pass(logdir, ray="auto")
        np.testing.assert_allclose(got.mismatch_mean, want.mismatch_mean, rtol=1e-12)
        print(f"local first pass {first_local:.2f} s; Ray start-up {ray_start:.2f} s; first pass on Ray "
              f"{first_ray:.2f} s ({len(db.ray.tasks)} tasks, workers starting)")
        local, on_ray, inside = [], [], []
        for _ in range(args.repeats):
            seconds, summary, _ = cold_pass(logdir)
            local.append(seconds)
            seconds, summary, db = cold_pass(logdir, ray="auto")
            np.testing.assert_allclose(summary.n_blocked__ppo_clip, want.n_blocked__ppo_clip)
            on_ray.append(seconds)
            inside.append(sum(t.seconds for t in db.ray.tasks))
            print(f"  local {local[-1]:.2f} s | Ray {on_ray[-1]:.2f} s ({len(db.ray.tasks)} tasks on "
                  f"{len({t.pid for t in db.ray.tasks})} workers, {inside[-1]:.2f} s inside them)")
    finally:
        ray.shutdown()
    load_after = os.getloadavg()
    print(f"median of {args.repeats}: local {statistics.median(local):.2f} s, Ray ({args.cpus} CPUs, warm) "
          f"{statistics.median(on_ray):.2f} s, task time inside workers {statistics.median(inside):.2f} s; "
          f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    return {"tokens_files": n_files, "first_pass_local_s": first_local, "ray_start_s": ray_start,
            "first_pass_ray_s": first_ray, "local_median_s": statistics.median(local),
            "ray_warm_median_s": statistics.median(on_ray), "inside_workers_median_s": statistics.median(inside)}


if __name__ == "__main__":
    main()
