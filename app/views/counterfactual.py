"""Counterfactual: what another rule would have done differently on this run, token by token.

It opens at an equal budget: every rule with a scalar threshold moved to block the share of the tokens that the
run's own rule blocks (or a share picked here), so two rules are compared on which tokens they pick, not on how
well their defaults fit this run; the rules at their parameters (the defaults, or the panel's) are one click away.
"""

import pandas as pd
import streamlit as st

from app import data, pages, widgets
from trustscope import figures
from trustscope.losses import list_losses
from trustscope.query.budget import EQUAL_WITHIN, OUT_OF_CALIBRATION

POSITION_BINS = [0, 1, 4, 16, 64, 256, 1 << 30]
POSITION_LABELS = ["0", "1-3", "4-15", "16-63", "64-255", "256+"]

EQUAL, AS_SET = "At an equal budget", "At their parameters (defaults)"
DIMENSIONS = {"mu_bucket": "mu bucket", "advantage_sign": "advantage sign", "entropy_bucket": "entropy bucket",
              "position": "position in the response", "turn": "turn", "staleness": "staleness (versions behind)"}

st.title("Counterfactual")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
applied = data.run_rule(run)
mode = st.segmented_control("Compare the rules", [EQUAL, AS_SET], default=EQUAL, key="cf_mode") or EQUAL
widgets.rule_panel(figures.rule_order(list_losses()), applied, "cf_panel")


def off_text(off: float | None, target: float | None, note: str | None) -> str:
    """How far a rule's count at the budget is from the target (signed share of it, and the target's count)."""
    if off is None or pd.isna(off) or target is None or pd.isna(target):
        return "-"
    text = "0" if off == 0 else f"{off:+.1%}" if abs(off) >= 0.001 else f"{off:+.2%}"
    ties = " (ties)" if str(note or "").startswith("nearest count") else ""
    return f"{text} of {int(target):,}{ties}"


