"""Trust-region rules and policy losses, one pure function each, registered by name: the rule catalogue.

Every rule shares one signature, ``rule(batch: PolicyBatch, **params) -> LossOutput``, and one loss form, the one
the paper's authors implement::

    loss_t = -A_t * sg(w_t) * M_t * log pi_t,    w_t = min(exp(min(log pi_t - log mu_t, 20)), C)

Rules differ in the keep-mask ``M`` (what it looks at, what it is anchored to), the IS weight ``w`` and, for the
sequence-level rules, the context they read (the whole response). The trainer looks rules up with
:func:`get_loss` (a registered name, or a dotted path ``pkg.module:rule`` that imports the user's module);
nothing picks a rule with if/elif. A user's rule registers exactly like the built-ins, and names its SQL mask
family so that the query layer (``trustscope.db``) shows it beside the others with no SQL of its own::

    @register_loss("my_rule", sql=DPPO_MU, divergence="binary_tv", delta=0.1)
    def my_rule(batch: PolicyBatch, divergence: str, delta: float) -> LossOutput: ...

The catalogue is one place: :func:`list_losses` feeds the trainer, the ``blocks_<rule>`` columns of the SQL view
``rule_blocks`` and every per-rule aggregate, the data contracts, the SQL parity tests and the docs' rule table.

**The A = 0 convention** (one for every rule, the paper authors'): a token with zero advantage takes the negative
branch of a mask (``A <= 0``); DPPO's mask says so in PAPER.md, and the ratio rules follow it. Such a token carries
no gradient whatever the mask says (its loss is ``-0 * w * log pi``), so every blocked fraction, here
(``policy/blocked_frac*``) and in the SQL views, is counted over the tokens that carry gradient (``A != 0``), with
the token count beside it, as verl's ``pg_clipfrac`` effectively does (a zero-advantage token is never "clipped").

Each built-in rule's keep-mask is its own pure function, ``mask_<rule>(terms: MaskTerms, **params)``, which the
rule's loss calls and :func:`keep_masks` calls alone: every rule's mask on one batch without building any loss,
under ``torch.no_grad``, the ratios, divergences and sequence context (:class:`MaskTerms`) computed once for
all rules. The logger's exact summaries count every rule's blocked tokens this way.

Per-token math is kept apart from aggregation: :func:`aggregate` reduces ``(B, T)`` losses with a named mode.

Precision: masks, weights and the loss are computed in float32 whatever the input dtype (float64 stays float64), so
a bf16 ``pi_logprob`` gives a float32 loss. Masks from bf16 inputs equal the float32 masks except on tokens within
the bf16 band at a threshold, defined in :mod:`trustscope.divergence` (``BF16_BAND_RTOL``).
Padding (``mask`` False) may hold any value, even inf or NaN: it never reaches the loss, its gradient or a metric.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Iterable
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

SQL_COLUMNS = frozenset({
    "ratio", "old_ratio", "log_ratio", "mu_prob", "pi_prob", "old_prob", "mu_logprob", "pi_logprob", "old_logprob",
    "binary_tv", "binary_kl", "topk_tv", "topk_kl", "old_binary_tv", "old_binary_kl", "advantage", "pos",
    "seq_log_ratio", "seq_pos", "seq_len", "seq_p90_binary_tv", "prefix_binary_tv", "prefix_pos_binary_tv",
})
"""Columns the SQL view ``rule_blocks`` hands to the mask macros (``old_*``: anchored on pi_old). The ``seq_*`` and
``prefix_*`` columns are the response's context, computed once over the window ``(run_id, step, rank,
sample_id)``: the mean log-ratio, the length, the P90 of binary TV, and the sums of binary TV (and of pos times it)
over the tokens before this one."""

_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class SqlMask:
    """How the SQL views evaluate a rule's mask as a "would block" flag: the rule's mask family and its inputs.

    The family is one macro, ``<family>_blocks`` in ``trustscope/sql/macros/<family>_blocks.sql``, shared by every
    rule of the family. ``trustscope.db`` calls it per rule with ``columns`` (names from :data:`SQL_COLUMNS`, in
    order; None passes SQL null) and then ``params`` (the rule's parameter names, in order, bound per run from the
    run's manifest or the defaults; None passes null). ``sequence``: the mask reads the whole response, through
    the context columns ``rule_blocks`` computes over ``(run_id, step, rank, sample_id)`` windows.
    """

    family: str
    columns: tuple[str | None, ...] = ()
    params: tuple[str | None, ...] = ()
    sequence: bool = False

    def __post_init__(self) -> None:
        if not _IDENTIFIER.fullmatch(self.family):
            raise ValueError(f"SqlMask.family={self.family!r} must match {_IDENTIFIER.pattern}")
        unknown = [c for c in self.columns if c is not None and c not in SQL_COLUMNS]
        if unknown:
            raise ValueError(f"SqlMask({self.family!r}).columns name unknown column(s) {unknown}; "
                             f"known: {sorted(SQL_COLUMNS)}")
        bad = [n for n in self.params if n is not None and not _IDENTIFIER.fullmatch(n)]
        if bad:
            raise ValueError(f"SqlMask({self.family!r}).params {bad} must match {_IDENTIFIER.pattern}")


# The mask families of the built-in rules; a user's rule of the same kind names one of these.
NO_MASK = SqlMask("none")
RATIO_CLIP_MU = SqlMask("ratio_clip", ("ratio", "advantage"), ("eps_low", "eps_high", "dual_clip"))
RATIO_CLIP_OLD = SqlMask("ratio_clip", ("old_ratio", "advantage"), ("eps_low", "eps_high", None))
DPPO_MU = SqlMask("dppo", ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "pi_logprob", "mu_logprob", "advantage"),
                  ("divergence", "delta"))
DPPO_OLD = SqlMask("dppo", ("old_binary_tv", "old_binary_kl", None, None, "pi_logprob", "old_logprob", "advantage"),
                   ("divergence", "delta"))
LOWPROB_RELAX = SqlMask("lowprob_relax", ("ratio", "mu_prob", "advantage"),
                        ("eps_low", "eps_high", "alpha_low", "alpha_high"))
NEGATIVE_MASK = SqlMask("negative_mask", ("mu_prob", "pi_prob", "advantage"), ("delta",))
RATIO_BAND = SqlMask("ratio_band", ("ratio",), ("low", "high"))
SEQ_RATIO_CLIP = SqlMask("seq_ratio_clip", ("seq_log_ratio", "advantage"), ("eps_low", "eps_high"), sequence=True)
SEQ_GEO_BAND = SqlMask("seq_geo_band", ("seq_log_ratio",), ("low", "high"), sequence=True)
CPPO_PREFIX = SqlMask("cppo", ("seq_pos", "seq_len", "binary_tv", "seq_p90_binary_tv", "prefix_binary_tv",
                               "prefix_pos_binary_tv", "pi_logprob", "mu_logprob", "advantage"),
                      ("delta", "w_min", "delta_b"), sequence=True)
DRPO_PENALTY = SqlMask("drpo", ("pi_prob", "mu_prob", "advantage"), ("delta",))


@dataclass(frozen=True)
class LossRule:
    """A registered rule: the function, its default parameters and its SQL mask family. Call it like the function."""

    name: str
    fn: RuleFn
    defaults: dict[str, Any]
    needs: frozenset[str]
    doc: str
    sql: SqlMask | None = None
    mask: Callable[..., Tensor] | None = None
    mask_params: tuple[str, ...] = ()

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


def register_loss(name: str, *, needs: tuple[str, ...] = (), doc: str | None = None, sql: SqlMask | None = None,
                  mask: Callable[..., Tensor] | None = None, **defaults: Any) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as rule ``name`` with default parameters ``defaults``.

    The same function may be registered under several names with other defaults (a preset). ``needs`` names the
    optional ``PolicyBatch`` fields the rule reads; ``doc`` is the one-line summary (default: the docstring's first
    paragraph), for presets whose defaults make them a different rule. ``sql`` is the rule's mask family
    (:class:`SqlMask`): with it the rule gets a ``blocks_<name>`` column in the SQL views; without it the rule
    trains but the query layer cannot show what it would block. ``mask`` is the rule's keep-mask alone,
    ``mask(terms: MaskTerms, **params) -> (B, T) bool`` over some of the rule's parameters, which the rule itself
    uses for its loss: :func:`keep_masks` calls it without building the loss (without it, the whole rule runs).
    ``name`` is lowercase letters, digits and '_'.
    """

    def decorator(fn: RuleFn) -> RuleFn:
        if not _IDENTIFIER.fullmatch(name):
            raise ValueError(f"loss rule name {name!r} must match {_IDENTIFIER.pattern} (it names a SQL column)")
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
        if sql is not None:
            unknown = [p for p in sql.params if p is not None and p not in defaults]
            if unknown:
                raise ValueError(f"loss rule {name!r}: sql family {sql.family!r} passes parameter(s) {unknown} "
                                 f"the rule does not have; its parameters are {sorted(defaults)}")
        mask_params: tuple[str, ...] = ()
        if mask is not None:
            mask_params = tuple(inspect.signature(mask).parameters)[1:]
            unknown = [p for p in mask_params if p not in defaults]
            if unknown:
                raise ValueError(f"loss rule {name!r}: mask function {mask.__name__!r} takes parameter(s) {unknown} "
                                 f"the rule does not have; its parameters are {sorted(defaults)}")
        summary = doc or inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
        _REGISTRY[name] = LossRule(name, fn, dict(defaults), frozenset(needs), summary, sql, mask, mask_params)
        return fn

    return decorator


def get_loss(name: str) -> LossRule:
    """The rule registered as ``name``, or found by dotted path ``pkg.module:rule`` (``pkg.module.rule``): the
    module is imported (registering its rules) and ``rule`` is a registered name or the registered function's
    attribute name. An unknown name fails with the list of valid names."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." not in name and ":" not in name:
        raise KeyError(f"unknown loss rule {name!r}; valid names: {', '.join(sorted(_REGISTRY))} "
                       f"(or a dotted path pkg.module:rule)")
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise KeyError(f"loss rule {name!r}: cannot import module {module_name!r} ({err})") from None
    if attr in _REGISTRY:
        return _REGISTRY[attr]
    fn = getattr(module, attr, None)
    for rule in _REGISTRY.values():
        if fn is not None and rule.fn is fn:
            return rule
    raise KeyError(f"loss rule {name!r}: module {module_name!r} registers no rule named {attr!r} "
                   f"(register it with @register_loss); valid names: {', '.join(sorted(_REGISTRY))}")


def list_losses() -> list[str]:
    """Names of every registered rule, sorted."""
    return sorted(_REGISTRY)


def catalogue_markdown() -> str:
    """The rule table of README.md and docs/sql.md: one row per rule with its SQL mask family and defaults."""
    rows = ["| rule | SQL mask family | defaults | what it does |", "|---|---|---|---|"]
    for name in list_losses():
        rule = _REGISTRY[name]
        family = "-" if rule.sql is None else f"`{rule.sql.family}`" + (" (sequence)" if rule.sql.sequence else "")
        defaults = ", ".join(f"{k}={v!r}" for k, v in rule.defaults.items()) or "-"
        summary = " ".join(rule.doc.split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {family} | {defaults} | {summary} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# validation


def _validate_params(rule: str, params: dict[str, Any]) -> None:
    """Reject parameters no rule can use, naming the argument and its value."""

    def bad(arg: str, why: str) -> ValueError:
        return ValueError(f"loss rule {rule!r}: {arg}={params[arg]!r} {why}")

    for arg, value in params.items():
        if arg in ("delta", "eps_high", "is_cap", "dual_clip", "alpha_low", "alpha_high", "low", "high", "w_min",
                   "delta_b") and value is not None:
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
        if arg == "low" and value < 0:
            raise bad(arg, "must be >= 0 (the lowest ratio kept)")
        if arg == "high" and "low" in params and value <= params["low"]:
            raise bad(arg, f"must be > low={params['low']!r}")
        if arg == "w_min" and not 0 < value <= 1:
            raise bad(arg, "must be in (0, 1]: the last position's weight")
        if arg == "delta_b" and value < 0:
            raise bad(arg, "must be >= 0 (the prefix budget's floor)")


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
    """PPO's mask on a ratio ``r``: block A > 0 with r > 1 + eps_high, and A <= 0 with r < 1 - eps_low (A = 0
    takes the negative branch, as in DPPO)."""
    block = ((adv > 0) & (r > 1 + eps_high)) | ((adv <= 0) & (r < 1 - eps_low))
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


def policy_loss(batch: PolicyBatch, keep: Tensor, w: Tensor, gate: Tensor | None = None) -> LossOutput:
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
    return LossOutput(loss=loss, keep=keep, metrics=trust_region_metrics(batch, keep, w))


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


# ---------------------------------------------------------------------------------------------------------------
# the terms the masks read, shared by every rule of a batch


DELTA_TV = 0.15
DELTA_KL = 0.05
EPS_LOW = 0.2
EPS_HIGH = 0.28
TIS_CAP = 2.0
NO_CAP = math.inf
GSPO_MAX_LOG_RATIO = 10.0

_DIVERGENCES: dict[str, tuple[str, str]] = {
    "binary_tv": ("binary_tv", "old_binary_tv"),
    "binary_kl": ("binary_kl", "old_binary_kl"),
    "topk_tv": ("topk_tv", "topk_tv"),
    "topk_kl": ("topk_kl", "topk_kl"),
}
"""The divergences a DPPO rule can gate on: the :class:`MaskTerms` term anchored on mu, and on pi_old (top-K
divergences have mu's lists only, so they stay anchored on mu)."""


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

    def divergence(self, name: str, anchor: str = "mu") -> Tensor:
        """The divergence ``name`` (:data:`_DIVERGENCES`) between ``anchor`` ('mu' or 'old') and pi."""
        return getattr(self, _DIVERGENCES[name][anchor == "old"])


def _present(batch: PolicyBatch, given: dict[str, Tensor] | None) -> set[str]:
    """The PolicyBatch fields a mask can read: those not None, and the top-K lists when both top-K divergences are
    given (then the lists are not read)."""
    present = {f for f in PolicyBatch.__dataclass_fields__ if getattr(batch, f) is not None}
    if set(given or {}) >= MaskTerms.GIVEN:
        present |= {"mu_topk_logprobs", "pi_topk_logprobs"}
    return present


def rules_with_inputs(batch: PolicyBatch, given: dict[str, Tensor] | None = None) -> list[str]:
    """The registered rules whose inputs ``batch`` (with ``given``, see :class:`MaskTerms`) holds, sorted."""
    present = _present(batch, given)
    return [name for name in list_losses() if get_loss(name).needs <= present]


def keep_masks(batch: PolicyBatch, rules: Iterable[str] | None = None, *,
               params: dict[str, dict[str, Any]] | None = None,
               given: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Every named rule's keep-mask M ``(B, T)`` (padding False) on one batch, without its loss or metrics.

    The same masks as ``get_loss(name)(batch, **params[name]).keep``, computed under ``torch.no_grad`` (not
    ``inference_mode``: a caller may use the masks in a loss it backpropagates) from one :class:`MaskTerms`, so
    the rules share their ratios, divergences and sequence context (the summaries compute every registered rule's
    mask over every logged token this way). ``rules``: registered names (default: all); ``params``: per rule,
    overrides of its defaults; ``given``: see :class:`MaskTerms`. The batch is checked once; a rule registered
    without a mask function runs whole, its ``keep`` taken.
    """
    names = list_losses() if rules is None else list(rules)
    params = params or {}
    chosen = {name: get_loss(name) for name in names}
    _check_batch(batch)
    present = _present(batch, given)
    out = {}
    with torch.no_grad():
        terms = MaskTerms(batch, given)
        for name, rule in chosen.items():
            merged = rule.resolve(**params.get(name, {}))
            missing = sorted(rule.needs - (present if rule.mask is not None else _present(batch, None)))
            if missing:
                raise ValueError(f"loss rule {name!r} needs PolicyBatch.{missing[0]}, which is None")
            if rule.mask is None:
                out[name] = rule.fn(batch, **merged).keep
                continue
            keep = rule.mask(terms, **{p: merged[p] for p in rule.mask_params})
            out[name] = keep & terms.valid
    return out


# ---------------------------------------------------------------------------------------------------------------
# the rules: each a mask function M(terms, params) -> (B, T) bool keep, and the loss that uses it


def mask_pg_is(t: MaskTerms) -> Tensor:
    """No trust region: every token kept."""
    return torch.ones_like(t.valid)


@register_loss("pg_is", sql=NO_MASK, mask=mask_pg_is, is_cap=NO_CAP)
def pg_is(batch: PolicyBatch, is_cap: float) -> LossOutput:
    """PG-IS: no trust region, untruncated importance weight pi/mu."""
    return policy_loss(batch, mask_pg_is(MaskTerms(batch)), is_weight(batch.pi_logprob, batch.mu_logprob, is_cap))


@register_loss("cispo", sql=NO_MASK, mask=mask_pg_is, is_cap=TIS_CAP)
def cispo(batch: PolicyBatch, is_cap: float) -> LossOutput:
    """PG-TIS (CISPO): no mask, importance weight truncated at C = ``is_cap``."""
    return pg_is(batch, is_cap=is_cap)


register_loss(
    "token_tis", sql=NO_MASK, mask=mask_pg_is, is_cap=TIS_CAP,
    doc="Token-level TIS (verl rollout correction, rollout_is='token', threshold 2): no mask, weight min(pi/mu, C).",
)(cispo)


def mask_ppo_clip(t: MaskTerms, eps_low: float, eps_high: float, dual_clip: float | None) -> Tensor:
    """PPO's clip on r = pi/mu, and dual-clip's block of A <= 0 with r > c."""
    keep = ppo_keep(t.ratio, t.advantage, eps_low, eps_high)  # (B, T)
    if dual_clip is not None:
        keep = keep & ~((t.advantage <= 0) & (t.ratio > dual_clip))
    return keep


@register_loss("ppo_clip", sql=RATIO_CLIP_MU, mask=mask_ppo_clip, eps_low=EPS_LOW, eps_high=EPS_HIGH,
               dual_clip=None, is_cap=NO_CAP)
def ppo_clip(batch: PolicyBatch, eps_low: float, eps_high: float, dual_clip: float | None, is_cap: float) -> LossOutput:
    """PPO / GRPO ratio clip on r = pi/mu (defaults: Clip-Higher, eps 0.2 / 0.28).

    ``dual_clip`` (c > 1): dual-clip PPO also blocks negative-advantage tokens with r > c (its objective is the
    constant c * A there, so they carry no gradient). None turns it off.
    """
    keep = mask_ppo_clip(MaskTerms(batch), eps_low, eps_high, dual_clip)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob, is_cap))


register_loss("grpo", sql=RATIO_CLIP_MU, mask=mask_ppo_clip,
              doc="GRPO: the symmetric PPO ratio clip on r = pi/mu (eps 0.2 / 0.2).",
              eps_low=EPS_LOW, eps_high=EPS_LOW, dual_clip=None, is_cap=NO_CAP)(ppo_clip)


def mask_minirl(t: MaskTerms, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on pi/pi_old."""
    return ppo_keep(t.old_ratio, t.advantage, eps_low, eps_high)


@register_loss("minirl", sql=RATIO_CLIP_OLD, mask=mask_minirl, needs=("old_logprob",), eps_low=EPS_LOW,
               eps_high=EPS_HIGH, is_cap=NO_CAP)
def minirl(batch: PolicyBatch, eps_low: float, eps_high: float, is_cap: float) -> LossOutput:
    """MiniRL (decoupled PPO): the clip mask on pi/pi_old (recomputed), IS weight pi/mu."""
    keep = mask_minirl(MaskTerms(batch), eps_low, eps_high)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob, is_cap))


