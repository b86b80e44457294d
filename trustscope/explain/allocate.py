"""Shapley allocation of a total (mismatch nats, blocked tokens) over the causes touching each token.

The tokens are grouped by their pattern S, the set of causes whose indicator is true on them. Let b be the level of
the quantity on the tokens no cause touches (its mean per token there). A pattern's excess is
``E_S = max(V_S - b * n_S, 0)``: what its ``n_S`` tokens carry (``V_S``) beyond that baseline. Removing the causes
in a set C brings back to the baseline every pattern they cover whole, so the value of a coalition is
``v(C) = sum over S subset of C of E_S``: a sum of unanimity games, whose Shapley value gives each cause of S the
share ``E_S / |S|`` (a token touched by two causes splits its excess in half). What the causes do not take, the
baseline level of every token and the untouched tokens' whole value, is the ``unexplained`` remainder; the shares
add up to 1 exactly.

Pure numpy over the pattern sums, vectorised over bootstrap replicates: ``values`` and ``counts`` are ``(R, P)``
(R replicates, P patterns), ``patterns`` ``(P, C)`` bool.
"""

from __future__ import annotations

import numpy as np


def shapley_shares(values: np.ndarray, counts: np.ndarray, patterns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(shares, amounts)``, each ``(R, C + 1)``: per replicate, each cause's Shapley share of the total and its
    amount, the last column the unexplained remainder. A replicate whose total is 0 puts its share on the remainder
    (nothing to allocate). Shares add up to 1 on every row.

    ``values`` ``(R, P)``: the quantity summed over each pattern's tokens (>= 0); ``counts`` ``(R, P)``: the tokens;
    ``patterns`` ``(P, C)``: which causes each pattern has."""
    values = np.atleast_2d(np.asarray(values, dtype=np.float64))
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    patterns = np.asarray(patterns, dtype=bool)
    size = patterns.sum(axis=1)  # (P,) |S|
    untouched = size == 0
    base_n = counts[:, untouched].sum(axis=1)  # (R,)
    base = np.divide(values[:, untouched].sum(axis=1), base_n, out=np.zeros(len(values)), where=base_n > 0)  # (R,)
    excess = np.maximum(values - base[:, None] * counts, 0.0)  # (R, P)
    excess[:, untouched] = 0.0
    per_member = excess / np.maximum(size, 1)[None, :]  # (R, P)
    amounts = per_member @ patterns.astype(np.float64)  # (R, C)
    total = values.sum(axis=1)  # (R,)
    rest = np.maximum(total - amounts.sum(axis=1), 0.0)
    amounts = np.concatenate([amounts, rest[:, None]], axis=1)  # (R, C + 1)
    shares = np.zeros_like(amounts)
    shares[:, -1] = 1.0
    nonzero = total > 0
    shares[nonzero] = amounts[nonzero] / amounts[nonzero].sum(axis=1, keepdims=True)
    return shares, amounts


def bootstrap_weights(n_groups: int, replicates: int, seed: int) -> np.ndarray:
    """``(replicates, n_groups)`` Poisson(1) weights: each replicate resamples the groups (responses) with
    replacement, the Poisson bootstrap (independent counts, so it needs no pass over the groups in order)."""
    rng = np.random.default_rng(seed)
    return rng.poisson(1.0, size=(replicates, n_groups)).astype(np.float64)


def pattern_sums(group: np.ndarray, pattern: np.ndarray, value: np.ndarray, n_groups: int, n_patterns: int,
                 weights: np.ndarray | None = None) -> np.ndarray:
    """``(R, P)`` sums of ``value`` ``(N,)`` per pattern, each row ``(group, pattern)`` weighted by its group's
    weight in each replicate (``weights`` ``(R, G)``; None: one replicate of weight 1)."""
    by_group = np.zeros((n_groups, n_patterns))
    np.add.at(by_group, (group, pattern), value)
    if weights is None:
        return by_group.sum(axis=0, keepdims=True)
    return weights @ by_group
