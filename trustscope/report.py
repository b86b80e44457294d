"""A run report: a readable terminal summary of every run of a log directory, and an HTML page of charts.

The per-step and per-run figures come from :meth:`trustscope.db.LogDB.overview`, the one source the dashboard's
Runs page reads too: exact from a run's summaries table (every token, whatever ``token_fraction`` kept), else from
its logged token rows, and the report says which for every run. The token-level sections (the tokens a rule blocks
most, the ratio against TV) read the logged rows and say so. The charts are :mod:`trustscope.figures`' builders, the same the dashboard draws. The run table, the grouping of seeds
and the collapse early warning defined here are shared with the dashboard.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from trustscope import schema
from trustscope.db import ANALYSIS_DEFAULTS, LogDB, Overview
from trustscope.query.connection import NoRunsFound as NoRunsFound
from trustscope.query.connection import connect_readable as connect_readable
from trustscope.results import result_table as result_table
from trustscope.results import write_result as write_result

MISMATCH_WARN = 0.01
"""Mean |pi - mu| above which a run is flagged: the paper's DPPO runs stay near 0.003."""
BAD_NEGATIVE_WARN = 0.005
"""Bad negative-update rate above which a run is flagged (the paper finds < 0.5% of tokens drive collapse)."""
CLIPPED_TOP = 10
BUDGET_MAX_ROWS = 500_000
"""The report cuts a run's rules at an equal budget on its logged rows only up to this many (where its summaries
hold no threshold histogram): the cut reads every row, 49 s for 1M rows on a loaded 2-core machine."""
STALE_AFTER_S = 600.0
"""A ``running`` run whose manifest has not been touched for this long reads ``stale`` (its writer may be on
another host, where its process cannot be checked)."""
SEED_KEYS = ("seed", "run_id", "logdir", "resume")
"""Config fields that do not make a different configuration: runs differing only in these are seeds of one."""


@dataclass(frozen=True)
class WarningLines:
    """The collapse early warning: a step warns when, over the last ``window`` steps, the bad negative-update rate
    reaches ``bad_rate`` or the mean |pi - mu| has grown ``mismatch_growth`` times over the run's first window.

    The defaults are twice the paper's 0.5% (on ~400 tokens per window half a percent is two tokens, noise);
    ``docs/experiments.md`` measures how the lines fare on the toy-v2 sample logs (those ``sample_logs/`` held up
    to commit d114d27, ``bench/eval_collapse_warning.py``).

    ``relative_z``: the lines against the run's own baseline instead, so that one setting means the same on a
    model whose normal mismatch is ten times the toy's or a tenth: a step warns when the last ``window`` steps'
    bad-update rate, or their mean |pi - mu|, stands ``relative_z`` robust deviations above the run's first
    ``window`` steps (their median; the deviation 1.4826 x their median absolute deviation, floored by the
    counting noise of the rate, sqrt(max(median, 1 / baseline tokens) / recent tokens), and by 5% of the median
    mismatch). ``bad_rate`` and ``mismatch_growth`` are then not read, and the fitted detector, whose weights are
    absolute, gives way to :data:`RELATIVE_DETECTOR`, fitted on inputs in the run's own terms (see
    :func:`collapse_warnings`)."""

    bad_rate: float = 0.01
    mismatch_growth: float = 2.0
    window: int = 10
    relative_z: float | None = None

    def __post_init__(self) -> None:
        for name in ("bad_rate", "mismatch_growth"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"WarningLines.{name}={value!r} must be a finite number > 0")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"WarningLines.window={self.window!r} must be an integer >= 1")
        if self.relative_z is not None and not (isinstance(self.relative_z, int | float)
                                                and math.isfinite(self.relative_z) and self.relative_z > 0):
            raise ValueError(f"WarningLines.relative_z={self.relative_z!r} must be a finite number > 0 (robust "
                             f"deviations above the run's first steps), or None for the absolute lines")

    def describe(self) -> list[str]:
        """The lines in words, for captions and alerts."""
        if self.relative_z is not None:
            return [f"bad negative updates of the last {self.window} steps {self.relative_z:g} robust deviations "
                    f"above the run's first {self.window} steps",
                    f"mean |pi - mu| of the last {self.window} steps {self.relative_z:g} robust deviations above "
                    f"the run's first {self.window} steps"]
        return [f"bad negative updates reach {self.bad_rate:.1%} of the last {self.window} steps' tokens",
                f"mean |pi - mu| {self.mismatch_growth:g}x the run's first {self.window} steps"]


ROBUST_SCALE = 1.4826
"""The median absolute deviation times this estimates a normal spread's standard deviation."""
MISMATCH_FLOOR = 0.05
"""The relative lines' least deviation of mean |pi - mu|: this share of the baseline's median (a run whose first
steps agree to the digit would otherwise warn on any wiggle); a share, so it scales with the run."""


def robust_z(recent: pd.Series, baseline: pd.Series, floor: pd.Series | float) -> pd.Series:
    """(recent - median(baseline)) / max(1.4826 MAD(baseline), floor): how far ``recent`` stands above the
    baseline in robust deviations."""
    med = float(baseline.median()) if len(baseline.dropna()) else math.nan
    mad = ROBUST_SCALE * float((baseline - med).abs().median()) if len(baseline.dropna()) else math.nan
    scale = np.maximum(mad, floor)
    return (recent - med) / pd.Series(scale, index=recent.index).where(lambda x: x > 0)


