"""A run report: a readable terminal summary of every run of a log directory, and a self-contained HTML page.

Everything comes from :mod:`trustscope.db`'s named analyses (per-step summaries from the kept per-file
aggregates), so a report over 100M tokens costs about what it costs over 1M once the aggregates are kept.
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from trustscope.db import ANALYSIS_DEFAULTS, LogDB, QueryResult

MISMATCH_WARN = 0.01
"""Mean |pi - mu| above which a run is flagged: the paper's DPPO runs stay near 0.003."""
BAD_NEGATIVE_WARN = 0.005
"""Bad negative-update rate above which a run is flagged (the paper finds < 0.5% of tokens drive collapse)."""
CLIPPED_TOP = 10


@dataclass
class RunReport:
    """What the report says about one run (numbers for tests, text for people)."""

    run_id: str
    status: str | None
    loss_rule: str | None
    n_steps: int
    n_tokens: int
    reward_first: float | None
    reward_last: float | None
    reward_max: float | None
    mismatch_first: float | None
    mismatch_last: float | None
    mismatch_max: float | None
    bad_negative_rate_mean: float | None
    trainer_blocked_frac: float | None
    blocked_by_rule: dict[str, float] = field(default_factory=dict)
    clipped: pd.DataFrame | None = None
    warnings: list[str] = field(default_factory=list)


def _first_last(series: pd.Series) -> tuple[float | None, float | None]:
    values = series.dropna()
    if values.empty:
        return None, None
    return float(values.iloc[0]), float(values.iloc[-1])


def build(db: LogDB) -> list[RunReport]:
    """One :class:`RunReport` per run that has tokens logged."""
    summary = db.step_summary()
    runs = db.runs().set_index("run_id")
    loss_rules = db.sql("select run_id, any_value(loss_rule) as loss_rule from tokens group by run_id",
                        max_rows=100_000).to_pandas().set_index("run_id")["loss_rule"]
    clipped = db.clipped_tokens(top=CLIPPED_TOP)
    reports = []
    for run_id, steps in summary.groupby("run_id", sort=True):
        steps = steps.sort_values("step")
        rule = loss_rules.get(run_id)
        weights = steps.n_tokens / steps.n_tokens.sum()
        n_grad = max(int(steps.n_nonzero_advantage.sum()), 1)  # blocked fractions are over the tokens with A != 0
        blocked = {c.removeprefix("n_blocked__"): float(steps[c].sum() / n_grad)
                   for c in steps.columns if c.startswith("n_blocked__")}
        r_first, r_last = _first_last(steps.reward_mean)
        m_first, m_last = _first_last(steps.mismatch_mean)
        report = RunReport(
            run_id=str(run_id),
            status=runs.status.get(run_id) if "status" in runs else None,
            loss_rule=rule,
            n_steps=len(steps),
            n_tokens=int(steps.n_tokens.sum()),
            reward_first=r_first,
            reward_last=r_last,
            reward_max=float(steps.reward_mean.max()) if steps.reward_mean.notna().any() else None,
            mismatch_first=m_first,
            mismatch_last=m_last,
            mismatch_max=float(steps.mismatch_max.max()),
            bad_negative_rate_mean=float((steps.bad_negative_rate * weights).sum()),
            trainer_blocked_frac=float(steps.n_trainer_blocked.sum() / n_grad),
            blocked_by_rule=dict(sorted(blocked.items(), key=lambda kv: -kv[1])),
            clipped=clipped[(clipped.run_id == run_id) & (clipped.rule == (rule or "ppo_clip"))],
        )
        if m_last is not None and m_last > MISMATCH_WARN:
            report.warnings.append(
                f"mean |pi - mu| ends at {m_last:.4f} (> {MISMATCH_WARN}): the policy is drifting from the rollouts"
            )
        if report.bad_negative_rate_mean > BAD_NEGATIVE_WARN:
            report.warnings.append(
                f"bad negative updates on {report.bad_negative_rate_mean:.2%} of tokens (> {BAD_NEGATIVE_WARN:.1%})"
            )
        if r_last is not None and report.reward_max is not None and report.reward_max - r_last > 0.3:
            report.warnings.append(f"reward fell from a peak of {report.reward_max:.3f} to {r_last:.3f}")
        reports.append(report)
    return reports


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


def render(reports: list[RunReport]) -> Group:
    """The terminal summary as rich renderables."""
    parts: list = []
    overview = Table(title="Runs", title_justify="left")
    for col in ("run", "rule", "steps", "tokens", "reward", "|pi - mu|", "bad neg.", "blocked"):
        overview.add_column(col, justify="left" if col in ("run", "rule") else "right")
    delta = ANALYSIS_DEFAULTS["bad_negative_delta"]
    overview.caption = (f"reward and |pi - mu|: first step -> last step; bad neg.: A < 0 and mu - pi >= {delta:g}; "
                        "blocked: the run's own mask")
    for r in reports:
        overview.add_row(
            f"{r.run_id} ({r.status or '-'})", r.loss_rule or "-", str(r.n_steps), f"{r.n_tokens:,}",
            f"{_fmt(r.reward_first, '.3f')} -> {_fmt(r.reward_last, '.3f')}",
            f"{_fmt(r.mismatch_first)} -> {_fmt(r.mismatch_last)}",
            _fmt(r.bad_negative_rate_mean, ".3%"), _fmt(r.trainer_blocked_frac, ".2%"),
        )
    parts.append(overview)
    for r in reports:
        rules = Table(title=f"{r.run_id}: what every rule would block on these tokens", title_justify="left")
        rules.add_column("rule")
        rules.add_column("blocked", justify="right")
        for rule, frac in r.blocked_by_rule.items():
            style = "bold" if rule == r.loss_rule else None
            rules.add_row(Text(rule, style=style or ""), _fmt(frac, ".3%"))
        parts.append(rules)
        if r.clipped is not None and not r.clipped.empty:
            tokens = Table(title=f"{r.run_id}: tokens {r.clipped.rule.iloc[0]} blocks most", title_justify="left")
            for col in ("rank", "token", "blocked", "rate", "mean mu", "mu bucket", "entropy"):
                tokens.add_column(col, justify="left" if col in ("token", "mu bucket") else "right")
            for row in r.clipped.itertuples():
                tokens.add_row(str(row.rank), repr(row.token_text), str(row.n_blocked), _fmt(row.block_rate, ".2%"),
                               _fmt(row.mu_prob_mean, ".3f"), str(row.mu_bucket), _fmt(row.entropy_mean, ".2f"))
            parts.append(tokens)
        for warning in r.warnings:
            parts.append(Text(f"! {r.run_id}: {warning}", style="yellow"))
    if not reports:
        parts.append(Text("no tokens logged yet", style="yellow"))
    return Group(*parts)


