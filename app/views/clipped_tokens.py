"""Clipped tokens: the token texts a rule blocks at the highest rate, with their counts, mu and entropy."""

import streamlit as st

from app import data, widgets
from trustscope import figures

SIGNS = {"any": "any advantage", "A<0": "A < 0", "A>0": "A > 0"}

st.title("Clipped tokens")
runs = widgets.require_runs()
left, right = st.columns(2)
with left:
    run = widgets.pick_run(runs)
masking = data.masking_rules(run)
if not masking:
    st.info(f"No rule would block any token of run {run}: the policy never moved far from the rollouts. Train "
            "with more mismatch (`--engine-dtype bfloat16`, `--mini-batches 4`) to see what the rules clip.")
    st.stop()
own = data.run_rule(run)
with right:
    rule = st.selectbox("Rule", masking, index=masking.index(own) if own in masking else 0, key="clip_rule",
                        format_func=lambda r: r + figures.APPLIED_MARK if r == own else r)
steps = widgets.pick_steps(run, key="clip_steps")
cols = st.columns(3)
sign = cols[0].radio("Advantage", list(SIGNS), format_func=SIGNS.get, horizontal=True, key="clip_sign")
min_count = cols[1].number_input("Seen at least (times)", 1, 10_000, 5, key="clip_min")
top = cols[2].slider("Tokens shown", 5, 50, 20, key="clip_top")
df = data.clipped_tokens(run, rule, steps, sign, int(min_count), top)
if df.empty:
    st.info(f"{rule} blocks no token seen at least {int(min_count)} times with {SIGNS[sign]} in steps "
            f"{steps[0]}-{steps[1]}: lower 'Seen at least', pick another advantage sign or widen the steps.")
    st.stop()
st.caption(f"Token texts ranked by the share of their occurrences (A != 0, {SIGNS[sign]}) that {rule} blocks in "
           f"steps {steps[0]}-{steps[1]}, among tokens seen at least {int(min_count)} times; each bar says blocked "
           f"of seen. The top token, {df['text'].iloc[0]!r}, is blocked {int(df['n_blocked'].iloc[0]):,} times of "
           f"{int(df['n_occurrences'].iloc[0]):,}.")
widgets.chart(data.figure(figures.clipped_tokens, df, rule), "clipped_chart", "No token to show.")
st.dataframe(df.drop(columns=["token_id"]), hide_index=True, key="clipped_table", column_config={
    "block_rate": st.column_config.NumberColumn("block rate", format="percent"),
    "mean_mu": st.column_config.NumberColumn("mean mu", format="%.3f"),
    "mean_entropy": st.column_config.NumberColumn("mean entropy", format="%.2f")})
