"""The ``dppo`` mask family. DPPO's divergence trust region (PAPER.md): block where D(anchor, pi) > delta and pi
moved the way A pushes.

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``dppo_blocks.sql`` and ``dppo_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, delta_threshold, divergence_term, dppo_keep, harmful

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_dppo(t: MaskTerms, divergence: str, delta: float, **_: Any) -> Tensor:
    """DPPO anchored on mu: D / delta where pi moved the harmful way."""
    return (divergence_term(t, divergence) / delta).where(harmful(t, t.mu_logprob), math.nan)


def score_dppo_old(t: MaskTerms, divergence: str, delta: float, **_: Any) -> Tensor:
    """DPPO anchored on pi_old: D(pi_old, pi) / delta where pi moved the harmful way from pi_old."""
    return (divergence_term(t, divergence, "old") / delta).where(harmful(t, t.old_logprob), math.nan)


def mask_dppo(t: MaskTerms, divergence: str, delta: float) -> Tensor:
    """DPPO's mask on D(mu, pi) with mu as the anchor: block a token only when D(mu, pi) > delta and pi moved past
    mu the way A pushes."""
    return dppo_keep(divergence_term(t, divergence), t.pi_logprob, t.mu_logprob, t.advantage, delta)


def mask_dppo_decoupled(t: MaskTerms, divergence: str, delta: float) -> Tensor:
    """DPPO's mask with the divergence and the anchor taken against pi_old."""
    return dppo_keep(divergence_term(t, divergence, "old"), t.pi_logprob, t.old_logprob, t.advantage, delta)


DPPO_MU = SqlMask("dppo", ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "pi_logprob", "mu_logprob", "advantage"),
                  ("divergence", "delta"), threshold=delta_threshold(score_dppo))


DPPO_OLD = SqlMask("dppo", ("old_binary_tv", "old_binary_kl", None, None, "pi_logprob", "old_logprob", "advantage"),
                   ("divergence", "delta"), threshold=delta_threshold(score_dppo_old))

