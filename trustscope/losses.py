"""Trust-region rules and policy losses, one pure function each, registered by name.

Every rule shares one signature, ``rule(batch: PolicyBatch, **params) -> LossOutput``, and one loss form, the one
the paper's authors implement::

    loss_t = -A_t * sg(w_t) * M_t * log pi_t,    w_t = min(exp(min(log pi_t - log mu_t, 20)), C)

Rules differ only in the keep-mask ``M`` (what it looks at, what it is anchored to) and the IS cap ``C``. The
trainer and the query layer look rules up with :func:`get_loss`; nothing picks a rule with if/elif. A user's rule
registers exactly like the built-ins::

    @register_loss("my_rule", delta=0.1)
    def my_rule(batch: PolicyBatch, delta: float) -> LossOutput: ...

Per-token math is kept apart from aggregation: :func:`aggregate` reduces ``(B, T)`` losses with a named mode.

Precision: masks, weights and the loss are computed in float32 whatever the input dtype (float64 stays float64), so
a bf16 ``pi_logprob`` gives a float32 loss. Masks from bf16 inputs equal the float32 masks except on tokens within
the bf16 band at a threshold, defined in :mod:`trustscope.divergence` (``BF16_BAND_RTOL``).
Padding (``mask`` False) may hold any value, even inf or NaN: it never reaches the loss, its gradient or a metric.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

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


RuleFn = Callable[..., LossOutput]


@dataclass(frozen=True)
class LossRule:
    """A registered rule: the function and its default parameters. Call it like the function."""

    name: str
    fn: RuleFn
    defaults: dict[str, Any]
    needs: frozenset[str]
    doc: str

    def resolve(self, **params: Any) -> dict[str, Any]:
        """The defaults overridden by ``params``, validated: errors name the parameter and its value."""
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise TypeError(
                f"loss rule {self.name!r} got unknown parameter(s) {sorted(unknown)}; "
                f"its parameters are {sorted(self.defaults)}"
            )
        merged = {**self.defaults, **params}
        _validate_params(self.name, merged)
        return merged

    def __call__(self, batch: PolicyBatch, **params: Any) -> LossOutput:
        merged = self.resolve(**params)
        for name in sorted(self.needs):
            if getattr(batch, name) is None:
                raise ValueError(f"loss rule {self.name!r} needs PolicyBatch.{name}, which is None")
        _check_batch(batch)
        return self.fn(batch, **merged)


_REGISTRY: dict[str, LossRule] = {}


def register_loss(name: str, *, needs: tuple[str, ...] = (), doc: str | None = None,
                  **defaults: Any) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as rule ``name`` with default parameters ``defaults``.

    The same function may be registered under several names with other defaults (a preset). ``needs`` names the
    optional ``PolicyBatch`` fields the rule reads; ``doc`` is the one-line summary (default: the docstring's first
    paragraph), for presets whose defaults make them a different rule.
    """

    def decorator(fn: RuleFn) -> RuleFn:
        if name in _REGISTRY:
            raise ValueError(f"loss rule {name!r} is already registered")
        params = set(inspect.signature(fn).parameters) - {"batch"}
        missing = params - set(defaults)
        if missing:
            raise ValueError(f"loss rule {name!r}: no default for parameter(s) {sorted(missing)}")
        _validate_params(name, defaults)
        fields = set(PolicyBatch.__dataclass_fields__)
        if not set(needs) <= fields:
            raise ValueError(f"loss rule {name!r}: needs={needs!r} names no PolicyBatch field(s); fields are {sorted(fields)}")
        summary = doc or inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
        _REGISTRY[name] = LossRule(name, fn, dict(defaults), frozenset(needs), summary)
        return fn

    return decorator


