"""The ``ratio_band`` mask family. A kept band of token ratios r = pi/mu (token-level MIS, IcePop).

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``ratio_band_blocks.sql`` and ``ratio_band_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, band_score, band_threshold

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_ratio_band(t: MaskTerms, low: float, high: float, **_: Any) -> Tensor:
    """The token's ratio band."""
    return band_score(t.ratio.log(), low, high)


def mask_ratio_band(t: MaskTerms, low: float, high: float) -> Tensor:
    """Keep low <= r <= high, r = pi/mu.

    Token-level masked IS (MIS) source: verl ``verl/trainer/ppo/rollout_corr_helper.py``,
    ``compute_rollout_rejection_mask`` with ``rollout_rs="token_k1"`` and a ``"lower_upper"`` threshold (here on
    r = pi/mu; the weight stays pi/mu on the kept tokens, bypass mode).
    """
    return (t.ratio >= low) & (t.ratio <= high)


RATIO_BAND = SqlMask("ratio_band", ("ratio",), ("low", "high"), threshold=band_threshold(score_ratio_band))

