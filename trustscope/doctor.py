"""Contract checks on any token log, native or imported: ``trustscope doctor LOGDIR``.

A log can pass ``trustscope validate`` (every column typed, every log-prob <= 0) and still be wrong in ways that
make every diagnostic lie: mu and pi one position apart, padding logged as tokens, mu's top-K without the sampled
token, an engine's processed log-probs against the trainer's raw ones, a mu that is the trainer's own recompute,
sample ids that several ranks reuse. Each check here measures one such mistake with one SQL file of
``trustscope/sql/doctor/`` (bound parameters, one row per run) and judges the measurement with one pure function,
which returns a :class:`Judgement`: a verdict (``ok``, ``warn``, ``fail`` or ``skipped``), a one-line summary, the
evidence (counts and a few example tokens with step, sample_id and pos) and the likely cause. :func:`diagnose`
reports it as the run's :class:`Finding` for that check.

A check is its judge, declared once with its name, SQL file and parameters::

    @register_check("alignment", sql="alignment.sql", about="mu and pi logged one position apart")
    def judge_alignment(m: Mapping[str, Any]) -> Judgement: ...

Use::

    with connect("logs/") as db:
        findings = diagnose(db)              # {run_id: [Finding, ...]}, one Finding per check
        panel = doctor_panel(db, "my-run")   # the same as a DataFrame, for the dashboard
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trustscope.db import SQL_DIR, LogDB, connect

DOCTOR_SQL_DIR = SQL_DIR / "doctor"

VERDICTS = ("ok", "warn", "fail", "skipped")

PLACEHOLDER_FLOOR = -100.0
"""A sampled token's log-prob at or below this is an -inf stand-in: no engine samples a token of probability
e^-100, so such a value was written by padding code (-1e4, -1e9, float32's minimum, ...)."""
HUGE_TV = 0.8
"""|pi - mu| above this on one token is a huge divergence: 80 % of the probability moved (a padding token the
trainer finds unlikely against a filler mu of 0 reads near 1)."""
HUGE_LOG_RATIO = 10.0
"""|log pi - log mu| above this (a ratio of e^10) is a huge divergence too."""
PLACEHOLDER_SHARE = 1e-4
"""Placeholder tokens fail the check from this share of the tokens on; fewer only warn. Leaked padding fills a tail
of every padded response; a collapsing policy can put pi at exactly 1 (log-prob 0) on a few tokens of a million."""
ALIGN_FACTOR = 0.5
"""mu and pi are off by one position when a one-position shift brings mean |pi - mu| below this fraction of the
logged alignment's."""
ALIGN_FLOOR = 0.01
"""Below this mean |pi - mu| at the logged alignment the log already fits well, and its alignment is not questioned."""
ALIGNMENT_CAUSES = {
    "later": "pi carries one entry too many before the response (the last prompt token's log-prob: per-token "
             "log-probs already aligned to the tokens sliced again from P - 1), or mu lacks the first token's.",
    "earlier": "pi lacks the first response token's log-prob (sliced from P + 1, or the logits from P instead of "
               "P - 1), or mu carries one entry too many (an engine's log-prob for the last prompt token).",
}
"""What usually shifts the two series, by the direction in which pi fits mu better."""
MIN_TOKENS = 20
"""Fewer tokens than this and a statistical check is skipped: too few to tell."""
CERTAIN_LOGPROB = math.log(0.9)
"""A token the engine logs at exactly 0.0 (probability 1) while the trainer gives it under 0.9 was padded, not
scored: no engine rounds a probability under 0.9 up to exactly 1 (check ``turn_placeholders``)."""
PADDED_MIN = 3
"""Padded tokens (``turn_placeholders``) in one turn from which the check fails (fewer only warn)."""
ZERO_VARIANCE_WARN = 0.5
"""A share of GRPO groups with all rewards equal from which ``zero_variance_groups`` warns: most of the batch then
carries no gradient while its tokens still count in the loss's denominators."""
TOPK_MASS_TOLERANCE = 5e-3
"""How far above 1 a top-K list's probabilities may sum. float16 top-K (``topk_precision="float16"``) rounds a
log-prob x by up to |x| * 2^-11, which moves a row's sum by up to entropy * 2^-11 (about 1.5e-3 at 3 nats)."""
BIAS_NATS = 0.02
"""Mean log mu - log pi above this (and ``BIAS_Z`` standard errors) is a bias, not noise."""
BIAS_Z = 4.0
"""Standard errors of the mean the gap must also exceed."""
INFORMATIVE_LOGPROB = -0.01
"""mu vs pi identity is read on tokens with log mu below this: near-certain tokens read 0 in every engine."""
SAME_NATS = 1e-6
"""Two log-probs within this many nats agree to float32 rounding (a few ulps): one computation repeated, or an engine
numerically identical to the trainer. Measured here: vLLM in float32 against the float32 toy trainer agrees this
closely on 87 % of the informative tokens, and exactly on 1.5 %."""
RECOMPUTE_SHARE = 0.95
"""mu exactly equal to pi (or pi_old) on this share of informative tokens is a copy of the trainer's numbers (fail);
within :data:`SAME_NATS` on this share, no mismatch is measurable (warn)."""

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Judgement:
    """What a judge makes of one run's measurement.

    Attributes:
        verdict: ``ok``, ``warn``, ``fail`` or ``skipped`` (then ``summary`` says why).
        summary: one line: what was measured.
        evidence: counts and figures behind the verdict.
        examples: a few tokens (or keys) that show it, each with step, sample_id and pos where it has them.
        cause: the likely cause and what to change, empty when there is nothing to fix.
    """

    verdict: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    cause: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} must be one of {VERDICTS}")


@dataclass(frozen=True)
class Finding(Judgement):
    """The judgement of one check on one run, with the check's name (a key of :data:`CHECKS`)."""

    check: str = field(kw_only=True)


# ------------------------------------------------------------------------------------------------ the registry

Judge = Callable[..., Judgement]
"""``judge(measurement) -> Judgement``, or ``judge(measurement, run.json field)`` for a check that reads one."""


