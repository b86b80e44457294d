"""The collapse warning names the cause that drives it: runs whose mismatch rises partway through from one injected
cause (stale tokens, re-tokenized histories) warn, and the warning's line names that cause, through the report too;
a run that never warns is named nothing."""

from __future__ import annotations

import pytest

from trustscope.db import connect
from trustscope.early_warning import WarningLines, collapse_warnings, first_warnings
from trustscope.explain.analysis import Scope, Share
from trustscope.explain.causes import CAUSES, UNEXPLAINED
from trustscope.explain.inject import InjectConfig, write_run
from trustscope.explain.warning import driving_cause, name_causes, warning_causes

WINDOW = 3
RUNS = {"stale-late": ({"stale": 0.7}, "staleness"), "drift-late": ({"drift": 0.7}, "token_drift"), "clean": ({}, None)}
"""run -> (causes switched on at step 5 of 9, the cause its warning must name; None: it never warns)."""


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("warned")
    for run_id, (causes, _) in RUNS.items():
        write_run(root, run_id, InjectConfig(causes=causes, steps=9, responses=8, length=16, onset=5, seed=3))
    return root


@pytest.fixture(scope="module")
def warned(logdir):
    with connect(logdir, cache=False) as db:
        warnings = collapse_warnings(db, list(RUNS), WarningLines(window=WINDOW), detector=None)
        return warnings, warning_causes(db, warnings, WINDOW)


def test_the_warning_names_the_injected_cause(warned):
    warnings, causes = warned
    firsts = first_warnings(warnings)
    assert set(firsts) == {r for r, (_, want) in RUNS.items() if want}  # the clean run never warns
    for run_id, (_, want) in RUNS.items():
        if want is None:
            assert run_id not in causes
            continue
        got = causes[run_id]
        assert (got.source, got.rose) == (want, True), got
        assert got.step == int(warnings[(warnings.run_id == run_id) & warnings.warning].step.min())
        assert got.after > got.before  # its mismatch per token rose over the warning's window
        assert got.warned[1] == got.step and got.baseline[0] == 0
        line = name_causes(firsts, causes)[run_id]
        assert line.startswith(firsts[run_id]) and f"driven by {_title(want)}" in line


def _title(source: str) -> str:
    return next(c.title for c in CAUSES if c.source == source)


def _scope(amounts: dict[str, float], tokens: int = 100) -> Scope:
    shares = [Share(s, a / max(sum(amounts.values()), 1e-12), 0, 0, 10, a) for s, a in amounts.items()]
    return Scope(0, 2, tokens, tokens, sum(amounts.values()) / tokens, 0.0, None, shares)


def test_the_rise_names_the_cause_not_the_largest_share():
    """Routing carries the most in both windows, but staleness is what rose: staleness drives the warning; where
    nothing rose the largest share is named and the sentence says the mismatch is not rising."""
    before = _scope({"routing": 5.0, "staleness": 0.0, UNEXPLAINED: 1.0})
    after = _scope({"routing": 5.0, "staleness": 2.0, UNEXPLAINED: 1.0})
    got = driving_cause("r", 5, before, after)
    assert (got.source, got.rose, got.before, got.after) == ("staleness", True, 0.0, 0.02)
    assert got.sentence().startswith("driven by staleness")
    level = driving_cause("r", 5, after, after)
    assert (level.source, level.rose) == ("routing", False) and "not rising" in level.sentence()
    numerics = driving_cause("r", 5, before, _scope({"routing": 5.0, "staleness": 0.0, UNEXPLAINED: 4.0}))
    assert numerics.source == UNEXPLAINED and "no known cause" in numerics.sentence()


def test_a_causeless_line_is_left_as_it_is():
    assert name_causes({"a": "collapse warning from step 3 (x)"}, {}) == {"a": "collapse warning from step 3 (x)"}
    with pytest.raises(ValueError, match="window=0"):
        warning_causes(None, None, 0)


def test_the_report_line_names_the_cause(logdir):
    from trustscope import report

    with connect(logdir, cache=False) as db:
        reports = {r.run_id: r for r in report.build(db, WarningLines(window=WINDOW))}
    for run_id, (_, want) in RUNS.items():
        if want is not None:
            assert f"driven by {_title(want)}" in reports[run_id].collapse_warning
