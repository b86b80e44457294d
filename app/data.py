"""Cached access to a log directory for the dashboard pages.

Every query goes through :mod:`trustscope.db`: one DuckDB connection per log directory (``st.cache_resource``), a
cursor per query, and results cached with ``st.cache_data`` under the log directory plus a fingerprint of its file
list, so a run that is still writing files gets fresh results as soon as a new file lands and cached ones otherwise.
Queries the query layer does not offer as named analyses live in ``app/sql/*.sql`` and take bound parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
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

from app import charts
from app.launch import LOGDIR_ENV, default_logdir
from trustscope import db, schema
from trustscope.losses import list_losses

SQL_DIR = Path(__file__).resolve().parent / "sql"

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
VIEWS = db.VIEWS
BAD_DELTA = db.ANALYSIS_DEFAULTS["bad_negative_delta"]
"""mu - pi at or above this on an A < 0 token makes a bad negative update (the paper's Mask-0.5 threshold)."""
DEFAULT_RULES = ("ppo_clip", "grpo", "dppo_binary_tv", "dppo_topk_tv", "ppo_lowprob_relax", "minimal_negative_mask")
"""Rules shown side by side until the user picks others."""
WINDOW_TOKENS = 1_000_000
"""Tokens the token-level pages read by default (the last steps of a run up to this many)."""
SQL_ROW_LIMIT = db.DEFAULT_MAX_ROWS
COLOUR_LEGEND = {
    "ratio": "Blue: pi below mu (ratio < 1), red: pi above mu; full colour at a factor of 4.",
    "tv": "White: no probability moved; red: |pi - mu| of 0.3 or more.",
    "advantage": "Blue: negative advantage, red: positive; full colour at |A| = 2.",
    "blocked": "Red: the trainer's own rule blocked the token's gradient.",
}
EXAMPLE_SQL = """select run_id, step, mismatch_mean, bad_negative_rate, blocked_frac__grpo, blocked_frac__dppo_binary_tv
from step_summary
order by run_id, step"""


class LogDirError(Exception):
    """A log directory the dashboard cannot show; the message says what is wrong and what to do."""


# ------------------------------------------------------------------------------------------------ the log dir


def resolve_logdir(argv: Sequence[str]) -> Path:
    """``--logdir`` from the script's arguments, else ``$TRUSTSCOPE_LOGDIR``, else the sample logs."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--logdir")
    known, _ = parser.parse_known_args(list(argv))
    chosen = known.logdir or os.environ.get(LOGDIR_ENV) or default_logdir()
    path = Path(chosen).expanduser().resolve()
    st.session_state["logdir"] = str(path)
    return path


def current_logdir() -> str:
    if "logdir" not in st.session_state:
        resolve_logdir([])
    return st.session_state["logdir"]


def check_logdir(logdir: Path) -> None:
    """Raise :class:`LogDirError` when ``logdir`` is missing, not a directory, or holds no run at all; show an
    error naming each run whose manifest is unreadable (the other runs are still shown)."""
    if not logdir.exists():
        raise LogDirError(f"The log directory `{logdir}` does not exist. Start the dashboard with "
                          "`trustscope dashboard LOGDIR` pointing at a directory a run writes to.")
    if not logdir.is_dir():
        raise LogDirError(f"`{logdir}` is a file, not a log directory.")
    if not schema.run_dirs(logdir):
        raise LogDirError(f"The log directory `{logdir}` holds no runs yet (no `<run>/{schema.MANIFEST}`). "
                          "Runs appear here once a trainer with a TokenLogger starts writing into it; "
                          "reload the page then.")
    for run_dir in schema.run_dirs(logdir):
        if (run_dir / schema.MANIFEST).exists():
            try:
                schema.read_manifest(run_dir)
            except schema.SchemaError as exc:
                st.error(f"Could not read the logs of run `{run_dir.name}`: {_first_line(exc)}\n\nThe other runs "
                         f"are shown. Run `trustscope validate {logdir}` to list every broken file.",
                         icon=":material/error:")


def _data_files(logdir: Path) -> Iterator[os.DirEntry]:
    for run_dir in schema.run_dirs(logdir):
        with contextlib.suppress(FileNotFoundError):
            yield from (e for e in os.scandir(run_dir) if e.is_file())
        for table in schema.TABLES:
            with contextlib.suppress(FileNotFoundError):
                yield from (e for e in os.scandir(run_dir / table) if schema.is_data_file(Path(e.name)))


def fingerprint(logdir: str | None = None) -> str:
    """A hash of every finished data file's path, size and modification time under the log directory."""
    h = hashlib.blake2b(digest_size=12)
    for entry in sorted(_data_files(Path(logdir or current_logdir())), key=lambda e: e.path):
        with contextlib.suppress(FileNotFoundError):
            stat = entry.stat()
            h.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()


def file_count(logdir: str | None = None) -> int:
    return sum(1 for _ in _data_files(Path(logdir or current_logdir())))


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


@st.cache_data(show_spinner=False, max_entries=256)
def _analysis(logdir: str, fp: str, method: str, kwargs: tuple[tuple[str, object], ...]) -> pd.DataFrame:
    """A named analysis of :class:`trustscope.db.LogDB` (it refreshes itself: new files are picked up)."""
    return getattr(_db(logdir), method)(**{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs})


@st.cache_data(show_spinner=False, max_entries=256)
def _sql_file(logdir: str, fp: str, name: str, params: tuple[tuple[str, object], ...]) -> pd.DataFrame:
    """``app/sql/<name>.sql`` with bound parameters, on a cursor of the query layer after a refresh."""
    handle = _db(logdir)
    handle.refresh()
    cur = handle.cursor()
    try:
        return cur.execute((SQL_DIR / f"{name}.sql").read_text(),
                           {k: list(v) if isinstance(v, tuple) else v for k, v in params}).df()
    finally:
        cur.close()


def _frozen(params: dict[str, object]) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in params.items()))