@dataclass(frozen=True)
class Check:
    """One check: the SQL file that measures it, its parameters, and the judge that reads the measurement."""

    name: str
    sql: str
    """The file in ``trustscope/sql/doctor/``: one row per run, its parameters bound."""
    judge: Judge
    about: str
    """What the check looks for, in a few words (``trustscope doctor --help`` lists them)."""
    params: Mapping[str, float] = field(default_factory=dict)
    manifest_field: str | None = None
    """The run.json field handed to the judge after the measurement, if any."""


CHECKS: dict[str, Check] = {}
"""Every check by name, in the order they are declared and reported."""


def register_check(name: str, *, sql: str, about: str, params: Mapping[str, float] | None = None,
                   manifest_field: str | None = None) -> Callable[[Judge], Judge]:
    """Declare the decorated judge as check ``name``, measured by ``sql`` (a file of ``trustscope/sql/doctor/``)
    with bound ``params``; with ``manifest_field``, the judge also gets that field of the run's run.json. Checks
    reading the same file with the same parameters share one measurement (one scan)."""

    def add(judge: Judge) -> Judge:
        if name in CHECKS:
            raise ValueError(f"doctor check {name!r} is declared twice")
        if not (DOCTOR_SQL_DIR / sql).is_file():
            raise ValueError(f"doctor check {name!r}: no {sql} in {DOCTOR_SQL_DIR}")
        CHECKS[name] = Check(name, sql, judge, about, dict(params or {}), manifest_field)
        return judge

    return add


TOPK_PARAMS = {"tolerance": TOPK_MASS_TOLERANCE}
"""The three top-K checks read one measurement (same file, same parameters): one scan of the lists."""


# ------------------------------------------------------------------------------------------------ judges


@register_check("alignment", sql="alignment.sql", about="mu and pi logged one position apart")
def judge_alignment(m: Mapping[str, Any]) -> Judgement:
    """mu and pi off by one position: a one-position shift (pi one later or one earlier) fits much better than the
    logged alignment, measured by mean |pi - mu| inside each response."""
    if not m or (m.get("n_pairs") or 0) < MIN_TOKENS:
        return Judgement("skipped", f"fewer than {MIN_TOKENS} pairs of adjacent positions to compare",
                         _pick(m, "n_tokens", "n_pairs"))
    evidence = _pick(m, "n_tokens", "n_pairs", "diff_logged", "diff_pi_later", "diff_pi_earlier", "corr_logged",
                     "corr_pi_later", "corr_pi_earlier")
    logged = m["diff_logged"]
    later, earlier = m["diff_pi_later"], m["diff_pi_earlier"]
    best, direction = (later, "later") if later <= earlier else (earlier, "earlier")
    summary = (f"mean |pi - mu| {logged:.4g} as logged, {later:.4g} with pi one position later, "
               f"{earlier:.4g} with pi one position earlier")
    if logged >= ALIGN_FLOOR and best < ALIGN_FACTOR * logged:
        return Judgement("fail", summary, evidence, m["examples"] or [],
                         f"pi fits mu far better one position {direction}: the two are logged off by one. "
                         + ALIGNMENT_CAUSES[direction])
    return Judgement("ok", summary, evidence)


@register_check("placeholders", sql="placeholders.sql", about="padding or unscored positions logged as tokens",
                params={"floor": PLACEHOLDER_FLOOR, "huge_tv": HUGE_TV, "huge_log_ratio": HUGE_LOG_RATIO})
def judge_placeholders(m: Mapping[str, Any]) -> Judgement:
    """Positions carrying placeholder log-probs (exactly 0, or at most :data:`PLACEHOLDER_FLOOR`) together with a
    huge divergence: padding or unscored positions that the response mask let into the log. ``fail`` when the
    trainer kept some and they make :data:`PLACEHOLDER_SHARE` of the tokens or more, else ``warn``."""
    if not m or not m.get("n_tokens"):
        return Judgement("skipped", "no token rows")
    evidence = _pick(m, "n_tokens", "n_flagged", "n_flagged_kept", "n_flagged_at_end", "n_mu_placeholder",
                     "n_pi_placeholder")
    n = m["n_flagged"]
    summary = (f"{n} of {m['n_tokens']} tokens carry a placeholder log-prob (0 or <= {PLACEHOLDER_FLOOR:g}) with "
               f"|pi - mu| > {HUGE_TV:g} or |log ratio| > {HUGE_LOG_RATIO:g}; {m['n_flagged_kept']} kept, "
               f"{m['n_flagged_at_end']} at the end of their response")
    if not n:
        return Judgement("ok", summary, evidence)
    cause = ("padding or unscored positions were logged as response tokens: the mask passed to the logger does not "
             "exclude padding after EOS, tool output or truncated tails, or an importer filled missing log-probs "
             "with 0 / -inf stand-ins. Pass the real response mask (False on those positions); an "
             "importer should drop unscored positions, not fill them.")
    if m["n_flagged_kept"] and n >= PLACEHOLDER_SHARE * m["n_tokens"]:
        return Judgement("fail", summary, evidence, m["examples"] or [], cause)
    if m["n_flagged_kept"]:
        cause += (f" So few (under {PLACEHOLDER_SHARE:g} of the tokens) may also be genuine extremes, a policy that "
                  "drove pi to exactly 1 on a token mu found unlikely: read the examples.")
    return Judgement("warn", summary, evidence, m["examples"] or [], cause)


@register_check("topk_sampled", sql="topk.sql", about="the sampled token missing from mu's top-K", params=TOPK_PARAMS)
def judge_topk_sampled(m: Mapping[str, Any]) -> Judgement:
    """The sampled token missing from mu's top-K ids (the engines put it in, replacing the K-th entry)."""
    skip = _topk_skip(m)
    if skip:
        return skip
    n = m["n_missing_sampled"]
    evidence = _pick(m, "n_topk", "k", "n_missing_sampled")
    summary = f"{n} of {m['n_topk']} top-K rows (K = {m['k']}) lack the sampled token"
    if not n:
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, m["missing_examples"] or [],
                     "mu's top-K is the engine's K most likely ids without the sampled token: top-K TV/KL then "
                     "misses the token the update is about. Ask the engine for the sampled token's log-prob as well "
                     "(vLLM returns it beside the K most likely) and put it in the K-th slot when it is not among "
                     "them; or the ids are misaligned with the tokens (see the alignment check).")


