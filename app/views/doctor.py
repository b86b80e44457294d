"""The Doctor section of the Runs page: the contract checks of ``trustscope doctor`` on the runs picked there.

Each run is read over its last steps up to :data:`WINDOW_TOKENS` tokens, so the section costs the same however long
a run grows (2.5 s for a 100k-token window on the shared 2-core machine); ``trustscope doctor LOGDIR`` reads every
step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import streamlit as st

from app import data
from trustscope.db import connect
from trustscope.doctor import VERDICTS, doctor_panel

COLUMNS = ["run_id", "from_step", "check", "verdict", "summary", "cause"]
WINDOW_TOKENS = 100_000
"""Tokens the section reads per run at most (whole steps, the last ones; at least the last step): plenty for every
check's statistics, and the Runs page stays an overview."""
ORDER = {"fail": 0, "warn": 1, "skipped": 2, "ok": 3}
"""Failures first, then warnings."""


@st.cache_data(show_spinner=False, max_entries=64)
def _panel(logdir: str, fp: str, windows: tuple[tuple[str, int], ...]) -> pd.DataFrame:
    """Verdict rows of each (run_id, first step) in ``windows``, cached under the log directory's file fingerprint
    ``fp``; one connection, and one pass of the checks per distinct first step."""
    by_first: dict[int, list[str]] = {}
    for run_id, first in windows:
        by_first.setdefault(first, []).append(run_id)
    with connect(logdir, cache=False) as db:
        return pd.concat([doctor_panel(db, run_ids, first_step=first).assign(from_step=first)
                          for first, run_ids in by_first.items()], ignore_index=True)


def doctor_section(run_ids: Sequence[str]) -> None:
    """A compact table of every check's verdict on ``run_ids``, failures first, with the likely cause."""
    st.subheader("Doctor")
    logdir = data.current_logdir()
    table = _panel(logdir, data.fingerprint(logdir), tuple((r, _first_step(r)) for r in run_ids))
    counts = table["verdict"].value_counts()
    st.caption("Contract checks on the logs themselves, over each run's last steps (`trustscope doctor LOGDIR` "
               "reads them all and prints the evidence): "
               + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS) + ".")
    shown = table.assign(_order=table["verdict"].map(ORDER)).sort_values(["_order", "run_id"], kind="stable")
    st.dataframe(shown[COLUMNS], hide_index=True, key="doctor_table")


def _first_step(run_id: str) -> int:
    """The first of the last steps of ``run_id`` that hold at most :data:`WINDOW_TOKENS` tokens (at least the last),
    counted from the overview (every token where the run has summaries: at least its logged rows), so picking the
    window reads no token row."""
    steps = data.overview().steps
    steps = steps[steps["run_id"] == run_id].sort_values("step", ascending=False)
    if steps.empty:
        return 0
    within = steps[steps["n_tokens"].cumsum() <= WINDOW_TOKENS]
    return int(within["step"].min()) if len(within) else int(steps["step"].iloc[0])
