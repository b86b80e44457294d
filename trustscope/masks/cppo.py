"""The ``cppo`` mask family. CPPO: DPPO's mask with a position-weighted threshold and a cumulative prefix budget.

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``cppo_blocks.sql`` and ``cppo_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, delta_threshold, harmful

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_cppo(t: MaskTerms, delta: float, w_min: float, delta_b: float, **_: Any) -> Tensor:
    """CPPO: z = w D against min(delta, delta + b W - S) = delta + min(0, b W - S), so the scale is
    (z - min(0, b W - S)) / delta where pi moved the harmful way (``w_min`` and ``delta_b`` stay)."""
    valid = t.valid
    div = t.binary_tv  # (B, T)
    pos = (valid.cumsum(-1) - 1).clamp_min(0).to(div.dtype)  # (B, T)
    last = (valid.sum(-1, keepdim=True) - 1).to(div.dtype)  # (B, 1)
    w = (w_min + (1 - w_min) * (last - pos) / last.clamp_min(1)).where(valid, 0.0)  # (B, T)
    z = (w * div).where(valid, 0.0)  # (B, T)
    spent, weight = z.cumsum(-1) - z, w.cumsum(-1) - w
    budget = div.where(valid, math.nan).nanquantile(0.9, dim=-1, keepdim=True).clamp(min=delta_b, max=2 * delta_b)
    slack = (budget * weight - spent).clamp(max=0)  # (B, T) min(0, b W - S)
    return ((z - slack) / delta).where(harmful(t, t.mu_logprob), math.nan)


def mask_cppo(t: MaskTerms, delta: float, w_min: float, delta_b: float) -> Tensor:
    """CPPO's mask: the position-weighted binary TV against a threshold with the response's prefix budget.

    Source: Mao, Zhou, Tao et al., Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning (CPPO,
    arXiv 2606.10968), mask Eq. 8-11 and the dynamic budget Eq. 22; reference implementation: Tencent-Hunyuan UniRL
    ``unirl/algorithms/cppo.py``, ``_cppo_mask`` (as its ``CPPO/README.md`` states it), which ships the binary-TV
    variant, as here: D = |pi - mu|. For a response of L tokens, position s = 0 .. L-1: w_s = w_min + (1 - w_min)
    (L - 1 - s) / max(L - 1, 1), Z_s = w_s D_s, prefix sums S = sum_{j<s} Z_j and W = sum_{j<s} w_j, the
    response's budget b = clamp(P90(D), delta_b, 2 delta_b), threshold c_s = min(delta, delta + b W - S). A token
    is blocked when pi moved the way A pushes (DPPO's direction test, A = 0 in the negative branch) and Z_s > c_s.
    Defaults: the paper's dense-model delta 0.15, w_min 0.8, delta_b 0.02.
    """
    valid = t.valid
    div = t.binary_tv  # (B, T)
    pos = (valid.cumsum(-1) - 1).clamp_min(0).to(div.dtype)  # (B, T) position among the valid tokens
    last = (valid.sum(-1, keepdim=True) - 1).to(div.dtype)  # (B, 1) L - 1
    w = (w_min + (1 - w_min) * (last - pos) / last.clamp_min(1)).where(valid, 0.0)  # (B, T)
    z = (w * div).where(valid, 0.0)  # (B, T)
    spent = z.cumsum(-1) - z  # (B, T) S: weighted divergence of the prefix before the token
    weight = w.cumsum(-1) - w  # (B, T) W
    p90 = div.where(valid, math.nan).nanquantile(0.9, dim=-1, keepdim=True)  # (B, 1)
    budget = p90.clamp(min=delta_b, max=2 * delta_b)
    threshold = (delta + budget * weight - spent).clamp(max=delta)  # (B, T) min(delta, delta + b W - S)
    adv, pi_lp, mu_lp = t.advantage, t.pi_logprob, t.mu_logprob
    harmful = ((adv > 0) & (pi_lp > mu_lp)) | ((adv <= 0) & (pi_lp < mu_lp))
    return ~(harmful & (z > threshold))


CPPO_PREFIX = SqlMask("cppo", ("seq_pos", "seq_len", "binary_tv", "seq_p90_binary_tv", "prefix_binary_tv",
                               "prefix_pos_binary_tv", "pi_logprob", "mu_logprob", "advantage"),
                      ("delta", "w_min", "delta_b"), sequence=True, threshold=delta_threshold(score_cppo))