@register_check("topk_mass", sql="topk.sql", about="top-K probabilities summing above 1", params=TOPK_PARAMS)
def judge_topk_mass(m: Mapping[str, Any]) -> Judgement:
    """mu's (or pi's) top-K probabilities summing above 1 + :data:`TOPK_MASS_TOLERANCE`."""
    skip = _topk_skip(m)
    if skip:
        return skip
    n_mu, n_pi = m["n_mu_over"], m["n_pi_over"]
    evidence = _pick(m, "n_topk", "n_pi_topk", "n_mu_over", "n_pi_over", "mu_mass_max", "pi_mass_max")
    pi_max = "none logged" if m["pi_mass_max"] is None else f"{m['pi_mass_max']:.4g}"
    summary = (f"{n_mu} mu and {n_pi} pi top-K rows sum above 1 + {TOPK_MASS_TOLERANCE:g} "
               f"(largest sums: mu {m['mu_mass_max']:.4g}, pi {pi_max})")
    if not (n_mu or n_pi):
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, m["mass_examples"] or [],
                     "the lists are not log-probabilities of one distribution: raw logits or unnormalised scores "
                     "logged as log-probs, an id listed twice (see topk_duplicates), or entries taken from two "
                     "different distributions (processed and raw). The 'other' bucket then clamps at 0 and top-K "
                     "TV/KL are wrong.")


@register_check("topk_duplicates", sql="topk.sql", about="an id listed twice in one top-K row", params=TOPK_PARAMS)
def judge_topk_duplicates(m: Mapping[str, Any]) -> Judgement:
    """An id listed twice in one row of mu's top-K."""
    skip = _topk_skip(m)
    if skip:
        return skip
    n = m["n_duplicates"]
    evidence = _pick(m, "n_topk", "n_duplicates")
    summary = f"{n} of {m['n_topk']} top-K rows list an id more than once"
    if not n:
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, m["duplicate_examples"] or [],
                     "the sampled token was appended to (or written over) a top-K list that already held it, or "
                     "padding ids (0, the pad id) fill short rows: the token's mass is counted twice and the "
                     "'other' bucket shrinks. Put the sampled token in the K-th slot only when it is absent; pad "
                     "nothing.")


@register_check("processed_logprobs", sql="processed_logprobs.sql",
                about="the engine's processed log-probs against the trainer's raw ones",
                params={"floor": PLACEHOLDER_FLOOR}, manifest_field="sampling")
def judge_processed_logprobs(m: Mapping[str, Any], sampling: Mapping[str, Any] | None) -> Judgement:
    """Processed-vs-raw log-probs: the engine reports log-probs after temperature / top-p / top-k while the trainer's
    are the raw softmax. For a token sampled from the processed q, E[log q - log p] = KL(q || p) > 0 for any
    temperature != 1, and top-p / top-k renormalise the kept tokens upwards: either way mu reads higher than pi.
    With top-K lists, the slope of mu's log-probs on pi's at the same ids (the ratio of their spreads within each
    row) is 1 / temperature instead of 1, whatever the normaliser."""
    if not m or (m.get("n_tokens") or 0) < MIN_TOKENS:
        return Judgement("skipped", f"fewer than {MIN_TOKENS} tokens", _pick(m, "n_tokens"))
    evidence = _pick(m, "n_tokens", "n_ref_old", "mean_log_gap", "sd_log_gap", "n_topk_rows", "topk_slope")
    ref = "pi_old" if m["n_ref_old"] == m["n_tokens"] else "pi" if not m["n_ref_old"] else "pi_old (else pi)"
    gap, sd, n = m["mean_log_gap"], m["sd_log_gap"] or 0.0, m["n_tokens"]
    z = gap / (sd / math.sqrt(n)) if sd > 0 else (math.inf if gap > 0 else 0.0)
    evidence["z"] = z
    slope = m["topk_slope"]
    measured = f"mean log mu - log {ref} = {gap:+.4g} nats (z = {z:.3g})"
    if slope is not None:
        measured += f", top-K slope of log mu on log pi {slope:.4g}"
    if not sampling:
        return Judgement("skipped", "run.json records no sampling parameters; " + measured, evidence)
    if not isinstance(sampling, Mapping):
        raise ValueError(f"run.json sampling={sampling!r} must be an object of sampling parameters")
    temperature = _number(sampling, "temperature", 1.0)
    top_p = _number(sampling, "top_p", 1.0)
    top_k = _number(sampling, "top_k", 0.0)
    evidence.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if temperature <= 0:
        return Judgement("skipped", f"greedy decoding (temperature {temperature:g}): the engine's log-probs "
                         "are of no sampling distribution to compare; " + measured, evidence)
    processing = [f"temperature {temperature:g}"] if temperature != 1 else []
    processing += [f"top_p {top_p:g}"] if top_p < 1 else []
    processing += [f"top_k {top_k:g}"] if top_k > 0 else []
    if not processing:
        return Judgement("skipped", "sampling at temperature 1 without top-p/top-k: processed and raw "
                         "log-probs agree; " + measured, evidence)
    predicted = "mu above pi" + (f" and a top-K slope of 1 / {temperature:g} = {1 / temperature:.4g}"
                                 if temperature != 1 else "")
    summary = f"{measured}; at {', '.join(processing)}, a processed mu against a raw pi would read {predicted}"
    # Drift and mismatch move the slope little (noise in pi pulls it a little below 1) but the mean gap a lot
    # (E[log mu - log pi] is KL(mu || pi) >= 0 whatever the cause), so a gap against a pi that moved only warns.
    sharpened = temperature != 1 and slope is not None and abs(slope - 1 / temperature) < abs(slope - 1)
    slope_says_raw = temperature != 1 and slope is not None and not sharpened
    truncating = top_p < 1 or top_k > 0
    biased = gap > BIAS_NATS and z > BIAS_Z and (truncating or not slope_says_raw)
    if not (sharpened or biased):
        return Judgement("ok", summary, evidence)
    cause = (f"mu holds the engine's processed log-probs (after {', '.join(processing)}) while pi is the "
             "trainer's raw softmax, so the ratio pi / mu carries the sampling transform, not the mismatch. "
             "Compute pi at the sampling temperature (divide the logits by it, e.g. capture(..., "
             "temperature=...)) and apply the same top-p / top-k, or log the engine's raw log-probs "
             "(vLLM logprobs_mode='raw_logprobs') and train on raw ones.")
    if sharpened or ref == "pi_old":
        return Judgement("fail", summary, evidence, m["examples"] or [], cause)
    return Judgement("warn", summary, evidence, m["examples"] or [],
                     cause + " But pi has moved since the rollout, which raises the gap too: log pi_old "
                     "(old_logprob, the trainer's log-probs at the rollout's weights) to tell the two apart.")


