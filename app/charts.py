"""Plotly figure builders for the dashboard: pure functions from pandas DataFrames to figures.

Nothing here touches Streamlit, DuckDB or the file system, so every chart can be built and checked in a unit test.
Each builder names the columns it reads in its docstring; the query layer's views provide them.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

PALETTE = (
    "#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D", "#BAB0AC",
)
BLOCKED_COLOUR = "#E45756"
COLOUR_BY = ("ratio", "tv", "advantage", "blocked")


def _check_columns(df: pd.DataFrame, needed: Sequence[str], chart: str) -> None:
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise ValueError(f"{chart}: missing column(s) {missing}; got {list(df.columns)}")


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _ordered(values: pd.Series, order: Sequence[str] | None = None) -> list:
    """Distinct values in the given order first, then the rest as they appear."""
    seen = list(dict.fromkeys(values.tolist()))
    if order is None:
        return seen
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def _buckets(values: pd.Series, order: Sequence[str] | None) -> list:
    """Bucket labels in the given order, else sorted (the query layer's labels sort in probability order)."""
    return _ordered(values, order if order is not None else sorted(values.dropna().unique().tolist()))


def empty_figure(message: str) -> go.Figure:
    """A blank figure carrying a centred message (used when a query returns no rows)."""
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=200, margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def metrics_over_steps(df: pd.DataFrame, metrics: Sequence[str], titles: dict[str, str] | None = None) -> go.Figure:
    """One panel per metric, one line per run: the runs side by side on shared steps.

    Reads long-form columns ``run_id, step, name, value`` (the ``steps`` table or the step summary in long form).
    Metrics absent from ``df`` still get a panel, so the layout stays stable while a run is starting.
    """
    _check_columns(df, ["run_id", "step", "name", "value"], "metrics_over_steps")
    titles = titles or {}
    fig = make_subplots(rows=len(metrics), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[titles.get(m, m) for m in metrics])
    runs = _ordered(df["run_id"])
    for row, metric in enumerate(metrics, start=1):
        part = df[df["name"] == metric]
        for i, run in enumerate(runs):
            one = part[part["run_id"] == run].sort_values("step")
            fig.add_trace(go.Scatter(x=one["step"], y=one["value"], mode="lines+markers", name=str(run),
                                     legendgroup=str(run), showlegend=row == 1, marker={"size": 4},
                                     line={"color": _colour(i)}),
                          row=row, col=1)
        fig.update_yaxes(title_text=titles.get(metric, metric), row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(metrics), col=1)
    fig.update_layout(height=max(260, 220 * len(metrics)), margin={"t": 40, "b": 40}, hovermode="x unified")
    return fig


def blocked_fraction_by_rule(df: pd.DataFrame) -> go.Figure:
    """Fraction of tokens each trust-region rule would block, over steps; one panel per run.

    Reads ``run_id, step, rule, blocked_frac``.
    """
    _check_columns(df, ["run_id", "step", "rule", "blocked_frac"], "blocked_fraction_by_rule")
    runs = _ordered(df["run_id"])
    rules = _ordered(df["rule"])
    fig = make_subplots(rows=1, cols=max(1, len(runs)), shared_yaxes=True, subplot_titles=[str(r) for r in runs])
    for col, run in enumerate(runs, start=1):
        part = df[df["run_id"] == run]
        for i, rule in enumerate(rules):
            one = part[part["rule"] == rule].sort_values("step")
            fig.add_trace(go.Scatter(x=one["step"], y=one["blocked_frac"], mode="lines", name=str(rule),
                                     legendgroup=str(rule), showlegend=col == 1, line={"color": _colour(i)}),
                          row=1, col=col)
        fig.update_xaxes(title_text="step", row=1, col=col)
    fig.update_yaxes(title_text="blocked fraction", tickformat=".1%", row=1, col=1)
    fig.update_layout(height=380, margin={"t": 40})
    return fig


def ratio_vs_divergence(df: pd.DataFrame, divergence: str = "tv", bucket_order: Sequence[str] | None = None) -> go.Figure:
    """The paper's Figure 2: the ratio pi/mu against mu (left) beside a divergence against mu (right).

    Reads ``mu, ratio, <divergence>, mu_bucket``: one point per token (a sample of them), one colour per mu bucket.
    The ratio spreads over orders of magnitude for low-probability tokens while the divergence stays small.
    """
    _check_columns(df, ["mu", "ratio", divergence, "mu_bucket"], "ratio_vs_divergence")
    label = {"tv": "binary TV |pi - mu|", "topk_tv": "top-K TV", "kl": "binary KL", "topk_kl": "top-K KL"}
    div_title = label.get(divergence, divergence)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.09,
                        subplot_titles=["ratio pi / mu", div_title])
    for i, bucket in enumerate(_buckets(df["mu_bucket"], bucket_order)):
        one = df[df["mu_bucket"] == bucket]
        style = {"size": 4, "color": _colour(i), "opacity": 0.6}
        fig.add_trace(go.Scattergl(x=one["mu"], y=one["ratio"], mode="markers", name=str(bucket),
                                   legendgroup=str(bucket), marker=style), row=1, col=1)
        fig.add_trace(go.Scattergl(x=one["mu"], y=one[divergence], mode="markers", name=str(bucket),
                                   legendgroup=str(bucket), showlegend=False, marker=style), row=1, col=2)
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "grey"}, row=1, col=1)
    fig.update_xaxes(type="log", title_text="mu (rollout probability of the sampled token)")
    fig.update_yaxes(type="log", title_text="ratio pi / mu", row=1, col=1)
    fig.update_yaxes(title_text=div_title, row=1, col=2)
    fig.update_layout(height=440, legend_title_text="mu bucket", margin={"t": 40})
    return fig


