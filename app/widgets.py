"""Pickers shared by the pages; the choice is remembered across pages in the session state."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import data


def pick_runs(runs: pd.DataFrame, limit: int = 4) -> list[str]:
    """Several runs to compare (default: the first run of each loss rule, at most ``limit``)."""
    ids = runs["run_id"].tolist()
    remembered = [r for r in st.session_state.get("_runs", []) if r in ids]
    one_per_rule = runs.drop_duplicates("loss_rule")["run_id"].tolist()[:limit]
    chosen = st.multiselect("Runs", ids, default=remembered or one_per_rule, key="runs_picker")
    st.session_state["_runs"] = chosen
    return chosen


def pick_run(runs: pd.DataFrame, label: str = "Run") -> str:
    """One run (default: the one picked last on any page)."""
    ids = runs["run_id"].tolist()
    remembered = [r for r in st.session_state.get("_runs", []) if r in ids]
    index = ids.index(remembered[0]) if remembered else 0
    run = st.selectbox(label, ids, index=index, key="run_picker")
    st.session_state["_runs"] = [run, *[r for r in remembered if r != run]]
    return run


def pick_steps(run_id: str) -> tuple[int, int]:
    """A step window within one run; by default the last steps holding at most ``data.WINDOW_TOKENS`` tokens,
    so token-level pages cost the same however long the run grows."""
    first, last = data.step_range(run_id)
    if first == last:
        st.caption(f"Step {first}")
        return first, last
    start = data.default_first_step(run_id)
    window = st.slider("Steps", first, last, (start, last), key=f"steps_{run_id}")
    if window[0] > first:
        st.caption(f"Token-level charts read the last steps up to {data.WINDOW_TOKENS:,} tokens by default; "
                   "widen the window for more (slower on large runs).")
    return window


def pick_rules(available: list[str]) -> list[str]:
    """Rules to show side by side (default: PPO's clip, GRPO, the DPPO rules, low-probability relaxation and the
    minimal negative mask, as far as they block anything here)."""
    remembered = [r for r in st.session_state.get("_rules", []) if r in available]
    default = remembered or [r for r in data.DEFAULT_RULES if r in available] or available[:6]
    chosen = st.multiselect("Rules", available, default=default, key="rules_picker")
    st.session_state["_rules"] = chosen
    return chosen


def require_runs() -> pd.DataFrame:
    """The runs table, or a message and a stop when the log directory holds none with data yet."""
    runs = data.runs()
    if runs.empty:
        st.info("No run in this log directory has logged a step yet. Runs still being written appear here "
                "once their first step lands; the Live page refreshes on its own.")
        st.stop()
    return runs
