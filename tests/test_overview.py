"""The overview (Runs page, report) reads the exact summaries table where a run has one, else the logged rows, and
says which: a run logged at token_fraction=0.1 shows the same overview numbers as the same run at 1.0."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from streamlit.testing.v1 import AppTest
from test_summaries import log_run, rollout

from app.launch import LOGDIR_ENV
from trustscope import db as tsdb
from trustscope import report, report_html
from trustscope.logger import TokenLogger

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"


def log_rows_only(logdir, run_id: str, fraction: float, steps: int = 3) -> None:
    """test_summaries' run without a summaries table (a logger with summaries off, as runs written before it)."""
    with TokenLogger(logdir, run_id, token_fraction=fraction, flush_rows=1, loss_rule="dppo_binary_tv",
                     summaries=False) as lg:
        for step in range(steps):
            tokens, mask, samples = rollout(step)
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("overview")
    log_run(logdir, "full", 1.0)
    log_run(logdir, "tenth", 0.1)
    log_rows_only(logdir, "rows", 0.1)
    log_rows_only(logdir, "rows_all", 1.0)
    return logdir


@pytest.fixture(scope="module")
def db(logdir, tmp_path_factory):
    with tsdb.connect(logdir, cache_dir=tmp_path_factory.mktemp("cache")) as conn:
        yield conn


@pytest.fixture(scope="module")
def overview(db):
    return db.overview()


def _array(values: object) -> np.ndarray:
    """A trace's values from a chart's JSON: a list, or plotly's typed array (``{"dtype", "bdata", "shape"}``)."""
    if isinstance(values, dict):
        flat = np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
        return flat.reshape([int(n) for n in str(values.get("shape", len(flat))).split(",")])
    return np.asarray(values)


def _run(df: pd.DataFrame, run_id: str) -> pd.DataFrame:
    return df[df["run_id"] == run_id].drop(columns="run_id").reset_index(drop=True)


def test_sources_say_exact_or_a_sample_of_the_rows(overview):
    sources = overview.sources.set_index("run_id")
    assert sources.loc["full", "exact"] and sources.loc["tenth", "exact"]
    assert not sources.loc["rows", "exact"] and not sources.loc["rows_all", "exact"]
    assert sources.loc["tenth", "source"] == "exact: every token (summaries table)"
    assert sources.loc["rows", "source"] == "from logged rows: a sample of 10% of tokens"
    assert sources.loc["rows_all", "source"] == "from logged rows (every token logged)"


def test_a_tenth_of_the_tokens_gives_the_same_overview_exactly(overview):
    pd.testing.assert_frame_equal(_run(overview.steps, "full"), _run(overview.steps, "tenth"), check_exact=True)
    pd.testing.assert_frame_equal(_run(overview.blocked, "full"), _run(overview.blocked, "tenth"), check_exact=True)
    # the logged-row fallback at 10% is a sample: it sees fewer tokens
    assert _run(overview.steps, "rows").n_tokens.sum() < 0.3 * _run(overview.steps, "full").n_tokens.sum()


def test_exact_figures_are_the_logged_rows_figures_at_full_logging(overview):
    """Same definitions both ways: at token_fraction 1 the summaries and the token rows give the same numbers."""
    exact, rows = _run(overview.steps, "full"), _run(overview.steps, "rows_all")
    for column in ("n_tokens", "n_positive", "n_negative", "n_zero_advantage", "n_nonzero_advantage",
                   "n_bad_negative", "n_trainer_blocked", "n_samples"):
        assert exact[column].tolist() == rows[column].tolist(), column
    for column in ("mismatch_mean", "mismatch_max", "prob_diff_min", "entropy_mean", "topk_tv_mean",
                   "bad_negative_rate", "trainer_blocked_frac", "reward_mean"):
        np.testing.assert_allclose(exact[column], rows[column], rtol=1e-5, err_msg=column)
    keys = ["step", "rule", "advantage_side"]
    both = _run(overview.blocked, "full").merge(_run(overview.blocked, "rows_all"), on=keys, suffixes=("", "_rows"))
    assert len(both) == len(_run(overview.blocked, "full")) and len(both) > 100
    assert (both.n_blocked == both.n_blocked_rows).all() and (both.n_tokens == both.n_tokens_rows).all()
    assert set(both.advantage_side) == {"all", "positive", "negative"}


