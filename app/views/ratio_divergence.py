"""Ratio versus divergence (the paper's Figure 2): the ratio is volatile on low-probability tokens, TV is not."""

import streamlit as st

from app import charts, data, widgets

st.title("Ratio vs divergence")
st.caption("Each point is a token. The ratio pi / mu swings over orders of magnitude when mu is small even "
           "though little probability mass moved; the total variation stays small and stable.")
runs = widgets.require_runs()
left, right = st.columns(2)
with left:
    run = widgets.pick_run(runs)
with right:
    divergence = st.radio("Divergence", list(data.DIVERGENCES), format_func=data.DIVERGENCES.get,
                          horizontal=True, key="divergence")
steps = widgets.pick_steps(run)
points = data.ratio_points(run, steps)
if points.empty:
    st.info(f"Run {run} has no tokens in steps {steps[0]}-{steps[1]}.")
    st.stop()
st.plotly_chart(charts.ratio_vs_divergence(points, divergence), key="figure2")
st.caption(f"{len(points):,} tokens shown (a uniform sample when there are more).")
st.subheader("Every token, binned")
st.caption("All tokens of the run (every step) binned by ratio and divergence; marker area grows with the count.")
histogram = data.ratio_histogram(run, data.VIEW_DIVERGENCE[divergence])
st.plotly_chart(charts.ratio_divergence_histogram(histogram, data.VIEW_DIVERGENCE[divergence]), key="histogram")
st.subheader("Spread by mu bucket")
st.plotly_chart(charts.spread_by_bucket(data.spread_by_bucket(run, steps)), key="spread_chart")
