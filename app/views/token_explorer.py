"""Token explorer: one response with every token coloured by ratio, TV, advantage or blocked flag."""

import streamlit as st

from app import charts, data, widgets

st.title("Token explorer")
runs = widgets.require_runs()
run = widgets.pick_run(runs)
first, last = data.step_range(run)
step = st.number_input("Step", min_value=first, max_value=last, value=first, step=1, key="explorer_step")
samples = data.samples(run, int(step))
if samples.empty:
    st.info(f"Run {run} logged no response tokens at step {step} (a run may log the tokens of only a fraction "
            "of its responses); try another step.")
    st.stop()
labels = {int(r.sample_id): f"#{int(r.sample_id)}  reward {r.reward:.2f}  A {r.advantage:+.2f}  {r.length} tokens"
          for r in samples.itertuples()}
sample_id = st.selectbox("Sample", list(labels), format_func=labels.get, key="explorer_sample")
colour_by = st.radio("Colour by", charts.COLOUR_BY, horizontal=True, key="explorer_colour")
row = samples.set_index("sample_id").loc[sample_id]
st.markdown("**Prompt**")
st.code(row["prompt"], language=None, wrap_lines=True)
tokens = data.sample_tokens(run, int(step), int(sample_id))
st.markdown(f"**Response** ({len(tokens)} tokens; hover a token for mu's top-K alternatives)")
st.html(charts.token_spans_html(tokens, colour_by))
st.caption(data.COLOUR_LEGEND[colour_by])