register_loss("minirl_tis", sql=RATIO_CLIP_OLD, mask=mask_minirl, needs=("old_logprob",),
              doc="MiniRL-TIS: MiniRL with the IS weight truncated at C.",
              eps_low=EPS_LOW, eps_high=EPS_HIGH, is_cap=TIS_CAP)(minirl)


def mask_dppo(t: MaskTerms, divergence: str, delta: float) -> Tensor:
    """DPPO's mask on D(mu, pi) with mu as the anchor."""
    return dppo_keep(t.divergence(divergence), t.pi_logprob, t.mu_logprob, t.advantage, delta)


@register_loss("dppo_binary_tv", sql=DPPO_MU, mask=mask_dppo, doc="DPPO gated on binary TV |pi - mu| > delta.",
               divergence="binary_tv", delta=DELTA_TV)
def dppo(batch: PolicyBatch, divergence: str, delta: float) -> LossOutput:
    """DPPO: block a token only when D(mu, pi) > delta and pi moved past mu the way A pushes."""
    keep = mask_dppo(MaskTerms(batch), divergence, delta)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob))


register_loss("dppo_binary_kl", sql=DPPO_MU, mask=mask_dppo, doc="DPPO gated on binary KL(mu || pi) > delta.",
              divergence="binary_kl", delta=DELTA_KL)(dppo)
