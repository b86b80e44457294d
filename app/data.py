"""Cached access to a log directory for the dashboard pages.

Every query goes through :mod:`trustscope.db`: one query-layer handle per log directory (``st.cache_resource``),
its named analyses and its named queries (``trustscope/sql/queries/*.sql``, :meth:`LogDB.query`), with results
cached by ``st.cache_data`` under the log directory and :meth:`LogDB.version` (which changes when a file lands),
so a run that is still writing gets fresh results as soon as a new file lands and cached ones otherwise. The run
table, seed groups and the collapse early warning are :mod:`trustscope.report`'s, shared with the report. The
overview pages read :meth:`LogDB.overview` (exact from the summaries table where a run has one, else from its
logged rows, which :func:`overview` says per run), the report's source too; the token-level pages read the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import streamlit as st

from app.launch import LOGDIR_ENV, default_logdir
from trustscope import db, figures, report, schema, storage
from trustscope.losses import list_losses

METRIC_TITLES = {
    "reward": "reward",
    "accuracy": "accuracy (eval)",
    "mismatch": "mismatch mean |pi - mu|",
    "entropy": "entropy (nats)",
}
ACCURACY_NAMES = ("accuracy", "accuracy/mean", "eval/accuracy", "eval/reward")
"""Step scalars read as the accuracy, first found per run wins: the trainer's own accuracy, else the reward on
held-out problems (an accuracy for the verifiable, 0/1-reward tasks)."""
DIVERGENCES = {"tv": "binary TV", "topk_tv": "top-K TV"}
"""Divergences of the ratio page: scatter column -> label."""
VIEW_DIVERGENCE = {"tv": "binary_tv", "topk_tv": "topk_tv"}
"""Scatter column -> the query layer's name of the same divergence."""
INTERNAL_VIEW_SUFFIXES = ("_partials", "_scan", "_core")
"""Views that exist to build others (kept aggregates, scans behind a cached view): listed apart in the console."""
VIEWS = tuple(v for v in db.VIEWS if not v.endswith(INTERNAL_VIEW_SUFFIXES))
INTERNAL_VIEWS = tuple(v for v in db.VIEWS if v.endswith(INTERNAL_VIEW_SUFFIXES))
BAD_DELTA = db.ANALYSIS_DEFAULTS["bad_negative_delta"]
"""mu - pi at or above this on an A < 0 token makes a bad negative update (the paper's Mask-0.5 threshold)."""
BASELINE_RULE = "ppo_clip"
"""Always in the default selection of runs, as the baseline the other rules are read against."""
COUNTERFACTUAL_RULE = "dppo_binary_tv"
"""The counterfactual page's default second rule: the paper's DPPO binary TV."""
WINDOW_TOKENS = 1_000_000
"""Tokens the token-level pages read by default (the last steps of a run up to this many)."""
SQL_ROW_LIMIT = db.DEFAULT_MAX_ROWS
WARNING_LINES = report.WarningLines()
COLOUR_LEGEND = {
    "ratio": "Blue: pi below mu (ratio < 1), red: pi above mu; full colour at a factor of {scale:g}.",
    "tv": "White: no probability moved; red: |pi - mu| of {scale:.2g} or more.",
    "advantage": "Blue: negative advantage, red: positive; full colour at |A| = {scale:.2g} (this response's "
                 "largest).",
    "blocked": "Red: {rule} blocks the token's gradient.",
}
EXAMPLE_SQL = """select run_id, step, mismatch_mean, bad_negative_rate, blocked_frac__grpo, blocked_frac__dppo_binary_tv
from step_summary
order by run_id, step"""


class LogDirError(Exception):
    """A log directory the dashboard cannot show; the message says what is wrong and what to do."""


# ------------------------------------------------------------------------------------------------ the log dir


