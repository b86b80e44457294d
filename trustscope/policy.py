"""The torch side of the rule catalogue: the batch a rule reads, the terms its mask reads, the shared loss form,
and aggregation.

The catalogue itself (:mod:`trustscope.losses`: names, SQL mask families, parameters and their bounds, the masks as
pure functions over :class:`MaskTerms`, every rule's mask on one batch) imports no torch, so the query layer, the
CLI and the dashboard read it without torch. This module sits below it and knows no registry: it takes a rule
object, never a rule's name. It is imported where tensors are touched: calling a rule (``get_loss(name)(batch)``),
:func:`trustscope.losses.keep_masks`, :func:`aggregate`.

Every built-in rule's loss is the one form the paper's authors implement::

    loss_t = -A_t * sg(w_t) * M_t * log pi_t,    w_t = min(exp(min(log pi_t - log mu_t, 20)), C)

built by :func:`rule_loss` from the rule's mask ``M`` and weight ``w``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trustscope.extras import missing

try:
    import torch
    from torch import Tensor
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.policy")

from trustscope import divergence as D


@dataclass(frozen=True)
class PolicyBatch:
    """Per-token inputs of a policy loss. B sequences, T response positions, K top-K ids.

    Attributes:
        pi_logprob: ``(B, T)`` log pi of the sampled token under the current weights; gradients flow through it.
        mu_logprob: ``(B, T)`` log mu, reported by the rollout engine.
        advantages: ``(B, T)`` advantage of each token (GRPO: the sequence's, broadcast).
        mask: ``(B, T)`` bool, True on real response tokens, False on padding.
        old_logprob: ``(B, T)`` log pi_old, recomputed by the trainer with the rollout's weights (decoupled rules).
        mu_topk_logprobs: ``(B, T, K)`` mu's top-K logprobs, with the sampled token forced into the set.
        pi_topk_logprobs: ``(B, T, K)`` pi's logprobs at the same ids (top-K rules).
    """

    pi_logprob: Tensor
    mu_logprob: Tensor
    advantages: Tensor
    mask: Tensor
    old_logprob: Tensor | None = None
    mu_topk_logprobs: Tensor | None = None
    pi_topk_logprobs: Tensor | None = None


@dataclass
class LossOutput:
    """What every rule returns.

    Attributes:
        loss: ``(B, T)`` per-token loss, zero on padding and on blocked tokens.
        keep: ``(B, T)`` bool trust-region mask M: True where the token's gradient is kept (padding: False).
        metrics: scalar 0-dim tensors named ``policy/...`` (detached).
    """

    loss: Tensor
    keep: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)



def check_batch(batch: PolicyBatch) -> None:
    """Shapes agree and valid positions hold no NaN; errors name the field."""
    shape = batch.pi_logprob.shape
    for name in ("mu_logprob", "advantages", "mask", "old_logprob"):
        t = getattr(batch, name)
        if t is not None and t.shape != shape:
            raise ValueError(f"PolicyBatch.{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like pi_logprob")
    for name in ("mu_topk_logprobs", "pi_topk_logprobs"):
        t = getattr(batch, name)
        if t is None:
            continue
        if t.ndim != len(shape) + 1 or t.shape[:-1] != shape:
            raise ValueError(f"PolicyBatch.{name} has shape {tuple(t.shape)}, expected {(*shape, 'K')}")
        if t.shape[-1] < 1:
            raise ValueError(f"PolicyBatch.{name} has K={t.shape[-1]}; K must be >= 1")
    if batch.mu_topk_logprobs is not None and batch.pi_topk_logprobs is not None:
        if batch.mu_topk_logprobs.shape != batch.pi_topk_logprobs.shape:
            raise ValueError(
                f"PolicyBatch.mu_topk_logprobs {tuple(batch.mu_topk_logprobs.shape)} and pi_topk_logprobs "
                f"{tuple(batch.pi_topk_logprobs.shape)} must have the same K"
            )
    mask = batch.mask.bool()
    for name in ("pi_logprob", "mu_logprob", "advantages", "old_logprob", "mu_topk_logprobs", "pi_topk_logprobs"):
        t = getattr(batch, name)
        if t is None:
            continue
        nan = torch.isnan(t.detach())  # (B, T) or (B, T, K)
        nan = (nan if nan.ndim == mask.ndim else nan.any(-1)) & mask  # (B, T)
        if nan.any():
            raise ValueError(f"PolicyBatch.{name} holds NaN on {int(nan.sum())} unmasked token(s)")


def rule_loss(rule: Any, batch: PolicyBatch, params: dict[str, Any], metrics: bool = True) -> LossOutput:
    """Rule ``rule``'s (a :class:`trustscope.losses.LossRule`) loss on ``batch`` at ``params`` (already resolved): its own loss function when it has one,
    else the shared form from its mask and weight (:func:`policy_loss`; ``metrics=False`` leaves its statistics
    out, for a caller whose logger computes them from the logged rows)."""
    for name in sorted(rule.needs):
        if getattr(batch, name) is None:
            raise ValueError(f"loss rule {rule.name!r} needs PolicyBatch.{name}, which is None")
    check_batch(batch)
    if rule.loss is not None:
        return rule.loss(batch, **params)
    terms = MaskTerms(batch)
    keep = rule.mask(terms, **{p: params[p] for p in rule.mask_params})
    w = rule.weight(terms, **{p: params[p] for p in rule.weight_params})
    return policy_loss(batch, keep, w, gate=terms.valid if rule.gate == "valid" else None, metrics=metrics)


def is_weight(pi_logprob: Tensor, mu_logprob: Tensor, is_cap: float = math.inf) -> Tensor:
    """``w = min(exp(min(log pi - log mu, 20)), C)``, detached. ``(B, T)`` -> ``(B, T)``."""
    w = D.ratio(pi_logprob.detach(), mu_logprob.detach())
    return w.clamp(max=is_cap) if math.isfinite(is_cap) else w


def policy_loss(batch: PolicyBatch, keep: Tensor, w: Tensor, gate: Tensor | None = None,
                metrics: bool = True) -> LossOutput:
    """The shared loss form ``-A * sg(w) * M * log pi`` with the standard metrics.

    ``keep``, ``w`` and ``gate``: ``(B, T)``. ``gate`` (default ``keep``) is where the loss applies: a hard mask
    gates on its keep-mask; a smooth rule (DRPO) applies its weight everywhere and reports its own ``keep``.
    Gated-out and padded tokens get an exact zero loss and an exact zero gradient, even where their inputs are inf
    or NaN.
    """
    valid = batch.mask.bool()
    keep = keep & valid  # (B, T)
    gate = keep if gate is None else gate & valid  # (B, T)
    pi_lp = D.as_compute(batch.pi_logprob)  # (B, T), differentiable
    coef = -D.as_compute(batch.advantages).detach() * w.detach().to(pi_lp.dtype)  # (B, T) = -A * sg(w)
    coef = torch.where(gate, coef, torch.zeros_like(coef))
    loss = torch.where(gate, coef * pi_lp, torch.zeros_like(pi_lp))
    return LossOutput(loss=loss, keep=keep, metrics=trust_region_metrics(batch, keep, w) if metrics else {})


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    x = torch.where(m, x, torch.zeros_like(x))
    return x.sum() / m.sum().clamp_min(1).to(x.dtype)


def trust_region_metrics(batch: PolicyBatch, keep: Tensor, w: Tensor) -> dict[str, Tensor]:
    """Blocked fraction over the tokens that carry gradient (A != 0) and by advantage sign, with the counts;
    mismatch |pi - mu|, k3 KL, IS weight statistics over every valid token."""
    with torch.no_grad():
        valid = batch.mask.bool()
        adv = batch.advantages
        grad = valid & (adv != 0)  # (B, T) tokens whose loss has a gradient
        blocked = (grad & ~keep).float()  # (B, T)
        pi_lp, mu_lp = batch.pi_logprob.detach(), batch.mu_logprob.detach()
        lr = D.log_ratio(pi_lp, mu_lp)
        out = {
            "policy/blocked_frac": _masked_mean(blocked, grad),
            "policy/blocked_frac_pos": _masked_mean(blocked, valid & (adv > 0)),
            "policy/blocked_frac_neg": _masked_mean(blocked, valid & (adv < 0)),
            "policy/n_blocked": blocked.sum(),
            "policy/n_grad_tokens": grad.sum().to(blocked.dtype),
            "policy/mismatch_abs_mean": _masked_mean(D.binary_tv(mu_lp, pi_lp), valid),
            "policy/k3_kl": _masked_mean(D.k3_kl(mu_lp, pi_lp), valid),
            "policy/is_weight_mean": _masked_mean(w.float(), valid),
            "policy/log_ratio_abs_max": torch.where(valid, lr.abs(), torch.zeros_like(lr)).max()
            if valid.any() else lr.new_zeros(()),
        }
    return out


def _seq_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``x`` over each sequence's valid tokens, broadcast back: ``(B, T)`` -> ``(B, T)``."""
    x = torch.where(valid, x, torch.zeros_like(x))
    n = valid.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)  # (B, 1)
    return (x.sum(-1, keepdim=True) / n).expand_as(x)


