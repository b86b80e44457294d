"""The ``ratio_clip`` mask family. PPO's ratio clip, on r = pi/mu (PPO, GRPO, dual-clip) or on pi/pi_old (MiniRL).

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``ratio_clip_blocks.sql`` and ``ratio_clip_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, clip_score, clip_threshold, ppo_keep

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_ratio_clip(t: MaskTerms, eps_low: float, eps_high: float, dual_clip: float | None = None,
                     **_: Any) -> Tensor:
    """PPO's clip on r = pi/mu; dual-clip's block (A <= 0, r > c) is at every scale."""
    score = clip_score(t, t.ratio, eps_low, eps_high)
    if dual_clip is not None:
        score = score.where(~((t.advantage <= 0) & (t.ratio > dual_clip)), math.inf)
    return score


def score_ratio_clip_old(t: MaskTerms, eps_low: float, eps_high: float, **_: Any) -> Tensor:
    """PPO's clip on pi/pi_old."""
    return clip_score(t, t.old_ratio, eps_low, eps_high)


def mask_ppo_clip(t: MaskTerms, eps_low: float, eps_high: float, dual_clip: float | None) -> Tensor:
    """PPO's clip on r = pi/mu, and dual-clip's block of A <= 0 with r > c.

    ``dual_clip`` (c > 1): dual-clip PPO also blocks negative-advantage tokens with r > c (its objective is the
    constant c * A there, so they carry no gradient). None turns it off.
    """
    keep = ppo_keep(t.ratio, t.advantage, eps_low, eps_high)  # (B, T)
    if dual_clip is not None:
        keep = keep & ~((t.advantage <= 0) & (t.ratio > dual_clip))
    return keep


def mask_minirl(t: MaskTerms, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on pi/pi_old."""
    return ppo_keep(t.old_ratio, t.advantage, eps_low, eps_high)


RATIO_CLIP_MU = SqlMask("ratio_clip", ("ratio", "advantage"), ("eps_low", "eps_high", "dual_clip"),
                        threshold=clip_threshold(score_ratio_clip))


RATIO_CLIP_OLD = SqlMask("ratio_clip", ("old_ratio", "advantage"), ("eps_low", "eps_high", None),
                         threshold=clip_threshold(score_ratio_clip_old))

