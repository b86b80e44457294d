"""The ``none`` mask family. No trust region: the family of the rules that block nothing (PG-IS, CISPO, token-level
TIS).

Its torch side here: the keep-mask(s) and the score(s) (:class:`~trustscope.masks.family.Threshold`); its SQL side
beside this module: ``none_blocks.sql``. The rules that use it are registered in
:mod:`trustscope.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trustscope.masks.family import SqlMask

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms


def mask_pg_is(t: MaskTerms) -> Tensor:
    """No trust region: every token kept."""
    return t.valid.new_ones(t.valid.shape)


NO_MASK = SqlMask("none")

