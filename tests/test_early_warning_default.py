"""The default collapse warning: the detector fitted in docs/experiments.md where a run's logs carry its signals,
the bad-rate and mismatch-growth lines elsewhere; the same in the report, the dashboard's badge and the live
tracker metric, and the same numbers as the SQL the docs publish."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from trustscope import early_warning
from trustscope import trackers as T
from trustscope.db import connect
from trustscope.synthetic import SyntheticConfig, generate_run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run logged with the importance-weight summaries: 12 steps, mismatch growing (the detector's inputs move)."""
    logdir = tmp_path_factory.mktemp("warn")
    generate_run(logdir, "live", SyntheticConfig(tokens=6_000, steps=12, edge_cases=False, loss_rule="pg_is",
                                                 seed=3))
    return logdir


def published_sql() -> str:
    """The "All signals" detector's query as docs/experiments.md publishes it."""
    text = (ROOT / "docs" / "experiments.md").read_text()
    section = text.split("All signals:", 1)[1]
    return re.search(r"```sql\n(.*?)```", section, re.S).group(1)


def test_the_default_is_the_published_detector(run):
    with connect(run) as db:
        got = early_warning.collapse_warnings(db, ["live"])
        want = db.sql(published_sql()).to_pandas()
    both = got.merge(want, on=["run_id", "step"], suffixes=("", "_sql"))
    assert len(both) == len(got) == 12 and got["score"].notna().all()
    np.testing.assert_allclose(both["score"], both["score_sql"], rtol=0, atol=1e-9)
    assert both["warn_score"].tolist() == both["warning_sql"].astype(bool).tolist()
    assert not got["warn_score"].iloc[:early_warning.DETECTOR.window - 1].any()  # a full window before it can warn
    # the lines stay beside it: a step warns by either
    assert got["warning"].tolist() == (got["warn_score"] | got["warn_bad_rate"] | got["warn_mismatch"]).tolist()


def test_runs_without_the_signals_keep_the_lines(legacy_logs):
    """A run logged before the importance-weight summaries (tests/data/legacy): the lines decide, as they did."""
    with connect(legacy_logs) as db:
        runs = sorted(db.overview().steps["run_id"].unique())
        got = early_warning.collapse_warnings(db, runs)
        lines = early_warning.collapse_warnings(db, runs, detector=None)
    assert got["score"].isna().all() and not got["warn_score"].any()
    assert got["warning"].tolist() == lines["warning"].tolist() and got["warning"].any()
    assert early_warning.first_warnings(got) == early_warning.first_warnings(lines)


def test_a_run_that_warns_says_so_in_the_detectors_words(run):
    low = early_warning.Detector(weights=early_warning.DETECTOR.weights, bias=early_warning.DETECTOR.bias, threshold=-1e9)
    with connect(run) as db:
        always = early_warning.collapse_warnings(db, ["live"], detector=low)
        never = early_warning.collapse_warnings(db, ["live"], detector=early_warning.Detector(
            weights=early_warning.DETECTOR.weights, bias=early_warning.DETECTOR.bias, threshold=1e9))
    assert always["warn_score"].tolist() == [False] * 4 + [True] * 8 and not never["warn_score"].any()
    text = early_warning.first_warnings(always, low)["live"]
    assert text.startswith("collapse warning from step 4 (early-warning score") and "ESS of pi/mu" in text


def test_the_bad_rate_line_warns_where_the_detector_extrapolates_low():
    """Far outside the fitted runs (half of every step's tokens bad updates) the detector's negative weight on the
    bad-update rate holds its score down; the bad-rate line beside it still warns."""
    import pandas as pd

    from trustscope.db import Overview

    steps = pd.DataFrame({"run_id": "r", "step": range(12), "n_tokens": 100.0, "reward_mean": 0.5,
                          "n_bad_negative": [0.0] * 6 + [50.0] * 6, "mismatch_mean": 0.02,
                          "log_ratio_std": [0.1] * 6 + [1.4] * 6, "ess_frac": [0.99] * 6 + [0.3] * 6,
                          "bad_negative_rate": [0.0] * 6 + [0.5] * 6})
    got = early_warning.collapse_warnings(Overview(steps, pd.DataFrame(), pd.DataFrame()), ["r"])
    assert not got["warn_score"].any() and got["warn_bad_rate"].iloc[-1] and got["warning"].iloc[-1]


def test_the_live_tracker_warning_reads_as_the_report(run):
    """Step by step from the committed summaries rows, as an integration reports it: the same score and warning
    as the report over the whole run."""
    with connect(run) as db:
        want = early_warning.collapse_warnings(db, ["live"])
    assert want["score"].notna().all()
    warning, got = T.EarlyWarning(), []
    for step in range(12):
        got.append(warning.update(T.step_metrics(T.committed_step_rows(run / "live", step), step)))
    np.testing.assert_allclose([g[f"{T.PREFIX}/warning/score"] for g in got], want["score"], rtol=1e-9, atol=1e-9)
    assert [g[f"{T.PREFIX}/warning"] for g in got] == want["warning"].astype(float).tolist()
    if want["warn_score"].any():
        assert "early-warning score" in warning.reason(got[int(want["warn_score"].to_numpy().argmax())])
