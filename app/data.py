"""Typed, cached access to a log directory for the dashboard pages.

Every query goes through :mod:`trustscope.db`: one query-layer handle per log directory (:func:`handle`,
``st.cache_resource``), its named analyses and its named queries (``trustscope/sql/queries/*.sql``). Each function
here that reads the logs is declared with :func:`cached`: it takes the handle as its first argument, and is called
without it; its result is kept by ``st.cache_data`` under the log directory and :meth:`LogDB.version` (which changes
when a file lands), so a run that is still writing gets fresh results as soon as a new file lands and cached ones
otherwise. Figures are built once per input by :func:`figure`. The run table, seed groups and the collapse early
warning are :mod:`trustscope.report`'s, shared with the report. The overview pages read :meth:`LogDB.overview`
(exact from the summaries table where a run has one, else from its logged rows, which :func:`sources` says per
run), the report's source too; the token-level pages read the rows of a step window.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import streamlit as st

from app.launch import FOCUS_ENV, LOGDIR_ENV, default_logdir
from trustscope import db, early_warning, figures, report, report_where, runformat
from trustscope.db import LogDB, Overview
from trustscope.losses import list_losses
from trustscope.rule_settings import SETTINGS_ENV, rule_params_of

if TYPE_CHECKING:
    import plotly.graph_objects as go

P = ParamSpec("P")
R = TypeVar("R")

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
CONTRAST_RULES = ("pg_is", "cispo")
"""Rules without a trust region: next after the baseline in the default selection of runs (when logged), so that it
holds a run whose pi drifts from mu unbounded beside the ones whose rules bound it."""
COUNTERFACTUAL_RULE = "dppo_binary_tv"
RULE_PARAMS_KEY = "rule_params"
"""Where the parameter panel keeps the session's rule parameters (rule -> parameters)."""
"""The counterfactual page's default second rule: the paper's DPPO binary TV."""
WINDOW_TOKENS = 1_000_000
"""Logged tokens the token-level pages read by default (the last steps of a run up to this many)."""
SQL_ROW_LIMIT = db.DEFAULT_MAX_ROWS
WARNING_LINES = early_warning.WarningLines()
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
    if runformat.is_remote(chosen):
        st.session_state["logdir"] = chosen
        return chosen
    path = Path(chosen).expanduser().resolve()
    st.session_state["logdir"] = str(path)
    return path


_outside = threading.local()
"""The log directory :func:`outside_session` set on this thread (``logdir``), read in place of a session's."""


@contextlib.contextmanager
def outside_session(logdir: str) -> Iterator[None]:
    """On this thread, every :func:`cached` read is of ``logdir`` at the rule parameters the dashboard was started
    with (``--rule``): what a session opening a page reads before its parameter panel is touched, so that a read
    made here (:func:`prepare`, in the server's start) fills the very cache entry the page then hits."""
    _outside.logdir = logdir
    try:
        yield
    finally:
        del _outside.logdir


def current_logdir() -> str:
    outside = getattr(_outside, "logdir", None)
    if outside is not None:
        return outside
    if "logdir" not in st.session_state:
        resolve_logdir([])
    return st.session_state["logdir"]