@dataclass(frozen=True)
class Detector:
    """The fitted collapse early warning: a logistic score ``bias + sum(weight * mean of the signal over the last
    window steps)`` over columns of the ``early_signals`` view; a step warns once the run has ``window`` steps and
    the score reaches ``threshold``.

    :data:`DETECTOR` is the one fitted on collapsing toy runs and judged on held-out ones (``docs/experiments.md``,
    "An early warning fitted on collapsing runs"; ``bench/eval_early_warning.py`` fits it); it warns on the runs
    whose logs carry its signals, and :class:`WarningLines` on the others (logged before the importance-weight
    summaries)."""

    weights: tuple[tuple[str, float], ...]
    bias: float
    threshold: float
    window: int = 5
    baseline: int | None = None
    """None: the weights apply to the signals' own values (absolute). A number of steps: the detector is relative,
    each signal entering as :func:`relative_signals` gives it, robust deviations of its last ``window`` steps' mean
    above the run's first ``baseline`` steps; a step warns only after the baseline."""

    @property
    def signals(self) -> list[str]:
        return [name for name, _ in self.weights]

    def inputs(self, one_run: pd.DataFrame) -> pd.DataFrame:
        """The values the weights multiply, one row per step of one run (sorted by step)."""
        if self.baseline is not None:
            return relative_signals(one_run, self.signals, self.window, self.baseline)
        return one_run[self.signals].astype(float).rolling(self.window, min_periods=1).mean()

    def score(self, one_run: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """The score of each step of one run's signals (sorted by step) and whether it warns."""
        recent = self.inputs(one_run)
        score = self.bias + sum(weight * recent[name] for name, weight in self.weights)
        n = np.arange(1, len(one_run) + 1)
        full = (n >= self.window) if self.baseline is None else (n > self.baseline) & (n >= self.window)
        return score.to_numpy(), full & (score >= self.threshold).to_numpy()


RELATIVE_FLOOR = 0.05
"""A relative signal's least deviation: this share of its baseline median's size (a signal that barely moves over
the run's first steps would otherwise stand many deviations off on any wiggle); a share, so it scales with the run."""


def relative_signals(one_run: pd.DataFrame, signals: list[str], window: int, baseline: int) -> pd.DataFrame:
    """Each signal of one run (rows sorted by step) in the run's own terms: the mean of its last ``window`` steps
    in robust deviations above its first ``baseline`` steps (:func:`robust_z`: their median; the deviation 1.4826 x
    their median absolute deviation, floored by :data:`RELATIVE_FLOOR` of the median's size). The same setting then
    reads the same on a model whose normal mismatch is ten times the toy's or a tenth."""
    out = {}
    for name in signals:
        values = one_run[name].astype(float).reset_index(drop=True)
        recent = values.rolling(window, min_periods=1).mean()
        base = values.iloc[:baseline]
        floor = RELATIVE_FLOOR * abs(float(base.median())) if base.notna().any() else math.nan
        out[name] = robust_z(recent, base, max(floor, 1e-12)).to_numpy()
    return pd.DataFrame(out, index=one_run.index)


DETECTOR = Detector(weights=(("log_ratio_std", 22.489230799476395), ("bad_negative_rate", -655.7173181551187),
                             ("ess_frac", -16.687836347753525)),
                    bias=6.823390282037188, threshold=1.1703118159948929)
"""The default early warning where a run's logs carry its signals (the published weights of docs/experiments.md)."""

RELATIVE_DETECTOR: Detector | None = Detector(
    weights=(("entropy_mean", 1.4130389062859534), ("mismatch_mean", -0.07704572494664134)),
    bias=-1.2404082056364087, threshold=0.10416236999831273, baseline=10)
"""The detector of the relative mode (``WarningLines(relative_z=...)``, ``report --warn-relative``): the entropy
and mean |pi - mu| of the last 5 steps, each in robust deviations above the run's first 10 steps, fitted on 21 toy
runs of two worlds and nine settings (docs/experiments.md, "The detector in the run's own terms"). Opt-in: on
held-out runs it was not at least as good as the shipped default everywhere."""


# ------------------------------------------------------------------------------------------------ shared tables


def _manifest(text: object) -> dict[str, Any]:
    try:
        parsed = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _timestamp(value: object) -> pd.Timestamp | None:
    if not isinstance(value, str):
        return None
    stamp = pd.to_datetime(value, utc=True, errors="coerce")
    return None if pd.isna(stamp) else stamp


def _status(run_dir: Path, manifest: dict[str, Any], now: datetime) -> str:
    """``finished``, ``crashed``, ``stale`` or ``running``: the logger's reading of the writer, then staleness
    (:func:`run_table` says ``broken`` first for a run in :attr:`LogDB.broken_runs`)."""
    from trustscope.logger import run_status

    try:
        status = run_status(run_dir)
    except (schema.SchemaError, OSError, ValueError):
        status = str(manifest.get("status") or "unknown")
    updated = _timestamp(manifest.get("updated_at"))
    if status == "running" and updated is not None and (now - updated).total_seconds() > STALE_AFTER_S:
        return "stale"
    return status


def _count(manifest: dict[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` the manifest holds as a number (at the top level or under ``tokens``)."""
    for key in keys:
        for where in (manifest, manifest.get("tokens") if isinstance(manifest.get("tokens"), dict) else {}):
            value = where.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
    return None


def seed_group(manifest: dict[str, Any], run_id: str) -> tuple[str, str]:
    """``(key, label)`` of the configuration a run belongs to: its config without :data:`SEED_KEYS`; the label is
    the run id without a trailing seed (``-s0``, ``-seed1``)."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else None
    label = re.sub(r"[-_](s|seed)\d+$", "", run_id)
    if config is None:
        return run_id, run_id
    key = json.dumps({k: v for k, v in config.items() if k not in SEED_KEYS}, sort_keys=True, default=str)
    return key, label


def run_table(db: LogDB) -> pd.DataFrame:
    """One row per run with a logged step: run_id, loss_rule, status, n_steps, first_step, last_step,
    tokens_generated, tokens_logged, logged_frac, mean_reward, updated_at (from the manifest, UTC), group (the
    seed group's label), group_key.

    ``tokens_generated``/``tokens_logged`` come from the manifest when the logger wrote them, else from the data:
    the response lengths of every sample, and the token rows on disk (counted only for runs whose manifest lacks
    them, so the table never reads the token rows of a run that says).
    """
    runs = db.runs()
    runs = runs[runs["n_steps"] > 0].reset_index(drop=True)
    uncounted = [r.run_id for r in runs.itertuples(index=False)
                 if _count(_manifest(r.manifest), "tokens_logged", "n_tokens_logged", "logged") is None]
    summary = db.step_summary(uncounted) if uncounted else pd.DataFrame(columns=["run_id", "n_tokens"])
    logged_rows = summary.groupby("run_id")["n_tokens"].sum() if len(summary) else pd.Series(dtype=float)
    dirs = {p.name: p for p in db.runs_dirs}
    token_rules: dict[str, str] | None = None
    now = datetime.now(UTC)
    rows = []
    for r in runs.itertuples(index=False):
        manifest = _manifest(r.manifest)
        config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        key, label = seed_group(manifest, r.run_id)
        generated = _count(manifest, "tokens_generated", "n_tokens_generated", "generated")
        logged = _count(manifest, "tokens_logged", "n_tokens_logged", "logged")
        generated = float(r.n_response_tokens) if generated is None else generated
        logged = float(logged_rows.get(r.run_id, 0)) if logged is None else logged
        run_dir = dirs.get(r.run_id, next((p for p in db.runs_dirs if p.name == r.run_id), Path(r.run_id)))
        rule = manifest.get("loss_rule") or config.get("loss")
        if rule is None:  # a third-party run whose manifest does not say: the rule its tokens were logged under
            if token_rules is None:
                found = db.query("token_loss_rules")
                token_rules = dict(zip(found["run_id"], found["loss_rule"], strict=True))
            rule = token_rules.get(r.run_id)
        rows.append({
            "run_id": r.run_id,
            "loss_rule": rule,
            "status": "broken" if r.run_id in db.broken_runs else _status(run_dir, manifest, now),
            "n_steps": int(r.n_steps), "first_step": int(r.first_step), "last_step": int(r.last_step),
            "tokens_generated": int(generated), "tokens_logged": int(logged),
            "logged_frac": logged / generated if generated else float("nan"),
            "mean_reward": r.mean_reward,
            "updated_at": _timestamp(manifest.get("updated_at")),
            "group": label, "group_key": key,
        })
    out = pd.DataFrame(rows, columns=["run_id", "loss_rule", "status", "n_steps", "first_step", "last_step",
                                      "tokens_generated", "tokens_logged", "logged_frac", "mean_reward",
                                      "updated_at", "group", "group_key"])
    # two configurations that read the same after dropping the seed keep apart by their first run
    clash = out.groupby("group")["group_key"].transform("nunique") > 1
    out.loc[clash, "group"] = out.loc[clash, "run_id"]
    return out


WARNING_COLUMNS = ["run_id", "step", "reward_mean", "bad_rate_recent", "mismatch_growth", "warn_bad_rate",
                   "warn_mismatch", "score", "warn_score", "warning", "bad_rate_z", "mismatch_z"]


def detector_for(lines: WarningLines, detector: Detector | None = DETECTOR) -> Detector | None:
    """The detector :func:`collapse_warnings` scores with beside ``lines``: ``detector``, but in the relative mode
    (``lines.relative_z`` set) an absolute one gives way to :data:`RELATIVE_DETECTOR` (absolute weights mean
    nothing in the run's own terms: the relative fit does)."""
    if lines.relative_z is not None and detector is not None and detector.baseline is None:
        return RELATIVE_DETECTOR
    return detector


def collapse_warnings(db: LogDB | Overview, run_ids: list[str], lines: WarningLines | None = None,
                      detector: Detector | None = DETECTOR, signals: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per run and step, the collapse early warning: run_id, step, reward_mean; the lines of
    :class:`WarningLines` over the overview figures (``db`` or its :meth:`LogDB.overview`): bad_rate_recent (bad
    negative updates of the last ``window`` steps over their tokens), mismatch_growth (the mean |pi - mu| of the
    last ``window`` steps over the run's first ``window``; the first full window is the baseline and never
    warns), warn_bad_rate, warn_mismatch; the ``detector``'s score and warn_score, on the runs whose signals
    (``signals``: rows of the ``early_signals`` view, queried from ``db`` when it is a LogDB, else read off the
    overview's steps) are there (score NaN elsewhere); ``warning``: any of the three.

    The lines stay beside the detector because its fitted weight on the bad-update rate is negative (a correction
    given the log-ratio spread on the runs it was fitted on): far outside them, a step whose tokens are mostly bad
    updates scores low, and the bad-rate line still warns. ``detector=None``: the lines alone."""
    lines = lines or WarningLines()
    detector = detector_for(lines, detector)
    if not run_ids:
        return pd.DataFrame(columns=WARNING_COLUMNS)
    overview = db.overview(run_ids) if isinstance(db, LogDB) else db
    steps = overview.steps[overview.steps["run_id"].isin(list(run_ids))].sort_values(["run_id", "step"])
    if detector is not None:
        if signals is None and isinstance(db, LogDB):
            signals = db.query("early_signals", run_ids=list(run_ids))
        if signals is not None and len(signals):
            have = signals[["run_id", "step", *(c for c in detector.signals if c in signals.columns)]]
            steps = steps.drop(columns=[c for c in have.columns[2:] if c in steps.columns]).merge(
                have, on=["run_id", "step"], how="left")
    parts = []
    for run_id, one in steps.groupby("run_id", sort=True):
        recent = one[["n_bad_negative", "n_tokens"]].astype(float).rolling(lines.window, min_periods=1).sum()
        mismatch = one["mismatch_mean"].astype(float)
        baseline = mismatch.iloc[:lines.window].mean()
        rate = recent["n_bad_negative"] / recent["n_tokens"].where(recent["n_tokens"] > 0)
        growth = mismatch.rolling(lines.window, min_periods=1).mean() / (baseline if baseline else np.nan)
        late = np.arange(1, len(one) + 1) > lines.window
        part = pd.DataFrame({
            "run_id": run_id, "step": one["step"].to_numpy(), "reward_mean": one["reward_mean"].to_numpy(),
            "bad_rate_recent": rate.to_numpy(), "mismatch_growth": growth.to_numpy(),
            "warn_bad_rate": late & (rate >= lines.bad_rate).to_numpy(),
            "warn_mismatch": late & (growth >= lines.mismatch_growth).to_numpy(),
            "bad_rate_z": np.nan, "mismatch_z": np.nan})
        if lines.relative_z is not None:
            first = one.iloc[:lines.window]
            step_rate = (first["n_bad_negative"].astype(float) / first["n_tokens"].astype(float).where(
                first["n_tokens"] > 0))
            base_tokens = float(first["n_tokens"].sum())
            noise = np.sqrt(max(float(step_rate.median()) if step_rate.notna().any() else 0.0, 1 / max(base_tokens, 1))
                            / recent["n_tokens"].where(recent["n_tokens"] > 0))
            bad_z = robust_z(rate, step_rate, noise)
            recent_mismatch = mismatch.rolling(lines.window, min_periods=1).mean()
            mis_z = robust_z(recent_mismatch, mismatch.iloc[:lines.window],
                             MISMATCH_FLOOR * abs(float(mismatch.iloc[:lines.window].median())))
            part["bad_rate_z"], part["mismatch_z"] = bad_z.to_numpy(), mis_z.to_numpy()
            part["warn_bad_rate"] = late & (bad_z >= lines.relative_z).to_numpy()
            part["warn_mismatch"] = late & (mis_z >= lines.relative_z).to_numpy()
        if detector is not None and all(c in one.columns and one[c].notna().any() for c in detector.signals):
            part["score"], part["warn_score"] = detector.score(one)
        else:
            part["score"], part["warn_score"] = np.nan, False
        part["warning"] = part["warn_score"] | part["warn_bad_rate"] | part["warn_mismatch"]
        parts.append(part)
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=WARNING_COLUMNS)
    out["warning"] = out["warning"].astype(bool)
    out = out[WARNING_COLUMNS]
    out.attrs["detector"] = detector
    return out


DETECTOR_LABELS = {"log_ratio_std": "spread of log(pi/mu)", "bad_negative_rate": "bad-update rate",
                   "ess_frac": "ESS of pi/mu", "mismatch_mean": "mean |pi - mu|", "entropy_mean": "entropy",
                   "grad_norm": "gradient norm", "seq_log_ratio_p99": "p99 of the responses' mean log-ratio"}


def first_warnings(warnings: pd.DataFrame, detector: Detector | None = None) -> dict[str, str]:
    """run_id -> one line saying at which step the warning first fired and why (runs that never warn are absent).
    ``detector``: the one that scored ``warnings`` (default: the one :func:`collapse_warnings` used)."""
    detector = detector or warnings.attrs.get("detector") or DETECTOR
    out = {}
    for run_id, part in warnings[warnings["warning"].astype(bool)].groupby("run_id", sort=False):
        row = part.sort_values("step").iloc[0]
        why = []
        if row["warn_score"]:
            names = ", ".join(DETECTOR_LABELS.get(n, n) for n in detector.signals)
            why.append(f"early-warning score {row['score']:.2f} >= {detector.threshold:.2f} over the last "
                       f"{detector.window} steps' {names}"
                       + (f", each against the run's first {detector.baseline} steps" if detector.baseline else ""))
        if row["warn_bad_rate"]:
            why.append(f"bad negative updates {row['bad_rate_recent']:.2%} of recent tokens"
                       + (f", {row['bad_rate_z']:.1f} robust deviations above its first steps"
                          if pd.notna(row.get("bad_rate_z")) else ""))
        if row["warn_mismatch"]:
            why.append(f"|pi - mu| {row['mismatch_growth']:.1f}x its first steps"
                       + (f", {row['mismatch_z']:.1f} robust deviations above them"
                          if pd.notna(row.get("mismatch_z")) else ""))
        out[str(run_id)] = f"collapse warning from step {int(row['step'])} ({'; '.join(why)}; {len(part)} steps warn)"
    return out


# ------------------------------------------------------------------------------------------------ opening logs


# ------------------------------------------------------------------------------------------------ the report


@dataclass
class RunReport:
    """What the report says about one run (numbers for tests, text for people)."""

    run_id: str
    status: str | None
    loss_rule: str | None
    group: str
    n_steps: int
    n_tokens: int
    """the tokens the figures are over: every token the trainer handed in where ``exact``, else the logged rows"""
    n_grad_tokens: int
    """tokens with A != 0: the denominator of every blocked fraction"""
    tokens_generated: int
    exact: bool
    """whether the figures come from the run's summaries table (every token) or from its logged token rows"""
    source: str
    """how the figures were obtained, in words (:func:`trustscope.db.source_sentence`)"""
    token_fraction: float | None
    """the share of token rows the logger kept (run.json), None when it does not say"""
    reward_first: float | None
    reward_last: float | None
    reward_max: float | None
    mismatch_first: float | None
    mismatch_last: float | None
    mismatch_max: float | None
    bad_negative_rate_mean: float | None
    trainer_blocked_frac: float | None
    blocked_by_rule: dict[str, tuple[float, int]] = field(default_factory=dict)
    """rule -> (blocked fraction, tokens blocked), rules that block nothing left out."""
    clipped: pd.DataFrame | None = None
    warnings: list[str] = field(default_factory=list)
    collapse_warning: str | None = None
    equal_budget: pd.DataFrame | None = None
    """the run's rows of :meth:`LogDB.equal_budget` (set by :func:`print_report`), or None"""
    chosen_rules: list[str] = field(default_factory=list)
    """rules evaluated at parameters the user chose (``--rule``): their blocks counted from the logged rows"""


def _first_last(series: pd.Series) -> tuple[float | None, float | None]:
    values = series.dropna()
    if values.empty:
        return None, None
    return float(values.iloc[0]), float(values.iloc[-1])


def build(db: LogDB, lines: WarningLines | None = None, overview: Overview | None = None) -> list[RunReport]:
    """One :class:`RunReport` per run with a logged step, from :meth:`LogDB.overview` (``overview`` when the
    caller holds it already)."""
    overview = overview or db.overview()
    summary = overview.steps
    sources = overview.sources.set_index("run_id")
    table = run_table(db).set_index("run_id")
    clipped = db.clipped_tokens(top=CLIPPED_TOP)
    run_ids = sorted(summary["run_id"].unique())
    alerts = first_warnings(collapse_warnings(overview, run_ids, lines,
                                              signals=db.query("early_signals", run_ids=run_ids)))
    totals = overview.blocked_totals()
    reports = []
    for run_id, steps in summary.groupby("run_id", sort=True):
        steps = steps.sort_values("step")
        info = table.loc[run_id] if run_id in table.index else None
        rule = None if info is None else info["loss_rule"]
        blocked = {t.rule: (float(t.blocked_frac), int(t.n_blocked)) for t in totals[totals.run_id == run_id]
                   .itertuples() if t.n_blocked > 0}
        n_grad = max(int(steps.n_nonzero_advantage.sum()), 1)  # blocked fractions are over the tokens with A != 0
        trainer = steps.n_trainer_blocked.dropna()
        r_first, r_last = _first_last(steps.reward_mean)
        m_first, m_last = _first_last(steps.mismatch_mean)
        report = RunReport(
            run_id=str(run_id),
            status=None if info is None else info["status"],
            loss_rule=rule,
            group=str(run_id) if info is None else info["group"],
            n_steps=len(steps),
            n_tokens=int(steps.n_tokens.sum()),
            n_grad_tokens=int(steps.n_nonzero_advantage.sum()),
            tokens_generated=0 if info is None else int(info["tokens_generated"]),
            exact=bool(sources.loc[run_id, "exact"]),
            source=str(sources.loc[run_id, "source"]),
            token_fraction=None if pd.isna(sources.loc[run_id, "token_fraction"])
            else float(sources.loc[run_id, "token_fraction"]),
            reward_first=r_first,
            reward_last=r_last,
            reward_max=float(steps.reward_mean.max()) if steps.reward_mean.notna().any() else None,
            mismatch_first=m_first,
            mismatch_last=m_last,
            mismatch_max=float(steps.mismatch_max.max()),
            bad_negative_rate_mean=float(steps.n_bad_negative.sum() / max(int(steps.n_tokens.sum()), 1)),
            trainer_blocked_frac=float(trainer.sum() / n_grad) if len(trainer) else None,
            blocked_by_rule=dict(sorted(blocked.items(), key=lambda kv: -kv[1][0])),
            clipped=clipped[(clipped.run_id == run_id) & (clipped.rule == (rule or "ppo_clip"))],
            collapse_warning=alerts.get(str(run_id)),
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
        if report.collapse_warning:
            report.warnings.append(report.collapse_warning)
        reports.append(report)
    return reports


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


def short_names(run_ids: list[str]) -> tuple[str, dict[str, str]]:
    """The prefix every run id shares (cut at a ``-`` or ``_``) and each id without it, so narrow tables keep
    the part that tells runs apart."""
    if len(run_ids) < 2:
        return "", {r: r for r in run_ids}
    prefix = run_ids[0]
    for run_id in run_ids[1:]:
        while not run_id.startswith(prefix):
            prefix = prefix[:-1]
    cut = max(prefix.rfind("-"), prefix.rfind("_"))
    prefix = prefix[:cut + 1] if cut >= 0 else ""
    return prefix, {r: r[len(prefix):] or r for r in run_ids}


def _short_source(r: RunReport) -> str:
    """``exact``, or ``rows`` with the share of tokens logged (``rows 25%``)."""
    if r.exact:
        return "exact"
    return "rows" if r.token_fraction is None else f"rows {r.token_fraction:.0%}"


def render(reports: list[RunReport], broken: dict[str, list[str]] | None = None) -> Group:
    """The terminal summary as rich renderables (readable at 80 columns: run ids lose their shared prefix)."""
    parts: list = []
    prefix, short = short_names([r.run_id for r in reports])
    statuses = {r.status for r in reports}
    lengths = {r.n_steps for r in reports}
    title = "Runs" + (f" (ids without the shared prefix {prefix!r})" if prefix else "")
    if len(statuses) == 1:
        title += f", all {next(iter(statuses))}"
    if len(lengths) == 1:
        title += f", {next(iter(lengths))} steps each"
    named = all(r.loss_rule and r.loss_rule in r.run_id for r in reports)  # the rule already in every run id
    overview = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    overview.add_column("run", no_wrap=True)
    if not named:
        overview.add_column("rule", overflow="fold", min_width=10)
    if len(statuses) > 1:
        overview.add_column("status", no_wrap=True)
    sources = {r.source for r in reports}
    if len(sources) > 1:
        overview.add_column("from", no_wrap=True)
    for col in ("steps", "tokens", "reward", "|pi-mu|", "bad neg", "blocked"):
        if col != "steps" or len(lengths) > 1:
            overview.add_column(col, justify="right", no_wrap=True)
    delta = ANALYSIS_DEFAULTS["bad_negative_delta"]
    where = (f"figures {next(iter(sources))}" if len(sources) == 1 else
             "from: exact (summaries table, every token) or rows (the logged token rows, % kept)")
    overview.caption = (f"{where}; tokens: those the figures are over; reward: first -> last step; |pi-mu|: last "
                        f"step; bad neg: A < 0 and mu - pi >= {delta:g}, of all tokens; blocked: by the run's own "
                        "rule, of the A != 0 tokens; ! marks a collapse warning")
    for r in reports:
        row = [short[r.run_id] + (" !" if r.collapse_warning else "")]
        if not named:
            row.append(r.loss_rule or "-")
        if len(statuses) > 1:
            row.append(r.status or "-")
        if len(sources) > 1:
            row.append(_short_source(r))
        if len(lengths) > 1:
            row.append(str(r.n_steps))
        reward = ("-" if r.reward_first is None and r.reward_last is None
                  else f"{_fmt(r.reward_first, '.2f')}->{_fmt(r.reward_last, '.2f')}")
        row += [f"{r.n_tokens:,}", reward,
                _fmt(r.mismatch_last, ".4f"), _fmt(r.bad_negative_rate_mean, ".2%"),
                _fmt(r.trainer_blocked_frac, ".1%")]
        overview.add_row(*row)
    parts.append(overview)
    for r in reports:
        parts.append(Text(f"{r.run_id}: what each rule would block of its {r.n_grad_tokens:,} tokens with A != 0 "
                          f"({r.source})", style="italic"))
        chosen = [c for c in r.chosen_rules if c != r.loss_rule]
        caption = "rules that block nothing left out" if r.blocked_by_rule else "no rule blocks any token of this run"
        if chosen and r.exact:
            caption += (f"; {', '.join(chosen)} at the parameters given (--rule), which the summaries do not hold: "
                        "counted from the logged rows" + (f" ({r.token_fraction:.0%} of the tokens)" if r.token_fraction else "")
                        + ", tokens blocked of those rows")
        rules = Table(caption=caption)
        rules.add_column("rule", no_wrap=True)
        rules.add_column("blocked", justify="right")
        rules.add_column("tokens blocked", justify="right")
        for rule, (frac, n) in r.blocked_by_rule.items():
            own = rule == r.loss_rule
            rules.add_row(Text(rule + (" (applied)" if own else ""), style="bold" if own else ""), _fmt(frac, ".2%"),
                          f"{n:,}")
        parts.append(rules)
        if r.equal_budget is not None and len(r.equal_budget):
            parts += equal_budget_parts(r)
        if r.clipped is not None and not r.clipped.empty:
            tokens = Table(title=f"{r.run_id}: tokens {r.clipped.rule.iloc[0]} blocks most (logged rows)",
                           title_justify="left")
            for col in ("token", "blocked", "of", "rate", "mean mu", "entropy"):
                tokens.add_column(col, justify="left" if col == "token" else "right", no_wrap=True)
            for row in r.clipped.itertuples():
                tokens.add_row(repr(row.token_text), f"{row.n_blocked:,}", f"{row.n_occurrences:,}",
                               _fmt(row.block_rate, ".1%"), _fmt(row.mu_prob_mean, ".3f"),
                               _fmt(row.entropy_mean, ".2f"))
            parts.append(tokens)
        for warning in r.warnings:
            parts.append(Text(f"! {r.run_id}: {warning}", style="yellow"))
    for run_id, problems in (broken or {}).items():
        parts.append(Text(f"! {run_id}: left out, unreadable: {problems[0]}"
                          + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), style="red"))
    if not reports:
        parts.append(Text("no tokens logged yet", style="yellow"))
    return Group(*parts)


# ------------------------------------------------------------------------------------------------ by dimension

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
    A != 0 tokens)."""
    params = {"run_ids": run_ids, "first_step": first_step, "last_step": last_step}
    return db.query("mismatch_by_dimension", **params), db.query("blocked_by_dimension", **params)


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
                      applied: dict[str, str | None]) -> Group:
    """The terminal tables of :func:`by_dimension`: per dimension, one row per (run, bucket) with its tokens,
    mean |pi - mu|, ESS fraction and what the run's own rule blocks (count of the A != 0 tokens and fraction);
    a sentence for the runs without the dimension."""
    from trustscope.columns import DIMENSIONS

    parts: list = []
    for dim in DIMENSIONS:
        rows = mismatch[mismatch["dimension"] == dim.name].sort_values(["run_id", "bucket"])
        missing = lacking(mismatch, dim.name, run_ids)
        if rows.empty:
            parts.append(Text(f"By {dim.name}: {absent_sentence(dim.name, missing)}", style="italic"))
            continue
        table = Table(title=f"Where the mismatch lives: by {dim.name} (every step, every token)", title_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
                      caption=absent_sentence(dim.name, missing) or None)
        for col in ("run", dim.name, "tokens", "|pi-mu|", "ESS", "own rule blocks"):
            table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
        own = blocked[(blocked["dimension"] == dim.name)]
        own = own[own["rule"] == own["run_id"].map(applied)].set_index(["run_id", "bucket"])
        for row in rows.itertuples():
            key = (row.run_id, row.bucket)
            block = "-"
            if key in own.index:
                b = own.loc[key]
                block = f"{int(b.n_blocked):,} of {int(b.n_nonzero_advantage):,} ({_fmt(b.blocked_frac, '.2%')})"
            table.add_row(str(row.run_id), str(row.bucket_label), f"{int(row.n_tokens):,}",
                          _fmt(row.mismatch_mean, ".4f"), _fmt(row.ess_frac, ".1%"), block)
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
        agree = rows[rows["split"] == "agreement"].set_index("bucket")
        n = int(agree["n_tokens"].sum())
        bad = agree.loc[1] if 1 in agree.index else None
        full = agree.loc[0] if 0 in agree.index else None
        lead = "  token rows: " if len(mine) else f"{run}: "
        lines.append(f"{lead}{0 if bad is None else int(bad.n_tokens):,} of {n:,} routed tokens "
                     f"({0 if bad is None else bad.n_tokens / n:.1%}) disagree in some layer and hold "
                     f"{0 if bad is None else bad.abs_share:.1%} of the total |log pi/mu|; mean |log pi/mu| "
                     f"{_fmt(None if full is None else full.mean_abs)} with full agreement, "
                     f"{_fmt(None if bad is None else bad.mean_abs)} with a disagreement")
        layers = rows[(rows["split"] == "first_layer") & (rows["bucket"] >= 0)]
        if len(layers):
            lines.append("  by first disagreeing layer: " + "; ".join(
                f"{r.label}: {int(r.n_tokens):,} tokens, mean {_fmt(r.mean_abs)} ({r.abs_share:.1%} of |log pi/mu|)"
                for r in layers.itertuples()))
        pos = rows[rows["split"] == "position"]
        lines.append("  by position: " + "; ".join(
            f"{r.label}: {int(r.n_disagree):,} of {int(r.n_tokens):,} disagree, mean {_fmt(r.mean_abs_full)} agreeing "
            f"vs {_fmt(r.mean_abs_disagree)}" for r in pos.itertuples()))
        own = blocked[(blocked["run_id"] == run) & (blocked["rule"] == applied.get(run))]
        if len(own):
            lines.append(f"  {applied.get(run)} blocks " + "; ".join(
                f"{int(r.n_blocked):,} of {int(r.n_nonzero_advantage):,} ({_fmt(r.blocked_frac, '.2%')}) with "
                f"{r.agreement}" for r in own.itertuples()))
    absent = [r for r in run_ids if r not in set(mismatch["run_id"])]
    if absent and len(absent) < len(run_ids):
        lines.append(routing_absent_sentence(absent, sides))
    return lines


def equal_budget_parts(r: RunReport) -> list:
    """The run's equal-budget section: each rule with a scalar threshold moved to block the reference's share
    (:meth:`LogDB.equal_budget`), beside what it blocks at the parameters evaluated (a rule over half of the
    tokens at those marked out of calibration)."""
    from trustscope.query.budget import OUT_OF_CALIBRATION

    eb = r.equal_budget
    solved = eb[eb["param"].notna()]
    if not len(solved):
        return []
    if solved["value"].isna().all():  # nothing cut: one line says why
        note = solved["note"].dropna()
        return [Text(f"{r.run_id}: rules at an equal budget not computed"
                     + (f": {note.iloc[0]}" if len(note) else ""), style="dim")]
    reference = solved["reference"].iloc[0]
    target = solved["target_frac"].iloc[0]
    head = (f"{r.run_id}: rules at an equal budget, each threshold moved to block "
            + (f"{target:.2%} of the tokens with A != 0, as {reference}" if target == target and target is not None
               else f"the reference's share ({reference})"))
    sources = {"summ" if str(x).startswith("summaries") else "rows" for x in solved["source"]}
    counts = solved["n_tokens"].dropna()
    of = f" of {int(counts.iloc[0]):,}" if len(counts) and counts.nunique() == 1 else ""
    table = Table(caption=escape(
        "threshold: at the parameters evaluated here -> at the equal budget ([low, high]: the bracket the "
        "summaries' bins allow); default: the share of the tokens with A != 0 it blocks there (* over half: out "
        "of calibration for this run, the equal-budget threshold is the one that would match); budget: the "
        f"tokens{of} it blocks at the equal budget; "
        + ("from: rows = the logged rows (exact cut), summ = the summaries (every token, to a bin edge)"
           if len(sources) > 1 else f"from the {'summaries (every token, to a bin edge)' if sources == {'summ'} else solved['source'].iloc[0]}")))
    columns = ("rule", "threshold", "default", "budget") + (("from",) if len(sources) > 1 else ())
    for col in columns:
        table.add_column(col, justify="left" if col in ("rule", "threshold", "from") else "right",
                         no_wrap=col != "rule", overflow="fold")
    for row in solved.itertuples():
        frac, _n = r.blocked_by_rule.get(row.rule, (0.0, 0))
        if row.value is None or row.value != row.value:
            value, blocks = "-", row.note or "-"
        else:
            value = f"{row.value:.4g}" + (f" [{row.value_low:.3g}, {row.value_high:.3g}]"
                                          if row.value_low != row.value_high else "")
            blocks = f"{int(row.n_blocked):,}"
        own = row.rule == r.loss_rule
        cells = [Text(row.rule + (" (applied)" if own else ""), style="bold" if own else ""),
                 Text(f"{row.param} {row.default:.4g} -> {value}"),
                 _fmt(frac, ".2%") + (" *" if frac > OUT_OF_CALIBRATION else ""), blocks]
        if len(sources) > 1:
            cells.append("summ" if str(row.source).startswith("summaries") else "rows")
        table.add_row(*cells)
    parts: list = [Text(head, style="italic"), table]
    unsolved = eb[eb["param"].isna()]
    if len(unsolved):
        parts.append(Text(f"not compared at an equal budget: {', '.join(unsolved['rule'])} (no scalar threshold)",
                          style="dim"))
    return parts


def print_report(db: LogDB, console: Console | None = None, broken: dict[str, list[str]] | None = None,
                 lines: WarningLines | None = None, budget: float | None = None) -> list[RunReport]:
    """Print the terminal summary, with each run's rules at an equal budget (the run's own rule's share, or
    ``budget``) and where the mismatch lives (runs with summary dimensions); return the reports."""
    reports = build(db, lines)
    if reports:
        eb = db.equal_budget([r.run_id for r in reports], budget, max_rows=BUDGET_MAX_ROWS)
        chosen = db.chosen_rules()
        for r in reports:
            r.chosen_rules = chosen
            r.equal_budget = eb[eb["run_id"] == r.run_id].reset_index(drop=True)
    console = console or Console()
    console.print(render(reports, broken))
    if reports:
        console.print(_dimension_part(db, reports))
        console.print(_routing_part(db, reports))
    return reports


def _dimension_part(db: LogDB, reports: list[RunReport]) -> Group:
    mismatch, blocked = by_dimension(db, [r.run_id for r in reports])
    if mismatch.empty:
        return Group(Text("Where the mismatch lives: no run has summary dimensions (position, turn, staleness); "
                          "they are logged since summaries table version 2.", style="italic"))
    return render_dimensions(mismatch, blocked, [r.run_id for r in reports], {r.run_id: r.loss_rule for r in reports})


def _routing_part(db: LogDB, reports: list[RunReport]) -> Group:
    run_ids = [r.run_id for r in reports]
    mismatch, blocked, exact = by_routing(db, run_ids)
    sides = routing_sides(db, run_ids)
    if mismatch.empty:
        one_side = routing_absent_sentence([r for r in run_ids if r in sides], sides) if sides else ""
        return Group(Text("Where the mismatch lives, by routing: no run logs routed experts on both sides (a "
                          "mixture-of-experts run's engine_experts and trainer_experts)." + (" " + one_side if
                          one_side else ""), style="italic"))
    lines = routing_lines(mismatch, blocked, run_ids, {r.run_id: r.loss_rule for r in reports}, exact, sides)
    return Group(Text("Where the mismatch lives: by routing agreement", style="bold"),
                 *(Text(line) for line in lines))


# ------------------------------------------------------------------------------------------------ html


def _group_colours(table: pd.DataFrame) -> dict[str, str]:
    """Each seed group drawn in its rule's colour when no two groups share a rule, else in series colours."""
    from trustscope import figures  # plotly: only the HTML page draws

    groups = table.drop_duplicates("group")
    if groups["loss_rule"].notna().all() and groups["loss_rule"].is_unique:
        return {g: figures.rule_colour(r) for g, r in zip(groups["group"], groups["loss_rule"], strict=True)}
    return {g: figures.series_colour(i) for i, g in enumerate(groups["group"])}


def source_caption(sources: pd.DataFrame) -> str:
    """One sentence on where the overview figures of these runs come from (``Overview.sources``)."""
    said = sources.groupby("source")["run_id"].apply(list)
    if len(said) == 1:
        return f"Figures {said.index[0]}."
    return "Figures " + "; ".join(f"{text} for {', '.join(runs)}" for text, runs in said.items()) + "."


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
    reports = build(db, lines, overview)
    console = Console(record=True, width=110, file=io.StringIO())
    console.print(render(reports, broken))
    if reports:
        console.print(_dimension_part(db, reports))
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
