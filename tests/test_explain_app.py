"""The dashboard's Explain page under Streamlit's AppTest, over runs with injected causes, and its chart builder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.launch import LOGDIR_ENV
from trustscope.explain.analysis import explain
from trustscope.explain.figures import shares_by_window
from trustscope.explain.inject import InjectConfig, write_run

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
TIMEOUT = 60
SHAPE = {"steps": 4, "responses": 16, "length": 32}


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain_app")
    write_run(root, "mix", InjectConfig(causes={"stale": 0.3, "routing": 0.2}, seed=1, **SHAPE))
    write_run(root, "bare", InjectConfig(causes={"stale": 0.3}, seed=2, **SHAPE),
              drop=("policy_version", "routing_agreement", "engine_token_id"))
    return root


def _page(monkeypatch, logdir, run: str) -> AppTest:
    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/explain.py")
    at.run()
    at.selectbox(key="run_picker").set_value(run).run()
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert [t.value for t in at.title] == ["Explain the mismatch"]
    return at


@pytest.mark.slow
def test_explain_page_shows_shares_with_counts_and_a_chart_per_allocation(monkeypatch, logdir):
    at = _page(monkeypatch, logdir, "mix")
    tables = [d.value for d in at.dataframe]  # the mismatch, the rule's blocked tokens, the detectors
    assert len(tables) == 3
    table = tables[0]
    shares = dict(zip(table["cause"], table["share"], strict=True))
    assert shares["staleness"].endswith("]") and "[" in shares["staleness"]  # a share with its interval
    assert table["tokens touched"].notna().all()
    charts = list(at.get("plotly_chart"))
    assert len(charts) == 2  # the mismatch and the run's own rule's blocked tokens
    for chart in charts:
        fig = json.loads(chart.proto.spec)
        names = {t["name"] for t in fig["data"]}
        assert {"staleness", "MoE routing disagreement"} <= names  # a legend entry per cause drawn
        assert all(t.get("text") for t in fig["data"])  # counts written on the bars
    assert set(tables[2]["check"]) >= {"cause_staleness", "cause_routing"}
    assert dict(zip(tables[2]["check"], tables[2]["verdict"], strict=True))["cause_staleness"] == "warn"


@pytest.mark.slow
def test_explain_page_says_what_a_cause_needs(monkeypatch, logdir):
    at = _page(monkeypatch, logdir, "bare")
    table = at.dataframe[0].value
    shares = dict(zip(table["cause"], table["share"], strict=True))
    assert shares["staleness"] == "not measurable: needs `policy_version`"
    assert shares["MoE routing disagreement"] == "not measurable: needs `routing_agreement`"


def test_chart_builder_draws_only_what_is_measured(logdir):
    got = explain(logdir, "bare", replicates=0).runs[0].as_dict()
    fig = shares_by_window(got["windows"])
    names = {t.name for t in fig.data}
    assert "staleness" not in names and "unexplained (numerics, the rest)" in names
    for trace in fig.data:
        assert len(trace.x) == len(got["windows"])
    totals = [sum(t.y[i] for t in fig.data) for i in range(len(got["windows"]))]
    assert totals == pytest.approx([1.0] * len(totals))



@pytest.mark.slow
def test_the_warning_badge_names_the_driving_cause(monkeypatch, tmp_path):
    """A run clean for five steps, then with stale responses, warns (the lines over 3 steps): the dashboard's
    warning line says it is driven by staleness."""
    from app import data
    from trustscope.early_warning import WarningLines

    write_run(tmp_path, "stale-late", InjectConfig(causes={"stale": 0.7}, steps=9, responses=8, length=16, onset=5,
                                                   seed=3))
    monkeypatch.setattr(data, "WARNING_LINES", WarningLines(window=3))
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path))
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/bad_updates.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    lines = [m.value for m in at.markdown] + [c.value for c in at.caption]
    warned = [line for line in lines if "stale-late" in line and "ollapse warning from step 5" in line]
    assert len(warned) == 1 and "; driven by staleness (" in warned[0], "\n".join(lines)