def _key() -> tuple[str, str]:
    logdir = current_logdir()
    return logdir, fingerprint(logdir)


def analysis(method: str, **kwargs: object) -> pd.DataFrame:
    """Cached result of ``LogDB.<method>(**kwargs)`` for the current log directory and file list."""
    return _analysis(*_key(), method, _frozen(kwargs))


def query(name: str, **params: object) -> pd.DataFrame:
    """Cached result of ``app/sql/<name>.sql`` with bound ``params`` for the current log directory and file list."""
    return _sql_file(*_key(), name, _frozen(params))


def runs() -> pd.DataFrame:
    """Runs with at least one logged step: run_id, status, loss_rule, n_steps, first/last step, n_samples,
    n_response_tokens, mean_reward, updated_at (last file write, seconds since the epoch)."""
    df = analysis("runs")
    df = df[df["n_steps"] > 0].reset_index(drop=True)
    df["loss_rule"] = [_manifest_rule(m) for m in df["manifest"]]
    df["updated_at"] = pd.to_datetime([_last_write(Path(current_logdir()), r) for r in df["run_id"]], unit="s")
    cols = ["run_id", "status", "loss_rule", "n_steps", "first_step", "last_step", "n_samples",
            "n_response_tokens", "mean_reward", "updated_at"]
    return df[cols]


def _manifest_rule(manifest: object) -> str | None:
    """The run's loss rule: ``loss_rule`` in the manifest, else the trainer config's ``loss``."""
    try:
        parsed = json.loads(manifest) if isinstance(manifest, str) else {}
    except ValueError:
        return None
    config = parsed.get("config") if isinstance(parsed.get("config"), dict) else {}
    return parsed.get("loss_rule") or config.get("loss")


def _last_write(logdir: Path, run_id: str) -> float:
    run_dir = logdir if (logdir / schema.MANIFEST).exists() else logdir / run_id
    stamps = [e.stat().st_mtime for e in _data_files(logdir) if Path(e.path).is_relative_to(run_dir)]
    return max(stamps, default=0.0)


def step_range(run_id: str) -> tuple[int, int]:
    row = runs().set_index("run_id").loc[run_id]
    return int(row["first_step"]), int(row["last_step"])


def default_first_step(run_id: str) -> int:
    """The first step of the longest run of final steps holding at most :data:`WINDOW_TOKENS` tokens (at least
    the last step)."""
    summary = analysis("step_summary", run_ids=[run_id]).sort_values("step", ascending=False)
    if summary.empty:
        return step_range(run_id)[0]
    within = summary[summary["n_tokens"].cumsum() <= WINDOW_TOKENS]
    return int(within["step"].min()) if len(within) else int(summary["step"].iloc[0])


def step_metrics(run_ids: Sequence[str]) -> pd.DataFrame:
    """Long form ``run_id, step, name, value`` for the metrics of :data:`METRIC_TITLES`."""
    summary = analysis("step_summary", run_ids=list(run_ids))
    wide = summary[["run_id", "step", "reward_mean", "mismatch_mean", "entropy_mean"]].rename(
        columns={"reward_mean": "reward", "mismatch_mean": "mismatch", "entropy_mean": "entropy"})
    long = wide.melt(id_vars=["run_id", "step"], var_name="name", value_name="value").dropna(subset=["value"])
    scalars = query("step_scalars", run_ids=list(run_ids), names=list(ACCURACY_NAMES))
    rank = scalars["name"].map({n: i for i, n in enumerate(ACCURACY_NAMES)})
    best = rank.groupby(scalars["run_id"]).transform("min")
    accuracy = scalars[rank == best].assign(name="accuracy")
    return pd.concat([long, accuracy], ignore_index=True)