def print_report(db: LogDB, console: Console | None = None) -> list[RunReport]:
    """Print the terminal summary; return the reports."""
    reports = build(db)
    (console or Console()).print(render(reports))
    return reports


def figures(db: LogDB) -> list[tuple[str, object]]:
    """The report's plotly figures, titled: reward and mismatch per step, blocked fractions by rule, bad negative
    updates against reward change, ratio against binary TV, the most-blocked tokens."""
    import plotly.express as px

    summary = db.step_summary()
    out: list[tuple[str, object]] = []
    out.append(("Reward per step", px.line(summary, x="step", y="reward_mean", color="run_id")))
    out.append(("Mismatch: mean |pi - mu| per step",
                px.line(summary, x="step", y="mismatch_mean", color="run_id", log_y=True)))
    blocked = db.blocked_fractions()
    blocked = blocked[blocked.advantage_side == "all"]
    out.append(("Fraction of tokens each rule would block", px.line(
        blocked, x="step", y="blocked_frac", color="rule", facet_row="run_id")))
    bad = db.bad_negative_updates()
    out.append(("Bad negative updates against reward change", px.scatter(
        bad, x="bad_negative_rate", y="reward_change", color="run_id", hover_data=["step"])))
    hist = db.ratio_vs_divergence(divergences="binary_tv")
    if not hist.empty:
        cells = hist.groupby(["ratio_lo", "divergence_lo"], as_index=False)["n"].sum()
        out.append(("Ratio against binary TV (token counts, log bins)", px.density_heatmap(
            cells, x="ratio_lo", y="divergence_lo", z="n", histfunc="sum", log_x=True, log_y=True)))
    clipped = db.clipped_tokens(rules="ppo_clip", top=20)
    if not clipped.empty:
        out.append(("Tokens the PPO clip blocks most", px.bar(
            clipped, x="token_text", y="n_blocked", color="mu_bucket", facet_row="run_id")))
    return out


def write_html(db: LogDB, path: Path | str) -> Path:
    """Write a self-contained HTML page (plotly.js inlined once) with the summary and the figures."""
    path = Path(path)
    reports = build(db)
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(render(reports))
    summary_html = console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
    blocks = []
    for i, (title, fig) in enumerate(figures(db)):
        fig.update_layout(title=title, height=420)
        blocks.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    meta = json.dumps({r.run_id: r.n_tokens for r in reports})
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>trustscope report</title></head><body>"
        f"<h1>trustscope report</h1><p>tokens per run: {html.escape(meta)}</p>{summary_html}"
        + "".join(blocks)
        + "</body></html>"
    )
    path.write_text(page, encoding="utf-8")
    return path


def result_table(result: QueryResult) -> Table:
    """A user query's rows as a rich table, with a caption when rows were cut."""
    table = Table(show_lines=False)
    for name in result.table.column_names:
        table.add_column(name, overflow="fold")
    for row in result.table.to_pylist():
        table.add_row(*("NULL" if v is None else str(v) for v in row.values()))
    if result.truncated:
        table.caption = f"first {result.max_rows} rows shown (--max-rows)"
    return table


def write_result(result: QueryResult, fmt: str, out: Path | None = None) -> None:
    """Write a user query's rows as ``fmt`` (table, csv, json, parquet) to ``out`` or stdout."""
    import sys

    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if fmt == "parquet":
        if out is None:
            raise ValueError("parquet output needs a file (--out)")
        pq.write_table(result.table, out)
    elif fmt == "csv":
        buf = io.BytesIO()
        pacsv.write_csv(result.table, buf)
        _emit(buf.getvalue().decode(), out)
    elif fmt == "json":
        rows = result.table.to_pylist()
        _emit(json.dumps(rows, default=str, indent=1) + "\n", out)
    elif fmt == "table":
        if out is None:
            Console().print(result_table(result))
        else:
            console = Console(record=True, width=200, file=io.StringIO())
            console.print(result_table(result))
            out.write_text(console.export_text())
    else:
        raise ValueError(f"format={fmt!r} is not one of table, csv, json, parquet")
    if result.truncated and fmt != "table":
        print(f"note: output cut at {result.max_rows} rows (--max-rows)", file=sys.stderr)


def _emit(text: str, out: Path | None) -> None:
    if out is None:
        print(text, end="")
    else:
        Path(out).write_text(text)