def equal_budget_page() -> None:
    """The rules at an equal budget: thresholds, curves, which tokens each picks, two rules' overlap."""
    own, given = "the run's rule's share", "a share I give"
    left, right = st.columns([2, 1])
    with left:
        how = st.radio("Budget", [own, given], horizontal=True, key="cf_budget_how",
                       help="The share of the tokens with A != 0 every rule is moved to block.")
    budget = None
    if how == given:
        with right:
            budget = st.number_input("Share (%)", min_value=0.01, max_value=99.99, value=5.0, step=0.5,
                                     key="cf_budget") / 100
    eb = data.equal_budget(run, budget)
    solved = eb[eb["value"].notna()]
    if solved.empty:
        note = eb["note"].dropna()
        st.info("No rule could be moved to an equal budget on this run: "
                + (note.iloc[0] if len(note) else "no rule with a scalar threshold") + ". Pick a share above.",
                icon=":material/info:")
        return
    target = float(solved["target_frac"].iloc[0])
    sources = sorted(set(solved["source"]))
    st.caption(f"Every rule below is moved along its one threshold to block {target:.2%} of the tokens with "
               f"A != 0, as {solved['reference'].iloc[0]}. Thresholds found from the {' and the '.join(sources)}. "
               "A sequence rule blocks whole responses, so it lands on the count nearest the target. Off the "
               f"target: each count against the target, within {EQUAL_WITHIN:.0%} where every token is logged (an "
               "exact cut on the rows) or a summaries' bin edge reaches it; a run that logged a sample of its rows "
               "has the bins' bracket only, and the column says how far that lands.")
    widgets.calibration_warnings(run, eb)
    totals = data.blocked_totals([run]).set_index("rule")

    def there(rule: str) -> str:
        if rule not in totals.index:
            return "0 blocked"
        n, of = totals.loc[rule, "n_blocked"], totals.loc[rule, "n_tokens"]
        return widgets.count_of(n, of) + (" - out of calibration" if of and n / of > OUT_OF_CALIBRATION else "")

    table = solved.assign(
        rule=[r + figures.APPLIED_MARK if r == applied else r for r in solved["rule"]],
        threshold=[f"{p} {d:.4g} -> {v:.4g}" + (f" [{lo:.3g}, {hi:.3g}]" if lo != hi else "")
                   for p, d, v, lo, hi in zip(solved["param"], solved["default"], solved["value"],
                                              solved["value_low"], solved["value_high"], strict=True)],
        blocks_there=[there(r) for r in solved["rule"]],
        blocks=[widgets.count_of(b, t) for b, t in zip(solved["n_blocked"], solved["n_tokens"], strict=True)],
        off=[off_text(o, g, note) for o, g, note in zip(solved["off"], solved["target_blocked"], solved["note"],
                                                        strict=True)])
    st.dataframe(table[["rule", "blocks", "off", "threshold", "blocks_there", "setting", "note"]], hide_index=True,
                 key="cf_budget_table", height=35 * (len(table) + 1) + 3,
                 column_config={"rule": st.column_config.TextColumn("rule", width="medium"),
                                "threshold": st.column_config.TextColumn(
                                    "threshold: evaluated -> equal budget",
                                    help="[low, high]: the bracket the summaries' bins allow"),
                                "blocks_there": "blocks at the parameters evaluated", "blocks": "blocks at the budget",
                                "off": st.column_config.TextColumn(
                                    "off the target", help="The count at the budget against the target count, as "
                                    "a share of it: within 1% where the summaries' bin edge or an exact cut on "
                                    "every logged token reaches it; ties: tied scores or whole responses"),
                                "setting": st.column_config.TextColumn(
                                    "as --rule", help="Give it to --rule or TokenLogger(rule_settings=...)")})
    skipped = eb[eb["param"].isna()]["rule"].tolist()
    if skipped:
        st.caption(f"Not compared at an equal budget (no scalar threshold): {', '.join(skipped)}.")
    curve = data.threshold_curve(run)
    st.markdown("**Blocked share against each rule's threshold**")
    widgets.chart(data.figure(figures.threshold_curves, curve, target=target, applied=applied), "cf_curves",
                  "No rule with a scalar threshold blocks a logged token of this run at any threshold.")
    absent = sorted(set(solved["rule"]) - set(curve["rule"]))
    counted = ", ".join(f"{n:,} tokens with A != 0 ({src})" for src, n in
                        curve.groupby("source")["n_tokens"].first().items())
    st.caption(f"One line per rule, over {counted}; the threshold as a multiple of the one evaluated (the diamond, "
               f"at 1: the default, or the run's own for {applied or 'its rule'}); the dashed line is the equal "
               f"budget, {target:.2%}. Hover for the threshold itself and the counts."
               + (f" Not drawn (no logged token any threshold blocks): {', '.join(absent)}." if absent else ""))

    choices = figures.rule_order(solved["rule"].tolist())
    first = applied if applied in choices else choices[0]
    second = next((r for r in (data.BASELINE_RULE, data.COUNTERFACTUAL_RULE, *choices) if r != first and r in choices),
                  first)
    left, right = st.columns(2)
    with left:
        rule_a = st.selectbox("Rule A", choices, index=choices.index(first), key=f"cf_eb_a_{run}",
                              format_func=lambda r: r + figures.APPLIED_MARK if r == applied else r)
    with right:
        rule_b = st.selectbox("Rule B", choices, index=choices.index(second), key=f"cf_eb_b_{run}",
                              format_func=lambda r: r + figures.APPLIED_MARK if r == applied else r)
    picks = data.budget_picks(run, budget)
    offered = [d for d in DIMENSIONS if d in set(picks["dimension"])] or list(DIMENSIONS)[:4]  # turn, staleness: where logged
    dimension = st.segmented_control("Picks by", offered, default="mu_bucket", key="cf_dimension",
                                     format_func=DIMENSIONS.get) or "mu_bucket"
    rows_n = int(picks.loc[picks["rule"] == "(all tokens)"].groupby("dimension")["n_blocked"].sum().max())
    widgets.chart(data.figure(figures.budget_picks, picks, dimension, [rule_a] if rule_a == rule_b else
                              [rule_a, rule_b]), "cf_picks", "Neither rule blocks a logged token at this budget.")
    st.caption(f"Which tokens each rule picks at the budget, by {DIMENSIONS[dimension]}: the share of its blocked "
               f"tokens in each group (the bar's label: its count of tokens), against the share of all {rows_n:,} "
               "logged tokens with A != 0 (grey). "
               "From the logged rows.")
    if rule_a == rule_b:
        st.info("Pick two different rules to see their overlap.", icon=":material/info:")
        return
    overlap = data.budget_overlap(run, rule_a, rule_b, budget)
    counts = overlap.groupby("pick")["n"].sum()
    cols = st.columns(3)
    cols[0].metric("Both block", widgets.count_of(counts.get("both", 0), rows_n))
    cols[1].metric(f"Only {rule_a}", widgets.count_of(counts.get("only a", 0), rows_n))
    cols[2].metric(f"Only {rule_b}", widgets.count_of(counts.get("only b", 0), rows_n))
    st.caption(f"Of the {rows_n:,} logged tokens with A != 0 of run {run}, at the equal budget.")
    columns = st.columns(3)
    for col, pick, title in zip(columns, ("both", "only a", "only b"),
                                ("both block", f"only {rule_a}", f"only {rule_b}"), strict=True):
        with col:
            texts = overlap[overlap["pick"] == pick].head(15)
            st.markdown(f"**Tokens {title}**")
            if texts.empty:
                st.caption("none")
            else:
                st.dataframe(texts.assign(token=texts["token_text"].map(figures.visible))[["token", "n"]],
                             hide_index=True, key=f"cf_texts_{pick.replace(' ', '_')}")


