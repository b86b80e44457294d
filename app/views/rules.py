"""Rules side by side: what each trust-region rule blocks on the same tokens, by mu bucket and advantage sign, at
the parameters of the panel (the defaults until set); a rule over half of the tokens is marked out of calibration,
with the threshold that would block the run's own rule's share."""

import streamlit as st

from app import data, widgets
from trustscope import figures
from trustscope.losses import list_losses

st.title("Rules side by side")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
applied = data.run_rule(run)
widgets.rule_panel(figures.rule_order(list_losses()), applied, "rules_panel")
widgets.calibration_warnings(run, data.equal_budget(run))
steps = widgets.pick_steps(run)
chosen = widgets.pick_rules(data.masking_rules(run), applied)
df = data.rules_by_bucket(run, steps)
df = df[df["rule"].isin(chosen)]
if df.empty:
    st.info(f"Nothing to show for run {run} in steps {steps[0]}-{steps[1]}: no rule picked, or no token with a "
            "non-zero advantage in the window. Pick rules above or widen the step window.")
    st.stop()
totals = df.groupby("rule")[["n_blocked", "n_tokens"]].sum()
n_tokens = int(df.drop_duplicates(["mu_bucket", "adv_sign"])["n_tokens"].sum())
ranked = totals.sort_values("n_blocked", ascending=False)
st.caption(f"Every rule on the same {n_tokens:,} tokens with a non-zero advantage of steps {steps[0]}-{steps[1]} "
           "(A = 0 tokens carry no gradient, whichever rule looks at them). Here "
           + "; ".join(f"{r} blocks {widgets.count_of(row.n_blocked, n_tokens)}" for r, row in ranked.iterrows())
           + ". The trainer applied only " + (f"{applied}." if applied else "its own rule (not recorded)."))
widgets.chart(data.figure(figures.rules_by_bucket, df, applied=applied), "rules_chart",
              "None of the picked rules blocks a token here.")
table = df.assign(blocked=[widgets.count_of(b, n) for b, n in zip(df["n_blocked"], df["n_tokens"], strict=True)])
table = table.pivot_table(index=["mu_bucket", "adv_sign", "n_tokens"], columns="rule", values="blocked",
                          aggfunc="first").reset_index()
st.dataframe(table[["mu_bucket", "adv_sign", "n_tokens", *[r for r in chosen if r in table.columns]]],
             hide_index=True, key="rules_table")
