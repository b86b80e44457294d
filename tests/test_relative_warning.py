"""The collapse warning against the run's own baseline (``WarningLines(relative_z=...)``): the same setting means
the same on runs whose mismatch is ten times the toy's or a tenth, where the absolute lines are always on or never."""

from __future__ import annotations

import pytest

from trustscope import report
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


def _warns(logdir, lines: report.WarningLines) -> dict[str, int]:
    with connect(logdir, cache=False) as db:
        runs = sorted(db.overview().steps["run_id"].unique())
        got = report.collapse_warnings(db, runs, lines)
    return got.groupby("run_id")["warning"].sum().astype(int).to_dict()


def test_relative_lines_stay_quiet_on_quiet_runs_and_fire_on_collapsing_ones_at_every_scale(logdir):
    warns = _warns(logdir, report.WarningLines(window=5, relative_z=6))
    for scale in SCALES:
        assert warns[f"quiet-x{scale:g}"] == 0, warns
        assert warns[f"collapse-x{scale:g}"] >= 3, warns


def test_the_absolute_lines_are_always_on_for_a_run_with_ten_times_the_mismatch(logdir):
    """What the relative lines fix: the quiet run at x10 sets off the absolute bad-rate line (and the detector)."""
    warns = _warns(logdir, report.WarningLines(window=5))
    assert warns["quiet-x10"] > 10 and warns["quiet-x0.1"] == 0


def test_relative_lines_are_refused_when_not_positive():
    with pytest.raises(ValueError, match="relative_z"):
        report.WarningLines(relative_z=0)


def test_the_live_warning_reads_the_relative_lines(logdir):
    with connect(logdir, cache=False) as db:
        got = report.collapse_warnings(db, ["collapse-x10"], report.WarningLines(window=5, relative_z=6))
    assert got["score"].isna().all()  # the detector's absolute weights are left out
    first = got[got["warning"]].iloc[0]
    warning = T.EarlyWarning(report.WarningLines(window=5, relative_z=6))
    text = warning.reason({f"{T.PREFIX}/warning/bad_rate_recent": first["bad_rate_recent"],
                           f"{T.PREFIX}/warning/mismatch_growth": first["mismatch_growth"],
                           f"{T.PREFIX}/warning/bad_rate_z": first["bad_rate_z"],
                           f"{T.PREFIX}/warning/mismatch_z": first["mismatch_z"]})
    assert "robust deviations above the run's first steps" in text
