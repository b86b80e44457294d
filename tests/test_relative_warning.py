"""The collapse warning against the run's own baseline (``WarningLines(relative_z=...)``): the same setting means
the same on runs whose mismatch is ten times the toy's or a tenth, where the absolute lines are always on or never."""

from __future__ import annotations

import pytest

from trustscope import early_warning
from trustscope import trackers as T
from trustscope.db import connect
from trustscope.synthetic import SyntheticConfig, generate_run

SCALES = (0.1, 10.0)
"""Mismatch scales against the synthetic toy's (SyntheticConfig.mismatch = 0.03)."""


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """Per scale a quiet run (pi stays at pi_old) and a collapsing one (pi drifts away from pi_old, more each
    step), 30 steps each."""
    root = tmp_path_factory.mktemp("relative")
    for scale in SCALES:
        for name, drift in (("quiet", 0.0), ("collapse", 3.0)):
            generate_run(root, f"{name}-x{scale:g}", SyntheticConfig(
                tokens=15_000, steps=30, edge_cases=False, loss_rule="pg_is", mismatch=0.03 * scale, drift=drift,
                seed=int(scale * 10)))
    return root


def _warns(logdir, lines: early_warning.WarningLines) -> dict[str, int]:
    with connect(logdir, cache=False) as db:
        runs = sorted(db.overview().steps["run_id"].unique())
        got = early_warning.collapse_warnings(db, runs, lines)
    return got.groupby("run_id")["warning"].sum().astype(int).to_dict()


def test_relative_lines_stay_quiet_on_quiet_runs_and_fire_on_collapsing_ones_at_every_scale(logdir):
    warns = _warns(logdir, early_warning.WarningLines(window=5, relative_z=6))
    for scale in SCALES:
        assert warns[f"quiet-x{scale:g}"] == 0, warns
        assert warns[f"collapse-x{scale:g}"] >= 3, warns


def test_the_absolute_lines_are_always_on_for_a_run_with_ten_times_the_mismatch(logdir):
    """What the relative lines fix: the quiet run at x10 sets off the absolute bad-rate line (and the detector)."""
    warns = _warns(logdir, early_warning.WarningLines(window=5))
    assert warns["quiet-x10"] > 10 and warns["quiet-x0.1"] == 0


def test_relative_lines_are_refused_when_not_positive():
    with pytest.raises(ValueError, match="relative_z"):
        early_warning.WarningLines(relative_z=0)


def test_the_live_warning_reads_the_relative_lines(logdir):
    with connect(logdir, cache=False) as db:
        got = early_warning.collapse_warnings(db, ["collapse-x10"], early_warning.WarningLines(window=5, relative_z=6))
    assert got.attrs["detector"] is early_warning.RELATIVE_DETECTOR  # the absolute weights give way to the relative fit
    assert not got["warn_score"].iloc[:early_warning.RELATIVE_DETECTOR.baseline].any()  # never within its baseline
    first = got[got["warning"]].iloc[0]
    warning = T.EarlyWarning(early_warning.WarningLines(window=5, relative_z=6))
    text = warning.reason({f"{T.PREFIX}/warning/bad_rate_recent": first["bad_rate_recent"],
                           f"{T.PREFIX}/warning/mismatch_growth": first["mismatch_growth"],
                           f"{T.PREFIX}/warning/bad_rate_z": first["bad_rate_z"],
                           f"{T.PREFIX}/warning/mismatch_z": first["mismatch_z"]})
    assert "robust deviations above the run's first steps" in text


