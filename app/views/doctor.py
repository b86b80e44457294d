"""The Doctor section of the Runs page: the contract checks of ``trustscope doctor`` on the runs picked there."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import streamlit as st

from app import data
from trustscope.doctor import VERDICTS, doctor_panel

COLUMNS = ["run_id", "check", "verdict", "summary", "cause"]


@st.cache_data(show_spinner=False, max_entries=64)
def _panel(logdir: str, fp: str, run_ids: tuple[str, ...]) -> pd.DataFrame:
    """Verdict rows of ``run_ids``, cached under the log directory's file fingerprint ``fp``."""
    return doctor_panel(logdir, list(run_ids))


def doctor_section(run_ids: Sequence[str]) -> None:
    """A compact table of every check's verdict on ``run_ids``, failures first, with the likely cause."""
    st.subheader("Doctor")
    logdir = data.current_logdir()
    table = _panel(logdir, data.fingerprint(logdir), tuple(run_ids))
    counts = table["verdict"].value_counts()
    st.caption("Contract checks on the logs themselves (`trustscope doctor LOGDIR` prints the evidence): "
               + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS) + ".")
    order = table["verdict"].map({"fail": 0, "warn": 1, "skipped": 2, "ok": 3})
    shown = table.assign(_order=order).sort_values(["_order", "run_id"], kind="stable")[COLUMNS]
    st.dataframe(shown, hide_index=True, key="doctor_table")