def ratio_divergence_histogram(df: pd.DataFrame, divergence: str = "binary_tv",
                               bucket_order: Sequence[str] | None = None) -> go.Figure:
    """Every token of a run binned by ratio (y) and divergence (x), one colour per mu bucket, area ~ token count.

    Reads ``mu_bucket, ratio, divergence, n`` (bin centres and counts). Low-probability buckets spread far along the
    ratio axis at divergences where high-probability buckets barely move.
    """
    _check_columns(df, ["mu_bucket", "ratio", "divergence", "n"], "ratio_divergence_histogram")
    biggest = max(float(df["n"].max()), 1.0) if len(df) else 1.0
    fig = go.Figure()
    for i, bucket in enumerate(_buckets(df["mu_bucket"], bucket_order)):
        one = df[df["mu_bucket"] == bucket]
        fig.add_trace(go.Scatter(
            x=one["divergence"], y=one["ratio"], mode="markers", name=str(bucket),
            marker={"size": 4 + 26 * (one["n"] / biggest) ** 0.5, "color": _colour(i), "opacity": 0.55,
                    "line": {"width": 0}},
            customdata=one["n"], hovertemplate="ratio %{y:.3g}<br>divergence %{x:.3g}<br>%{customdata} tokens"
                                                "<extra>%{fullData.name}</extra>",
        ))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "grey"})
    fig.update_xaxes(type="log", title_text=divergence.replace("_", " "))
    fig.update_yaxes(type="log", title_text="ratio pi / mu")
    fig.update_layout(height=420, legend_title_text="mu bucket", margin={"t": 30})
    return fig