def check_logdir(logdir: Path | str) -> None:
    """Raise :class:`LogDirError` when ``logdir`` is missing, not a directory, or holds no run at all; show an
    error naming each run that cannot be read whole and why (:attr:`trustscope.db.LogDB.broken_runs`: a manifest
    that is not JSON, a data file whose Parquet footer does not read). What still reads of such a run is shown,
    and the other runs as they are."""
    remote = runformat.is_remote(logdir)
    if remote:
        try:
            ours = _db(str(logdir))
            ours.refresh()  # the mirror, brought up to date, and its runs checked
            logdir = ours.paths[0]
        except (runformat.StorageError, ValueError) as exc:
            raise LogDirError(f"The object store prefix cannot be read: {exc}") from None
    if not logdir.exists():
        raise LogDirError(f"The log directory `{logdir}` does not exist. Start the dashboard with "
                          "`trustscope dashboard LOGDIR` pointing at a directory a run writes to.")
    if not logdir.is_dir():
        raise LogDirError(f"`{logdir}` is a file, not a log directory.")
    if not runformat.run_dirs(logdir):
        raise LogDirError(f"The log directory `{logdir}` holds no runs yet (no `<run>/{runformat.MANIFEST}`). "
                          "Runs appear here once a trainer with a TokenLogger starts writing into it; "
                          "reload the page then.")
    if not remote:
        ours = handle()
        ours.refresh()  # new runs and files, each file's footer read once
    version(fresh=True)
    for run, problem in sorted(ours.broken_runs.items()):
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
    except (runformat.SchemaError, duckdb.Error, pa.ArrowException, OSError) as exc:
        logdir = current_logdir()
        st.error(f"Could not read the logs in `{logdir}`: {_first_line(exc)}\n\n"
                 f"Run `trustscope validate {logdir}` to list every broken file. A run that is still being "
                 "written is read again on the next refresh.", icon=":material/error:")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


# ------------------------------------------------------------------------------------------------ caching


@st.cache_resource(show_spinner=False, max_entries=4, on_release=lambda ours: ours.close())
def _connect(logdir: str, rules: str) -> LogDB:
    """One query-layer handle per log directory and rule parameters (``rules``: JSON of ``rule_params``), shared by
    every session; it keeps the per-file step aggregates between refreshes."""
    return db.connect(logdir, rule_params=json.loads(rules) or None)


def _db(logdir: str) -> LogDB:
    """The handle of ``logdir`` at the rule parameters of this session (:func:`rule_params`)."""
    return _connect(logdir, json.dumps(rule_params(), sort_keys=True))


def launch_rule_params() -> dict[str, dict]:
    """The rule parameters ``trustscope dashboard --rule`` set (:data:`SETTINGS_ENV`, one setting a line)."""
    text = os.environ.get(SETTINGS_ENV, "").strip()
    return rule_params_of(text.splitlines()) if text else {}


def rule_params() -> dict[str, dict]:
    """The rule parameters the pages evaluate rules at: ``--rule``'s, with the parameter panel's on top
    (:func:`app.widgets.rule_panel`, kept in the session); outside a session (:func:`outside_session`) ``--rule``'s."""
    if getattr(_outside, "logdir", None) is not None:
        return launch_rule_params()
    return {**launch_rule_params(), **st.session_state.get(RULE_PARAMS_KEY, {})}


VERSION_TTL_S = 1.0
"""How long a read :meth:`LogDB.version` stands for the log directory's files (it stats every file, and every cached
read asks for it); each page run reads it afresh first (:func:`check_logdir`), so only a fragment that reruns on
its own within a second of the last read sees the files as they were then."""
_versions: dict[str, tuple[float, str]] = {}


def version(logdir: str | None = None, fresh: bool = False) -> str:
    """The current log directory's (or ``logdir``'s) :meth:`LogDB.version`, read at most once per
    :data:`VERSION_TTL_S` unless ``fresh``."""
    logdir = logdir or current_logdir()
    now = time.monotonic()
    read_at, value = _versions.get(logdir, (-VERSION_TTL_S, ""))
    if fresh or now - read_at >= VERSION_TTL_S:
        value = _db(logdir).version()
        _versions[logdir] = (now, value)
    return value


def handle() -> LogDB:
    """The query-layer handle of the current log directory (for the rare caller that needs the handle itself;
    read through :func:`cached` functions otherwise)."""
    return _db(current_logdir())


