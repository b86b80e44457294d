"""Live: a run still being written refreshes on its own; new Parquet files invalidate the cached results."""

from datetime import datetime

import pandas as pd
import streamlit as st

from app import data
from trustscope import figures

st.title("Live")
every = st.select_slider("Refresh every", options=[2, 5, 10, 30, 60], value=5, format_func=lambda s: f"{s} s",
                         key="live_every")


@st.fragment(run_every=every)
def live_view() -> None:
    with data.friendly_errors():
        runs = data.runs()
        if runs.empty:
            st.info("Waiting for the first step to land in this log directory...")
            return
        latest = runs.sort_values(["updated_at", "run_id"], ascending=False, na_position="last")["run_id"].iloc[0]
        ids = runs["run_id"].tolist()
        run = st.selectbox("Run", ids, index=ids.index(latest), key="live_run")
        row = runs.set_index("run_id").loc[run]
        cols = st.columns(4)
        cols[0].metric("Last step", int(row["last_step"]))
        cols[1].metric("Tokens logged", f"{int(row['tokens_logged']):,}",
                       f"of {int(row['tokens_generated']):,} generated", delta_color="off", delta_arrow="off")
        cols[2].metric("Mean reward", "-" if pd.isna(row["mean_reward"]) else f"{row['mean_reward']:.3f}")
        cols[3].metric("Status", str(row["status"]))
        metrics = data.step_metrics([run])
        logged = [m for m in data.METRIC_TITLES if m in set(metrics["name"])]
        chart = data.figure(figures.metrics_over_steps, metrics, logged, data.METRIC_TITLES)
        st.plotly_chart(chart, key="live_chart")
        signals = data.early_signals([run])
        shown = [n for n in data.SIGNAL_TITLES if n in set(signals["name"])]
        if shown:
            st.plotly_chart(data.figure(figures.metrics_over_steps, signals, shown, data.SIGNAL_TITLES),
                            key="live_signals_chart")
            st.caption("Early-warning signals, exact over every token of each step (the `early_signals` view).")
        updated = row["updated_at"]
        st.caption(f"Refreshed {datetime.now():%H:%M:%S}; the run's manifest was last updated "
                   + ("never" if updated is None or pd.isna(updated) else f"{updated:%Y-%m-%d %H:%M:%S} UTC") + ".")


live_view()