register_loss("dppo_topk_tv", sql=DPPO_MU, mask=mask_dppo, needs=("mu_topk_logprobs", "pi_topk_logprobs"),
              doc="DPPO gated on top-K TV > delta.", divergence="topk_tv", delta=DELTA_TV)(dppo)
register_loss("dppo_topk_kl", sql=DPPO_MU, mask=mask_dppo, needs=("mu_topk_logprobs", "pi_topk_logprobs"),
              doc="DPPO gated on top-K KL > delta.", divergence="topk_kl", delta=DELTA_KL)(dppo)


def mask_dppo_decoupled(t: MaskTerms, divergence: str, delta: float) -> Tensor:
    """DPPO's mask with the divergence and the anchor taken against pi_old."""
    if divergence not in ("binary_tv", "binary_kl"):
        raise ValueError(f"dppo_decoupled: divergence={divergence!r}; only binary_tv and binary_kl have a pi_old anchor")
    return dppo_keep(t.divergence(divergence, "old"), t.pi_logprob, t.old_logprob, t.advantage, delta)


@register_loss("dppo_decoupled", sql=DPPO_OLD, mask=mask_dppo_decoupled, needs=("old_logprob",),
               divergence="binary_kl", delta=DELTA_KL)
def dppo_decoupled(batch: PolicyBatch, divergence: str, delta: float) -> LossOutput:
    """DPPO decoupled (ablation): the DPPO mask anchored on the recomputed pi_old instead of mu; weight pi/mu."""
    keep = mask_dppo_decoupled(MaskTerms(batch), divergence, delta)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob))