@register_check("mu_recompute", sql="mu_recompute.sql", about="a mu that is the trainer's own recompute",
                params={"informative": INFORMATIVE_LOGPROB, "same": SAME_NATS}, manifest_field="mu_source")
def judge_mu_recompute(m: Mapping[str, Any], mu_source: str | None) -> Judgement:
    """mu identical to pi (or pi_old): a recompute by the trainer, so no training-inference mismatch is measured.
    ``fail`` when mu is exactly the trainer's numbers on :data:`RECOMPUTE_SHARE` of the tokens and ``run.json``
    claims otherwise; ``warn`` when it says so (``mu_source = "trainer_recompute"``), or when mu agrees to float32
    rounding without being a copy (a recompute, or an engine numerically identical to the trainer)."""
    declared = mu_source == "trainer_recompute"
    declared_text = ("run.json says mu_source = 'trainer_recompute': mu is the trainer's own recompute, so "
                     "mismatch and ratio-based rules see no training-inference mismatch; log the engine's "
                     "log-probs (e.g. TRL's vLLM path) to measure it.")
    n = (m or {}).get("n_informative") or 0
    if n < MIN_TOKENS:
        if declared:
            return Judgement("warn", f"fewer than {MIN_TOKENS} tokens with log mu < {INFORMATIVE_LOGPROB:g} "
                             "to compare", _pick(m, "n_informative"), [], declared_text)
        return Judgement("skipped", f"fewer than {MIN_TOKENS} tokens with log mu < {INFORMATIVE_LOGPROB:g} "
                         "(all near-certain): too few to tell", _pick(m, "n_informative"))
    evidence = _pick(m, "n_informative", "n_exact_pi", "n_same_pi", "n_informative_old", "n_exact_old",
                     "n_same_old", "mismatch_mean")
    evidence["mu_source"] = mu_source
    n_old = m["n_informative_old"]
    exact = max(m["n_exact_pi"] / n, (m["n_exact_old"] or 0) / n_old if n_old else 0.0)
    near = max(m["n_same_pi"] / n, (m["n_same_old"] or 0) / n_old if n_old else 0.0)
    summary = (f"mu equals pi or pi_old exactly on {exact:.1%} and within {SAME_NATS:g} nats on {near:.1%} of {n} "
               f"tokens with log mu < {INFORMATIVE_LOGPROB:g}; mean |pi - mu| {m['mismatch_mean']:.3g}")
    if declared:
        return Judgement("warn", summary, evidence, m["examples"] or [], declared_text)
    if exact >= RECOMPUTE_SHARE:
        return Judgement("fail", summary, evidence, m["examples"] or [],
                         "mu is the trainer's own log-prob, not the engine's: the framework kept no rollout "
                         "log-probs and the trainer's numbers were logged as mu (TRL's transformers path, a pi_old "
                         "written into the mu column). Log the engine's log-probs, or mark the run "
                         "mu_source='trainer_recompute'.")
    if near >= RECOMPUTE_SHARE:
        return Judgement("warn", summary, evidence, m["examples"] or [],
                         "mu agrees with the trainer to float32 rounding: a recompute (a second trainer forward "
                         "logged as mu), or an engine numerically identical to the trainer (same weights, dtype and "
                         "kernels). Either way no training-inference mismatch is measured; if mu is a recompute, "
                         "mark the run mu_source='trainer_recompute'.")
    return Judgement("ok", summary, evidence)


@register_check("rank_collisions", sql="rank_collisions.sql", about="sample ids that several ranks reuse")
def judge_rank_collisions(m: Mapping[str, Any]) -> Judgement:
    """The same (step, sample_id) written by two ranks, in the tokens or the samples table."""
    if not m or not m.get("n_ranks"):
        return Judgement("skipped", "no token or sample rows")
    evidence = _pick(m, "n_ranks", "n_token_collisions", "n_sample_collisions")
    if m["n_ranks"] < 2:
        return Judgement("skipped", "one rank wrote this run: nothing can collide", evidence)
    n_tok, n_smp = m["n_token_collisions"], m["n_sample_collisions"]
    summary = (f"{n_tok} (step, sample_id) keys of tokens and {n_smp} of samples written by more than one of "
               f"{m['n_ranks']} ranks")
    if not (n_tok or n_smp):
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, m["examples"] or [],
                     "each rank numbers its samples from 0 (the logger's default when no sample_id is passed), so "
                     "different responses share a key and joins mix them. Pass a global sample_id (e.g. the index "
                     "in the global batch, or rank * per_rank + i); a context-parallel shard of one sample belongs "
                     "to one rank's file once reassembled.")


