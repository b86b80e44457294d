"""Runs: reward, accuracy, mismatch, entropy and blocked fraction by rule over steps, several runs side by side."""

import streamlit as st

from app import charts, data, widgets
from app.views import doctor

st.title("Runs")
runs = widgets.require_runs()
st.dataframe(runs, hide_index=True, key="runs_table")
chosen = widgets.pick_runs(runs)
if not chosen:
    st.info("Pick at least one run.")
    st.stop()

metrics = st.multiselect("Metrics", data.METRIC_TITLES, default=list(data.METRIC_TITLES),
                         format_func=data.METRIC_TITLES.get, key="metrics_picker")
st.plotly_chart(charts.metrics_over_steps(data.step_metrics(chosen), metrics, data.METRIC_TITLES),
                key="metrics_chart")

st.subheader("Blocked fraction by rule")
st.caption("Share of tokens each trust-region rule would block on the same tokens (the trainer applied only "
           "the run's own rule).")
blocked = data.blocked_by_rule(chosen)
rules = widgets.pick_rules(sorted(set(blocked["rule"]), key=blocked["rule"].tolist().index))
st.plotly_chart(charts.blocked_fraction_by_rule(blocked[blocked["rule"].isin(rules)]), key="blocked_chart")

doctor.doctor_section(chosen)
