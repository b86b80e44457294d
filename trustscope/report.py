"""A run report: a readable terminal summary of every run of a log directory, and an HTML page of charts.

The per-step and per-run figures come from :meth:`trustscope.db.LogDB.overview`, the one source the dashboard's
Runs page reads too: exact from a run's summaries table (every token, whatever ``token_fraction`` kept), else from
its logged token rows, and the report says which for every run. The token-level sections (the tokens a rule blocks
most, the ratio against TV) read the logged rows and say so. The charts are :mod:`trustscope.figures`' builders, the same the dashboard draws. The run table and the grouping of seeds
defined here are shared with the dashboard; the collapse early warning is :mod:`trustscope.early_warning`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from trustscope import runformat
from trustscope.db import ANALYSIS_DEFAULTS, LogDB, Overview
from trustscope.early_warning import WarningLines, collapse_warnings, first_warnings, warning_outcome
from trustscope.query.connection import NoRunsFound as NoRunsFound
from trustscope.query.connection import connect_readable as connect_readable
from trustscope.report_tables import Column, fitted_table, fmt, left_out, short_names, sig
from trustscope.report_where import (
    by_dimension,
    by_routing,
    render_dimensions,
    routing_absent_sentence,
    routing_lines,
    routing_sides,
)
from trustscope.results import result_table as result_table
from trustscope.results import write_result as write_result

MISMATCH_WARN = 0.01
"""Mean |pi - mu| above which a run is flagged: the paper's DPPO runs stay near 0.003."""
BAD_NEGATIVE_WARN = 0.005
"""Bad negative-update rate above which a run is flagged (the paper finds < 0.5% of tokens drive collapse)."""
CLIPPED_TOP = 10
BUDGET_MAX_ROWS = 500_000
"""The report cuts a run's rules at an equal budget on its logged rows only up to this many (where its summaries
hold no threshold histogram): the cut reads every row, 49 s for 1M rows on a loaded 2-core machine."""
STALE_AFTER_S = 600.0
"""A ``running`` run whose manifest has not been touched for this long reads ``stale`` (its writer may be on
another host, where its process cannot be checked)."""
SEED_KEYS = ("seed", "run_id", "logdir", "resume")
"""Config fields that do not make a different configuration: runs differing only in these are seeds of one."""



# ------------------------------------------------------------------------------------------------ shared tables


def _manifest(text: object) -> dict[str, Any]:
    try:
        parsed = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _timestamp(value: object) -> pd.Timestamp | None:
    if not isinstance(value, str):
        return None
    stamp = pd.to_datetime(value, utc=True, errors="coerce")
    return None if pd.isna(stamp) else stamp


def _status(run_dir: Path, manifest: dict[str, Any], now: datetime) -> str:
    """``finished``, ``crashed``, ``stale`` or ``running``: the logger's reading of the writer, then staleness
    (:func:`run_table` says ``broken`` first for a run in :attr:`LogDB.broken_runs`)."""
    from trustscope.logger import run_status

    try:
        status = run_status(run_dir)
    except (runformat.SchemaError, OSError, ValueError):
        status = str(manifest.get("status") or "unknown")
    updated = _timestamp(manifest.get("updated_at"))
    if status == "running" and updated is not None and (now - updated).total_seconds() > STALE_AFTER_S:
        return "stale"
    return status


