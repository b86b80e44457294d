"""Plotly figure builders shared by the dashboard and ``trustscope report``: pure functions from DataFrames.

Nothing here touches Streamlit, DuckDB or the file system, so every chart can be built and checked in a unit test.
Each builder names the columns it reads in its docstring; the query layer's views provide them.

Conventions every builder follows, so a chart reads the same wherever it appears:

- one colour per rule (:func:`rule_colour`), legends in the registry's order (:func:`rule_order`); the rule the
  trainer applied is drawn thicker and its legend entry says so (:data:`APPLIED_MARK`);
- log axes tick at 1, 2 and 5 x 10^k only, labelled as plain numbers (:func:`log_axis`); no axis uses SI prefixes;
- rates and fractions are percentages starting at 0 (:func:`percent_axis`); counts are integers (:func:`count_axis`);
- every trace drawn for a rule carries ``meta={"rule": name}``, so a check can read which rule a colour stands for.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from trustscope.losses import list_losses

RULE_PALETTE = ("#1F77B4", "#D62728", "#2CA02C", "#FF7F0E", "#9467BD", "#8C564B", "#E377C2", "#7F7F7F",
                "#BCBD22", "#17BECF", "#393B79", "#000000", "#E7BA52", "#843C39", "#7B4173", "#3182BD",
                "#31A354", "#756BB1", "#636363", "#E6550D", "#969696", "#FD8D3C", "#A55194", "#6B6ECF")
"""Rule colours, assigned in registry order (:func:`rule_colour`): neighbours in the registry differ in hue."""
SERIES_PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D", "#EECA3B",
                  "#FF9DA6", "#BAB0AC")
"""Colours of runs (or seed groups) when they are not told apart by their rule."""
BUCKET_PALETTE = ("#440154", "#3B528B", "#21918C", "#5EC962", "#C8A400", "#E16A1E")
"""mu buckets, lowest probability first (a dark-to-bright ramp, so the order reads off the colour)."""
BLOCKED_COLOUR = "#E45756"
ALERT_COLOUR = "#C62828"
COLOUR_BY = ("ratio", "tv", "advantage", "blocked")
APPLIED_MARK = " (applied)"
"""Appended to the legend name of the rule the trainer applied."""
LOG_MANTISSAS = (1, 2, 5)


# ------------------------------------------------------------------------------------------------ conventions


def _check_columns(df: pd.DataFrame, needed: Sequence[str], chart: str) -> None:
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise ValueError(f"{chart}: missing column(s) {missing}; got {list(df.columns)}")


def rule_order(rules: Iterable[str]) -> list[str]:
    """``rules`` in the registry's order (unregistered names last, sorted), each once."""
    registry = list_losses()
    wanted = set(rules)
    return [r for r in registry if r in wanted] + sorted(wanted - set(registry))


def rule_colour(rule: str) -> str:
    """The one colour of ``rule`` on every chart: its place in the registry picks it from :data:`RULE_PALETTE`."""
    registry = list_losses()
    index = registry.index(rule) if rule in registry else len(registry) + sum(map(ord, rule))
    return RULE_PALETTE[index % len(RULE_PALETTE)]


def series_colour(i: int) -> str:
    return SERIES_PALETTE[i % len(SERIES_PALETTE)]


def bucket_colour(i: int) -> str:
    return BUCKET_PALETTE[min(i, len(BUCKET_PALETTE) - 1)]


def _ordered(values: pd.Series, order: Sequence[str] | None = None) -> list:
    """Distinct values in the given order first, then the rest as they appear."""
    seen = list(dict.fromkeys(values.tolist()))
    if order is None:
        return seen
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def _buckets(values: pd.Series, order: Sequence[str] | None) -> list:
    """Bucket labels in the given order, else sorted (the query layer's labels sort in probability order)."""
    return _ordered(values, order if order is not None else sorted(values.dropna().unique().tolist()))


def number_label(value: float) -> str:
    """A tick label as a plain number: ``0.002``, ``0.5``, ``20``; ``2e-5`` below 0.001 (never an SI prefix)."""
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.6g}"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def log_ticks(low: float, high: float) -> list[float]:
    """Ticks of the form {1, 2, 5} x 10^k from the last one at or below ``low`` to the first at or above ``high``.

    Over more than three decades only the powers of ten are kept, so labels never crowd.
    """
    if not (low > 0 and high > 0 and math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"log_ticks needs positive finite bounds, got {low!r}, {high!r}")
    low, high = min(low, high), max(low, high)
    mantissas = LOG_MANTISSAS if math.log10(high / low) <= 3 else (1,)
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    ticks = [m * 10.0 ** k for k in range(first, last + 1) for m in mantissas]
    below = [t for t in ticks if t <= low * (1 + 1e-9)]
    above = [t for t in ticks if t >= high * (1 - 1e-9)]
    start, stop = (max(below) if below else ticks[0]), (min(above) if above else ticks[-1])
    chosen = [t for t in ticks if start <= t <= stop]
    return chosen if len(chosen) >= 2 else [start, start * (2 if start == stop else stop / start)]


