"""Top-K TV and KL in numpy, for code that must not import torch: the logger's writer thread.

The same formulas as :func:`trustscope.divergence.topk_tv` and :func:`~trustscope.divergence.topk_kl` (mu's top-K
ids plus one 'other' bucket, KL(mu || pi), every difference of probabilities taken without cancellation), computed
in float64: in float32 the 'other' bucket ``1 - sum P`` is lost below about 1e-3, and its log-ratio term of the KL
with it. ``tests/test_divergence.py`` holds the two implementations to each other.
"""

from __future__ import annotations

import numpy as np

__all__ = ["topk_divergences_np"]

EPS = 1e-12
"""Floor of the 'other' bucket before its logarithm: :data:`trustscope.divergence.EPS`."""


def topk_divergences_np(mu_topk_logprobs: np.ndarray, pi_topk_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-K TV and KL(mu || pi) ``(N,)`` float32 from ``(N, K)`` log-probs aligned by token id (mu's top-K ids)."""
    mu = np.asarray(mu_topk_logprobs, dtype=np.float64)  # (N, K)
    pi = np.asarray(pi_topk_logprobs, dtype=np.float64)  # (N, K)
    if mu.shape != pi.shape or mu.ndim != 2 or mu.shape[1] < 1:
        raise ValueError(f"top-K log-probs must be two (N, K) arrays with K >= 1, got {mu.shape} and {pi.shape}")
    mu_sum, pi_sum = _logsumexp(mu), _logsumexp(pi)  # (N,) log of each list's probability mass
    # |P_rest - Q_rest| = |sum Q_i - sum P_i|: from the two log-sums, accurate even when both rests are near 1.
    listed = _abs_diff_exp(mu, pi).sum(-1)  # (N,)
    rest = _abs_diff_exp(np.minimum(mu_sum, 0.0), np.minimum(pi_sum, 0.0))  # (N,)
    tv = np.clip(0.5 * (listed + rest), 0.0, 1.0)
    p = np.exp(mu)  # (N, K)
    p_rest = np.maximum(-np.expm1(mu_sum), EPS)  # (N,)
    q_rest = np.maximum(-np.expm1(pi_sum), EPS)  # (N,)
    terms = np.where(p > 0, p * (mu - pi), 0.0)  # (N, K): 0 log 0 = 0 for padded ids
    kl = np.maximum(terms.sum(-1) + p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return tv.astype(np.float32), kl.astype(np.float32)


def _logsumexp(lp: np.ndarray) -> np.ndarray:
    """``log(sum(exp(lp)))`` over the last axis, shifted by the row's largest entry. ``(N, K)`` -> ``(N,)``."""
    top = lp.max(axis=-1)  # (N,)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):  # a row of -inf sums to 0: its log is -inf, as in torch
        return shift + np.log(np.exp(lp - shift[:, None]).sum(-1))


def _abs_diff_exp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|exp(a) - exp(b)|`` without cancellation: ``exp(max) * (1 - exp(-|a - b|))``."""
    gap = np.abs(a - b)
    out = np.exp(np.maximum(a, b)) * -np.expm1(-gap)
    return np.where(gap == 0, 0.0, out)
