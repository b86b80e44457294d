"""trustscope's rules as verl policy losses, registered in verl's own policy-loss registry.

verl 0.9.1 hands a policy loss ``old_log_prob`` (pi_old, the actor's recompute; it *is* ``rollout_log_probs`` when
``algorithm.rollout_correction.bypass_mode=True``) but not ``rollout_log_probs``. A trustscope rule takes mu =
``rollout_log_probs`` when :func:`~trustscope.integrations.verl.attach` runs (its actor hook reads them from the
micro-batch and shares them through :data:`ACTOR_CALL`), else mu = ``old_log_prob``; pi_old is always
``old_log_prob``. verl's ``rollout_is_weights`` multiply the per-token loss as in verl's built-in losses only when mu
is ``old_log_prob`` (with mu = ``rollout_log_probs`` the rule's weight pi / mu already corrects for the rollout).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trustscope import losses as L
from trustscope.integrations.verl.versions import CORE, need

LOSS_PREFIX = "trustscope_"
_TOPK_FIELDS = frozenset({"mu_topk_logprobs", "pi_topk_logprobs"})


@dataclass
class ActorCall:
    """What the actor hook shares with a trustscope policy loss during one micro-batch (same process, same stack).

    Attributes:
        mu: ``(B, T)`` the micro-batch's ``rollout_log_probs``, or None when the batch has none.
        keep: ``(B, T)`` bool, filled in by the rule: the mask it applied.
        is_applied: filled in by the rule: True when it multiplied verl's ``rollout_is_weights`` into the loss.
    """

    mu: Tensor | None
    keep: Tensor | None = None
    is_applied: bool = False


ACTOR_CALL: contextvars.ContextVar[ActorCall | None] = contextvars.ContextVar("trustscope_verl_call", default=None)


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
    agg_loss = need(CORE, "agg_loss")

    def policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                    loss_agg_mode: str = "token-mean", config: Any = None,
                    rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        call = ACTOR_CALL.get()
        mu_is_old = call is None or call.mu is None
        mu = old_log_prob if mu_is_old else call.mu  # (B, T)
        valid = response_mask.bool()  # (B, T)
        # with the hook on, the logger summarises the logged rows exactly on its writer thread: the rule's own
        # statistics (blocked fractions by sign, mismatch, k3 KL, IS weight) are not computed again here
        out = rule(L.PolicyBatch(pi_logprob=log_prob, mu_logprob=mu.detach(), advantages=advantages.detach(),
                                 mask=valid, old_logprob=old_log_prob.detach()), metrics=call is None)
        per_token = out.loss  # (B, T), zero on padding and blocked tokens
        applied = rollout_is_weights is not None and mu_is_old
        if applied:
            per_token = per_token * rollout_is_weights.detach()
        pg_loss = agg_loss(loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                           **_batch_info(config))
        if call is not None:
            call.keep, call.is_applied = out.keep.detach(), applied
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
    register = need(CORE, "register_policy_loss")
    need(CORE, "get_policy_loss_fn")
    modes = []
    for name in verl_rules():
        mode = verl_loss_mode(name)
        register(mode)(make_policy_loss(name))
        modes.append(mode)
    return modes
