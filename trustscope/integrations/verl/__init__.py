"""verl: trustscope's rules as verl policy losses, and per-token logging of a verl run.

Select a rule (any name of :func:`trustscope.losses.list_losses` whose inputs verl has, prefixed ``trustscope_``)::

    python -m verl.trainer.main_ppo ... actor_rollout_ref.actor.policy_loss.loss_mode=trustscope_dppo_binary_tv \\
        actor_rollout_ref.rollout.calculate_log_probs=True

Installing trustscope registers the rules in verl's own policy-loss registry
(``verl.trainer.ppo.core_algos.register_policy_loss``) through verl's plugin entry point (group ``verl.plugins``),
which verl loads on ``import verl`` in the driver and in every Ray worker. Log a run from the driver::

    from trustscope.integrations.verl import attach

    trainer.init_workers()
    with attach(trainer, "logs"):   # run.json, samples and verl's actor metrics here; token rows from the actors
        trainer.fit()

verl's V1 trainer (``trainer.use_v1=True``, verl 0.9.1's default) is attached the same way after ``trainer.init()``,
around ``trainer.fit(agent_loop_manager)``: its batch lives in TransferQueue, and :class:`VerlV1Logging` reads the
driver's rows from there and writes the sample ids back as two more columns of the same rows.

Which verl tensor is what. verl 0.9.1 hands a policy loss ``old_log_prob`` (pi_old, the actor's recompute; it *is*
``rollout_log_probs`` when ``algorithm.rollout_correction.bypass_mode=True``) but not ``rollout_log_probs``.
A trustscope rule takes mu = ``rollout_log_probs`` when :func:`attach` runs (its actor hook reads them from the
micro-batch), else mu = ``old_log_prob``; pi_old (``PolicyBatch.old_logprob``, the decoupled rules' anchor) is
always ``old_log_prob``. verl's ``rollout_is_weights`` (pi_old / mu, its own rollout correction) multiply the
per-token loss as in verl's built-in losses only when mu is ``old_log_prob``: with mu = ``rollout_log_probs`` the
rule's weight pi / mu already corrects for the rollout. The loss is reduced with verl's own ``agg_loss`` and
``loss_agg_mode`` over verl's global batch, so micro-batch losses add up to the mini-batch loss as verl expects.
Rules on mu's top-K (``dppo_topk_*``) are not registered: verl keeps no top-K of the rollout distribution.

The package, one idea a module: :mod:`~trustscope.integrations.verl.versions` (the releases and the loop attach
reads), :mod:`~trustscope.integrations.verl.losses` (the rules as verl loss modes), :mod:`~trustscope.integrations.
verl.masks` (replays of verl's own masks), :mod:`~trustscope.integrations.verl.driver` (the stamps and ``samples``
rows), :mod:`~trustscope.integrations.verl.rollout` (the rejection mask kept), :mod:`~trustscope.integrations.verl.
layout` and :mod:`~trustscope.integrations.verl.actor` (the actors' hook), :mod:`~trustscope.integrations.verl.
attach` (the driver's handle).

How a run is written (one run directory, read as one run, passing ``trustscope validate``):

- rank 0 is verl's driver: ``run.json`` (verl's config, loss rule, mu source, ``source={"framework": "verl"}``),
  the vocab, one ``samples`` row per response (prompt id from verl's ``uid``, reward, sequence advantage, length,
  texts) and verl's actor metrics as ``steps`` scalars.
- the actors of data-parallel rank r are rank r + 1: one process per replica (Ulysses sequence rank 0 under
  FSDP; tensor and context rank 0 on the last pipeline stage under Megatron, :func:`actor_layout`) writes the
  ``tokens`` rows of the samples the replica trains on: pi (the loss's own log-probs), the mask the rule applied (with verl's own ``vanilla``, ``dppo_tv`` or
  ``dppo_kl`` loss a replay of theirs, :data:`VERL_MASKS`), entropy (when verl computes it:
  ``actor.calculate_entropy=True`` or an entropy coefficient), and, from the driver batch that verl ships inside
  every micro-batch, ``responses``, ``rollout_log_probs`` as mu, ``old_log_probs`` as pi_old and ``advantages``.
  Writing these driver tensors beside pi keeps one row per token: no half-rows to join later.
- the join key is the sample id: before verl splits the batch, the driver stamps two ``(B,)`` tensor columns into
  it (``trustscope_sample_id``: the row's index in the step, counted over the step's calls;
  ``trustscope_prompt_id``) and the step and the call's updates into ``meta_info``. Tensor columns travel with their rows through dispatch, shuffling, mini- and micro-batching and
  dynamic batch sizes, so each actor row finds its ``samples`` row by ``(step, sample_id)``.
- several updates a step: verl's V1 ``PPOTrainer.step`` calls ``_update_actor`` ``parameter_sync_step`` times
  under one global step, and each call makes ``ppo_epochs`` x mini-batches optimizer updates. Every update's
  tokens are logged once, with ``update_index`` (the update of the step, from 0: call x epoch x mini-batch); the
  sample ids of a step's later calls follow its earlier calls', so every token row joins its own ``samples`` row.
  A response trained again in a later epoch must have the same tokens and mask (else the call is refused naming
  the step, the update and the field). Each actor process keeps one logger for the whole run; once it has logged
  its share of a call it asks the logger's writer thread to commit it
  (:meth:`~trustscope.logger.TokenLogger.commit_step`), so the actor never waits on Parquet, fsync or the manifest.
  Neither does the driver: a step's summaries reach verl's metrics at a later update, once every actor committed
  it (``trustscope/step`` names it). :meth:`VerlLogging.close` closes the actors' loggers (:class:`FinishActors`),
  and an actor that exits after a whole call closes its logger ``finished``.
- rollout correction (``algorithm.rollout_correction``): verl overwrites ``response_mask`` with its rejection mask
  (``rollout_rs``) before the update; every token of the response is logged all the same, ``kept`` False and
  ``rollout_rejected`` True on the rejected ones, and ``is_weight`` holds verl's ``rollout_is_weights`` where the
  loss applied them (:mod:`trustscope.integrations.verl.rollout`).
- ``attach(..., resume=True)`` continues the run after verl's own resume (``trainer.resume_mode``): at the first
  actor update the run is cut back, on every rank, to the step before ``trainer.global_steps`` (the checkpoint
  verl restored), so the steps a crash logged past the checkpoint are logged once (:meth:`VerlLogging.resume_at`);
  a rank log ending before the checkpoint is a logging incident (a warning, a ``trustscope/incidents/...`` step
  scalar, a ``trustscope validate`` finding), never a stop.

Mixture-of-experts runs with rollout routing replay (R3: ``actor_rollout_ref.rollout.enable_rollout_routing_replay``
with ``router_replay.mode=R3``): the engine's routed experts travel in the batch as ``routed_experts``, one row per
position fed over the whole sequence (verl's agent loop writes them from the left-padded prompt's first real token
on, ``(B, prompt + response, MoE layers, top-k)`` int16, zeros where the engine recorded none), made unpadded like
``input_ids`` before the update. Each actor logs the rows that predict its response tokens (verl's own
``no_padding_2_padding``, the shift the log-probs get) as ``engine_experts``, the run declared with
``routing_shape`` from the model's config (or ``attach(..., routing_shape=...)``). The trainer's side is not logged:
under R3 the actor's routers run with the replayed experts (verl patches Megatron's and VeOmni's routers), so their
own top-k is not computed.

Asynchronous and multi-turn runs: each token's ``turn`` is read off the response mask (verl's agent loop masks
the tool's and environment's tokens out: a new model turn starts after each gap, :func:`trustscope.columns.turns_from_mask`). On the
V1 trainer each response's ``policy_version`` is the weight version it started under, from the trajectory's
``min_global_steps`` tag (+ 1: verl's weights at ``global_steps`` s are version s - 1), so ``staleness`` reads as
verl's ``training/off_policy/trajectory_staleness_worst``, and ``policy_version_last`` the last, from
``max_global_steps``: verl keeps a trajectory's first and last version, not each token's. verl's own ``training/off_policy/*`` metrics at the actor update are kept as ``steps`` scalars.

The log directory must be reachable from every worker (a shared filesystem on several nodes). A parallel layout
other than :data:`SUPPORTED_LAYOUTS` is refused by :func:`attach` (from verl's config) and by every actor at its
first micro-batch (from its process groups), before anything is logged.
"""

