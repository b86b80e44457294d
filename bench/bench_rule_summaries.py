"""What the rules' threshold histograms and declared rule settings cost the logger's exact summaries.

    .venv/bin/python -m bench.bench_rule_summaries [--baseline /path/to/a/checkout] [--repeats 5]

Times :func:`trustscope.logger.summaries.summarize_call` on one call of 256 responses x 256 positions (65,536
tokens, top-K 8, pi_old given) on the CPU clock, each case in a fresh process: the checkout given as ``--baseline``
(its summaries, without threshold histograms), this checkout with every rule at its defaults (the threshold
histograms on), and with three rule settings declared (``geo_mask@0.99``, ``geo_mask@0.9``,
``ppo_clip:eps_low=0.1,eps_high=0.1``). Prints the median CPU seconds and the ratio to the baseline
(docs/performance.md, "Rule settings and threshold histograms in the summaries").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = r'''
import json, sys, time
import numpy as np
from trustscope.logger.summaries import summarize_call
settings = json.loads(sys.argv[1]); repeats = int(sys.argv[2])
rng = np.random.default_rng(0)
B, T, K = 256, 256, 8
n = B * T
mu_topk = -np.sort(rng.exponential(2.0, (n, K)).astype(np.float32), axis=-1)
mu_topk[:, 0] = np.log(rng.uniform(1e-4, 1.0, n)).astype(np.float32)
mu_topk = -np.sort(-mu_topk, axis=-1)
shift = np.where(rng.random((n, K)) < 0.1, rng.normal(0, 1.0, (n, K)), rng.normal(0, 0.01, (n, K)))
pi_topk = np.minimum(mu_topk + shift.astype(np.float32), 0)
cols = {"mu_logprob": mu_topk[:, 0], "pi_logprob": pi_topk[:, 0],
        "old_logprob": np.minimum(mu_topk[:, 0] + rng.normal(0, 0.05, n).astype(np.float32), 0),
        "entropy": rng.exponential(1.0, n).astype(np.float32),
        "advantage": np.repeat(rng.normal(size=B).astype(np.float32), T),
        "mu_topk_logprobs": mu_topk, "pi_topk_logprobs": pi_topk, "kept": rng.random(n) > 0.2,
        "sample_id": np.repeat(np.arange(B), T), "pos": np.tile(np.arange(T, dtype=np.int32), B)}
kwargs = {}
if settings is not None:
    from trustscope.logger.summaries import summary_rules
    from trustscope.rule_settings import parse_settings
    kwargs["rules"] = summary_rules("dppo_binary_tv", {}, tuple(parse_settings(settings)))
summarize_call(dict(cols), **kwargs)  # warm: imports, torch's first calls
times = []
for _ in range(repeats):
    start = time.process_time()
    summarize_call(dict(cols), **kwargs)
    times.append(time.process_time() - start)
print(json.dumps(sorted(times)[len(times) // 2]))
'''


def run(path: Path, settings: list[str] | None, repeats: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CASE, json.dumps(settings), str(repeats)], env=env, check=True,
                         capture_output=True, text=True, cwd=path)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout without threshold histograms")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = []
    if args.baseline is not None:
        cases.append(("baseline checkout: every rule at its defaults", args.baseline, None))
    cases += [("every rule at its defaults, threshold histograms", ROOT, []),
              ("and three rule settings", ROOT, ["geo_mask@0.99", "geo_mask@0.9", "ppo_clip:eps_low=0.1,eps_high=0.1"])]
    first = None
    figures = {}
    for label, path, settings in cases:
        seconds = run(path, settings, args.repeats)
        first = first or seconds
        print(f"{label}: {seconds:.3f} CPU s a call of 65,536 tokens, x{seconds / first:.2f}")
        figures[label] = {"cpu_s": seconds, "x_first": seconds / first}
    return figures


if __name__ == "__main__":
    main()