@register_check("turn_alignment", sql="turn_alignment.sql", about="mu and pi one position apart from a turn on")
def judge_turn_alignment(m: Mapping[str, Any]) -> Judgement:
    """``alignment`` judged per turn: a one-position shift inside a turn's tokens fits much better than the logged
    alignment (a shift that starts at a turn boundary, which the whole-response ``alignment`` averages away)."""
    turns = [t for t in (m.get("turns") or []) if t["turn"] is not None] if m else []
    if not turns:
        return Judgement("skipped", "the run logs no turns (tokens without `turn`): `alignment` judges whole "
                         "responses", _pick(m, "n_tokens"))
    judged = [t for t in turns if (t["n_pairs"] or 0) >= MIN_TOKENS]
    if not judged:
        return Judgement("skipped", f"no turn has {MIN_TOKENS} pairs of adjacent positions to compare",
                         _pick(m, "n_tokens", "n_turns"))
    shifted = []
    for t in judged:
        best, direction = min((t["diff_pi_later"], "later"), (t["diff_pi_earlier"], "earlier"))
        if t["diff_logged"] >= ALIGN_FLOOR and best < ALIGN_FACTOR * t["diff_logged"]:
            shifted.append((t, direction, best))
    evidence = {"n_tokens": m["n_tokens"], "n_turns": m["n_turns"],
                **{f"diff_logged_turn{t['turn']}": t["diff_logged"] for t in judged},
                **{f"diff_best_shift_turn{t['turn']}": min(t["diff_pi_later"], t["diff_pi_earlier"]) for t in judged}}
    if not shifted:
        return Judgement("ok", f"in each of {len(judged)} turns mu and pi fit best as logged", evidence)
    names = ", ".join(str(t["turn"]) for t, _, _ in shifted)
    worst, direction, best = max(shifted, key=lambda x: x[0]["diff_logged"] - x[2])
    summary = (f"turn(s) {names} of {len(judged)}: pi fits mu far better one position {direction} (turn "
               f"{worst['turn']}: mean |pi - mu| {worst['diff_logged']:.4g} as logged, {best:.4g} shifted)")
    first = all(t["turn"] != min(x["turn"] for x in judged) for t, _, _ in shifted)
    cause = ("the shift starts at a turn boundary: the turns before it are aligned. " if first else "") + (
        "The trainer's sequence and the engine's differ by one token from that boundary on: a separator or role "
        "token dropped (or added) where the environment's answer is spliced in, or the response mask and the "
        "log-probs sliced per turn with different offsets. Build the trainer's input from the engine's token ids, "
        "turn by turn, and log both from the same positions.")
    return Judgement("fail", summary, evidence, list(worst["examples"] or []), cause)


@register_check("turn_placeholders", sql="turn_placeholders.sql",
                about="log-probs of 0.0 padded in for a turn's tokens", params={"certain": CERTAIN_LOGPROB})
def judge_turn_placeholders(m: Mapping[str, Any]) -> Judgement:
    """Tokens whose mu log-prob is exactly 0.0 while pi gives them under 0.9, per turn: an environment's (tool's)
    tokens with the engine's log-probs padded with 0.0, let through by the response mask. ``fail`` from
    :data:`PADDED_MIN` such tokens in one turn, ``warn`` below."""
    if not m or not m.get("n_tokens"):
        return Judgement("skipped", "no token rows")
    turns = m.get("turns") or []
    flagged = [t for t in turns if t["n_flagged"]]
    evidence = {"n_tokens": m["n_tokens"], "n_flagged": m["n_flagged"],
                **{f"n_flagged_turn{t['turn']}": t["n_flagged"] for t in flagged}}
    certain = math.exp(CERTAIN_LOGPROB)
    if not flagged:
        return Judgement("ok", f"no token with mu's log-prob at exactly 0.0 where pi gives under {certain:.2g}, in "
                         f"{len(turns)} turn(s)", evidence)
    worst = max(flagged, key=lambda t: t["n_flagged"] / t["n_tokens"])
    where = "tokens without a turn" if worst["turn"] is None else f"turn {worst['turn']}"
    summary = (f"{m['n_flagged']} of {m['n_tokens']} tokens have mu's log-prob at exactly 0.0 where pi gives under "
               f"{certain:.2g}; most in {where}: {worst['n_flagged']} of {worst['n_tokens']}, "
               f"{worst['n_flagged_kept']} kept")
    cause = ("the engine's log-probs were padded with 0.0 where nothing was sampled: typically the environment's or "
             "a tool's tokens spliced into a multi-turn trajectory, which have no engine log-prob, left in the "
             "response mask. Mask those tokens out (response mask False) and log only the model's own turns.")
    verdict = "fail" if worst["n_flagged"] >= PADDED_MIN else "warn"
    return Judgement(verdict, summary, evidence, list(worst["examples"] or []), cause)


@register_check("zero_variance_groups", sql="zero_variance_groups.sql",
                about="GRPO groups whose rewards are all equal")
def judge_zero_variance_groups(m: Mapping[str, Any]) -> Judgement:
    """The share of GRPO groups (the responses of one prompt_id at one step) whose rewards are all equal: their
    group-relative advantages are 0, so they carry no gradient, yet their tokens count in the loss's denominators.
    ``warn`` from :data:`ZERO_VARIANCE_WARN` of the groups."""
    if not m or not m.get("n_groups"):
        return Judgement("skipped", "no prompt with two or more rewarded responses at one step (samples.reward, "
                         "prompt_id)", _pick(m, "n_groups"))
    evidence = _pick(m, "n_groups", "n_zero_variance", "n_steps", "n_tokens", "n_tokens_zero_variance")
    share = m["n_zero_variance"] / m["n_groups"]
    tokens = m["n_tokens_zero_variance"] / m["n_tokens"] if m["n_tokens"] else 0.0
    evidence.update(share_zero_variance=share, token_share_zero_variance=tokens)
    summary = (f"{m['n_zero_variance']} of {m['n_groups']} groups ({share:.0%}) have all rewards equal: "
               f"{tokens:.0%} of their response tokens carry no gradient")
    if share < ZERO_VARIANCE_WARN:
        return Judgement("ok", summary, evidence, list(m.get("examples") or []))
    return Judgement("warn", summary, evidence, list(m.get("examples") or []),
                     "most prompts are all solved or all failed at this difficulty: the batch's gradient comes from "
                     "few groups while every token dilutes the token-mean loss. Filter such groups out (dynamic "
                     "sampling), use a sequence-level or constant normaliser, or rebalance the prompt set.")


