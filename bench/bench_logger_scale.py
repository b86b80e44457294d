"""The logger at a production step: 2M tokens a step through ``TokenLogger``, what waits on the training thread.

    nice -n 10 .venv/bin/python -m bench.bench_logger_scale                       # 512 x 4,096 tokens, 3 steps
    nice -n 10 .venv/bin/python -m bench.bench_logger_scale --responses 256 --steps 2 --json out.json

One step is ``--responses`` x ``--length`` tokens (default 512 x 4,096 = 2,097,152, about a rank's share of a
100M-token step on 48 ranks), built like ``bench/bench_logger.py``'s data (top-K ids Zipf-distributed over a
152k vocabulary, sorted top-K log-probs, pi within about 1e-3 of mu). Cases, each in a fresh process:

- ``baseline-k0`` / ``baseline-k20``: build the step's arrays (without / with mu's top-20) and log nothing: the
  time and the peak memory every logging case of that K also pays;
- ``k0-f1`` / ``k0-f0.01``: log the scalar columns (ids, mu / pi_old / pi, advantage, entropy, the mask) at
  ``token_fraction`` 1 and 0.01 (the summaries always over every token);
- ``k20-f1`` / ``k20-f0.01``: the same with mu's top-20 (ids, mu's and pi's log-probs, top-K TV and KL).

A logging case builds the arrays once and logs them as ``--steps`` steps: ``log_step``, then ``commit_step`` (what
the training thread calls at a step's end), then ``flush``, which stands for the rest of a training step: it waits
until the writer has stored and committed the step, so each call starts with an idle writer and the time the
writer needs a step is read apart from the calls. Reported per case: the wall time the calling thread spends
inside ``log_step`` + ``commit_step`` (median and largest over the steps) and as a share of building the step's
arrays (the baseline of the same K); the writer's wall per step (commit to stored: a training step shorter than
this would make the next ``log_step`` wait for room); the CPU seconds per step of the logger's own threads
(:class:`logger_cpu.LoggerCPU`: the caller, the writer thread, the encoders); bytes on disk per logged token row
and per step (every table); peak RSS and what it adds over the baseline of the same K (``ru_maxrss`` of the
case's own process). ``--json`` writes every measurement.
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

from bench import common

common.one_thread()

QUICK = ["--responses", "16", "--length", "256", "--steps", "2"]
CASES = {"baseline-k0": (0, None), "k0-f1": (0, 1.0), "k0-f0.01": (0, 0.01),
         "baseline-k20": (20, None), "k20-f1": (20, 1.0), "k20-f0.01": (20, 0.01)}


def child(case: str, responses: int, length: int, steps: int, out: Path) -> dict:
    """One case in this fresh process."""
    import numpy as np
    import torch

    import bench.bench_logger  # noqa: F401  (its imports, polars and torch among them, before any timer)

    torch.set_num_threads(1)
    k, fraction = CASES[case]
    samples = {"sample_id": np.arange(responses), "prompt_id": np.arange(responses) // 16}
    mask = np.ones((responses, length), dtype=bool)
    t0 = time.perf_counter()
    data = common.build_step(0, responses, length, k)
    result: dict = {"case": case, "k": k, "token_fraction": fraction, "tokens_per_step": responses * length,
                    "steps": steps, "build_s": time.perf_counter() - t0,
                    "array_bytes": sum(a.nbytes for a in data.values()) + mask.nbytes}
    if fraction is not None:
        from bench.logger_cpu import LoggerCPU
        from trustscope.logger import TokenLogger

        log_calls, commits, drains = [], [], []
        with LoggerCPU() as cpu:
            logger = TokenLogger(out, "scale", loss_rule="dppo_binary_tv", token_fraction=fraction, log_topk=k > 0)
            for step in range(steps):
                t1 = time.perf_counter()
                logger.log_step(step, tokens=data, mask=mask, samples=samples)
                t2 = time.perf_counter()
                logger.commit_step()
                t3 = time.perf_counter()
                logger.flush()  # the rest of the step: wait until the writer has stored it
                log_calls.append(t2 - t1)
                commits.append(t3 - t2)
                drains.append(time.perf_counter() - t3)
            logger.close()
        roles = cpu.seconds()
        tokens_dir = out / "scale" / "tokens"
        logged = common.token_rows(tokens_dir)
        waits = [a + b for a, b in zip(log_calls, commits, strict=True)]
        result.update({
            "logger_cpu_s_per_step": {name: s / steps for name, s in roles.items()},
            "log_step_s": log_calls, "commit_step_s": commits, "writer_wall_s": drains, "wait_s": waits,
            "wait_median_s": statistics.median(waits), "wait_max_s": max(waits),
            "writer_wall_median_s": statistics.median(drains),
            "logged_rows": logged, "token_bytes": common.dir_bytes(tokens_dir) if tokens_dir.exists() else 0,
            "run_bytes": common.dir_bytes(out / "scale")})
        result["bytes_per_logged_row"] = result["token_bytes"] / max(logged, 1)
        result["run_bytes_per_step"] = result["run_bytes"] / steps
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def main() -> dict:
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
        return {}
    results = []
    for case in args.cases:
        tmp = Path(tempfile.mkdtemp(prefix="bench_logger_scale."))
        try:
            done = subprocess.run([*common.module_cmd(__spec__), "--child", case, "--out", str(tmp), "--responses",
                                   str(args.responses), "--length", str(args.length), "--steps", str(args.steps)],
                                  capture_output=True, text=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if done.returncode:
            sys.exit(f"case {case} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {case}: done", file=sys.stderr)
    n = results[0]["tokens_per_step"]
    print(f"{n:,} tokens a step ({args.responses} x {args.length}), {args.steps} steps a case, fresh processes; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<12} {'build s':>8} {'wait s med/max':>15} {'% build':>8} {'writer s':>9} {'caller':>7} "
          f"{'writer':>7} {'encoders':>9} {'B/row':>7} {'MB/step':>8} {'RSS GiB':>8} {'added':>6}")
    bases = {r["k"]: r for r in results if r["token_fraction"] is None}
    figures: dict = {"tokens_per_step": n}
    for r in results:
        figures[r["case"]] = {"build_s": r["build_s"], "peak_rss_gib": r["peak_rss_gib"]}
        if r["token_fraction"] is None:
            print(f"{r['case']:<12} {r['build_s']:8.2f} {'':>15} {'':>8} {'':>9} {'':>7} {'':>7} {'':>9} {'':>7} "
                  f"{'':>8} {r['peak_rss_gib']:8.2f}")
            continue
        cpu = r["logger_cpu_s_per_step"]
        base = bases.get(r["k"])
        added = "" if base is None else f"{r['peak_rss_gib'] - base['peak_rss_gib']:+6.2f}"
        share = "" if base is None else f"{r['wait_median_s'] / base['build_s']:8.1%}"
        print(f"{r['case']:<12} {r['build_s']:8.2f} {r['wait_median_s']:7.3f}/{r['wait_max_s']:<7.3f} {share:>8} "
              f"{r['writer_wall_median_s']:9.2f} {cpu['caller']:7.2f} {cpu['writer thread']:7.2f} "
              f"{cpu['encoders']:9.2f} {r['bytes_per_logged_row']:7.1f} {r['run_bytes_per_step'] / 1e6:8.1f} "
              f"{r['peak_rss_gib']:8.2f} {added}")
        figures[r["case"]].update({
            "wait_median_s": r["wait_median_s"], "wait_max_s": r["wait_max_s"],
            "writer_wall_median_s": r["writer_wall_median_s"], "logger_cpu_s_per_step": cpu,
            "bytes_per_logged_row": r["bytes_per_logged_row"], "run_mb_per_step": r["run_bytes_per_step"] / 1e6})
        if base is not None:
            figures[r["case"]].update({"wait_over_build": r["wait_median_s"] / base["build_s"],
                                       "added_rss_gib": r["peak_rss_gib"] - base["peak_rss_gib"]})
    if args.json:
        args.json.write_text(json.dumps({"responses": args.responses, "length": args.length, "steps": args.steps,
                                         "load_average": os.getloadavg(), "results": results}, indent=2))
    return figures


if __name__ == "__main__":
    main()