from __future__ import annotations

from trustscope.extras import missing

try:
    import torch  # noqa: F401
except ModuleNotFoundError as exc:  # a reader's install: the [verl] extra brings torch and verl
    missing(exc, "trustscope.integrations.verl", extra="verl")

import importlib.util

from trustscope.integrations.verl.actor import ActorLogHook, FinishActors, VerlUpdateMismatch
from trustscope.integrations.verl.attach import VerlLogging, VerlV1Logging, attach, r3_routing_shape
from trustscope.integrations.verl.driver import (
    BATCH_SIZE_KEY,
    KEPT_SCALARS,
    PROMPT_KEY,
    REJECTED_KEY,
    SAMPLE_KEY,
    STEP_KEY,
    UPDATE_BASE_KEY,
    UPDATES_KEY,
    VERSION_KEY,
    VERSION_LAST_KEY,
    actor_scalars,
    log_driver_batch,
    read_v1_batch,
    tag_versions,
    unstamp_batch,
    updates_of_call,
)
from trustscope.integrations.verl.layout import (
    SUPPORTED_LAYOUTS,
    ActorLayout,
    VerlLayoutError,
    actor_layout,
    check_actor_config,
)
from trustscope.integrations.verl.losses import (
    LOSS_PREFIX,
    make_policy_loss,
    register_policy_losses,
    rule_of_loss_mode,
    verl_loss_mode,
    verl_rules,
)
from trustscope.integrations.verl.masks import VERL_MASKS, dppo_kl_keep, dppo_tv_keep, vanilla_keep
from trustscope.integrations.verl.versions import SUPPORTED_VERL, VerlVersionError, check_loop, verl_version

__all__ = [
    "BATCH_SIZE_KEY", "KEPT_SCALARS", "LOSS_PREFIX", "PROMPT_KEY", "REJECTED_KEY", "SAMPLE_KEY",
    "STEP_KEY", "SUPPORTED_LAYOUTS", "SUPPORTED_VERL", "UPDATES_KEY", "UPDATE_BASE_KEY", "VERL_MASKS", "VERSION_KEY",
    "VERSION_LAST_KEY", "ActorLayout", "ActorLogHook", "FinishActors", "VerlLayoutError", "VerlLogging",
    "VerlUpdateMismatch", "VerlV1Logging", "VerlVersionError", "actor_layout", "actor_scalars", "attach",
    "check_actor_config", "check_loop", "dppo_kl_keep", "dppo_tv_keep", "log_driver_batch", "make_policy_loss",
    "r3_routing_shape", "read_v1_batch", "register_policy_losses", "rule_of_loss_mode", "tag_versions",
    "unstamp_batch", "updates_of_call", "vanilla_keep", "verl_loss_mode", "verl_rules", "verl_version",
]

if importlib.util.find_spec("verl") is not None:
    register_policy_losses()
