"""Live: a run still being written refreshes on its own; new Parquet files invalidate the cached results.

The refresh never outruns itself: when one refresh takes longer than half the chosen interval (a busy server, many
readers), the page waits twice the time its last refresh took instead, so a reader always sees a finished page
between refreshes rather than one that is re-drawn before it is done.
"""

import math
import time
from datetime import datetime

import pandas as pd
import streamlit as st

from app import data
from trustscope import figures

st.title("Live")
every = st.select_slider("Refresh every", options=[2, 5, 10, 30, 60], value=5, format_func=lambda s: f"{s} s",
                         key="live_every")


def refresh_interval(chosen: float, took: float | None) -> float:
    """The seconds between two refreshes: the reader's choice, or twice the last refresh's time when that is longer
    (rounded up to a whole second, so small changes in a refresh's time do not move the timer)."""
    return float(chosen) if took is None else float(max(chosen, math.ceil(2 * took)))


interval = refresh_interval(every, st.session_state.get("live_took"))


@st.fragment(run_every=interval)
def live_view() -> None:
    start = time.perf_counter()
    draw()
    took = time.perf_counter() - start
    st.session_state["live_took"] = took
    wanted = refresh_interval(every, took)
    if wanted > 1.5 * interval or wanted < interval / 1.5:  # the timer is far from what a refresh takes: re-arm it
        st.rerun()


def draw() -> None:
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
        slower = f" (every {interval:.0f} s: a refresh takes {st.session_state['live_took']:.1f} s)" if (
            interval > every and "live_took" in st.session_state) else ""
        st.caption(f"Refreshed {datetime.now():%H:%M:%S}{slower}; the run's manifest was last updated "
                   + ("never" if updated is None or pd.isna(updated) else f"{updated:%Y-%m-%d %H:%M:%S} UTC") + ".")


live_view()