def test_a_relative_detector_reads_a_run_the_same_at_any_scale_and_waits_for_its_baseline():
    """Inputs in the run's own terms: a run whose signals are all ten times (or a tenth of) another's scores the
    same, step by step, where the same weights on absolute inputs warn on one and not the other; no step of the
    baseline warns."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    steps = np.arange(40)
    drift = np.where(steps >= 25, (steps - 24) * 0.2, 0.0)  # quiet for 25 steps, then rising
    run = pd.DataFrame({"step": steps, "mismatch_mean": 0.01 * (1 + 0.05 * rng.standard_normal(40) + drift),
                        "entropy_mean": 0.1 * (1 + 0.05 * rng.standard_normal(40) + drift)})
    relative = early_warning.Detector(weights=(("mismatch_mean", 0.5), ("entropy_mean", 0.5)), bias=0.0, threshold=3.0,
                               baseline=10)
    score, warn = relative.score(run)
    assert not warn[:10].any() and warn[30:].all() and not warn[10:25].any()
    for scale in (0.1, 10.0):
        scaled = run.assign(mismatch_mean=run.mismatch_mean * scale, entropy_mean=run.entropy_mean * scale)
        other, other_warn = relative.score(scaled)
        assert np.allclose(other, score) and (other_warn == warn).all()
    absolute = early_warning.Detector(weights=relative.weights, bias=0.0, threshold=0.05)
    loud = absolute.score(run.assign(mismatch_mean=run.mismatch_mean * 10, entropy_mean=run.entropy_mean * 10))[1]
    assert loud[absolute.window - 1:].all()  # every step from its first full window
    assert not absolute.score(run.assign(mismatch_mean=run.mismatch_mean / 10,
                                         entropy_mean=run.entropy_mean / 10))[1].any()


def test_the_live_relative_warning_scores_the_relative_detector_as_the_report_does():
    """Step by step from a step's metrics, the entropy among them, the relative mode's live warning keeps the
    detector's whole baseline (longer than the lines' window here) and scores :data:`early_warning.RELATIVE_DETECTOR`
    as the report does over every step of the run; its reason names that detector."""
    import numpy as np
    import pandas as pd

    from trustscope.db import Overview
    from trustscope.query.analyses import OVERVIEW_COLUMNS

    rng = np.random.default_rng(3)
    lines = early_warning.WarningLines(window=4, relative_z=6)
    warning, got, rows = T.EarlyWarning(lines), [], []
    assert warning.detector is early_warning.RELATIVE_DETECTOR
    for step in range(40):
        entropy = 0.5 * (1 + 0.03 * rng.standard_normal() + (0.08 * (step - 24) if step >= 25 else 0.0))
        mismatch = 0.01 * (1 + 0.03 * rng.standard_normal())
        metrics = {f"{T.PREFIX}/step": float(step), f"{T.PREFIX}/tokens/total": 500.0,
                   f"{T.PREFIX}/bad_negative_count": 0.0, f"{T.PREFIX}/bad_negative_rate": 0.0,
                   f"{T.PREFIX}/mismatch/abs_mean": mismatch, f"{T.PREFIX}/entropy/mean": entropy}
        got.append(warning.update(metrics))
        rows.append({"run_id": "run", "step": step, "n_tokens": 500.0, "n_bad_negative": 0.0, "reward_mean": 0.5,
                     "bad_negative_rate": 0.0, "mismatch_mean": mismatch, "entropy_mean": entropy})
    steps = pd.DataFrame(rows).reindex(columns=list(dict.fromkeys([*OVERVIEW_COLUMNS, "entropy_mean"])))
    want = early_warning.collapse_warnings(Overview(steps, pd.DataFrame(), pd.DataFrame()), ["run"], lines)
    assert want.attrs["detector"] is early_warning.RELATIVE_DETECTOR
    np.testing.assert_allclose([g[f"{T.PREFIX}/warning/score"] for g in got][early_warning.RELATIVE_DETECTOR.baseline:],
                               want["score"].iloc[early_warning.RELATIVE_DETECTOR.baseline:], rtol=1e-9)
    assert [g[f"{T.PREFIX}/warning"] for g in got] == want["warning"].astype(float).tolist()
    first = int(want["warn_score"].to_numpy().argmax())
    assert want["warn_score"].any() and first > early_warning.RELATIVE_DETECTOR.baseline  # the entropy rise, not before
    assert "each against the run's first 10 steps" in warning.reason(got[first])
    assert "entropy" in warning.reason(got[first])