def log_axis(fig: go.Figure, values: Iterable[float], axis: str = "y", **where: object) -> None:
    """Make one axis logarithmic with :func:`log_ticks` over the positive ``values`` (a no-op when none are)."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    arr = arr[np.isfinite(arr) & (arr > 0)]
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    if arr.size == 0:
        update(type="log", **where)
        return
    ticks = log_ticks(float(arr.min()), float(arr.max()))
    update(type="log", tickmode="array", tickvals=ticks, ticktext=[number_label(t) for t in ticks],
           range=[math.log10(ticks[0]), math.log10(ticks[-1])], minor={"showgrid": False}, **where)


def percent_axis(fig: go.Figure, axis: str = "y", **where: object) -> None:
    """A rate axis: percentages, starting at 0."""
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tickformat=".2~%", rangemode="tozero", **where)


def count_axis(fig: go.Figure, values: Iterable[float], axis: str = "y", **where: object) -> None:
    """A count axis: integers from 0 (one tick per unit when the counts are small)."""
    top = max([float(v) for v in values if v is not None and not pd.isna(v)], default=0.0)
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    extra = {"dtick": 1, "tick0": 0} if top <= 8 else {}
    update(tickformat=",d", rangemode="tozero", **extra, **where)


def step_axis(fig: go.Figure, steps: Iterable[float], **where: object) -> None:
    """A step axis: integer ticks (one per step when a run has few), titled ``step``."""
    values = [float(v) for v in steps if v is not None and not pd.isna(v)]
    span = (max(values) - min(values)) if values else 0.0
    extra = {"dtick": 1} if span <= 8 else {}
    fig.update_xaxes(tickformat="d", **extra, **where)


def _finish(fig: go.Figure, height: int, top: int = 40) -> go.Figure:
    """Shared layout: no SI prefixes on any axis, the legend beside the plot in trace order."""
    fig.update_xaxes(exponentformat="e", automargin=True)
    fig.update_yaxes(exponentformat="e", automargin=True)
    fig.update_layout(height=height, margin={"t": top, "b": 40}, legend={"traceorder": "normal"})
    return fig


def has_data(fig: go.Figure | Mapping) -> bool:
    """Whether any trace of ``fig`` (a figure, or its ``to_plotly_json()`` dict) holds at least one point."""
    traces = fig.get("data", []) if isinstance(fig, Mapping) else [t.to_plotly_json() for t in fig.data]
    for trace in traces:
        for attr in ("x", "y", "z", "values"):
            values = trace.get(attr)
            if values is not None and len(values) > 0:
                return True
    return False


def empty_figure(message: str) -> go.Figure:
    """A blank figure carrying a centred message (the report's stand-in for a chart without data)."""
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=200, margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def _grid(n: int, max_cols: int) -> tuple[int, int]:
    cols = max(1, min(n, max_cols))
    return max(1, math.ceil(n / cols)), cols


# ------------------------------------------------------------------------------------------------ over steps


def smooth(df: pd.DataFrame, weight: float, by: Sequence[str], column: str = "value") -> pd.DataFrame:
    """Exponential moving average of ``column`` over steps within each ``by`` group (``weight`` 0 = raw)."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight!r}")
    if weight == 0 or df.empty:
        return df
    out = df.sort_values([*by, "step"]).copy()
    out[column] = out.groupby(list(by))[column].transform(lambda s: s.ewm(alpha=1 - weight).mean())
    return out


def seed_band(df: pd.DataFrame, groups: Mapping[str, str]) -> pd.DataFrame:
    """Mean over the runs of each group, with the band of their min and max per step.

    Reads ``run_id, step, name, value``; ``groups`` maps run_id -> group label. Returns ``run_id`` (the group
    label), ``step, name, value, lo, hi, n_runs``.
    """
    _check_columns(df, ["run_id", "step", "name", "value"], "seed_band")
    labelled = df.assign(run_id=df["run_id"].map(lambda r: groups.get(r, r)))
    out = labelled.groupby(["run_id", "name", "step"], as_index=False, sort=False).agg(
        value=("value", "mean"), lo=("value", "min"), hi=("value", "max"), n_runs=("value", "size"))
    return out


def metrics_over_steps(df: pd.DataFrame, metrics: Sequence[str], titles: Mapping[str, str] | None = None,
                       colours: Mapping[str, str] | None = None, log_metrics: Sequence[str] = ("mismatch",),
                       percent_metrics: Sequence[str] = ()) -> go.Figure:
    """One panel per metric, one line per run (or seed group): the runs side by side on shared steps.

    Reads long-form ``run_id, step, name, value``, and ``lo, hi`` when present (the band of a seed group, drawn
    shaded). ``colours`` maps run_id -> colour. Metrics absent from ``df`` still get a panel, so the layout stays
    stable while a run is starting; ``log_metrics`` get a log axis, ``percent_metrics`` a percentage axis.
    """
    _check_columns(df, ["run_id", "step", "name", "value"], "metrics_over_steps")
    titles = titles or {}
    fig = make_subplots(rows=len(metrics), cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=[titles.get(m, m) for m in metrics])
    runs = _ordered(df["run_id"])
    band = {"lo", "hi"} <= set(df.columns)
    traces, rows = [], []
    for row, metric in enumerate(metrics, start=1):
        part = df[df["name"] == metric]
        for i, run in enumerate(runs):
            one = part[part["run_id"] == run].sort_values("step")
            colour = (colours or {}).get(run, series_colour(i))
            if band and len(one) and (one["hi"] > one["lo"]).any():
                traces.append(go.Scatter(
                    x=[*one["step"], *one["step"][::-1]], y=[*one["hi"], *one["lo"][::-1]], fill="toself",
                    fillcolor=colour, opacity=0.15, line={"width": 0}, hoverinfo="skip", showlegend=False,
                    legendgroup=str(run), name=f"{run} min-max"))
                rows.append(row)
            traces.append(go.Scatter(x=one["step"], y=one["value"], mode="lines", name=str(run),
                                     legendgroup=str(run), showlegend=row == 1, line={"color": colour, "width": 2},
                                     hovertemplate=f"{run}<br>step %{{x}}<br>%{{y:.4g}}<extra></extra>"))
            rows.append(row)
    if traces:
        fig.add_traces(traces, rows=rows, cols=[1] * len(rows))  # one call: per-trace add_trace is slow
    for row, metric in enumerate(metrics, start=1):
        part = df[df["name"] == metric]
        if metric in log_metrics:
            values = [*part["value"], *(part["lo"] if band else []), *(part["hi"] if band else [])]
            log_axis(fig, values, row=row, col=1)
        elif metric in percent_metrics:
            percent_axis(fig, row=row, col=1)
        fig.update_yaxes(title_text=titles.get(metric, metric), row=row, col=1)
    step_axis(fig, df["step"])
    fig.update_xaxes(title_text="step", row=len(metrics), col=1)
    return _finish(fig, max(300, 230 * len(metrics)), top=60)


def blocked_fraction_by_rule(df: pd.DataFrame, applied: Mapping[str, str | None] | None = None,
                             max_cols: int = 3) -> go.Figure:
    """Share of tokens each rule would block, over steps; one panel per run (or seed group).

    Reads ``run_id, step, rule, blocked_frac`` and, when present, ``n_blocked, n_tokens`` (shown on hover).
    ``applied`` maps run_id -> the rule its trainer applied: that line is thicker and marked in its panel title.
    """
    _check_columns(df, ["run_id", "step", "rule", "blocked_frac"], "blocked_fraction_by_rule")
    applied = applied or {}
    runs = _ordered(df["run_id"])
    rows, cols = _grid(len(runs), max_cols)
    titles = [f"{r}<br><sup>applied: {applied[r]}</sup>" if applied.get(r) else str(r) for r in runs]
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes="all", subplot_titles=titles,
                        vertical_spacing=min(0.3 / max(rows - 1, 1), 0.12), horizontal_spacing=0.04)
    counts = {"n_blocked", "n_tokens"} <= set(df.columns)
    shown: set[str] = set()
    traces, at_rows, at_cols = [], [], []
    groups = {key: one.sort_values("step") for key, one in df.groupby(["run_id", "rule"], sort=False)}
    for k, run in enumerate(runs):
        row, col = divmod(k, cols)
        for rule in rule_order(r for (g, r) in groups if g == run):
            one = groups[(run, rule)]
            own = applied.get(run) == rule
            extra = {}
            if counts:
                extra = {"customdata": one[["n_blocked", "n_tokens"]].to_numpy(),
                         "hovertemplate": f"{rule}<br>step %{{x}}<br>%{{y:.2%}} (%{{customdata[0]:,.0f}} of "
                                          "%{customdata[1]:,.0f} tokens with A != 0)<extra></extra>"}
            traces.append(go.Scatter(x=one["step"], y=one["blocked_frac"], mode="lines", name=rule,
                                     legendgroup=rule, showlegend=rule not in shown, meta={"rule": rule},
                                     line={"color": rule_colour(rule), "width": 4 if own else 1.5}, **extra))
            at_rows.append(row + 1)
            at_cols.append(col + 1)
            shown.add(rule)
    if traces:
        fig.add_traces(traces, rows=at_rows, cols=at_cols)  # one call: per-trace add_trace is slow
    step_axis(fig, df["step"])
    fig.update_xaxes(title_text="step", row=rows)
    percent_axis(fig)
    fig.update_yaxes(title_text="blocked (% of A != 0 tokens)", col=1)
    return _finish(fig, 120 + 260 * rows, top=90)


def bad_updates_vs_reward(df: pd.DataFrame, alert_line: float | None = None,
                          alert_steps: Sequence[int] = ()) -> go.Figure:
    """Rate of bad negative-advantage updates against reward fluctuation, over steps, for one run.

    Reads ``step, bad_rate, reward_fluctuation`` and ``n_bad_negative, n_tokens`` when present (on hover).
    ``alert_line`` draws the early-warning threshold; ``alert_steps`` marks the steps where the warning fired.
    """
    _check_columns(df, ["step", "bad_rate", "reward_fluctuation"], "bad_updates_vs_reward")
    df = df.sort_values("step")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    extra = {}
    if {"n_bad_negative", "n_tokens"} <= set(df.columns):
        extra = {"customdata": df[["n_bad_negative", "n_tokens"]].to_numpy(),
                 "hovertemplate": "step %{x}<br>%{y:.2%} (%{customdata[0]:,.0f} of %{customdata[1]:,.0f} "
                                  "tokens)<extra>bad negative updates</extra>"}
    fig.add_trace(go.Scatter(x=df["step"], y=df["bad_rate"], mode="lines+markers", name="bad negative updates",
                             line={"color": BLOCKED_COLOUR}, marker={"size": 4}, **extra), secondary_y=False)
    fig.add_trace(go.Scatter(x=df["step"], y=df["reward_fluctuation"], mode="lines", name="reward fluctuation",
                             line={"color": series_colour(0), "dash": "dot"}), secondary_y=True)
    if alert_line is not None:
        fig.add_hline(y=alert_line, line={"dash": "dash", "color": ALERT_COLOUR, "width": 1}, secondary_y=False,
                      annotation_text=f"warning line {alert_line:.2%}", annotation_position="top left")
    for step in alert_steps:
        fig.add_vline(x=step, line={"color": ALERT_COLOUR, "width": 1, "dash": "dot"})
    step_axis(fig, df["step"])
    fig.update_xaxes(title_text="step")
    percent_axis(fig, secondary_y=False)
    fig.update_yaxes(title_text="bad negative updates (% of the step's tokens)", secondary_y=False)
    fig.update_yaxes(title_text="|reward - previous step's reward|", rangemode="tozero", tickmode="auto",
                     tickformat=".2~f", showgrid=False, secondary_y=True)
    fig.update_layout(hovermode="x unified")
    return _finish(fig, 400, top=60)


# ------------------------------------------------------------------------------------------------ trust region


def ratio_vs_divergence(df: pd.DataFrame, divergence: str = "tv", bucket_order: Sequence[str] | None = None) -> go.Figure:
    """The paper's Figure 2: the ratio pi/mu against mu (left) beside a divergence against mu (right).

    Reads ``mu, ratio, <divergence>, mu_bucket``: one point per token (a sample of them), one colour per mu bucket.
    Points whose ratio or divergence is 0 cannot sit on a log axis and are left out of that panel.
    """
    _check_columns(df, ["mu", "ratio", divergence, "mu_bucket"], "ratio_vs_divergence")
    label = {"tv": "binary TV |pi - mu|", "topk_tv": "top-K TV", "kl": "binary KL", "topk_kl": "top-K KL"}
    div_title = label.get(divergence, divergence)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=["ratio pi / mu", div_title])
    for i, bucket in enumerate(_buckets(df["mu_bucket"], bucket_order)):
        one = df[df["mu_bucket"] == bucket]
        style = {"size": 4, "color": bucket_colour(i), "opacity": 0.6}
        fig.add_trace(go.Scattergl(x=one["mu"], y=one["ratio"], mode="markers", name=str(bucket),
                                   legendgroup=str(bucket), marker=style,
                                   hovertemplate="mu %{x:.3g}<br>ratio %{y:.3g}<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scattergl(x=one["mu"], y=one[divergence], mode="markers", name=str(bucket),
                                   legendgroup=str(bucket), showlegend=False, marker=style,
                                   hovertemplate="mu %{x:.3g}<br>divergence %{y:.3g}<extra></extra>"),
                      row=1, col=2)
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "grey"}, row=1, col=1)
    log_axis(fig, df["mu"], axis="x")
    fig.update_xaxes(title_text="mu (rollout probability of the sampled token)")
    log_axis(fig, df["ratio"], row=1, col=1)
    log_axis(fig, df[divergence], row=1, col=2)
    fig.update_yaxes(title_text="ratio pi / mu", row=1, col=1)
    fig.update_yaxes(title_text=div_title, row=1, col=2)
    fig.update_layout(legend_title_text="mu bucket")
    return _finish(fig, 460, top=70)


def ratio_divergence_histogram(df: pd.DataFrame, divergence: str = "binary_tv",
                               bucket_order: Sequence[str] | None = None) -> go.Figure:
    """Every token binned by ratio (y) and divergence (x), one colour per mu bucket, marker area ~ token count.

    Reads ``mu_bucket, ratio, divergence, n`` (bin centres and counts).
    """
    _check_columns(df, ["mu_bucket", "ratio", "divergence", "n"], "ratio_divergence_histogram")
    biggest = max(float(df["n"].max()), 1.0) if len(df) else 1.0
    fig = go.Figure()
    for i, bucket in enumerate(_buckets(df["mu_bucket"], bucket_order)):
        one = df[df["mu_bucket"] == bucket]
        fig.add_trace(go.Scatter(
            x=one["divergence"], y=one["ratio"], mode="markers", name=str(bucket),
            marker={"size": 4 + 26 * (one["n"] / biggest) ** 0.5, "color": bucket_colour(i), "opacity": 0.55,
                    "line": {"width": 0}},
            customdata=one["n"], hovertemplate="ratio %{y:.3g}<br>divergence %{x:.3g}<br>%{customdata:,} tokens"
                                                "<extra>%{fullData.name}</extra>",
        ))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "grey"})
    names = {"binary_tv": "binary TV |pi - mu|", "binary_kl": "binary KL", "topk_tv": "top-K TV",
             "topk_kl": "top-K KL"}
    log_axis(fig, df["divergence"], axis="x")
    log_axis(fig, df["ratio"])
    fig.update_xaxes(title_text=f"{names.get(divergence, divergence)} (bin centre)")
    fig.update_yaxes(title_text="ratio pi / mu (bin centre)")
    fig.update_layout(legend_title_text="mu bucket")
    return _finish(fig, 440, top=60)


def spread_by_bucket(df: pd.DataFrame, bucket_order: Sequence[str] | None = None) -> go.Figure:
    """How far the ratio and the divergence stray per mu bucket: |ratio - 1| and TV side by side.

    Reads ``mu_bucket, ratio_dev, tv`` and ``n_tokens`` when present (one row per bucket; 99th percentiles).
    """
    _check_columns(df, ["mu_bucket", "ratio_dev", "tv"], "spread_by_bucket")
    order = _buckets(df["mu_bucket"], bucket_order)
    df = df.set_index("mu_bucket").loc[order].reset_index()
    labels = ([f"{b}<br>({n:,} tokens)" for b, n in zip(df["mu_bucket"], df["n_tokens"], strict=True)]
              if "n_tokens" in df else list(df["mu_bucket"]))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=df["ratio_dev"], name="|ratio - 1|", marker_color=series_colour(0),
                         hovertemplate="%{x}<br>|ratio - 1| %{y:.3g}<extra></extra>"))
    fig.add_trace(go.Bar(x=labels, y=df["tv"], name="binary TV |pi - mu|", marker_color=series_colour(2),
                         hovertemplate="%{x}<br>TV %{y:.3g}<extra></extra>"))
    fig.update_xaxes(title_text="mu bucket")
    log_axis(fig, [*df["ratio_dev"], *df["tv"]])
    fig.update_yaxes(title_text="99th percentile in the bucket")
    fig.update_layout(barmode="group")
    return _finish(fig, 340)


def rules_by_bucket(df: pd.DataFrame, bucket_order: Sequence[str] | None = None,
                    applied: str | None = None) -> go.Figure:
    """What each rule blocks on the same tokens, by mu bucket; one panel per advantage sign.

    Reads ``rule, mu_bucket, adv_sign, blocked_frac`` and ``n_blocked, n_tokens`` when present (on hover).
    """
    _check_columns(df, ["rule", "mu_bucket", "adv_sign", "blocked_frac"], "rules_by_bucket")
    signs = sorted(df["adv_sign"].unique().tolist(), reverse=True)
    buckets = _buckets(df["mu_bucket"], bucket_order)
    fig = make_subplots(rows=1, cols=max(1, len(signs)), shared_yaxes=True,
                        subplot_titles=[f"advantage {s}" for s in signs])
    counts = {"n_blocked", "n_tokens"} <= set(df.columns)
    for rule in rule_order(df["rule"]):
        name = rule + (APPLIED_MARK if rule == applied else "")
        for col, sign in enumerate(signs, start=1):
            # every bucket on every panel (an empty one stays a gap), so the panels' axes read the same
            one = df[(df["rule"] == rule) & (df["adv_sign"] == sign)].set_index("mu_bucket").reindex(buckets)
            extra = {}
            if counts:
                extra = {"customdata": one[["n_blocked", "n_tokens"]].to_numpy(),
                         "hovertemplate": f"{rule}<br>%{{x}}<br>%{{y:.2%}} (%{{customdata[0]:,.0f}} of "
                                          "%{customdata[1]:,.0f} tokens)<extra></extra>"}
            fig.add_trace(go.Bar(x=list(one.index), y=one["blocked_frac"], name=name, legendgroup=rule,
                                 showlegend=col == 1, meta={"rule": rule},
                                 marker={"color": rule_colour(rule),
                                         "line": {"width": 2 if rule == applied else 0, "color": "black"}},
                                 **extra), row=1, col=col)
            fig.update_xaxes(title_text="mu bucket", categoryorder="array", categoryarray=buckets, row=1, col=col)
    percent_axis(fig)
    fig.update_yaxes(title_text="blocked (% of the bucket's tokens)", col=1)
    fig.update_layout(barmode="group")
    return _finish(fig, 440, top=70)


def counterfactual_by_bucket(df: pd.DataFrame, rule_a: str, rule_b: str,
                             bucket_order: Sequence[str] | None = None) -> go.Figure:
    """Tokens one rule blocks and the other keeps, by mu bucket; one panel per advantage sign.

    Reads ``mu_bucket, adv_sign, only_a, only_b`` (counts of tokens only ``rule_a`` / only ``rule_b`` blocks).
    """
    _check_columns(df, ["mu_bucket", "adv_sign", "only_a", "only_b"], "counterfactual_by_bucket")
    signs = sorted(df["adv_sign"].unique().tolist(), reverse=True)
    buckets = _buckets(df["mu_bucket"], bucket_order)
    fig = make_subplots(rows=1, cols=max(1, len(signs)), shared_yaxes=True,
                        subplot_titles=[f"advantage {s}" for s in signs])
    for col, sign in enumerate(signs, start=1):
        one = df[df["adv_sign"] == sign].set_index("mu_bucket").reindex(buckets).fillna(0)
        for rule, other, column in ((rule_a, rule_b, "only_a"), (rule_b, rule_a, "only_b")):
            fig.add_trace(go.Bar(x=buckets, y=one[column], name=f"{rule} blocks, {other} keeps",
                                 legendgroup=rule, showlegend=col == 1, meta={"rule": rule},
                                 marker_color=rule_colour(rule),
                                 hovertemplate="%{x}<br>%{y:,} tokens<extra>%{fullData.name}</extra>"),
                          row=1, col=col)
        fig.update_xaxes(title_text="mu bucket", categoryorder="array", categoryarray=buckets, row=1, col=col)
    count_axis(fig, [*df["only_a"], *df["only_b"]])
    fig.update_yaxes(title_text="tokens", col=1)
    fig.update_layout(barmode="group")
    return _finish(fig, 400, top=70)


def visible(text: str) -> str:
    """A token's text as an axis label: escapes for control characters, and spaces shown as ``␣`` (a token that
    is a space would otherwise be a blank label)."""
    return repr(text)[1:-1].replace(" ", "\u2423")


def clipped_tokens(df: pd.DataFrame, rule: str) -> go.Figure:
    """The token texts one rule blocks at the highest rate, coloured by their mean mu, counts beside each bar.

    Reads ``text, block_rate, n_blocked, n_occurrences, mean_mu, mean_entropy`` (highest rate first).
    """
    _check_columns(df, ["text", "block_rate", "n_blocked", "n_occurrences", "mean_mu", "mean_entropy"],
                   "clipped_tokens")
    df = df.iloc[::-1]
    labels = [visible(t) if isinstance(t, str) else str(t) for t in df["text"]]
    fig = go.Figure(go.Bar(
        x=df["block_rate"], y=labels, orientation="h",
        text=[f"{b:,} of {n:,}" for b, n in zip(df["n_blocked"], df["n_occurrences"], strict=True)],
        textposition="outside", cliponaxis=False,
        marker={"color": df["mean_mu"], "colorscale": "Viridis", "cmin": 0.0, "cmax": 1.0,
                "colorbar": {"title": {"text": "mean mu"}, "tickformat": ".1f"}},
        customdata=df[["n_blocked", "n_occurrences", "mean_mu", "mean_entropy"]].to_numpy(),
        hovertemplate="%{y}<br>blocked %{customdata[0]:,} of %{customdata[1]:,} (%{x:.1%})"
                      "<br>mean mu %{customdata[2]:.3f}<br>mean entropy %{customdata[3]:.2f}<extra></extra>",
    ))
    percent_axis(fig, axis="x")
    top = float(df["block_rate"].max()) if len(df) else 1.0
    fig.update_xaxes(title_text=f"share of the token's occurrences {rule} blocks", range=[0, min(1.0, top) * 1.3])
    fig.update_yaxes(title_text="token text", type="category")
    return _finish(fig, max(300, 24 * len(df) + 100), top=30)


# ------------------------------------------------------------------------------------------------ report


def bad_rate_vs_reward_change(df: pd.DataFrame, colours: Mapping[str, str] | None = None) -> go.Figure:
    """Per step, the bad negative-update rate (x) against the reward change (y); one colour per run or group.

    Reads ``run_id, step, bad_negative_rate, reward_change``.
    """
    _check_columns(df, ["run_id", "step", "bad_negative_rate", "reward_change"], "bad_rate_vs_reward_change")
    fig = go.Figure()
    for i, run in enumerate(_ordered(df["run_id"])):
        one = df[df["run_id"] == run]
        fig.add_trace(go.Scatter(x=one["bad_negative_rate"], y=one["reward_change"], mode="markers", name=str(run),
                                 marker={"size": 5, "opacity": 0.6, "color": (colours or {}).get(run, series_colour(i))},
                                 customdata=one["step"],
                                 hovertemplate="step %{customdata}<br>bad %{x:.2%}<br>reward change %{y:.3f}"
                                               "<extra>%{fullData.name}</extra>"))
    percent_axis(fig, axis="x")
    fig.update_xaxes(title_text="bad negative updates (% of the step's tokens)")
    fig.update_yaxes(title_text="|reward - previous step's reward|", rangemode="tozero")
    return _finish(fig, 420, top=60)


def ratio_tv_heatmap(df: pd.DataFrame) -> go.Figure:
    """Token counts on log bins of the ratio (y) against binary TV (x), summed over runs and mu buckets.

    Reads ``ratio_lo, ratio_hi, divergence_lo, divergence_hi, n`` (the ratio_vs_divergence view's bins).
    """
    _check_columns(df, ["ratio_lo", "ratio_hi", "divergence_lo", "divergence_hi", "n"], "ratio_tv_heatmap")
    df = df[(df["ratio_lo"] > 0) & (df["divergence_lo"] > 0)]
    cells = df.assign(ratio=np.sqrt(df["ratio_lo"] * df["ratio_hi"]),
                      divergence=np.sqrt(df["divergence_lo"] * df["divergence_hi"]))
    cells = cells.groupby(["ratio", "divergence"], as_index=False)["n"].sum()
    fig = go.Figure(go.Scatter(
        x=cells["divergence"], y=cells["ratio"], mode="markers",
        marker={"symbol": "square", "size": 9, "color": np.log10(cells["n"]), "colorscale": "Viridis",
                "colorbar": {"title": {"text": "tokens"}, "tickvals": [0, 1, 2, 3, 4, 5, 6],
                             "ticktext": ["1", "10", "100", "1000", "1e4", "1e5", "1e6"]}},
        customdata=cells["n"], name="tokens",
        hovertemplate="TV %{x:.3g}<br>ratio %{y:.3g}<br>%{customdata:,} tokens<extra></extra>"))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "grey"})
    log_axis(fig, cells["divergence"], axis="x")
    log_axis(fig, cells["ratio"])
    fig.update_xaxes(title_text="binary TV |pi - mu| (bin centre)")
    fig.update_yaxes(title_text="ratio pi / mu (bin centre)")
    return _finish(fig, 440, top=40)


# ------------------------------------------------------------------------------------------------ tokens


def _blend(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    t = min(max(t, 0.0), 1.0)
    r, g, bl = (round(x + (y - x) * t) for x, y in zip(a, b, strict=True))
    return f"rgb({r},{g},{bl})"


_WHITE, _RED, _BLUE = (255, 255, 255), (228, 87, 86), (76, 120, 168)
TOKEN_SCALES = {"ratio": 4.0, "tv": 0.3, "advantage": 2.0}
"""Where each colouring reaches full colour by default: a ratio factor of 4, a TV of 0.3, |A| of 2."""


def token_colour(value: float | bool | None, colour_by: str, scale: float | None = None) -> str:
    """Background colour for one token: blue below the neutral point, red above, white at it.

    ratio: neutral 1, full colour at a factor ``scale`` either way (log scale); tv: 0 to ``scale``; advantage:
    -``scale`` to ``scale``; blocked: red when blocked. ``scale`` defaults to :data:`TOKEN_SCALES`.
    """
    if colour_by not in COLOUR_BY:
        raise ValueError(f"colour_by must be one of {COLOUR_BY}, got {colour_by!r}")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "rgb(235,235,235)"
    if colour_by == "blocked":
        return _blend(_WHITE, _RED, 0.8) if bool(value) else "rgb(255,255,255)"
    scale = scale or TOKEN_SCALES[colour_by]
    if colour_by == "ratio":
        s = math.log(max(float(value), 1e-12)) / math.log(max(scale, 1.0 + 1e-9))
    else:
        s = float(value) / scale
    return _blend(_WHITE, _RED, s) if s >= 0 else _blend(_WHITE, _BLUE, -s)


def token_spans_html(df: pd.DataFrame, colour_by: str, scale: float | None = None) -> str:
    """A response as HTML, every token on a background coloured by ``colour_by``.

    Reads ``pos, text, ratio, tv, advantage, blocked, mu, pi, alternatives`` where ``alternatives`` is the hover
    text listing mu's top-K tokens with mu's and pi's probabilities. Token texts are escaped.
    """
    _check_columns(df, ["pos", "text", "ratio", "tv", "advantage", "blocked", "mu", "pi", "alternatives"],
                   "token_spans_html")
    if colour_by not in COLOUR_BY:
        raise ValueError(f"colour_by must be one of {COLOUR_BY}, got {colour_by!r}")
    spans = []
    for row in df.sort_values("pos").itertuples(index=False):
        value = getattr(row, colour_by)
        tip = (f"pos {row.pos} | mu {row.mu:.4f} | pi {row.pi:.4f} | ratio {row.ratio:.3f} | TV {row.tv:.4f} | "
               f"A {row.advantage:+.3f}{' | blocked' if row.blocked else ''}\n{row.alternatives}")
        text = html.escape(str(row.text)).replace("\n", "↵<br>")
        spans.append(f'<span class="tok" title="{html.escape(tip, quote=True)}" '
                     f'style="background:{token_colour(value, colour_by, scale)};padding:1px 0;'
                     f'border-right:1px solid #ddd;white-space:pre-wrap">{text}</span>')
    return ('<div style="font-family:monospace;line-height:1.9;font-size:0.95rem">' + "".join(spans) + "</div>")


def format_alternatives(texts: Sequence[str], probs: Sequence[float], sampled_index: int | None,
                        pi_probs: Sequence[float] | None = None) -> str:
    """Hover text for mu's top-K: one ``'text' mu p`` (and ``pi q`` when given) per line, the sampled token
    marked."""
    lines = []
    for i, (t, p) in enumerate(zip(texts, probs, strict=True)):
        mark = " <- sampled" if i == sampled_index else ""
        pi = f"  pi {pi_probs[i]:.4f}" if pi_probs is not None and i < len(pi_probs) else ""
        lines.append(f"{t!r} mu {p:.4f}{pi}{mark}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ by dimension

DIMENSION_AXES = {"position": "position in the response (power-of-two buckets)", "turn": "turn",
                  "staleness": "staleness (step - policy_version)"}
"""The x-axis title of each summary dimension (:data:`trustscope.columns.DIMENSIONS`)."""


def _bucket_labels(df: pd.DataFrame) -> list[str]:
    """The bucket labels of ``df`` in bucket order (position ``2-3`` after ``1``, staleness ``10`` after ``9``)."""
    return df.sort_values("bucket").drop_duplicates("bucket_label")["bucket_label"].astype(str).tolist()


def mismatch_by_dimension(df: pd.DataFrame, dimension: str) -> go.Figure:
    """Mean |pi - mu| and the importance weights' ESS fraction by one summary dimension's bucket, one line per run.

    Reads ``run_id, bucket, bucket_label, n_tokens, mismatch_mean, ess_frac`` (the ``mismatch_by_dimension``
    query's rows of one dimension); the token count of every point is on hover.
    """
    _check_columns(df, ["run_id", "bucket", "bucket_label", "n_tokens", "mismatch_mean", "ess_frac"],
                   "mismatch_by_dimension")
    labels = _bucket_labels(df)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["mean |pi - mu|", "ESS / tokens (importance weights)"],
                        horizontal_spacing=0.1)
    for i, run in enumerate(_ordered(df["run_id"])):
        one = df[df["run_id"] == run].sort_values("bucket")
        x = one["bucket_label"].astype(str)
        for col, (column, fmt) in enumerate((("mismatch_mean", ".4g"), ("ess_frac", ".2%")), start=1):
            fig.add_trace(go.Scatter(
                x=x, y=one[column], mode="lines+markers", name=str(run), legendgroup=str(run), showlegend=col == 1,
                line={"color": series_colour(i)}, customdata=one[["n_tokens"]].to_numpy(),
                hovertemplate=f"{run}<br>{dimension} %{{x}}<br>%{{y:{fmt}}} over %{{customdata[0]:,.0f}} "
                              "tokens<extra></extra>"), row=1, col=col)
    fig.update_xaxes(title_text=DIMENSION_AXES.get(dimension, dimension), type="category", categoryorder="array",
                     categoryarray=labels)
    fig.update_yaxes(rangemode="tozero", col=1)
    percent_axis(fig, col=2)
    return _finish(fig, 360, top=60)


def mismatch_by_routing(df: pd.DataFrame) -> go.Figure:
    """Mean |log pi/mu| by the first MoE layer where the engine's and the trainer's experts differ ('none': full
    agreement), one bar group per run in its colour; the token counts and the share of the run's total |log pi/mu|
    on hover. Reads the ``routing_mismatch`` query's rows of split ``first_layer``."""
    _check_columns(df, ["run_id", "bucket", "label", "n_tokens", "mean_abs", "abs_share"], "mismatch_by_routing")
    fig = go.Figure()
    for i, run in enumerate(_ordered(df["run_id"])):
        one = df[df["run_id"] == run].sort_values("bucket")
        fig.add_trace(go.Bar(
            x=one["label"].astype(str), y=one["mean_abs"], name=str(run), marker={"color": series_colour(i)},
            customdata=one[["n_tokens", "abs_share"]].to_numpy(),
            hovertemplate=f"{run}<br>first disagreeing layer: %{{x}}<br>mean |log pi/mu| %{{y:.4f}} over "
                          "%{customdata[0]:,.0f} tokens<br>%{customdata[1]:.1%} of the run's total<extra></extra>"))
    fig.update_layout(barmode="group", xaxis_title="first MoE layer where the experts differ",
                      yaxis_title="mean |log pi/mu|")
    return _finish(fig, 360, top=40)


def blocked_by_dimension(df: pd.DataFrame, dimension: str, max_cols: int = 3) -> go.Figure:
    """Each rule's blocked fraction of the A != 0 tokens by one summary dimension's bucket: one panel per rule
    (titled with its name), one line per run in the run's colour.

    Reads ``run_id, rule, bucket, bucket_label, n_blocked, n_nonzero_advantage, blocked_frac`` (the
    ``blocked_by_dimension`` query's rows of one dimension); the counts are on hover.
    """
    _check_columns(df, ["run_id", "rule", "bucket", "bucket_label", "n_blocked", "n_nonzero_advantage",
                        "blocked_frac"], "blocked_by_dimension")
    labels = _bucket_labels(df)
    rules = rule_order(df["rule"])
    rows, cols = _grid(len(rules), max_cols)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes="all", subplot_titles=rules,
                        vertical_spacing=min(0.3 / max(rows - 1, 1), 0.15), horizontal_spacing=0.05)
    runs = _ordered(df["run_id"])
    for k, rule in enumerate(rules):
        row, col = divmod(k, cols)
        for i, run in enumerate(runs):
            one = df[(df["rule"] == rule) & (df["run_id"] == run)].sort_values("bucket")
            fig.add_trace(go.Scatter(
                x=one["bucket_label"].astype(str), y=one["blocked_frac"], mode="lines+markers", name=str(run),
                legendgroup=str(run), showlegend=k == 0, line={"color": series_colour(i)},
                customdata=one[["n_blocked", "n_nonzero_advantage"]].to_numpy(),
                hovertemplate=f"{run}<br>{rule}, {dimension} %{{x}}<br>%{{y:.2%}} (%{{customdata[0]:,.0f}} of "
                              "%{customdata[1]:,.0f} tokens with A != 0)<extra></extra>"), row=row + 1, col=col + 1)
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=labels)
    fig.update_xaxes(title_text=dimension, row=rows)  # short: the panels of a row sit side by side
    percent_axis(fig)
    fig.update_yaxes(title_text="blocked (% of A != 0)", col=1)
    return _finish(fig, 120 + 230 * rows, top=60)