def cached(fn: Callable[Concatenate[LogDB, P], R]) -> Callable[P, R]:
    """Declare a read of the logs: ``fn(handle, *args)`` becomes ``fn(*args)`` on the current log directory, its
    result kept by ``st.cache_data`` under the directory, :meth:`LogDB.version` and the arguments (hashable
    values: strings, numbers, tuples, lists)."""
    def keyed(logdir: str, version: str, rules: str, *args: P.args, **kwargs: P.kwargs) -> R:
        return fn(_connect(logdir, rules), *args, **kwargs)

    keyed.__module__, keyed.__qualname__, keyed.__name__ = fn.__module__, fn.__qualname__, fn.__name__
    store = st.cache_data(show_spinner=False, max_entries=256)(keyed)

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        logdir = current_logdir()
        return store(logdir, version(logdir), json.dumps(rule_params(), sort_keys=True), *args, **kwargs)

    call.__module__, call.__qualname__, call.__name__, call.__doc__ = (
        fn.__module__, fn.__qualname__, fn.__name__, fn.__doc__)
    call.clear = store.clear  # type: ignore[attr-defined]
    call.store = store  # type: ignore[attr-defined]  (keyed by hand: :func:`prepare`, outside a session)
    return call


def _qualified_name(fn: FunctionType) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


@st.cache_data(show_spinner=False, max_entries=128, hash_funcs={FunctionType: _qualified_name})
def _figure(builder: Callable[..., go.Figure], args: tuple, kwargs: dict) -> dict:
    return builder(*args, **kwargs).to_plotly_json()


def figure(builder: Callable[P, go.Figure], *args: P.args, **kwargs: P.kwargs) -> dict:
    """``builder(*args, **kwargs)`` (a :mod:`trustscope.figures` builder) as plotly JSON, kept per input: a
    revisit of a page skips plotly's figure building, which costs more than the cached queries behind it."""
    return _figure(builder, args, kwargs)


def prepare(logdir: str | Path, then: Sequence[tuple[str, Callable[[list[str]], object]]] = ()) -> list[str]:
    """Compute, outside any session (:func:`outside_session`), what the first page (Runs) reads when it opens with
    its default comparison, into the same caches the page then hits: the run table, the overview, the default
    runs' accuracy scalars and early-warning signals, their collapse warnings with each warning's cause, then each
    of ``then``'s ``(name, read(run_ids))`` over the same runs (the server passes the Doctor section's), at the
    rule parameters the dashboard was started with (``--rule``). The server calls it while it starts
    (``app/serve.py``), so the first page reads what is ready instead of computing it after the browser asked.
    Returns the names of what it prepared; a log directory that cannot be read is left for the page to report
    (nothing raised)."""
    chosen = str(logdir) if runformat.is_remote(str(logdir)) else str(Path(logdir).expanduser().resolve())
    done: list[str] = []
    with outside_session(chosen):
        try:
            version(chosen, fresh=True)
            table = runs()
            done.append("runs")
            overview()
            done.append("overview")
            if not len(table):
                return done
            members = table.loc[table["group"].isin(default_comparison(table, "group")), "run_id"].tolist()
            _step_scalars(tuple(members))
            _early_signals(tuple(members))
            done.append("default comparison")
            warning_causes(collapse_warnings(members))
            done.append("collapse warning")
            for name, read in then:
                read(members)
                done.append(name)
        except Exception:  # the page reads the same and reports what went wrong where the user sees it
            return done
    return done
    return done


# ------------------------------------------------------------------------------------------------ runs


@cached
def runs(ours: LogDB) -> pd.DataFrame:
    """Runs with at least one logged step (:func:`trustscope.report.run_table`): run_id, loss_rule, status,
    n_steps, first/last step, tokens_generated, tokens_logged, logged_frac, mean_reward, updated_at, group."""
    return report.run_table(ours)


@cached
def overview(ours: LogDB) -> Overview:
    """:meth:`LogDB.overview` of every run (read once; the functions below filter it): exact from the summaries
    table where a run has one, else from its logged token rows, as ``sources`` says."""
    return ours.overview()


def _of(view: Overview, run_ids: Sequence[str]) -> Overview:
    """The part of ``view`` about ``run_ids``."""
    wanted = list(run_ids)
    return Overview(view.steps[view.steps["run_id"].isin(wanted)].reset_index(drop=True),
                    view.blocked[view.blocked["run_id"].isin(wanted)].reset_index(drop=True),
                    view.sources[view.sources["run_id"].isin(wanted)].reset_index(drop=True))


def sources(run_ids: Sequence[str]) -> pd.DataFrame:
    """``run_id, exact, token_fraction, source`` of ``run_ids``: where their overview figures come from."""
    return _of(overview(), run_ids).sources


