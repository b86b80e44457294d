"""The ``negative_mask`` mask family. Mask-delta: block only negative-advantage tokens that pi pushed down from mu
by at least delta.

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``negative_mask_blocks.sql`` and ``negative_mask_score.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trustscope.masks.family import SqlMask, delta_threshold

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def score_negative_mask(t: MaskTerms, delta: float, **_: Any) -> Tensor:
    """Mask-delta: (mu - pi) / delta on A <= 0 tokens."""
    return ((t.mu_prob - t.pi_prob) / delta).where(t.advantage <= 0, math.nan)


def mask_minimal_negative(t: MaskTerms, delta: float) -> Tensor:
    """Block A <= 0 where mu - pi >= delta."""
    return ~((t.advantage <= 0) & (t.mu_prob - t.pi_prob >= delta))


NEGATIVE_MASK = SqlMask("negative_mask", ("mu_prob", "pi_prob", "advantage"), ("delta",),
                        threshold=delta_threshold(score_negative_mask, inclusive=True))