def threshold_curves(df: pd.DataFrame, target: float | None = None, applied: str | None = None) -> go.Figure:
    """Blocked share of a run's tokens with A != 0 against each rule's threshold, one line per rule, on one scale:
    the threshold as a multiple of the one evaluated (u = 1, marked on every line: the default, or the run's own
    for its rule; ratio bands scale in log, see :class:`trustscope.losses.Threshold`). A larger scale blocks fewer
    tokens. ``target``: the equal budget's share, drawn across.

    Reads ``rule, param, value, scale, n_blocked, n_tokens, blocked_frac, default`` (``LogDB.threshold_curve``).
    """
    _check_columns(df, ["rule", "param", "value", "scale", "n_blocked", "n_tokens", "blocked_frac", "default"],
                   "threshold_curves")
    fig = go.Figure()
    for rule in rule_order(df["rule"].unique()):
        one = df[df["rule"] == rule].sort_values("scale")
        name = rule + (APPLIED_MARK if rule == applied else "")
        custom = one[["param", "value", "n_blocked", "n_tokens"]].to_numpy()
        fig.add_trace(go.Scatter(
            x=one["scale"], y=one["blocked_frac"], mode="lines", name=name, legendgroup=rule, meta={"rule": rule},
            line={"color": rule_colour(rule), "width": 3 if rule == applied else 1.5, "shape": "hv"},
            customdata=custom,
            hovertemplate=f"{rule}<br>%{{customdata[0]}} = %{{customdata[1]:.4g}} (scale %{{x:.3g}})<br>"
                          "blocks %{y:.2%} (%{customdata[2]:,} of %{customdata[3]:,} tokens)<extra></extra>"))
        below = one[one["scale"] <= 1.0]
        at = below.iloc[-1] if len(below) else one.iloc[0]
        fig.add_trace(go.Scatter(
            x=[1.0], y=[at["blocked_frac"]], mode="markers", name=f"{rule} at {at['param']} = {at['default']:.4g}",
            legendgroup=rule, showlegend=False, meta={"rule": rule},
            marker={"color": rule_colour(rule), "size": 10, "symbol": "diamond", "line": {"width": 1, "color": "black"}},
            hovertemplate=f"{rule} at {at['param']} = {at['default']:.4g} (the parameters evaluated)<br>"
                          f"blocks about %{{y:.2%}}<extra></extra>"))
    if target is not None and len(df):
        fig.add_hline(y=target, line={"dash": "dash", "color": "black", "width": 1},
                      annotation_text=f"equal budget {target:.2%}", annotation_position="top left")
    log_axis(fig, df["scale"], axis="x")
    percent_axis(fig)
    fig.update_xaxes(title_text="threshold as a multiple of the one evaluated (log; diamond: 1, the default)")
    fig.update_yaxes(title_text="blocked (% of the tokens with A != 0)")
    return _finish(fig, 460)


