"""``trustscope explain`` as text (80 columns) and as JSON; the report's section reads the same lines."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from trustscope.explain.analysis import INTERVAL, METHOD, Explanation, RunExplanation, Scope, Share
from trustscope.explain.causes import UNEXPLAINED, cause


def title(source: str) -> str:
    return "unexplained (numerics, the rest)" if source == UNEXPLAINED else cause(source).title


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def share_lines(shares: Sequence[Share], unit: str, indent: str = "  ",
                measured: Mapping[str, float] | None = None) -> list[str]:
    """One line per cause: title, share, interval, the tokens it touches and its amount, and with ``measured``
    (the trainer's recompute, :attr:`Scope.measured`) the measured share beside them; a cause that cannot be
    measured says what it needs instead of a number."""
    head = f"{indent}{'cause':<34}{'share':>7}  {'95% interval':<15}{'tokens':>9}  {unit}"
    lines = [head + (f"  {'measured':>8}" if measured else "")]
    for s in shares:
        if not s.measurable:
            lines.append(f"{indent}{title(s.source):<34}{s.note}")
            continue
        interval = f"[{100 * s.low:.1f}, {100 * s.high:.1f}]"
        line = f"{indent}{title(s.source):<34}{_pct(s.share):>7}  {interval:<15}{s.tokens:>9,}  {s.amount:,.4g}"
        if measured:
            line = f"{line:<{len(head)}}  {_pct(measured.get(s.source, 0.0)):>8}"
        lines.append(line)
    return lines


def _top(shares: Sequence[Share], n: int = 2) -> str:
    ranked = sorted((s for s in shares if s.measurable), key=lambda s: -s.share)[:n]
    return ", ".join(f"{title(s.source)} {100 * s.share:.0f}% ({s.tokens:,} tok)" for s in ranked)


def _scope_head(s: Scope) -> list[str]:
    exact = "exact over every token" if s.tokens != s.tokens_logged else "over every token"
    kl = "n/a" if math.isnan(s.kl_k3) else f"{s.kl_k3:.4g}"
    return [f"  steps {s.first_step}-{s.last_step}: {s.tokens:,} tokens ({s.tokens_logged:,} logged)",
            f"  mismatch: mean |log pi - log mu| {s.mismatch:.4g} nats over the logged tokens; KL k3 {kl} ({exact})"]


def run_lines(r: RunExplanation, rules: Sequence[str] | None = None) -> list[str]:
    """A run's explanation: the totals, the mismatch's causes, each asked-for rule's blocked tokens by cause (default:
    the run's own rule), and a line per window with its two largest shares."""
    lines = [f"run {r.run_id}", *_scope_head(r.run), "  where the mismatch comes from:",
             *share_lines(r.run.causes, "nats", "    ", r.run.measured)]
    if r.run.measured:
        lines.append("    measured: pi recomputed by the trainer with each cause removed (train --explain-tokens; "
                     "numerics in unexplained)")
    wanted = list(rules) if rules else [r.loss_rule] if r.loss_rule else []
    for rule in wanted:
        got = r.run.rules.get(rule)
        if got is None:
            lines.append(f"  blocked by {rule}: no SQL mask for this rule, nothing to allocate")
            continue
        lines.append(f"  blocked by {rule}{' (the run trains with it)' if rule == r.loss_rule else ''}: "
                     f"{got['blocked']:,} tokens ({got['blocked_logged']:,} logged)")
        if got["blocked_logged"]:
            lines += share_lines(got["causes"], "blocked", "    ")
    lines.append(f"  by window of {r.window} step(s): mismatch, largest shares")
    for w in r.windows:
        lines.append(f"    steps {w.first_step}-{w.last_step}: {w.mismatch:.4g} nats; {_top(w.causes)}")
    return lines


def text(e: Explanation, rules: Sequence[str] | None = None) -> str:
    lines = []
    for r in e.runs:
        lines += [*run_lines(r, rules), ""]
    for par in e.parity:  # the numerics floor, measured before the run by trustscope parity
        lines.append(parity_line(par))
    lines += [f"method: {METHOD}.", f"interval: {INTERVAL}, {e.replicates} replicates.",
              "docs/explain.md says what each cause's indicator reads and where it falls short."]
    return "\n".join(lines)


def parity_line(par: dict) -> str:
    """One ``trustscope parity`` run's numerics floor, for the text: where the run's engine and trainer settings
    match, the ``unexplained`` share is read against it."""
    mean = par.get("mean_abs_log_ratio")
    full = (f"; whole distributions at {par['full_positions']:,} positions: TV mean {par['full_tv_mean']:.3g}, "
            f"KL mean {par['full_kl_mean']:.3g}" if par.get("full_tv_mean") is not None else "")
    return (f"numerics floor (trustscope parity, run {par['run_id']}: engine {par.get('engine')} "
            f"{par.get('engine_dtype')} against the trainer's {par.get('trainer_dtype')} forward): mean |log pi - "
            f"log mu| {mean:.3g} nats" if mean is not None else f"numerics floor (trustscope parity, run "
            f"{par['run_id']})") + full + "; unexplained is read against it where the settings match."


def to_json(e: Explanation) -> str:
    """The explanation as JSON: NaN (a figure that cannot be computed) as null."""
    return json.dumps(_clean(e.as_dict()), indent=1, default=str, allow_nan=False)


def _clean(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def report_lines(e: Explanation, shown: int = 3) -> list[str]:
    """The terminal report's section: per run, its mismatch and the ``shown`` largest shares with their token
    counts, then the causes it cannot measure and what they need."""
    lines = []
    for r in e.runs:
        ranked = sorted((c for c in r.run.causes if c.measurable and c.share > 0), key=lambda c: -c.share)[:shown]
        lines.append(f"{r.run_id}: {r.run.mismatch:.4g} nats; "
                     + ", ".join(f"{title(c.source)} {100 * c.share:.0f}% ({c.tokens:,} tok)" for c in ranked))
        if r.run.measured:
            top = sorted(((v, k) for k, v in r.run.measured.items() if v > 0), reverse=True)[:shown]
            lines.append("  measured by the trainer: " + ", ".join(f"{title(k)} {100 * v:.0f}%" for v, k in top))
        absent = [f"{title(c.source)} ({c.note.removeprefix('not measurable: ')})" for c in r.run.causes
                  if not c.measurable]
        if absent:
            lines.append("  not measurable: " + ", ".join(absent))
    return lines


def explain_section(db: Any, data: Any) -> Any:
    """The report's section (``trustscope.report.add_section``): where each reported run's mismatch comes from, the
    largest shares without intervals (``trustscope explain`` gives them); None without runs."""
    from rich.console import Group
    from rich.text import Text

    from trustscope.explain.analysis import explain

    run_ids = [r.run_id for r in getattr(data, "reports", [])]
    if not run_ids:
        return None
    found = explain(db, run_ids, replicates=0)
    head = Text("Where the mismatch comes from (mean |log pi - log mu| by cause; trustscope explain for intervals, "
                "windows and each rule's blocked tokens)", style="bold")
    return Group(head, *(Text(line) for line in report_lines(found)))