if mode == EQUAL:
    equal_budget_page()
    st.stop()

rules = figures.rule_order(data.masking_rules(run) + [r for r in (applied, data.COUNTERFACTUAL_RULE) if r])
default_a = applied if applied in rules else rules[0]
default_b = data.BASELINE_RULE if default_a == data.COUNTERFACTUAL_RULE else data.COUNTERFACTUAL_RULE
left, right = st.columns(2)
with left:
    rule_a = st.selectbox("Rule A", rules, index=rules.index(default_a), key="cf_rule_a",
                          format_func=lambda r: r + figures.APPLIED_MARK if r == applied else r)
with right:
    rule_b = st.selectbox("Rule B", rules, index=rules.index(default_b) if default_b in rules else 0,
                          key="cf_rule_b", format_func=lambda r: r + figures.APPLIED_MARK if r == applied else r)
steps = widgets.pick_steps(run, key="cf_steps")
if rule_a == rule_b:
    st.info("Pick two different rules to compare.")
    st.stop()
diff = data.counterfactual(run, rule_a, rule_b, steps)
buckets = data.rules_by_bucket(run, steps)
n_tokens = int(buckets.drop_duplicates(["mu_bucket", "adv_sign"])["n_tokens"].sum())
only_a = diff[diff["blocked_by"] == rule_a]
only_b = diff[diff["blocked_by"] == rule_b]
cols = st.columns(3)
cols[0].metric(f"{rule_a} blocks, {rule_b} keeps", widgets.count_of(len(only_a), n_tokens))
cols[1].metric(f"{rule_b} blocks, {rule_a} keeps", widgets.count_of(len(only_b), n_tokens))
cols[2].metric("Tokens compared (A != 0)", f"{n_tokens:,}")
st.caption(f"Both rules evaluated on the same {n_tokens:,} tokens with a non-zero advantage of run {run}, steps "
           f"{steps[0]}-{steps[1]}. The trainer applied " + (f"{applied}; " if applied else "a rule not recorded; ")
           + "the other rule's column says what it would have done instead.")
if diff.empty:
    st.info(f"{rule_a} and {rule_b} agree on every token of this window: pick other rules or widen the steps.")
    st.stop()

by_bucket = diff.groupby(["mu_bucket", "adv_sign"]).agg(
    only_a=("blocked_by", lambda s: int((s == rule_a).sum())),
    only_b=("blocked_by", lambda s: int((s == rule_b).sum()))).reset_index()
widgets.chart(data.figure(figures.counterfactual_by_bucket, by_bucket, rule_a, rule_b), "cf_chart",
              "No difference.")

diff = diff.assign(position=pd.cut(diff["pos"], POSITION_BINS, right=False, labels=POSITION_LABELS))
left, right = st.columns(2)
with left:
    st.markdown("**By advantage sign**")
    st.dataframe(pd.crosstab(diff["adv_sign"], diff["blocked_by"]).reindex(columns=[rule_a, rule_b], fill_value=0)
                 .rename(columns=lambda r: f"{r} blocks").reset_index(), hide_index=True, key="cf_sign")
with right:
    st.markdown("**By position in the response**")
    st.dataframe(pd.crosstab(diff["position"], diff["blocked_by"]).reindex(columns=[rule_a, rule_b], fill_value=0)
                 .rename(columns=lambda r: f"{r} blocks").reset_index(), hide_index=True, key="cf_pos")

st.markdown(f"**The {len(diff):,} tokens** (pick a row to open it in the token explorer)")
shown = diff[["step", "sample_id", "pos", "token_text", "blocked_by", "kept_by", "adv_sign", "mu_bucket",
              "mu_prob", "pi_prob", "ratio", "binary_tv", "advantage"]].head(2_000)
event = st.dataframe(shown, hide_index=True, key="cf_tokens", on_select="rerun", selection_mode="single-row",
                     column_config={"token_text": st.column_config.TextColumn("token"),
                                    "mu_prob": st.column_config.NumberColumn("mu", format="%.4f"),
                                    "pi_prob": st.column_config.NumberColumn("pi", format="%.4f"),
                                    "ratio": st.column_config.NumberColumn(format="%.3f"),
                                    "binary_tv": st.column_config.NumberColumn("TV", format="%.4f")})
if len(diff) > len(shown):
    st.caption(f"The latest {len(shown):,} of {len(diff):,} tokens are listed; narrow the steps for the others.")
picked = event.selection.rows if event is not None else []
if picked:
    row = shown.iloc[picked[0]]
    st.session_state["explorer_target"] = {"run": run, "step": int(row["step"]), "sample": int(row["sample_id"]),
                                           "pos": int(row["pos"])}
    st.switch_page(pages.by_file("token_explorer.py").script)
