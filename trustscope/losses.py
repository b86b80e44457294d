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
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")

SQL_COLUMNS = frozenset({
    "ratio", "old_ratio", "log_ratio", "mu_prob", "pi_prob", "old_prob", "mu_logprob", "pi_logprob", "old_logprob",
    "binary_tv", "binary_kl", "topk_tv", "topk_kl", "old_binary_tv", "old_binary_kl", "advantage", "pos",
    "seq_log_ratio", "seq_pos", "seq_len", "seq_p90_binary_tv", "prefix_binary_tv", "prefix_pos_binary_tv",
})
"""Columns the SQL view ``rule_blocks`` hands to the mask macros (``old_*``: anchored on pi_old). The ``seq_*`` and
``prefix_*`` columns are the response's context, computed once over the window ``(run_id, step, rank,
sample_id)``: the mean log-ratio, the length, the P90 of binary TV, and the sums of binary TV (and of pos times it)
over the tokens before this one."""


ScoreFn = Callable[..., "Tensor"]
"""``score(terms: MaskTerms, **params) -> (B, T)`` float: see :class:`Threshold`."""


@dataclass(frozen=True)
class Threshold:
    """A mask family's scalar threshold: the one number that moves how much the rule blocks.

    The threshold is ``param``; the parameters of ``scaled`` (``param`` first) move together on one scale ``u``
    (``u = 1`` at the parameters the rule is evaluated at, its *base*): ``"linear"`` ones become ``base * u``,
    ``"power"`` ones ``base ** u`` (the two bounds of a ratio band keep their log-ratio proportion, so a band
    symmetric in log stays so). Every other parameter stays at the base. ``score(terms, **base params)`` gives
    each token the scale at which it starts to be blocked: the rule at scale ``u`` blocks a token exactly when
    ``score > u`` (``score >= u`` when ``inclusive``); NaN where it blocks the token at no scale, ``inf`` where at
    every scale (dual-clip's block, which no scale moves). The SQL macro ``<family>_score`` in
    ``trustscope/sql/macros/`` computes the same score, with the arguments of ``<family>_blocks``. A larger
    scale blocks fewer tokens.
    """

    param: str
    scaled: tuple[tuple[str, str], ...]
    score: ScoreFn
    inclusive: bool = False

    def __post_init__(self) -> None:
        if not self.scaled or self.scaled[0][0] != self.param:
            raise ValueError(f"Threshold({self.param!r}).scaled must start with its own parameter")
        bad = [kind for _, kind in self.scaled if kind not in ("linear", "power")]
        if bad:
            raise ValueError(f"Threshold({self.param!r}).scaled kinds {bad} must be 'linear' or 'power'")

    def scalable(self, base: Mapping[str, Any]) -> str | None:
        """Why the scale is undefined at ``base`` (a linear parameter at 0, a power one at 1), or None."""
        for name, kind in self.scaled:
            value = base.get(name)
            if not _is_number(value) or not math.isfinite(value):
                return f"{name}={value!r} is not a finite number"
            if kind == "linear" and value == 0:
                return f"{name}=0 cannot be scaled"
            if kind == "power" and (value <= 0 or value == 1):
                return f"{name}={value!r} cannot be scaled in log (it must be > 0 and != 1)"
        return None

    def scale_of(self, value: float, base: Mapping[str, Any]) -> float:
        """The scale ``u`` at which the threshold parameter equals ``value``."""
        kind, b = dict(self.scaled)[self.param], float(base[self.param])
        return value / b if kind == "linear" else math.log(value) / math.log(b)

    def at(self, u: float, base: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters at scale ``u``: ``base`` with the scaled parameters moved."""
        out = dict(base)
        for name, kind in self.scaled:
            out[name] = float(base[name]) * u if kind == "linear" else float(base[name]) ** u
        return out


def _harmful(t: MaskTerms, anchor_logprob: Tensor) -> Tensor:
    """DPPO's direction test: pi moved past the anchor the way A pushes (A = 0 in the negative branch)."""
    return ((t.advantage > 0) & (t.pi_logprob > anchor_logprob)) | ((t.advantage <= 0) & (t.pi_logprob < anchor_logprob))


def score_dppo(t: MaskTerms, divergence: str, delta: float, **_: Any) -> Tensor:
    """DPPO anchored on mu: D / delta where pi moved the harmful way."""
    return (divergence_term(t, divergence) / delta).where(_harmful(t, t.mu_logprob), math.nan)


def score_dppo_old(t: MaskTerms, divergence: str, delta: float, **_: Any) -> Tensor:
    """DPPO anchored on pi_old: D(pi_old, pi) / delta where pi moved the harmful way from pi_old."""
    return (divergence_term(t, divergence, "old") / delta).where(_harmful(t, t.old_logprob), math.nan)


def _clip_score(t: MaskTerms, r: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on ``r`` as a scale: (r - 1) / eps_high for A > 0, (1 - r) / eps_low for A <= 0."""
    return ((r - 1) / eps_high).where(t.advantage > 0, (1 - r) / eps_low)


def score_ratio_clip(t: MaskTerms, eps_low: float, eps_high: float, dual_clip: float | None = None,
                     **_: Any) -> Tensor:
    """PPO's clip on r = pi/mu; dual-clip's block (A <= 0, r > c) is at every scale."""
    score = _clip_score(t, t.ratio, eps_low, eps_high)
    if dual_clip is not None:
        score = score.where(~((t.advantage <= 0) & (t.ratio > dual_clip)), math.inf)
    return score


def score_ratio_clip_old(t: MaskTerms, eps_low: float, eps_high: float, **_: Any) -> Tensor:
    """PPO's clip on pi/pi_old."""
    return _clip_score(t, t.old_ratio, eps_low, eps_high)


def score_lowprob_relax(t: MaskTerms, eps_low: float, eps_high: float, alpha_low: float, alpha_high: float,
                        **_: Any) -> Tensor:
    """PPO's clip on r = pi/mu, each side only where mu >= that side's alpha."""
    side = ((t.advantage > 0) & (t.mu_prob >= alpha_high)) | ((t.advantage <= 0) & (t.mu_prob >= alpha_low))
    return _clip_score(t, t.ratio, eps_low, eps_high).where(side, math.nan)


def _band_score(log_r: Tensor, low: float, high: float) -> Tensor:
    """A band [low, high] of ratios (low < 1 < high), both bounds scaled in log: max(log r / log high, log r /
    log low)."""
    return (log_r / math.log(high)).maximum(log_r / math.log(low))


def score_ratio_band(t: MaskTerms, low: float, high: float, **_: Any) -> Tensor:
    """The token's ratio band."""
    return _band_score(t.ratio.log(), low, high)


def score_seq_geo_band(t: MaskTerms, low: float, high: float, **_: Any) -> Tensor:
    """The response's geometric-mean ratio band."""
    return _band_score(t.seq_log_ratio, low, high)


def score_seq_ratio_clip(t: MaskTerms, eps_low: float, eps_high: float, **_: Any) -> Tensor:
    """PPO's clip on the sequence ratio s (GSPO)."""
    return _clip_score(t, t.seq_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO).exp(), eps_low, eps_high)


def score_negative_mask(t: MaskTerms, delta: float, **_: Any) -> Tensor:
    """Mask-delta: (mu - pi) / delta on A <= 0 tokens."""
    return ((t.mu_prob - t.pi_prob) / delta).where(t.advantage <= 0, math.nan)


def score_drpo(t: MaskTerms, delta: float, **_: Any) -> Tensor:
    """DRPO: sign(A) (pi - mu) / delta (sign(A) = -1 for A <= 0)."""
    shift = t.pi_prob - t.mu_prob
    return (shift / delta).where(t.advantage > 0, -shift / delta)


def score_cppo(t: MaskTerms, delta: float, w_min: float, delta_b: float, **_: Any) -> Tensor:
    """CPPO: z = w D against min(delta, delta + b W - S) = delta + min(0, b W - S), so the scale is
    (z - min(0, b W - S)) / delta where pi moved the harmful way (``w_min`` and ``delta_b`` stay)."""
    valid = t.valid
    div = t.binary_tv  # (B, T)
    pos = (valid.cumsum(-1) - 1).clamp_min(0).to(div.dtype)  # (B, T)
    last = (valid.sum(-1, keepdim=True) - 1).to(div.dtype)  # (B, 1)
    w = (w_min + (1 - w_min) * (last - pos) / last.clamp_min(1)).where(valid, 0.0)  # (B, T)
    z = (w * div).where(valid, 0.0)  # (B, T)
    spent, weight = z.cumsum(-1) - z, w.cumsum(-1) - w
    budget = div.where(valid, math.nan).nanquantile(0.9, dim=-1, keepdim=True).clamp(min=delta_b, max=2 * delta_b)
    slack = (budget * weight - spent).clamp(max=0)  # (B, T) min(0, b W - S)
    return ((z - slack) / delta).where(_harmful(t, t.mu_logprob), math.nan)


def delta_threshold(score: ScoreFn, inclusive: bool = False) -> Threshold:
    """The threshold of a family gated on one ``delta``."""
    return Threshold("delta", (("delta", "linear"),), score, inclusive)


def clip_threshold(score: ScoreFn) -> Threshold:
    """PPO-style clips: eps_high is the threshold, eps_low keeps its proportion to it."""
    return Threshold("eps_high", (("eps_high", "linear"), ("eps_low", "linear")), score)


def band_threshold(score: ScoreFn) -> Threshold:
    """Ratio bands: ``low`` is the threshold, ``high`` keeps its log-ratio proportion to it."""
    return Threshold("low", (("low", "power"), ("high", "power")), score)


@dataclass(frozen=True)
class SqlMask:
    """How the SQL views evaluate a rule's mask as a "would block" flag: the rule's mask family and its inputs.

    The family is one macro, ``<family>_blocks`` in ``trustscope/sql/macros/<family>_blocks.sql``, shared by every
    rule of the family. ``trustscope.db`` calls it per rule with ``columns`` (names from :data:`SQL_COLUMNS`, in
    order; None passes SQL null) and then ``params`` (the rule's parameter names, in order, bound per run from the
    run's manifest or the defaults; None passes null). ``sequence``: the mask reads the whole response, through
    the context columns ``rule_blocks`` computes over ``(run_id, step, rank, sample_id)`` windows.
    ``threshold``: the family's scalar threshold (:class:`Threshold`), or None where it has none.
    """

    family: str
    columns: tuple[str | None, ...] = ()
    params: tuple[str | None, ...] = ()
    sequence: bool = False
    threshold: Threshold | None = None

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
RATIO_CLIP_MU = SqlMask("ratio_clip", ("ratio", "advantage"), ("eps_low", "eps_high", "dual_clip"),
                        threshold=clip_threshold(score_ratio_clip))
RATIO_CLIP_OLD = SqlMask("ratio_clip", ("old_ratio", "advantage"), ("eps_low", "eps_high", None),
                         threshold=clip_threshold(score_ratio_clip_old))
DPPO_MU = SqlMask("dppo", ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "pi_logprob", "mu_logprob", "advantage"),
                  ("divergence", "delta"), threshold=delta_threshold(score_dppo))