def resolve_logdir(argv: Sequence[str]) -> Path | str:
    """``--logdir`` from the script's arguments, else ``$TRUSTSCOPE_LOGDIR``, else the sample logs; an
    ``s3://`` prefix stays a URL (LogDB reads it through its mirror)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--logdir")
    known, _ = parser.parse_known_args(list(argv))
    chosen = known.logdir or os.environ.get(LOGDIR_ENV) or default_logdir()
    if storage.is_remote(chosen):
        st.session_state["logdir"] = chosen
        return chosen
    path = Path(chosen).expanduser().resolve()
    st.session_state["logdir"] = str(path)
    return path


def current_logdir() -> str:
    if "logdir" not in st.session_state:
        resolve_logdir([])
    return st.session_state["logdir"]


def check_logdir(logdir: Path | str) -> None:
    """Raise :class:`LogDirError` when ``logdir`` is missing, not a directory, or holds no run at all; show an
    error naming each run that cannot be read whole and why (:attr:`trustscope.db.LogDB.broken_runs`: a manifest
    that is not JSON, a data file whose Parquet footer does not read). What still reads of such a run is shown,
    and the other runs as they are."""
    handle = None
    if storage.is_remote(logdir):
        try:
            handle = _db(str(logdir))
            handle.refresh()  # the mirror, brought up to date, and its runs checked
            logdir = handle.paths[0]
        except (storage.StorageError, ValueError) as exc:
            raise LogDirError(f"The object store prefix cannot be read: {exc}") from None
    if not logdir.exists():
        raise LogDirError(f"The log directory `{logdir}` does not exist. Start the dashboard with "
                          "`trustscope dashboard LOGDIR` pointing at a directory a run writes to.")
    if not logdir.is_dir():
        raise LogDirError(f"`{logdir}` is a file, not a log directory.")
    if not schema.run_dirs(logdir):
        raise LogDirError(f"The log directory `{logdir}` holds no runs yet (no `<run>/{schema.MANIFEST}`). "
                          "Runs appear here once a trainer with a TokenLogger starts writing into it; "
                          "reload the page then.")
    if handle is None:
        handle = _db(current_logdir())
        handle.refresh()  # new runs and files, each file's footer read once
    for run, problem in sorted(handle.broken_runs.items()):
        st.error(f"Could not read all of run `{run}`: {problem}\n\nWhat still reads of it is shown, marked broken; "
                 f"the other runs are as they are. Run `trustscope validate {logdir}` to list every broken file.",
                 icon=":material/error:")


@contextlib.contextmanager
def friendly_errors() -> Iterator[None]:
    """Show a broken or half-written log directory as a clear message instead of a traceback."""
    try:
        yield
    except LogDirError as exc:
        st.warning(str(exc), icon=":material/folder_off:")
    except (schema.SchemaError, duckdb.Error, pa.ArrowException, OSError) as exc:
        logdir = current_logdir()
        st.error(f"Could not read the logs in `{logdir}`: {_first_line(exc)}\n\n"
                 f"Run `trustscope validate {logdir}` to list every broken file. A run that is still being "
                 "written is read again on the next refresh.", icon=":material/error:")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


# ------------------------------------------------------------------------------------------------ queries


@st.cache_resource(show_spinner=False, max_entries=4, on_release=lambda handle: handle.close())
def _db(logdir: str) -> db.LogDB:
    """One query-layer handle per log directory; it keeps the per-file step aggregates between refreshes."""
    return db.connect(logdir)


def _thaw(params: tuple[tuple[str, object], ...]) -> dict[str, object]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params}


@st.cache_data(show_spinner=False, max_entries=256)
def _analysis(logdir: str, version: str, method: str, kwargs: tuple[tuple[str, object], ...]) -> pd.DataFrame:
    """A named analysis of :class:`trustscope.db.LogDB` (it refreshes itself: new files are picked up)."""
    return getattr(_db(logdir), method)(**_thaw(kwargs))


@st.cache_data(show_spinner=False, max_entries=256)
def _query(logdir: str, version: str, name: str, params: tuple[tuple[str, object], ...]) -> pd.DataFrame:
    """``trustscope/sql/queries/<name>.sql`` with bound parameters, through :meth:`LogDB.query`."""
    return _db(logdir).query(name, **_thaw(params))


@st.cache_data(show_spinner=False, max_entries=16)
def _run_table(logdir: str, version: str) -> pd.DataFrame:
    return report.run_table(_db(logdir))


@st.cache_data(show_spinner=False, max_entries=128)
def figure(builder: str, *args: object, **kwargs: object) -> dict:
    """``trustscope.figures.<builder>(*args, **kwargs)`` as plotly JSON, cached on its inputs: a revisit of a page
    skips plotly's figure building, which costs more than the cached queries behind it."""
    return getattr(figures, builder)(*args, **kwargs).to_plotly_json()


