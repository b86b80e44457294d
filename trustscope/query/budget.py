"""Rules compared at an equal budget: the threshold at which each rule blocks the same share of a run's tokens.

A rule's defaults come from other models and other mismatch levels, so on one run they may block nearly every
token or none; side by side at their defaults, rules say more about their calibration than about what they pick.
Here each rule with a scalar threshold (:class:`trustscope.losses.Threshold`) is moved, along its one scale, to
block the share of the tokens that carry gradient (A != 0) that a reference blocks: the rule the run trained with,
or a share the caller gives. Then the rules can be compared on *which* tokens they pick.

Two sources, said in every result's ``source``:

- the run's summaries (``threshold_hist``, written by the logger over every token): the count the rule blocks at
  every bin edge of scale is exact, so the threshold is found to within one bin (8 a decade): ``value_low`` and
  ``value_high`` bracket it, each with the count it blocks, and ``value`` is the edge whose count is nearest;
- the logged rows (``rule_blocks``' ``score_<rule>`` columns): the exact cut between two tokens' scores, a
  threshold that blocks the nearest count the rule can block (a sequence rule blocks whole responses); over the
  logged tokens, a sample where the run kept a fraction of its rows.

The summaries are used where they hold the rule at the parameters asked for (``run.json``'s
``logging.summary_rules``), the rows otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trustscope import runformat
from trustscope.losses import LossRule, get_loss, list_losses
from trustscope.query.runs import logged_fraction
from trustscope.rule_settings import check_budget, explicit_name, number_text

if TYPE_CHECKING:
    import pandas as pd

LogDB = Any
"""A :class:`trustscope.query.connection.LogDB` (named here without importing it: the connection's analyses import
this module)."""

BUDGET_COLUMNS = ("run_id", "rule", "param", "default", "value", "value_low", "value_high", "n_blocked",
                  "n_blocked_low", "n_blocked_high", "n_tokens", "blocked_frac", "target_frac", "target_blocked",
                  "reference", "setting", "params", "source", "note", "off")
"""The columns of :func:`equal_budget` (see :meth:`trustscope.query.analyses.NamedAnalyses.equal_budget`)."""

SUMMARIES_SOURCE = "summaries (every token; exact to a bin edge)"
"""The ``source`` of a threshold read from the summaries' threshold histogram."""

EQUAL_WITHIN = 0.01
"""How close to the reference's count every rule's count should come, as a share of it: a rule the summaries'
bins bracket no closer is cut again on the logged rows where they hold every token (exact, but for tied scores
and a sequence rule's whole responses, which the note then names)."""

OUT_OF_CALIBRATION = 0.5
"""A rule whose parameters block more than this share of a run's tokens with A != 0 is out of calibration for the
run: its figures say more about its defaults than about the tokens."""


def mask_params(rule: LossRule, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters ``rule``'s blocks depend on."""
    return {p: params.get(p) for p in rule.mask_params}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) or (isinstance(a.get(k), float | int) and isinstance(b.get(k), float | int)
                                        and math.isclose(a[k], b[k], rel_tol=1e-12)) for k in set(a) | set(b))


def short_value(lo: float, hi: float) -> float:
    """The number with the fewest significant digits strictly between ``lo`` and ``hi`` (``lo < hi``)."""
    for digits in range(1, 18):
        for candidate in (float(f"{(lo + hi) / 2:.{digits}g}"), float(f"{hi:.{digits}g}"), float(f"{lo:.{digits}g}")):
            if lo < candidate < hi:
                return candidate
    return (lo + hi) / 2


