"""Token explorer: one response with every token coloured by ratio, TV, advantage or any rule's would-block."""

import streamlit as st

from app import data, widgets
from trustscope import figures

st.title("Token explorer")
runs = widgets.require_runs()
target = st.session_state.pop("explorer_target", None)
params = st.query_params
if target is None and {"run", "step", "sample"} <= set(params):
    target = {"run": params["run"], "step": int(params["step"]), "sample": int(params["sample"]),
              "pos": int(params.get("pos", -1))}
if target is not None and target["run"] in set(runs["run_id"]):
    st.session_state["_runs"] = [target["run"]]
    st.session_state["run_picker"] = target["run"]
run = widgets.pick_run(runs)
first, last = data.step_range(run)
start = data.explorer_start(run)
if target is not None and target["run"] == run:
    st.session_state["explorer_step"] = target["step"]
    st.session_state["explorer_sample"] = target["sample"]
    st.session_state["explorer_pos"] = target.get("pos", -1)
elif st.session_state.get("_explorer_run") != run:
    st.session_state["explorer_step"] = start[0] if start else last
    st.session_state["explorer_sample"] = start[1] if start else None
    st.session_state.pop("explorer_pos", None)
elif "explorer_step" not in st.session_state:  # back from another page, which dropped these widgets' state
    st.session_state["explorer_step"] = st.session_state.get("_explorer_step", last)
    st.session_state["explorer_sample"] = st.session_state.get("_explorer_sample")
st.session_state["_explorer_run"] = run
step = st.number_input("Step", min_value=first, max_value=last, step=1, key="explorer_step")
samples = data.samples(run, int(step))
if samples.empty:
    st.info(f"Run {run} logged no response tokens at step {step} (a run may log the tokens of only a fraction "
            "of its responses); try another step.")
    st.stop()
labels = {int(r.sample_id): f"#{int(r.sample_id)}  reward {r.reward:.2f}  A {r.advantage:+.2f}  "
                            f"{int(r.n_logged)} tokens, {int(r.n_blocked)} blocked by the trainer, "
                            f"{int(r.n_would_block)} by some rule" for r in samples.itertuples()}
ids = list(labels)
if st.session_state.get("explorer_sample") not in ids:
    busiest = samples.sort_values(["n_blocked", "n_would_block", "n_logged"], ascending=False)["sample_id"].iloc[0]
    st.session_state["explorer_sample"] = start[1] if start and start[0] == step and start[1] in ids else int(busiest)
sample_id = st.selectbox("Sample", ids, format_func=labels.get, key="explorer_sample")
st.session_state["_explorer_step"], st.session_state["_explorer_sample"] = int(step), int(sample_id)
tokens = data.sample_tokens(run, int(step), int(sample_id))
rule_columns = [c.removeprefix("blocks_") for c in tokens.columns if c.startswith("blocks_")]
own = data.run_rule(run)
left, right = st.columns(2)
with left:
    colour_by = st.radio("Colour by", figures.COLOUR_BY, horizontal=True, key="explorer_colour")
rule = own
if colour_by == "blocked":
    with right:
        options = ["trainer's mask", *figures.rule_order(rule_columns)]
        pick = st.selectbox("Blocked by", options, key="explorer_rule",
                            format_func=lambda r: r + figures.APPLIED_MARK if r == own else r)
    if pick != "trainer's mask":
        tokens = tokens.assign(blocked=tokens[f"blocks_{pick}"])
        rule = pick
    else:
        rule = f"the trainer's own rule ({own})" if own else "the trainer's own rule"
scale = None
if colour_by == "advantage":
    scale = max(float(tokens["advantage"].abs().max()), 1e-6)
row = samples.set_index("sample_id").loc[sample_id]
st.markdown("**Prompt**")
st.code(row["prompt"], language=None, wrap_lines=True)
st.markdown(f"**Response** ({len(tokens)} logged tokens, {int(tokens['blocked'].sum())} blocked; hover a token for "
            "mu's top-K with pi's probability of each)")
st.html(figures.token_spans_html(tokens, colour_by, scale))
legend = data.COLOUR_LEGEND[colour_by]
st.caption(legend.format(scale=scale or figures.TOKEN_SCALES.get(colour_by, 0), rule=rule))

st.markdown("**Every token**")
table = tokens[["pos", "text", "mu", "pi", "ratio", "tv", "advantage", "blocked"]].copy()
table["text"] = table["text"].map(repr)
focus = st.session_state.get("explorer_pos", -1)
if focus < 0 and tokens["blocked"].any():
    focus = int(tokens.loc[tokens["blocked"], "pos"].iloc[0])  # the first blocked token's top-K
st.dataframe(table, hide_index=True, key="explorer_table", column_config={
    "mu": st.column_config.NumberColumn(format="%.4f"), "pi": st.column_config.NumberColumn(format="%.4f"),
    "ratio": st.column_config.NumberColumn(format="%.3f"), "tv": st.column_config.NumberColumn("TV", format="%.4f"),
    "advantage": st.column_config.NumberColumn(format="%+.3f")})
positions = tokens["pos"].tolist()
pos = st.selectbox("Top-K at position", positions, index=positions.index(focus) if focus in positions else 0,
                   key="explorer_topk_pos", format_func=lambda p: f"{p}: {tokens.set_index('pos').loc[p, 'text']!r}")
topk = data.topk_table(run, int(step), int(sample_id), int(pos))
if topk.empty:
    st.caption("This run did not log top-K probabilities.")
else:
    st.dataframe(topk, hide_index=True, key="explorer_topk", column_config={
        "mu": st.column_config.NumberColumn(format="%.4f"), "pi": st.column_config.NumberColumn(format="%.4f"),
        "pi - mu": st.column_config.NumberColumn(format="%+.4f")})
    st.caption("mu's top-K tokens at this position with mu's probability and pi's probability of the same token "
               "(the trainer's policy at update time).")
