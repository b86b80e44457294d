"""Trust-region rules, registered by name: the rule catalogue. Imports no torch.

A rule is declared once, with :func:`register_loss`: its keep-mask ``M`` (a pure function over the per-token
terms, :class:`~trustscope.policy.MaskTerms`), its importance weight ``w``, its SQL mask family, and its parameters
with their defaults and bounds. The registry builds the loss, the one form the paper's authors implement::

    loss_t = -A_t * sg(w_t) * M_t * log pi_t,    w_t = min(exp(min(log pi_t - log mu_t, 20)), C)

    register_loss("my_rule", sql=DPPO_MU, mask=mask_dppo, doc="DPPO on binary TV at 0.1.",
                  divergence=Param("binary_tv", choices=tuple(DIVERGENCES)), delta=Param(0.1, low=0))
    register_loss("my_preset", like=get_loss("ppo_clip"), eps_high=0.4)     # another rule's form, other defaults

Rules differ in the mask (what it looks at, what it is anchored to), the weight and, for the sequence-level
rules, the context they read (the whole response). The trainer looks rules up with :func:`get_loss` (a registered
name, or a dotted path ``pkg.module:rule`` that imports the user's module); nothing picks a rule with if/elif. A
user's rule registers exactly like the built-ins and names its SQL mask family, so that the query layer
(:mod:`trustscope.db`) shows it beside the others with no SQL of its own. A rule whose loss is not of the shared
form registers its own function with the decorator form, ``@register_loss(name, **params)``.

The catalogue is one place: :func:`list_losses` feeds the trainer, the ``blocks_<rule>`` columns of the SQL view
``rule_blocks`` and every per-rule aggregate, the data contracts, the SQL parity tests and the docs' rule table.
This module reads no tensor itself: the masks and weights use tensor methods on the terms they are handed, and
torch is imported by :mod:`trustscope.policy` (the layer below, which knows no registry) when a rule is called or
:func:`keep_masks` runs. ``PolicyBatch``, ``LossOutput``, ``MaskTerms`` and ``aggregate`` live there.

**The A = 0 convention** (one for every rule, the paper authors'): a token with zero advantage takes the negative
branch of a mask (``A <= 0``); DPPO's mask says so in PAPER.md, and the ratio rules follow it. Such a token carries
no gradient whatever the mask says (its loss is ``-0 * w * log pi``), so every blocked fraction, here
(``policy/blocked_frac*``) and in the SQL views, is counted over the tokens that carry gradient (``A != 0``), with
the token count beside it, as verl's ``pg_clipfrac`` effectively does (a zero-advantage token is never "clipped").

Precision: masks, weights and the loss are computed in float32 whatever the input dtype (float64 stays float64), so
a bf16 ``pi_logprob`` gives a float32 loss. Masks from bf16 inputs equal the float32 masks except on tokens within
the bf16 band at a threshold, defined in :mod:`trustscope.divergence` (``BF16_BAND_RTOL``).
Padding (``mask`` False) may hold any value, even inf or NaN: it never reaches the loss, its gradient or a metric.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# The mask families (:mod:`trustscope.masks`: each family's torch mask, score, SQL declaration and SQL macros in
# one place) and the built-in rules' pieces from them; a user's rule of the same kind names one of these.
from trustscope.masks.cppo import CPPO_PREFIX, mask_cppo
from trustscope.masks.dppo import DPPO_MU, DPPO_OLD, mask_dppo, mask_dppo_decoupled
from trustscope.masks.drpo import DRPO_PENALTY, mask_drpo, weight_drpo
from trustscope.masks.family import (
    DIVERGENCES,
    IDENTIFIER,
    SqlMask,
    Threshold,
    is_number,
)
from trustscope.masks.lowprob_relax import LOWPROB_RELAX, mask_ppo_lowprob_relax
from trustscope.masks.negative_mask import NEGATIVE_MASK, mask_minimal_negative
from trustscope.masks.none import NO_MASK, mask_pg_is
from trustscope.masks.ratio_band import RATIO_BAND, mask_ratio_band
from trustscope.masks.ratio_clip import RATIO_CLIP_MU, RATIO_CLIP_OLD, mask_minirl, mask_ppo_clip
from trustscope.masks.seq_geo_band import SEQ_GEO_BAND, mask_geo_band
from trustscope.masks.seq_ratio_clip import SEQ_RATIO_CLIP, mask_gspo, weight_gspo

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import LossOutput, MaskTerms, PolicyBatch

RuleFn = Callable[..., "LossOutput"]
MaskFn = Callable[..., "Tensor"]
"""``mask(terms: MaskTerms, **params) -> (B, T) bool``: True where the token's gradient is kept."""
WeightFn = Callable[..., "Tensor"]
"""``weight(terms: MaskTerms, **params) -> (B, T)``: the importance weight ``w``, detached."""

