"""A detector per cause of ``trustscope explain``, each a doctor check (``cause_<source>``) usable alone:
``trustscope doctor LOGDIR --check cause_temperature``.

All read one measurement, ``trustscope/sql/doctor/causes.sql`` (one scan of ``explain_tokens`` for every run, the
doctor sharing it between the checks), and judge it with a pure function. A check is ``skipped`` where its cause is
not measurable (the columns it needs are absent: the summary says which), ``ok`` where no token is touched, and
``warn`` with evidence and examples where some are: these are findings about the run, never errors (a temperature
or truncation setting in run.json that the logged distributions contradict is said so in the summary).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from trustscope.doctor import Judgement, register_check
from trustscope.explain.analysis import Thresholds
from trustscope.explain.causes import cause

PARAMS = {k: float(v) for k, v in asdict(Thresholds()).items()}
"""explain's default thresholds, bound into the measurement (one measurement for every cause check)."""
MIN_TOUCHED = 20
"""Fewer touched tokens than this are reported (ok) but not warned about: too few to tell a cause from noise."""
EXCESS_FACTOR = 1.5
"""The touched tokens' mean |log pi - log mu| must reach this multiple of the untouched tokens' for a warning: a
cause that touches tokens without carrying more mismatch than the rest (stale tokens of a policy that barely moved)
is reported, not warned about."""


def _base(m: Mapping[str, Any], source: str, measured: str | None, touched: str) -> Judgement | None:
    """The verdicts every cause check shares: no tokens, not measurable, nothing touched (None: go on)."""
    if not m or not m.get("n_tokens"):
        return Judgement("skipped", "no token rows")
    needs = cause(source).needs
    if measured is not None and not m.get(measured):
        return Judgement("skipped", "not measurable: needs " + ", ".join(f"`{n}`" for n in needs),
                         {"n_tokens": m["n_tokens"]})
    if (m.get(touched) or 0) == 0:
        return Judgement("ok", f"no token touched by {cause(source).title}",
                         {"n_tokens": m["n_tokens"], "mismatch": m.get("mismatch")})
    return None


def _excess(m: Mapping[str, Any], touched: str, mismatch: str) -> tuple[str, dict[str, Any]]:
    n, flagged, rest = m[touched], m.get(mismatch), m.get("untouched_mismatch")
    text = (f"{n:,} of {m['n_tokens']:,} tokens ({n / m['n_tokens']:.1%}), mean |log pi - log mu| "
            f"{_f(flagged)} nats against {_f(rest)} on untouched tokens")
    return text, {"n_tokens": m["n_tokens"], "touched": n, "touched_mismatch": flagged, "untouched_mismatch": rest}


def _verdict(m: Mapping[str, Any], touched: str, mismatch: str) -> str:
    """``warn`` when enough tokens are touched and they carry :data:`EXCESS_FACTOR` times the untouched tokens'
    mismatch (or there are no untouched tokens to compare with), else ``ok``."""
    rest = m.get("untouched_mismatch")
    carries = rest is None or (m.get(mismatch) or 0.0) >= EXCESS_FACTOR * rest
    return "warn" if m[touched] >= MIN_TOUCHED and carries else "ok"