class _Run:
    """One run's facts for the solve: its directory, manifest, bound rule parameters, applied rule."""

    def __init__(self, db: LogDB, run: Path, run_id: str, rules: dict[str, dict[str, Any]]) -> None:
        self.run_id, self.rules = run_id, rules
        try:
            manifest = json.loads((run / runformat.MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = {}
        self.manifest = manifest if isinstance(manifest, dict) else {}
        logging = self.manifest.get("logging") if isinstance(self.manifest.get("logging"), dict) else {}
        self.summary_rules = logging.get("summary_rules") if isinstance(logging.get("summary_rules"), dict) else {}
        self.fraction = logged_fraction(self.manifest)
        self.applied = db.binding.run_rule(run)[1]

    def rows_source(self) -> str:
        if self.fraction is not None and self.fraction < 1:
            return f"logged rows (a {self.fraction:.0%} sample of the sequences)"
        return "logged rows (every token)"

    def summaries_hold(self, rule: LossRule) -> bool:
        """Whether the summaries' threshold_hist of ``rule`` is at the parameters bound for it here."""
        entry = self.summary_rules.get(rule.name)
        if not isinstance(entry, dict) or entry.get("rule") != rule.name or not isinstance(entry.get("params"), dict):
            return False
        return _same(mask_params(rule, self.rules[rule.name]), entry["params"])


def _runs(db: LogDB, run_ids: Sequence[str] | str | None) -> list[_Run]:
    wanted = None if run_ids is None else [run_ids] if isinstance(run_ids, str) else list(run_ids)
    db.refresh()
    out = []
    for run, (run_id, rules) in db.binding.rule_sets(db.runs_dirs).items():
        if wanted is None or run_id in wanted:
            out.append(_Run(db, run, run_id, rules))
    if wanted is not None:
        missing = sorted(set(wanted) - {r.run_id for r in out})
        if missing:
            raise ValueError(f"no run {missing[0]!r} here; runs: {', '.join(sorted(r.run_id for r in out))}")
    return out


def _rules(names: Sequence[str] | str | None) -> list[LossRule]:
    names = None if names is None else [names] if isinstance(names, str) else list(names)
    known = [n for n in list_losses() if get_loss(n).sql is not None]
    if names is None:
        return [get_loss(n) for n in known]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown rule {unknown[0]!r}; rules the views show: {', '.join(known)}")
    return [get_loss(n) for n in names]


class _Figures:
    """What the solve reads of every run at once: the overview's blocked totals and tokens with A != 0, and the
    summaries' threshold histograms (one query for all the runs, not a few a run)."""

    def __init__(self, db: LogDB, runs: list[_Run], hist_runs: list[str], overview: Any = None) -> None:
        ids = [r.run_id for r in runs]
        if overview is None:
            overview = db.overview(ids) if ids else None
        else:  # the caller's (the report's, the dashboard's), of these runs or more
            overview = type(overview)(overview.steps[overview.steps["run_id"].isin(ids)],
                                      overview.blocked[overview.blocked["run_id"].isin(ids)], overview.sources)
        totals = overview.blocked_totals() if overview is not None else None
        self.blocked: dict[tuple[str, str], tuple[int, int]] = {} if totals is None else {
            (str(t.run_id), str(t.rule)): (int(t.n_blocked), int(t.n_tokens)) for t in totals.itertuples()}
        steps = overview.steps if overview is not None else None
        self.n_tokens: dict[str, int] = {} if steps is None or not len(steps) else {
            str(k): int(v) for k, v in steps.groupby("run_id")["n_nonzero_advantage"].sum().items()}
        hist = db.query("threshold_hist", run_ids=hist_runs) if hist_runs else None
        self.hist: dict[str, pd.DataFrame] = {} if hist is None else {
            str(k): part for k, part in hist.groupby("run_id")}
        self.bins: dict[tuple[str, str], tuple[Any, Any, Any]] = {} if hist is None else {
            (str(run_id), str(rule)): (part["bin_low"].to_numpy(), part["bin_high"].to_numpy(),
                                       part["count"].to_numpy())
            for (run_id, rule), part in hist.sort_values("bin_low").groupby(["run_id", "rule"])}
        """(run_id, rule) -> the bins' low edges, high edges and counts, by low edge"""


def reference_share(run: _Run, figures: _Figures) -> tuple[float | None, str]:
    """The share of the run's A != 0 tokens its own rule blocks (exact where the run has summaries), and a
    sentence naming it; None where the run's rule is unknown here or blocks nothing."""
    if run.applied is None or run.applied not in list_losses() or get_loss(run.applied).sql is None:
        return None, f"the run's rule {run.applied!r} is not one the views evaluate: give a budget"
    n, of = figures.blocked.get((run.run_id, run.applied), (0, 0))
    if not n:
        return None, f"the run's rule {run.applied} blocks no token: give a budget"
    return n / of, f"{run.applied} (the run's rule: {n:,} of {of:,} tokens with A != 0)"


def rows_reference(db: LogDB, run: _Run) -> tuple[float | None, str]:
    """:func:`reference_share` over the logged rows (the population a cut from the rows is made on, so the run's
    own rule stays at its own threshold)."""
    if run.applied is None or run.applied not in list_losses() or get_loss(run.applied).sql is None:
        return None, f"the run's rule {run.applied!r} is not one the views evaluate: give a budget"
    df = db.blocked_fractions([run.run_id], [run.applied])
    df = df[df["advantage_side"] == "all"]
    n, of = int(df["n_blocked"].sum()), int(df["n_tokens"].sum())
    if not n:
        return None, f"the run's rule {run.applied} blocks no logged token: give a budget"
    return n / of, f"{run.applied} (the run's rule: {n:,} of the {of:,} logged tokens with A != 0)"


def _logged_rows(run: _Run) -> int | None:
    """The token rows the run's logger committed (run.json's ``rows``), or None where it does not say."""
    rows = run.manifest.get("rows")
    value = rows.get("tokens") if isinstance(rows, dict) else None
    return int(value) if isinstance(value, int | float) else None


def _row(run: _Run, rule: LossRule, **values: Any) -> dict[str, Any]:
    threshold = rule.threshold
    base = run.rules[rule.name]
    out = dict.fromkeys(BUDGET_COLUMNS)
    out.update(run_id=run.run_id, rule=rule.name, param=threshold.param if threshold else None,
               default=base.get(threshold.param) if threshold else None)
    out.update(values)
    return out


def _setting(rule: LossRule, base: dict[str, Any], u: float, value: float | None = None) -> tuple[str, str, str]:
    """(name, params JSON, note) of ``rule`` at scale ``u`` from ``base`` (the threshold at ``value`` exactly
    when given); the note says when a parameter leaves its bounds."""
    threshold = rule.threshold
    params = threshold.at(u, base)
    if value is not None:
        params[threshold.param] = value
    try:
        resolved = rule.resolve(**{k: v for k, v in params.items() if k in rule.params})
    except (TypeError, ValueError) as err:
        return "", json.dumps(mask_params(rule, params), default=str), f"outside the parameters' bounds: {err}"
    at_defaults = _same(mask_params(rule, base), mask_params(rule, rule.defaults))
    name = (f"{rule.name}@{number_text(resolved[threshold.param])}" if at_defaults
            else explicit_name(rule, resolved))
    return name, json.dumps(mask_params(rule, resolved), default=str), ""


def _value(rule: LossRule, base: dict[str, Any], u: float) -> float:
    return float(rule.threshold.at(u, base)[rule.threshold.param])


def _from_summaries(run: _Run, rule: LossRule, bins: tuple[Any, Any, Any], n_tokens: int,
                    target: int) -> dict[str, Any] | None:
    """The summaries' bracket, or None where the threshold lies beyond the bins (then the rows are read)."""
    base = run.rules[rule.name]
    lows, highs, counts = bins
    above = counts[::-1].cumsum()[::-1]  # tokens in this bin and every bin above: blocked at scale = bin_low
    source = SUMMARIES_SOURCE
    if not len(counts) or above[0] < target:
        most = int(above[0]) if len(counts) else 0
        return _row(run, rule, n_tokens=n_tokens, source=source,
                    note=f"blocks at most {most:,} of {n_tokens:,} tokens at any threshold")
    # the highest bin whose low edge still blocks >= target: the threshold lies in [bin_low, bin_high]
    i = int((above >= target).nonzero()[0][-1])
    u_low, n_low = float(lows[i]), int(above[i])
    u_high = float(highs[i])
    n_high = int(above[i + 1]) if i + 1 < len(above) else 0  # the bins above start at or after u_high
    if not math.isfinite(u_high):  # beyond the bins' range: the summaries cannot bracket it
        return None
    u, n = (u_low, n_low) if abs(n_low - target) <= abs(n_high - target) else (u_high, n_high)
    u_low = max(u_low, 1e-300)
    values = sorted((_value(rule, base, u_low), _value(rule, base, u_high)))
    counts_at = (n_low, n_high) if values[0] == _value(rule, base, u_low) else (n_high, n_low)
    name, params, note = _setting(rule, base, u)
    return _row(run, rule, value=_value(rule, base, u), value_low=values[0], value_high=values[1], n_blocked=n,
                n_blocked_low=counts_at[0], n_blocked_high=counts_at[1], n_tokens=n_tokens,
                blocked_frac=n / n_tokens if n_tokens else None, setting=name, params=params, source=source,
                note=note or ("exact at a bin edge" if n == target else
                              f"between two bin edges: {min(n_low, n_high):,} to {max(n_low, n_high):,} tokens"))


def _from_rows(run: _Run, rule: LossRule, cut: pd.DataFrame) -> dict[str, Any]:
    base = run.rules[rule.name]
    rows = cut[cut["rule"] == rule.name]
    source = run.rows_source()
    if not len(rows):
        return _row(run, rule, source=source, note="blocks no logged token at any threshold")
    r = rows.iloc[0]
    n_tokens = int(r["n_tokens"])
    score, below = r["score"], r["next_score"]
    if score is None or (isinstance(score, float) and math.isnan(score)):
        u = float(below) * 2 if below and below > 0 and math.isfinite(below) else 1e300  # above every score
        value = None
    else:
        lo = 0.0 if below is None or (isinstance(below, float) and math.isnan(below)) else float(below)
        hi = float(score)
        if not math.isfinite(hi):  # only tokens every scale blocks are left above: no finite threshold frees them
            return _row(run, rule, n_tokens=n_tokens, source=source,
                        note="only tokens blocked at every threshold (dual-clip) remain above this budget")
        u, value = short_scale(rule, base, lo, hi)
    n = int(r["n_blocked"])
    value = _value(rule, base, u) if value is None else value
    name, params, note = _setting(rule, base, u, value)
    target = int(r["target"])
    return _row(run, rule, value=value, value_low=value, value_high=value, n_blocked=n, n_blocked_low=n,
                n_blocked_high=n, n_tokens=n_tokens, blocked_frac=n / n_tokens if n_tokens else None,
                setting=name, params=params, source=source,
                note=note or ("exact" if n == target else
                              f"nearest count it can block ({n:,}; target {target:,}): ties move together"))


def short_scale(rule: LossRule, base: dict[str, Any], lo: float, hi: float) -> tuple[float, float | None]:
    """A scale strictly between the scores ``lo`` < ``hi`` whose threshold value has few digits, and that value
    (None where no such value was found: the midpoint's)."""
    threshold = rule.threshold
    kind = dict(threshold.scaled)[threshold.param]
    a, b = sorted((_value(rule, base, lo) if lo > 0 or kind == "linear" else _value(rule, base, 1e-300),
                   _value(rule, base, hi)))
    if a < b:
        value = short_value(a, b)
        u = threshold.scale_of(value, base)
        if lo < u < hi:
            return u, value
    return (lo + hi) / 2, None


def _logged_in_full(run: _Run) -> bool:
    """Whether the run's logged rows are every token (``token_fraction`` 1, or not said by an older log)."""
    return run.fraction is None or run.fraction >= 1


def _off(row: dict[str, Any]) -> float | None:
    """How far the count a row blocks is from its target, as a share of the target (signed)."""
    n, target = row.get("n_blocked"), row.get("target_blocked")
    if n is None or target is None or (isinstance(n, float) and math.isnan(n)) or not target:
        return None
    return (n - target) / target


def equal_budget(db: LogDB, run_ids: Sequence[str] | str | None = None, budget: float | None = None,
                 rules: Sequence[str] | str | None = None, max_rows: int | None = None,
                 overview: Any = None) -> pd.DataFrame:
    """See :meth:`trustscope.query.analyses.NamedAnalyses.equal_budget`. ``max_rows``: a run whose rules must
    be cut on its logged rows is left out (a note says so) when it logged more token rows than this (the cut
    reads every one of them: 49 s for 1M rows on a loaded 2-core machine).

    Every run's figures are read at once (:class:`_Figures`: the overview and one query of the threshold
    histograms). A rule the summaries bracket no closer than :data:`EQUAL_WITHIN` of the target is cut again on
    the logged rows where they are every token (an exact cut), within ``max_rows``. ``overview``: the
    :meth:`LogDB.overview` the caller holds already (of these runs or more), read instead of a new one."""
    import pandas as pd

    share = None if budget is None else check_budget(budget)
    chosen = _rules(rules)
    runs = _runs(db, run_ids)
    figures = _Figures(db, runs, [r.run_id for r in runs
                                  if any(r.summaries_hold(rule) for rule in chosen if rule.threshold)], overview)
    out = []
    for run in runs:
        if share is None:
            target_frac, reference = reference_share(run, figures)
        else:
            target_frac, reference = share, f"a budget of {share:.2%} of the tokens with A != 0"
        hist = figures.hist.get(run.run_id)
        n_summ = figures.n_tokens.get(run.run_id, 0) if hist is not None else 0
        logged = _logged_rows(run)
        readable = max_rows is None or logged is None or logged <= max_rows
        cut = None
        for rule in chosen:
            if rule.threshold is None:
                out.append(_row(run, rule, reference=reference, target_frac=target_frac,
                                note=f"no scalar threshold (mask family {rule.sql.family!r}): not compared at an "
                                     f"equal budget"))
                continue
            why = rule.threshold.scalable(run.rules[rule.name])
            if target_frac is None or why is not None:
                out.append(_row(run, rule, reference=reference, target_frac=target_frac,
                                note=reference if target_frac is None else f"the threshold cannot be scaled: {why}"))
                continue
            row = None
            bins = figures.bins.get((run.run_id, rule.name))
            if hist is not None and run.summaries_hold(rule) and n_summ and bins is None:
                out.append(_row(run, rule, reference=reference, target_frac=target_frac, n_tokens=n_summ,
                                target_blocked=round(target_frac * n_summ), source=SUMMARIES_SOURCE,
                                note="blocks no token at any threshold (the summaries score none: the inputs it "
                                     "needs, such as old_logprob, were not logged)"))
                continue
            if hist is not None and run.summaries_hold(rule) and bins is not None and n_summ:
                target = round(target_frac * n_summ)
                row = _from_summaries(run, rule, bins, n_summ, target)
                if row is not None and target and readable and _logged_in_full(run) and row["n_blocked"] is not None \
                        and abs(row["n_blocked"] - target) > EQUAL_WITHIN * target:
                    row = None  # every token is in the rows: the exact cut there instead of the bin edge
            said = (target_frac, reference)
            if row is None and not readable:
                out.append(_row(run, rule, reference=reference, target_frac=target_frac,
                                note=f"not cut: its summaries hold no threshold histogram at these parameters, and "
                                     f"its {logged:,} logged token rows are more than {max_rows:,} to read here "
                                     f"(LogDB.equal_budget reads them)"))
                continue
            if row is None:
                if cut is None:
                    if share is None and not _logged_in_full(run):  # the rows' own reference
                        rows_said = rows_reference(db, run)
                        rows_said = rows_said if rows_said[0] is not None else said
                    else:
                        rows_said = said
                    cut = db.query("equal_budget_cut", run_id=run.run_id, share=rows_said[0])
                row = _from_rows(run, rule, cut)
                target = int(cut["target"].iloc[0]) if len(cut) else None
                said = rows_said
            row.update(reference=said[1], target_frac=said[0], target_blocked=target)
            row["off"] = _off(row)
            out.append(row)
    return pd.DataFrame(out, columns=list(BUDGET_COLUMNS))


def threshold_curve(db: LogDB, run_id: str, rules: Sequence[str] | str | None = None) -> pd.DataFrame:
    """See :meth:`trustscope.query.analyses.NamedAnalyses.threshold_curve`."""
    import pandas as pd

    (run,) = _runs(db, run_id)
    chosen = [r for r in _rules(rules) if r.threshold is not None and r.threshold.scalable(run.rules[r.name]) is None]
    held = [r for r in chosen if run.summaries_hold(r)]
    figures = _Figures(db, [run], [run_id] if held else [])
    hist = figures.hist.get(run_id) if held else None
    counts = db.query("threshold_counts", run_id=run_id) if len(held) < len(chosen) else None
    n_summ = figures.n_tokens.get(run_id, 0) if hist is not None else 0
    n_rows = None
    out = []
    for rule in chosen:
        use_summ = hist is not None and rule in held and (hist["rule"] == rule.name).any()
        bins = (hist if use_summ else counts)
        bins = bins[bins["rule"] == rule.name].sort_values("bin_low") if bins is not None else bins
        if bins is None or not len(bins):
            continue
        if use_summ:
            n_tokens, source = n_summ, "summaries (every token)"
        else:
            if n_rows is None:
                n_rows = int(db.query("equal_budget_cut", run_id=run_id, share=0.5)["n_tokens"].iloc[0])
            n_tokens, source = n_rows, run.rows_source()
        above = bins["count"].to_numpy()[::-1].cumsum()[::-1]
        base = run.rules[rule.name]
        for low, n in zip(bins["bin_low"].to_numpy(), above, strict=True):
            if low <= 0:
                continue
            out.append({"run_id": run_id, "rule": rule.name, "param": rule.threshold.param,
                        "value": _value(rule, base, float(low)), "scale": float(low), "n_blocked": int(n),
                        "n_tokens": n_tokens, "blocked_frac": n / n_tokens if n_tokens else None,
                        "default": base[rule.threshold.param], "source": source})
    return pd.DataFrame(out, columns=["run_id", "rule", "param", "value", "scale", "n_blocked", "n_tokens",
                                      "blocked_frac", "default", "source"])


def cuts_of(budget: pd.DataFrame, db: LogDB, run_id: str) -> list[dict[str, Any]]:
    """The scales of ``budget``'s rows of ``run_id`` (an :func:`equal_budget` frame), as the picks queries bind
    them."""
    (run,) = _runs(db, run_id)
    out = []
    for row in budget[(budget["run_id"] == run_id) & budget["value"].notna()].itertuples():
        rule = get_loss(row.rule)
        out.append({"rule": row.rule, "u": rule.threshold.scale_of(float(row.value), run.rules[row.rule])})
    return out