POLICY_NAMES = frozenset({"PolicyBatch", "LossOutput", "MaskTerms", "aggregate", "AGGREGATIONS", "policy_loss",
                          "is_weight", "trust_region_metrics", "rule_loss"})
"""The torch side of the catalogue (:mod:`trustscope.policy`), reachable from here by name."""


def __getattr__(name: str) -> Any:
    """``trustscope.losses.PolicyBatch`` and the other :data:`POLICY_NAMES`: imported from
    :mod:`trustscope.policy` (and so torch) on first use."""
    if name in POLICY_NAMES:
        return getattr(importlib.import_module("trustscope.policy"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------------------------
# parameters: each rule declares what each of its parameters accepts


@dataclass(frozen=True)
class Param:
    """One rule parameter: its default and what it accepts, declared with the rule (never shared by name).

    A number in ``[low, high]`` (``low_open`` / ``high_open`` exclude the bound; ``above``: greater than another
    parameter of the same rule), one of ``choices``, or None where ``optional``. ``why`` replaces the generated
    reason in the error, which always names the rule, the parameter and the value.
    """

    default: Any
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    above: str | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False
    why: str | None = None

    def bounds(self) -> str:
        """What the parameter accepts, in words: ``[0, 1)``, ``> low``, ``one of [...]``."""
        if self.choices is not None:
            return f"one of {sorted(self.choices)}" + (" or None" if self.optional else "")
        if self.low is None and self.high is None:
            if self.above is not None:
                return f"> {self.above}" + (" or None" if self.optional else "")
            return "any value" if not is_number(self.default) else "any number"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        text = f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high_open or self.high is None else ']'}"
        text += f" and > {self.above}" if self.above else ""
        return text + (" or None" if self.optional else "")

    def check(self, rule: str, name: str, params: Mapping[str, Any]) -> None:
        """Raise ValueError naming ``rule``, the parameter and its value when ``params[name]`` is not accepted."""
        value = params[name]

        def bad(reason: str) -> ValueError:
            return ValueError(f"loss rule {rule!r}: {name}={value!r} {self.why or reason}")

        if value is None:
            if self.optional:
                return
            raise bad("must be set")
        if self.choices is not None:
            if value not in self.choices:
                raise bad(f"is not one of {sorted(self.choices)}")
            return
        if not is_number(self.default) and self.low is None and self.high is None and self.above is None:
            return  # a plain value of a user's rule: nothing declared to check
        if not is_number(value) or math.isnan(value):
            raise ValueError(f"loss rule {rule!r}: {name}={value!r} must be a number")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise bad(f"must be {'>' if self.low_open else '>='} {self.low}")
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            raise bad(f"must be {'<' if self.high_open else '<='} {self.high}")
        if self.above is not None and is_number(params.get(self.above)) and value <= params[self.above]:
            raise ValueError(f"loss rule {rule!r}: {name}={value!r} must be > {self.above}={params[self.above]!r}")


DELTA_TV = 0.15
DELTA_KL = 0.05
EPS_LOW = 0.2
EPS_HIGH = 0.28
TIS_CAP = 2.0
NO_CAP = math.inf


def eps_low(default: float = EPS_LOW) -> Param:
    return Param(default, low=0, high=1, high_open=True, why="must be in [0, 1): the low clip bound is 1 - eps_low")


def eps_high(default: float = EPS_HIGH) -> Param:
    return Param(default, low=0)


def is_cap(default: float = NO_CAP) -> Param:
    return Param(default, low=0, low_open=True, why="must be > 0 (use math.inf for no truncation)")


def delta(default: float) -> Param:
    return Param(default, low=0)


def divergence(default: str, choices: tuple[str, ...] = tuple(DIVERGENCES)) -> Param:
    return Param(default, choices=choices)


def probability(default: float) -> Param:
    return Param(default, low=0, high=1, why="must be a probability in [0, 1]")


def ratio_band(low: float, high: float) -> dict[str, Param]:
    """The ``low`` / ``high`` bounds of a kept band of ratios."""
    return {"low": Param(low, low=0, why="must be >= 0 (the lowest ratio kept)"), "high": Param(high, above="low")}


# ---------------------------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class LossRule:
    """A registered rule: its parameters, its mask and weight (or its own loss function), its SQL mask family.

    Call it like a loss: ``rule(batch, **params) -> LossOutput`` (imports :mod:`trustscope.policy`, so torch).
    ``gate``: where the loss applies, ``"keep"`` (its mask: a hard trust region) or ``"valid"`` (every real token:
    a smooth rule such as DRPO, whose mask only reports what it cancelled).
    """

    name: str
    params: Mapping[str, Param]
    needs: frozenset[str]
    doc: str
    sql: SqlMask | None = None
    mask: MaskFn | None = None
    weight: WeightFn | None = None
    gate: str = "keep"
    loss: RuleFn | None = None
    mask_params: tuple[str, ...] = ()
    weight_params: tuple[str, ...] = ()

    @property
    def threshold(self) -> Threshold | None:
        """The rule's scalar threshold (its SQL mask family's), or None: see :class:`Threshold`."""
        return self.sql.threshold if self.sql is not None else None

    @property
    def defaults(self) -> dict[str, Any]:
        """Every parameter's default."""
        return {name: p.default for name, p in self.params.items()}

    def resolve(self, **params: Any) -> dict[str, Any]:
        """The defaults overridden by ``params``, validated: errors name the parameter and its value."""
        unknown = set(params) - set(self.params)
        if unknown:
            raise TypeError(
                f"loss rule {self.name!r} got unknown parameter(s) {sorted(unknown)}; "
                f"its parameters are {sorted(self.params)}"
            )
        merged = {**self.defaults, **params}
        for name, spec in self.params.items():
            spec.check(self.name, name, merged)
        return merged

    def __call__(self, batch: PolicyBatch, *, metrics: bool = True, **params: Any) -> LossOutput:
        from trustscope.policy import rule_loss

        return rule_loss(self, batch, self.resolve(**params), metrics=metrics)


_REGISTRY: dict[str, LossRule] = {}
_GATES = ("keep", "valid")


def register_loss(name: str, *, mask: MaskFn | None = None, weight: WeightFn | None = None,
                  like: LossRule | None = None, sql: SqlMask | None = None, needs: tuple[str, ...] | None = None,
                  doc: str | None = None, gate: str | None = None, **params: Any) -> Any:
    """Register rule ``name`` (lowercase letters, digits and '_': it names a SQL column) and return it.

    - ``register_loss(name, mask=..., weight=..., **params)``: the loss is built from the keep-mask
      ``mask(terms, **some params) -> (B, T) bool`` and the weight ``weight(terms, **some params)`` (default
      :func:`weight_is`, pi/mu truncated at the rule's ``is_cap`` when it has one).
    - ``register_loss(name, like=rule, **params)``: ``rule``'s mask, weight, SQL family and parameter bounds,
      with other defaults (a preset). ``register_loss(name, **params)(rule)`` is the same.
    - ``@register_loss(name, **params)`` on a function ``fn(batch, **params) -> LossOutput``: a rule with a loss of
      its own (its ``keep`` is what the views count as blocked only if ``sql`` names a family).

    ``params``: each parameter's default, as a :class:`Param` (its bounds) or a plain value. ``sql``: the rule's
    mask family (:class:`SqlMask`): with it the rule gets a ``blocks_<name>`` column in the SQL views; without it
    the rule trains but the query layer cannot show what it would block. ``needs``: the optional ``PolicyBatch``
    fields the rule reads. ``doc``: the one-line summary (default: the first paragraph of the mask's or the
    function's docstring).
    """
    if like is not None:
        return _register_like(name, like, mask=mask, weight=weight, sql=sql, needs=needs, doc=doc, gate=gate,
                              params=params)
    if mask is None:

        def decorator(fn: RuleFn | LossRule) -> RuleFn | LossRule:
            if isinstance(fn, LossRule):
                return _register_like(name, fn, mask=None, weight=weight, sql=sql, needs=needs, doc=doc, gate=gate,
                                      params=params)
            signature = set(inspect.signature(fn).parameters) - {"batch"}
            missing = signature - set(params)
            if missing:
                raise ValueError(f"loss rule {name!r}: no default for parameter(s) {sorted(missing)}")
            _add(LossRule(name, _params(params), frozenset(needs or ()), doc or _summary(fn), sql, gate=gate or "keep",
                          loss=fn))
            return fn

        return decorator
    weight = weight or weight_is
    return _add(LossRule(name, _params(params), frozenset(needs or ()), doc or _summary(mask), sql, mask, weight,
                         gate or "keep", mask_params=_takes(name, mask, params, "mask"),
                         weight_params=_takes(name, weight, params, "weight")))


def _register_like(name: str, like: LossRule, *, mask: MaskFn | None, weight: WeightFn | None, sql: SqlMask | None,
                   needs: tuple[str, ...] | None, doc: str | None, gate: str | None,
                   params: dict[str, Any]) -> LossRule:
    """A preset of ``like``: its form and bounds, the given defaults (and anything else given) on top."""
    unknown = set(params) - set(like.params)
    if unknown and like.loss is None:
        raise ValueError(f"loss rule {name!r}: like={like.name!r} has no parameter(s) {sorted(unknown)}; "
                         f"its parameters are {sorted(like.params)}")
    merged = dict(like.params)
    for key, value in params.items():
        merged[key] = value if isinstance(value, Param) or key not in merged else dataclasses.replace(
            merged[key], default=value)
    mask, weight = mask or like.mask, weight or like.weight
    rule = dataclasses.replace(
        like, name=name, params=merged, needs=like.needs if needs is None else frozenset(needs),
        doc=doc or like.doc, sql=like.sql if sql is None else sql, mask=mask, weight=weight, gate=gate or like.gate,
        mask_params=_takes(name, mask, merged, "mask") if mask else (),
        weight_params=_takes(name, weight, merged, "weight") if weight else ())
    return _add(rule)


def _params(params: Mapping[str, Any]) -> dict[str, Param]:
    return {k: v if isinstance(v, Param) else Param(v, optional=v is None) for k, v in params.items()}


def _summary(fn: Callable[..., Any]) -> str:
    return inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]


