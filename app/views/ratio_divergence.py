"""Ratio versus divergence (the paper's Figure 2): how the ratio and the divergence spread by mu bucket."""

import numpy as np
import streamlit as st

from app import data, widgets
from trustscope import figures

st.title("Ratio vs divergence")
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
    st.info(f"Run {run} has no tokens in steps {steps[0]}-{steps[1]}; widen the step window.")
    st.stop()
spread = data.spread_by_bucket(run, steps)
logs = points.assign(log_ratio=np.log(points["ratio"].clip(lower=1e-12)).abs())
corr = logs["log_ratio"].rank().corr(points["mu"].rank())  # Spearman: Pearson of the ranks
low, high = spread.iloc[0], spread.iloc[-1]
st.caption(f"Each point is a token ({len(points):,} shown, a uniform sample when there are more). On this run, "
           f"|log ratio| and log mu correlate at Spearman {corr:+.2f}; the 99th percentile of |ratio - 1| is "
           f"{low['ratio_dev']:.3g} in the lowest mu bucket ({low['mu_bucket']}, {int(low['n_tokens']):,} tokens) "
           f"against {high['ratio_dev']:.3g} in the highest ({high['mu_bucket']}, {int(high['n_tokens']):,} "
           f"tokens), while binary TV's is {low['tv']:.3g} against {high['tv']:.3g}.")
widgets.chart(data.figure(figures.ratio_vs_divergence, points, divergence), "figure2",
              "No token of this window has a positive ratio and divergence to place on log axes.")
st.subheader("Every token, binned")
st.caption("All tokens of the run (every step) binned by ratio and divergence; marker area grows with the count.")
binned = data.VIEW_DIVERGENCE[divergence]
histogram = data.ratio_histogram(run, binned)
widgets.chart(data.figure(figures.ratio_divergence_histogram, histogram, binned), "histogram",
              "Every token of this run has a divergence of exactly 0 (no probability moved), so none sits on a "
              "log axis; train with bf16 rollouts against the fp32 trainer to see mismatch.")
st.subheader("Spread by mu bucket")
widgets.chart(data.figure(figures.spread_by_bucket, spread), "spread_chart", "No token in this window.")
st.caption("The 99th percentile of |ratio - 1| and of binary TV within each mu bucket of the step window; the "
           "token count of each bucket is under its label.")
