"""The trustscope dashboard's router: resolves the log directory, checks it, and runs the chosen page.

Start it with ``trustscope dashboard [LOGDIR]``, or ``streamlit run app/main.py -- --logdir LOGDIR``; the log
directory may also come from the ``TRUSTSCOPE_LOGDIR`` environment variable.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from app import data  # noqa: E402

st.set_page_config(page_title="trustscope", page_icon=":material/troubleshoot:", layout="wide")

PAGES = {
    "Training": [
        st.Page("views/runs.py", title="Runs", icon=":material/monitoring:", default=True),
        st.Page("views/live.py", title="Live", icon=":material/autorenew:"),
        st.Page("views/bad_updates.py", title="Bad negative updates", icon=":material/trending_down:"),
    ],
    "Trust region": [
        st.Page("views/ratio_divergence.py", title="Ratio vs divergence", icon=":material/scatter_plot:"),
        st.Page("views/rules.py", title="Rules side by side", icon=":material/compare:"),
        st.Page("views/counterfactual.py", title="Counterfactual", icon=":material/difference:"),
        st.Page("views/clipped_tokens.py", title="Clipped tokens", icon=":material/content_cut:"),
    ],
    "Drill down": [
        st.Page("views/token_explorer.py", title="Token explorer", icon=":material/text_fields:"),
        st.Page("views/sql_console.py", title="SQL console", icon=":material/terminal:"),
    ],
}

page = st.navigation(PAGES)
logdir = data.resolve_logdir(sys.argv[1:])
st.sidebar.caption(f"Log directory: `{logdir}`")

with data.friendly_errors():
    data.check_logdir(logdir)
    page.run()
