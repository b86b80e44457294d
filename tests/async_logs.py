"""Small asynchronous multi-turn logs for the page "Where the mismatch lives", the report and the browser test.

Each response has three model turns; half of the responses were sampled ``lag`` weight versions behind the trainer,
the others one version behind, switching to the newer version part-way (a partial rollout). The gap between mu and
pi grows with the staleness and, more slowly, with the position, so the charts have something to show.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trustscope.logger import TokenLogger

B, T, V = 16, 40, 64


def write_async_run(root: Path, run_id: str, *, lag: int = 2, steps: int = 5, seed: int = 0,
                    turns: bool = True, versions: bool = True, **logger_options) -> Path:
    """One run of ``steps`` steps; ``turns`` / ``versions``: log ``turn`` / ``policy_version`` at all."""
    rng = np.random.default_rng(seed)
    pos = np.arange(T)[None, :]  # (1, T)
    with TokenLogger(root, run_id, loss_rule="dppo_binary_tv", vocab=[f"t{i}" for i in range(V)], fsync=False,
                     max_staleness=lag if versions else None, **logger_options) as lg:
        for step in range(steps):
            start = np.where(np.arange(B) % 2, np.maximum(step - lag, 0), max(step - 1, 0))  # (B,)
            switch = rng.integers(T // 4, T, B)[:, None]  # (B, 1)
            version = np.where(pos < switch, start[:, None], step)  # (B, T)
            stale = step - version  # (B, T)
            mu = np.log(rng.uniform(0.02, 1.0, (B, T)))  # (B, T)
            noise = rng.normal(0, 0.05 + 0.25 * stale + 0.002 * pos, (B, T))
            pi = np.minimum(mu + noise, -1e-3)  # never exactly 0: doctor would read it as padded
            tokens = {"token_id": rng.integers(0, V, (B, T)), "mu_logprob": mu.astype(np.float32),
                      "pi_logprob": pi.astype(np.float32), "advantage": rng.choice([-1.0, 1.0], B),
                      "kept": rng.random((B, T)) > 0.05}
            if versions:
                tokens["policy_version"] = version
            if turns:
                tokens["turn"] = np.repeat((pos >= T // 3).astype(np.int32) + (pos >= 2 * T // 3), B, axis=0)
            lg.log_step(step, tokens=tokens, samples={"sample_id": np.arange(B), "prompt_id": np.arange(B) // 4,
                                                      "reward": rng.random(B).astype(np.float32)})
    return root / run_id


def write_async_logdir(root: Path) -> Path:
    """Three runs: staleness bounds 1 and 3 with turns, and a synchronous single-turn run without versions or
    turns (whose charts the page must replace with a sentence)."""
    write_async_run(root, "async-lag1", lag=1, seed=1)
    write_async_run(root, "async-lag3", lag=3, seed=2)
    write_async_run(root, "sync-single-turn", lag=0, seed=3, turns=False, versions=False)
    return root
