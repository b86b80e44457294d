"""Where the mismatch lives: the report's and the dashboard's figures by summary dimension (position, turn,
staleness, routing: :data:`trustscope.columns.DIMENSIONS`) and, on mixture-of-experts runs, by routing agreement;
the terminal tables of them and the sentences said where a run lacks a dimension. Exact from the summaries where
a run has their dimension rows, else from its token rows where it logged every token."""

from __future__ import annotations

import pandas as pd
from rich.console import Group
from rich.text import Text

from trustscope.db import LogDB
from trustscope.report_tables import Column, fitted_table, fmt, left_out, short_names, sig

DIMENSION_ABSENT = {
    "position": ("has no summary dimensions (logged before them, or with summaries=False), with a sample of the "
                 "tokens kept (token_fraction < 1), which would not be exact"),
    "turn": "logs no turn (a single-turn run, or tokens logged without `turn`)",
    "staleness": "logs no policy_version (a synchronous run, or tokens logged without it)",
}
"""What a run without a dimension's rows lacks, said in a sentence where its chart or table would be."""


def by_dimension(db: LogDB, run_ids: list[str] | None = None, first_step: int | None = None,
                 last_step: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Where the mismatch lives, exact from the summaries' dimension rows over the steps taken together: the
    ``mismatch_by_dimension`` rows (per run, dimension, bucket: tokens, mean |pi - mu|, ESS fraction, bad
    negative updates) and the ``blocked_by_dimension`` rows (per run, dimension, bucket, rule: n_blocked of the
    A != 0 tokens). The runs whose summaries hold no dimension rows get theirs from their token rows where they
    logged every token (the ``*_tokens`` queries over ``token_dimensions``, run only for those runs: binding the
    token rows' rule scores costs about a second even where no run needs them)."""
    params = {"run_ids": run_ids, "first_step": first_step, "last_step": last_step}
    mismatch, blocked = db.query("mismatch_by_dimension", **params), db.query("blocked_by_dimension", **params)
    wanted = run_ids if run_ids is not None else db.runs()["run_id"].tolist()
    rest = [r for r in wanted if r not in set(mismatch["run_id"])]  # no dimension rows in their summaries
    if rest:  # a run logged in full gets them from its token rows (token_dimensions); the others have none
        params["run_ids"] = rest
        mismatch = _stacked(mismatch, db.query("mismatch_by_dimension_tokens", **params),
                            ["run_id", "dimension", "bucket"])
        blocked = _stacked(blocked, db.query("blocked_by_dimension_tokens", **params),
                           ["run_id", "dimension", "rule", "bucket"])
    return mismatch, blocked


def _stacked(first: pd.DataFrame, more: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """``first`` and ``more`` (rows of the same query shape) as one frame sorted by ``order``."""
    if more.empty:
        return first
    if first.empty:
        return more
    return pd.concat([first, more], ignore_index=True).sort_values(order, kind="stable").reset_index(drop=True)


def lacking(mismatch: pd.DataFrame, dimension: str, run_ids: list[str]) -> list[str]:
    """The runs of ``run_ids`` without rows of ``dimension`` in ``mismatch`` (:func:`by_dimension`'s first frame)."""
    have = set(mismatch.loc[mismatch["dimension"] == dimension, "run_id"])
    return [r for r in run_ids if r not in have]


def absent_sentence(dimension: str, runs: list[str]) -> str:
    """One sentence saying that ``runs`` have no ``dimension`` rows, and why that usually is."""
    if not runs:
        return ""
    who = f"Run {runs[0]}" if len(runs) == 1 else "Runs " + ", ".join(runs)
    what = DIMENSION_ABSENT.get(dimension, f"has no {dimension} rows")
    if len(runs) > 1:
        what = what.replace("has ", "have ", 1).replace("logs ", "log ", 1)
    return f"{who} {what}: nothing to split by {dimension}."


def render_dimensions(mismatch: pd.DataFrame, blocked: pd.DataFrame, run_ids: list[str],
                      applied: dict[str, str | None], width: int | None = None) -> Group:
    """The terminal tables of :func:`by_dimension`: per dimension, one row per (run, bucket) with its tokens,
    mean |pi - mu|, ESS fraction and what the run's own rule blocks (count of the A != 0 tokens and fraction);
    a sentence for the runs without the dimension. Run ids lose the prefix they share; fitted to ``width``
    (:func:`fitted_table`: the tokens, then the ESS are left out first)."""
    from trustscope.columns import DIMENSIONS

    prefix, short = short_names(sorted(set(run_ids) | set(mismatch["run_id"])))
    parts: list = []
    for dim in DIMENSIONS:
        rows = mismatch[mismatch["dimension"] == dim.name].sort_values(["run_id", "bucket"])
        missing = lacking(mismatch, dim.name, run_ids)
        if rows.empty:
            parts.append(Text(f"By {dim.name}: {absent_sentence(dim.name, missing)}", style="italic"))
            continue
        own = blocked[(blocked["dimension"] == dim.name)]
        own = own[own["rule"] == own["run_id"].map(applied)].set_index(["run_id", "bucket"])
        found = [own.loc[(row.run_id, row.bucket)] if (row.run_id, row.bucket) in own.index else None
                 for row in rows.itertuples()]
        columns = [
            Column("run", [short.get(r, r) for r in rows["run_id"]], "left"),
            Column(dim.name, [str(b) for b in rows["bucket_label"]]),
            Column("tokens", [f"{int(n):,}" for n in rows["n_tokens"]], drop=1),
            Column("|pi-mu|", [sig(x) for x in rows["mismatch_mean"]]),
            Column("ESS", [fmt(x, ".1%") for x in rows["ess_frac"]], drop=2),
            Column("own rule blocks", ["-" if b is None else f"{int(b.n_blocked):,} of {int(b.n_nonzero_advantage):,}"
                                       for b in found]),
            Column("share", ["-" if b is None or pd.isna(b.blocked_frac) else sig(100 * b.blocked_frac, 2) + "%"
                             for b in found]),
        ]
        title = (f"Where the mismatch lives: by {dim.name} (every step, every token"
                 + (f"; run ids without {prefix!r}" if prefix else "") + ")")
        table, dropped = fitted_table(columns, width, title=title, title_justify="left", caption_justify="left")
        caption = (absent_sentence(dim.name, missing) + left_out(dropped)).lstrip("; ")
        table.caption = caption or None
        parts.append(table)
    return Group(*parts)


def by_routing(db: LogDB, run_ids: list[str] | None = None, first_step: int | None = None,
               last_step: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """How much of the mismatch routing explains, on mixture-of-experts runs' token rows carrying both sides'
    experts: the ``routing_mismatch`` rows (per run, split ``agreement`` / ``first_layer`` / ``position`` and
    bucket: tokens, disagreeing tokens, mean |log pi/mu| overall, with full agreement and with a disagreement, the
    share of the run's total), the ``routing_blocked`` rows (per run, rule and agreement: n_blocked of the
    A != 0 tokens) and the ``routing_agreement`` rows (per run, ``all`` / ``layer`` / ``position`` and bucket:
    the summaries' exact agreement over every token)."""
    params = {"run_ids": run_ids, "first_step": first_step, "last_step": last_step}
    return (db.query("routing_mismatch", **params), db.query("routing_blocked", **params),
            db.query("routing_agreement", **params))


def routing_sides(db: LogDB, run_ids: list[str] | None = None, first_step: int | None = None,
                  last_step: int | None = None) -> dict[str, tuple[int, int]]:
    """Per mixture-of-experts run (``routing_shape`` in run.json): ``(token rows with engine_experts, with
    trainer_experts)`` (the ``routing_sides`` query)."""
    rows = db.query("routing_sides", run_ids=run_ids, first_step=first_step, last_step=last_step)
    return {r.run_id: (int(r.n_engine), int(r.n_trainer)) for r in rows.itertuples()}


def routing_absent_sentence(runs: list[str], sides: dict[str, tuple[int, int]] | None = None) -> str:
    """What ``runs`` (none with both sides' experts) show by routing: for a run that logs one side
    (``sides``, :func:`routing_sides`), which and on how many token rows; for the rest, that they log none and why
    that usually is."""
    sides = sides or {}
    one = [r for r in runs if any(sides.get(r, (0, 0)))]
    none = [r for r in runs if r not in one]
    out = []
    for run in one:
        engine, trainer = sides[run]
        side, n = ("the engine's", engine) if engine else ("the trainer's", trainer)
        out.append(f"Run {run} logs {side} routed experts alone ({n:,} token rows): agreement needs both the engine's "
                   f"and the trainer router's own choices (an import of a framework's rollout experts, kept for "
                   f"routing replay, carries the engine's only), so there is nothing to split by routing; the "
                   f"experts are in the tokens table (engine_experts, trainer_experts) for SQL.")
    if none:
        who = f"Run {none[0]} logs" if len(none) == 1 else "Runs " + ", ".join(none) + " log"
        out.append(f"{who} no routed experts on both sides (a dense model, an engine without routing capture, or "
                   f"tokens logged without engine_experts and trainer_experts): nothing to split by routing.")
    return " ".join(out)


def routing_lines(mismatch: pd.DataFrame, blocked: pd.DataFrame, run_ids: list[str],
                  applied: dict[str, str | None], exact: pd.DataFrame | None = None,
                  sides: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """The report's routing lines per run: the summaries' exact agreement overall and per layer (``exact``, the
    ``routing_agreement`` rows), the tokens with a disagreement and their share of |log pi/mu|, the mean
    |log pi/mu| with full agreement against the rest, by first disagreeing layer, by position, and what the run's
    own rule blocks by agreement; one sentence for the runs without routing."""
    from trustscope.routing import replace_rate_lines

    lines = []
    for run in run_ids:
        rows = mismatch[mismatch["run_id"] == run]
        if rows.empty:
            continue
        mine = exact[exact["run_id"] == run] if exact is not None else pd.DataFrame()
        if len(mine):
            whole = mine[mine["dimension"] == "all"]
            layers = mine[mine["dimension"] == "layer"]
            lines.append(f"{run}: {whole['agreement'].iloc[0]:.2%} of (layer, slot) expert choices agree over "
                         f"{int(whole['n_tokens'].iloc[0]):,} tokens (exact, every token); by layer: "
                         + ", ".join(f"{int(r.bucket)}: {r.agreement:.2%}" for r in layers.itertuples()))
            lines += replace_rate_lines(mine)  # routing replay's replace rate, where the router's own pick is logged
        agree = rows[rows["split"] == "agreement"].set_index("bucket")
        n = int(agree["n_tokens"].sum())
        bad = agree.loc[1] if 1 in agree.index else None
        full = agree.loc[0] if 0 in agree.index else None
        lead = "  token rows: " if len(mine) else f"{run}: "
        lines.append(f"{lead}{0 if bad is None else int(bad.n_tokens):,} of {n:,} routed tokens "
                     f"({0 if bad is None else bad.n_tokens / n:.1%}) disagree in some layer and hold "
                     f"{0 if bad is None else bad.abs_share:.1%} of the total |log pi/mu|; mean |log pi/mu| "
                     f"{fmt(None if full is None else full.mean_abs)} with full agreement, "
                     f"{fmt(None if bad is None else bad.mean_abs)} with a disagreement")
        layers = rows[(rows["split"] == "first_layer") & (rows["bucket"] >= 0)]
        if len(layers):
            lines.append("  by first disagreeing layer: " + "; ".join(
                f"{r.label}: {int(r.n_tokens):,} tokens, mean {fmt(r.mean_abs)} ({r.abs_share:.1%} of |log pi/mu|)"
                for r in layers.itertuples()))
        pos = rows[rows["split"] == "position"]
        lines.append("  by position: " + "; ".join(
            f"{r.label}: {int(r.n_disagree):,} of {int(r.n_tokens):,} disagree, mean {fmt(r.mean_abs_full)} agreeing "
            f"vs {fmt(r.mean_abs_disagree)}" for r in pos.itertuples()))
        own = blocked[(blocked["run_id"] == run) & (blocked["rule"] == applied.get(run))]
        if len(own):
            lines.append(f"  {applied.get(run)} blocks " + "; ".join(
                f"{int(r.n_blocked):,} of {int(r.n_nonzero_advantage):,} ({fmt(r.blocked_frac, '.2%')}) with "
                f"{r.agreement}" for r in own.itertuples()))
    absent = [r for r in run_ids if r not in set(mismatch["run_id"])]
    if absent and len(absent) < len(run_ids):
        lines.append(routing_absent_sentence(absent, sides))
    return lines