def mask_ppo_lowprob_relax(t: MaskTerms, eps_low: float, eps_high: float, alpha_low: float,
                           alpha_high: float) -> Tensor:
    """PPO's clip on r = pi/mu, each side only where mu >= that side's alpha."""
    adv, r, mu = t.advantage, t.ratio, t.mu_prob
    block = ((adv > 0) & (r > 1 + eps_high) & (mu >= alpha_high)) | ((adv <= 0) & (r < 1 - eps_low) & (mu >= alpha_low))
    return ~block


@register_loss("ppo_lowprob_relax", sql=LOWPROB_RELAX, mask=mask_ppo_lowprob_relax, eps_low=EPS_LOW,
               eps_high=EPS_HIGH, alpha_low=0.1, alpha_high=0.1)
def ppo_lowprob_relax(batch: PolicyBatch, eps_low: float, eps_high: float, alpha_low: float,
                      alpha_high: float) -> LossOutput:
    """PPO clip that never clips a side for tokens with mu < alpha (alpha per side; 0 turns a side's relief off)."""
    keep = mask_ppo_lowprob_relax(MaskTerms(batch), eps_low, eps_high, alpha_low, alpha_high)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob))


def mask_minimal_negative(t: MaskTerms, delta: float) -> Tensor:
    """Block A <= 0 where mu - pi >= delta."""
    return ~((t.advantage <= 0) & (t.mu_prob - t.pi_prob >= delta))


