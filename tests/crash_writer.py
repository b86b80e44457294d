"""Subprocess for tests/test_crash_safety.py: logs steps in a loop until it is killed.

Usage: python tests/crash_writer.py LOGDIR RUN_ID FIRST_STEP [KILL_AFTER_RENAMES]. Prints ``ready`` once the
logger is open and ``flushed <step> <torch imported 0/1>`` after every flush. Even steps are flushed, odd ones stay
buffered; $CRASH_WRITER_COMPACT_EVERY sets ``compact_every`` (0 by default). With KILL_AFTER_RENAMES = n the process SIGKILLs itself right after the n-th rename of a data file (a
flush commits, then renames one file per table: tokens, samples, steps, then summaries, which is not counted):
n = 3k + 1 or 3k + 2 dies between the renames of one committed flush, n = 3k before its summaries file's.
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np

from trustscope.logger import TokenLogger
from trustscope.runformat.layout import table_of

B, T, K = 8, 16, 5


def main() -> None:
    logdir, run_id, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if len(sys.argv) > 4:
        kill_after, replace, renames = int(sys.argv[4]), os.replace, []

        def replace_then_die(src, dst):
            replace(src, dst)
            if str(dst).endswith(".parquet") and table_of(Path(dst)) in ("tokens", "samples", "steps"):
                renames.append(dst)
                if len(renames) == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)

        os.replace = replace_then_die
    rng = np.random.default_rng(first)
    logger = TokenLogger(logdir, run_id, resume=True, flush_seconds=3600, vocab=[str(i) for i in range(100)],
                         # test_crash_safety follows each committed file (no compaction); test_exactly_once compacts
                         compact_every=int(os.environ.get("CRASH_WRITER_COMPACT_EVERY", "0")))
    print("ready", flush=True)
    step = first
    while True:
        topk = -np.sort(rng.random((B, T, K), dtype=np.float32) * 5, axis=-1)  # (B, T, K)
        logger.log_step(
            step,
            tokens={
                "token_id": rng.integers(0, 100, (B, T)),
                "mu_logprob": topk[..., 0],
                "pi_logprob": topk[..., 0],
                "advantage": rng.normal(size=B),
                "mu_topk_ids": rng.integers(0, 100, (B, T, K)),
                "mu_topk_logprobs": topk,
                "topk_tv": np.zeros((B, T)),
            },
            mask=np.ones((B, T), dtype=bool),
            samples={"sample_id": np.arange(B), "prompt_id": np.arange(B) // 4, "reward": rng.random(B)},
            scalars={"loss": float(step)},
        )
        if step % 2 == 0:
            logger.flush()
            print(f"flushed {step} {int('torch' in sys.modules)}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