class MaskTerms:
    """The detached per-token terms the rules' keep-masks read, each computed at most once for a batch.

    Every rule's mask function (``mask=`` of :func:`register_loss`) reads its inputs here, so the rules of one
    :func:`keep_masks` call share one ratio, one binary TV, one top-K TV, one sequence log-ratio instead of each
    computing its own; a rule called alone builds its own ``MaskTerms``, so both paths run the same code. Names
    follow the SQL view ``rule_blocks`` (:data:`SQL_COLUMNS`). All ``(B, T)``; the sequence context is over the
    valid tokens of each row (padding is False in ``mask``).

    ``given`` supplies ``topk_tv`` / ``topk_kl`` already computed (the scalars stored with the token rows, which the
    SQL views gate on too): used as they are, so the top-K lists need not be there.
    """

    GIVEN = frozenset({"topk_tv", "topk_kl"})

    def __init__(self, batch: PolicyBatch, given: dict[str, Tensor] | None = None) -> None:
        self.batch = batch
        for name, value in (given or {}).items():
            if name not in self.GIVEN:
                raise ValueError(f"MaskTerms: given term {name!r} is not one of {sorted(self.GIVEN)}")
            if value.shape != batch.pi_logprob.shape:
                raise ValueError(f"MaskTerms: given {name} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(batch.pi_logprob.shape)} like pi_logprob")
            self.__dict__[name] = value  # functools.cached_property reads the instance's dict first

    @functools.cached_property
    def valid(self) -> Tensor:
        return self.batch.mask.bool()

    @functools.cached_property
    def advantage(self) -> Tensor:
        return self.batch.advantages

    @functools.cached_property
    def pi_logprob(self) -> Tensor:
        return self.batch.pi_logprob.detach()

    @functools.cached_property
    def mu_logprob(self) -> Tensor:
        return self.batch.mu_logprob.detach()

    @functools.cached_property
    def old_logprob(self) -> Tensor:
        if self.batch.old_logprob is None:
            raise ValueError("this mask needs PolicyBatch.old_logprob, which is None")
        return self.batch.old_logprob.detach()

    @functools.cached_property
    def ratio(self) -> Tensor:
        return D.ratio(self.pi_logprob, self.mu_logprob)

    @functools.cached_property
    def old_ratio(self) -> Tensor:
        return D.ratio(self.pi_logprob, self.old_logprob)

    @functools.cached_property
    def mu_prob(self) -> Tensor:
        return torch.exp(D.as_compute(self.mu_logprob))

    @functools.cached_property
    def pi_prob(self) -> Tensor:
        return torch.exp(D.as_compute(self.pi_logprob))

    @functools.cached_property
    def binary_tv(self) -> Tensor:
        return D.binary_tv(self.mu_logprob, self.pi_logprob)

    @functools.cached_property
    def binary_kl(self) -> Tensor:
        return D.binary_kl(self.mu_logprob, self.pi_logprob)

    @functools.cached_property
    def old_binary_tv(self) -> Tensor:
        return D.binary_tv(self.old_logprob, self.pi_logprob)

    @functools.cached_property
    def old_binary_kl(self) -> Tensor:
        return D.binary_kl(self.old_logprob, self.pi_logprob)

    def _topk_lists(self, divergence: str) -> tuple[Tensor, Tensor]:
        if self.batch.mu_topk_logprobs is None or self.batch.pi_topk_logprobs is None:
            raise ValueError(f"divergence={divergence!r} needs PolicyBatch.mu_topk_logprobs and pi_topk_logprobs")
        return self.batch.mu_topk_logprobs, self.batch.pi_topk_logprobs.detach()

    @functools.cached_property
    def topk_tv(self) -> Tensor:
        return D.topk_tv(*self._topk_lists("topk_tv"))

    @functools.cached_property
    def topk_kl(self) -> Tensor:
        return D.topk_kl(*self._topk_lists("topk_kl"))

    @functools.cached_property
    def seq_log_ratio(self) -> Tensor:
        """Per-sequence mean of log(pi / mu): the log of the geometric-mean ratio (one value per row)."""
        return _seq_mean(D.log_ratio(self.pi_logprob, self.mu_logprob), self.valid)