def _takes(rule: str, fn: Callable[..., Any], params: Mapping[str, Any], role: str) -> tuple[str, ...]:
    """The rule parameters ``fn`` (a mask or a weight: ``fn(terms, ...)``) takes; each one it takes without a
    default of its own must be a parameter of the rule."""
    taken = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.name in params:
            taken.append(p.name)
        elif p.default is inspect.Parameter.empty:
            raise ValueError(f"loss rule {rule!r}: {role} function {fn.__name__!r} takes parameter(s) {[p.name]} "
                             f"the rule does not have; its parameters are {sorted(params)}")
    return tuple(taken)


def _add(rule: LossRule) -> LossRule:
    """Check ``rule`` whole and enter it in the registry."""
    if not IDENTIFIER.fullmatch(rule.name):
        raise ValueError(f"loss rule name {rule.name!r} must match {IDENTIFIER.pattern} (it names a SQL column)")
    if rule.name in _REGISTRY:
        raise ValueError(f"loss rule {rule.name!r} is already registered")
    if rule.gate not in _GATES:
        raise ValueError(f"loss rule {rule.name!r}: gate={rule.gate!r} is not one of {list(_GATES)}")
    fields = set(POLICY_BATCH_FIELDS)
    if not rule.needs <= fields:
        raise ValueError(f"loss rule {rule.name!r}: needs={tuple(sorted(rule.needs))!r} names no PolicyBatch "
                         f"field(s); fields are {sorted(fields)}")
    if rule.sql is not None:
        unknown = [p for p in rule.sql.params if p is not None and p not in rule.params]
        if unknown:
            raise ValueError(f"loss rule {rule.name!r}: sql family {rule.sql.family!r} passes parameter(s) {unknown} "
                             f"the rule does not have; its parameters are {sorted(rule.params)}")
        if rule.sql.threshold is not None:
            unknown = [p for p, _ in rule.sql.threshold.scaled if p not in rule.params]
            if unknown:
                raise ValueError(f"loss rule {rule.name!r}: the threshold of sql family {rule.sql.family!r} scales "
                                 f"parameter(s) {unknown} the rule does not have; its parameters are "
                                 f"{sorted(rule.params)}")
    for name, spec in rule.params.items():
        spec.check(rule.name, name, rule.defaults)
    _REGISTRY[rule.name] = rule
    return rule


