"""The collapse warning's cause: when a run's collapse early warning fires, which known cause drives its mismatch.

For each warned run (rows of :func:`trustscope.early_warning.collapse_warnings`), :func:`warning_causes` explains
two windows of ``window`` steps (the warning's own lines' window): the run's first (the baseline the lines compare
against) and the one ending at the first warning step. Each cause's mismatch per logged token is its Shapley amount
(:mod:`trustscope.explain.allocate`) over the window's logged tokens; the cause whose figure rose the most from the
baseline to the warning is the one that drives it. Where none rose (the warning came from the bad-update rate or
the fitted score while the mismatch stayed level), the cause carrying the largest share of the warning window's
mismatch is named instead, and the sentence says so. The unexplained remainder competes like a cause: a warning
whose rise no detector sees names it ("no known cause").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trustscope.explain.analysis import Scope, Share, Thresholds, _scope
from trustscope.explain.causes import CAUSES, UNEXPLAINED


@dataclass(frozen=True)
class WarningCause:
    """What drives one run's collapse warning."""

    run_id: str
    step: int
    """The first warning step."""
    source: str
    """The driving cause (a :data:`~trustscope.explain.causes.CAUSES` source), or ``unexplained``."""
    rose: bool
    """Whether the cause's mismatch rose from the baseline window to the warning's (else: the largest share)."""
    before: float
    """The cause's mismatch over the baseline window, nats per logged token."""
    after: float
    """... and over the warning's window."""
    share: float
    """Its share of the mismatch over the warning's window."""
    tokens: int
    """The logged tokens of the warning's window it touches."""
    baseline: tuple[int, int]
    warned: tuple[int, int]

    def sentence(self) -> str:
        """One clause for the warning's line."""
        from trustscope.explain.render import title

        name = ("no known cause: the unexplained rest (numerics, what no detector sees)" if self.source == UNEXPLAINED
                else title(self.source))
        figures = (f"{self.before:.3g} -> {self.after:.3g} nats/token from steps {self.baseline[0]}-{self.baseline[1]}"
                   f" to {self.warned[0]}-{self.warned[1]}, {self.share:.0%} of the mismatch there, "
                   f"{self.tokens:,} tokens")
        if self.rose:
            return f"driven by {name} ({figures}; trustscope explain)"
        return (f"mismatch not rising; the largest part is {name} ({figures}; trustscope explain)")

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "step": self.step, "source": self.source, "rose": self.rose,
                "before": self.before, "after": self.after, "share": self.share, "tokens": self.tokens,
                "baseline": list(self.baseline), "warned": list(self.warned)}


def _per_token(scope: Scope) -> dict[str, Share]:
    return {s.source: s for s in scope.causes if s.measurable}


def driving_cause(run_id: str, step: int, baseline: Scope, warned: Scope) -> WarningCause:
    """The cause whose mismatch per logged token rose the most from ``baseline`` to ``warned`` (ties: the earlier
    in :data:`~trustscope.explain.causes.CAUSES`, the remainder last); where none rose, the largest share of
    ``warned``."""
    before, after = _per_token(baseline), _per_token(warned)
    n_before, n_after = max(baseline.tokens_logged, 1), max(warned.tokens_logged, 1)

    def level(shares: dict[str, Share], source: str, n: int) -> float:
        return shares[source].amount / n if source in shares else 0.0

    rise = {s: level(after, s, n_after) - level(before, s, n_before) for s in after}
    top = max(rise, key=lambda s: rise[s])  # max keeps the first of equals: the declared order
    rose = rise[top] > 0
    if not rose:
        top = max(after, key=lambda s: after[s].share)
    got = after[top]
    return WarningCause(run_id, step, top, rose, level(before, top, n_before), level(after, top, n_after),
                        got.share, got.tokens, (baseline.first_step, baseline.last_step),
                        (warned.first_step, warned.last_step))


def warning_causes(db: Any, warnings: Any, window: int, thresholds: Thresholds | None = None) -> dict[str, WarningCause]:
    """run_id -> what drives its collapse warning, for each run of ``warnings`` (rows of
    :func:`~trustscope.early_warning.collapse_warnings`) that warns and has token rows to explain (a run without
    them is left out: nothing to name). ``window``: the warning lines' steps (:class:`WarningLines.window`): the
    baseline is the run's first ``window`` logged steps, the warning's window the ``window`` logged steps ending at
    its first warning step. One ``explain_patterns`` query for every warned run; the allocation of each window as
    :func:`~trustscope.explain.analysis.explain` makes it (no bootstrap: the point shares)."""
    from trustscope.db import LogDB, connect

    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"warning_causes: window={window!r} must be a whole number of steps >= 1")
    if not isinstance(db, LogDB):
        with connect(db, cache=False) as opened:
            return warning_causes(opened, warnings, window, thresholds)
    warned = warnings[warnings["warning"].astype(bool)]
    steps = {str(r): int(s) for r, s in warned.groupby("run_id")["step"].min().items()}
    if not steps:
        return {}
    patterns = db.query("explain_patterns", run_ids=sorted(steps), first_step=None,
                        last_step=max(steps.values()),  # the windows end at the first warning step: read no further
                        **asdict(thresholds or Thresholds()))
    out = {}
    for run_id, rows in patterns.groupby("run_id", sort=True):
        run_id = str(run_id)
        logged = np.sort(rows["step"].unique())
        unmeasured = {c.source: "not measurable" for c in CAUSES if rows[c.column].isna().all()}
        upto = logged[logged <= steps[run_id]]
        out[run_id] = driving_cause(run_id, steps[run_id], _steps_scope(rows, logged[:window], unmeasured),
                                    _steps_scope(rows, upto[-window:], unmeasured))
    return out


def _steps_scope(rows: Any, chosen: np.ndarray, unmeasured: dict[str, str]) -> Scope:
    """The mismatch of ``rows`` (``explain_patterns``) over the steps ``chosen`` allocated to the causes."""
    import pandas as pd

    part = rows[rows["step"].isin(chosen)].assign(n_signed=0)  # no rule: nothing blocked to allocate
    no_totals = pd.DataFrame({"metric": pd.Series(dtype=str), "count": pd.Series(dtype="int64"),
                              "sum": pd.Series(dtype=float), "rule": pd.Series(dtype=str)})
    return _scope(part, part, {}, no_totals, int(chosen[0]), int(chosen[-1]), unmeasured, 0, 0)


def name_causes(first: dict[str, str], causes: dict[str, WarningCause]) -> dict[str, str]:
    """:func:`~trustscope.early_warning.first_warnings`' lines with each run's driving cause appended."""
    return {run_id: f"{line}; {causes[run_id].sentence()}" if run_id in causes else line
            for run_id, line in first.items()}