def spread_by_bucket(df: pd.DataFrame, bucket_order: Sequence[str] | None = None) -> go.Figure:
    """How far the ratio and the divergence stray per mu bucket: |ratio - 1| and TV side by side.

    Reads ``mu_bucket, ratio_dev, tv`` (one row per bucket; e.g. the 99th percentile of each in that bucket).
    """
    _check_columns(df, ["mu_bucket", "ratio_dev", "tv"], "spread_by_bucket")
    order = _buckets(df["mu_bucket"], bucket_order)
    df = df.set_index("mu_bucket").loc[order].reset_index()
    fig = go.Figure()
    fig.add_trace(go.Bar(x=df["mu_bucket"], y=df["ratio_dev"], name="|ratio - 1|", marker_color=_colour(0)))
    fig.add_trace(go.Bar(x=df["mu_bucket"], y=df["tv"], name="binary TV", marker_color=_colour(2)))
    fig.update_xaxes(title_text="mu bucket")
    fig.update_yaxes(title_text="99th percentile", type="log")
    fig.update_layout(barmode="group", height=320, margin={"t": 30})
    return fig


def rules_by_bucket(df: pd.DataFrame, bucket_order: Sequence[str] | None = None) -> go.Figure:
    """What each rule blocks on the same tokens, by mu bucket; one panel per advantage sign.

    Reads ``rule, mu_bucket, adv_sign, blocked_frac`` (``adv_sign`` is ``'A>0'`` or ``'A<0'`` style labels).
    """
    _check_columns(df, ["rule", "mu_bucket", "adv_sign", "blocked_frac"], "rules_by_bucket")
    signs = sorted(df["adv_sign"].unique().tolist(), reverse=True)
    buckets = _buckets(df["mu_bucket"], bucket_order)
    fig = make_subplots(rows=1, cols=max(1, len(signs)), shared_yaxes=True,
                        subplot_titles=[f"advantage {s}" for s in signs])
    for i, rule in enumerate(_ordered(df["rule"])):
        for col, sign in enumerate(signs, start=1):
            one = df[(df["rule"] == rule) & (df["adv_sign"] == sign)].set_index("mu_bucket")
            one = one.reindex([b for b in buckets if b in one.index])
            fig.add_trace(go.Bar(x=list(one.index), y=one["blocked_frac"], name=str(rule), legendgroup=str(rule),
                                 showlegend=col == 1, marker_color=_colour(i)), row=1, col=col)
            fig.update_xaxes(title_text="mu bucket", categoryorder="array", categoryarray=buckets, row=1, col=col)
    fig.update_yaxes(title_text="blocked fraction", tickformat=".1%", row=1, col=1)
    fig.update_layout(barmode="group", height=420, margin={"t": 40})
    return fig


def clipped_tokens(df: pd.DataFrame, rule: str) -> go.Figure:
    """The token texts one rule blocks most, coloured by their mean mu, entropy on hover.

    Reads ``text, n_blocked, mean_mu, mean_entropy`` (most blocked first).
    """
    _check_columns(df, ["text", "n_blocked", "mean_mu", "mean_entropy"], "clipped_tokens")
    df = df.sort_values("n_blocked", ascending=True)
    labels = [repr(t)[1:-1] if isinstance(t, str) else str(t) for t in df["text"]]
    fig = go.Figure(go.Bar(
        x=df["n_blocked"], y=labels, orientation="h",
        marker={"color": df["mean_mu"], "colorscale": "Viridis", "cmin": 0.0, "cmax": 1.0,
                "colorbar": {"title": {"text": "mean mu"}}},
        customdata=df[["mean_mu", "mean_entropy"]].to_numpy(),
        hovertemplate="%{y}<br>blocked %{x}<br>mean mu %{customdata[0]:.3f}"
                      "<br>mean entropy %{customdata[1]:.2f}<extra></extra>",
    ))
    fig.update_xaxes(title_text=f"tokens blocked by {rule}")
    fig.update_yaxes(title_text="token text", type="category")
    fig.update_layout(height=max(300, 22 * len(df) + 80), margin={"t": 30})
    return fig


