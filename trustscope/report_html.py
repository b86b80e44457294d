"""The report's HTML page (``trustscope report --html``): the terminal summary exported to HTML, then the figures,
drawn by :mod:`trustscope.figures` as the dashboard's are, seeds of one configuration as their mean with a band,
and the figures of where the mismatch lives, by summary dimension. plotly is imported only here."""

from __future__ import annotations

import html
import io
from pathlib import Path

import pandas as pd
from rich.console import Console

from trustscope.db import LogDB, Overview
from trustscope.early_warning import WarningLines
from trustscope.report import _dimension_part, kept_gather, render, run_table, source_caption
from trustscope.report_where import absent_sentence, by_dimension, lacking


def _group_colours(table: pd.DataFrame) -> dict[str, str]:
    """Each seed group drawn in its rule's colour when no two groups share a rule, else in series colours."""
    from trustscope import figures  # plotly: only the HTML page draws

    groups = table.drop_duplicates("group")
    if groups["loss_rule"].notna().all() and groups["loss_rule"].is_unique:
        return {g: figures.rule_colour(r) for g, r in zip(groups["group"], groups["loss_rule"], strict=True)}
    return {g: figures.series_colour(i) for i, g in enumerate(groups["group"])}


def figures_for(db: LogDB, overview: Overview | None = None) -> list[tuple[str, str, object]]:
    """The report's figures: ``(title, caption, figure)``, seeds of one configuration drawn as their mean with a
    min-max band; built by :mod:`trustscope.figures`, as the dashboard's, from :meth:`LogDB.overview` (exact
    where a run has summaries), then the token-level figures from the logged rows."""
    from trustscope import figures  # plotly: only the HTML page draws

    overview = overview or db.overview()
    where = source_caption(overview.sources)
    table = run_table(db)
    groups = dict(zip(table["run_id"], table["group"], strict=True))
    applied = dict(zip(table["group"], table["loss_rule"], strict=False))
    colours = _group_colours(table)
    order = table.sort_values("group")["group"].drop_duplicates().tolist()
    summary = overview.steps
    out: list[tuple[str, str, object]] = []
    long = summary[["run_id", "step", "reward_mean", "mismatch_mean"]].rename(
        columns={"reward_mean": "reward", "mismatch_mean": "mismatch"}).melt(["run_id", "step"], var_name="name")
    banded = figures.seed_band(long.dropna(subset=["value"]), groups)
    banded = banded.set_index("run_id").loc[[g for g in order if g in set(banded["run_id"])]].reset_index()
    out.append(("Reward and mismatch per step", "Mean over the seeds of each configuration; the band spans their "
                f"min and max. {where}", figures.metrics_over_steps(
                    banded, ["reward", "mismatch"], {"reward": "mean reward", "mismatch": "mean |pi - mu|"},
                    colours=colours)))
    blocked = overview.blocked_by_rule(groups)
    out.append(("Share of the A != 0 tokens each rule would block", "Every rule on the same tokens, the seeds of a "
                "configuration added up (blocked tokens over tokens with A != 0; hover for the counts); the thick "
                f"line is the rule the trainer applied. {where}",
                figures.blocked_fraction_by_rule(blocked, applied=applied, max_cols=3)))
    bad = overview.bad_updates()
    bad = bad.assign(run_id=bad["run_id"].map(lambda r: groups.get(r, r))).dropna(subset=["reward_change"])
    out.append(("Bad negative updates against reward change", "One point per step and run, coloured by "
                f"configuration. {where}", figures.bad_rate_vs_reward_change(bad, colours=colours)))
    hist = db.ratio_vs_divergence(divergences="binary_tv")
    tv = figures.ratio_tv_heatmap(hist) if not hist.empty else None
    if tv is not None and figures.has_data(tv):
        out.append(("Ratio against binary TV", "Every logged token row of every run on log bins (a sample where a run "
                    "logged a fraction of its tokens); the ratio spreads over "
                    "orders of magnitude at TVs where little probability moved.", tv))
    clipped = db.clipped_tokens(rules="ppo_clip", top=1_000)
    if not clipped.empty:
        agg = clipped.groupby("token_text", as_index=False).agg(
            n_blocked=("n_blocked", "sum"), n_occurrences=("n_occurrences", "sum"),
            mean_mu=("mu_prob_mean", "mean"), mean_entropy=("entropy_mean", "mean"))
        agg["block_rate"] = agg["n_blocked"] / agg["n_occurrences"]
        agg = agg[agg["n_occurrences"] >= 5].sort_values(["block_rate", "n_blocked"], ascending=False).head(20)
        agg = agg.rename(columns={"token_text": "text"})
        if not agg.empty:
            out.append(("Tokens the PPO clip blocks at the highest rate", "Over the logged token rows of every "
                        "run, tokens seen at least 5 times; the bar label is blocked of seen.", figures.clipped_tokens(agg, "ppo_clip")))
    out += dimension_figures(db, table["run_id"].tolist())
    return out