def run_rule(run_id: str) -> str | None:
    """The rule the run's trainer applied (None when its manifest and tokens do not say)."""
    table = runs().set_index("run_id")
    rule = table.loc[run_id, "loss_rule"] if run_id in table.index else None
    return None if rule is None or pd.isna(rule) else str(rule)


def step_range(run_id: str) -> tuple[int, int]:
    row = runs().set_index("run_id").loc[run_id]
    return int(row["first_step"]), int(row["last_step"])


def window_start(run_id: str, tokens: int = WINDOW_TOKENS) -> int:
    """The first step of the longest run of final steps of ``run_id`` whose logged token rows add up to at most
    ``tokens`` (at least the last step). Counted from the overview, so choosing a window reads no token row: a
    step's logged rows are its tokens times the run's ``token_fraction`` where the figures are exact."""
    view = _of(overview(), [run_id])
    steps = view.steps.sort_values("step", ascending=False)
    if steps.empty:
        return step_range(run_id)[0]
    fraction = 1.0
    if len(view.sources) and bool(view.sources["exact"].iloc[0]):
        given = view.sources["token_fraction"].iloc[0]
        fraction = 1.0 if given is None or pd.isna(given) else float(given)
    within = steps[(steps["n_tokens"] * fraction).cumsum() <= tokens]
    return int(within["step"].min()) if len(within) else int(steps["step"].iloc[0])


NEWEST_APART_S = 3600.0
"""A run updated this long after every other run of the folder is the one the dashboard opens on (the demo's run,
trained beside the shipped ones; a run just trained into a folder of older runs): runs of one sweep, a few
minutes apart, leave the default comparison as it is."""


def focus_run(table: pd.DataFrame) -> str | None:
    """The run the dashboard was opened for: ``$TRUSTSCOPE_FOCUS_RUN`` (``trustscope demo`` sets it to its run)
    where it names a run here, else the newest run of the folder where its manifest was updated at least
    :data:`NEWEST_APART_S` after every other run's (run.json's ``updated_at``); None otherwise."""
    named = os.environ.get(FOCUS_ENV, "")
    if named in set(table["run_id"]):
        return named
    stamps = table[["run_id", "updated_at"]].dropna().sort_values("updated_at")
    if len(stamps) < 2:
        return None
    newest, before = stamps.iloc[-1], stamps.iloc[-2]
    if (newest["updated_at"] - before["updated_at"]).total_seconds() >= NEWEST_APART_S:
        return str(newest["run_id"])
    return None


def default_run(table: pd.DataFrame) -> str:
    """The run the drill-down pages open on: the run the dashboard was opened for (:func:`focus_run`), else the
    first run of the Runs page's default comparison."""
    focus = focus_run(table)
    if focus is not None:
        return focus
    first = default_comparison(table, "group")[0]
    return str(table.loc[table["group"] == first, "run_id"].iloc[0])


def default_comparison(table: pd.DataFrame, column: str, limit: int = 4) -> list[str]:
    """The seed groups (``column`` 'group') or runs ('run_id') the Runs page compares by default: the PPO-clip
    baseline, then one configuration per other rule, those of :data:`CONTRAST_RULES` first, at most ``limit``: per
    rule the one with the most seeds, and among those only the ones with at least the baseline's seeds when there
    are any. The run the dashboard was opened for (:func:`focus_run`: the one ``trustscope demo`` names, or a
    folder's newest run trained apart from the others) comes first, so every page opens on it."""
    seeds = table.groupby(column, sort=False)["run_id"].transform("size")
    # per rule, the configuration with the most seeds (a sweep's runs before a one-seed probe beside them)
    first = table.assign(seeds=seeds).sort_values("seeds", ascending=False, kind="stable").drop_duplicates(column)
    baseline = first[first["loss_rule"] == BASELINE_RULE].head(1)
    others = first[first["loss_rule"] != BASELINE_RULE].drop_duplicates("loss_rule")
    if len(baseline):
        matched = others[others["seeds"] >= baseline["seeds"].iloc[0]]
        others = matched if len(matched) else others
    contrast = others["loss_rule"].isin(CONTRAST_RULES)
    others = pd.concat([others[contrast], others[~contrast]])
    picked = baseline[column].tolist() + others[column].tolist()
    focus = table.loc[table["run_id"] == focus_run(table), column]
    if len(focus):  # the run the dashboard was opened for (the demo's) first, beside the comparison
        picked = [focus.iloc[0], *(c for c in picked if c != focus.iloc[0])]
    return picked[:limit]


