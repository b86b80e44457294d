"""Token-level divergences between the rollout policy mu and the trainer policy pi.

Everything takes log-probabilities (what engines and trainers produce) and works on any leading shape ``...``.
Low-precision inputs (bf16, fp16) are promoted to float32 before any arithmetic; float64 stays float64. Values are
safe for probabilities from 1e-12 up to 1 - 1e-7: the complements ``1 - p`` are computed as ``-expm1(log p)``,
never by subtraction, and clamped at ``EPS`` before a logarithm.

KL is always ``KL(mu || pi)``, the direction the paper uses. Memory is O(N * K): nothing here sees the vocabulary.

Precision and the bf16 band. Every divergence and ratio is computed in float32 (float64 inputs in float64), so a
bf16 input differs from its float32 source only by its own rounding: a logprob ``x`` rounded to bf16 moves by at
most ``|x| * 2**-8`` (half an ulp of an 8-bit significand). A keep-mask computed from bf16 logprobs therefore equals
the float32 mask on every token except those inside the *bf16 band*: tokens whose float32 decision quantity
(``D - delta``, ``r - (1 + eps)``, ``pi - mu``) would change sign if every input logprob moved by up to
``BF16_BAND_RTOL * |x|`` in its worst direction. ``BF16_BAND_RTOL = 2**-7`` is twice the rounding bound, leaving
room for the second-order terms. In words: a bf16 mask only disagrees with the fp32 one for tokens within about
``2**-7 * (p_pi |log p_pi| + p_mu |log p_mu|)`` (at most 0.003) of a TV threshold, and within a relative
``2**-7 * (|log pi| + |log mu|)`` of a ratio bound. ``tests/test_losses.py`` checks this band.
"""

from __future__ import annotations

from trustscope.extras import missing

try:
    import torch
    from torch import Tensor
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.divergence")

# The top-K pair in numpy, for callers without torch (the logger's writer thread).
from trustscope.divergence_np import topk_divergences_np as topk_divergences_np

EPS = 1e-12
"""Floor for probabilities that enter a logarithm (the 'other' bucket, ``1 - p``)."""

BF16_BAND_RTOL = 2.0**-7
"""Relative move of each input logprob that defines the bf16 tolerance band at a mask threshold (module docstring)."""

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped here before ``exp``, as in the authors' code (``exp(20)`` is about 4.9e8)."""


def as_compute(x: Tensor) -> Tensor:
    """``x`` in the compute dtype: float32, or float64 when it already is float64."""
    return x if x.dtype == torch.float64 else x.float()


def log_ratio(pi_logprob: Tensor, mu_logprob: Tensor) -> Tensor:
    """``log(pi / mu)`` of the sampled token. Shapes ``(...)`` -> ``(...)``."""
    return as_compute(pi_logprob) - as_compute(mu_logprob)


def ratio(pi_logprob: Tensor, mu_logprob: Tensor, max_log_ratio: float = MAX_LOG_RATIO) -> Tensor:
    """Importance ratio ``r = pi / mu``, with the log-ratio clamped at ``max_log_ratio``. ``(...)`` -> ``(...)``."""
    return torch.exp(log_ratio(pi_logprob, mu_logprob).clamp(max=max_log_ratio))


def log1mexp(logp: Tensor) -> Tensor:
    """``log(1 - exp(logp))`` for ``logp <= 0``, accurate near both ends, floored at ``log(EPS)``."""
    return torch.log((-torch.expm1(as_compute(logp))).clamp_min(EPS))


def abs_diff_exp(a: Tensor, b: Tensor) -> Tensor:
    """``|exp(a) - exp(b)|`` without cancellation: ``exp(max) * (1 - exp(-|a - b|))``. ``(...)`` -> ``(...)``.

    Plain subtraction loses every digit when both probabilities are close to 1 (1 - 1e-4 against 1 - 1e-7 in
    float32); this form keeps the relative error at a few ulps.
    """
    a, b = as_compute(a), as_compute(b)
    hi = torch.maximum(a, b)
    gap = (a - b).abs()
    out = torch.exp(hi) * -torch.expm1(-gap)
    return torch.where(gap == 0, torch.zeros_like(out), out)  # also covers a = b = -inf


def binary_tv(mu_logprob: Tensor, pi_logprob: Tensor) -> Tensor:
    """Binary TV: the vocabulary collapsed to {sampled token, rest}, which gives ``|pi - mu|``.

    ``mu_logprob``, ``pi_logprob``: ``(...)``. Returns ``(...)`` in [0, 1].
    """
    return abs_diff_exp(pi_logprob, mu_logprob)


def binary_kl(mu_logprob: Tensor, pi_logprob: Tensor) -> Tensor:
    """Binary KL(mu || pi) = ``mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi))``.

    ``mu_logprob``, ``pi_logprob``: ``(...)``. Returns ``(...)``, >= 0.
    """
    mu_lp, pi_lp = as_compute(mu_logprob), as_compute(pi_logprob)
    mu_rest_lp, pi_rest_lp = log1mexp(mu_lp), log1mexp(pi_lp)
    kl = torch.exp(mu_lp) * (mu_lp - pi_lp) + torch.exp(mu_rest_lp) * (mu_rest_lp - pi_rest_lp)
    return kl.clamp_min(0.0)


