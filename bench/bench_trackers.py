"""What the tracker metrics and the alerts cost the training thread, per step.

    .venv/bin/python -m bench.bench_trackers [--steps 50] [--tokens 16384]

Logs ``--steps`` steps of ``--tokens`` token rows (no top-K) into a TokenLogger in a temporary directory and times,
on the training thread: ``TokenLogger.step_summaries()`` (no wait), :func:`trustscope.trackers.step_metrics` over
the step's rows, the early warning (:class:`trustscope.trackers.EarlyWarning`, the report's ``collapse_warnings``
over the kept window), and ``Alerts.send`` to a webhook that refuses connections. Prints the median and the 95th
percentile of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time

import numpy as np

from trustscope.alerts import Alerts
from trustscope.logger import TokenLogger
from trustscope.trackers import EarlyWarning, step_metrics

QUICK = ["--steps", "10"]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    b, t = 64, max(1, args.tokens // 64)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"step_summaries": [], "step_metrics": [], "early_warning": [], "alert_send": []}
    n_rows = n_metrics = 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}/hook"
    warning = EarlyWarning()
    alerts = Alerts(refused, retries=0, timeout_s=1.0, min_interval_s=0)
    with tempfile.TemporaryDirectory() as tmp, TokenLogger(tmp, "bench", fsync=False) as logger:
        for step in range(args.steps):
            mu = np.log(rng.uniform(0.02, 1.0, (b, t)))
            logger.log_step(step, tokens={"token_id": rng.integers(0, 1000, (b, t)), "mu_logprob": mu,
                                          "pi_logprob": np.minimum(mu + rng.normal(0, 0.2, (b, t)), 0.0),
                                          "advantage": rng.normal(size=b), "prompt_id": np.arange(b) // 8},
                            mask=np.ones((b, t), bool))
            logger.step_summaries(wait_s=60.0)  # the writer caught up: time the calls, not the wait
            t0 = time.perf_counter()
            latest = logger.step_summaries()
            t1 = time.perf_counter()
            metrics = step_metrics(latest[1], latest[0])
            t2 = time.perf_counter()
            warning.update(metrics)
            t3 = time.perf_counter()
            alerts.send(f"k{step}", "bench")
            t4 = time.perf_counter()
            for name, took in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(took * 1000)
            n_rows, n_metrics = len(latest[1]), len(metrics)
    alerts.close()
    print(f"{args.steps} steps of {b * t} tokens; {n_rows} summary rows -> {n_metrics} metrics a step")
    figures: dict = {"tokens_per_step": b * t, "summary_rows": n_rows, "metrics": n_metrics}
    for name, values in times.items():
        values = sorted(values)
        p95 = values[int(0.95 * (len(values) - 1))]
        print(f"{name:>15}: median {statistics.median(values):7.3f} ms, p95 {p95:7.3f} ms")
        figures[name] = {"median_ms": statistics.median(values), "p95_ms": p95}
    return figures


if __name__ == "__main__":
    main()