POLICY_BATCH_FIELDS = ("pi_logprob", "mu_logprob", "advantages", "mask", "old_logprob", "mu_topk_logprobs",
                       "pi_topk_logprobs")
"""The fields of :class:`~trustscope.policy.PolicyBatch` (a test holds them equal), for ``needs``."""


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
    found = getattr(module, attr, None)
    for rule in _REGISTRY.values():
        if found is not None and (rule is found or rule.loss is found):
            return rule
    raise KeyError(f"loss rule {name!r}: module {module_name!r} registers no rule named {attr!r} "
                   f"(register it with register_loss); valid names: {', '.join(sorted(_REGISTRY))}")


def list_losses() -> list[str]:
    """Names of every registered rule, sorted."""
    return sorted(_REGISTRY)


def catalogue_markdown() -> str:
    """The docs' rule table: one row per rule with its SQL mask family and defaults."""
    rows = ["| rule | SQL mask family | defaults | scalar threshold | what it does |", "|---|---|---|---|---|"]
    for name in list_losses():
        rule = _REGISTRY[name]
        family = "-" if rule.sql is None else f"`{rule.sql.family}`" + (" (sequence)" if rule.sql.sequence else "")
        defaults = ", ".join(f"{k}={v!r}" for k, v in rule.defaults.items()) or "-"
        summary = " ".join(rule.doc.split()).replace("|", "\\|")
        threshold = "-"
        if rule.threshold is not None:
            moved = [f"{p} ({'in log' if kind == 'power' else 'in proportion'})" for p, kind in rule.threshold.scaled
                     if p != rule.threshold.param]
            threshold = f"`{rule.threshold.param}`" + (f", moving {', '.join(moved)}" if moved else "")
        rows.append(f"| `{name}` | {family} | {defaults} | {threshold} | {summary} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# the pieces masks and weights share: tensor methods only, on the terms they are handed


def weight_is(t: MaskTerms, is_cap: float = NO_CAP) -> Tensor:
    """The importance weight pi/mu (its log clamped at 20), truncated at ``is_cap``."""
    return t.ratio.clamp(max=is_cap) if math.isfinite(is_cap) else t.ratio


# ---------------------------------------------------------------------------------------------------------------
# the rules: each a mask M(terms, params) -> (B, T) bool keep and a weight, declared once


pg_is = register_loss("pg_is", sql=NO_MASK, mask=mask_pg_is, is_cap=is_cap(NO_CAP),
                      doc="PG-IS: no trust region, untruncated importance weight pi/mu.")
cispo = register_loss("cispo", like=pg_is, is_cap=TIS_CAP,
                      doc="PG-TIS (CISPO): no mask, importance weight truncated at C = ``is_cap``.")
token_tis = register_loss(
    "token_tis", like=cispo,
    doc="Token-level TIS (verl rollout correction, rollout_is='token', threshold 2): no mask, weight min(pi/mu, C).")


ppo_clip = register_loss(
    "ppo_clip", sql=RATIO_CLIP_MU, mask=mask_ppo_clip, eps_low=eps_low(), eps_high=eps_high(),
    dual_clip=Param(None, low=1, low_open=True, optional=True, why="must be > 1 (or None to turn dual-clip off)"),
    is_cap=is_cap(),
    doc="PPO / GRPO ratio clip on r = pi/mu (defaults: Clip-Higher, eps 0.2 / 0.28).")
grpo = register_loss("grpo", like=ppo_clip, eps_high=EPS_LOW,
                     doc="GRPO: the symmetric PPO ratio clip on r = pi/mu (eps 0.2 / 0.2).")


minirl = register_loss("minirl", sql=RATIO_CLIP_OLD, mask=mask_minirl, needs=("old_logprob",), eps_low=eps_low(),
                       eps_high=eps_high(), is_cap=is_cap(),
                       doc="MiniRL (decoupled PPO): the clip mask on pi/pi_old (recomputed), IS weight pi/mu.")
minirl_tis = register_loss("minirl_tis", like=minirl, is_cap=TIS_CAP,
                           doc="MiniRL-TIS: MiniRL with the IS weight truncated at C.")


dppo = register_loss("dppo_binary_tv", sql=DPPO_MU, mask=mask_dppo, divergence=divergence("binary_tv"),
                     delta=delta(DELTA_TV), doc="DPPO gated on binary TV |pi - mu| > delta.")
register_loss("dppo_binary_kl", like=dppo, divergence="binary_kl", delta=DELTA_KL,
              doc="DPPO gated on binary KL(mu || pi) > delta.")
register_loss("dppo_topk_tv", like=dppo, needs=("mu_topk_logprobs", "pi_topk_logprobs"), divergence="topk_tv",
              doc="DPPO gated on top-K TV > delta.")
register_loss("dppo_topk_kl", like=dppo, needs=("mu_topk_logprobs", "pi_topk_logprobs"), divergence="topk_kl",
              delta=DELTA_KL, doc="DPPO gated on top-K KL > delta.")


dppo_decoupled = register_loss(
    "dppo_decoupled", sql=DPPO_OLD, mask=mask_dppo_decoupled, needs=("old_logprob",),
    divergence=Param("binary_kl", choices=("binary_tv", "binary_kl"),
                     why="must be binary_tv or binary_kl: only those have a pi_old anchor"),
    delta=delta(DELTA_KL),
    doc="DPPO decoupled (ablation): the DPPO mask anchored on the recomputed pi_old instead of mu; weight pi/mu.")


ppo_lowprob_relax = register_loss("ppo_lowprob_relax", sql=LOWPROB_RELAX, mask=mask_ppo_lowprob_relax, eps_low=eps_low(),
              eps_high=eps_high(), alpha_low=probability(0.1), alpha_high=probability(0.1),
              doc="PPO clip that never clips a side for tokens with mu < alpha (alpha per side; 0 turns a side's "
                  "relief off).")


minimal_negative_mask = register_loss("minimal_negative_mask", sql=NEGATIVE_MASK, mask=mask_minimal_negative, delta=delta(0.5),
              doc="Mask-delta: block only negative-advantage tokens that pi pushed down from mu by at least delta.")


token_mis = register_loss(
    "token_mis", sql=RATIO_BAND, mask=mask_ratio_band, **ratio_band(0.5, 2.0),
    doc="Token-level masked IS (MIS): drop tokens whose r = pi/mu leaves [low, high], either advantage sign.")
register_loss("icepop", like=token_mis, low=0.5, high=5.0,
              doc="IcePop: drop tokens with r = pi/mu outside [alpha, beta] = [0.5, 5] (Ling Team, Ring-1T report, "
                  "arXiv 2510.18855, IcePop; INTELLECT-3 report, arXiv 2512.16144, eq. 1).")


gspo = register_loss("gspo", sql=SEQ_RATIO_CLIP, mask=mask_gspo, weight=weight_gspo, eps_low=eps_low(3e-4),
              eps_high=eps_high(4e-4),
              doc="GSPO: PPO's clip on the sequence ratio s = exp(mean_t log(pi/mu)), weight s on every token of "
                  "the response.")


geo_mask = register_loss("geo_mask", sql=SEQ_GEO_BAND, mask=mask_geo_band, **ratio_band(0.999, 1.001),
              doc="Geometric-mean sequence masking: drop a whole response when exp(mean_t log(pi/mu)) leaves "
                  "[low, high].")


cppo = register_loss("cppo", sql=CPPO_PREFIX, mask=mask_cppo, delta=delta(DELTA_TV),
              w_min=Param(0.8, low=0, low_open=True, high=1, why="must be in (0, 1]: the last position's weight"),
              delta_b=Param(0.02, low=0, why="must be >= 0 (the prefix budget's floor)"),
              doc="CPPO: DPPO's mask with a position-weighted threshold and a cumulative prefix budget.")


drpo = register_loss("drpo", sql=DRPO_PENALTY, mask=mask_drpo, weight=weight_drpo, gate="valid",
              delta=Param(DELTA_TV, low=0, low_open=True),
              doc="DRPO: DPPO's binary-TV geometry as a smooth advantage-weighted penalty, not a hard mask.")
BUILTIN_RULES = frozenset(_REGISTRY)
"""The rules trustscope ships (a user's rules register after this module is imported)."""


def rules_with_inputs(batch: PolicyBatch, given: dict[str, Tensor] | None = None) -> list[str]:
    """The registered rules whose inputs ``batch`` (with ``given``, see :class:`~trustscope.policy.MaskTerms`)
    holds, sorted."""
    from trustscope.policy import present_fields

    present = present_fields(batch, given)
    return [name for name in list_losses() if get_loss(name).needs <= present]


def keep_masks(batch: PolicyBatch, rules: Iterable[str] | None = None, *,
               params: dict[str, dict[str, Any]] | None = None,
               given: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Every named rule's keep-mask M ``(B, T)`` (padding False) on one batch, without its loss or metrics.

    The same masks as ``get_loss(name)(batch, **params[name]).keep``, computed under ``torch.no_grad`` (not
    ``inference_mode``: a caller may use the masks in a loss it backpropagates) from one
    :class:`~trustscope.policy.MaskTerms`, so the rules share their ratios, divergences and sequence context (the
    summaries compute every registered rule's mask over every logged token this way). ``rules``: registered names
    (default: all); ``params``: per rule, overrides of its defaults; ``given``: see
    :class:`~trustscope.policy.MaskTerms`. The batch is checked once; a rule registered without a mask function
    runs whole, its ``keep`` taken.
    """
    import torch

    from trustscope.policy import MaskTerms, check_batch, present_fields, rule_loss

    names = list_losses() if rules is None else list(rules)
    params = params or {}
    chosen = {name: get_loss(name) for name in names}
    check_batch(batch)
    present = present_fields(batch, given)
    out = {}
    with torch.no_grad():
        terms = MaskTerms(batch, given)
        for name, rule in chosen.items():
            merged = rule.resolve(**params.get(name, {}))
            missing = sorted(rule.needs - (present if rule.mask is not None else present_fields(batch, None)))
            if missing:
                raise ValueError(f"loss rule {name!r} needs PolicyBatch.{missing[0]}, which is None")
            if rule.mask is None:
                out[name] = rule_loss(rule, batch, merged).keep
                continue
            keep = rule.mask(terms, **{p: merged[p] for p in rule.mask_params})
            out[name] = keep & terms.valid
    return out