@register_check("staleness_bound", sql="staleness_bound.sql", about="tokens older than the declared staleness bound",
                manifest_field="max_staleness")
def judge_staleness_bound(m: Mapping[str, Any], max_staleness: Any) -> Judgement:
    """Tokens whose staleness (step - policy_version) exceeds the run's declared bound (run.json ``max_staleness``,
    ``TokenLogger(max_staleness=k)``): an asynchronous trainer that lets older rollouts through than it claims."""
    if not m or not m.get("n_versioned"):
        return Judgement("skipped", "the run logs no policy_version: staleness unknown", _pick(m, "n_tokens"))
    if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)):
        raise ValueError(f"run.json max_staleness={max_staleness!r} must be an integer")
    by = m.get("by_staleness") or []
    evidence = {**_pick(m, "n_tokens", "n_versioned", "max_staleness"),
                **{f"n_staleness_{b['staleness']}": b["n"] for b in by[:8]}}
    if max_staleness is None:
        return Judgement("skipped", f"no staleness bound declared (run.json max_staleness); the stalest tokens are "
                         f"{m['max_staleness']} version(s) behind", evidence, list(m.get("examples") or []))
    over = sum(b["n"] for b in by if b["staleness"] > max_staleness)
    evidence.update(bound=max_staleness, n_over_bound=over)
    summary = (f"{over} of {m['n_versioned']} tokens are more than {max_staleness} version(s) behind the trainer "
               f"(stalest: {m['max_staleness']})")
    if not over:
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, list(m.get("examples") or []),
                     "rollouts older than the declared bound reached the update: the trainer's staleness filter "
                     "(or its queue's capacity) lets them through, or policy_version is logged from the wrong "
                     "counter (the version a request was submitted under, not the weights that sampled the token).")


@register_check("token_drift", sql="token_drift.sql", about="engine token ids differing from the trainer's")
def judge_token_drift(m: Mapping[str, Any]) -> Judgement:
    """The engine's sampled token id (``engine_token_id``) differing from the id the trainer scored: the trainer's
    input was re-tokenized from text instead of reusing the sampled ids."""
    if not m or not m.get("n_logged"):
        return Judgement("skipped", "the run logs no engine_token_id", _pick(m, "n_tokens"))
    evidence = _pick(m, "n_tokens", "n_logged", "n_differ", "n_responses_differ")
    evidence.update({f"n_differ_turn{t['turn']}": t["n_differ"] for t in (m.get("turns") or []) if t["n_differ"]})
    summary = (f"{m['n_differ']} of {m['n_logged']} tokens' ids differ between the engine and the trainer, in "
               f"{m['n_responses_differ']} response(s)")
    if not m["n_differ"]:
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, list(m.get("examples") or []),
                     "the trainer scores different token ids than the engine sampled: the history was decoded to "
                     "text and tokenized again (merges differ across a turn boundary or a chat template), so pi is "
                     "computed on tokens mu never sampled. Keep the sampled ids and splice the environment's tokens "
                     "in (tokens in, tokens out).")


@register_check("routing_replay", sql="routing_replay.sql",
                about="routing left disagreeing in a run declared replayed", manifest_field="routing_replay")
def judge_routing_replay(m: Mapping[str, Any], replayed: Any) -> Judgement:
    """Routing replay's health: a run declared replayed (run.json ``routing_replay``, ``TokenLogger(routing_replay=
    True)``, ``trustscope train --routing-replay``) routes every token through the engine's experts, so the experts
    the trainer's forward used (``trainer_experts``) equal the engine's (``engine_experts``) on every (layer, slot):
    any disagreement left means the replay buffer was misaligned, stale or corrupted, or replay was not applied."""
    if replayed is not None and not isinstance(replayed, bool):
        raise ValueError(f"run.json routing_replay={replayed!r} must be true or false")
    routed = (m or {}).get("n_routed") or 0
    evidence = _pick(m, "n_tokens", "n_routed")
    if routed:
        evidence.update(_pick(m, "n_disagree", "n_steps_disagree"), choice_disagreement=m["choice_disagreement"])
        evidence["token_disagreement"] = m["n_disagree"] / routed
    if not replayed:
        return Judgement("skipped", "the run is not declared replayed (run.json routing_replay)"
                         + (f"; {m['n_disagree']} of {routed} routed tokens disagree in some layer" if routed else ""),
                         evidence)
    if not routed:
        return Judgement("warn", "the run is declared replayed but logs no routed experts on both sides: replay "
                         "health unknown", evidence, cause="log engine_experts and trainer_experts (the integrated "
                         "trainer does with the vllm engine) so the replay can be checked")
    summary = (f"{m['n_disagree']} of {routed} routed tokens ({m['n_disagree'] / routed:.2%}) disagree in some layer "
               f"under replay; {m['choice_disagreement']:.3%} of (layer, slot) choices differ")
    if not m["n_disagree"]:
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, list(m.get("examples") or []),
                     "the trainer's forward did not use the experts the engine routed to: the replay buffer is "
                     "misaligned with the tokens (a prompt/response offset, left padding, a reordered batch), stale "
                     "(another step's rollouts) or corrupted, or the replay hook is not installed on every MoE layer.")


REPLACE_RATE_WARN = 0.5
"""A replace rate above this share of the router's own choices: the trainer's router picks mostly other experts
than the engine did (the policy trained has drifted from the one that generated, or the two sides' numerics
diverge): ``routing_replace_rate`` warns."""


@register_check("routing_replace_rate", sql="routing_health.sql",
                about="the share of the router's own expert choices the routing replay replaced")