DPPO_OLD = SqlMask("dppo", ("old_binary_tv", "old_binary_kl", None, None, "pi_logprob", "old_logprob", "advantage"),
                   ("divergence", "delta"), threshold=delta_threshold(score_dppo_old))
LOWPROB_RELAX = SqlMask("lowprob_relax", ("ratio", "mu_prob", "advantage"),
                        ("eps_low", "eps_high", "alpha_low", "alpha_high"),
                        threshold=clip_threshold(score_lowprob_relax))
NEGATIVE_MASK = SqlMask("negative_mask", ("mu_prob", "pi_prob", "advantage"), ("delta",),
                        threshold=delta_threshold(score_negative_mask, inclusive=True))
RATIO_BAND = SqlMask("ratio_band", ("ratio",), ("low", "high"), threshold=band_threshold(score_ratio_band))
SEQ_RATIO_CLIP = SqlMask("seq_ratio_clip", ("seq_log_ratio", "advantage"), ("eps_low", "eps_high"), sequence=True,
                         threshold=clip_threshold(score_seq_ratio_clip))
SEQ_GEO_BAND = SqlMask("seq_geo_band", ("seq_log_ratio",), ("low", "high"), sequence=True,
                       threshold=band_threshold(score_seq_geo_band))
CPPO_PREFIX = SqlMask("cppo", ("seq_pos", "seq_len", "binary_tv", "seq_p90_binary_tv", "prefix_binary_tv",
                               "prefix_pos_binary_tv", "pi_logprob", "mu_logprob", "advantage"),
                      ("delta", "w_min", "delta_b"), sequence=True, threshold=delta_threshold(score_cppo))