def _count(manifest: dict[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` the manifest holds as a number (at the top level or under ``tokens``)."""
    for key in keys:
        for where in (manifest, manifest.get("tokens") if isinstance(manifest.get("tokens"), dict) else {}):
            value = where.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
    return None


def seed_group(manifest: dict[str, Any], run_id: str) -> tuple[str, str]:
    """``(key, label)`` of the configuration a run belongs to: its config without :data:`SEED_KEYS`; the label is
    the run id without a trailing seed (``-s0``, ``-seed1``)."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else None
    label = re.sub(r"[-_](s|seed)\d+$", "", run_id)
    if config is None:
        return run_id, run_id
    key = json.dumps({k: v for k, v in config.items() if k not in SEED_KEYS}, sort_keys=True, default=str)
    return key, label


def run_table(db: LogDB) -> pd.DataFrame:
    """One row per run with a logged step: run_id, loss_rule, status, n_steps, first_step, last_step,
    tokens_generated, tokens_logged, logged_frac, mean_reward, updated_at (from the manifest, UTC), group (the
    seed group's label), group_key.

    ``tokens_generated``/``tokens_logged`` come from the manifest when the logger wrote them, else from the data:
    the response lengths of every sample, and the token rows on disk (counted only for runs whose manifest lacks
    them, so the table never reads the token rows of a run that says).
    """
    runs = db.runs()
    runs = runs[runs["n_steps"] > 0].reset_index(drop=True)
    uncounted = [r.run_id for r in runs.itertuples(index=False)
                 if _count(_manifest(r.manifest), "tokens_logged", "n_tokens_logged", "logged") is None]
    summary = db.step_summary(uncounted) if uncounted else pd.DataFrame(columns=["run_id", "n_tokens"])
    logged_rows = summary.groupby("run_id")["n_tokens"].sum() if len(summary) else pd.Series(dtype=float)
    dirs = {p.name: p for p in db.runs_dirs}
    token_rules: dict[str, str] | None = None
    now = datetime.now(UTC)
    rows = []
    for r in runs.itertuples(index=False):
        manifest = _manifest(r.manifest)
        config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        key, label = seed_group(manifest, r.run_id)
        generated = _count(manifest, "tokens_generated", "n_tokens_generated", "generated")
        logged = _count(manifest, "tokens_logged", "n_tokens_logged", "logged")
        generated = float(r.n_response_tokens) if generated is None else generated
        logged = float(logged_rows.get(r.run_id, 0)) if logged is None else logged
        run_dir = dirs.get(r.run_id, next((p for p in db.runs_dirs if p.name == r.run_id), Path(r.run_id)))
        rule = manifest.get("loss_rule") or config.get("loss")
        if rule is None:  # a third-party run whose manifest does not say: the rule its tokens were logged under
            if token_rules is None:
                found = db.query("token_loss_rules")
                token_rules = dict(zip(found["run_id"], found["loss_rule"], strict=True))
            rule = token_rules.get(r.run_id)
        rows.append({
            "run_id": r.run_id,
            "loss_rule": rule,
            "status": "broken" if r.run_id in db.broken_runs else _status(run_dir, manifest, now),
            "n_steps": int(r.n_steps), "first_step": int(r.first_step), "last_step": int(r.last_step),
            "tokens_generated": int(generated), "tokens_logged": int(logged),
            "logged_frac": logged / generated if generated else float("nan"),
            "mean_reward": r.mean_reward,
            "updated_at": _timestamp(manifest.get("updated_at")),
            "group": label, "group_key": key,
        })
    out = pd.DataFrame(rows, columns=["run_id", "loss_rule", "status", "n_steps", "first_step", "last_step",
                                      "tokens_generated", "tokens_logged", "logged_frac", "mean_reward",
                                      "updated_at", "group", "group_key"])
    # two configurations that read the same after dropping the seed keep apart by their first run
    clash = out.groupby("group")["group_key"].transform("nunique") > 1
    out.loc[clash, "group"] = out.loc[clash, "run_id"]
    return out



# ------------------------------------------------------------------------------------------------ opening logs


# ------------------------------------------------------------------------------------------------ the report


@dataclass
class RunReport:
    """What the report says about one run (numbers for tests, text for people)."""

    run_id: str
    status: str | None
    loss_rule: str | None
    group: str
    n_steps: int
    n_tokens: int
    """the tokens the figures are over: every token the trainer handed in where ``exact``, else the logged rows"""
    n_grad_tokens: int
    """tokens with A != 0: the denominator of every blocked fraction"""
    tokens_generated: int
    exact: bool
    """whether the figures come from the run's summaries table (every token) or from its logged token rows"""
    source: str
    """how the figures were obtained, in words (:func:`trustscope.db.source_sentence`)"""
    token_fraction: float | None
    """the share of token rows the logger kept (run.json), None when it does not say"""
    reward_first: float | None
    reward_last: float | None
    reward_max: float | None
    mismatch_first: float | None
    mismatch_last: float | None
    mismatch_max: float | None
    bad_negative_rate_mean: float | None
    trainer_blocked_frac: float | None
    blocked_by_rule: dict[str, tuple[float, int]] = field(default_factory=dict)
    """rule -> (blocked fraction, tokens blocked), rules that block nothing left out."""
    clipped: pd.DataFrame | None = None
    warnings: list[str] = field(default_factory=list)
    collapse_warning: str | None = None
    """when and why the collapse early warning first fired (:func:`trustscope.early_warning.first_warnings`)"""
    warning_holds: bool = False
    """whether that warning holds over the steps logged (:func:`trustscope.early_warning.warning_outcome`): the
    reward collapsed after it, or it is still on at the last step; only then is the run marked ``!``"""
    warning_outcome: str | None = None
    """the sentence saying whether the warning held, with the figures"""
    equal_budget: pd.DataFrame | None = None
    """the run's rows of :meth:`LogDB.equal_budget` (set by :func:`print_report`), or None"""
    chosen_rules: list[str] = field(default_factory=list)
    """rules evaluated at parameters the user chose (``--rule``): their blocks counted from the logged rows"""


def _first_last(series: pd.Series) -> tuple[float | None, float | None]:
    values = series.dropna()
    if values.empty:
        return None, None
    return float(values.iloc[0]), float(values.iloc[-1])


def build(db: LogDB, lines: WarningLines | None = None, overview: Overview | None = None) -> list[RunReport]:
    """One :class:`RunReport` per run with a logged step, from :meth:`LogDB.overview` (``overview`` when the
    caller holds it already)."""
    overview = overview or db.overview()
    summary = overview.steps
    sources = overview.sources.set_index("run_id")
    table = run_table(db).set_index("run_id")
    clipped = db.clipped_tokens(top=CLIPPED_TOP)
    run_ids = sorted(summary["run_id"].unique())
    warned = collapse_warnings(overview, run_ids, lines, signals=db.query("early_signals", run_ids=run_ids))
    alerts = first_warnings(warned)
    from trustscope.explain.warning import name_causes, warning_causes  # each warning names its driving cause

    alerts = name_causes(alerts, warning_causes(db, warned, (lines or WarningLines()).window))
    totals = overview.blocked_totals()
    reports = []
    for run_id, steps in summary.groupby("run_id", sort=True):
        steps = steps.sort_values("step")
        info = table.loc[run_id] if run_id in table.index else None
        rule = None if info is None else info["loss_rule"]
        blocked = {t.rule: (float(t.blocked_frac), int(t.n_blocked)) for t in totals[totals.run_id == run_id]
                   .itertuples() if t.n_blocked > 0}
        n_grad = max(int(steps.n_nonzero_advantage.sum()), 1)  # blocked fractions are over the tokens with A != 0
        trainer = steps.n_trainer_blocked.dropna()
        r_first, r_last = _first_last(steps.reward_mean)
        m_first, m_last = _first_last(steps.mismatch_mean)
        report = RunReport(
            run_id=str(run_id),
            status=None if info is None else info["status"],
            loss_rule=rule,
            group=str(run_id) if info is None else info["group"],
            n_steps=len(steps),
            n_tokens=int(steps.n_tokens.sum()),
            n_grad_tokens=int(steps.n_nonzero_advantage.sum()),
            tokens_generated=0 if info is None else int(info["tokens_generated"]),
            exact=bool(sources.loc[run_id, "exact"]),
            source=str(sources.loc[run_id, "source"]),
            token_fraction=None if pd.isna(sources.loc[run_id, "token_fraction"])
            else float(sources.loc[run_id, "token_fraction"]),
            reward_first=r_first,
            reward_last=r_last,
            reward_max=float(steps.reward_mean.max()) if steps.reward_mean.notna().any() else None,
            mismatch_first=m_first,
            mismatch_last=m_last,
            mismatch_max=float(steps.mismatch_max.max()),
            bad_negative_rate_mean=float(steps.n_bad_negative.sum() / max(int(steps.n_tokens.sum()), 1)),
            trainer_blocked_frac=float(trainer.sum() / n_grad) if len(trainer) else None,
            blocked_by_rule=dict(sorted(blocked.items(), key=lambda kv: -kv[1][0])),
            clipped=clipped[(clipped.run_id == run_id) & (clipped.rule == (rule or "ppo_clip"))],
            collapse_warning=alerts.get(str(run_id)),
        )
        outcome = warning_outcome(warned, str(run_id)) if report.collapse_warning else None
        if outcome is not None:
            report.warning_holds, report.warning_outcome = outcome
        if m_last is not None and m_last > MISMATCH_WARN:
            report.warnings.append(
                f"mean |pi - mu| ends at {m_last:.4f} (> {MISMATCH_WARN}): the policy is drifting from the rollouts"
            )
        if report.bad_negative_rate_mean > BAD_NEGATIVE_WARN:
            report.warnings.append(
                f"bad negative updates on {report.bad_negative_rate_mean:.2%} of tokens (> {BAD_NEGATIVE_WARN:.1%})"
            )
        if r_last is not None and report.reward_max is not None and report.reward_max - r_last > 0.3:
            report.warnings.append(f"reward fell from a peak of {report.reward_max:.3f} to {r_last:.3f}")
        if report.collapse_warning and report.warning_holds:
            report.warnings.append(f"{report.collapse_warning}: {report.warning_outcome}")
        reports.append(report)
    return reports


def _short_source(r: RunReport) -> str:
    """``exact``, or ``rows`` with the share of tokens logged (``rows 25%``)."""
    if r.exact:
        return "exact"
    return "rows" if r.token_fraction is None else f"rows {r.token_fraction:.0%}"


def render(reports: list[RunReport], broken: dict[str, list[str]] | None = None, width: int | None = None) -> Group:
    """The terminal summary as rich renderables, fitted to ``width`` columns (None: every column): run ids lose
    the prefix they share; a table too wide leaves out columns in a stated order (named under it), never cutting a
    name or a figure."""
    parts: list = []
    prefix, short = short_names([r.run_id for r in reports])
    statuses = {r.status for r in reports}
    lengths = {r.n_steps for r in reports}
    title = "Runs" + (f" (ids without the shared prefix {prefix!r})" if prefix else "")
    if len(statuses) == 1:
        title += f", all {next(iter(statuses))}"
    if len(lengths) == 1:
        title += f", {next(iter(lengths))} steps each"
    named = all(r.loss_rule and r.loss_rule in r.run_id for r in reports)  # the rule already in every run id
    sources = {r.source for r in reports}
    columns = [Column("run", [Text(short[r.run_id] + (" !" if r.warning_holds else ""),
                                   style="yellow" if r.warning_holds else "") for r in reports], "left")]
    if not named:
        columns.append(Column("rule", [r.loss_rule or "-" for r in reports], "left", drop=6))
    if len(statuses) > 1:
        columns.append(Column("status", [r.status or "-" for r in reports], "left", drop=7))
    if len(sources) > 1:
        columns.append(Column("from", [_short_source(r) for r in reports], "left", drop=3))
    if len(lengths) > 1:
        columns.append(Column("steps", [str(r.n_steps) for r in reports], drop=2))
    columns += [
        Column("tokens", [f"{r.n_tokens:,}" for r in reports], drop=1),
        Column("reward", ["-" if r.reward_first is None and r.reward_last is None
                          else f"{fmt(r.reward_first, '.2f')}->{fmt(r.reward_last, '.2f')}" for r in reports]),
        Column("|pi-mu|", [sig(r.mismatch_last) for r in reports]),
        Column("bad neg", [sig(None if r.bad_negative_rate_mean is None else 100 * r.bad_negative_rate_mean, 2)
                           + ("%" if r.bad_negative_rate_mean is not None else "") for r in reports], drop=5),
        Column("blocked", [sig(None if r.trainer_blocked_frac is None else 100 * r.trainer_blocked_frac, 2)
                           + ("%" if r.trainer_blocked_frac is not None else "") for r in reports], drop=4),
    ]
    delta = ANALYSIS_DEFAULTS["bad_negative_delta"]
    where = (f"figures {next(iter(sources))}" if len(sources) == 1 else
             "from: exact (summaries table, every token) or rows (the logged token rows, % kept)")
    overview, dropped = fitted_table(columns, width, title=title, title_justify="left", caption_justify="left")
    overview.caption = (f"{where}; tokens: those the figures are over; reward: first -> last step; |pi-mu|: last "
                        f"step; bad neg: A < 0 and mu - pi >= {delta:g}, of all tokens; blocked: by the run's own "
                        "rule, of the A != 0 tokens; ! marks a collapse warning that holds (the reason below)"
                        + left_out(dropped))
    parts.append(overview)
    for r in reports:
        parts.append(Text(f"{r.run_id}: what each rule would block of its {r.n_grad_tokens:,} tokens with A != 0 "
                          f"({r.source})", style="italic"))
        chosen = [c for c in r.chosen_rules if c != r.loss_rule]
        caption = "rules that block nothing left out" if r.blocked_by_rule else "no rule blocks any token of this run"
        if chosen and r.exact:
            caption += (f"; {', '.join(chosen)} at the parameters given (--rule), which the summaries do not hold: "
                        "counted from the logged rows" + (f" ({r.token_fraction:.0%} of the tokens)" if r.token_fraction else "")
                        + ", tokens blocked of those rows")
        rules = Table(caption=caption)
        rules.add_column("rule", no_wrap=True)
        rules.add_column("blocked", justify="right")
        rules.add_column("tokens blocked", justify="right")
        for rule, (frac, n) in r.blocked_by_rule.items():
            own = rule == r.loss_rule
            rules.add_row(Text(rule + (" (applied)" if own else ""), style="bold" if own else ""), fmt(frac, ".2%"),
                          f"{n:,}")
        parts.append(rules)
        if r.equal_budget is not None and len(r.equal_budget):
            parts += equal_budget_parts(r, width)
        if r.clipped is not None and not r.clipped.empty:
            cl = r.clipped
            tokens, dropped = fitted_table([
                Column("token", [repr(t) for t in cl.token_text], "left"),
                Column("blocked", [f"{n:,}" for n in cl.n_blocked]),
                Column("of", [f"{n:,}" for n in cl.n_occurrences], drop=3),
                Column("rate", [fmt(x, ".1%") for x in cl.block_rate]),
                Column("mean mu", [sig(x) for x in cl.mu_prob_mean], drop=2),
                Column("entropy", [fmt(x, ".2f") for x in cl.entropy_mean], drop=1),
            ], width, title=f"{r.run_id}: tokens {cl.rule.iloc[0]} blocks most (logged rows)", title_justify="left",
               caption_justify="left")
            if dropped:
                tokens.caption = left_out(dropped)[2:]
            parts.append(tokens)
        for warning in r.warnings:
            parts.append(Text(f"! {r.run_id}: {warning}", style="yellow"))
        if r.collapse_warning and not r.warning_holds:
            parts.append(Text(f"{r.run_id}: {r.collapse_warning}, {r.warning_outcome} (not marked !)", style="dim"))
    for run_id, problems in (broken or {}).items():
        parts.append(Text(f"! {run_id}: left out, unreadable: {problems[0]}"
                          + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), style="red"))
    if not reports:
        parts.append(Text("no tokens logged yet", style="yellow"))
    return Group(*parts)


# ------------------------------------------------------------------------------------------------ by dimension

def _off_cell(row: Any) -> Text:
    """How far a rule's count at the equal budget is from the target: ``+0.4%``; ``ties`` where tied scores (or a
    sequence rule's whole responses) keep an exact cut from coming nearer; yellow beyond :data:`EQUAL_WITHIN`."""
    from trustscope.query.budget import EQUAL_WITHIN

    off = row.off
    if off is None or off != off:
        return Text("-")
    text = "0" if off == 0 else f"{off:+.1%}" if abs(off) >= 0.001 else f"{off:+.2%}"
    ties = str(row.note or "").startswith("nearest count")
    return Text(text + (" ties" if ties else ""), style="" if abs(off) <= EQUAL_WITHIN or ties else "yellow")


def equal_budget_parts(r: RunReport, width: int | None = None) -> list:
    """The run's equal-budget section: each rule with a scalar threshold moved to block the reference's share
    (:meth:`LogDB.equal_budget`), how far its count lands from the target, beside what it blocks at the
    parameters evaluated (a rule over half of the tokens at those marked out of calibration); fitted to
    ``width`` (:func:`fitted_table`: the bracket first, then the source, the parameter's name and the share at
    the default are left out)."""
    from trustscope.query.budget import EQUAL_WITHIN, OUT_OF_CALIBRATION

    eb = r.equal_budget
    solved = eb[eb["param"].notna()]
    if not len(solved):
        return []
    if solved["value"].isna().all():  # nothing cut: one line says why
        note = solved["note"].dropna()
        return [Text(f"{r.run_id}: rules at an equal budget not computed"
                     + (f": {note.iloc[0]}" if len(note) else ""), style="dim")]
    reference = solved["reference"].iloc[0]
    target = solved["target_frac"].iloc[0]
    goal = solved["target_blocked"].dropna()
    head = (f"{r.run_id}: rules at an equal budget, each threshold moved to block "
            + (f"{target:.2%} of the tokens with A != 0" + (f" ({int(goal.iloc[0]):,})" if len(goal) and
                                                             goal.nunique() == 1 else "")
               + f", as {reference}" if target == target and target is not None
               else f"the reference's share ({reference})"))
    cut = solved[solved["value"].notna()]
    sources = {"summ" if str(x).startswith("summaries") else "rows" for x in cut["source"]}
    counts = cut["n_tokens"].dropna()
    of = f" of {int(counts.iloc[0]):,}" if len(counts) and counts.nunique() == 1 else ""
    rows = list(cut.itertuples())
    shares = [r.blocked_by_rule.get(row.rule, (0.0, 0))[0] for row in rows]
    columns = [
        Column("rule", [Text(row.rule + (" (applied)" if row.rule == r.loss_rule else ""),
                             style="bold" if row.rule == r.loss_rule else "") for row in rows], "left"),
        Column("param", [str(row.param) for row in rows], "left", drop=3),
        Column("threshold", [f"{sig(row.default)} -> {sig(row.value, 4)}" for row in rows], "left"),
        Column("bracket", [f"[{sig(row.value_low)}, {sig(row.value_high)}]" if row.value_low != row.value_high
                           else "" for row in rows], "left", drop=1),
        Column("default", [fmt(f, ".2%") + (" *" if f > OUT_OF_CALIBRATION else "") for f in shares], drop=4),
        Column("blocks", [f"{int(row.n_blocked):,}" for row in rows]),
        Column("off", [_off_cell(row) for row in rows]),
    ]
    if len(sources) > 1:
        columns.append(Column("from", ["summ" if str(row.source).startswith("summaries") else "rows"
                                       for row in rows], "left", drop=2))
    table, dropped = fitted_table(columns, width, caption_justify="left")
    wide = [row.rule for row in rows if row.off is not None and row.off == row.off and abs(row.off) > EQUAL_WITHIN
            and not str(row.note or "").startswith("nearest count")]
    table.caption = escape(
        "threshold: at the parameters evaluated here -> at the equal budget; bracket: the [low, high] the "
        "summaries' bins allow (exact at their edges); default: the share of the tokens with A != 0 the rule "
        "blocks at the parameters evaluated (* over half: out of calibration for this run); blocks: the tokens"
        f"{of} it blocks at the equal budget; off: that count's distance from the target, as a share of it "
        f"(ties: tied scores or whole responses keep an exact cut from coming nearer)"
        + (f"; beyond {EQUAL_WITHIN:.0%}: {', '.join(wide)} (the summaries' bins are all that bracket them: the "
           "run's rows are a sample, or too many to read here)" if wide else "")
        + ("; from: rows = the logged rows (exact cut), summ = the summaries (every token, to a bin edge)"
           if len(sources) > 1 else
           f"; from the {'summaries (every token, to a bin edge)' if sources == {'summ'} else cut['source'].iloc[0]}")
        + left_out(dropped))
    parts: list = [Text(head, style="italic"), table]
    uncut = solved[solved["value"].isna()]
    for row in uncut.itertuples():
        parts.append(Text(f"  {row.rule}: {row.note}", style="dim"))
    unsolved = eb[eb["param"].isna()]
    if len(unsolved):
        parts.append(Text(f"not compared at an equal budget: {', '.join(unsolved['rule'])} (no scalar threshold)",
                          style="dim"))
    return parts


@dataclass
class ReportData:
    """Everything the terminal report shows, computed once (:func:`gather`) and kept under the log directory's
    version (:func:`kept_gather`): the runs' reports (each with its rules at an equal budget), where the mismatch
    lives by summary dimension, and by routing."""

    reports: list[RunReport]
    dim_mismatch: pd.DataFrame
    dim_blocked: pd.DataFrame
    routing: tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None
    """:func:`by_routing`'s frames, None where no run is a mixture-of-experts run (run.json's routing_shape)"""
    sides: dict[str, tuple[int, int]]


def gather(db: LogDB, lines: WarningLines | None = None, budget: float | None = None) -> ReportData:
    """The report's figures: :func:`build`, each run's rules at an equal budget (the run's own rule's share, or
    ``budget``), :func:`by_dimension` and :func:`by_routing` (read only where some run is a mixture-of-experts
    run), over one :meth:`LogDB.overview`."""
    from trustscope.query.budget import equal_budget

    overview = db.overview()
    reports = build(db, lines, overview)
    run_ids = [r.run_id for r in reports]
    if reports:
        eb = equal_budget(db, run_ids, budget, max_rows=BUDGET_MAX_ROWS, overview=overview)
        chosen = db.chosen_rules()
        for r in reports:
            r.chosen_rules = chosen
            r.equal_budget = eb[eb["run_id"] == r.run_id].reset_index(drop=True)
    mismatch, blocked = by_dimension(db, run_ids) if run_ids else (pd.DataFrame(), pd.DataFrame())
    manifests = db.runs().set_index("run_id")["manifest"]
    routed = [r for r in run_ids if r in manifests.index and "routing_shape" in _manifest(manifests[r])]
    sides = routing_sides(db, routed) if routed else {}  # the token rows are read for mixture-of-experts runs only
    routing = by_routing(db, run_ids) if sides else None
    return ReportData(reports, mismatch, blocked, routing, sides)


KEPT_VERSION = 1
"""Bumped when :class:`ReportData` changes shape: a kept report of another shape is computed again."""


def _kept_key(db: LogDB, lines: WarningLines | None, budget: float | None) -> str:
    """What a kept report stands for: the log directory's files (:meth:`LogDB.version`), the report's options and
    the code that computed it (this module, the early warning and the equal-budget solve, by content)."""
    import hashlib

    from trustscope import early_warning
    from trustscope.query import budget as budget_module

    h = hashlib.blake2b(digest_size=16)
    h.update(f"{KEPT_VERSION}\0{db.version()}\0{[str(p) for p in db.paths]}\0{lines!r}\0{budget!r}\0"
             f"{json.dumps(db.rule_params, sort_keys=True, default=str)}".encode())
    for module in (__file__, early_warning.__file__, budget_module.__file__):
        h.update(Path(module).read_bytes())
    for name in ("warning.py", "analysis.py", "allocate.py"):  # the warning's cause (trustscope.explain.warning)
        h.update((Path(__file__).parent / "explain" / name).read_bytes())
    return h.hexdigest()


def kept_gather(db: LogDB, lines: WarningLines | None = None, budget: float | None = None) -> ReportData:
    """:func:`gather`, kept beside the query layer's kept aggregates (``report/`` under the connection's cache
    folder) under :func:`_kept_key`: a second report over unchanged logs reads it back instead of computing it
    again; a run that grows, a new run, other options or other code compute it anew. A connection without a cache
    (``cache=False``) computes every time; a kept file that cannot be read or written is only slower."""
    import pickle

    folder = getattr(db, "cache_dir", None)
    if folder is None:
        return gather(db, lines, budget)
    path = Path(folder) / "report" / f"{_kept_key(db, lines, budget)}.pickle"
    try:
        with path.open("rb") as f:
            data = pickle.load(f)
        if isinstance(data, ReportData):
            return data
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        pass
    data = gather(db, lines, budget)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob("*.pickle"):  # one kept report a directory's options at a time is plenty
            if old.stat().st_mtime < datetime.now(UTC).timestamp() - 7 * 86400:
                old.unlink(missing_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        with scratch.open("wb") as f:
            pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
        scratch.replace(path)
    except OSError:
        pass
    return data


Section = Callable[[LogDB, ReportData], "RenderableType | None"]
"""A section of the terminal report after the built-in ones: given the connection and the report's figures, a
rich renderable (or None to print nothing)."""

SECTIONS: list[Section] = []
"""Extra sections, printed in order after where the mismatch lives (:func:`add_section` appends one)."""


def add_section(section: Section) -> Section:
    """Register ``section`` (:data:`Section`) to print after the report's built-in sections; usable as a
    decorator. A section registered twice prints once."""
    if section not in SECTIONS:
        SECTIONS.append(section)
    return section


def print_report(db: LogDB, console: Console | None = None, broken: dict[str, list[str]] | None = None,
                 lines: WarningLines | None = None, budget: float | None = None) -> list[RunReport]:
    """Print the terminal summary, with each run's rules at an equal budget (the run's own rule's share, or
    ``budget``), where the mismatch lives (runs with summary dimensions, mixture-of-experts runs by routing), then
    :data:`SECTIONS`; return the reports. The figures are :func:`kept_gather`'s."""
    data = kept_gather(db, lines, budget)
    console = console or Console()
    console.print(render(data.reports, broken, width=console.width))
    if data.reports:
        console.print(_dimension_part(data, console.width))
        console.print(_routing_part(data))
        for section in SECTIONS:
            part = section(db, data)
            if part is not None:
                console.print(part)
    return data.reports


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it: numpy numbers as Python's, NaN and NaT as None, frames as lists of records."""
    if isinstance(value, pd.DataFrame):
        return [_plain(r) for r in value.to_dict(orient="records")]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, pd.Timestamp | datetime):
        return None if pd.isna(value) else value.isoformat()
    if hasattr(value, "item") and not isinstance(value, str):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def report_json(data: ReportData, broken: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The report's figures for scripts (``trustscope report --format json``): ``runs``, one object per run with
    every :class:`RunReport` field (``blocked_by_rule``: rule -> ``{"frac", "n"}``; ``equal_budget``: the run's
    :meth:`LogDB.equal_budget` rows; ``clipped``: the tokens its rule blocks most), ``by_dimension`` and
    ``blocked_by_dimension`` (:func:`by_dimension`'s rows), ``by_routing`` (:func:`by_routing`'s, or null), and
    ``broken``: the runs left out and why. NaN reads null."""
    runs = []
    for r in data.reports:
        one = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
        one["blocked_by_rule"] = {rule: {"frac": frac, "n": n} for rule, (frac, n) in r.blocked_by_rule.items()}
        for name in ("equal_budget", "clipped"):
            one[name] = [] if one[name] is None else one[name]
        runs.append(one)
    routing = None if data.routing is None else dict(zip(("mismatch", "blocked", "agreement"), data.routing,
                                                         strict=True))
    return _plain({"runs": runs, "by_dimension": data.dim_mismatch, "blocked_by_dimension": data.dim_blocked,
                   "by_routing": routing, "broken": broken or {}})


def print_json(db: LogDB, broken: dict[str, list[str]] | None = None, lines: WarningLines | None = None,
               budget: float | None = None, file: Any = None) -> dict[str, Any]:
    """Write :func:`report_json` of :func:`kept_gather`'s figures to ``file`` (default stdout) and return it."""
    import sys

    out = report_json(kept_gather(db, lines, budget), broken)
    json.dump(out, file or sys.stdout, indent=1, default=str)
    (file or sys.stdout).write("\n")
    return out


def _dimension_part(data: ReportData, width: int | None = None) -> Group:
    reports = data.reports
    if data.dim_mismatch.empty:
        return Group(Text("Where the mismatch lives: no run has summary dimensions (position, turn, staleness); "
                          "they are logged since summaries table version 2.", style="italic"))
    return render_dimensions(data.dim_mismatch, data.dim_blocked, [r.run_id for r in reports],
                             {r.run_id: r.loss_rule for r in reports}, width)


def _routing_part(data: ReportData) -> Group:
    run_ids = [r.run_id for r in data.reports]
    sides = data.sides
    mismatch, blocked, exact = data.routing if data.routing is not None else (pd.DataFrame(), None, None)
    if mismatch.empty:
        one_side = routing_absent_sentence([r for r in run_ids if r in sides], sides) if sides else ""
        return Group(Text("Where the mismatch lives, by routing: no run logs routed experts on both sides (a "
                          "mixture-of-experts run's engine_experts and trainer_experts)." + (" " + one_side if
                          one_side else ""), style="italic"))
    lines = routing_lines(mismatch, blocked, run_ids, {r.run_id: r.loss_rule for r in data.reports}, exact, sides)
    return Group(Text("Where the mismatch lives: by routing agreement", style="bold"),
                 *(Text(line) for line in lines))


def source_caption(sources: pd.DataFrame) -> str:
    """One sentence on where the overview figures of these runs come from (``Overview.sources``)."""
    said = sources.groupby("source")["run_id"].apply(list)
    if len(said) == 1:
        return f"Figures {said.index[0]}."
    return "Figures " + "; ".join(f"{text} for {', '.join(runs)}" for text, runs in said.items()) + "."


# ----------------------------------------------------------------------------- the frameworks' own figures

from trustscope.report_frameworks import frameworks_section  # noqa: E402  (a section of its own module)

add_section(frameworks_section)
