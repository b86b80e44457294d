"""What every benchmark shares: the repository root, the one-thread environment, the machine facts stored with
each result, the command that re-runs a benchmark module in a fresh process, and small file measures.

Importing this module puts the repository root on ``PYTHONPATH`` for the processes a benchmark starts, so that a
child started with :func:`module_cmd` finds the ``bench`` package wherever its working directory is.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V = 152_064
"""The vocabulary the generated top-K ids are drawn from (Qwen's)."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

if str(ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def one_thread() -> None:
    """Keep the math libraries on one thread (unless the caller's environment says otherwise): small operations
    stay off OpenMP barriers on a shared machine. Call it before numpy or torch is imported."""
    for name in THREAD_VARIABLES:
        os.environ.setdefault(name, "1")


def module_cmd(spec, *args: str) -> list[str]:
    """``python -m <module> args...`` for the module whose ``__spec__`` is ``spec``: a benchmark re-running itself
    as a child in a fresh process (works whether it was imported or run with ``-m``)."""
    if spec is None:
        raise RuntimeError("run benchmarks as modules: python -m bench run NAME, or python -m bench.bench_NAME")
    return [sys.executable, "-m", spec.name, *map(str, args)]


def make_step(rng, B: int, T: int, K: int) -> dict:
    """One padded step of rollout-like token arrays, every position real: mu's top-K log-probs (a descending
    softmax with 0-30 % of the mass outside the top-K), pi's the same plus noise of 1e-3, top-K ids Zipf-distributed
    over :data:`V`, one advantage a response, the top-K TV and KL computed as the trainer does. Shapes (B, T) and
    (B, T, K)."""
    import numpy as np
    import torch

    from trustscope import divergence

    logits = rng.standard_normal((B, T, K)).astype(np.float32) * 2.0 + np.linspace(4, 0, K, dtype=np.float32)
    logits = -np.sort(-logits, axis=-1)  # (B, T, K) descending
    tail = rng.uniform(0.0, 0.3, (B, T, 1)).astype(np.float32)  # probability mass outside the top-K
    topk = np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) * (1 - tail))  # (B, T, K)
    ids = np.minimum(rng.zipf(1.3, (B, T, K)), V) - 1  # (B, T, K)
    pi_topk = np.minimum(topk + rng.normal(0, 1e-3, topk.shape).astype(np.float32), 0)  # (B, T, K)
    mu_t, pi_t = torch.from_numpy(topk), torch.from_numpy(pi_topk)
    return {
        "token_id": ids[..., 0].astype(np.int32),
        "mu_logprob": topk[..., 0],
        "old_logprob": topk[..., 0],
        "pi_logprob": pi_topk[..., 0],
        "advantage": np.repeat(rng.standard_normal((B, 1)).astype(np.float32), T, axis=1),
        "entropy": rng.exponential(1.0, (B, T)).astype(np.float32),
        "mu_topk_ids": ids.astype(np.int32),
        "mu_topk_logprobs": topk,
        "pi_topk_logprobs": pi_topk,
        "topk_tv": divergence.topk_tv(mu_t, pi_t).numpy(),
        "topk_kl": divergence.topk_kl(mu_t, pi_t).numpy(),
        "kept": np.ones((B, T), dtype=bool),
    }


TOPK_COLUMNS = ("mu_topk_ids", "mu_topk_logprobs", "pi_topk_logprobs", "topk_tv", "topk_kl")


def build_step(seed: int, responses: int, length: int, k: int) -> dict:
    """:func:`make_step` from ``seed``, ``(responses, length)`` and ``(responses, length, k)``; at ``k = 0``
    without the top-K columns."""
    import numpy as np

    data = make_step(np.random.default_rng(seed), responses, length, max(k, 1))
    if k == 0:
        for name in TOPK_COLUMNS:
            del data[name]
    return data


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def token_rows(path: Path) -> int:
    """Rows in the Parquet files under ``path``, from their footers (0 when ``path`` does not exist)."""
    import pyarrow.parquet as pq

    path = Path(path)
    return sum(pq.ParquetFile(f).metadata.num_rows for f in path.rglob("*.parquet")) if path.exists() else 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_commit() -> dict:
    """The commit the benchmark ran on and whether the tree had changes beside it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine() -> dict:
    """The facts a figure needs beside it: CPU model and count, memory, Python, the platform, the thread settings
    and the load average now."""
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(), "memory_gib": _memory_gib(),
            "python": platform.python_version(), "platform": platform.platform(),
            "threads": {name: os.environ.get(name) for name in THREAD_VARIABLES},
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def now() -> str:
    """UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