def _with_other_bucket(topk_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Probabilities ``(..., K)`` and the 'other' bucket ``(...)`` (clamped at EPS), from top-K logprobs. The bucket
    is ``1 - sum(P)``, a cancellation when the top-K holds nearly all the mass: it is taken in float64 (a float32
    sum near 1 is off by ~6e-8, which is the whole bucket when it holds 1e-7 of the mass and a 5e-4 relative error
    at 1e-4), then returned in the computation's dtype."""
    lp = as_compute(topk_logprobs)
    rest = (-torch.expm1(torch.logsumexp(lp.double(), dim=-1))).clamp_min(EPS).to(lp.dtype)
    return torch.exp(lp), rest


def _check_topk(mu_topk_logprobs: Tensor, pi_topk_logprobs: Tensor) -> None:
    if mu_topk_logprobs.shape != pi_topk_logprobs.shape:
        raise ValueError(
            f"mu_topk_logprobs and pi_topk_logprobs must have the same shape, got "
            f"{tuple(mu_topk_logprobs.shape)} and {tuple(pi_topk_logprobs.shape)}"
        )
    if mu_topk_logprobs.ndim == 0 or mu_topk_logprobs.shape[-1] < 1:
        raise ValueError(f"top-K lists need K >= 1, got shape {tuple(mu_topk_logprobs.shape)}")


def topk_tv(mu_topk_logprobs: Tensor, pi_topk_logprobs: Tensor) -> Tensor:
    """Top-K TV over mu's top-K ids plus one 'other' bucket.

    ``0.5 * (sum_i |P_i - Q_i| + |P_rest - Q_rest|)`` with P = mu, Q = pi at the same ids.
    ``mu_topk_logprobs``, ``pi_topk_logprobs``: ``(..., K)``, aligned by token id. Returns ``(...)`` in [0, 1].
    K = 1 (the sampled token alone) equals :func:`binary_tv`. ``|P_rest - Q_rest|`` is taken as
    ``|sum_i Q_i - sum_i P_i|`` from the two log-sums (each sum capped at 1), which equals the clamped form up to
    ``EPS`` and keeps its digits when both buckets are close to 1.
    """
    _check_topk(mu_topk_logprobs, pi_topk_logprobs)
    mu_lp, pi_lp = as_compute(mu_topk_logprobs), as_compute(pi_topk_logprobs)
    listed = abs_diff_exp(mu_lp, pi_lp).sum(-1)  # (...)
    # |P_rest - Q_rest| = |sum Q_i - sum P_i|: from the two log-sums, accurate even when both rests are near 1.
    mu_sum = torch.logsumexp(mu_lp, dim=-1).clamp(max=0.0)  # (...)
    pi_sum = torch.logsumexp(pi_lp, dim=-1).clamp(max=0.0)  # (...)
    rest = abs_diff_exp(mu_sum, pi_sum)
    return (0.5 * (listed + rest)).clamp(0.0, 1.0)


def topk_kl(mu_topk_logprobs: Tensor, pi_topk_logprobs: Tensor) -> Tensor:
    """Top-K KL(mu || pi) over mu's top-K ids plus one 'other' bucket.

    ``sum_i P_i log(P_i/Q_i) + P_rest log(P_rest/Q_rest)``. Shapes ``(..., K)`` -> ``(...)``, >= 0.
    K = 1 equals :func:`binary_kl`.
    """
    _check_topk(mu_topk_logprobs, pi_topk_logprobs)
    mu_lp, pi_lp = as_compute(mu_topk_logprobs), as_compute(pi_topk_logprobs)
    p, p_rest = _with_other_bucket(mu_lp)
    _, q_rest = _with_other_bucket(pi_lp)
    terms = torch.where(p > 0, p * (mu_lp - pi_lp), torch.zeros_like(p))  # (..., K): 0 log 0 = 0 for padded ids
    kl = terms.sum(-1) + p_rest * (torch.log(p_rest) - torch.log(q_rest))
    return kl.clamp_min(0.0)


def force_sampled_into_topk(
    topk_ids: Tensor, topk_logprobs: Tensor, sampled_ids: Tensor, sampled_logprobs: Tensor
) -> tuple[Tensor, Tensor]:
    """Make sure mu's top-K set holds the sampled token: where it is missing it replaces the K-th entry.

    ``topk_ids`` ``(..., K)`` int, ``topk_logprobs`` ``(..., K)`` sorted by descending probability,
    ``sampled_ids`` / ``sampled_logprobs`` ``(...)``. Returns new ``(ids, logprobs)``, both ``(..., K)``.
    """
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"topk_ids and topk_logprobs must have the same shape, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_logprobs.shape)}"
        )
    if topk_ids.shape[:-1] != sampled_ids.shape:
        raise ValueError(
            f"sampled_ids must have shape {tuple(topk_ids.shape[:-1])} (topk_ids without K), "
            f"got {tuple(sampled_ids.shape)}"
        )
    if sampled_logprobs.shape != sampled_ids.shape:
        raise ValueError(
            f"sampled_logprobs must have the shape of sampled_ids {tuple(sampled_ids.shape)}, "
            f"got {tuple(sampled_logprobs.shape)}"
        )
    if topk_ids.ndim == 0 or topk_ids.shape[-1] < 1:
        raise ValueError(f"topk_ids needs K >= 1, got shape {tuple(topk_ids.shape)}")
    present = (topk_ids == sampled_ids.unsqueeze(-1)).any(-1)  # (...)
    ids, lps = topk_ids.clone(), topk_logprobs.clone()
    ids[..., -1] = torch.where(present, ids[..., -1], sampled_ids.to(ids.dtype))
    lps[..., -1] = torch.where(present, lps[..., -1], sampled_logprobs.to(lps.dtype))
    return ids, lps


def k3_kl(mu_logprob: Tensor, pi_logprob: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(mu || pi) from one sample of mu: ``(r - 1) - log r``. ``(...)`` -> ``(...)``."""
    lr = log_ratio(pi_logprob, mu_logprob).clamp(max=MAX_LOG_RATIO)
    return torch.expm1(lr) - lr