def judge_routing_replace_rate(m: Mapping[str, Any]) -> Judgement:
    """The replace rate under routing replay (miles compares the replayed experts with the router's own choice,
    prime-rl logs ``router_replay_replace_rate``): the share of the trainer router's own (layer, slot) choices the
    engine's experts replaced, from ``routing_replaced`` (logged with ``router_experts``), overall, per MoE layer and
    per step, exact over every token. ``warn`` above :data:`REPLACE_RATE_WARN`."""
    n = (m or {}).get("n_replaced") or 0
    if not n:
        return Judgement("skipped", "the run logs no router's own pick beside the engine's experts (router_experts): "
                         "replace rate unknown", _pick(m, "n_agreement"))
    rate = float(m["replace_rate"])
    layers = m.get("replace_by_layer") or []
    evidence = {"n_tokens": n, "replace_rate": rate,
                **{f"replace_rate_layer{r['layer']}": r["replace_rate"] for r in layers}}
    worst = max(layers, key=lambda r: r["replace_rate"]) if layers else None
    summary = (f"the replay replaced {rate:.2%} of the router's own (layer, slot) choices over {n:,} tokens"
               + (f"; most in layer {worst['layer']} ({worst['replace_rate']:.2%})" if worst else ""))
    steps = [dict(r) for r in (m.get("worst_steps") or [])]
    if rate <= REPLACE_RATE_WARN:
        return Judgement("ok", summary, evidence, steps)
    return Judgement("warn", summary, evidence, steps,
                     f"more than {REPLACE_RATE_WARN:.0%} of the router's choices were replaced: the trainer's router "
                     "routes most tokens elsewhere than the engine did, so the replayed forward is far from the "
                     "policy's own (stale rollouts, a weight sync that did not reach the engine, or precision "
                     "differences in the router's logits).")


NO_ROUTING_HEALTH = ("the run logs no routed experts with their health (engine_experts, routing_fault): a dense "
                     "model, routing not logged, or a log older than tokens version 4")
"""Why the replay health checks are skipped where they cannot apply."""


@register_check("routing_fallbacks", sql="routing_health.sql",
                about="tokens the engine reported no routing for", manifest_field="routing_replay")
def judge_routing_fallbacks(m: Mapping[str, Any], replayed: Any) -> Judgement:
    """Tokens whose ``engine_experts`` the engine did not report (a row of -1: ``routing_fault`` bit 1): replay
    falls back to the router's own pick there (NeMo-RL's R3 trace check counts such rows). ``fail`` in a run
    declared replayed, ``warn`` otherwise."""
    if not (m or {}).get("has_faults"):
        return Judgement("skipped", NO_ROUTING_HEALTH, {})
    n = int(m["n_fallback"])
    evidence = _pick(m, "n_agreement", "n_replaced", "n_fallback")
    summary = f"{n:,} token(s) with no engine routing"
    if not n:
        return Judgement("ok", summary, evidence)
    examples = [dict(r) for r in (m.get("fallback_examples") or [])]
    return Judgement("fail" if replayed else "warn", summary, evidence, examples,
                     "the engine returned no routed experts for these positions (a request that fell out of the "
                     "capture, prefix-cached positions, a buffer shorter than the response): replay used the "
                     "router's own experts there, so those tokens were not replayed.")


@register_check("routing_alignment", sql="routing_health.sql",
                about="replay buffers shifted by a position or reused across responses")
def judge_routing_alignment(m: Mapping[str, Any]) -> Judgement:
    """Responses whose engine experts sit one position off the router's own pick (they agree with it better at
    the next or previous position than at their own: ``routing_fault`` bit 2) or repeat another response's with
    other tokens (bit 4): a replay buffer shifted by one position or reused across samples."""
    if not (m or {}).get("has_faults"):
        return Judgement("skipped", NO_ROUTING_HEALTH, {})
    evidence = _pick(m, "n_shifted", "n_reused", "n_responses_shifted", "n_responses_reused")
    summary = (f"{int(m['n_shifted']):,} token(s) in {int(m['n_responses_shifted'] or 0)} response(s) with engine "
               f"experts one position off, {int(m['n_reused']):,} token(s) in {int(m['n_responses_reused'] or 0)} "
               f"response(s) with another response's engine experts")
    if not m["n_shifted"] and not m["n_reused"]:
        return Judgement("ok", summary, evidence)
    return Judgement("fail", summary, evidence, [dict(r) for r in (m.get("alignment_examples") or [])],
                     "the replay buffer is not the tokens' own: shifted by one position (the rollout's experts "
                     "of position t laid on token t instead of t - 1, or the other way round) or one response's "
                     "buffer given to several responses (a batch reordered or padded without its routing).")


# ------------------------------------------------------------------------------------------------ measuring


def measure(db: LogDB, sql: str, run_ids: Sequence[str] | None = None, first_step: int | None = None,
            **params: float) -> dict[str, dict[str, Any]]:
    """Run ``sql/doctor/<sql>`` with bound parameters over ``run_ids`` (or all runs) from ``first_step`` on (or
    all steps); one row per run, keyed by run_id."""
    text = (DOCTOR_SQL_DIR / sql).read_text()
    bound = {"run_ids": None if run_ids is None else list(run_ids), "first_step": first_step, **params}
    # read again where a compaction swapped a rank folder under the read (a live run with compact_every)
    table = db.read(lambda cur: cur.sql(text, params=bound).to_arrow_table())
    return {row["run_id"]: row for row in table.to_pylist()}


def measure_all(db: LogDB, keys: Sequence[tuple[str, tuple]], run_ids: Sequence[str] | None = None,
                first_step: int | None = None) -> dict[tuple[str, tuple], dict[str, dict[str, Any]]]:
    """:func:`measure` of each ``(sql file, sorted params)`` of ``keys``, on :data:`MEASURE_THREADS` threads with a
    cursor each (the checks are small queries that wait mostly on DuckDB's planning, which runs outside the GIL:
    three threads took the 14 checks over three runs' last steps of ``sample_logs`` from 1.2 to 0.67 s); each read
    again where a compaction swapped a rank folder under it."""
    from concurrent.futures import ThreadPoolExecutor

    def one(key: tuple[str, tuple]) -> dict[str, dict[str, Any]]:
        return measure(db, key[0], run_ids, first_step, **dict(key[1]))

    with ThreadPoolExecutor(max(1, min(MEASURE_THREADS, len(keys))), thread_name_prefix="trustscope-doctor") as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


