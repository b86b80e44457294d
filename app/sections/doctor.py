"""The Doctor section of the Runs page: the contract checks of ``trustscope doctor`` on the runs picked there.

Each run is read over its last steps up to :data:`WINDOW_TOKENS` logged tokens, so the section costs the same
however long a run grows; ``trustscope doctor LOGDIR`` reads every step. Failures and warnings come first; what
passed or was skipped folds into one line of counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import streamlit as st

from app import data
from trustscope.db import LogDB
from trustscope.doctor import VERDICTS, doctor_panel

COLUMNS = ["run_id", "from_step", "check", "verdict", "summary", "cause"]
WINDOW_TOKENS = 100_000
"""Logged tokens the section reads per run at most (whole steps, the last ones; at least the last step): plenty
for every check's statistics, and the Runs page stays an overview."""
ORDER = {"fail": 0, "warn": 1, "ok": 2, "skipped": 3}
"""Failures first, then warnings."""
QUIET = ("ok", "skipped")
"""Verdicts that say nothing is wrong: counted in one line, listed only on demand."""


def windows(run_ids: Sequence[str]) -> dict[int, list[str]]:
    """First step -> the runs read from there: one shared first step (one pass of the checks) when every run has
    steps at or after the latest of their own windows' starts, else one per distinct start."""
    starts = {run_id: data.window_start(run_id, WINDOW_TOKENS) for run_id in run_ids}
    latest = max(starts.values(), default=0)
    if all(data.step_range(run_id)[1] >= latest for run_id in run_ids):
        return {latest: list(run_ids)}
    grouped: dict[int, list[str]] = {}
    for run_id, first in starts.items():
        grouped.setdefault(first, []).append(run_id)
    return grouped


@data.cached
def panel(ours: LogDB, by_first: tuple[tuple[int, tuple[str, ...]], ...]) -> pd.DataFrame:
    """The verdict rows of the runs of each (first step, runs) pair, failures first, then by run."""
    table = pd.concat([doctor_panel(ours, list(run_ids), first_step=first).assign(from_step=first)
                       for first, run_ids in by_first], ignore_index=True)
    return (table.assign(_order=table["verdict"].map(ORDER)).sort_values(["_order", "run_id"], kind="stable")
            .drop(columns="_order").reset_index(drop=True))


def panel_of(run_ids: Sequence[str]) -> pd.DataFrame:
    """:func:`panel` over each run's window of last steps (:func:`windows`): what the section shows for
    ``run_ids``, and what the server prepares for the default comparison (:func:`app.data.prepare`)."""
    return panel(tuple((first, tuple(ids)) for first, ids in windows(run_ids).items()))


def counts_line(table: pd.DataFrame) -> str:
    """``"2 fail, 0 warn, 36 ok, 12 skipped"``: every verdict's count, failures first."""
    counts = table["verdict"].value_counts()
    return ", ".join(f"{int(counts.get(v, 0))} {v}" for v in sorted(VERDICTS, key=ORDER.get))


def doctor_section(run_ids: Sequence[str]) -> None:
    """Failures and warnings of every check on ``run_ids`` with the likely cause; the rest as counts, the whole
    table folded beneath them."""
    st.subheader("Doctor")
    table = panel_of(run_ids)
    firsts = sorted(set(table["from_step"]))
    since = f"from step {firsts[0]} on" if len(firsts) == 1 else "over each run's last steps"
    st.caption(f"Contract checks on the logs themselves, {since} (`trustscope doctor LOGDIR` reads every step and "
               f"prints the evidence): {counts_line(table)}.")
    loud = table[~table["verdict"].isin(QUIET)]
    n_runs = table["run_id"].nunique()
    if len(loud):
        st.dataframe(loud[COLUMNS], hide_index=True, key="doctor_problems")
    else:
        st.success(f"No check failed or warned on the {n_runs} run{'s' * (n_runs > 1)} picked.",
                   icon=":material/check:")
    folded = " and ".join(f"{int((table['verdict'] == v).sum())} {v}" for v in QUIET)
    with st.expander(f"{folded}: every verdict, one row per run and check"):
        st.dataframe(table[COLUMNS], hide_index=True, key="doctor_table")