def _frozen(params: dict[str, object]) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in params.items()))


def _key() -> tuple[str, str]:
    logdir = current_logdir()
    return logdir, _db(logdir).version()


def fingerprint(logdir: str | None = None) -> str:
    """The log directory's :meth:`LogDB.version` (what results are cached under), for sections that cache their
    own results."""
    return _db(logdir or current_logdir()).version()


def analysis(method: str, **kwargs: object) -> pd.DataFrame:
    """Cached result of ``LogDB.<method>(**kwargs)`` for the current log directory and its files."""
    return _analysis(*_key(), method, _frozen(kwargs))


def query(name: str, **params: object) -> pd.DataFrame:
    """Cached result of ``LogDB.query(name, **params)`` for the current log directory and its files."""
    return _query(*_key(), name, _frozen(params))


def overview() -> db.Overview:
    """:meth:`LogDB.overview` of every run (read once and filtered by the callers: the pages ask for different
    runs of the same small frames): exact from the summaries table where a run has one, else from its logged
    token rows, as ``sources`` says."""
    return analysis("overview")


def sources(run_ids: Sequence[str]) -> pd.DataFrame:
    """``run_id, exact, token_fraction, source`` of ``run_ids``: where their overview figures come from."""
    df = overview().sources
    return df[df["run_id"].isin(list(run_ids))].reset_index(drop=True)


def summary(run_ids: Sequence[str] | None = None) -> pd.DataFrame:
    """The step summary over the logged token rows (one row per run and step), for the token-level pages' step
    windows; read once for every run and filtered here."""
    df = analysis("step_summary")
    return df if run_ids is None else df[df["run_id"].isin(list(run_ids))].reset_index(drop=True)


def runs() -> pd.DataFrame:
    """Runs with at least one logged step (:func:`trustscope.report.run_table`): run_id, loss_rule, status,
    n_steps, first/last step, tokens_generated, tokens_logged, logged_frac, mean_reward, updated_at, group."""
    return _run_table(*_key())


def run_rule(run_id: str) -> str | None:
    """The rule the run's trainer applied (None when its manifest and tokens do not say)."""
    table = runs().set_index("run_id")
    rule = table.loc[run_id, "loss_rule"] if run_id in table.index else None
    return None if rule is None or pd.isna(rule) else str(rule)


def step_range(run_id: str) -> tuple[int, int]:
    row = runs().set_index("run_id").loc[run_id]
    return int(row["first_step"]), int(row["last_step"])


def default_first_step(run_id: str) -> int:
    """The first step of the longest run of final steps holding at most :data:`WINDOW_TOKENS` tokens (at least
    the last step)."""
    steps = summary([run_id]).sort_values("step", ascending=False)
    if steps.empty:
        return step_range(run_id)[0]
    within = steps[steps["n_tokens"].cumsum() <= WINDOW_TOKENS]
    return int(within["step"].min()) if len(within) else int(steps["step"].iloc[0])


