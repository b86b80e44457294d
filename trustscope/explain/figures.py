"""The dashboard's and the HTML report's chart of ``trustscope explain``: shares per cause, per window of steps.

A pure function of the JSON form (:meth:`trustscope.explain.analysis.RunExplanation.as_dict`), so tests call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from trustscope.explain.causes import CAUSES, UNEXPLAINED, cause

COLOURS = {"temperature": "#d62728", "truncation": "#ff7f0e", "position_shift": "#9467bd", "token_drift": "#8c564b",
           "staleness": "#1f77b4", "routing": "#2ca02c", UNEXPLAINED: "#b0b0b0"}
"""One colour per cause, the same on every chart."""
if set(COLOURS) != {c.source for c in CAUSES} | {UNEXPLAINED}:  # a cause added without a colour
    raise RuntimeError(f"explain.figures.COLOURS must name every cause: {sorted(COLOURS)}")


def _label(source: str) -> str:
    return "unexplained (numerics, the rest)" if source == UNEXPLAINED else cause(source).title


def shares_by_window(windows: Sequence[Mapping[str, Any]], what: str = "mismatch",
                     rule: str | None = None) -> go.Figure:
    """Stacked bars, one per window of steps: each cause's share of the window's mismatch (``rule`` None) or of the
    rule's blocked tokens, written on the bar with its count (the tokens the cause touches, or for a rule the
    blocked tokens allocated to it) and its interval on hover; one legend entry per cause. A cause that cannot be
    measured has no bar (the table beside says what it needs)."""
    fig = go.Figure()
    x = [f"steps {w['first_step']}-{w['last_step']}" for w in windows]
    per_window = [w["causes"] if rule is None else w["rules"].get(rule, {}).get("causes", []) for w in windows]
    unit, hover = ("tok", "tokens touched") if rule is None else ("blocked", "blocked tokens allocated")
    for source in COLOURS:
        shares, counts, lows, highs = [], [], [], []
        for causes in per_window:
            c = next((c for c in causes if c["source"] == source and c.get("measurable", True)), None)
            shares.append(c["share"] if c else 0.0)
            counts.append((c["tokens"] if rule is None else round(c["amount"])) if c else 0)
            lows.append(c["interval"][0] if c else 0.0)
            highs.append(c["interval"][1] if c else 0.0)
        if not any(shares):
            continue
        fig.add_trace(go.Bar(
            x=x, y=shares, name=_label(source), marker={"color": COLOURS[source]},
            text=[f"{s:.0%} ({n:,} {unit})" if s >= 0.04 else "" for s, n in zip(shares, counts, strict=True)],
            textposition="inside", customdata=list(zip(counts, lows, highs, strict=True)),
            hovertemplate=f"{_label(source)}<br>%{{x}}<br>share %{{y:.1%}} "
                          f"[%{{customdata[1]:.1%}}, %{{customdata[2]:.1%}}]<br>%{{customdata[0]:,}} {hover}"
                          "<extra></extra>"))
    title = f"Where the {what} comes from, by window of steps"
    fig.update_layout(barmode="stack", title={"text": title, "x": 0.0}, height=380,
                      yaxis={"title": "share", "tickformat": ".0%", "range": [0, 1]},
                      legend={"orientation": "h", "y": -0.2}, margin={"t": 50, "b": 40, "l": 60, "r": 20},
                      uniformtext={"minsize": 9, "mode": "hide"})
    return fig
