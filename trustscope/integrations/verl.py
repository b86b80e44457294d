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
  it (``trustscope_sample_id``: the row index in the step's batch; ``trustscope_prompt_id``) and the step into
  ``meta_info``. Tensor columns travel with their rows through dispatch, shuffling, mini- and micro-batching and
  dynamic batch sizes, so each actor row finds its ``samples`` row by ``(step, sample_id)``.
- with ``ppo_epochs > 1`` a sample is trained on several times a step; its first pass is logged (pi then is the
  log-prob after the optimizer steps of the earlier mini-batches of that step). Each actor process keeps one
  logger for the whole run; once it has logged all of its samples of a step (batch size / data-parallel size) it
  asks the logger's writer thread to commit them (:meth:`~trustscope.logger.TokenLogger.commit_step`), so the
  actor's step never waits on Parquet, fsync or the manifest. The driver waits for the actors' commits before it
  reads the step's summaries and before verl saves a checkpoint; :meth:`VerlLogging.close` closes the actors'
  loggers (:class:`FinishActors`), and an actor that exits after a whole step closes its logger ``finished``.
- ``attach(..., resume=True)`` continues the run after verl's own resume (``trainer.resume_mode``): at the first
  actor update the run is cut back, on every rank, to the step before ``trainer.global_steps`` (the checkpoint
  verl restored), so the steps a crash logged past the checkpoint are logged once (:meth:`VerlLogging.resume_at`).

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
verl's ``training/off_policy/trajectory_staleness_worst``; verl keeps a trajectory's first and last version, not
each token's. verl's own ``training/off_policy/*`` metrics at the actor update are kept as ``steps`` scalars.

The log directory must be reachable from every worker (a shared filesystem on several nodes). A parallel layout
other than :data:`SUPPORTED_LAYOUTS` is refused by :func:`attach` (from verl's config) and by every actor at its
first micro-batch (from its process groups), before anything is logged.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from trustscope.extras import missing, release_position

try:
    import torch
    from torch import Tensor
except ModuleNotFoundError as exc:  # a reader's install: the [verl] extra brings torch and verl
    missing(exc, "trustscope.integrations.verl", extra="verl")

from trustscope import losses as L
from trustscope.columns import turns_from_mask
from trustscope.logger import TokenLogger

SUPPORTED_VERL = ">=0.8,<0.10"
"""The verl releases this module supports (the ``[verl]`` extra's range; docs/verl.md has the table). Within it each
internal is probed where it is used (:class:`VerlVersionError` names a missing one), never the version string."""

LOSS_PREFIX = "trustscope_"
STEP_KEY = "trustscope_step"
BATCH_SIZE_KEY = "trustscope_batch_size"
SAMPLE_KEY = "trustscope_sample_id"
PROMPT_KEY = "trustscope_prompt_id"
VERSION_KEY = "trustscope_policy_version"
KEPT_SCALARS = ("actor/", "training/off_policy/")
"""The V1 trainer's step metrics kept as ``steps`` scalars at the actor update: verl's actor metrics and its own
off-policy (staleness, evicted samples) figures."""
_TOPK_FIELDS = frozenset({"mu_topk_logprobs", "pi_topk_logprobs"})


class VerlVersionError(RuntimeError):
    """The installed verl lacks a module or attribute this integration relies on (its internals moved)."""


# ------------------------------------------------------------------------------------------------ verl internals


def verl_version() -> str:
    """The installed verl's version; an ImportError that says how to install it when verl is absent."""
    try:
        import verl
    except ImportError as err:
        raise ImportError(f"trustscope.integrations.verl needs verl ({err}); install it with "
                          f"pip install 'trustscope[verl]' (verl{SUPPORTED_VERL})") from err
    return str(getattr(verl, "__version__", "unknown"))


def _need(module_name: str, attr: str) -> Any:
    """``module_name.attr`` from verl, or a :class:`VerlVersionError` naming the version and what is missing."""
    version = verl_version()
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise VerlVersionError(f"verl {version}: module {module_name} cannot be imported ({err}); "
                               f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}") from err
    if not hasattr(module, attr):
        raise VerlVersionError(f"verl {version}: {module_name}.{attr} is missing; "
                               f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}")
    return getattr(module, attr)


_CORE = "verl.trainer.ppo.core_algos"


def _check_release(version: str) -> None:
    """A :class:`VerlVersionError` for a verl older than :data:`SUPPORTED_VERL`, a warning for a newer one."""
    position = release_position(version, SUPPORTED_VERL)
    if position == 0:
        return
    if position < 0:
        raise VerlVersionError(f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}; the installed verl "
                               f"{version} is older: pip install 'trustscope[verl]' (or 'verl{SUPPORTED_VERL}')")
    warnings.warn(f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}, this is verl {version}: its "
                  f"internals are checked as they are used, but check the log against verl's own metrics",
                  stacklevel=3)


def _require_attrs(obj: Any, what: str, attrs: tuple[str, ...]) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise VerlVersionError(f"verl {verl_version()}: {what} has no {', '.join(missing)}; "
                               f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}")


# ---------------------------------------------------------------------------------------------------- the losses


@dataclass
class _ActorCall:
    """What the actor hook shares with a trustscope policy loss during one micro-batch (same process, same stack).

    Attributes:
        mu: ``(B, T)`` the micro-batch's ``rollout_log_probs``, or None when the batch has none.
        keep: ``(B, T)`` bool, filled in by the rule: the mask it applied.
    """

    mu: Tensor | None
    keep: Tensor | None = None


_ACTOR_CALL: contextvars.ContextVar[_ActorCall | None] = contextvars.ContextVar("trustscope_verl_call", default=None)


def verl_loss_mode(rule: str) -> str:
    """verl's ``policy_loss.loss_mode`` for trustscope rule ``rule``: ``trustscope_<rule>``."""
    return f"{LOSS_PREFIX}{rule}"


def rule_of_loss_mode(loss_mode: str) -> str | None:
    """The trustscope rule behind verl loss mode ``loss_mode``, or None for verl's own losses."""
    if not loss_mode.startswith(LOSS_PREFIX):
        return None
    rule = loss_mode.removeprefix(LOSS_PREFIX)
    L.get_loss(rule)  # an unknown name fails with the list of valid names
    return rule


def verl_rules() -> list[str]:
    """The trustscope rules verl can run: every registered rule that needs no top-K of mu."""
    return [name for name in L.list_losses() if not (L.get_loss(name).needs & _TOPK_FIELDS)]


def _batch_info(config: Any) -> dict[str, Any]:
    """verl's global-batch normalisers (dp_size, batch_num_tokens, ...) that its actor puts on the config."""
    if config is None:
        return {}
    info = config.get("global_batch_info", None) if hasattr(config, "get") else getattr(config, "global_batch_info", None)
    return dict(info or {})


def _masked_frac(x: Tensor, valid: Tensor) -> float:
    return float((x & valid).sum()) / max(int(valid.sum()), 1)


def make_policy_loss(rule_name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """trustscope rule ``rule_name`` as a verl ``PolicyLossFn`` (verl 0.9.1's signature and return value).

    The returned function takes ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
    rollout_is_weights)``, all ``(B, T)``, and returns ``(pg_loss, metrics)``: the scalar loss reduced by verl's
    ``agg_loss`` and verl's three policy metrics as floats (``actor/pg_clipfrac``: blocked fraction of valid
    tokens; ``actor/pg_clipfrac_lower``: the blocked negative-advantage tokens' share of valid tokens;
    ``actor/ppo_kl``: mean ``old_log_prob - log_prob``), plus the rule's own as ``actor/trustscope/...``.
    """
    rule = L.get_loss(rule_name)
    agg_loss = _need(_CORE, "agg_loss")

    def policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                    loss_agg_mode: str = "token-mean", config: Any = None,
                    rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        call = _ACTOR_CALL.get()
        mu_is_old = call is None or call.mu is None
        mu = old_log_prob if mu_is_old else call.mu  # (B, T)
        valid = response_mask.bool()  # (B, T)
        # with the hook on, the logger summarises the logged rows exactly on its writer thread: the rule's own
        # statistics (blocked fractions by sign, mismatch, k3 KL, IS weight) are not computed again here
        out = rule(L.PolicyBatch(pi_logprob=log_prob, mu_logprob=mu.detach(), advantages=advantages.detach(),
                                 mask=valid, old_logprob=old_log_prob.detach()), metrics=call is None)
        per_token = out.loss  # (B, T), zero on padding and blocked tokens
        if rollout_is_weights is not None and mu_is_old:
            per_token = per_token * rollout_is_weights.detach()
        pg_loss = agg_loss(loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                           **_batch_info(config))
        if call is not None:
            call.keep = out.keep.detach()
        with torch.no_grad():
            blocked = valid & ~out.keep
            log_ratio = torch.clamp(log_prob.detach() - old_log_prob.detach(), -20.0, 20.0)
            n = max(int(valid.sum()), 1)
            metrics = {
                "actor/pg_clipfrac": _masked_frac(blocked, valid),
                "actor/ppo_kl": float(torch.where(valid, -log_ratio, torch.zeros_like(log_ratio)).sum()) / n,
                "actor/pg_clipfrac_lower": _masked_frac(blocked & (advantages < 0), valid),
            }
            metrics.update({f"actor/trustscope/{k.removeprefix('policy/')}": float(v) for k, v in out.metrics.items()})
        return pg_loss, metrics

    policy_loss.__name__ = f"trustscope_{rule_name}_policy_loss"
    policy_loss.__doc__ = f"trustscope rule {rule_name!r} as a verl policy loss: {rule.doc}"
    return policy_loss


def register_policy_losses() -> list[str]:
    """Register every rule of :func:`verl_rules` in verl's policy-loss registry; returns the verl loss modes.

    Idempotent: call it again after registering a rule of your own to make it a verl loss mode too. Run on
    import of this module, which verl's plugin entry point (``verl.plugins``) triggers in every verl process.
    """
    register = _need(_CORE, "register_policy_loss")
    _need(_CORE, "get_policy_loss_fn")
    modes = []
    for name in verl_rules():
        mode = verl_loss_mode(name)
        register(mode)(make_policy_loss(name))
        modes.append(mode)
    return modes


# -------------------------------------------------------------------------------- masks of verl's own loss modes


def _clip_bounds(config: Any) -> tuple[float, float]:
    """verl's (low, high) clip settings: ``clip_ratio_low`` / ``clip_ratio_high``, each defaulting to ``clip_ratio``."""
    low, high = config.get("clip_ratio_low", None), config.get("clip_ratio_high", None)
    base = config.get("clip_ratio", 0.2)
    return float(base if low is None else low), float(base if high is None else high)


def vanilla_keep(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, config: Any) -> Tensor:
    """Where verl's ``vanilla`` (PPO, dual-clip) loss keeps a gradient. ``(B, T)`` -> ``(B, T)`` bool.

    Zero gradient where the clipped term wins (A > 0 with r > 1 + high, A < 0 with r < 1 - low) and, dual-clip, where
    A < 0 and the clipped objective passes ``clip_ratio_c`` (its loss is the constant ``-A * c`` there).
    """
    low, high = _clip_bounds(config)
    c = float(config.get("clip_ratio_c", 3.0))
    r = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))  # (B, T), verl's clamped ratio
    clipped = ((advantages > 0) & (r > 1 + high)) | ((advantages < 0) & (r < 1 - low))
    dual = (advantages < 0) & (torch.maximum(r, r.clamp(1 - low, 1 + high)) > c)
    return ~(clipped | dual)


def dppo_tv_keep(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, config: Any) -> Tensor:
    """Where verl's ``dppo_tv`` keeps a gradient: A > 0 needs p - p_old <= high, A <= 0 needs p - p_old >= -low."""
    low, high = _clip_bounds(config)
    diff = torch.exp(log_prob) - torch.exp(old_log_prob)  # (B, T)
    return torch.where(advantages > 0, diff <= high, diff >= -low)


def dppo_kl_keep(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, config: Any) -> Tensor:
    """Where verl's ``dppo_kl`` keeps a gradient: binary KL(p_old || p) within the bound, or p moved against A."""
    low, high = _clip_bounds(config)
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return torch.where(advantages > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))


VERL_MASKS: dict[str, Callable[[Tensor, Tensor, Tensor, Any], Tensor]] = {
    "vanilla": vanilla_keep,
    "dppo_tv": dppo_tv_keep,
    "dppo_kl": dppo_kl_keep,
}
"""The applied mask of verl's own mask-based loss modes, replayed from pi, pi_old, A and verl's clip settings."""


# ------------------------------------------------------------------------------------------------ the driver side


def _prompt_ids(uids: Any, n: int) -> Tensor:
    """``(B,)`` int64 prompt ids: a stable 63-bit hash of verl's per-prompt ``uid`` (the row index without one)."""
    if uids is None:
        return torch.arange(n, dtype=torch.int64)
    ids = [int.from_bytes(hashlib.blake2b(str(u).encode(), digest_size=8).digest(), "little") >> 1 for u in uids]
    return torch.tensor(ids, dtype=torch.int64)


def _id_rows(ids: Tensor, mask: Tensor) -> list[Any]:
    """``(B, L)`` ids -> B arrays of the ids where ``mask`` is set (one transfer to the CPU)."""
    ids_np, mask_np = ids.cpu().numpy(), mask.bool().cpu().numpy()
    return [row[m] for row, m in zip(ids_np, mask_np, strict=True)]


def tag_versions(tags: Any, n: int) -> Tensor | None:
    """``(B,)`` int64 ``policy_version`` of each response from verl V1's trajectory tags: ``min_global_steps``
    (the weights it started under) + 1, in trustscope's (and verl's) step numbering; None when the tags lack it."""
    if not tags or len(tags) != n:
        return None
    firsts = [tag.get("min_global_steps") if isinstance(tag, Mapping) else None for tag in tags]
    if any(not isinstance(v, numbers.Integral) for v in firsts):
        return None
    return torch.tensor([int(v) + 1 for v in firsts], dtype=torch.int64)


def log_driver_batch(logger: TokenLogger, batch: Any, step: int, tokenizer: Any = None) -> None:
    """Stamp the sample and prompt ids and the step into verl ``DataProto`` ``batch``; log one ``samples`` row each.

    ``batch`` is the driver's batch as it goes into the actor update: ``responses`` and ``response_mask``
    ``(B, T)``, optionally ``advantages`` and ``token_level_scores`` ``(B, T)``, ``prompts`` and
    ``attention_mask``, and ``uid`` in ``non_tensor_batch``. Adds ``trustscope_sample_id`` /
    ``trustscope_prompt_id`` ``(B,)`` to ``batch.batch`` and ``trustscope_step`` / ``trustscope_batch_size`` to
    ``batch.meta_info``; :func:`unstamp_batch` removes them.
    """
    tensors = batch.batch
    for key in ("responses", "response_mask"):
        if key not in tensors:
            raise KeyError(f"verl batch has no {key!r} (keys: {sorted(tensors.keys())}); is it the actor-update batch?")
    mask = tensors["response_mask"].bool()  # (B, T)
    n = mask.shape[0]
    sample_id = torch.arange(n, dtype=torch.int64)  # (B,)
    prompt_id = _prompt_ids(batch.non_tensor_batch.get("uid"), n)  # (B,)
    tensors[SAMPLE_KEY] = sample_id
    tensors[PROMPT_KEY] = prompt_id
    batch.meta_info[STEP_KEY] = int(step)
    batch.meta_info[BATCH_SIZE_KEY] = n
    samples: dict[str, Any] = {"sample_id": sample_id, "prompt_id": prompt_id, "length": mask.sum(-1)}
    lengths = mask.sum(-1).clamp_min(1)
    if "advantages" in tensors:
        adv = tensors["advantages"].float()
        samples["advantage"] = torch.where(mask, adv, torch.zeros_like(adv)).sum(-1) / lengths  # (B,)
    for key in ("token_level_scores", "token_level_rewards"):
        if key in tensors:
            samples["reward"] = torch.where(mask, tensors[key].float(), torch.zeros_like(tensors[key].float())).sum(-1)
            break
    if tokenizer is not None:  # token ids: the logger's writer thread decodes its text_fraction sample
        samples["response_token_ids"] = _id_rows(tensors["responses"], mask)
        if "prompts" in tensors and "attention_mask" in tensors:
            prompts = tensors["prompts"]
            samples["prompt_token_ids"] = _id_rows(prompts, tensors["attention_mask"][:, : prompts.shape[1]])
    logger.log_step(int(step), samples=samples)


def unstamp_batch(batch: Any) -> None:
    """Remove what :func:`log_driver_batch` added to ``batch``."""
    for key in (SAMPLE_KEY, PROMPT_KEY):
        if key in batch.batch:
            del batch.batch[key]
    for key in (STEP_KEY, BATCH_SIZE_KEY):
        batch.meta_info.pop(key, None)


def actor_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's actor metrics (a number or a list per micro-batch each) as one float per name (lists: their mean)."""
    out = {}
    for name, value in metrics.items():
        values = value if isinstance(value, list | tuple) else [value]
        floats = [float(v) for v in values if isinstance(v, numbers.Real) or (isinstance(v, Tensor) and v.numel() == 1)]
        if floats and len(floats) == len(values):
            out[name] = sum(floats) / len(floats)
    return out


# ------------------------------------------------------------------------------------------------- the actor side


SUPPORTED_LAYOUTS = ("FSDP (fsdp, fsdp2) with data parallelism and Ulysses sequence parallelism; Megatron with data, "
                     "tensor, pipeline and context parallelism (not dynamic context parallelism)")
"""The actor layouts :func:`actor_layout` maps (named in the error of any other)."""


class VerlLayoutError(NotImplementedError):
    """verl's actors run in a parallel layout whose ranks trustscope cannot map to data-parallel replicas."""


@dataclass(frozen=True)
class ActorLayout:
    """Where one actor process sits in verl's parallel layout, read from verl's own process groups.

    Attributes:
        dp_rank: its data-parallel rank (trustscope logs it as rank ``dp_rank + 1``).
        dp_size: the number of data-parallel replicas.
        logs: True on the one rank per replica that holds the replica's gathered rows: Ulysses sequence rank 0
            (FSDP), or tensor rank 0 and context rank 0 on the last pipeline stage (Megatron).
        name: the layout in words, e.g. ``FSDP: 2 data x 2 Ulysses sequence``.
    """

    dp_rank: int
    dp_size: int
    logs: bool
    name: str


def _megatron_state() -> Any:
    """Megatron's ``parallel_state`` (verl's ``mpu``) when this process initialised it, else None."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    return mpu


def actor_layout(dp_group: Any = None) -> ActorLayout:
    """This actor's :class:`ActorLayout`, from the data-parallel group verl's engine hands its loss function.

    verl's FSDP engine passes the ``dp`` dimension of its ``(dp, sp)`` device mesh and sets its Ulysses group
    (``verl.utils.ulysses.get_ulysses_sequence_parallel_group``) while it trains; the sequence ranks of a replica
    get the same rows and, after the gather of the outputs, the same log-probs. verl's Megatron engine passes
    ``mpu.get_data_parallel_group()``; tensor and context ranks hold the same gathered outputs and only the last
    pipeline stage computes the loss. Without torch.distributed each process is its own replica (rank from
    ``RANK``). Raises :class:`VerlLayoutError` when the world is not data x (sequence | tensor x pipeline x
    context), naming the layout and :data:`SUPPORTED_LAYOUTS`.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return ActorLayout(int(os.environ.get("RANK", "0")), 1, True, "one process per data-parallel rank")
    world = dist.get_world_size()
    dp_size, dp_rank = dist.get_world_size(group=dp_group), dist.get_rank(group=dp_group)
    mpu = _megatron_state()
    if mpu is not None:
        sizes = {"tensor": mpu.get_tensor_model_parallel_world_size(),
                 "pipeline": mpu.get_pipeline_model_parallel_world_size(),
                 "context": mpu.get_context_parallel_world_size()}
        name = f"Megatron: {dp_size} data x " + " x ".join(f"{n} {k}" for k, n in sizes.items())
        mpu_dp = mpu.get_data_parallel_group()
        if dp_group is not None and dist.get_process_group_ranks(dp_group) != dist.get_process_group_ranks(mpu_dp):
            raise VerlLayoutError(f"verl actor layout {name}: the loss's data-parallel group is not Megatron's "
                                  f"(dynamic context parallelism?); trustscope maps {SUPPORTED_LAYOUTS}")
        if world != dp_size * math.prod(sizes.values()):
            raise VerlLayoutError(f"verl actor layout {name} does not make up its world of {world} ranks; "
                                  f"trustscope maps {SUPPORTED_LAYOUTS}")
        logs = (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
                and mpu.is_pipeline_last_stage(ignore_virtual=True))
        return ActorLayout(dp_rank, dp_size, logs, name)
    ulysses = importlib.import_module("verl.utils.ulysses")
    sp_size, sp_rank = ulysses.get_ulysses_sequence_parallel_world_size(), ulysses.get_ulysses_sequence_parallel_rank()
    name = f"FSDP: {dp_size} data x {sp_size} Ulysses sequence"
    if world != dp_size * sp_size:
        raise VerlLayoutError(
            f"verl actor layout {name} does not make up its world of {world} ranks (ranks in groups trustscope "
            f"cannot see: tensor or pipeline parallelism outside Megatron's parallel state?), so rows would be "
            f"logged more than once or not at all; trustscope maps {SUPPORTED_LAYOUTS}")
    return ActorLayout(dp_rank, dp_size, sp_rank == 0, name)


def check_actor_config(actor_cfg: Any) -> str:
    """The actor layout verl's config asks for, in words; :class:`VerlLayoutError` for one trustscope cannot map
    (a strategy other than FSDP or Megatron with model parallelism, Megatron's dynamic context parallelism).
    :func:`attach` calls it; every actor checks its real groups again at its first micro-batch."""
    strategy = str(actor_cfg.get("strategy", "fsdp"))
    if strategy in ("fsdp", "fsdp2"):
        sp = int(actor_cfg.get("ulysses_sequence_parallel_size", 1) or 1)
        return f"{strategy}: data x {sp} Ulysses sequence"
    block = actor_cfg.get(strategy, None) or {}
    sizes = {k: v for k, v in block.items() if k.endswith("parallel_size") and isinstance(v, int) and v > 1}
    if strategy == "megatron":
        if block.get("dynamic_context_parallel", False):
            raise VerlLayoutError(f"verl actor strategy megatron with dynamic_context_parallel=True: trustscope "
                                  f"maps {SUPPORTED_LAYOUTS}")
        return f"megatron: data x {sizes or 'no model parallelism'}"
    if sizes:
        raise VerlLayoutError(f"verl actor strategy {strategy} with {sizes}: trustscope maps {SUPPORTED_LAYOUTS}; "
                              f"run {strategy} without model parallelism, or with FSDP or Megatron")
    return f"{strategy}: data parallel"


class ActorLogHook:
    """verl actor loss function: verl's ``ppo_loss`` with trustscope's mu provision and token logging around it.

    verl calls it as ``loss_fn(model_output=..., data=micro_batch, dp_group=...)`` (its engines' ``forward_step``).
    A micro-batch without the driver's step stamp (another caller of the loss) passes straight through. Sent to the
    actors by :func:`attach` through verl's ``set_loss_fn``; it is pickled, and each process opens its own logger.
    ``kept`` is the trustscope rule's mask; with verl's own loss it is ``mask_fn(log_prob, old_log_prob,
    advantages)`` (a replay, :data:`VERL_MASKS`), or True everywhere without one.
    """

    def __init__(self, inner: Callable[..., Any], logdir: str | os.PathLike, run_id: str, *, loss_rule: str,
                 log_old_logprob: bool = True, mask_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                 logger_options: Mapping[str, Any] | None = None):
        self.inner = inner
        self.mask_fn = mask_fn
        self.logdir = str(logdir)
        self.run_id = run_id
        self.loss_rule = loss_rule
        self.log_old_logprob = log_old_logprob
        self.logger_options = dict(logger_options or {})
        self._reset()

    def _reset(self) -> None:
        self._logger: TokenLogger | None = None
        self._step: int | None = None
        self._seen: set[int] = set()
        self._opened = False
        self._share_done = True  # this rank's share of the open step is all logged (and committed)
        self._layout: ActorLayout | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_logger", "_step", "_seen", "_opened", "_share_done", "_layout"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __call__(self, model_output: Mapping[str, Any], data: Any, dp_group: Any = None) -> Any:
        get = _need("verl.utils.tensordict_utils", "get_non_tensor_data")
        step = get(data=data, key=STEP_KEY, default=None)
        if step is None:
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)
        layout = self._layout_of(dp_group)
        fields = ["responses", "response_mask", "old_log_probs", "advantages", SAMPLE_KEY, PROMPT_KEY]
        missing = [f for f in fields if f not in data]
        if missing:
            raise KeyError(f"verl micro-batch of step {step} has no {missing}; the driver stamps {SAMPLE_KEY} and "
                           f"{PROMPT_KEY} (trustscope.integrations.verl.attach)")
        fields += [f for f in ("rollout_log_probs", VERSION_KEY) if f in data]
        cols = data.select(*fields).to_padded_tensor()
        call = _ActorCall(mu=cols.get("rollout_log_probs", None))
        token = _ACTOR_CALL.set(call)
        try:
            result = self.inner(model_output=model_output, data=data, dp_group=dp_group)
        finally:
            _ACTOR_CALL.reset(token)
        if layout.logs:  # one rank per data-parallel replica holds its gathered rows
            with torch.no_grad():
                self._log(int(step), model_output, data, cols, call.keep, layout.dp_rank + 1)
        return result

    def _layout_of(self, dp_group: Any) -> ActorLayout:
        """This process's :class:`ActorLayout`, read at its first micro-batch (before anything is logged)."""
        if self._layout is None:
            self._layout = actor_layout(dp_group)
        return self._layout

    def _log(self, step: int, model_output: Mapping[str, Any], data: Any, cols: Any, keep: Tensor | None,
             rank: int) -> None:
        no_padding_2_padding = _need("verl.workers.utils.padding", "no_padding_2_padding")
        get = _need("verl.utils.tensordict_utils", "get_non_tensor_data")
        if step != self._step:
            if self._logger is not None and not self._share_done:
                self._logger.commit_step()  # a share smaller than announced: the step ends here
            self._step, self._seen, self._share_done = step, set(), False
        sample_id = cols[SAMPLE_KEY].cpu()  # (B,)
        new = [i for i, s in enumerate(sample_id.tolist()) if s not in self._seen]
        if not new:
            return
        idx = torch.tensor(new, dtype=torch.int64, device=cols[SAMPLE_KEY].device)  # (B',) rows not logged yet
        mask = cols["response_mask"].bool()  # (B, T)
        pi = no_padding_2_padding(model_output["log_probs"], data).detach()  # (B, T)
        old = cols["old_log_probs"]  # (B, T)
        columns = {
            "token_id": cols["responses"],
            "mu_logprob": cols.get("rollout_log_probs", old),
            "pi_logprob": pi,
            "advantage": cols["advantages"],
            "kept": self._kept(keep, pi, old, cols["advantages"], mask),
            "sample_id": sample_id.to(idx.device),
            "prompt_id": cols[PROMPT_KEY],
            "turn": torch.from_numpy(turns_from_mask(mask.cpu().numpy())).to(idx.device),
        }
        if VERSION_KEY in cols:
            columns["policy_version"] = cols[VERSION_KEY]
        routed = data.get("routed_experts", None) if self.logger_options.get("routing_shape") else None
        if routed is not None and routed.is_nested:  # R3: the engine's experts of every position fed
            columns["engine_experts"] = no_padding_2_padding(routed, data).to(torch.int16)  # (B, T, L, k)
        if self.log_old_logprob:
            columns["old_logprob"] = old
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            columns["entropy"] = no_padding_2_padding(entropy, data).detach()
        # index_select, not boolean indexing: measured 0.02 ms against ~30 ms on (8, 1024) CPU tensors
        tokens = {name: value.index_select(0, idx) for name, value in columns.items()}
        mask = mask.index_select(0, idx)
        if self._logger is None:
            self._open(rank)
        self._logger.log_step(step, tokens=tokens, mask=mask)
        self._seen.update(tokens["sample_id"].tolist())
        dp_size = int(get(data=data, key="dp_size", default=1) or 1)
        if len(self._seen) >= int(get(data=data, key=BATCH_SIZE_KEY, default=math.inf)) // dp_size:
            self._logger.commit_step()  # this rank's share of the step is in; its writer thread commits it
            self._share_done = True

    def _open(self, rank: int) -> None:
        """This process's logger of the run (``rank``: trustscope's rank, the data-parallel rank + 1), opened at its
        first logged micro-batch and kept for the whole run (one per process: a hook unpickled again finds it); closed by :meth:`close`, by the :class:`FinishActors`
        that :meth:`VerlLogging.close` sends, or at exit."""
        key = (self.logdir, self.run_id)
        logger = _ACTOR_LOGGERS.get(key)
        if logger is None or logger._closed:
            logger = TokenLogger(self.logdir, self.run_id, rank=rank, resume=True,
                                 loss_rule=self.loss_rule, **self.logger_options)
            _ACTOR_LOGGERS[key] = logger
            atexit.register(_close_actor_logger, key, self)
        self._logger = logger
        self._opened = True

    def _kept(self, keep: Tensor | None, pi: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        if keep is not None:
            return keep
        if self.mask_fn is not None:
            return self.mask_fn(pi, old, adv) & mask
        return mask

    def close(self) -> None:
        """Close this process's logger of the run (``finished``), if it opened one. Safe to call twice."""
        logger = _ACTOR_LOGGERS.pop((self.logdir, self.run_id), None)
        if logger is not None:
            logger.close()
        self._logger = None


_ACTOR_LOGGERS: dict[tuple[str, str], TokenLogger] = {}
"""This process's actor loggers, by (logdir, run id): one per rank for the whole run."""


def _close_actor_logger(key: tuple[str, str], hook: ActorLogHook) -> None:
    """At exit: a rank whose last step was all logged (and so committed) ends ``finished``; one that stopped
    inside a step is left to the logger's own exit hook, which records it ``crashed``."""
    logger = _ACTOR_LOGGERS.get(key)
    if logger is not None and hook._share_done and not logger._closed:
        with contextlib.suppress(Exception):  # nothing left to report to at exit
            _ACTOR_LOGGERS.pop(key, None)
            logger.close()


class FinishActors:
    """verl's loss again (``inner``), sent by :meth:`VerlLogging.close` through ``set_loss_fn``: where it is
    built or unpickled (the driver, each actor process) it closes that process's logger of the run."""

    def __init__(self, inner: Callable[..., Any], logdir: str, run_id: str):
        self.inner, self.logdir, self.run_id = inner, logdir, run_id
        self._finish()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finish()

    def _finish(self) -> None:
        logger = _ACTOR_LOGGERS.pop((self.logdir, self.run_id), None)
        if logger is not None:
            logger.close()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------- attaching


def _to_plain(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that only resolves inside verl's workers
        return OmegaConf.to_container(cfg, resolve=False)


class VerlLogging:
    """What :func:`attach` set up: the driver's logger and the actor hook. :meth:`close` at the end of training."""

    def __init__(self, trainer: Any, logger: TokenLogger, hook: ActorLogHook, update_actor: Callable[..., Any],
                 reporter: Any = None, alerts: Any = None, resume: bool = False, actor_wait_s: float = 60.0):
        self.trainer = trainer
        self.logger = logger
        self.hook = hook
        self._update_actor = update_actor
        self.reporter = reporter
        """Adds the step's summaries to verl's step metrics (None: ``metrics=False``)."""
        self.alerts = alerts
        self._resume_pending = resume
        """Cut the run back to the step verl restored, at the first actor update (:meth:`resume_at`)."""
        self.actor_wait_s = actor_wait_s
        """How long the driver waits for the actors' commit of a step (before its metrics and a checkpoint)."""
        self._save_checkpoint = getattr(trainer, "_save_checkpoint", None)
        if self._save_checkpoint is not None:
            trainer._save_checkpoint = self.save_checkpoint

    def resume_at(self, step: int) -> int:
        """The run resumes at ``step`` (verl restored its checkpoint of ``step - 1``, or started over at step 1):
        every rank's rows after ``step - 1`` go (the driver's through its open logger, the actors' before their
        loggers open), so the resumed steps are logged once. A rank whose log ends before the checkpoint, or a
        run of another schema version, is refused naming the run, the rank and the steps. Returns the files
        removed."""
        from trustscope.logger import drop_steps_after

        self._resume_pending = False
        kept = step - 1 if step > 1 else -1  # verl counts steps from 1
        removed = self.logger.cut_back(kept)
        return removed + drop_steps_after(self.logger.run_dir, kept, ranks=range(1, 2**31), resume=True,
                                          storage_options=self.hook.logger_options.get("storage_options"))

    def wait_actors(self, step: int) -> bool:
        """Wait (up to :attr:`actor_wait_s`) until every actor rank of the run has committed ``step``; False
        (with a warning) if one has not. Local or shared log directories only (object storage: no wait)."""
        from trustscope.logger.runfiles import effective_status, read_json
        from trustscope.schema import publishing_files

        run_dir = self.logger.run_dir
        if not isinstance(run_dir, os.PathLike):
            return True
        deadline = time.monotonic() + self.actor_wait_s
        while True:  # every logging actor wrote its manifest when it opened its logger, inside the update
            paths = sorted((run_dir / "ranks").glob("rank*.json"))
            lagging = []
            for path in paths:
                try:
                    manifest = read_json(path)
                except Exception:  # a manifest being replaced: read it again
                    lagging.append(path.stem)
                    continue
                last = manifest.get("last_step")
                landing = [f for f in publishing_files(manifest) if not (run_dir / f).exists()]
                if effective_status(manifest) == "running" and (last is None or last < step or landing):
                    # ranks an earlier session left (closed or dead) are not waited on; a commit whose files are
                    # still being renamed into place is not readable yet
                    lagging.append(path.stem)
            if not lagging:
                return True
            if time.monotonic() > deadline:
                warnings.warn(f"trustscope: actor ranks {lagging or 'not yet opened'} have not committed step "
                              f"{step} after {self.actor_wait_s:.0f} s", stacklevel=3)
                return False
            time.sleep(0.02)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """verl's ``_save_checkpoint`` once the log holds the step it saves (driver flushed, actors committed),
        so a resume from it finds every step up to it logged (installed by attach)."""
        self.logger.flush()
        self.wait_actors(int(self.trainer.global_steps))
        return self._save_checkpoint(*args, **kwargs)

    @property
    def run_id(self) -> str:
        return self.logger.run_id

    def update_actor(self, batch: Any) -> Any:
        """The trainer's ``_update_actor`` with the driver batch logged and stamped first (installed by attach)."""
        step = int(self.trainer.global_steps)
        if self._resume_pending:
            self.resume_at(step)
        log_driver_batch(self.logger, batch, step, getattr(self.trainer, "tokenizer", None))
        try:
            output = self._update_actor(batch)
        finally:
            unstamp_batch(batch)
        scalars = actor_scalars(output.meta_info.get("metrics", {}))
        if scalars:
            self.logger.log_step(step, scalars=scalars)
        self.logger.commit_step()
        if self.reporter is not None:
            self._add_step_metrics(output, step)
        return output

    def _add_step_metrics(self, output: Any, step: int) -> None:
        """The step's exact summaries from every actor's committed files (an actor's writer thread commits its
        share of the step once it is logged; the driver waits for that, :meth:`wait_actors`), as ``trustscope/...``
        metrics in the actor output's metrics, which verl's ``reduce_metrics`` passes to its ``Tracking``
        logger (``trainer.logger``). Never raises into training."""
        from trustscope.trackers import committed_step_rows

        self.wait_actors(step)  # the actors commit on their writer threads
        try:
            rows = committed_step_rows(self.logger.run_dir, step, ranks=None)
            metrics = self.reporter.from_rows(rows, step)
        except Exception as err:  # the metrics must never stop the training
            warnings.warn(f"trustscope: step {step}'s summaries could not be added to verl's metrics: {err!r}",
                          stacklevel=3)
            return
        if metrics:
            output.meta_info.setdefault("metrics", {}).update(metrics)

    def _detach(self) -> None:
        """Restore the trainer's methods and verl's loss in the actors, which closes their loggers."""
        self.trainer.__dict__.pop("_update_actor", None)
        self.trainer.__dict__.pop("_save_checkpoint", None)
        self.trainer.actor_rollout_wg.set_loss_fn(FinishActors(self.hook.inner, self.hook.logdir, self.hook.run_id))

    def close(self) -> None:
        """Restore the trainer's ``_update_actor``, close the actors' loggers (:class:`FinishActors`) and the
        driver's."""
        try:
            self._detach()
        finally:
            if self.alerts is not None:
                self.alerts.close()
            self.logger.close()

    def __enter__(self) -> VerlLogging:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self._detach()
            finally:
                if self.alerts is not None:
                    self.alerts.close()
                self.logger.close(status="crashed", error=f"{exc_type.__name__}: {exc}")


class _DriverBatch:
    """The driver batch as :func:`log_driver_batch` reads it (``batch``, ``non_tensor_batch``, ``meta_info``),
    built from what verl's V1 trainer keeps in TransferQueue; the stamps it adds land here too."""

    def __init__(self, tensors: dict[str, Tensor], uids: list[str]):
        self.batch, self.non_tensor_batch, self.meta_info = tensors, {"uid": uids}, {}


_V1_DRIVER_FIELDS = ("responses", "response_mask", "advantages", "token_level_scores", "token_level_rewards",
                     "prompts")


def _padded(t: Tensor) -> tuple[Tensor, Tensor]:
    """A TransferQueue column ``(B, ...)``: nested (one length per sample) or dense -> ``(B, L)`` right-padded
    with 0, and ``(B, L)`` bool of the real entries."""
    if not t.is_nested:
        return t, torch.ones(t.shape[:2], dtype=torch.bool, device=t.device)
    lengths = torch.tensor([len(row) for row in t.unbind()], device=t.device)  # (B,)
    dense = torch.nested.to_padded_tensor(t, 0.0)
    return dense, torch.arange(dense.shape[1], device=t.device) < lengths[:, None]


def read_v1_batch(batch: Any) -> _DriverBatch:
    """What verl's V1 trainer keeps of ``batch`` (a TransferQueue ``KVBatchMeta``) for the ``samples`` rows:
    responses, their mask, advantages, rewards and prompts, padded; the prompt group from the sample key
    (verl names a trajectory ``{uid}_{session}_{index}``)."""
    import transfer_queue as tq

    have = set(batch.fields or [])
    missing = [f for f in ("responses", "response_mask") if f not in have]
    if missing:
        raise KeyError(f"verl V1 batch (TransferQueue partition {batch.partition_id!r}) has no {missing}; fields: "
                       f"{sorted(have)}; is it the actor-update batch?")
    fields = [f for f in _V1_DRIVER_FIELDS if f in have]
    data = tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id, select_fields=fields)
    tensors = {f: _padded(data[f])[0] for f in fields}
    if "prompts" in tensors:  # right-padded here; log_driver_batch reads the prompt's mask from attention_mask
        tensors["attention_mask"] = _padded(data["prompts"])[1].long()
    return _DriverBatch(tensors, [str(k).split("_", 1)[0] for k in batch.keys])


class VerlV1Logging(VerlLogging):
    """:func:`attach` on verl's V1 trainer (``trainer.use_v1=True``, verl 0.9.1's default), whose
    ``_update_actor(batch, metrics)`` gets a TransferQueue ``KVBatchMeta``: the rows live in TransferQueue and
    the actors fetch them there. The driver reads the rows' responses and rewards from TransferQueue for the
    ``samples`` table, writes the sample and prompt ids into TransferQueue as two more columns of the same rows
    (so each actor's micro-batch carries them, as the V0 trainer's batch does) and the step into the batch's
    ``extra_info`` (verl hands it to the actors as non-tensor data); the actors' hook is the same."""

    def update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:  # type: ignore[override]
        """The trainer's ``_update_actor`` with the batch logged and stamped first (installed by attach)."""
        import transfer_queue as tq
        from tensordict import TensorDict

        step = int(self.trainer.global_steps)
        if self._resume_pending:
            self.resume_at(step)
        view = read_v1_batch(batch)
        log_driver_batch(self.logger, view, step, getattr(self.trainer, "tokenizer", None))
        versions = tag_versions(getattr(batch, "tags", None), len(batch.keys))
        if versions is not None:
            view.batch[VERSION_KEY] = versions
        keys = [k for k in (SAMPLE_KEY, PROMPT_KEY, VERSION_KEY) if k in view.batch]
        stamps = TensorDict({k: view.batch[k] for k in keys}, batch_size=[len(batch.keys)])
        tq.kv_batch_put(keys=list(batch.keys), partition_id=batch.partition_id, fields=stamps)
        fields = list(batch.fields or [])
        batch.fields = fields + [k for k in keys if k not in fields]
        batch.extra_info.update(view.meta_info)
        try:
            output = self._update_actor(batch, metrics)
        finally:
            batch.fields = fields
            for key in (STEP_KEY, BATCH_SIZE_KEY):
                batch.extra_info.pop(key, None)
        scalars = {k: v for k, v in actor_scalars(metrics).items() if k.startswith(KEPT_SCALARS)}
        if scalars:
            self.logger.log_step(step, scalars=scalars)
        self.logger.commit_step()
        if self.reporter is not None:  # the step's summaries into the metrics the V1 trainer hands its trackers
            self._add_step_metrics(_MetricsOutput(metrics), step)
        return output


class _MetricsOutput:
    """The V1 trainer's step ``metrics`` dict where :meth:`VerlLogging._add_step_metrics` looks for the V0
    actor output's (``meta_info["metrics"]``), so the summaries land in the dict itself."""

    def __init__(self, metrics: dict[str, Any]):
        self.meta_info = {"metrics": metrics}


def r3_routing_shape(model_path: Any) -> tuple[int, int, int] | None:
    """The ``routing_shape`` (MoE layers, top-k, experts) of the model verl trains, from its config (a local
    directory, or the Hugging Face cache), for a run whose rollouts return routed experts; None with a warning when
    the config cannot be read or names no experts (the experts are then not logged)."""
    from trustscope.routing import moe_shape

    try:
        from transformers import AutoConfig

        shape = moe_shape(AutoConfig.from_pretrained(str(model_path), trust_remote_code=False))
    except Exception as err:  # any loader error: the run goes on without the experts
        warnings.warn(f"rollout routing replay is on, but the config of {model_path!r} cannot be read ({err}): the "
                      f"routed experts are not logged; pass attach(..., routing_shape=(layers, top_k, experts))",
                      stacklevel=3)
        return None
    if shape is None:
        warnings.warn(f"rollout routing replay is on, but {model_path!r} is a dense model (its config names no "
                      f"experts): the routed experts are not logged", stacklevel=3)
    return shape


def attach(trainer: Any, logdir: str | os.PathLike, run_id: str | None = None, *, metrics: bool = True,
           webhook: str | None = None, warn_relative: float | None = None, **logger_options: Any) -> VerlLogging:
    """Log verl ``RayPPOTrainer`` ``trainer`` to ``<logdir>/<run_id>/``; call after ``init_workers()``.

    Both of verl 0.9.1's trainers: ``RayPPOTrainer`` (``trainer.use_v1=False``, ``main_ppo_v0``'s task runner; call
    after ``init_workers()``) and the V1 trainers of ``verl.trainer.ppo.v1`` (``trainer.use_v1=True``, the default;
    call after ``trainer.init()``), whose batch lives in TransferQueue (:class:`VerlV1Logging`).

    Wraps the trainer's ``_update_actor`` (the one place the driver batch goes to the actors) to log and stamp the
    batch, and installs :class:`ActorLogHook` around verl's ``ppo_loss`` in every actor through the worker group's
    ``set_loss_fn``. ``logger_options`` go to every :class:`~trustscope.logger.TokenLogger` (e.g.
    ``token_fraction``); ``strict`` defaults to False so bad rows are dropped with a warning, never an error in
    the middle of training. ``resume=True`` continues an existing run from the checkpoint verl restores
    (:meth:`VerlLogging.resume_at`).

    ``metrics`` (default True): after each actor update, the step's exact summaries over every actor's tokens
    (read from their committed files) and the collapse early warning go into the step's metrics as
    ``trustscope/...`` (:mod:`trustscope.trackers`, ``docs/trackers.md``), so verl's ``trainer.logger`` trackers
    carry them, and W&B or trackio among them get the early warning as an alert. ``webhook``: a Slack-compatible
    URL the early warning is posted to (:class:`trustscope.alerts.Alerts`); a malformed one raises ``ValueError``
    here. Both need a log directory the driver can read (local or shared). ``warn_relative``: the early warning in
    the run's own terms (:class:`trustscope.report.WarningLines` ``relative_z`` robust deviations, and the relative
    detector); None keeps the absolute lines.
    """
    from trustscope.alerts import Alerts, check_webhook_url
    from trustscope.report import WarningLines
    from trustscope.trackers import LiveTrackerAlerts, StepReporter

    alerts_url = None if webhook is None else check_webhook_url(webhook)
    lines = WarningLines(relative_z=warn_relative)  # a bad value fails here, naming it
    version = verl_version()
    _check_release(version)
    _require_attrs(trainer, f"trainer {type(trainer).__name__}", ("_update_actor", "config", "global_steps"))
    params = list(inspect.signature(trainer._update_actor).parameters)
    v1 = params == ["batch", "metrics"]  # verl's V1 trainer: the batch is a KVBatchMeta into TransferQueue
    if not v1 and params != ["batch"]:
        raise NotImplementedError(
            f"attach() logs verl's RayPPOTrainer (_update_actor(batch), trainer.use_v1=False) and its V1 trainer "
            f"(_update_actor(batch, metrics), trainer.use_v1=True); {type(trainer).__name__}._update_actor"
            f"{tuple(params)} is neither (verl {version}): run with trainer.use_v1=False, or build a RayPPOTrainer"
        )
    if v1:
        _need("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")
        if importlib.util.find_spec("transfer_queue") is None:
            raise ImportError("verl's V1 trainer keeps its batch in TransferQueue, which is not installed: pip "
                              "install transferqueue==0.1.11 (verl's verl-core extra), or run with "
                              "trainer.use_v1=False")
    if not hasattr(trainer, "actor_rollout_wg"):
        raise RuntimeError("attach() sends its hook to the trainer's actor workers: call trainer.init_workers() first")
    _require_attrs(trainer.actor_rollout_wg, "the actor worker group", ("set_loss_fn",))
    ppo_loss = _need("verl.workers.utils.losses", "ppo_loss")
    omega_conf_to_dataclass = _need("verl.utils.config", "omega_conf_to_dataclass")
    cfg = trainer.config
    if cfg.get("distillation", None) and cfg.distillation.get("enabled", False):
        raise NotImplementedError("trustscope's verl hook wraps verl's ppo_loss; distillation runs use another loss")
    actor_cfg = cfg.actor_rollout_ref.actor
    layout = check_actor_config(actor_cfg)
    rollout_cfg = cfg.actor_rollout_ref.rollout
    loss_mode = str(actor_cfg.policy_loss.get("loss_mode", "vanilla"))
    rule = rule_of_loss_mode(loss_mode)
    has_mu = bool(rollout_cfg.get("calculate_log_probs", False))
    bypass = bool((cfg.algorithm.get("rollout_correction", None) or {}).get("bypass_mode", False))
    if not has_mu:
        warnings.warn("verl keeps no rollout log-probs (actor_rollout_ref.rollout.calculate_log_probs=False): mu is "
                      "logged as the actor's recompute old_log_probs (mu_source='trainer_recompute'), so mismatch "
                      "will read zero; set calculate_log_probs=True to measure it", stacklevel=2)
    verl_mask = VERL_MASKS.get(loss_mode) if rule is None else None
    if rule is None and verl_mask is None:
        warnings.warn(f"loss_mode {loss_mode!r} is verl's own and masks trustscope cannot replay (it replays "
                      f"{sorted(VERL_MASKS)}), so 'kept' is logged True on every token (the counterfactual views "
                      f"still replay every trustscope rule)", stacklevel=2)
    resume = bool(logger_options.pop("resume", False))  # the driver resumes; the actors open theirs resumed
    options = {"strict": False, **logger_options}
    if rollout_cfg.get("enable_rollout_routing_replay", False) and options.get("routing_shape") is None:
        options["routing_shape"] = r3_routing_shape(cfg.actor_rollout_ref.model.get("path", None))
    summary = {
        "loss_mode": loss_mode,
        "loss_agg_mode": actor_cfg.get("loss_agg_mode", None),
        "ppo_epochs": actor_cfg.get("ppo_epochs", None),
        "rollout_n": rollout_cfg.get("n", None),
        "calculate_log_probs": has_mu,
        "bypass_mode": bypass,
        "rule_mu": "rollout_log_probs" if has_mu else "old_log_probs",
        "kept": ("the rule's mask" if rule is not None else f"verl's {loss_mode} mask, replayed" if verl_mask
                 else f"not recorded (verl's {loss_mode} loss)"),
        "ranks": "0: driver (samples, steps); r + 1: data-parallel replica r of the actors (tokens)",
        "actor_layout": layout,
    }
    logger = TokenLogger(
        logdir, run_id, rank=0,
        config={"verl": summary, "config": _to_plain(cfg)},
        model={"path": cfg.actor_rollout_ref.model.get("path", None)},
        sampling={k: rollout_cfg.get(k, None) for k in ("name", "temperature", "top_p", "top_k", "n")},
        vocab=getattr(trainer, "tokenizer", None),
        loss_rule=rule or f"verl:{loss_mode}",
        mu_source="engine" if has_mu else "trainer_recompute",
        source={"framework": "verl", "version": version},
        resume=resume,
        **options,
    )
    actor_config = omega_conf_to_dataclass(actor_cfg)
    hook = ActorLogHook(partial(ppo_loss, config=actor_config), logdir, logger.run_id,
                        loss_rule=rule or f"verl:{loss_mode}", log_old_logprob=not bypass,
                        mask_fn=partial(verl_mask, config=actor_config) if verl_mask else None,
                        logger_options=options)
    trainer.actor_rollout_wg.set_loss_fn(hook)
    loggers = cfg.trainer.get("logger", None)  # verl's trackers: W&B / trackio get the warning as an alert
    in_trackers = LiveTrackerAlerts([loggers] if isinstance(loggers, str) else list(loggers or []))
    alerts = (Alerts(alerts_url, logger=logger, trackers=in_trackers)
              if metrics and (alerts_url is not None or in_trackers.names) else None)
    reporter = StepReporter(logger, alerts=alerts, lines=lines) if metrics else None
    handle = (VerlV1Logging if v1 else VerlLogging)(trainer, logger, hook, trainer._update_actor, reporter, alerts,
                                                     resume=resume)
    trainer._update_actor = handle.update_actor
    return handle


if importlib.util.find_spec("verl") is not None:
    register_policy_losses()