def step_metrics(run_ids: Sequence[str]) -> pd.DataFrame:
    """Long form ``run_id, step, name, value`` for the metrics of :data:`METRIC_TITLES`, from :func:`overview`."""
    steps = overview().steps
    steps = steps[steps["run_id"].isin(list(run_ids))]
    wide = steps[["run_id", "step", "reward_mean", "mismatch_mean", "entropy_mean"]].rename(
        columns={"reward_mean": "reward", "mismatch_mean": "mismatch", "entropy_mean": "entropy"})
    long = wide.melt(id_vars=["run_id", "step"], var_name="name", value_name="value").dropna(subset=["value"])
    scalars = query("step_scalars", run_ids=list(run_ids), names=list(ACCURACY_NAMES))
    rank = scalars["name"].map({n: i for i, n in enumerate(ACCURACY_NAMES)})
    best = rank.groupby(scalars["run_id"]).transform("min")
    accuracy = scalars[rank == best].assign(name="accuracy")
    return pd.concat([long, accuracy], ignore_index=True)


def blocked_by_rule(run_ids: Sequence[str], labels: dict[str, str] | None = None) -> pd.DataFrame:
    """``run_id, step, rule, n_blocked, n_tokens, blocked_frac`` (over the tokens with A != 0) for every rule that
    blocks anything in these runs, in registry order (:meth:`trustscope.db.Overview.blocked_by_rule`: the runs of
    one label in ``labels`` added up)."""
    ours = overview()
    mine = db.Overview(ours.steps, ours.blocked[ours.blocked["run_id"].isin(list(run_ids))], ours.sources)
    df = mine.blocked_by_rule(labels)
    order = {r: i for i, r in enumerate(figures.rule_order(df["rule"].unique()))}
    return df.sort_values(["rule", "run_id", "step"], key=lambda c: c.map(order) if c.name == "rule" else c,
                          kind="stable").reset_index(drop=True)


def blocked_totals(run_ids: Sequence[str], labels: dict[str, str] | None = None) -> pd.DataFrame:
    """``run_id, rule, n_blocked, n_tokens, blocked_frac`` over every step of these runs (A != 0 tokens), the
    runs of one label in ``labels`` added up (:meth:`trustscope.db.Overview.blocked_totals`)."""
    ours = overview()
    return db.Overview(ours.steps, ours.blocked[ours.blocked["run_id"].isin(list(run_ids))],
                       ours.sources).blocked_totals(labels)


def ratio_points(run_id: str, steps: tuple[int, int]) -> pd.DataFrame:
    """A uniform sample of at most 20,000 tokens: mu, ratio, tv, topk_tv, mu_bucket."""
    return query("ratio_points", run_id=run_id, first_step=steps[0], last_step=steps[1])


def spread_by_bucket(run_id: str, steps: tuple[int, int]) -> pd.DataFrame:
    return query("spread_by_bucket", run_id=run_id, first_step=steps[0], last_step=steps[1])


def ratio_histogram(run_id: str, divergence: str) -> pd.DataFrame:
    """The query layer's ratio-versus-divergence histogram with bin centres: mu_bucket, ratio, divergence, n."""
    df = analysis("ratio_vs_divergence", run_ids=[run_id], divergences=[divergence])
    df = df[(df["ratio_lo"] > 0) & (df["divergence_lo"] > 0)]
    return pd.DataFrame({
        "mu_bucket": df["mu_bucket"],
        "ratio": (df["ratio_lo"] * df["ratio_hi"]) ** 0.5,
        "divergence": (df["divergence_lo"] * df["divergence_hi"]) ** 0.5,
        "n": df["n"],
    }).reset_index(drop=True)


def rules_by_bucket(run_id: str, steps: tuple[int, int]) -> pd.DataFrame:
    """``rule, mu_bucket, adv_sign, n_tokens, n_blocked, blocked_frac`` over the A != 0 tokens of the window."""
    return query("rules_by_bucket", run_id=run_id, first_step=steps[0], last_step=steps[1])


