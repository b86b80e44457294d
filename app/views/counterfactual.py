"""Counterfactual: what another rule would have done differently on this run, token by token."""

import pandas as pd
import streamlit as st

from app import data, pages, widgets
from trustscope import figures

POSITION_BINS = [0, 1, 4, 16, 64, 256, 1 << 30]
POSITION_LABELS = ["0", "1-3", "4-15", "16-63", "64-255", "256+"]

st.title("Counterfactual")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
applied = data.run_rule(run)
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