MEASURE_THREADS = 3
"""Checks measured side by side (:func:`measure_all`)."""


def diagnose(db: LogDB, run_ids: Iterable[str] | str | None = None, checks: Iterable[str] | None = None,
             first_step: int | None = None) -> dict[str, list[Finding]]:
    """Every check (or ``checks``) on every run of ``db`` (or ``run_ids``): {run_id: [Finding per check]}.

    ``first_step`` reads only the steps from there on (a big run's recent window). Each SQL file is run once for all
    the runs asked for; a run unknown to ``db`` raises ``KeyError`` naming it.
    """
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise KeyError(f"unknown check(s) {unknown}; known: {list(CHECKS)}")
    db.refresh()
    manifests = run_manifests(db)
    wanted = list(manifests) if run_ids is None else [run_ids] if isinstance(run_ids, str) else list(run_ids)
    missing = [r for r in wanted if r not in manifests]
    if missing:
        raise KeyError(f"run(s) {missing} not in the log directory; runs: {sorted(manifests)}")
    only = None if run_ids is None else wanted
    keys = list(dict.fromkeys((CHECKS[n].sql, tuple(sorted(CHECKS[n].params.items()))) for n in names))
    measured = measure_all(db, keys, only, first_step)
    out: dict[str, list[Finding]] = {r: [] for r in wanted}
    for name in names:
        check = CHECKS[name]
        key = (check.sql, tuple(sorted(check.params.items())))
        for run_id in wanted:
            row = measured[key].get(run_id, {})
            args = (manifests[run_id].get(check.manifest_field),) if check.manifest_field else ()
            try:
                judged = check.judge(row, *args)
            except ValueError as err:  # a manifest field of the wrong kind: name the run
                raise ValueError(f"run {run_id!r}: {err}") from None
            out[run_id].append(Finding(**vars(judged), check=name))
    return out


def run_manifests(db: LogDB) -> dict[str, dict[str, Any]]:
    """Each run's manifest (run.json) as a dict, by run_id ({} for a run without one)."""
    cur = db.cursor()
    try:
        rows = cur.sql("select run_id, manifest from runs").to_arrow_table().to_pylist()
    finally:
        cur.close()
    out = {run_id: {} for run_id in db.broken_runs}  # a run whose run.json does not read
    out.update({r["run_id"]: json.loads(r["manifest"]) if isinstance(r["manifest"], str) else (r["manifest"] or {})
                for r in rows})
    return out


def doctor_panel(db: LogDB | str | Path, run_ids: Sequence[str] | str, first_step: int | None = None) -> pd.DataFrame:
    """The checks of one run (or several) as rows for the dashboard: run_id, check, verdict, summary, cause and
    examples (JSON text). ``db`` is an open :class:`LogDB` or a log directory opened for the occasion."""
    if isinstance(db, LogDB):
        found = diagnose(db, run_ids, first_step=first_step)
    else:
        found = doctor_logdir(db, run_ids, first_step=first_step)
    rows = [{"run_id": run_id, "check": f.check, "verdict": f.verdict, "summary": f.summary, "cause": f.cause,
             "examples": json.dumps(f.examples, default=_json_default) if f.examples else ""}
            for run_id, fs in found.items() for f in fs]
    import pandas as pd

    return pd.DataFrame(rows, columns=["run_id", "check", "verdict", "summary", "cause", "examples"])


def doctor_logdir(logdir: str | Path, run_ids: Iterable[str] | str | None = None,
                  first_step: int | None = None) -> dict[str, list[Finding]]:
    """:func:`diagnose` over a log directory opened for the occasion (no aggregate cache written)."""
    with connect(logdir, cache=False) as db:
        return diagnose(db, run_ids, first_step=first_step)


# ------------------------------------------------------------------------------------------------ printing


def format_finding(f: Finding, examples: int = 3) -> list[str]:
    """A finding as text lines: verdict and summary, the evidence, a few examples, the likely cause."""
    lines = [f"  [{f.verdict.upper()}] {f.check}: {f.summary}"]
    if f.evidence:
        lines.append("      evidence: " + ", ".join(f"{k}={_fmt(v)}" for k, v in f.evidence.items()))
    for ex in f.examples[:examples]:
        lines.append("      e.g. " + ", ".join(f"{k}={_fmt(v)}" for k, v in ex.items()))
    if f.cause and f.verdict in ("warn", "fail"):
        lines.append(f"      likely cause: {f.cause}")
    return lines


def failed(findings: Mapping[str, list[Finding]]) -> int:
    """How many findings failed, over all runs."""
    return sum(f.verdict == "fail" for fs in findings.values() for f in fs)


# ------------------------------------------------------------------------------------------------ helpers


def _topk_skip(m: Mapping[str, Any]) -> Judgement | None:
    if not m or not m.get("n_tokens"):
        return Judgement("skipped", "no token rows")
    if not m.get("n_topk"):
        return Judgement("skipped", "the run logs no top-K lists (log_topk=False or none given)",
                         _pick(m, "n_tokens", "n_topk"))
    return None


def _pick(m: Mapping[str, Any] | None, *keys: str) -> dict[str, Any]:
    return {k: m[k] for k in keys if m and k in m}


def _number(sampling: Mapping[str, Any], key: str, default: float) -> float:
    """A sampling parameter as a float; absent or null reads as its neutral ``default``; anything else is an error
    naming the field."""
    value = sampling.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"run.json sampling.{key}={value!r} must be a finite number")
    return float(value)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(_fmt(x) for x in v[:8]) + ", ...]"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _json_default(v: Any) -> Any:
    return float(v) if isinstance(v, int | float) else str(v)


CHECK_MODULES = ("trustscope.explain.detect",)
"""Modules above this one that declare further checks (:func:`register_check`; trustscope explain's detectors, the
cause_* checks), imported by name after the built-in ones: they import this module, so this one names them only
(the layers run one way)."""

for _module in CHECK_MODULES:
    importlib.import_module(_module)
