"""SQL console over the token tables, through the query layer's read-only sandbox."""

import streamlit as st

from app import data

st.title("SQL console")
st.caption(f"Read-only SQL (one SELECT) over the views below. At most {data.SQL_ROW_LIMIT:,} rows come back.")
left, right = st.columns([1, 3])
with left:
    view = st.selectbox("Views", data.VIEWS, index=data.VIEWS.index("step_summary") if "step_summary" in data.VIEWS
                        else 0, key="sql_view")
    st.caption("Internal views (they build the ones above): " + ", ".join(f"`{v}`" for v in data.INTERNAL_VIEWS))
    st.dataframe(data.view_columns(view), hide_index=True, key="sql_columns", height=360)
with right:
    sql = st.text_area("Query", value=data.EXAMPLE_SQL, height=160, key="sql_text")
    if st.button("Run", type="primary", key="sql_run") or "sql_result" not in st.session_state:
        st.session_state["sql_result"] = data.run_sql(sql)
    result = st.session_state["sql_result"]
    if result.error:
        st.error(result.error)
        st.stop()
    st.caption(f"{len(result.frame):,} rows in {result.seconds:.2f} s" + (" (truncated)" if result.truncated else ""))
    st.dataframe(result.frame, hide_index=True, key="sql_table")
    st.download_button("Download CSV", result.frame.to_csv(index=False).encode(), file_name="trustscope_query.csv",
                       mime="text/csv", key="sql_download")
