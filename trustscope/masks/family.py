"""What every mask family declares and shares: the SQL inputs, the scalar threshold, the SQL mask declaration, and
the tensor pieces several families build on (the divergence by name, PPO's and DPPO's keep-masks, DPPO's direction
test, the clip and band scores). Imports no torch: tensor methods only, on the terms a family is handed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from trustscope.policy import MaskTerms

IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")


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
    beside the family's module (:mod:`trustscope.masks`) computes the same score, with the arguments of ``<family>_blocks``. A larger
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
            if not is_number(value) or not math.isfinite(value):
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

    The family is one macro, ``<family>_blocks`` in ``trustscope/masks/<family>_blocks.sql``, shared by every
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
        if not IDENTIFIER.fullmatch(self.family):
            raise ValueError(f"SqlMask.family={self.family!r} must match {IDENTIFIER.pattern}")
        unknown = [c for c in self.columns if c is not None and c not in SQL_COLUMNS]
        if unknown:
            raise ValueError(f"SqlMask({self.family!r}).columns name unknown column(s) {unknown}; "
                             f"known: {sorted(SQL_COLUMNS)}")
        bad = [n for n in self.params if n is not None and not IDENTIFIER.fullmatch(n)]
        if bad:
            raise ValueError(f"SqlMask({self.family!r}).params {bad} must match {IDENTIFIER.pattern}")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


DIVERGENCES: dict[str, tuple[str, str]] = {
    "binary_tv": ("binary_tv", "old_binary_tv"),
    "binary_kl": ("binary_kl", "old_binary_kl"),
    "topk_tv": ("topk_tv", "topk_tv"),
    "topk_kl": ("topk_kl", "topk_kl"),
}
"""The divergences a DPPO rule can gate on: the :class:`~trustscope.policy.MaskTerms` term anchored on mu, and on
pi_old (top-K divergences have mu's lists only, so they stay anchored on mu)."""


def divergence_term(t: MaskTerms, name: str, anchor: str = "mu") -> Tensor:
    """The divergence ``name`` (:data:`DIVERGENCES`) between ``anchor`` ('mu' or 'old') and pi, from the terms."""
    return getattr(t, DIVERGENCES[name][anchor == "old"])


def harmful(t: MaskTerms, anchor_logprob: Tensor) -> Tensor:
    """DPPO's direction test: pi moved past the anchor the way A pushes (A = 0 in the negative branch)."""
    return ((t.advantage > 0) & (t.pi_logprob > anchor_logprob)) | ((t.advantage <= 0) & (t.pi_logprob < anchor_logprob))


def clip_score(t: MaskTerms, r: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip on ``r`` as a scale: (r - 1) / eps_high for A > 0, (1 - r) / eps_low for A <= 0."""
    return ((r - 1) / eps_high).where(t.advantage > 0, (1 - r) / eps_low)


def band_score(log_r: Tensor, low: float, high: float) -> Tensor:
    """A band [low, high] of ratios (low < 1 < high), both bounds scaled in log: max(log r / log high, log r /
    log low)."""
    return (log_r / math.log(high)).maximum(log_r / math.log(low))


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

