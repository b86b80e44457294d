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

from dataclasses import dataclass
from typing import Any

from trustscope.explain.analysis import Scope, Share, explain
from trustscope.explain.causes import UNEXPLAINED


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


def warning_causes(db: Any, warnings: Any, window: int) -> dict[str, WarningCause]:
    """run_id -> what drives its collapse warning, for each run of ``warnings`` (rows of
    :func:`~trustscope.early_warning.collapse_warnings`) that warns and has token rows to explain (a run without
    them is left out: nothing to name). ``window``: the warning lines' steps (:class:`WarningLines.window`)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"warning_causes: window={window!r} must be a whole number of steps >= 1")
    from trustscope.db import LogDB, connect
    from trustscope.doctor import run_manifests

    if not isinstance(db, LogDB):
        with connect(db, cache=False) as opened:
            return warning_causes(opened, warnings, window)
    warned = warnings[warnings["warning"].astype(bool)]
    known = run_manifests(db)
    steps = {str(r): int(s) for r, s in warned.groupby("run_id")["step"].min().items() if str(r) in known}
    if not steps:
        return {}
    baselines = {r.run_id: r.windows[0] for r in explain(db, sorted(steps), window=window, replicates=0).runs}
    out = {}
    for run_id, baseline in baselines.items():
        start = max(steps[run_id] - window + 1, baseline.first_step)
        late = explain(db, [run_id], window=window, first_step=start, replicates=0).runs
        if late:
            out[run_id] = driving_cause(run_id, steps[run_id], baseline, late[0].windows[0])
    return out


def name_causes(first: dict[str, str], causes: dict[str, WarningCause]) -> dict[str, str]:
    """:func:`~trustscope.early_warning.first_warnings`' lines with each run's driving cause appended."""
    return {run_id: f"{line}; {causes[run_id].sentence()}" if run_id in causes else line
            for run_id, line in first.items()}