def dimension_figures(db: LogDB, run_ids: list[str]) -> list[tuple[str, str, object]]:
    """The report's figures of where the mismatch lives: per summary dimension some run has, mean |pi - mu| and
    ESS, then each rule's blocked fraction, by bucket, one line per run (exact, every step)."""
    from trustscope import figures
    from trustscope.columns import DIMENSIONS

    mismatch, blocked = by_dimension(db, run_ids)
    out: list[tuple[str, str, object]] = []
    for dim in DIMENSIONS:
        rows = mismatch[mismatch["dimension"] == dim.name]
        if rows.empty:
            continue
        absent = absent_sentence(dim.name, lacking(mismatch, dim.name, run_ids))
        out.append((f"Mismatch and ESS by {dim.name}", f"Exact over every token of every step ({dim.doc}); hover for "
                    f"the token counts. {absent}", figures.mismatch_by_dimension(rows, dim.name)))
        out.append((f"What each rule blocks by {dim.name}", "Blocked tokens over the bucket's tokens with A != 0; "
                    f"hover for the counts. {absent}",
                    figures.blocked_by_dimension(blocked[blocked["dimension"] == dim.name], dim.name)))
    return out


PLOTLY_JS = "plotly.min.js"


def write_html(db: LogDB, path: Path | str, *, inline_js: bool = False, broken: dict[str, list[str]] | None = None,
               lines: WarningLines | None = None) -> Path:
    """Write the report page: the summary and the figures. plotly.js is written once beside the page
    (``plotly.min.js``, shared by every report in that folder, no network needed) unless ``inline_js``, which
    makes one self-contained file (about 5 MB more)."""
    path = Path(path)
    overview = db.overview()
    data = kept_gather(db, lines)
    reports = data.reports
    console = Console(record=True, width=110, file=io.StringIO())
    console.print(render(reports, broken, width=110))
    if reports:
        console.print(_dimension_part(data))
    summary_html = console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
    blocks = []
    for i, (title, caption, fig) in enumerate(figures_for(db, overview)):
        include: bool | str = (i == 0) if inline_js else False
        blocks.append(f"<h2>{html.escape(title)}</h2><p>{html.escape(caption)}</p>"
                      + fig.to_html(full_html=False, include_plotlyjs=include, config={"displaylogo": False}))
    if not inline_js:
        import plotly

        source = Path(plotly.__file__).parent / "package_data" / PLOTLY_JS
        target = path.parent / PLOTLY_JS
        if not target.exists() or target.stat().st_size != source.stat().st_size:
            target.write_bytes(source.read_bytes())
    head = "" if inline_js else f"<script src='{PLOTLY_JS}'></script>"
    alerts = [f"<li>{html.escape(r.run_id)}: {html.escape(r.collapse_warning)}</li>" for r in reports
              if r.collapse_warning]
    n_tokens = sum(r.n_tokens for r in reports)
    intro = (f"<p>{len(reports)} runs, {n_tokens:,} tokens. {html.escape(source_caption(overview.sources))}</p>"
             + (f"<ul>{''.join(alerts)}</ul>" if alerts else "<p>No run crossed the collapse early-warning line.</p>"))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>trustscope report</title>"
        f"{head}<style>body{{font-family:sans-serif;max-width:1200px;margin:auto}}</style></head><body>"
        f"<h1>trustscope report</h1>{intro}{''.join(blocks)}<h2>Summary</h2>{summary_html}</body></html>"
    )
    path.write_text(page, encoding="utf-8")
    return path