@register_loss("minimal_negative_mask", sql=NEGATIVE_MASK, mask=mask_minimal_negative, delta=0.5)
def minimal_negative_mask(batch: PolicyBatch, delta: float) -> LossOutput:
    """Mask-delta: block only negative-advantage tokens that pi pushed down from mu by at least delta."""
    keep = mask_minimal_negative(MaskTerms(batch), delta)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob))


def mask_ratio_band(t: MaskTerms, low: float, high: float) -> Tensor:
    """Keep low <= r <= high, r = pi/mu."""
    return (t.ratio >= low) & (t.ratio <= high)


@register_loss("token_mis", sql=RATIO_BAND, mask=mask_ratio_band, low=0.5, high=2.0)
def token_mis(batch: PolicyBatch, low: float, high: float) -> LossOutput:
    """Token-level masked IS (MIS): drop tokens whose r = pi/mu leaves [low, high], either advantage sign.

    Source: verl ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask`` with
    ``rollout_rs="token_k1"`` and a ``"lower_upper"`` threshold (here on r = pi/mu; the weight stays pi/mu on the
    kept tokens, bypass mode). Kept iff low <= r <= high.
    """
    return policy_loss(batch, mask_ratio_band(MaskTerms(batch), low, high), is_weight(batch.pi_logprob, batch.mu_logprob))


