"""The logger's sampling hash: one uniform value per sample from ``(seed, step, sample_id)`` alone, which the input
checks (``token_fraction``), the writer (``text_fraction``) and the routed-experts pass (their own fraction) each
compare with their fraction, so every rank keeps the same samples."""

from __future__ import annotations

import numpy as np


def keep_hash(seed: int, step: int, sample_id: np.ndarray) -> np.ndarray:
    """A uniform value in [0, 1) per sample, from (seed, step, sample_id) alone (splitmix64), so ranks agree:
    ``token_fraction`` keeps a sample's tokens below it, ``text_fraction`` its texts (so the one sample holds the
    other when it is the larger)."""
    with np.errstate(over="ignore"):
        z = sample_id.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)
