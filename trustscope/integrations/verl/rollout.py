"""Rollout correction seen whole: the tokens verl's rollout rejection sampling takes out of the loss stay logged.

verl's ``compute_rollout_correction_and_add_to_batch`` (``verl/trainer/ppo/rollout_corr_helper.py``) overwrites
``response_mask`` with the rejection mask before the actor update (``algorithm.rollout_correction.rollout_rs``), so
the actors no longer see which tokens the response had. :class:`RejectionMask` wraps that function on the driver,
where both of verl's trainers call it (the V0 trainer imports it from its module at each step, the V1 trainer holds
its own name for it): the tokens the rejection took out, ``before & ~after`` ``(B, T)``, travel beside the batch's
rows as :data:`~trustscope.integrations.verl.driver.REJECTED_KEY` (a column of the V0 ``DataProto``; on the V1
trainer one more TransferQueue field of the same rows). Each actor then logs every token of the response
(``response_mask | rejected``), ``kept`` the mask its loss applied, ``rollout_rejected`` the rejection mask, and
``turn`` from the response's own structure.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from trustscope.integrations.verl.driver import REJECTED_KEY

HELPER = "verl.trainer.ppo.rollout_corr_helper"
V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
FUNCTION = "compute_rollout_correction_and_add_to_batch"


class RejectionMask:
    """Installed by :func:`~trustscope.integrations.verl.attach` while a run with rollout correction is logged;
    :meth:`remove` restores verl's function and the trainer's ``_compute_advantage``."""

    def __init__(self, trainer: Any, v1: bool):
        from trustscope.integrations.verl.versions import need

        self.trainer, self.v1 = trainer, v1
        self._patched: list[tuple[Any, Any]] = []
        self._pending: torch.Tensor | None = None  # V1: (B, T) rejected, until _compute_advantage puts it
        for name in (HELPER, V1_TRAINER) if v1 else (HELPER,):
            original = need(name, FUNCTION)
            module = importlib.import_module(name)
            setattr(module, FUNCTION, self._wrap(original))
            self._patched.append((module, original))
        if v1:
            self._compute_advantage = trainer._compute_advantage
            trainer._compute_advantage = self.compute_advantage

    def _wrap(self, original: Any) -> Any:
        def compute_rollout_correction_and_add_to_batch(batch: Any, rollout_corr_config: Any) -> Any:
            before = batch.batch["response_mask"].bool().clone()  # (B, T)
            batch, metrics = original(batch, rollout_corr_config)
            rejected = before & ~batch.batch["response_mask"].bool()  # (B, T)
            if self.v1:
                self._pending = rejected
            else:
                batch.batch[REJECTED_KEY] = rejected
            return batch, metrics

        compute_rollout_correction_and_add_to_batch.__wrapped__ = original  # type: ignore[attr-defined]
        return compute_rollout_correction_and_add_to_batch

    def compute_advantage(self, batch: Any, metrics: dict) -> Any:
        """verl V1's ``_compute_advantage``, then the rejected tokens written to TransferQueue beside the rows'
        other per-token fields (nested, one length per response, as verl writes its own)."""
        import transfer_queue as tq
        from tensordict import TensorDict

        from trustscope.integrations.verl.versions import need

        response_to_nested = need("verl.workers.utils.padding", "response_to_nested")
        lengths = tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id,
                                  select_fields=["response_mask"])["response_mask"]  # nested: the responses' lengths
        self._pending = None
        out = self._compute_advantage(batch, metrics)
        if self._pending is not None:
            nested = response_to_nested(self._pending, lengths)
            out = tq.kv_batch_put(keys=list(out.keys), partition_id=out.partition_id,
                                  fields=TensorDict({REJECTED_KEY: nested}, batch_size=[len(out.keys)]))
            self._pending = None
        return out

    def remove(self) -> None:
        for module, original in self._patched:
            setattr(module, FUNCTION, original)
        self._patched = []
        if self.v1:
            self.trainer.__dict__.pop("_compute_advantage", None)