def blocked_by_rule(run_ids: Sequence[str]) -> pd.DataFrame:
    """``run_id, step, rule, blocked_frac`` over all tokens, for every rule that blocks anything in these runs
    (read off the step summary's ``blocked_frac__<rule>`` columns, the same frame the metrics come from)."""
    summary = analysis("step_summary", run_ids=list(run_ids))
    columns = [c for c in summary.columns if c.startswith("blocked_frac__")]
    df = summary[["run_id", "step", *columns]].melt(id_vars=["run_id", "step"], var_name="rule",
                                                     value_name="blocked_frac")
    df["rule"] = df["rule"].str.removeprefix("blocked_frac__")
    masking = df.groupby("rule")["blocked_frac"].max()
    return df[df["rule"].isin(masking[masking > 0].index)].reset_index(drop=True)


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
    """``rule, mu_bucket, adv_sign, n_tokens, n_blocked, blocked_frac``: every rule on the same tokens (A != 0)."""
    return query("rules_by_bucket", run_id=run_id, first_step=steps[0], last_step=steps[1])


def masking_rules(run_id: str) -> list[str]:
    """The registered rules that would block at least one token of the run, in registry order."""
    blocking = set(blocked_by_rule([run_id])["rule"])
    return [r for r in list_losses() if r in blocking]


def clipped_tokens(run_id: str, rule: str, top: int) -> pd.DataFrame:
    """``text, n_blocked, n_occurrences, block_rate, mean_mu, mu_bucket, mean_entropy``, most blocked first."""
    df = analysis("clipped_tokens", run_ids=[run_id], rules=[rule], top=top)
    texts = [t if isinstance(t, str) else f"#{i}" for t, i in zip(df["token_text"], df["token_id"], strict=True)]
    return pd.DataFrame({
        "text": texts, "n_blocked": df["n_blocked"], "n_occurrences": df["n_occurrences"],
        "block_rate": df["block_rate"], "mean_mu": df["mu_prob_mean"], "mu_bucket": df["mu_bucket"],
        "mean_entropy": df["entropy_mean"],
    })


def bad_updates(run_id: str) -> pd.DataFrame:
    """``step, bad_rate, n_bad_negative, n_negative, n_tokens, reward, reward_fluctuation`` per step."""
    df = analysis("bad_negative_updates", run_ids=[run_id]).sort_values("step")
    return pd.DataFrame({
        "step": df["step"], "bad_rate": df["bad_negative_rate"], "n_bad_negative": df["n_bad_negative"],
        "n_negative": df["n_negative"], "n_tokens": df["n_tokens"], "reward": df["reward_mean"], "reward_fluctuation": df["reward_change"],
    }).reset_index(drop=True)


def samples(run_id: str, step: int) -> pd.DataFrame:
    """The responses of one step whose tokens were logged (``token_fraction`` may leave some out)."""
    df = analysis("samples", run_ids=[run_id], steps=[int(step)])
    logged = query("logged_samples", run_id=run_id, step=int(step))["sample_id"]
    return df[df["sample_id"].isin(logged)].sort_values("sample_id").reset_index(drop=True)


def sample_tokens(run_id: str, step: int, sample_id: int) -> pd.DataFrame:
    """The tokens of one response: pos, text, mu, ratio, tv, advantage, blocked and ``alternatives`` (mu's
    top-K as hover text)."""
    metrics = analysis("sample_tokens", run_id=run_id, step=int(step), sample_id=int(sample_id))
    alts = query("sample_alternatives", run_id=run_id, step=int(step), sample_id=int(sample_id))
    df = pd.DataFrame({
        "pos": metrics["pos"],
        "text": [t if isinstance(t, str) else f"#{i}"
                 for t, i in zip(metrics["token_text"], metrics["token_id"], strict=True)],
        "mu": metrics["mu_prob"], "ratio": metrics["ratio"], "tv": metrics["binary_tv"],
        "advantage": metrics["advantage"], "blocked": ~metrics["kept"].astype(bool),
    }).merge(alts, on="pos", how="left")
    df["alternatives"] = [
        _alternatives_text(texts, probs, rank)
        for texts, probs, rank in zip(df["alt_texts"], df["alt_probs"], df["sampled_rank"], strict=True)
    ]
    return df.drop(columns=["alt_texts", "alt_probs", "sampled_rank"])


def _alternatives_text(texts: object, probs: object, rank: object) -> str:
    if not isinstance(texts, list | tuple | np.ndarray) or len(texts) == 0:
        return "top-K not logged"
    index = None if rank is None or pd.isna(rank) else int(rank) - 1
    return charts.format_alternatives(list(texts), [float(p) for p in probs], index)


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
