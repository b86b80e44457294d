"""Log a run of TRL's ``GRPOTrainer`` with trustscope: two lines of user code.

    from trustscope.integrations.trl import attach
    attach(trainer, "logs")        # after building the trainer, before trainer.train()
    trainer.train()

Written and tested against TRL 1.16.0 (the ``[trl]`` extra pins it). Per optimizer step (``step`` is TRL's
``state.global_step`` before the update; micro-batches of one step share it) and per rank it logs:

- **tokens**: the completion tokens TRL's loss covers, ``completion_mask * tool_mask`` (padding and tool results are
  left out; ``pos`` is the column in TRL's completion tensor), each with
  - ``mu_logprob``: the engine's log-prob of the sampled token when TRL has one (vLLM's ``sampling_per_token_logps``,
    or a ``rollout_func``'s ``logprobs``): ``mu_source = "engine"``. TRL's transformers path keeps none; mu is then
    TRL's ``old_per_token_logps`` (the trainer's recompute at the rollout's weights) when TRL computed them, else pi
    itself, and ``run.json`` records ``mu_source = "trainer_recompute"``: mismatch (mu against pi_old) reads zero
    there, and attach warns. Tokens whose mu or pi is NaN (vLLM could not score them) are left out of the log and
    counted in the ``trustscope/unscored_tokens`` scalar; training is never interrupted for them.
  - ``pi_logprob`` and ``entropy``: from the loss's own forward (TRL's fused LM head, at TRL's temperature); no
    second forward is run for them.
  - ``old_logprob``: TRL's ``old_per_token_logps`` when it computed them; ``advantage``: TRL's.
  - ``kept``: the mask TRL's loss applied, from its settings (:func:`trl_kept`: the clip region of ``epsilon_low``
    / ``epsilon_high`` / ``delta`` for the clipped loss types, and the off-policy, high-entropy and vLLM
    importance-sampling masks when they are on). Tokens with A = 0 are kept, as TRL counts them, so
    ``1 - mean(kept)`` over a step's tokens is TRL's ``clip_ratio/region_mean`` when only the clip is on (and one
    micro-batch makes the step: with gradient accumulation TRL averages the micro-batches' ratios).
- **samples**: a sample id stable over the iterations that reuse a rollout, the prompt group, TRL's weighted reward
  (``sum_i w_i r_i``, the figure TRL logs as ``reward``), the sequence's advantage, prompt and completion text and
  finish reason (``stop`` when the completion ends in an EOS token, else ``length``).
- **steps**: every number TRL logs, as ``trl/<name>``, at the step it describes.
- **run.json**: TRL's loss and sampling settings (``config["trl"]``, :func:`trl_settings`), ``loss_rule =
  "trl:<loss_type>"``, ``mu_source``, ``source = {"framework": "trl", "version": trl.__version__}``, the sampler's
  temperature under ``sampling``.

Top-K (``topk=K``). On the vLLM path attach asks the engine for K log-probs per token (``VLLMGeneration.logprobs``)
and keeps their ids, handing TRL the sampled token's log-prob first as it expects. On the transformers path there
is no engine distribution, so ``topk=K`` needs ``topk_forward=True``: one extra no-grad forward right after each
rollout gives the trainer's own top-K at the rollout's weights; it stands in for mu's top-K (a recompute, like mu
on that path: top-K TV measures how far pi moved since the rollout, not training-inference mismatch). Either way
pi's log-probs at those ids come from the loss's own forward, though TRL's fused LM head makes no logits: a forward
hook on the model's backbone keeps its last hidden states (the head's input), and
:func:`~trustscope.capture.logprobs_from_hidden` scores the K ids with the head's K rows and the log-normaliser
recovered from TRL's log-prob of the sampled token (``log Z = z_token - log pi(token)``): ``O(B T K H)`` work, no
further forward, no ``(B, T, V)`` tensor. Without ``topk`` nothing is recomputed.

How it hooks in. TRL's callbacks mark step boundaries (used for the scalars and to close the log) but no public
hook sees a batch's tokens or the loss's log-probs, so :class:`~trustscope.integrations.trl.hooks._Hooks` wraps four methods of this one trainer
instance (never the class), and for top-K on vLLM its engine's ``generate``; each wrapper calls TRL's method
unchanged and reads its inputs or outputs (only the engine's log-prob lists are reordered). attach first
checks that every method, parameter and attribute this relies on exists (:func:`check_trainer`) and raises
:class:`TRLVersionError` naming the TRL version and what is missing; tests/test_integration_trl.py pins the logged
values against TRL's own, so a TRL upgrade that changes them fails in CI rather than in a user's run.

``RLOOTrainer`` does not share this code path in TRL 1.16 (its loss is sequence-level on ``old_logps`` and it keeps
no per-token rollout log-probs), so attach refuses it.

The package, one idea a module: :mod:`~trustscope.integrations.trl.versions` (the supported releases and the
internals probed), :mod:`~trustscope.integrations.trl.settings` (TRL's settings and the mask its loss applied),
:mod:`~trustscope.integrations.trl.engine` (the engine's log-prob lists and multi-turn engine calls),
:mod:`~trustscope.integrations.trl.hooks` (the wrappers on the trainer's methods) and
:mod:`~trustscope.integrations.trl.attach` (:func:`attach` and the :class:`Attachment` it returns).
"""

from __future__ import annotations

from trustscope.extras import missing

try:
    import torch  # noqa: F401
except ModuleNotFoundError as exc:  # a reader's install: the [trl] extra brings torch and trl
    missing(exc, "trustscope.integrations.trl", extra="trl")

from trustscope.integrations.trl.attach import Attachment, attach
from trustscope.integrations.trl.engine import EngineCall, engine_rows, split_engine_logprobs
from trustscope.integrations.trl.settings import trl_kept, trl_settings
from trustscope.integrations.trl.versions import (
    CLIPPED_LOSS_TYPES,
    SUPPORTED_TRL,
    TESTED_TRL,
    UNMASKED_LOSS_TYPES,
    TRLVersionError,
    check_trainer,
)

__all__ = ["CLIPPED_LOSS_TYPES", "SUPPORTED_TRL", "TESTED_TRL", "UNMASKED_LOSS_TYPES", "Attachment", "EngineCall",
           "TRLVersionError", "attach", "check_trainer", "engine_rows", "split_engine_logprobs", "trl_kept",
           "trl_settings"]