def budget_picks(df: pd.DataFrame, dimension: str, rules: Sequence[str]) -> go.Figure:
    """Which tokens each rule blocks at an equal budget along one ``dimension`` (mu bucket, advantage sign,
    entropy bucket, position): the share of the rule's blocked tokens in each group, beside the share of all the
    tokens with A != 0 (grey), so a rule's bias shows as a bar above the grey one. Each bar is labelled with its
    count of tokens.

    Reads ``rule, dimension, value, n_blocked, share`` (``LogDB.budget_picks``).
    """
    _check_columns(df, ["rule", "dimension", "value", "n_blocked", "share"], "budget_picks")
    one = df[df["dimension"] == dimension]
    values = _buckets(one["value"], None)
    fig = go.Figure()
    for rule in ["(all tokens)", *rules]:
        part = one[one["rule"] == rule].set_index("value").reindex(values)
        colour = "#BBBBBB" if rule == "(all tokens)" else rule_colour(rule)
        name = "all tokens with A != 0" if rule == "(all tokens)" else f"{rule} blocks"
        counts = part["n_blocked"].fillna(0).astype(int)
        fig.add_trace(go.Bar(x=values, y=part["share"].fillna(0), name=name, marker_color=colour,
                             text=[f"{c:,}" if c else "" for c in counts], textposition="outside",
                             textfont={"size": 10}, cliponaxis=False,
                             meta={"rule": rule}, customdata=part[["n_blocked"]].fillna(0).to_numpy(),
                             hovertemplate="%{x}<br>%{y:.1%} (%{customdata[0]:,} tokens)<extra>%{fullData.name}"
                                           "</extra>"))
    percent_axis(fig)
    fig.update_xaxes(title_text=dimension.replace("_", " "), categoryorder="array", categoryarray=values)
    fig.update_yaxes(title_text="share of the tokens each blocks")
    fig.update_layout(barmode="group")
    return _finish(fig, 380)