register_loss(
    "icepop", sql=RATIO_BAND, mask=mask_ratio_band, low=0.5, high=5.0,
    doc="IcePop: drop tokens with r = pi/mu outside [alpha, beta] = [0.5, 5] (Ling Team, Ring-1T report, "
        "arXiv 2510.18855, IcePop; INTELLECT-3 report, arXiv 2512.16144, eq. 1).",
)(token_mis)


def _gspo_ratio(t: MaskTerms) -> Tensor:
    """GSPO's sequence ratio s = exp(mean_t log(pi/mu)), the mean clamped at 10 first: ``(B, T)``."""
    return torch.exp(t.seq_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO))


def mask_gspo(t: MaskTerms, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on the sequence ratio s: a whole response is kept or blocked together."""
    return ppo_keep(_gspo_ratio(t), t.advantage, eps_low, eps_high)


@register_loss("gspo", sql=SEQ_RATIO_CLIP, mask=mask_gspo, eps_low=3e-4, eps_high=4e-4)
def gspo(batch: PolicyBatch, eps_low: float, eps_high: float) -> LossOutput:
    """GSPO: PPO's clip on the sequence ratio s = exp(mean_t log(pi/mu)), weight s on every token of the response.

    Source: Zheng et al., Group Sequence Policy Optimization (arXiv 2507.18071), eq. 5-7 (s_i, the length-normalised
    sequence ratio); defaults eps 3e-4 / 4e-4 from its section 5.1. Reference implementation: verl
    ``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_gspo`` (the mean log-ratio clamped at 10 before exp).
    Anchored on mu here (the rollout policy, as the rest of trustscope). A whole response is blocked together:
    A > 0 with s > 1 + eps_high, A <= 0 with s < 1 - eps_low.
    """
    terms = MaskTerms(batch)
    return policy_loss(batch, mask_gspo(terms, eps_low, eps_high), _gspo_ratio(terms))


def mask_geo_mask(t: MaskTerms, low: float, high: float) -> Tensor:
    """Keep a response while its geometric-mean ratio exp(mean_t log(pi/mu)) stays in [low, high]."""
    g = torch.exp(t.seq_log_ratio)  # (B, T)
    return (g >= low) & (g <= high)


@register_loss("geo_mask", sql=SEQ_GEO_BAND, mask=mask_geo_mask, low=0.999, high=1.001)
def geo_mask(batch: PolicyBatch, low: float, high: float) -> LossOutput:
    """Geometric-mean sequence masking: drop a whole response when exp(mean_t log(pi/mu)) leaves [low, high].

    Source: verl ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask`` option
    ``seq_mean_k1`` (preset ``RolloutCorrectionConfig.decoupled_geo_rs``, bounds ``"0.999_1.001"``); verl bounds
    the mean of log(mu/pi), here its reciprocal, the geometric mean of r = pi/mu. Weight pi/mu per token.
    """
    return policy_loss(batch, mask_geo_mask(MaskTerms(batch), low, high), is_weight(batch.pi_logprob, batch.mu_logprob))


def mask_cppo(t: MaskTerms, delta: float, w_min: float, delta_b: float) -> Tensor:
    """CPPO's mask: the position-weighted binary TV against a threshold with the response's prefix budget."""
    valid = t.valid
    div = t.binary_tv  # (B, T)
    pos = (valid.cumsum(-1) - 1).clamp_min(0).to(div.dtype)  # (B, T) position among the valid tokens
    last = (valid.sum(-1, keepdim=True) - 1).to(div.dtype)  # (B, 1) L - 1
    w = torch.where(valid, w_min + (1 - w_min) * (last - pos) / last.clamp_min(1), 0.0)  # (B, T)
    z = torch.where(valid, w * div, 0.0)  # (B, T)
    spent = torch.cumsum(z, -1) - z  # (B, T) S: weighted divergence of the prefix before the token
    weight = torch.cumsum(w, -1) - w  # (B, T) W
    p90 = torch.nanquantile(torch.where(valid, div, math.nan), 0.9, dim=-1, keepdim=True)  # (B, 1)
    budget = p90.clamp(min=delta_b, max=2 * delta_b)
    threshold = torch.minimum(torch.full_like(z, delta), delta + budget * weight - spent)
    adv, pi_lp, mu_lp = t.advantage, t.pi_logprob, t.mu_logprob
    harmful = ((adv > 0) & (pi_lp > mu_lp)) | ((adv <= 0) & (pi_lp < mu_lp))
    return ~(harmful & (z > threshold))


@register_loss("cppo", sql=CPPO_PREFIX, mask=mask_cppo, delta=DELTA_TV, w_min=0.8, delta_b=0.02)
def cppo(batch: PolicyBatch, delta: float, w_min: float, delta_b: float) -> LossOutput:
    """CPPO: DPPO's mask with a position-weighted threshold and a cumulative prefix budget.

    Source: Mao, Zhou, Tao et al., Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning (CPPO,
    arXiv 2606.10968), mask Eq. 8-11 and the dynamic budget Eq. 22; reference implementation: Tencent-Hunyuan UniRL
    ``unirl/algorithms/cppo.py``, ``_cppo_mask`` (as its ``CPPO/README.md`` states it), which ships the binary-TV
    variant, as here: D = |pi - mu|. For a response of L tokens, position s = 0 .. L-1: w_s = w_min + (1 - w_min) (L - 1 - s) / max(L - 1, 1), Z_s = w_s D_s, prefix
    sums S = sum_{j<s} Z_j and W = sum_{j<s} w_j, the response's budget b = clamp(P90(D), delta_b, 2 delta_b),
    threshold c_s = min(delta, delta + b W - S). A token is blocked when pi moved the way A pushes (DPPO's
    direction test, A = 0 in the negative branch) and Z_s > c_s. Defaults: the paper's dense-model delta 0.15,
    w_min 0.8, delta_b 0.02.
    """
    keep = mask_cppo(MaskTerms(batch), delta, w_min, delta_b)
    return policy_loss(batch, keep, is_weight(batch.pi_logprob, batch.mu_logprob))


def _drpo_gain(t: MaskTerms, delta: float) -> Tensor:
    """DRPO's gradient scale g = 1 - sign(A) (pi - mu) / delta, sign(A) = -1 for A <= 0: ``(B, T)``."""
    if delta <= 0:
        raise ValueError(f"loss rule 'drpo': delta={delta!r} must be > 0")
    shift = t.pi_prob - t.mu_prob  # (B, T)
    sign = torch.where(t.advantage > 0, 1.0, -1.0).to(shift.dtype)  # (B, T)
    return 1 - sign * shift / delta


def mask_drpo(t: MaskTerms, delta: float) -> Tensor:
    """What DRPO 'blocks': where its penalty cancelled or reversed the push, g <= 0."""
    return _drpo_gain(t, delta) > 0


@register_loss("drpo", sql=DRPO_PENALTY, mask=mask_drpo, delta=DELTA_TV)
def drpo(batch: PolicyBatch, delta: float) -> LossOutput:
    """DRPO: DPPO's binary-TV geometry as a smooth advantage-weighted penalty, not a hard mask.

    Source: Yao, Zhou, Qi et al., Rethinking the Divergence Regularization in LLM RL (DRPO, arXiv 2606.09821),
    objective Eq. 8 and weight Table 1: L = r A - |A| mu (r - 1)^2 / (2 delta); reference implementation:
    Tencent-Hunyuan UniRL ``unirl/algorithms/drpo.py``, ``_drpo_loss``. Its gradient is the policy gradient scaled
    by g = 1 - sign(A) (pi - mu) / delta: g = 1 on the anchor, 0 on the DPPO boundary in the harmful direction,
    negative (corrective) beyond it, above 1 when pi moved back toward mu; bounded by 1 +- 1/delta since
    |pi - mu| <= 1 (sign(A) = -1 for A <= 0). Implemented as w = (pi/mu) * g on every valid token. The default
    delta is DPPO's binary-TV threshold, the geometry DRPO keeps (UniRL's 4B recipe sets its epsilon to 12.5,
    where g stays within 1 +- 0.08 and nothing ever counts as blocked).

    No hard mask gates the loss. What "blocked" means for DRPO, here and in the SQL views: the penalty has
    cancelled or reversed the push, g <= 0, i.e. A > 0 with pi - mu >= delta or A <= 0 with mu - pi >= delta.
    ``keep`` reports g > 0; blocked tokens still get their (corrective) gradient.
    """
    g = _drpo_gain(MaskTerms(batch), delta)
    w = is_weight(batch.pi_logprob, batch.mu_logprob) * g
    return policy_loss(batch, g > 0, w, gate=batch.mask.bool())

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
