"""Subprocess for the kill test of tests/test_s3_faults.py: logs steps to an ``s3://`` run until it is killed.

Usage: python tests/s3_kill_writer.py URL RUN_ID STORAGE_OPTIONS_JSON. Resumes the run (or starts it), logs from the
step after the last committed one, one flush per step, and prints ``ready <first step>`` once the logger is open
and ``flushed <step>`` after every flush.
"""

import json
import sys
import warnings

import numpy as np

from trustscope.logger import LogWarning, TokenLogger

B, T = 4, 6


def main() -> None:
    url, run_id, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    warnings.simplefilter("ignore", LogWarning)  # no lock on object storage; a flush lost past the bound
    logger = TokenLogger(url, run_id, resume=True, strict=False, flush_seconds=3600, compact_every=0,
                         summaries=False, write_threads=1, storage_options=options)
    last = logger.manifest.get("last_step")
    step = 0 if last is None else last + 1
    print(f"ready {step}", flush=True)
    while True:
        rng = np.random.default_rng(step)
        mu = -rng.random((B, T)).astype(np.float32) * 3  # (B, T)
        logger.log_step(step, tokens={"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": mu,
                                      "pi_logprob": mu, "advantage": rng.normal(size=B)},
                        mask=np.ones((B, T), dtype=bool),
                        samples={"sample_id": np.arange(B), "prompt_id": np.zeros(B, int), "reward": rng.random(B)},
                        scalars={"loss": float(step)})
        logger.flush()
        print(f"flushed {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
