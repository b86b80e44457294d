"""The ``drpo`` mask family. DRPO: DPPO's binary-TV geometry as a smooth advantage-weighted penalty; 'blocked' where
it cancels the push.

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``drpo_blocks.sql`` and ``drpo_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, delta_threshold

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_drpo(t: MaskTerms, delta: float, **_: Any) -> Tensor:
    """DRPO: sign(A) (pi - mu) / delta (sign(A) = -1 for A <= 0)."""
    shift = t.pi_prob - t.mu_prob
    return (shift / delta).where(t.advantage > 0, -shift / delta)


def _drpo_gain(t: MaskTerms, delta: float) -> Tensor:
    """DRPO's gradient scale g = 1 - sign(A) (pi - mu) / delta, sign(A) = -1 for A <= 0: ``(B, T)``."""
    shift = t.pi_prob - t.mu_prob  # (B, T)
    sign = (t.advantage > 0).to(shift.dtype) * 2 - 1  # (B, T) +1 for A > 0, -1 for A <= 0
    return 1 - sign * shift / delta


def mask_drpo(t: MaskTerms, delta: float) -> Tensor:
    """What DRPO 'blocks': where its penalty cancelled or reversed the push, g <= 0.

    Source: Yao, Zhou, Qi et al., Rethinking the Divergence Regularization in LLM RL (DRPO, arXiv 2606.09821),
    objective Eq. 8 and weight Table 1: L = r A - |A| mu (r - 1)^2 / (2 delta); reference implementation:
    Tencent-Hunyuan UniRL ``unirl/algorithms/drpo.py``, ``_drpo_loss``. Its gradient is the policy gradient scaled
    by g = 1 - sign(A) (pi - mu) / delta: g = 1 on the anchor, 0 on the DPPO boundary in the harmful direction,
    negative (corrective) beyond it, above 1 when pi moved back toward mu; bounded by 1 +- 1/delta since
    |pi - mu| <= 1 (sign(A) = -1 for A <= 0). Implemented as w = (pi/mu) * g on every valid token. The default
    delta is DPPO's binary-TV threshold, the geometry DRPO keeps (UniRL's 4B recipe sets its epsilon to 12.5,
    where g stays within 1 +- 0.08 and nothing ever counts as blocked).

    No hard mask gates the loss. What "blocked" means for DRPO, here and in the SQL views: the penalty has
    cancelled or reversed the push, g <= 0, i.e. A > 0 with pi - mu >= delta or A <= 0 with mu - pi >= delta.
    ``keep`` reports g > 0; blocked tokens still get their (corrective) gradient.
    """
    return _drpo_gain(t, delta) > 0


def weight_drpo(t: MaskTerms, delta: float) -> Tensor:
    """DRPO's weight on every valid token: pi/mu times its gradient scale g."""
    return t.ratio * _drpo_gain(t, delta)


DRPO_PENALTY = SqlMask("drpo", ("pi_prob", "mu_prob", "advantage"), ("delta",),
                       threshold=delta_threshold(score_drpo, inclusive=True))

