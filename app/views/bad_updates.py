"""Bad negative updates (A < 0 tokens pushed far below mu) against reward fluctuation, over steps."""

import streamlit as st

from app import charts, data, widgets

st.title("Bad negative updates")
st.caption(f"A token counts as a bad update when A < 0 and mu - pi >= {data.BAD_DELTA}: the update pushed its "
           "probability far below the rollout's. The paper finds their rate moves with reward fluctuation.")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
df = data.bad_updates(run)
if df.empty:
    st.info(f"Run {run} has no steps with tokens yet.")
    st.stop()
cols = st.columns(3)
cols[0].metric("Bad updates (all steps)", f"{df['n_bad_negative'].sum() / max(df['n_tokens'].sum(), 1):.3%}")
cols[1].metric("Worst step", int(df.loc[df["bad_rate"].idxmax(), "step"]))
corr = df["bad_rate"].corr(df["reward_fluctuation"]) if len(df) > 2 else float("nan")
cols[2].metric("Correlation with reward fluctuation", "-" if corr != corr else f"{corr:+.2f}")
st.plotly_chart(charts.bad_updates_vs_reward(df), key="bad_chart")
st.dataframe(df, hide_index=True, key="bad_table")
