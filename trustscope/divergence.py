"""Token-level divergences between the rollout policy mu and the trainer policy pi.

Everything takes log-probabilities (what engines and trainers produce) and works on any leading shape ``...``.
Low-precision inputs (bf16, fp16) are promoted to float32 before any arithmetic; float64 stays float64. Values are
safe for probabilities from 1e-12 up to 1 - 1e-7: the complements ``1 - p`` are computed as ``-expm1(log p)``,
never by subtraction, and clamped at ``EPS`` before a logarithm.

KL is always ``KL(mu || pi)``, the direction the paper uses. Memory is O(N * K): nothing here sees the vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-12
"""Floor for probabilities that enter a logarithm (the 'other' bucket, ``1 - p``)."""

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


def binary_tv(mu_logprob: Tensor, pi_logprob: Tensor) -> Tensor:
    """Binary TV: the vocabulary collapsed to {sampled token, rest}, which gives ``|pi - mu|``.

    ``mu_logprob``, ``pi_logprob``: ``(...)``. Returns ``(...)`` in [0, 1].
    """
    return (torch.exp(as_compute(pi_logprob)) - torch.exp(as_compute(mu_logprob))).abs()


def binary_kl(mu_logprob: Tensor, pi_logprob: Tensor) -> Tensor:
    """Binary KL(mu || pi) = ``mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi))``.

    ``mu_logprob``, ``pi_logprob``: ``(...)``. Returns ``(...)``, >= 0.
    """
    mu_lp, pi_lp = as_compute(mu_logprob), as_compute(pi_logprob)
    mu_rest_lp, pi_rest_lp = log1mexp(mu_lp), log1mexp(pi_lp)
    kl = torch.exp(mu_lp) * (mu_lp - pi_lp) + torch.exp(mu_rest_lp) * (mu_rest_lp - pi_rest_lp)
    return kl.clamp_min(0.0)


def _with_other_bucket(topk_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Probabilities ``(..., K)`` and the 'other' bucket ``(...)`` (clamped at EPS), from top-K logprobs."""
    lp = as_compute(topk_logprobs)
    rest = (-torch.expm1(torch.logsumexp(lp, dim=-1))).clamp_min(EPS)
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
    K = 1 (the sampled token alone) equals :func:`binary_tv`.
    """
    _check_topk(mu_topk_logprobs, pi_topk_logprobs)
    p, p_rest = _with_other_bucket(mu_topk_logprobs)
    q, q_rest = _with_other_bucket(pi_topk_logprobs)
    return (0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())).clamp(0.0, 1.0)


def topk_kl(mu_topk_logprobs: Tensor, pi_topk_logprobs: Tensor) -> Tensor:
    """Top-K KL(mu || pi) over mu's top-K ids plus one 'other' bucket.

    ``sum_i P_i log(P_i/Q_i) + P_rest log(P_rest/Q_rest)``. Shapes ``(..., K)`` -> ``(...)``, >= 0.
    K = 1 equals :func:`binary_kl`.
    """
    _check_topk(mu_topk_logprobs, pi_topk_logprobs)
    mu_lp, pi_lp = as_compute(mu_topk_logprobs), as_compute(pi_topk_logprobs)
    p, p_rest = _with_other_bucket(mu_lp)
    _, q_rest = _with_other_bucket(pi_lp)
    kl = (p * (mu_lp - pi_lp)).sum(-1) + p_rest * (torch.log(p_rest) - torch.log(q_rest))
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
    present = (topk_ids == sampled_ids.unsqueeze(-1)).any(-1)  # (...)
    ids, lps = topk_ids.clone(), topk_logprobs.clone()
    ids[..., -1] = torch.where(present, ids[..., -1], sampled_ids.to(ids.dtype))
    lps[..., -1] = torch.where(present, lps[..., -1], sampled_logprobs.to(lps.dtype))
    return ids, lps


def k3_kl(mu_logprob: Tensor, pi_logprob: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(mu || pi) from one sample of mu: ``(r - 1) - log r``. ``(...)`` -> ``(...)``."""
    lr = log_ratio(pi_logprob, mu_logprob).clamp(max=MAX_LOG_RATIO)
    return torch.expm1(lr) - lr