def _f(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def _setting(sampling: Any, key: str) -> float | None:
    if not isinstance(sampling, Mapping) or sampling.get(key) is None:
        return None
    value = sampling[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"run.json sampling.{key}={value!r} must be a finite number")
    return float(value)


@register_check("cause_temperature", sql="causes.sql", params=PARAMS, manifest_field="sampling",
                about="mu at another temperature than pi (fitted from the top-K lists)")
def judge_temperature(m: Mapping[str, Any], sampling: Any = None) -> Judgement:
    """A temperature mismatch: over a response's top-K lists, log mu = a_t + log pi / T fits with T away from 1.
    The run's declared temperature (run.json ``sampling.temperature``) is compared with the fit."""
    early = _base(m, "temperature", "temperature_measured", "temperature_tokens")
    if early:
        return early
    text, evidence = _excess(m, "temperature_tokens", "temperature_mismatch")
    fit = m.get("temperature_fit")
    evidence["fitted_temperature"] = fit
    declared = _setting(sampling, "temperature")
    summary = f"mu fits softmax(logits / {_f(fit)}) against pi's softmax(logits) on {text}"
    if declared is not None:
        summary += (f"; run.json declares temperature {declared:g}, which the logged distributions contradict"
                    if fit is not None and abs(math.log(max(fit, 1e-9) / max(declared, 1e-9))) > 0.05
                    else f"; run.json declares temperature {declared:g}")
    return Judgement(_verdict(m, "temperature_tokens", "temperature_mismatch"), summary, evidence, m.get("temperature_examples") or [],
                     cause("temperature").fix)


@register_check("cause_truncation", sql="causes.sql", params=PARAMS, manifest_field="sampling",
                about="mu renormalised over a top-k / top-p support, pi over the vocabulary")
def judge_truncation(m: Mapping[str, Any], sampling: Any = None) -> Judgement:
    """Top-k / top-p truncation: log mu - log pi is one positive constant over a response's top-K lists (mu
    renormalised over the kept support), mu's top-K mass above pi's. The kept mass is exp(-offset)."""
    early = _base(m, "truncation", "truncation_measured", "truncation_tokens")
    if early:
        return early
    text, evidence = _excess(m, "truncation_tokens", "truncation_mismatch")
    offset = m.get("truncation_offset_fit")
    kept = math.exp(-offset) if offset is not None else None
    evidence.update(offset=offset, kept_mass=kept, mu_topk_mass=m.get("truncation_mu_mass"),
                    pi_topk_mass=m.get("truncation_pi_mass"))
    summary = (f"mu is pi renormalised over {_f(kept)} of its mass (log mu - log pi = {_f(offset)} nats at every "
               f"top-K id) on {text}")
    declared = _setting(sampling, "top_p")
    if declared is not None:
        summary += f"; run.json declares top_p {declared:g}"
        if declared >= 1.0:
            summary += ", which the logged distributions contradict"
    return Judgement(_verdict(m, "truncation_tokens", "truncation_mismatch"), summary, evidence, m.get("truncation_examples") or [],
                     cause("truncation").fix)


@register_check("cause_position_shift", sql="causes.sql", params=PARAMS,
                about="response turns where mu fits pi one position off")
def judge_position_shift(m: Mapping[str, Any]) -> Judgement:
    """A position shift, per response turn: pi one position later or earlier fits mu much better than as logged."""
    early = _base(m, "position_shift", None, "shift_tokens")
    if early:
        return early
    text, evidence = _excess(m, "shift_tokens", "shift_mismatch")
    evidence.update(pi_later=m.get("shift_pi_later"), pi_earlier=m.get("shift_pi_earlier"), turns=m.get("turns"))
    summary = (f"pi one position off fits mu better (mean |log pi - log mu| {_f(m.get('shift_pi_later'))} later, "
               f"{_f(m.get('shift_pi_earlier'))} earlier) on {text}")
    return Judgement(_verdict(m, "shift_tokens", "shift_mismatch"), summary, evidence, m.get("shift_examples") or [],
                     cause("position_shift").fix)


@register_check("cause_token_drift", sql="causes.sql", params=PARAMS,
                about="tokens after the first engine id that differs from the trainer's")
def judge_token_drift(m: Mapping[str, Any]) -> Judgement:
    """Token drift: from the first position where ``engine_token_id`` differs from ``token_id`` on, the engine and
    the trainer condition on different histories; the evidence has the first differing positions and the turns."""
    early = _base(m, "token_drift", "drift_measured", "drift_tokens")
    if early:
        return early
    text, evidence = _excess(m, "drift_tokens", "drift_mismatch")
    evidence.update(first_pos=m.get("drift_first_pos"), median_first_pos=m.get("drift_median_first_pos"),
                    turns=m.get("turns"))
    summary = f"ids drift from position {m.get('drift_first_pos')} on (median {_f(m.get('drift_median_first_pos'))}): {text}"
    return Judgement(_verdict(m, "drift_tokens", "drift_mismatch"), summary, evidence, m.get("drift_examples") or [],
                     cause("token_drift").fix)


@register_check("cause_staleness", sql="causes.sql", params=PARAMS,
                about="mismatch carried by tokens sampled by older weights")
def judge_staleness(m: Mapping[str, Any]) -> Judgement:
    """Staleness: tokens with ``policy_version`` below the step, the mismatch by staleness value."""
    early = _base(m, "staleness", "stale_measured", "stale_tokens")
    if early:
        return early
    text, evidence = _excess(m, "stale_tokens", "stale_mismatch")
    evidence.update(max_staleness=m.get("max_staleness"), by_staleness=m.get("staleness_rows"))
    return Judgement(_verdict(m, "stale_tokens", "stale_mismatch"), f"stale tokens (up to {m.get('max_staleness')} versions): {text}",
                     evidence, m.get("stale_examples") or [], cause("staleness").fix)


@register_check("cause_routing", sql="causes.sql", params=PARAMS,
                about="mismatch carried by tokens routed to other experts")
def judge_routing(m: Mapping[str, Any]) -> Judgement:
    """MoE routing disagreement: tokens with ``routing_agreement`` < 1."""
    early = _base(m, "routing", "routing_measured", "routing_tokens")
    if early:
        return early
    text, evidence = _excess(m, "routing_tokens", "routing_mismatch")
    return Judgement(_verdict(m, "routing_tokens", "routing_mismatch"), f"tokens routed differently: {text}", evidence,
                     m.get("routing_examples") or [], cause("routing").fix)


@register_check("cause_numerics", sql="causes.sql", params=PARAMS,
                about="the mismatch left on fresh, agreeing tokens, by position and turn")
def judge_numerics(m: Mapping[str, Any]) -> Judgement:
    """Numerics: the mismatch on the tokens no cause touches (fresh, agreeing, aligned, untempered), the first
    generated token apart, by position bucket and by turn: what ``explain`` leaves unexplained. Descriptive (ok);
    ``warn`` only when the first token's mismatch is over three times the rest's (a prefill / first-decode
    kernel difference)."""
    if not m or not m.get("n_untouched"):
        return Judgement("skipped", "no untouched token rows")
    first, rest = m.get("numerics_first_token"), m.get("numerics_rest")
    evidence = {"n_untouched": m["n_untouched"], "first_token": first, "rest": rest,
                "by_position": m.get("position_rows"), "by_turn": m.get("turns")}
    summary = (f"{m['n_untouched']:,} untouched tokens: mean |log pi - log mu| {_f(m.get('untouched_mismatch'))} "
               f"nats (first generated token {_f(first)}, the rest {_f(rest)})")
    if first is not None and rest and first > 3 * rest and first > 0.01:
        return Judgement("warn", summary, evidence, [],
                         "the first generated token disagrees far more than the rest: the engine's prefill and the "
                         "trainer's forward differ at the prompt's last position (kernel, dtype, or the prompt "
                         "itself)")
    return Judgement("ok", summary, evidence)