def bad_updates_vs_reward(df: pd.DataFrame) -> go.Figure:
    """Rate of bad negative-advantage updates against reward fluctuation, over steps, for one run.

    Reads ``step, bad_rate, reward_fluctuation``. The paper finds the two move together.
    """
    _check_columns(df, ["step", "bad_rate", "reward_fluctuation"], "bad_updates_vs_reward")
    df = df.sort_values("step")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=df["step"], y=df["bad_rate"], mode="lines+markers", name="bad negative updates",
                             line={"color": BLOCKED_COLOUR}), secondary_y=False)
    fig.add_trace(go.Scatter(x=df["step"], y=df["reward_fluctuation"], mode="lines+markers",
                             name="reward fluctuation", line={"color": _colour(0), "dash": "dot"}), secondary_y=True)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="bad negative-update rate", tickformat=".2%", secondary_y=False)
    fig.update_yaxes(title_text="|reward - previous reward|", secondary_y=True)
    fig.update_layout(height=400, margin={"t": 30}, hovermode="x unified")
    return fig


def _blend(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    t = min(max(t, 0.0), 1.0)
    r, g, bl = (round(x + (y - x) * t) for x, y in zip(a, b, strict=True))
    return f"rgb({r},{g},{bl})"


_WHITE, _RED, _BLUE = (255, 255, 255), (228, 87, 86), (76, 120, 168)


def token_colour(value: float | bool | None, colour_by: str) -> str:
    """Background colour for one token: blue below the neutral point, red above, white at it.

    ratio: neutral 1, full colour at a factor 4 either way (log scale); tv: 0 to 0.3; advantage: -2 to 2;
    blocked: red when the trainer blocked the token.
    """
    if colour_by not in COLOUR_BY:
        raise ValueError(f"colour_by must be one of {COLOUR_BY}, got {colour_by!r}")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "rgb(235,235,235)"
    if colour_by == "blocked":
        return _blend(_WHITE, _RED, 0.8) if bool(value) else "rgb(255,255,255)"
    if colour_by == "ratio":
        s = math.log(max(float(value), 1e-12)) / math.log(4.0)
    elif colour_by == "tv":
        s = float(value) / 0.3
    else:
        s = float(value) / 2.0
    return _blend(_WHITE, _RED, s) if s >= 0 else _blend(_WHITE, _BLUE, -s)


def token_spans_html(df: pd.DataFrame, colour_by: str) -> str:
    """A response as HTML, every token on a background coloured by ``colour_by``.

    Reads ``pos, text, ratio, tv, advantage, blocked, mu, alternatives`` where ``alternatives`` is the hover text
    listing mu's top-K tokens with their probabilities. Token texts are escaped.
    """
    _check_columns(df, ["pos", "text", "ratio", "tv", "advantage", "blocked", "mu", "alternatives"],
                   "token_spans_html")
    if colour_by not in COLOUR_BY:
        raise ValueError(f"colour_by must be one of {COLOUR_BY}, got {colour_by!r}")
    spans = []
    for row in df.sort_values("pos").itertuples(index=False):
        value = getattr(row, colour_by)
        tip = (f"pos {row.pos} | mu {row.mu:.4f} | ratio {row.ratio:.3f} | TV {row.tv:.4f} | "
               f"A {row.advantage:+.3f}{' | blocked' if row.blocked else ''}\n{row.alternatives}")
        text = html.escape(str(row.text)).replace("\n", "↵<br>")
        spans.append(f'<span class="tok" title="{html.escape(tip, quote=True)}" '
                     f'style="background:{token_colour(value, colour_by)};padding:1px 0;'
                     f'border-right:1px solid #ddd;white-space:pre-wrap">{text}</span>')
    return ('<div style="font-family:monospace;line-height:1.9;font-size:0.95rem">' + "".join(spans) + "</div>")


def format_alternatives(texts: Sequence[str], probs: Sequence[float], sampled_index: int | None) -> str:
    """Hover text for mu's top-K: one ``'text' p`` per line, the sampled token marked."""
    lines = []
    for i, (t, p) in enumerate(zip(texts, probs, strict=True)):
        mark = " <- sampled" if i == sampled_index else ""
        lines.append(f"{t!r} {p:.4f}{mark}")
    return "\n".join(lines)