DRPO_PENALTY = SqlMask("drpo", ("pi_prob", "mu_prob", "advantage"), ("delta",),
                       threshold=delta_threshold(score_drpo, inclusive=True))


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
            return "any value" if not _is_number(self.default) else "any number"
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
        if not _is_number(self.default) and self.low is None and self.high is None and self.above is None:
            return  # a plain value of a user's rule: nothing declared to check
        if not _is_number(value) or math.isnan(value):
            raise ValueError(f"loss rule {rule!r}: {name}={value!r} must be a number")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise bad(f"must be {'>' if self.low_open else '>='} {self.low}")
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            raise bad(f"must be {'<' if self.high_open else '<='} {self.high}")
        if self.above is not None and _is_number(params.get(self.above)) and value <= params[self.above]:
            raise ValueError(f"loss rule {rule!r}: {name}={value!r} must be > {self.above}={params[self.above]!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


DELTA_TV = 0.15
DELTA_KL = 0.05
EPS_LOW = 0.2
EPS_HIGH = 0.28
TIS_CAP = 2.0
NO_CAP = math.inf
GSPO_MAX_LOG_RATIO = 10.0

DIVERGENCES: dict[str, tuple[str, str]] = {
    "binary_tv": ("binary_tv", "old_binary_tv"),
    "binary_kl": ("binary_kl", "old_binary_kl"),
    "topk_tv": ("topk_tv", "topk_tv"),
    "topk_kl": ("topk_kl", "topk_kl"),
}
"""The divergences a DPPO rule can gate on: the :class:`~trustscope.policy.MaskTerms` term anchored on mu, and on
pi_old (top-K divergences have mu's lists only, so they stay anchored on mu)."""


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
    if not _IDENTIFIER.fullmatch(rule.name):
        raise ValueError(f"loss rule name {rule.name!r} must match {_IDENTIFIER.pattern} (it names a SQL column)")
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


# ---------------------------------------------------------------------------------------------------------------
# the rules: each a mask M(terms, params) -> (B, T) bool keep and a weight, declared once


def mask_pg_is(t: MaskTerms) -> Tensor:
    """No trust region: every token kept."""
    return t.valid.new_ones(t.valid.shape)


pg_is = register_loss("pg_is", sql=NO_MASK, mask=mask_pg_is, is_cap=is_cap(NO_CAP),
                      doc="PG-IS: no trust region, untruncated importance weight pi/mu.")
cispo = register_loss("cispo", like=pg_is, is_cap=TIS_CAP,
                      doc="PG-TIS (CISPO): no mask, importance weight truncated at C = ``is_cap``.")
token_tis = register_loss(
    "token_tis", like=cispo,
    doc="Token-level TIS (verl rollout correction, rollout_is='token', threshold 2): no mask, weight min(pi/mu, C).")


def mask_ppo_clip(t: MaskTerms, eps_low: float, eps_high: float, dual_clip: float | None) -> Tensor:
    """PPO's clip on r = pi/mu, and dual-clip's block of A <= 0 with r > c.

    ``dual_clip`` (c > 1): dual-clip PPO also blocks negative-advantage tokens with r > c (its objective is the
    constant c * A there, so they carry no gradient). None turns it off.
    """
    keep = ppo_keep(t.ratio, t.advantage, eps_low, eps_high)  # (B, T)
    if dual_clip is not None:
        keep = keep & ~((t.advantage <= 0) & (t.ratio > dual_clip))
    return keep


ppo_clip = register_loss(
    "ppo_clip", sql=RATIO_CLIP_MU, mask=mask_ppo_clip, eps_low=eps_low(), eps_high=eps_high(),
    dual_clip=Param(None, low=1, low_open=True, optional=True, why="must be > 1 (or None to turn dual-clip off)"),
    is_cap=is_cap(),
    doc="PPO / GRPO ratio clip on r = pi/mu (defaults: Clip-Higher, eps 0.2 / 0.28).")
grpo = register_loss("grpo", like=ppo_clip, eps_high=EPS_LOW,
                     doc="GRPO: the symmetric PPO ratio clip on r = pi/mu (eps 0.2 / 0.2).")


def mask_minirl(t: MaskTerms, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on pi/pi_old."""
    return ppo_keep(t.old_ratio, t.advantage, eps_low, eps_high)


minirl = register_loss("minirl", sql=RATIO_CLIP_OLD, mask=mask_minirl, needs=("old_logprob",), eps_low=eps_low(),
                       eps_high=eps_high(), is_cap=is_cap(),
                       doc="MiniRL (decoupled PPO): the clip mask on pi/pi_old (recomputed), IS weight pi/mu.")
minirl_tis = register_loss("minirl_tis", like=minirl, is_cap=TIS_CAP,
                           doc="MiniRL-TIS: MiniRL with the IS weight truncated at C.")


def divergence_term(t: MaskTerms, name: str, anchor: str = "mu") -> Tensor:
    """The divergence ``name`` (:data:`DIVERGENCES`) between ``anchor`` ('mu' or 'old') and pi, from the terms."""
    return getattr(t, DIVERGENCES[name][anchor == "old"])


def mask_dppo(t: MaskTerms, divergence: str, delta: float) -> Tensor:
    """DPPO's mask on D(mu, pi) with mu as the anchor: block a token only when D(mu, pi) > delta and pi moved past
    mu the way A pushes."""
    return dppo_keep(divergence_term(t, divergence), t.pi_logprob, t.mu_logprob, t.advantage, delta)


dppo = register_loss("dppo_binary_tv", sql=DPPO_MU, mask=mask_dppo, divergence=divergence("binary_tv"),
                     delta=delta(DELTA_TV), doc="DPPO gated on binary TV |pi - mu| > delta.")
register_loss("dppo_binary_kl", like=dppo, divergence="binary_kl", delta=DELTA_KL,
              doc="DPPO gated on binary KL(mu || pi) > delta.")
register_loss("dppo_topk_tv", like=dppo, needs=("mu_topk_logprobs", "pi_topk_logprobs"), divergence="topk_tv",
              doc="DPPO gated on top-K TV > delta.")
register_loss("dppo_topk_kl", like=dppo, needs=("mu_topk_logprobs", "pi_topk_logprobs"), divergence="topk_kl",
              delta=DELTA_KL, doc="DPPO gated on top-K KL > delta.")


def mask_dppo_decoupled(t: MaskTerms, divergence: str, delta: float) -> Tensor:
    """DPPO's mask with the divergence and the anchor taken against pi_old."""
    return dppo_keep(divergence_term(t, divergence, "old"), t.pi_logprob, t.old_logprob, t.advantage, delta)


dppo_decoupled = register_loss(
    "dppo_decoupled", sql=DPPO_OLD, mask=mask_dppo_decoupled, needs=("old_logprob",),
    divergence=Param("binary_kl", choices=("binary_tv", "binary_kl"),
                     why="must be binary_tv or binary_kl: only those have a pi_old anchor"),
    delta=delta(DELTA_KL),
    doc="DPPO decoupled (ablation): the DPPO mask anchored on the recomputed pi_old instead of mu; weight pi/mu.")


def mask_ppo_lowprob_relax(t: MaskTerms, eps_low: float, eps_high: float, alpha_low: float,
                           alpha_high: float) -> Tensor:
    """PPO's clip on r = pi/mu, each side only where mu >= that side's alpha."""
    adv, r, mu = t.advantage, t.ratio, t.mu_prob
    block = ((adv > 0) & (r > 1 + eps_high) & (mu >= alpha_high)) | ((adv <= 0) & (r < 1 - eps_low) & (mu >= alpha_low))
    return ~block


ppo_lowprob_relax = register_loss("ppo_lowprob_relax", sql=LOWPROB_RELAX, mask=mask_ppo_lowprob_relax, eps_low=eps_low(),
              eps_high=eps_high(), alpha_low=probability(0.1), alpha_high=probability(0.1),
              doc="PPO clip that never clips a side for tokens with mu < alpha (alpha per side; 0 turns a side's "
                  "relief off).")


def mask_minimal_negative(t: MaskTerms, delta: float) -> Tensor:
    """Block A <= 0 where mu - pi >= delta."""
    return ~((t.advantage <= 0) & (t.mu_prob - t.pi_prob >= delta))


minimal_negative_mask = register_loss("minimal_negative_mask", sql=NEGATIVE_MASK, mask=mask_minimal_negative, delta=delta(0.5),
              doc="Mask-delta: block only negative-advantage tokens that pi pushed down from mu by at least delta.")


def mask_ratio_band(t: MaskTerms, low: float, high: float) -> Tensor:
    """Keep low <= r <= high, r = pi/mu.

    Token-level masked IS (MIS) source: verl ``verl/trainer/ppo/rollout_corr_helper.py``,
    ``compute_rollout_rejection_mask`` with ``rollout_rs="token_k1"`` and a ``"lower_upper"`` threshold (here on
    r = pi/mu; the weight stays pi/mu on the kept tokens, bypass mode).
    """
    return (t.ratio >= low) & (t.ratio <= high)


token_mis = register_loss(
    "token_mis", sql=RATIO_BAND, mask=mask_ratio_band, **ratio_band(0.5, 2.0),
    doc="Token-level masked IS (MIS): drop tokens whose r = pi/mu leaves [low, high], either advantage sign.")
register_loss("icepop", like=token_mis, low=0.5, high=5.0,
              doc="IcePop: drop tokens with r = pi/mu outside [alpha, beta] = [0.5, 5] (Ling Team, Ring-1T report, "
                  "arXiv 2510.18855, IcePop; INTELLECT-3 report, arXiv 2512.16144, eq. 1).")


def _gspo_ratio(t: MaskTerms) -> Tensor:
    """GSPO's sequence ratio s = exp(mean_t log(pi/mu)), the mean clamped at 10 first: ``(B, T)``."""
    return t.seq_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO).exp()


def mask_gspo(t: MaskTerms, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on the sequence ratio s: a whole response is kept or blocked together.

    Source: Zheng et al., Group Sequence Policy Optimization (arXiv 2507.18071), eq. 5-7 (s_i, the length-normalised
    sequence ratio); defaults eps 3e-4 / 4e-4 from its section 5.1. Reference implementation: verl
    ``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_gspo`` (the mean log-ratio clamped at 10 before exp).
    Anchored on mu here (the rollout policy, as the rest of trustscope). A whole response is blocked together:
    A > 0 with s > 1 + eps_high, A <= 0 with s < 1 - eps_low.
    """
    return ppo_keep(_gspo_ratio(t), t.advantage, eps_low, eps_high)


def weight_gspo(t: MaskTerms) -> Tensor:
    """GSPO's weight: the sequence ratio s on every token of the response."""
    return _gspo_ratio(t)


gspo = register_loss("gspo", sql=SEQ_RATIO_CLIP, mask=mask_gspo, weight=weight_gspo, eps_low=eps_low(3e-4),
              eps_high=eps_high(4e-4),
              doc="GSPO: PPO's clip on the sequence ratio s = exp(mean_t log(pi/mu)), weight s on every token of "
                  "the response.")


def mask_geo_band(t: MaskTerms, low: float, high: float) -> Tensor:
    """Keep a response while its geometric-mean ratio exp(mean_t log(pi/mu)) stays in [low, high].

    Source: verl ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask`` option
    ``seq_mean_k1`` (preset ``RolloutCorrectionConfig.decoupled_geo_rs``, bounds ``"0.999_1.001"``); verl bounds
    the mean of log(mu/pi), here its reciprocal, the geometric mean of r = pi/mu. Weight pi/mu per token.
    """
    g = t.seq_log_ratio.exp()  # (B, T)
    return (g >= low) & (g <= high)


geo_mask = register_loss("geo_mask", sql=SEQ_GEO_BAND, mask=mask_geo_band, **ratio_band(0.999, 1.001),
              doc="Geometric-mean sequence masking: drop a whole response when exp(mean_t log(pi/mu)) leaves "
                  "[low, high].")


def mask_cppo(t: MaskTerms, delta: float, w_min: float, delta_b: float) -> Tensor:
    """CPPO's mask: the position-weighted binary TV against a threshold with the response's prefix budget.

    Source: Mao, Zhou, Tao et al., Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning (CPPO,
    arXiv 2606.10968), mask Eq. 8-11 and the dynamic budget Eq. 22; reference implementation: Tencent-Hunyuan UniRL
    ``unirl/algorithms/cppo.py``, ``_cppo_mask`` (as its ``CPPO/README.md`` states it), which ships the binary-TV
    variant, as here: D = |pi - mu|. For a response of L tokens, position s = 0 .. L-1: w_s = w_min + (1 - w_min)
    (L - 1 - s) / max(L - 1, 1), Z_s = w_s D_s, prefix sums S = sum_{j<s} Z_j and W = sum_{j<s} w_j, the
    response's budget b = clamp(P90(D), delta_b, 2 delta_b), threshold c_s = min(delta, delta + b W - S). A token
    is blocked when pi moved the way A pushes (DPPO's direction test, A = 0 in the negative branch) and Z_s > c_s.
    Defaults: the paper's dense-model delta 0.15, w_min 0.8, delta_b 0.02.
    """
    valid = t.valid
    div = t.binary_tv  # (B, T)
    pos = (valid.cumsum(-1) - 1).clamp_min(0).to(div.dtype)  # (B, T) position among the valid tokens
    last = (valid.sum(-1, keepdim=True) - 1).to(div.dtype)  # (B, 1) L - 1
    w = (w_min + (1 - w_min) * (last - pos) / last.clamp_min(1)).where(valid, 0.0)  # (B, T)
    z = (w * div).where(valid, 0.0)  # (B, T)
    spent = z.cumsum(-1) - z  # (B, T) S: weighted divergence of the prefix before the token
    weight = w.cumsum(-1) - w  # (B, T) W
    p90 = div.where(valid, math.nan).nanquantile(0.9, dim=-1, keepdim=True)  # (B, 1)
    budget = p90.clamp(min=delta_b, max=2 * delta_b)
    threshold = (delta + budget * weight - spent).clamp(max=delta)  # (B, T) min(delta, delta + b W - S)
    adv, pi_lp, mu_lp = t.advantage, t.pi_logprob, t.mu_logprob
    harmful = ((adv > 0) & (pi_lp > mu_lp)) | ((adv <= 0) & (pi_lp < mu_lp))
    return ~(harmful & (z > threshold))


cppo = register_loss("cppo", sql=CPPO_PREFIX, mask=mask_cppo, delta=delta(DELTA_TV),
              w_min=Param(0.8, low=0, low_open=True, high=1, why="must be in (0, 1]: the last position's weight"),
              delta_b=Param(0.02, low=0, why="must be >= 0 (the prefix budget's floor)"),
              doc="CPPO: DPPO's mask with a position-weighted threshold and a cumulative prefix budget.")


def _drpo_gain(t: MaskTerms, delta: float) -> Tensor:
    """DRPO's gradient scale g = 1 - sign(A) (pi - mu) / delta, sign(A) = -1 for A <= 0: ``(B, T)``."""
    shift = t.pi_prob - t.mu_prob  # (B, T)
    sign = (t.advantage > 0).to(shift.dtype) * 2 - 1  # (B, T) +1 for A > 0, -1 for A <= 0
    return 1 - sign * shift / delta


def mask_drpo(t: MaskTerms, delta: float) -> Tensor:
    """What DRPO 'blocks': where its penalty cancelled or reversed the push, g <= 0.

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
    return _drpo_gain(t, delta) > 0


def weight_drpo(t: MaskTerms, delta: float) -> Tensor:
    """DRPO's weight on every valid token: pi/mu times its gradient scale g."""
    return t.ratio * _drpo_gain(t, delta)


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