def test_blocked_totals_add_counts_before_dividing(overview):
    totals = overview.blocked_totals({"full": "cfg", "tenth": "cfg"})
    one = overview.blocked_totals()
    cfg = totals[totals.run_id == "cfg"].set_index("rule")
    full = one[one.run_id == "full"].set_index("rule")
    assert (cfg.n_blocked == 2 * full.n_blocked).all() and (cfg.n_tokens == 2 * full.n_tokens).all()
    np.testing.assert_allclose(cfg.blocked_frac, full.n_blocked / full.n_tokens)


def test_report_reads_the_summaries_and_labels_the_fallback(db):
    reports = {r.run_id: r for r in report.build(db)}
    full, tenth, rows = reports["full"], reports["tenth"], reports["rows"]
    assert full.exact and tenth.exact and not rows.exact
    for name in ("n_tokens", "n_grad_tokens", "mismatch_last", "mismatch_max", "bad_negative_rate_mean",
                 "trainer_blocked_frac", "blocked_by_rule", "reward_first", "reward_last"):
        assert getattr(full, name) == getattr(tenth, name), name
    frac, n = full.blocked_by_rule["dppo_binary_tv"]
    assert frac == pytest.approx(n / full.n_grad_tokens) and n > 0
    assert rows.n_tokens < full.n_tokens and rows.source == "from logged rows: a sample of 10% of tokens"
    console = Console(record=True, width=100)
    console.print(report.render(list(reports.values())))
    text = console.export_text()
    assert "rows 10%" in text and "exact" in text
    assert f"of its {full.n_grad_tokens:,} tokens with A != 0 (exact: every token" in text


def test_html_report_captions_say_where_the_figures_come_from(db, tmp_path):
    captions = [caption for _, caption, _ in report_html.figures_for(db)]
    assert any("exact: every token (summaries table) for full, tenth" in c for c in captions)
    assert any("a sample of 10% of tokens for rows" in c for c in captions)
    page = report_html.write_html(db, tmp_path / "report.html").read_text()
    assert "from logged rows: a sample of 10% of tokens" in page


def test_runs_page_reads_the_overview(monkeypatch, logdir, db, overview):
    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    at = AppTest.from_file(str(MAIN), default_timeout=120)
    at.run()
    at.toggle(key="group_seeds").set_value(False).run()
    at.multiselect(key="run_id_picker").set_value(["full", "tenth", "rows"]).run()
    assert not at.exception, [e.message for e in at.exception]
    captions = " ".join(c.value for c in at.caption)
    assert "exact: every token (summaries table) for full, tenth" in captions
    assert "from logged rows: a sample of 10% of tokens for rows" in captions
    totals = next(d.value for d in at.dataframe if "dppo_binary_tv" in d.value.columns).set_index("run_id")
    expected = overview.blocked_totals().set_index(["run_id", "rule"])
    n, t = expected.loc[("full", "dppo_binary_tv"), ["n_blocked", "n_tokens"]]
    assert totals.loc["full", "dppo_binary_tv"] == totals.loc["tenth", "dppo_binary_tv"]
    assert totals.loc["full", "dppo_binary_tv"].endswith(f"({int(n):,} of {int(t):,})")
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    blocked = [c for c in charts if any(isinstance(t.get("meta"), dict) and "rule" in t["meta"] for t in c["data"])]
    assert len(blocked) == 1, f"{len(charts)} charts, {len(blocked)} of them by rule"
    traces = {(t["meta"]["rule"], int(_array(t["customdata"])[0][1])) for t in blocked[0]["data"] if t.get("meta")}
    assert ("dppo_binary_tv", int(_run(overview.steps, "full").n_nonzero_advantage[0])) in traces
