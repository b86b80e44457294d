"""The collapse early warning: lines on the bad negative-update rate and the growth of |pi - mu|, and the fitted
detector, step by step over a run's overview figures.

:func:`collapse_warnings` is the one computation the report, the dashboard's badge, the trainer's and the
integrations' live warning (:class:`trustscope.trackers.EarlyWarning`) read; :func:`first_warnings` says in one
line when and why a run first warned. ``docs/experiments.md`` measures the lines and fits the detectors
(``studies/eval_early_warning.py``, ``studies/eval_relative_detector.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trustscope.db import LogDB, Overview


@dataclass(frozen=True)
class WarningLines:
    """The collapse early warning: a step warns when, over the last ``window`` steps, the bad negative-update rate
    reaches ``bad_rate`` or the mean |pi - mu| has grown ``mismatch_growth`` times over the run's first window.

    The defaults are twice the paper's 0.5% (on ~400 tokens per window half a percent is two tokens, noise);
    ``docs/experiments.md`` measures how the lines fare on the toy-v2 sample logs (those ``sample_logs/`` held up
    to commit d114d27, ``studies/eval_collapse_warning.py``).

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
    "An early warning fitted on collapsing runs"; ``studies/eval_early_warning.py`` fits it); it warns on the runs
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


COLLAPSE_WINDOW = 10
"""The steps of the reward mean a collapse is judged on (the findings' definition, ``studies/findings.py``)."""


def collapse_step(one_run: pd.DataFrame, window: int = COLLAPSE_WINDOW) -> tuple[int, float, float] | None:
    """A run's collapse: the first step whose ``window``-step mean reward is at most half the best such mean
    before it, with that mean and the best (``docs/experiments.md``'s collapse); None where it never is.
    ``one_run``: step, reward_mean."""
    one = one_run.sort_values("step")
    avg = one["reward_mean"].astype(float).rolling(window, min_periods=window).mean()
    best = avg.cummax()
    hit = (avg <= 0.5 * best).to_numpy() & (best > 0).to_numpy()
    if not hit.any():
        return None
    i = int(hit.argmax())
    return int(one["step"].iloc[i]), float(avg.iloc[i]), float(best.iloc[i])


def lowest_share(one_run: pd.DataFrame, window: int = COLLAPSE_WINDOW) -> tuple[float, float] | None:
    """The lowest ``window``-step mean reward after the best before it, as a share of that best, and the best
    (how near a run that never collapsed came to it); None for a run shorter than ``window``."""
    one = one_run.sort_values("step")
    avg = one["reward_mean"].astype(float).rolling(window, min_periods=window).mean()
    best = avg.cummax()
    share = (avg / best.where(best > 0)).dropna()
    return (float(share.min()), float(best.max())) if len(share) else None


def warning_outcome(warnings: pd.DataFrame, run_id: str) -> tuple[bool, str] | None:
    """Whether run ``run_id``'s collapse warning (rows of :func:`collapse_warnings`) holds over the steps logged,
    and a sentence saying why: it holds where the reward then collapsed (:func:`collapse_step`, at or after the
    first warning) or where the warning is still on at the run's last step (the run may yet collapse); a warning
    the run's reward never bore out (it never fell to half its best after it) does not hold, and the sentence
    gives the lowest share of its best the reward reached. None where the run never warned."""
    one = warnings[warnings["run_id"] == run_id].sort_values("step")
    warned = one[one["warning"].astype(bool)]
    if warned.empty:
        return None
    first = int(warned["step"].iloc[0])
    collapse = collapse_step(one)
    if collapse is not None and collapse[0] >= first:
        step, avg, best = collapse
        return True, (f"the reward then collapsed: its {COLLAPSE_WINDOW}-step mean fell to {avg:.2f} at step {step}, "
                      f"half its best {best:.2f} or less")
    if bool(one["warning"].iloc[-1]):
        return True, "still on at the last step logged"
    low = lowest_share(one)
    said = (f"the reward never fell to half its best after it (its {COLLAPSE_WINDOW}-step mean stayed at "
            f"{low[0]:.0%} of its best {low[1]:.2f} or more)" if low is not None else
            f"the run is too short to judge (under {COLLAPSE_WINDOW} steps)")
    if collapse is not None:
        said += f"; it had collapsed before, at step {collapse[0]}"
    return False, f"not borne out: {said}, and the warning is off at the last step"
