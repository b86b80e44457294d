"""The ``lowprob_relax`` mask family. PPO's clip relieved for low-probability tokens: each side clips only where mu
>= that side's alpha.

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``lowprob_relax_blocks.sql`` and ``lowprob_relax_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, clip_score, clip_threshold

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_lowprob_relax(t: MaskTerms, eps_low: float, eps_high: float, alpha_low: float, alpha_high: float,
                        **_: Any) -> Tensor:
    """PPO's clip on r = pi/mu, each side only where mu >= that side's alpha."""
    side = ((t.advantage > 0) & (t.mu_prob >= alpha_high)) | ((t.advantage <= 0) & (t.mu_prob >= alpha_low))
    return clip_score(t, t.ratio, eps_low, eps_high).where(side, math.nan)


def mask_ppo_lowprob_relax(t: MaskTerms, eps_low: float, eps_high: float, alpha_low: float,
                           alpha_high: float) -> Tensor:
    """PPO's clip on r = pi/mu, each side only where mu >= that side's alpha."""
    adv, r, mu = t.advantage, t.ratio, t.mu_prob
    block = ((adv > 0) & (r > 1 + eps_high) & (mu >= alpha_high)) | ((adv <= 0) & (r < 1 - eps_low) & (mu >= alpha_low))
    return ~block


LOWPROB_RELAX = SqlMask("lowprob_relax", ("ratio", "mu_prob", "advantage"),
                        ("eps_low", "eps_high", "alpha_low", "alpha_high"),
                        threshold=clip_threshold(score_lowprob_relax))

