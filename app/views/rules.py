"""Rules side by side: what each trust-region rule blocks on the same tokens, by mu bucket and advantage sign."""

import streamlit as st

from app import charts, data, widgets

st.title("Rules side by side")
st.caption("Every rule is evaluated on the same logged tokens. PPO's clip concentrates on low-probability "
           "tokens; the divergence rules block the large moves on high-probability ones.")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
steps = widgets.pick_steps(run)
chosen = widgets.pick_rules(data.masking_rules(run))
df = data.rules_by_bucket(run, steps)
df = df[df["rule"].isin(chosen)]
if df.empty:
    st.info(f"Nothing to show for run {run} in steps {steps[0]}-{steps[1]}: no tokens, or no rule picked.")
    st.stop()
st.plotly_chart(charts.rules_by_bucket(df), key="rules_chart")
table = df.pivot_table(index=["mu_bucket", "adv_sign"], columns="rule", values="blocked_frac").reset_index()
st.dataframe(table, hide_index=True, key="rules_table")
