"""The logger at a production step: 2M tokens a step through ``TokenLogger``, what waits on the training thread.

    nice -n 10 .venv/bin/python bench/bench_logger_scale.py                       # 512 x 4,096 tokens, 3 steps
    nice -n 10 .venv/bin/python bench/bench_logger_scale.py --responses 256 --steps 2 --json out.json

One step is ``--responses`` x ``--length`` tokens (default 512 x 4,096 = 2,097,152, about a rank's share of a
100M-token step on 48 ranks), built like ``bench/bench_logger.py``'s data (top-K ids Zipf-distributed over a
152k vocabulary, sorted top-K log-probs, pi within about 1e-3 of mu). Cases, each in a fresh process, ``--steps``
steps each (every step's arrays built anew, as a trainer's are):

- ``baseline``: build the step's arrays, log nothing (what every other case also pays);
- ``k0-f1`` / ``k0-f0.01``: log the scalar columns (ids, mu / pi_old / pi, advantage, entropy, the mask) at
  ``token_fraction`` 1 and 0.01 (summaries always over every token);
- ``k20-f1`` / ``k20-f0.01``: the same with mu's top-20 (ids, mu's and pi's log-probs, top-K TV and KL).

Each step calls ``log_step`` then ``commit_step`` (a step ends committed; the writer stores it while the next step
is built). Reported per case: the wall time the calling thread spends inside ``log_step`` + ``commit_step`` per step
(median, and the largest, which includes waiting when the writer is behind and the row budget is full), the same as a
share of the step's array build (the baseline's work); the CPU seconds per step of the logger's own threads
(:class:`logger_cpu.LoggerCPU`: the caller, the writer thread, the encoders); how long ``close`` waits for the writer
to drain after the last step; bytes on disk per logged token row and per step; peak RSS and what it adds over the
baseline (``ru_maxrss`` of the case's own process). ``--json`` writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {"baseline": None, "k0-f1": (0, 1.0), "k0-f0.01": (0, 0.01), "k20-f1": (20, 1.0), "k20-f0.01": (20, 0.01)}
TOPK_COLUMNS = ("mu_topk_ids", "mu_topk_logprobs", "pi_topk_logprobs", "topk_tv", "topk_kl")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def token_rows(path: Path) -> int:
    """Token rows in the Parquet files under ``path`` (from their footers)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in path.rglob("*.parquet")) if path.exists() else 0


def build_step(seed: int, responses: int, length: int, k: int) -> dict:
    """One step's token arrays, ``(responses, length)`` and ``(responses, length, K)``."""
    import numpy as np
    from bench_logger import make_step

    data = make_step(np.random.default_rng(seed), responses, length, max(k, 1))
    if k == 0:
        for name in TOPK_COLUMNS:
            del data[name]
    return data


def child(case: str, responses: int, length: int, steps: int, out: Path) -> dict:
    """One case in this fresh process."""
    import bench_logger  # noqa: F401  (its imports, polars and torch among them, before any timer)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    spec = CASES[case]
    k = 20 if spec is None else spec[0]
    builds, waits, log_calls, commits = [], [], [], []
    samples = {"sample_id": np.arange(responses), "prompt_id": np.arange(responses) // 16}
    mask = np.ones((responses, length), dtype=bool)
    result: dict = {"case": case, "tokens_per_step": responses * length, "steps": steps}
    if spec is None:
        for step in range(steps):
            t0 = time.perf_counter()
            data = build_step(step, responses, length, k)
            builds.append(time.perf_counter() - t0)
            del data
    else:
        from logger_cpu import LoggerCPU

        from trustscope.logger import TokenLogger

        with LoggerCPU() as cpu:
            logger = TokenLogger(out, "scale", loss_rule="dppo_binary_tv", token_fraction=spec[1],
                                 log_topk=k > 0)
            for step in range(steps):
                t0 = time.perf_counter()
                data = build_step(step, responses, length, k)
                t1 = time.perf_counter()
                logger.log_step(step, tokens=data, mask=mask, samples=samples)
                t2 = time.perf_counter()
                logger.commit_step()
                t3 = time.perf_counter()
                builds.append(t1 - t0)
                log_calls.append(t2 - t1)
                commits.append(t3 - t2)
                waits.append(t3 - t1)
                del data
            t4 = time.perf_counter()
            logger.close()
            result["close_drain_s"] = time.perf_counter() - t4
        roles = cpu.seconds()
        result["logger_cpu_s_per_step"] = {name: s / steps for name, s in roles.items()}
        tokens_dir = out / "scale" / "tokens"
        logged = token_rows(tokens_dir)
        result["logged_rows"] = logged
        result["token_bytes"] = dir_bytes(tokens_dir) if tokens_dir.exists() else 0
        result["run_bytes"] = dir_bytes(out / "scale")
        result["bytes_per_logged_row"] = result["token_bytes"] / max(logged, 1)
        result["run_bytes_per_step"] = result["run_bytes"] / steps
        result["wait_s"] = waits
        result["log_step_s"] = log_calls
        result["commit_step_s"] = commits
        result["wait_median_s"] = statistics.median(waits)
        result["wait_max_s"] = max(waits)
    result["build_s"] = builds
    result["build_median_s"] = statistics.median(builds)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--responses", type=int, default=512)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.responses, args.length, args.steps, args.out)))
        return
    results = []
    for case in args.cases:
        tmp = Path(tempfile.mkdtemp(prefix="bench_logger_scale."))
        try:
            done = subprocess.run([sys.executable, __file__, "--child", case, "--out", str(tmp), "--responses",
                                   str(args.responses), "--length", str(args.length), "--steps", str(args.steps)],
                                  capture_output=True, text=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if done.returncode:
            sys.exit(f"case {case} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {case}: done", file=sys.stderr)
    base = next((r for r in results if r["case"] == "baseline"), None)
    n = results[0]["tokens_per_step"]
    print(f"{n:,} tokens a step ({args.responses} x {args.length}), {args.steps} steps a case, fresh processes; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<10} {'build s':>8} {'wait s (med/max)':>17} {'% of build':>10} {'caller CPU':>10} "
          f"{'writer CPU':>10} {'encoders':>9} {'drain s':>8} {'B/row':>7} {'MB/step':>8} {'RSS GiB':>8} {'added':>6}")
    for r in results:
        if r["case"] == "baseline":
            print(f"{'baseline':<10} {r['build_median_s']:8.2f} {'':>17} {'':>10} {'':>10} {'':>10} {'':>9} {'':>8} "
                  f"{'':>7} {'':>8} {r['peak_rss_gib']:8.2f}")
            continue
        cpu = r["logger_cpu_s_per_step"]
        share = r["wait_median_s"] / r["build_median_s"]
        added = "" if base is None else f"{r['peak_rss_gib'] - base['peak_rss_gib']:+6.2f}"
        print(f"{r['case']:<10} {r['build_median_s']:8.2f} {r['wait_median_s']:8.3f}/{r['wait_max_s']:<8.3f} "
              f"{share:10.1%} {cpu['caller']:10.2f} {cpu['writer thread']:10.2f} {cpu['encoders']:9.2f} "
              f"{r['close_drain_s']:8.2f} {r['bytes_per_logged_row']:7.1f} {r['run_bytes_per_step'] / 1e6:8.1f} "
              f"{r['peak_rss_gib']:8.2f} {added}")
    if args.json:
        args.json.write_text(json.dumps({"responses": args.responses, "length": args.length, "steps": args.steps,
                                         "load_average": os.getloadavg(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
