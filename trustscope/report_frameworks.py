"""The report's frameworks section: each run's own framework's mismatch figures, named as the framework names them,
and the token rows behind the step where they are worst.

A run logged by verl's or TRL's integration or imported from prime-rl, slime or miles (``run.json``'s
``source.framework``: :data:`trustscope.framework_metrics.SOURCE_FRAMEWORKS`) gets a table of its framework's headline figures
(:data:`trustscope.framework_metrics.HEADLINES`, under the framework's default setting:
:data:`~trustscope.framework_metrics.DEFAULT_VARIANTS`) over its steps: at the first and the last step, the mean
and the largest over the steps and where; then the sequences of the step where its framework's figure peaks whose
per-sequence log-perplexity difference is largest (``sql/queries/framework_sequences.sql``), with their sample
ids to read their rows. Figures from a sample of the token rows (``token_fraction`` < 1) say so. Other runs get
one line naming the view that has every framework's figures for them too. Reads ``sql/queries/framework_summary.sql``
over the ``framework_metrics`` view.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from trustscope.framework_metrics import DEFAULT_VARIANTS, HEADLINES, SOURCE_FRAMEWORKS

if TYPE_CHECKING:
    import pandas as pd

    from trustscope.db import LogDB

PEAK_METRIC = {"verl": "rollout_corr/chi2_seq", "prime-rl": "mismatch_kl/all/mean",
               "slime": "train_rollout_logprob_abs_diff", "trl": "sampling/sampling_logp_difference/mean"}
"""The figure whose worst step the section opens (the step where it is largest)."""
SEQUENCES_SHOWN = 3


def run_frameworks(db: LogDB, run_ids: list[str]) -> dict[str, str]:
    """run_id -> the framework whose figures the run is shown with, for the runs whose ``run.json`` names one."""
    runs = db.runs()
    out = {}
    for run_id, manifest in zip(runs["run_id"], runs["manifest"], strict=True):
        try:
            source = json.loads(manifest).get("source") if isinstance(manifest, str) else None
        except (ValueError, AttributeError):
            source = None
        name = source.get("framework") if isinstance(source, dict) else None
        if run_id in run_ids and name in SOURCE_FRAMEWORKS:
            out[run_id] = SOURCE_FRAMEWORKS[name]
    return out


def summary(db: LogDB, run_ids: list[str]) -> pd.DataFrame:
    """``sql/queries/framework_summary.sql`` for ``run_ids``: per run, framework, metric and variant, the figure
    at the first and last step, its mean and largest over the steps and where, and whether it is exact."""
    return db.query("framework_summary", run_ids=list(run_ids))


def _fmt(value: Any) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "-"
    return "-" if v != v else f"{v:.4g}"


def _run_part(db: LogDB, run_id: str, framework: str, figures: pd.DataFrame) -> list:
    mine = figures[(figures["run_id"] == run_id) & (figures["framework"] == framework)]
    mine = mine[mine["variant"].isna() | (mine["variant"] == DEFAULT_VARIANTS[framework])]
    if mine.empty:
        return [Text(f"{run_id}: no token rows for {framework}'s figures", style="dim")]
    exact = bool(mine["exact"].all())
    table = Table(box=box.SIMPLE, title=f"{escape(run_id)}: {framework}'s own figures"
                  + ("" if exact else " (from a sample of the token rows: estimates)"), title_justify="left")
    for column in ("figure", "first step", "last step", "mean", "largest", "at step"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    by_metric = {m: row for m, row in zip(mine["metric"], mine.itertuples(index=False), strict=True)}
    for metric in HEADLINES[framework]:
        row = by_metric.get(metric)
        if row is None:
            continue
        table.add_row(metric, _fmt(row.first_value), _fmt(row.last_value), _fmt(row.mean_value),
                      _fmt(row.max_value), str(int(row.max_step)))
    parts: list = [table]
    peak = by_metric.get(PEAK_METRIC[framework])
    if peak is not None:
        step = int(peak.max_step)
        seqs = db.query("framework_sequences", run_id=run_id, step=step, limit=SEQUENCES_SHOWN)
        if len(seqs):
            lines = [f"  sample_id {int(s.sample_id)}: {int(s.n_tokens)} rows, log-ppl diff {_fmt(s.log_ppl_diff)}, "
                     f"summed log ratio {_fmt(s.log_ratio_sum)}, largest |log ratio| {_fmt(s.max_abs_log_ratio)}"
                     + (f", {int(s.n_rejected)} rejected" if s.n_rejected else "")
                     for s in seqs.itertuples(index=False)]
            parts.append(Text(f"behind {PEAK_METRIC[framework]} at its largest (step {step}), the sequences "
                              f"furthest apart:\n" + "\n".join(lines) + f"\n  their rows: trustscope sql \"select * "
                              f"from tokens where run_id = '{run_id}' and step = {step} and sample_id = ...\""))
    return parts


def frameworks_part(db: LogDB, run_ids: list[str]) -> Group:
    """The report's frameworks section for ``run_ids`` (see the module docstring)."""
    chosen = run_frameworks(db, run_ids)
    head = Text("The frameworks' own mismatch figures, reproduced from the token rows", style="bold")
    others = [r for r in run_ids if r not in chosen]
    note = Text(("" if not others else f"{len(others)} run(s) from no framework with figures of its own "
                 f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): verl's, prime-rl's, slime's and "
                 "TRL's figures of any run are in the view framework_metrics (trustscope sql \"select * from "
                 "framework_metrics\")."), style="italic")
    if not chosen:
        return Group(head, note)
    figures = summary(db, sorted(chosen))
    parts: list = [head]
    for run_id in run_ids:
        if run_id in chosen:
            parts.extend(_run_part(db, run_id, chosen[run_id], figures))
    if others:
        parts.append(note)
    return Group(*parts)


def frameworks_section(db: LogDB, data: Any) -> Group | None:
    """The section as ``trustscope.report`` registers it (``add_section``): the frameworks section of the report's
    runs (``data.reports``), None without runs."""
    run_ids = [r.run_id for r in getattr(data, "reports", [])]
    return frameworks_part(db, run_ids) if run_ids else None
