"""The trustscope dashboard's router: resolves the log directory, checks it, and runs the page picked in the
menu (:data:`app.pages.PAGES`), once :func:`app.auth.gate` has let the session in (a dashboard started with an access
token or a sign-in provider shows nothing else until then).

Start it with ``trustscope dashboard [LOGDIR]``, or ``streamlit run app/main.py -- --logdir LOGDIR``; the log
directory may also come from the ``TRUSTSCOPE_LOGDIR`` environment variable.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from app import auth, data, pages  # noqa: E402

st.set_page_config(page_title="trustscope", page_icon=":material/troubleshoot:", layout="wide")
auth.gate()  # before the menu and any read of the logs
page = st.navigation(pages.navigation())
logdir = data.resolve_logdir(sys.argv[1:])
st.sidebar.caption(f"Log directory: `{logdir}`")

with data.friendly_errors():
    data.check_logdir(logdir)
    page.run()