@cached
def _step_scalars(ours: LogDB, run_ids: tuple[str, ...]) -> pd.DataFrame:
    return ours.query("step_scalars", run_ids=list(run_ids), names=list(ACCURACY_NAMES))


def step_metrics(run_ids: Sequence[str]) -> pd.DataFrame:
    """Long form ``run_id, step, name, value`` for the metrics of :data:`METRIC_TITLES`, from :func:`overview`
    and the logged accuracy scalars."""
    steps = _of(overview(), run_ids).steps
    wide = steps[["run_id", "step", "reward_mean", "mismatch_mean", "entropy_mean"]].rename(
        columns={"reward_mean": "reward", "mismatch_mean": "mismatch", "entropy_mean": "entropy"})
    long = wide.melt(id_vars=["run_id", "step"], var_name="name", value_name="value").dropna(subset=["value"])
    scalars = _step_scalars(tuple(run_ids))
    rank = scalars["name"].map({n: i for i, n in enumerate(ACCURACY_NAMES)})
    best = rank.groupby(scalars["run_id"]).transform("min")
    accuracy = scalars[rank == best].assign(name="accuracy")
    return pd.concat([long, accuracy], ignore_index=True)


SIGNAL_TITLES = {
    "ess_frac": "ESS of pi/mu (share of tokens)",
    "seq_log_ratio_p99": "p99 |mean log(pi/mu)| a response",
    "mismatch_mean": "mismatch mean |pi - mu|",
    "entropy_slope": "entropy slope (nats a step, last 10 steps)",
    "grad_norm": "grad norm",
    "bad_negative_rate": "bad negative updates (share of tokens)",
}
"""The early-warning signals the Runs and Live pages draw, from the ``early_signals`` view (exact over every
token; docs/experiments.md says which of them warn)."""


@cached
def _early_signals(ours: LogDB, run_ids: tuple[str, ...]) -> pd.DataFrame:
    return ours.query("early_signals", run_ids=list(run_ids))


def early_signals(run_ids: Sequence[str]) -> pd.DataFrame:
    """Long form ``run_id, step, name, value`` of :data:`SIGNAL_TITLES` (runs without a summaries table, or
    logged before the importance-weight rows, have none or only some)."""
    wide = _early_signals(tuple(run_ids))
    names = [n for n in SIGNAL_TITLES if n in wide.columns]
    long = wide[["run_id", "step", *names]].melt(id_vars=["run_id", "step"], var_name="name", value_name="value")
    return long.dropna(subset=["value"]).reset_index(drop=True)


def blocked_by_rule(run_ids: Sequence[str], labels: dict[str, str] | None = None) -> pd.DataFrame:
    """``run_id, step, rule, n_blocked, n_tokens, blocked_frac`` (over the tokens with A != 0) for every rule that
    blocks anything in these runs, in registry order (:meth:`trustscope.db.Overview.blocked_by_rule`: the runs of
    one label in ``labels`` added up)."""
    df = _of(overview(), run_ids).blocked_by_rule(labels)
    order = {r: i for i, r in enumerate(figures.rule_order(df["rule"].unique()))}
    return df.sort_values(["rule", "run_id", "step"], key=lambda c: c.map(order) if c.name == "rule" else c,
                          kind="stable").reset_index(drop=True)


def blocked_totals(run_ids: Sequence[str], labels: dict[str, str] | None = None) -> pd.DataFrame:
    """``run_id, rule, n_blocked, n_tokens, blocked_frac`` over every step of these runs (A != 0 tokens), the
    runs of one label in ``labels`` added up (:meth:`trustscope.db.Overview.blocked_totals`)."""
    return _of(overview(), run_ids).blocked_totals(labels)


