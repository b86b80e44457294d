"""The ``seq_ratio_clip`` mask family. PPO's clip on the sequence ratio (GSPO): a whole response kept or blocked
together.

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``seq_ratio_clip_blocks.sql`` and ``seq_ratio_clip_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, clip_score, clip_threshold, ppo_keep

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


GSPO_MAX_LOG_RATIO = 10.0


def score_seq_ratio_clip(t: MaskTerms, eps_low: float, eps_high: float, **_: Any) -> Tensor:
    """PPO's clip on the sequence ratio s (GSPO)."""
    return clip_score(t, t.seq_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO).exp(), eps_low, eps_high)


def _gspo_ratio(t: MaskTerms) -> Tensor:
    """GSPO's sequence ratio s = exp(mean_t log(pi/mu)), the mean clamped at 10 first: ``(B, T)``."""
    return t.seq_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO).exp()


def mask_gspo(t: MaskTerms, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on the sequence ratio s: a whole response is kept or blocked together.

    Source: Zheng et al., Group Sequence Policy Optimization (arXiv 2507.18071), eq. 5-7 (s_i, the length-normalised
    sequence ratio); defaults eps 3e-4 / 4e-4 from its section 5.1. Reference implementation: verl
    ``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_gspo`` (the mean log-ratio clamped at 10 before exp).
    Anchored on mu here (the rollout policy, as the rest of trustscope). A whole response is blocked together:
    A > 0 with s > 1 + eps_high, A <= 0 with s < 1 - eps_low.
    """
    return ppo_keep(_gspo_ratio(t), t.advantage, eps_low, eps_high)


def weight_gspo(t: MaskTerms) -> Tensor:
    """GSPO's weight: the sequence ratio s on every token of the response."""
    return _gspo_ratio(t)


SEQ_RATIO_CLIP = SqlMask("seq_ratio_clip", ("seq_log_ratio", "advantage"), ("eps_low", "eps_high"), sequence=True,
                         threshold=clip_threshold(score_seq_ratio_clip))

