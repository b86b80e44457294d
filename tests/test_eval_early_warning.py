"""The early-warning study's judging: collapses, lead times, false alarms, and the published detector's SQL."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from studies import eval_early_warning as ew
from trustscope import db as tsdb
from trustscope.synthetic import SyntheticConfig, generate_run


def test_a_collapse_is_the_first_step_at_half_the_best_ten_step_mean():
    reward = [0.4] * 30 + [0.0] * 20  # the 10-step mean reaches 0.2 once five zero steps are in it
    steps = pd.DataFrame({"step": np.arange(50), "reward_mean": reward})
    assert ew.collapse_step(steps) == 34
    assert ew.collapse_step(steps.assign(reward_mean=0.4)) is None


def test_leads_and_false_alarms_are_counted_against_the_collapse():
    flags = pd.DataFrame({
        "run_id": ["a"] * 40 + ["b"] * 40,
        "step": [*range(40), *range(40)],
        "warning": ([False] * 5 + [True] * 2 + [False] * 13 + [True] * 3 + [False] * 17)  # a: episodes 5, 20
                   + ([False] * 10 + [True] + [False] * 29),  # b: one episode at 10, never collapses
    })
    out = ew.judge(flags, {"a": 30, "b": None})
    # a collapses at 30: the episode at 20 is within 20 steps (lead 10), the one at 5 is not (a false alarm)
    assert out == {"collapses": 1, "warned": 1, "median_lead": 10.0, "episodes": 3, "false_alarms": 2,
                   "runs_with_false_alarm": 2}
    assert ew.judge(flags, {"a": 3, "b": None})["episodes"] == 1  # a's episodes after its collapse are not counted


def test_the_fit_finds_a_planted_signal_and_the_published_sql_scores_as_the_weights_say(tmp_path):
    generate_run(tmp_path, "r", SyntheticConfig(tokens=3_000, steps=8))
    with tsdb.connect(tmp_path) as conn:
        signals = conn.sql("select * from early_signals order by step").to_pandas()
        weights, bias = {"ess_frac": -3.0, "mismatch_mean": 20.0}, 1.5
        scores = conn.sql(ew.detector_sql(weights, bias, 0.0)).to_pandas()
    assert signals.ess_frac.notna().all() and signals.ess_frac.between(0, 1).all()
    smooth = signals[["ess_frac", "mismatch_mean"]].rolling(ew.SMOOTH, min_periods=1).mean()
    expected = bias + weights["ess_frac"] * smooth.ess_frac + weights["mismatch_mean"] * smooth.mismatch_mean
    np.testing.assert_allclose(scores.score, expected, rtol=1e-12)
    assert not scores.warning.iloc[: ew.SMOOTH - 1].any()  # no warning before SMOOTH steps

    rng = np.random.default_rng(0)
    rows = pd.DataFrame({s: rng.normal(size=400) for s in ew.SIGNALS})
    rows["y"] = (rows.grad_norm + 0.3 * rng.normal(size=400) > 0.8).astype(float)
    fitted, _, path = ew.fit_detector(rows)
    assert path[0][0] == "grad_norm" and fitted["grad_norm"] > 0


def test_bad_shard_is_refused():
    with pytest.raises(SystemExit, match="--shard"):
        import sys

        argv, sys.argv = sys.argv, ["eval_early_warning.py", "sweep", "--shard", "2/2", "--dry-run"]
        try:
            ew.main()
        finally:
            sys.argv = argv