def bad_updates(run_id: str) -> pd.DataFrame:
    """``step, bad_rate, n_bad_negative, n_negative, n_tokens, reward, reward_fluctuation`` per step, from
    :func:`overview` (exact where the run has summaries)."""
    df = _of(overview(), [run_id]).bad_updates().sort_values("step")
    return pd.DataFrame({
        "step": df["step"], "bad_rate": df["bad_negative_rate"], "n_bad_negative": df["n_bad_negative"],
        "n_negative": df["n_negative"], "n_tokens": df["n_tokens"], "reward": df["reward_mean"],
        "reward_fluctuation": df["reward_change"],
    }).reset_index(drop=True)


def collapse_warnings(run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run and step, :func:`trustscope.early_warning.collapse_warnings` over :func:`overview` and the runs'
    early-warning signals: the fitted detector where a run has them, :data:`WARNING_LINES` elsewhere."""
    return early_warning.collapse_warnings(_of(overview(), run_ids), list(run_ids), WARNING_LINES,
                                    signals=_early_signals(tuple(run_ids)))


@cached
def _warning_causes(ours: LogDB, firsts: tuple[tuple[str, int], ...], window: int) -> dict[str, str]:
    from trustscope.explain.warning import warning_causes as causes_of

    warned = pd.DataFrame(list(firsts), columns=["run_id", "step"]).assign(warning=True)
    return {run_id: cause.sentence() for run_id, cause in causes_of(ours, warned, window).items()}


def warning_causes(warnings: pd.DataFrame) -> dict[str, str]:
    """run_id -> the clause naming what drives its collapse warning (:mod:`trustscope.explain.warning`), for the
    runs that warn in ``warnings`` (rows of :func:`collapse_warnings`)."""
    on = warnings[warnings["warning"].astype(bool)]
    firsts = tuple((str(r), int(s)) for r, s in on.groupby("run_id")["step"].min().items())
    return _warning_causes(firsts, WARNING_LINES.window) if firsts else {}


# ------------------------------------------------------------------------------------------------ token windows


@cached
def ratio_points(ours: LogDB, run_id: str, steps: tuple[int, int]) -> pd.DataFrame:
    """A uniform sample of at most 8,000 tokens of the window: mu, ratio, tv, topk_tv, mu_bucket."""
    return ours.query("ratio_points", run_id=run_id, first_step=steps[0], last_step=steps[1])


@cached
def spread_by_bucket(ours: LogDB, run_id: str, steps: tuple[int, int]) -> pd.DataFrame:
    """Per mu bucket of the window: the 99th percentiles of |ratio - 1| and binary TV, and the token count."""
    return ours.query("spread_by_bucket", run_id=run_id, first_step=steps[0], last_step=steps[1])


@cached
def ratio_histogram(ours: LogDB, run_id: str, divergence: str) -> pd.DataFrame:
    """The query layer's ratio-versus-divergence histogram of every token of the run, with bin centres:
    mu_bucket, ratio, divergence, n."""
    df = ours.ratio_vs_divergence(run_ids=[run_id], divergences=[divergence])
    df = df[(df["ratio_lo"] > 0) & (df["divergence_lo"] > 0)]
    return pd.DataFrame({
        "mu_bucket": df["mu_bucket"],
        "ratio": (df["ratio_lo"] * df["ratio_hi"]) ** 0.5,
        "divergence": (df["divergence_lo"] * df["divergence_hi"]) ** 0.5,
        "n": df["n"],
    }).reset_index(drop=True)


@cached
def rules_by_bucket(ours: LogDB, run_id: str, steps: tuple[int, int]) -> pd.DataFrame:
    """``rule, mu_bucket, adv_sign, n_tokens, n_blocked, blocked_frac`` over the A != 0 tokens of the window."""
    return ours.query("rules_by_bucket", run_id=run_id, first_step=steps[0], last_step=steps[1])


def masking_rules(run_id: str) -> list[str]:
    """The registered rules that would block at least one token (A != 0) of the run, in registry order: those the
    overview counts over every step, and those blocking a logged token of the default step window
    (:func:`window_start`), so a rule registered after the run was logged, which its summaries table cannot hold,
    is offered too, at a cost bounded however long the run grows."""
    window = rules_by_bucket(run_id, (window_start(run_id), step_range(run_id)[1]))
    blocked = _of(overview(), [run_id]).blocked
    blocking = {*window.loc[window["n_blocked"] > 0, "rule"],
                *blocked.loc[(blocked["advantage_side"] == "all") & (blocked["n_blocked"] > 0), "rule"]}
    return [r for r in list_losses() if r in blocking]


@cached
def clipped_tokens(ours: LogDB, run_id: str, rule: str, steps: tuple[int, int], adv_sign: str, min_count: int,
                   top: int) -> pd.DataFrame:
    """``text, token_id, n_blocked, n_occurrences, block_rate, mean_mu, mu_bucket, mean_entropy``: the tokens
    ``rule`` blocks at the highest rate in the step window (``adv_sign`` 'A>0', 'A<0' or 'any')."""
    return ours.query("clipped_by_rate", run_id=run_id, rule=rule, first_step=steps[0], last_step=steps[1],
                      adv_sign=adv_sign, min_count=int(min_count), top=int(top))


@cached
def counterfactual(ours: LogDB, run_id: str, rule_a: str, rule_b: str, steps: tuple[int, int]) -> pd.DataFrame:
    """Every A != 0 token of the window one of the two rules blocks and the other keeps: step, rank, sample_id,
    pos, token_text, blocked_by, kept_by, adv_sign, mu_bucket, mu_prob, pi_prob, ratio, binary_tv, advantage."""
    return ours.query("counterfactual_tokens", run_id=run_id, rule_a=rule_a, rule_b=rule_b, first_step=steps[0],
                      last_step=steps[1])


@cached
def equal_budget(ours: LogDB, run_id: str, budget: float | None = None) -> pd.DataFrame:
    """:meth:`LogDB.equal_budget` of one run: each rule's threshold at the run's rule's share (or ``budget``),
    over the cached :func:`overview` (no second read of the summaries)."""
    from trustscope.query.budget import equal_budget as solve

    return solve(ours, [run_id], budget, overview=overview())


@cached
def threshold_curve(ours: LogDB, run_id: str) -> pd.DataFrame:
    """:meth:`LogDB.threshold_curve`: blocked share against each rule's threshold."""
    return ours.threshold_curve(run_id)


@cached
def budget_picks(ours: LogDB, run_id: str, budget: float | None = None) -> pd.DataFrame:
    """:meth:`LogDB.budget_picks` at the equal budget of :func:`equal_budget` (its cached result)."""
    return ours.budget_picks(run_id, equal_budget(run_id, budget))


@cached
def budget_overlap(ours: LogDB, run_id: str, rule_a: str, rule_b: str, budget: float | None = None) -> pd.DataFrame:
    """:meth:`LogDB.budget_overlap` of two rules at the equal budget of :func:`equal_budget`."""
    return ours.budget_overlap(run_id, equal_budget(run_id, budget), rule_a, rule_b)


# ------------------------------------------------------------------------------------------------ one response


@cached
def samples(ours: LogDB, run_id: str, step: int) -> pd.DataFrame:
    """The responses of one step whose tokens were logged (``token_fraction`` may leave some out), with
    ``n_logged`` and ``n_blocked`` (by the trainer's own rule)."""
    df = ours.samples(run_ids=[run_id], steps=[int(step)])
    logged = ours.query("logged_samples", run_id=run_id, step=int(step))
    return df.merge(logged, on="sample_id").sort_values("sample_id").reset_index(drop=True)


@cached
def explorer_start(ours: LogDB, run_id: str) -> tuple[int, int] | None:
    """``(step, sample_id)`` the token explorer opens on: the latest step with a blocked token, its response
    with the most blocked tokens."""
    df = ours.query("explorer_start", run_id=run_id)
    return None if df.empty else (int(df["step"].iloc[0]), int(df["sample_id"].iloc[0]))


@cached
def _alternatives(ours: LogDB, run_id: str, step: int, sample_id: int) -> pd.DataFrame:
    return ours.query("sample_alternatives", run_id=run_id, step=int(step), sample_id=int(sample_id))


@cached
def sample_tokens(ours: LogDB, run_id: str, step: int, sample_id: int) -> pd.DataFrame:
    """The tokens of one response: pos, text, mu, pi, ratio, tv, advantage, blocked (the trainer's own rule),
    ``blocks_<rule>`` for every rule, and ``alternatives`` (mu's top-K with pi's probabilities, as hover
    text)."""
    metrics = ours.sample_tokens(run_id=run_id, step=int(step), sample_id=int(sample_id))
    alts = ours.query("sample_alternatives", run_id=run_id, step=int(step), sample_id=int(sample_id))
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
    alts = _alternatives(run_id, step, sample_id)
    row = alts[alts["pos"] == pos]
    if row.empty or not isinstance(row["alt_texts"].iloc[0], list | tuple | np.ndarray):
        return pd.DataFrame(columns=["rank", "text", "mu", "pi", "pi - mu"])
    texts, mus = list(row["alt_texts"].iloc[0]), [float(p) for p in row["alt_probs"].iloc[0]]
    pis = row["alt_pi_probs"].iloc[0]
    pis = [float(p) for p in pis] if isinstance(pis, list | tuple | np.ndarray) and len(pis) else [np.nan] * len(mus)
    out = pd.DataFrame({"rank": range(1, len(texts) + 1), "text": [repr(t) for t in texts], "mu": mus, "pi": pis})
    out["pi - mu"] = out["pi"] - out["mu"]
    return out


# ------------------------------------------------------------------------------------------------ SQL console


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
        result = handle().sql(sql, max_rows=SQL_ROW_LIMIT)
    except (db.QueryRefused, db.QueryStopped, duckdb.Error) as exc:
        return SqlResult(pd.DataFrame(), False, time.perf_counter() - start, _first_line(exc))
    return SqlResult(result.to_pandas(), result.truncated, time.perf_counter() - start)


@cached
def view_columns(ours: LogDB, view: str) -> pd.DataFrame:
    """``column, type`` of one view (for the SQL console's column browser)."""
    def columns(cur: duckdb.DuckDBPyConnection) -> pd.DataFrame:
        rel = cur.view(view)
        return pd.DataFrame({"column": rel.columns, "type": [str(t) for t in rel.types]})

    return ours.read(columns)  # read again where a compaction swapped a rank folder under the read


# ------------------------------------------------------------------------------------------------ by dimension


@cached
def by_routing(ours: LogDB, run_ids: tuple[str, ...]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """How much of the mismatch routing explains (:func:`trustscope.report_where.by_routing`): the ``routing_mismatch``
    rows (run_id, split, bucket, label, n_tokens, n_disagree, mean_abs, mean_abs_full, mean_abs_disagree,
    abs_share), the ``routing_blocked`` rows (run_id, rule, agreement, n_blocked, n_nonzero_advantage,
    blocked_frac) and the ``routing_agreement`` rows (run_id, dimension, bucket, label, n_tokens, agreement)."""
    return report_where.by_routing(ours, list(run_ids))


@cached
def routing_sides(ours: LogDB, run_ids: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Per mixture-of-experts run, the token rows with the engine's and with the trainer's routed experts
    (:func:`trustscope.report_where.routing_sides`): what a run with one side alone shows."""
    return report_where.routing_sides(ours, list(run_ids))


@cached
def by_dimension(ours: LogDB, run_ids: tuple[str, ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Where the mismatch lives, exact over every step (:func:`trustscope.report_where.by_dimension`): the
    ``mismatch_by_dimension`` rows (run_id, dimension, bucket, bucket_label, n_tokens, mismatch_mean, ess_frac,
    ...) and the ``blocked_by_dimension`` rows (run_id, dimension, bucket, bucket_label, rule, n_blocked,
    n_nonzero_advantage, blocked_frac)."""
    return report_where.by_dimension(ours, list(run_ids))