def masking_rules(run_id: str) -> list[str]:
    """The registered rules that would block at least one logged token of the run, in registry order: read off
    the logged rows (the token-level pages' source), so a rule registered after the run was logged, which its
    summaries table cannot hold, is offered too."""
    steps = summary([run_id])
    blocking = {c.removeprefix("n_blocked__") for c in steps.columns
                if c.startswith("n_blocked__") and steps[c].fillna(0).sum() > 0}
    return [r for r in list_losses() if r in blocking]


def clipped_tokens(run_id: str, rule: str, steps: tuple[int, int], adv_sign: str, min_count: int,
                   top: int) -> pd.DataFrame:
    """``text, token_id, n_blocked, n_occurrences, block_rate, mean_mu, mu_bucket, mean_entropy``: the tokens
    ``rule`` blocks at the highest rate in the step window (``adv_sign`` 'A>0', 'A<0' or 'any')."""
    return query("clipped_by_rate", run_id=run_id, rule=rule, first_step=steps[0], last_step=steps[1],
                 adv_sign=adv_sign, min_count=int(min_count), top=int(top))


def counterfactual(run_id: str, rule_a: str, rule_b: str, steps: tuple[int, int]) -> pd.DataFrame:
    """Every A != 0 token of the window one of the two rules blocks and the other keeps: step, rank, sample_id,
    pos, token_text, blocked_by, kept_by, adv_sign, mu_bucket, mu_prob, pi_prob, ratio, binary_tv, advantage."""
    return query("counterfactual_tokens", run_id=run_id, rule_a=rule_a, rule_b=rule_b, first_step=steps[0],
                 last_step=steps[1])


def bad_updates(run_id: str) -> pd.DataFrame:
    """``step, bad_rate, n_bad_negative, n_negative, n_tokens, reward, reward_fluctuation`` per step, from
    :func:`overview` (exact where the run has summaries)."""
    df = overview().bad_updates()
    df = df[df["run_id"] == run_id].sort_values("step")
    return pd.DataFrame({
        "step": df["step"], "bad_rate": df["bad_negative_rate"], "n_bad_negative": df["n_bad_negative"],
        "n_negative": df["n_negative"], "n_tokens": df["n_tokens"], "reward": df["reward_mean"],
        "reward_fluctuation": df["reward_change"],
    }).reset_index(drop=True)