def get_loss(name: str) -> LossRule:
    """The rule registered as ``name``; an unknown name fails with the list of valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown loss rule {name!r}; valid names: {', '.join(sorted(_REGISTRY))}") from None


def list_losses() -> list[str]:
    """Names of every registered rule, sorted."""
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------------------------------------------
# validation


def _validate_params(rule: str, params: dict[str, Any]) -> None:
    """Reject parameters no rule can use, naming the argument and its value."""

    def bad(arg: str, why: str) -> ValueError:
        return ValueError(f"loss rule {rule!r}: {arg}={params[arg]!r} {why}")

    for arg, value in params.items():
        if arg in ("delta", "eps_high", "is_cap", "dual_clip", "alpha_low", "alpha_high") and value is not None:
            if not isinstance(value, int | float) or math.isnan(value):
                raise bad(arg, "must be a number")
        if arg == "delta" and value < 0:
            raise bad(arg, "must be >= 0")
        if arg == "eps_low" and not (isinstance(value, int | float) and 0 <= value < 1):
            raise bad(arg, "must be in [0, 1): the low clip bound is 1 - eps_low")
        if arg == "eps_high" and value < 0:
            raise bad(arg, "must be >= 0")
        if arg == "is_cap" and value <= 0:
            raise bad(arg, "must be > 0 (use math.inf for no truncation)")
        if arg == "dual_clip" and value is not None and value <= 1:
            raise bad(arg, "must be > 1 (or None to turn dual-clip off)")
        if arg in ("alpha_low", "alpha_high") and not 0 <= value <= 1:
            raise bad(arg, "must be a probability in [0, 1]")
        if arg == "divergence" and value not in _DIVERGENCES:
            raise bad(arg, f"is not one of {sorted(_DIVERGENCES)}")


def _check_batch(batch: PolicyBatch) -> None:
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


# ---------------------------------------------------------------------------------------------------------------
# shared pieces


def is_weight(pi_logprob: Tensor, mu_logprob: Tensor, is_cap: float = math.inf) -> Tensor:
    """``w = min(exp(min(log pi - log mu, 20)), C)``, detached. ``(B, T)`` -> ``(B, T)``."""
    w = D.ratio(pi_logprob.detach(), mu_logprob.detach())
    return w.clamp(max=is_cap) if math.isfinite(is_cap) else w


def ppo_keep(r: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's mask on a ratio ``r``: block A > 0 with r > 1 + eps_high, and A < 0 with r < 1 - eps_low."""
    block = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    return ~block


def dppo_keep(div: Tensor, pi_logprob: Tensor, anchor_logprob: Tensor, adv: Tensor, delta: float) -> Tensor:
    """DPPO's mask: block only where D > delta and pi already moved the way the advantage pushes.

    Block A > 0 with pi > anchor, and A <= 0 with pi < anchor (A = 0 falls in the negative branch).
    """
    up = pi_logprob > anchor_logprob
    down = pi_logprob < anchor_logprob
    over = div > delta
    block = over & (((adv > 0) & up) | ((adv <= 0) & down))
    return ~block


def policy_loss(batch: PolicyBatch, keep: Tensor, w: Tensor) -> LossOutput:
    """The shared loss form ``-A * sg(w) * M * log pi`` with the standard metrics.

    ``keep`` and ``w``: ``(B, T)``. Blocked and padded tokens get an exact zero loss and an exact zero gradient, even
    where their inputs are inf or NaN.
    """
    keep = keep & batch.mask.bool()  # (B, T)
    pi_lp = D.as_compute(batch.pi_logprob)  # (B, T), differentiable
    coef = -D.as_compute(batch.advantages).detach() * w.detach().to(pi_lp.dtype)  # (B, T) = -A * sg(w)
    coef = torch.where(keep, coef, torch.zeros_like(coef))
    loss = torch.where(keep, coef * pi_lp, torch.zeros_like(pi_lp))
    return LossOutput(loss=loss, keep=keep, metrics=trust_region_metrics(batch, keep, w))


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    x = torch.where(m, x, torch.zeros_like(x))
    return x.sum() / m.sum().clamp_min(1).to(x.dtype)


def trust_region_metrics(batch: PolicyBatch, keep: Tensor, w: Tensor) -> dict[str, Tensor]:
    """Blocked fraction overall and by advantage sign, mismatch |pi - mu|, k3 KL, IS weight statistics."""
    with torch.no_grad():
        valid = batch.mask.bool()
        blocked = (valid & ~keep).float()  # (B, T)
        adv = batch.advantages
        pi_lp, mu_lp = batch.pi_logprob.detach(), batch.mu_logprob.detach()
        lr = D.log_ratio(pi_lp, mu_lp)
        out = {
            "policy/blocked_frac": _masked_mean(blocked, valid),
            "policy/blocked_frac_pos": _masked_mean(blocked, valid & (adv > 0)),
            "policy/blocked_frac_neg": _masked_mean(blocked, valid & (adv <= 0)),
            "policy/mismatch_abs_mean": _masked_mean(D.binary_tv(mu_lp, pi_lp), valid),
            "policy/k3_kl": _masked_mean(D.k3_kl(mu_lp, pi_lp), valid),
            "policy/is_weight_mean": _masked_mean(w.float(), valid),
            "policy/log_ratio_abs_max": torch.where(valid, lr.abs(), torch.zeros_like(lr)).max()
            if valid.any() else lr.new_zeros(()),
        }
    return out