def present_fields(batch: PolicyBatch, given: dict[str, Tensor] | None) -> set[str]:
    """The PolicyBatch fields a mask can read: those not None, and the top-K lists when both top-K divergences are
    given (then the lists are not read)."""
    present = {f for f in PolicyBatch.__dataclass_fields__ if getattr(batch, f) is not None}
    if set(given or {}) >= MaskTerms.GIVEN:
        present |= {"mu_topk_logprobs", "pi_topk_logprobs"}
    return present


# ---------------------------------------------------------------------------------------------------------------
# aggregation


def _where(loss: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, loss, torch.zeros_like(loss))


def _agg_token_mean(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    """Mean over all valid tokens of the batch.

    Length bias: long sequences carry more weight (one vote per token), and each token's weight depends on the
    batch's total token count.
    """
    return _where(loss, mask).sum() / mask.sum().clamp_min(1.0)


def _agg_seq_mean_token_mean(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    """Mean over sequences (those with at least one valid token) of each sequence's token mean.

    Length bias: tokens of short sequences weigh more (GRPO's bias): short right answers are pushed up hard,
    long wrong ones are pushed down softly.
    """
    per_seq = _where(loss, mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    has_tokens = (mask.sum(-1) > 0).to(loss.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)


def _agg_seq_mean_token_sum(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    """Mean over all B sequences of each sequence's token sum.

    Length bias: none between tokens, but the loss scale (and the gradient) grows with response length.
    """
    return _where(loss, mask).sum(-1).mean()


def _agg_seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    """Token sum over the batch / (B * max_len) (Dr. GRPO), the paper's recipe.

    Length bias: none; the normaliser is a constant, so every token weighs the same whatever its sequence's
    length. ``max_len`` defaults to T, the padded response length.
    """
    b, t = loss.shape
    return _where(loss, mask).sum() / (b * (max_len or t))


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "token_mean": _agg_token_mean,
    "seq_mean_token_mean": _agg_seq_mean_token_mean,
    "seq_mean_token_sum": _agg_seq_mean_token_sum,
    "seq_mean_token_sum_norm": _agg_seq_mean_token_sum_norm,
}


def aggregate(loss: Tensor, mask: Tensor, mode: str = "seq_mean_token_sum_norm", max_len: int | None = None) -> Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar over ``mask`` ``(B, T)`` with the named ``mode``.

    Modes: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum``, ``seq_mean_token_sum_norm`` (the
    paper's recipe, the default). Each mode's docstring in ``AGGREGATIONS`` states its length bias.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregate: mode={mode!r} is not one of {sorted(AGGREGATIONS)}")
    if loss.shape != mask.shape or loss.ndim != 2:
        raise ValueError(f"aggregate: loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must both be (B, T)")
    if max_len is not None and max_len < 1:
        raise ValueError(f"aggregate: max_len={max_len!r} must be >= 1")
    return AGGREGATIONS[mode](loss, mask.to(loss.dtype), max_len)