def collapse_warnings(run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run and step, :func:`trustscope.report.collapse_warnings` at :data:`WARNING_LINES` over
    :func:`overview`."""
    return report.collapse_warnings(overview(), list(run_ids), WARNING_LINES)


def samples(run_id: str, step: int) -> pd.DataFrame:
    """The responses of one step whose tokens were logged (``token_fraction`` may leave some out), with
    ``n_logged`` and ``n_blocked`` (by the trainer's own rule)."""
    df = analysis("samples", run_ids=[run_id], steps=[int(step)])
    logged = query("logged_samples", run_id=run_id, step=int(step))
    return df.merge(logged, on="sample_id").sort_values("sample_id").reset_index(drop=True)


def explorer_start(run_id: str) -> tuple[int, int] | None:
    """``(step, sample_id)`` the token explorer opens on: the latest step with a blocked token, its response
    with the most blocked tokens."""
    df = query("explorer_start", run_id=run_id)
    return None if df.empty else (int(df["step"].iloc[0]), int(df["sample_id"].iloc[0]))


def sample_tokens(run_id: str, step: int, sample_id: int) -> pd.DataFrame:
    """The tokens of one response: pos, text, mu, pi, ratio, tv, advantage, blocked (the trainer's own rule),
    ``blocks_<rule>`` for every rule, and ``alternatives`` (mu's top-K with pi's probabilities, as hover
    text)."""
    metrics = analysis("sample_tokens", run_id=run_id, step=int(step), sample_id=int(sample_id))
    alts = query("sample_alternatives", run_id=run_id, step=int(step), sample_id=int(sample_id))
    df = pd.DataFrame({
        "pos": metrics["pos"],
        "text": [t if isinstance(t, str) else f"#{i}"
                 for t, i in zip(metrics["token_text"], metrics["token_id"], strict=True)],
        "mu": metrics["mu_prob"], "pi": metrics["pi_prob"], "ratio": metrics["ratio"], "tv": metrics["binary_tv"],
        "advantage": metrics["advantage"], "blocked": ~metrics["kept"].astype(bool),
    })
    for column in (c for c in metrics.columns if c.startswith("blocks_")):
        df[column] = metrics[column].astype(bool)
    df = df.merge(alts, on="pos", how="left")
    df["alternatives"] = [
        _alternatives_text(texts, probs, pis, rank)
        for texts, probs, pis, rank in zip(df["alt_texts"], df["alt_probs"], df["alt_pi_probs"], df["sampled_rank"],
                                           strict=True)
    ]
    return df.drop(columns=["alt_texts", "alt_probs", "alt_pi_probs", "sampled_rank"])


def _alternatives_text(texts: object, probs: object, pis: object, rank: object) -> str:
    if not isinstance(texts, list | tuple | np.ndarray) or len(texts) == 0:
        return "top-K not logged"
    index = None if rank is None or pd.isna(rank) else int(rank) - 1
    pi_probs = [float(p) for p in pis] if isinstance(pis, list | tuple | np.ndarray) and len(pis) else None
    return figures.format_alternatives(list(texts), [float(p) for p in probs], index, pi_probs)


def topk_table(run_id: str, step: int, sample_id: int, pos: int) -> pd.DataFrame:
    """mu's top-K at one position beside pi's probability of the same tokens: rank, text, mu, pi, pi - mu."""
    alts = query("sample_alternatives", run_id=run_id, step=int(step), sample_id=int(sample_id))
    row = alts[alts["pos"] == pos]
    if row.empty or not isinstance(row["alt_texts"].iloc[0], list | tuple | np.ndarray):
        return pd.DataFrame(columns=["rank", "text", "mu", "pi", "pi - mu"])
    texts, mus = list(row["alt_texts"].iloc[0]), [float(p) for p in row["alt_probs"].iloc[0]]
    pis = row["alt_pi_probs"].iloc[0]
    pis = [float(p) for p in pis] if isinstance(pis, list | tuple | np.ndarray) and len(pis) else [np.nan] * len(mus)
    out = pd.DataFrame({"rank": range(1, len(texts) + 1), "text": [repr(t) for t in texts], "mu": mus, "pi": pis})
    out["pi - mu"] = out["pi"] - out["mu"]
    return out


@dataclass
class SqlResult:
    """A console query's rows, or the error that stopped it."""

    frame: pd.DataFrame
    truncated: bool
    seconds: float
    error: str | None = None


def run_sql(sql: str) -> SqlResult:
    """Run user SQL through the query layer's sandbox (read-only, row limit, timeout); errors become messages."""
    start = time.perf_counter()
    try:
        result = _db(current_logdir()).sql(sql, max_rows=SQL_ROW_LIMIT)
    except (db.QueryRefused, db.QueryStopped, duckdb.Error) as exc:
        return SqlResult(pd.DataFrame(), False, time.perf_counter() - start, _first_line(exc))
    return SqlResult(result.to_pandas(), result.truncated, time.perf_counter() - start)


@st.cache_data(show_spinner=False, max_entries=64)
def _columns(logdir: str, view: str) -> pd.DataFrame:
    cur = _db(logdir).cursor()
    try:
        rel = cur.view(view)
        return pd.DataFrame({"column": rel.columns, "type": [str(t) for t in rel.types]})
    finally:
        cur.close()


def view_columns(view: str) -> pd.DataFrame:
    """``column, type`` of one view (for the SQL console's column browser)."""
    return _columns(current_logdir(), view)
