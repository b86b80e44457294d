"""Clipped tokens: the token texts each rule blocks most, with their probabilities and entropy."""

import streamlit as st

from app import charts, data, widgets

st.title("Clipped tokens")
runs = widgets.require_runs()
left, right = st.columns(2)
with left:
    run = widgets.pick_run(runs)
masking = data.masking_rules(run)
if not masking:
    st.info(f"No rule blocks any token of run {run}.")
    st.stop()
own = runs.set_index("run_id").loc[run, "loss_rule"]
with right:
    rule = st.selectbox("Rule", masking, index=masking.index(own) if own in masking else 0, key="clip_rule")
top = st.slider("Tokens shown", 5, 50, 20, key="clip_top")
df = data.clipped_tokens(run, rule, top)
if df.empty:
    st.info(f"{rule} blocks no token in run {run}.")
    st.stop()
st.plotly_chart(charts.clipped_tokens(df, rule), key="clipped_chart")
st.dataframe(df, hide_index=True, key="clipped_table")
