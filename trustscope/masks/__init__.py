"""The mask families: how a trust-region rule decides which tokens' gradients it blocks, one family per module.

A family is four pieces that say the same thing in torch and in SQL, kept side by side here:

- ``<family>.py``: the torch keep-mask(s) ``mask_*(terms, **params) -> (B, T) bool``, the score function(s)
  ``score_*(terms, **params)`` behind the family's scalar threshold, and the family's
  :class:`~trustscope.masks.family.SqlMask` declaration(s) (its SQL inputs, parameters and threshold);
- ``<family>_blocks.sql``: the macro ``<family>_blocks(columns..., params...)``, true where the rule would block
  the token;
- ``<family>_score.sql``: the macro ``<family>_score`` with the same arguments, the score the score function
  computes (families with a scalar threshold).

:mod:`trustscope.masks.family` holds what every family declares and shares. Rules name a family when they register
(:func:`trustscope.losses.register_loss`); the SQL catalogue (:mod:`trustscope.query.catalogue`) loads every
``*.sql`` of this folder with the other macros. Nothing here imports torch.
"""

from pathlib import Path

FAMILY_DIR = Path(__file__).resolve().parent
"""This folder: each family's module and its SQL macros."""

FAMILIES = tuple(sorted(p.stem for p in FAMILY_DIR.glob("*.py") if p.stem not in ("__init__", "family")))
"""The families that ship, by module. (``ppo_mask_blocks.sql`` and ``dppo_mask_blocks.sql`` are the SQL of
:func:`~trustscope.masks.family.ppo_keep` and :func:`~trustscope.masks.family.dppo_keep`, which several families
call.)"""
