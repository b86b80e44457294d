"""Runs: reward, accuracy, mismatch, entropy and blocked fraction by rule over steps, several runs side by side.

The figures are :func:`app.data.overview`'s (exact from a run's summaries table, else from its logged token rows),
the report's source too; each section says which.
"""

import pandas as pd
import streamlit as st

from app import data, widgets
from app.sections import doctor
from trustscope import figures, report

st.title("Runs")
runs = widgets.require_runs()
table = runs.drop(columns=["group_key"]).assign(
    updated_at=runs["updated_at"].map(lambda t: "-" if t is None or pd.isna(t) else f"{t:%Y-%m-%d %H:%M} UTC"),
    logged_frac=100 * runs["logged_frac"])  # shown with its two decimals on every row
st.dataframe(table, hide_index=True, key="runs_table", column_config={
    "tokens_generated": st.column_config.NumberColumn("tokens generated", format="localized"),
    "tokens_logged": st.column_config.NumberColumn("tokens logged", format="localized"),
    "logged_frac": st.column_config.NumberColumn("logged", format="%.2f%%"),
    "updated_at": st.column_config.TextColumn("updated (manifest)"),
    "mean_reward": st.column_config.NumberColumn("mean reward", format="%.3f"),
})
st.caption("Status reads the writer: a run whose process is gone reads crashed, one whose manifest has not "
           f"changed for {report.STALE_AFTER_S / 60:.0f} minutes reads stale, one with a file that cannot "
           "be read reads broken (a red line at the top of every page then names the file). Tokens logged are the "
           "token rows on disk (a run may log a fraction of what it generated).")


def compare(chosen: list[str], grouped: bool) -> None:
    """Metrics and blocked fractions over steps of the chosen configurations (or runs)."""
    column = "group" if grouped else "run_id"
    members = runs[runs[column].isin(chosen)]
    labels = dict(zip(members["run_id"], members[column], strict=True))
    widgets.warning_badge(members["run_id"].tolist())

    left, right = st.columns([3, 1])
    with left:
        metrics = st.multiselect("Metrics", data.METRIC_TITLES, default=list(data.METRIC_TITLES),
                                 format_func=data.METRIC_TITLES.get, key="metrics_picker")
    with right:
        weight = st.select_slider("Smoothing (EMA weight)", options=[0.0, 0.5, 0.8, 0.9, 0.95], value=0.0,
                                  key="smoothing")
    rules_of = members.drop_duplicates(column).set_index(column)["loss_rule"]
    colours = ({g: figures.rule_colour(r) for g, r in rules_of.items()}
               if rules_of.notna().all() and rules_of.is_unique else None)
    sources = data.sources(members["run_id"].tolist())
    where = report.source_caption(sources)
    long = figures.smooth(data.step_metrics(members["run_id"].tolist()), weight, ["run_id", "name"])
    series = figures.seed_band(long, labels)
    series = series.set_index("run_id").loc[[c for c in chosen if c in set(series["run_id"])]].reset_index()
    logged = [m for m in metrics if m in set(series["name"])]
    if logged:
        widgets.chart(data.figure(figures.metrics_over_steps, series, logged, data.METRIC_TITLES, colours=colours),
                      "metrics_chart", "None of these runs has logged a step with these metrics yet.")
    missing = [data.METRIC_TITLES[m] for m in metrics if m not in logged]
    if missing:
        st.caption("Not logged by these runs: " + ", ".join(missing)
                   + " (the accuracy comes from held-out evaluation, every `--eval-every` steps).")
    if grouped:
        sizes = members.groupby(column)["run_id"].size()
        st.caption("Lines are the mean over each configuration's seeds, the band their min..max; "
                   + ", ".join(f"{g}: {n} seed{'s' * (n > 1)}" for g, n in sizes.items()) + ".")
    st.caption(where)

    rule_of = members.set_index("run_id")["loss_rule"]
    signals_section(members["run_id"].tolist(), weight,
                    {r: figures.rule_colour(rule) for r, rule in rule_of.items()}  # as the metrics chart colours
                    if rule_of.notna().all() and rule_of.is_unique else None)

    st.subheader("Blocked fraction by rule")
    blocked = data.blocked_by_rule(members["run_id"].tolist(), labels)
    applied = rules_of.to_dict()
    rules = widgets.pick_rules(blocked["rule"].unique().tolist(), key="runs_rules")
    blocked = blocked[blocked["rule"].isin(rules)]
    totals = data.blocked_totals(members["run_id"].tolist(), labels)
    smoothed = figures.smooth(blocked, weight, ["run_id", "rule"], column="blocked_frac")
    widgets.chart(data.figure(figures.blocked_fraction_by_rule, smoothed, applied=applied), "blocked_chart",
                  "No rule would block any token of these runs (the policy never moved far from the rollouts). "
                  "Train with more mismatch (`--engine-dtype bfloat16`, `--mini-batches 4`) to see the rules bind.")
    added = ", the seeds of a configuration added up" if grouped else ""
    st.caption(f"Share of the tokens that carry gradient (A != 0) each rule would block, every rule on the same "
               f"tokens{added}; the thick line is the rule the trainer applied (only that one shaped the update). "
               f"Hover a line for the token counts. {where}")
    totals = totals[totals["rule"].isin(rules)]
    if not totals.empty:
        cells = totals.assign(cell=[widgets.count_of(n, t) for n, t in zip(totals["n_blocked"], totals["n_tokens"],
                                                                          strict=True)])
        table = cells.pivot(index="run_id", columns="rule", values="cell")
        table = table[figures.rule_order(table.columns)].reindex([c for c in chosen if c in table.index])
        st.dataframe(table.rename_axis(column).reset_index(), hide_index=True, key="blocked_totals")
        st.caption("Blocked over every step: the share of the tokens with A != 0, with the counts (blocked of "
                   "tokens with A != 0).")


def signals_section(run_ids: list[str], weight: float, colours: dict[str, str] | None = None) -> None:
    """The early-warning signals over steps, one line per run (seeds are not grouped here), coloured by
    ``colours`` (run_id -> colour) when given."""
    st.subheader("Early-warning signals")
    long = data.early_signals(run_ids)
    shown = [n for n in data.SIGNAL_TITLES if n in set(long["name"])]
    if not shown:
        st.caption("These runs log no early-warning signals (runs without a summaries table, or logged before the "
                   "importance-weight rows).")
        return
    picked = st.multiselect("Signals", shown, default=shown[:4], format_func=data.SIGNAL_TITLES.get,
                            key="signals_picker")
    series = figures.smooth(long[long["name"].isin(picked)], weight, ["run_id", "name"])
    widgets.chart(data.figure(figures.metrics_over_steps, series, picked, data.SIGNAL_TITLES, colours=colours),
                  "signals_chart", "None of these runs has logged these signals yet.")
    st.caption("Exact over every token of each step (the `early_signals` view, `trustscope sql \"select * from "
               "early_signals\"`): the effective sample size of the importance weights pi/mu, the tail of the "
               "responses' mean log-ratio, |pi - mu|, the entropy's slope, the grad norm. Which of them warn "
               "before a collapse, and how early: docs/experiments.md.")


chosen, grouped = widgets.pick_groups(runs)
if chosen:
    compare(chosen, grouped)
    doctor.doctor_section(runs.loc[runs["group" if grouped else "run_id"].isin(chosen), "run_id"].tolist())
else:
    st.info("Pick at least one configuration or run above.")
