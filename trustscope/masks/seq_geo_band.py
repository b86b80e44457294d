"""The ``seq_geo_band`` mask family. A kept band of the response's geometric-mean ratio (verl's seq_mean_k1
rejection).

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``seq_geo_band_blocks.sql`` and ``seq_geo_band_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, band_score, band_threshold

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_seq_geo_band(t: MaskTerms, low: float, high: float, **_: Any) -> Tensor:
    """The response's geometric-mean ratio band."""
    return band_score(t.seq_log_ratio, low, high)


def mask_geo_band(t: MaskTerms, low: float, high: float) -> Tensor:
    """Keep a response while its geometric-mean ratio exp(mean_t log(pi/mu)) stays in [low, high].

    Source: verl ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask`` option
    ``seq_mean_k1`` (preset ``RolloutCorrectionConfig.decoupled_geo_rs``, bounds ``"0.999_1.001"``); verl bounds
    the mean of log(mu/pi), here its reciprocal, the geometric mean of r = pi/mu. Weight pi/mu per token.
    """
    g = t.seq_log_ratio.exp()  # (B, T)
    return (g >= low) & (g <= high)


SEQ_GEO_BAND = SqlMask("seq_geo_band", ("seq_log_ratio",), ("low", "high"), sequence=True,
                       threshold=band_threshold(score_seq_geo_band))