# ---------------------------------------------------------------------------------------------------------------
# divergences a DPPO rule can gate on


def _binary_tv(b: PolicyBatch, anchor: Tensor) -> Tensor:
    return D.binary_tv(anchor, b.pi_logprob.detach())


def _binary_kl(b: PolicyBatch, anchor: Tensor) -> Tensor:
    return D.binary_kl(anchor, b.pi_logprob.detach())


def _topk_tv(b: PolicyBatch, anchor: Tensor) -> Tensor:
    return D.topk_tv(b.mu_topk_logprobs, b.pi_topk_logprobs.detach())


def _topk_kl(b: PolicyBatch, anchor: Tensor) -> Tensor:
    return D.topk_kl(b.mu_topk_logprobs, b.pi_topk_logprobs.detach())


_DIVERGENCES: dict[str, Callable[[PolicyBatch, Tensor], Tensor]] = {
    "binary_tv": _binary_tv,
    "binary_kl": _binary_kl,
    "topk_tv": _topk_tv,
    "topk_kl": _topk_kl,
}

DELTA_TV = 0.15
DELTA_KL = 0.05
EPS_LOW = 0.2
EPS_HIGH = 0.28
TIS_CAP = 2.0
NO_CAP = math.inf

# ---------------------------------------------------------------------------------------------------------------
# the rules


@register_loss("pg_is", is_cap=NO_CAP)
def pg_is(batch: PolicyBatch, is_cap: float) -> LossOutput:
    """PG-IS: no trust region, untruncated importance weight pi/mu."""
    return policy_loss(batch, torch.ones_like(batch.mask, dtype=torch.bool), is_weight(batch.pi_logprob, batch.mu_logprob, is_cap))


@register_loss("cispo", is_cap=TIS_CAP)
def cispo(batch: PolicyBatch, is_cap: float) -> LossOutput:
    """PG-TIS (CISPO): no mask, importance weight truncated at C = ``is_cap``."""
    return pg_is(batch, is_cap=is_cap)


def _ppo(batch: PolicyBatch, anchor: Tensor, eps_low: float, eps_high: float, is_cap: float,
         dual_clip: float | None = None) -> LossOutput:
    pi_lp = batch.pi_logprob.detach()
    r = D.ratio(pi_lp, anchor)  # (B, T)
    keep = ppo_keep(r, batch.advantages, eps_low, eps_high)
    if dual_clip is not None:
        keep = keep & ~((batch.advantages < 0) & (r > dual_clip))
    return policy_loss(batch, keep, is_weight(pi_lp, batch.mu_logprob, is_cap))


@register_loss("ppo_clip", eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=None, is_cap=NO_CAP)
def ppo_clip(batch: PolicyBatch, eps_low: float, eps_high: float, dual_clip: float | None, is_cap: float) -> LossOutput:
    """PPO / GRPO ratio clip on r = pi/mu (defaults: Clip-Higher, eps 0.2 / 0.28).

    ``dual_clip`` (c > 1): dual-clip PPO also blocks negative-advantage tokens with r > c (its objective is the
    constant c * A there, so they carry no gradient). None turns it off.
    """
    return _ppo(batch, batch.mu_logprob.detach(), eps_low, eps_high, is_cap, dual_clip)


register_loss("grpo", doc="GRPO: the symmetric PPO ratio clip on r = pi/mu (eps 0.2 / 0.2).",
              eps_low=EPS_LOW, eps_high=EPS_LOW, dual_clip=None, is_cap=NO_CAP)(ppo_clip)


@register_loss("minirl", needs=("old_logprob",), eps_low=EPS_LOW, eps_high=EPS_HIGH, is_cap=NO_CAP)
def minirl(batch: PolicyBatch, eps_low: float, eps_high: float, is_cap: float) -> LossOutput:
    """MiniRL (decoupled PPO): the clip mask on pi/pi_old (recomputed), IS weight pi/mu."""
    return _ppo(batch, batch.old_logprob.detach(), eps_low, eps_high, is_cap)


