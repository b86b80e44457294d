"""Bad negative updates (A < 0 tokens pushed far below mu) against reward fluctuation, over steps."""

import streamlit as st

from app import data, widgets
from trustscope import figures, report

st.title("Bad negative updates")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
df = data.bad_updates(run)
if df.empty:
    st.info(f"Run {run} has no steps with tokens yet.")
    st.stop()
widgets.warning_badge([run])
warnings = data.collapse_warnings([run])
alert_steps = warnings.loc[warnings["warning"].astype(bool), "step"].tolist()
n_bad, n_tokens = int(df["n_bad_negative"].sum()), int(df["n_tokens"].sum())
cols = st.columns([3, 2, 2])  # the first value is the longest: a fraction with its counts
cols[0].metric("Bad updates (all steps)", widgets.count_of(n_bad, n_tokens))
if n_bad:
    worst = df.loc[df["bad_rate"].idxmax()]
    cols[1].metric("Worst step", f"{int(worst['step'])}",
                   f"{int(worst['n_bad_negative']):,} of {int(worst['n_tokens']):,} tokens", delta_color="off",
                   delta_arrow="off")
else:
    cols[1].metric("Worst step", "none", "no bad update in any step", delta_color="off", delta_arrow="off")
valid = df.dropna(subset=["reward_fluctuation"])
corr = valid["bad_rate"].corr(valid["reward_fluctuation"]) if len(valid) > 2 and n_bad else float("nan")
cols[2].metric("Correlation with reward fluctuation", "-" if corr != corr else f"{corr:+.2f}")
widgets.chart(data.figure(figures.bad_updates_vs_reward, df, data.WARNING_LINES.bad_rate, alert_steps[:1]),
              "bad_chart", "No step has tokens yet.")
where = report.source_caption(data.sources([run]))
if n_bad:
    st.caption(f"A token is a bad update when A < 0 and mu - pi >= {data.BAD_DELTA:g}: the update pushed its "
               f"probability far below the rollout's. On this run, {n_bad:,} of {n_tokens:,} tokens were "
               f"bad updates, in {int((df['n_bad_negative'] > 0).sum())} of {len(df)} steps; the per-step rate "
               f"correlates with the reward's step-to-step change at r = {corr:+.2f} over {len(valid)} steps"
               + (" (too few bad updates for that to mean much). " if n_bad < 30 else ". ") + where)
else:
    st.caption(f"No token of this run is a bad update (A < 0 and mu - pi >= {data.BAD_DELTA:g}): the policy never "
               f"moved a negative-advantage token that far below the rollout. {where}")
st.dataframe(df, hide_index=True, key="bad_table", column_config={
    "bad_rate": st.column_config.NumberColumn("bad rate", format="percent")})
