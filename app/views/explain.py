"""Explain the mismatch: a run's mismatch and a rule's blocked tokens split between the known causes (temperature,
truncation, position shift, token drift, staleness, MoE routing) and what is left unexplained, per window of steps,
each share with its token count and interval; the detectors' findings beside (``trustscope explain``)."""

import pandas as pd
import streamlit as st

from app import data, widgets
from trustscope.db import LogDB
from trustscope.explain import render
from trustscope.explain.analysis import INTERVAL, METHOD, explain
from trustscope.explain.figures import shares_by_window


@data.cached
def explained(ours: LogDB, run_id: str) -> dict | None:
    """The run's explanation as JSON-like dicts (None: no token rows), 200 bootstrap replicates."""
    found = explain(ours, run_id, replicates=200).runs
    return found[0].as_dict() if found else None


@data.cached
def detectors(ours: LogDB, run_id: str) -> pd.DataFrame:
    """The cause_* doctor checks of the run: check, verdict, summary."""
    from trustscope.doctor import CHECKS, diagnose

    found = diagnose(ours, run_id, checks=[name for name in CHECKS if name.startswith("cause_")])[run_id]
    return pd.DataFrame([{"check": f.check, "verdict": f.verdict, "summary": f.summary} for f in found])


MEASURED = "measured by the trainer"  # the column of the trainer's share (train --explain-tokens), where logged


def share_table(causes: list[dict], unit: str, key: str) -> None:
    """One row per cause: the share with its interval and token count, and the trainer's measured share beside it
    where the run logged one; a cause that cannot be measured says what it needs instead of a number."""
    measured = any("measured" in c for c in causes)
    rows = [{"cause": render.title(c["source"]),
             "share": f"{c['share']:.1%} [{c['interval'][0]:.1%}, {c['interval'][1]:.1%}]" if c["measurable"]
             else c["note"],
             "tokens touched": c["tokens"] if c["measurable"] else None,
             unit: c["amount"] if c["measurable"] else None,
             **({MEASURED: c.get("measured")} if measured else {})} for c in causes]  # None: not one it measures
    st.dataframe(pd.DataFrame(rows), hide_index=True, key=key, column_config={
        "tokens touched": st.column_config.NumberColumn("tokens touched", format="localized"),
        unit: st.column_config.NumberColumn(unit, format="%.4g"),
        MEASURED: st.column_config.NumberColumn(MEASURED, format="percent")})


st.title("Explain the mismatch")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
got = explained(run)
if got is None:
    st.info(f"Run {run} has no token rows yet: explain reads the logged tokens (the summaries alone do not say "
            "which cause touched which token).", icon=":material/info:")
    st.stop()
cols = st.columns(3)
cols[0].metric("mean |log pi - log mu|", f"{got['mismatch']:.4g} nats")
cols[1].metric("KL k3 per token", "-" if got["kl_k3"] is None else f"{got['kl_k3']:.4g}")
cols[2].metric("Tokens", f"{got['tokens']:,}", f"{got['tokens_logged']:,} logged", delta_color="off",
               delta_arrow="off")
st.caption(f"Steps {got['first_step']}-{got['last_step']}. {METHOD}; {INTERVAL}. The totals and KL are exact over "
           "every token where the run has summaries; the allocation reads the logged token rows (docs/explain.md).")
st.header("Where the mismatch comes from")
share_table(got["causes"], "nats", "explain_mismatch")
if got.get("measured"):
    st.caption(f"{MEASURED}: the share of the mismatch that recomputing pi without the cause took away, Shapley "
               "shares over every combination (trustscope train --explain-tokens, on a sample of each step's tokens; "
               "the engine's dtype counts as unexplained). Where it and the inferred share differ, the measured one "
               "is the check (docs/explain.md).")
widgets.chart(shares_by_window(got["windows"]), "explain_windows",
              "No window has a logged token: nothing to split.")
rules = sorted(got["rules"])
if rules:
    st.header("Where the blocked tokens come from")
    applied = got["loss_rule"] if got["loss_rule"] in rules else rules[0]
    rule = st.selectbox("Rule", rules, index=rules.index(applied), key="explain_rule")
    entry = got["rules"][rule]
    st.caption(f"{rule}: {entry['blocked']:,} tokens with A != 0 blocked ({entry['blocked_logged']:,} in the logged "
               f"rows), read from {entry['from']}.")
    if entry["blocked_logged"]:
        share_table(entry["causes"], "blocked", "explain_blocked")
        widgets.chart(shares_by_window(got["windows"], f"blocked tokens of {rule}", rule), "explain_blocked_windows",
                      f"{rule} blocks no logged token in any window.")
    else:
        st.info(f"{rule} blocks no logged token with A != 0 in this run: nothing to split.", icon=":material/info:")
st.header("Detectors")
st.caption("Each cause's detector is a doctor check (trustscope doctor): warn where the touched tokens carry the "
           "mismatch, skipped where the run lacks the columns it needs.")
st.dataframe(detectors(run), hide_index=True, key="explain_detectors")