register_loss("minirl_tis", needs=("old_logprob",), doc="MiniRL-TIS: MiniRL with the IS weight truncated at C.",
              eps_low=EPS_LOW, eps_high=EPS_HIGH, is_cap=TIS_CAP)(minirl)


def _dppo(batch: PolicyBatch, divergence: str, delta: float, anchor: Tensor) -> LossOutput:
    div = _DIVERGENCES[divergence](batch, anchor)
    keep = dppo_keep(div, batch.pi_logprob.detach(), anchor, batch.advantages, delta)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob))


@register_loss("dppo_binary_tv", doc="DPPO gated on binary TV |pi - mu| > delta.", divergence="binary_tv", delta=DELTA_TV)
def dppo(batch: PolicyBatch, divergence: str, delta: float) -> LossOutput:
    """DPPO: block a token only when D(mu, pi) > delta and pi moved past mu the way A pushes."""
    if divergence.startswith("topk") and (batch.mu_topk_logprobs is None or batch.pi_topk_logprobs is None):
        raise ValueError(f"divergence={divergence!r} needs PolicyBatch.mu_topk_logprobs and pi_topk_logprobs")
    return _dppo(batch, divergence, delta, batch.mu_logprob.detach())


register_loss("dppo_binary_kl", doc="DPPO gated on binary KL(mu || pi) > delta.",
              divergence="binary_kl", delta=DELTA_KL)(dppo)
register_loss("dppo_topk_tv", needs=("mu_topk_logprobs", "pi_topk_logprobs"), doc="DPPO gated on top-K TV > delta.",
              divergence="topk_tv", delta=DELTA_TV)(dppo)
register_loss("dppo_topk_kl", needs=("mu_topk_logprobs", "pi_topk_logprobs"), doc="DPPO gated on top-K KL > delta.",
              divergence="topk_kl", delta=DELTA_KL)(dppo)


@register_loss("dppo_decoupled", needs=("old_logprob",), divergence="binary_kl", delta=DELTA_KL)
def dppo_decoupled(batch: PolicyBatch, divergence: str, delta: float) -> LossOutput:
    """DPPO decoupled (ablation): the DPPO mask anchored on the recomputed pi_old instead of mu; weight pi/mu."""
    if divergence not in ("binary_tv", "binary_kl"):
        raise ValueError(f"dppo_decoupled: divergence={divergence!r}; only binary_tv and binary_kl have a pi_old anchor")
    return _dppo(batch, divergence, delta, batch.old_logprob.detach())


@register_loss("ppo_lowprob_relax", eps_low=EPS_LOW, eps_high=EPS_HIGH, alpha_low=0.1, alpha_high=0.1)
def ppo_lowprob_relax(batch: PolicyBatch, eps_low: float, eps_high: float, alpha_low: float,
                      alpha_high: float) -> LossOutput:
    """PPO clip that never clips a side for tokens with mu < alpha (alpha per side; 0 turns a side's relief off)."""
    pi_lp, mu_lp, adv = batch.pi_logprob.detach(), batch.mu_logprob.detach(), batch.advantages
    r = D.ratio(pi_lp, mu_lp)
    mu = torch.exp(D.as_compute(mu_lp))
    block = ((adv > 0) & (r > 1 + eps_high) & (mu >= alpha_high)) | ((adv < 0) & (r < 1 - eps_low) & (mu >= alpha_low))
    return policy_loss(batch, ~block, is_weight(pi_lp, mu_lp))


@register_loss("minimal_negative_mask", delta=0.5)
def minimal_negative_mask(batch: PolicyBatch, delta: float) -> LossOutput:
    """Mask-delta: block only negative-advantage tokens that pi pushed down from mu by at least delta."""
    pi_lp, mu_lp = batch.pi_logprob.detach(), batch.mu_logprob.detach()
    drop = torch.exp(D.as_compute(mu_lp)) - torch.exp(D.as_compute(pi_lp))
    block = (batch.advantages < 0) & (drop >= delta)
    return policy_loss(batch, ~block, is_weight(pi_lp, mu_lp))


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
