"""The exact per-step summaries as flat tracker metrics, and the trackers they go to: W&B, TensorBoard, MLflow, trackio.

One mapping, :func:`step_metrics`, turns the summary rows of one step (``summaries`` rows as the logger computes
them, :mod:`trustscope.logger.summaries`; any ranks and micro-batches, merged here) into flat metrics named
``trustscope/<group>/<name>``. It is generic over the rows' shape, so a summary the logger gains later reaches the
trackers with no change here:

- ``tokens``: ``trustscope/tokens/total`` and ``trustscope/tokens/<sign>`` (positive, negative, zero).
- a count per rule (``blocked``): ``trustscope/<metric>_count/<rule>`` and ``trustscope/<metric>_frac/<rule>``
  over the tokens that carry gradient (A != 0), as the ``summary_blocked`` view divides.
- a count without a rule (``trainer_blocked``, ``bad_negative``): ``trustscope/<metric>_count`` and
  ``trustscope/<metric>_rate`` over the tokens of :data:`DENOMINATORS` (A != 0 for ``trainer_blocked``, every
  token for the others), as ``summary_steps`` divides.
- moments (a row with ``sum``): ``trustscope/<group>/<prefix>mean``, ``std``, ``min``, ``max``.
- a histogram (``<name>_hist``): ``trustscope/<group>/<prefix>p50``, ``p90``, ``p99``, the upper edge of the
  bin where the quantile falls (exact to bin resolution, 8 bins a decade).
- any other number a row carries (``threshold``, or a column added later): ``trustscope/<metric>/<column>``,
  the largest over the step's rows.

``<group>`` is the metric's name, but for the two mismatch metrics (:data:`ALIASES`): ``abs_prob_diff`` is
``trustscope/mismatch/abs_*`` and ``prob_diff`` is ``trustscope/mismatch/*``. ``trustscope/step`` is the step the
figures describe. :class:`EarlyWarning` adds ``trustscope/warning`` (1.0 when the collapse early warning of
:func:`trustscope.early_warning.collapse_warnings` fires at the step) and what it reads. ``docs/trackers.md`` has the table.

:func:`open_trackers` opens the trackers of the trainer's ``--report-to`` through each package's own API; a package
that is not installed is left out with a :class:`TrackerWarning` naming the extra to install, and training goes on.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PREFIX = "trustscope"
ALIASES: dict[str, tuple[str, str]] = {"abs_prob_diff": ("mismatch", "abs_"), "prob_diff": ("mismatch", "")}
"""Summary metrics shown under another group: name -> (group, prefix of each statistic)."""
DENOMINATORS: dict[str, str] = {"blocked": "signed", "trainer_blocked": "signed"}
"""What a count is a fraction of: ``signed`` (tokens with A != 0, zero-advantage rows left out of the count too) or,
for any metric not listed, ``all`` (every token of the step)."""
QUANTILES = (0.5, 0.9, 0.99)
KEY_COLUMNS = frozenset({"run_id", "step", "rank", "part", "metric", "rule", "advantage_sign", "mu_low", "bin_low",
                         "bin_high", "count", "sum", "sum_sq", "min", "max"})
"""Columns of a summaries row that say which group it is or hold its mergeable figures; any other number a row
carries becomes ``trustscope/<metric>/<column>``."""
TRACKERS = ("wandb", "tensorboard", "mlflow", "trackio")
"""The trackers :func:`open_trackers` knows, as ``--report-to`` names them."""
EXTRA = "trackers"
"""The extra that installs every tracker package: ``pip install 'trustscope[trackers]'``."""


class TrackerWarning(UserWarning):
    """A tracker left out (its package is missing or it failed to start), or one that failed later."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _quantile(bins: list[tuple[float, float, float]], q: float) -> float:
    """The upper edge of the bin ``(low, high, count)`` where the ``q`` quantile falls (``bins`` sorted by low)."""
    total = sum(c for _, _, c in bins)
    seen = 0.0
    for low, high, count in bins:
        seen += count
        if seen >= q * total:
            return high if math.isfinite(high) else low
    return bins[-1][1]


def step_metrics(rows: Iterable[Mapping[str, Any]], step: int | None = None,
                 rules: Mapping[str, Iterable[str]] | None = None) -> dict[str, float]:
    """One step's ``summaries`` rows (any ranks, parts and micro-batches) as flat ``trustscope/...`` metrics.

    ``step`` is recorded as ``trustscope/step``. Rows are merged as the ``summaries`` view merges them: counts and
    sums add, extremes take their min and max. A rule that blocks nothing at a step has no rows; ``rules``
    (metric -> rule names, e.g. those seen at earlier steps) are reported 0 there, as ``summary_blocked`` does.
    Returns ``{}`` for no rows.
    """
    by_metric: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("dimension") is not None:  # the summary dimensions' rows split the same tokens again
            continue
        name = row.get("metric")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a summaries row needs a metric name, got metric={name!r} in {dict(row)!r}")
        by_metric[name].append(row)
    if not by_metric:
        return {}
    out: dict[str, float] = {} if step is None else {f"{PREFIX}/step": float(step)}
    tokens = by_metric.get("tokens", [])
    n_all = float(sum(r["count"] for r in tokens))
    n_signed = float(sum(r["count"] for r in tokens if r.get("advantage_sign") != "zero"))
    for name in sorted(by_metric):
        part = by_metric[name]
        group, prefix = ALIASES.get(name.removesuffix("_hist"), (name.removesuffix("_hist"), ""))
        if name == "tokens":
            out[f"{PREFIX}/tokens/total"] = n_all
            signs: dict[str, float] = defaultdict(float)
            for r in part:
                signs[str(r.get("advantage_sign"))] += r["count"]
            out.update({f"{PREFIX}/tokens/{sign}": n for sign, n in sorted(signs.items())})
        elif name.endswith("_hist"):
            merged: dict[float, list[float]] = {}
            for r in part:
                have = merged.setdefault(float(r["bin_low"]), [float(r["bin_high"]), 0.0])
                have[1] += r["count"]
            bins = [(low, high, count) for low, (high, count) in sorted(merged.items()) if count > 0]
            if bins:
                for q in QUANTILES:
                    out[f"{PREFIX}/{group}/{prefix}p{round(q * 100):d}"] = _quantile(bins, q)
        elif any(r.get("sum") is not None for r in part):
            n = float(sum(r["count"] for r in part))
            if n > 0:
                total = sum(r["sum"] for r in part if r.get("sum") is not None)
                squares = sum(r["sum_sq"] for r in part if r.get("sum_sq") is not None)
                mean = total / n
                out[f"{PREFIX}/{group}/{prefix}mean"] = mean
                out[f"{PREFIX}/{group}/{prefix}std"] = math.sqrt(max(squares / n - mean * mean, 0.0))
                lows = [r["min"] for r in part if r.get("min") is not None]
                highs = [r["max"] for r in part if r.get("max") is not None]
                if lows:
                    out[f"{PREFIX}/{group}/{prefix}min"] = float(min(lows))
                if highs:
                    out[f"{PREFIX}/{group}/{prefix}max"] = float(max(highs))
        else:
            signed = DENOMINATORS.get(name, "all") == "signed"
            denominator = n_signed if signed else n_all
            counted = [r for r in part if not (signed and r.get("advantage_sign") == "zero")]
            if any(r.get("rule") is not None for r in part):
                per_rule: dict[str, float] = defaultdict(float)
                for r in counted:
                    per_rule[str(r.get("rule"))] += r["count"]
                for rule in sorted({str(r.get("rule")) for r in part} | set((rules or {}).get(name, ()))):
                    out[f"{PREFIX}/{name}_count/{rule}"] = per_rule[rule]
                    out[f"{PREFIX}/{name}_frac/{rule}"] = per_rule[rule] / denominator if denominator else math.nan
            else:
                n = float(sum(r["count"] for r in counted))
                out[f"{PREFIX}/{name}_count"] = n
                out[f"{PREFIX}/{name}_rate"] = n / denominator if denominator else math.nan
        extras: dict[str, float] = {}
        for r in part:
            for column, value in r.items():
                number = _number(value) if column not in KEY_COLUMNS else None
                if number is not None:
                    extras[column] = max(extras.get(column, -math.inf), number)
        out.update({f"{PREFIX}/{group}/{column}": v for column, v in sorted(extras.items())})
    for name, names in (rules or {}).items():  # a rule metric with no rows at all this step
        if name not in by_metric and names:
            denominator = n_signed if DENOMINATORS.get(name, "all") == "signed" else n_all
            for rule in sorted(names):
                out[f"{PREFIX}/{name}_count/{rule}"] = 0.0
                out[f"{PREFIX}/{name}_frac/{rule}"] = 0.0 if denominator else math.nan
    return out


DETECTOR_SIGNALS = ("log_ratio_std", "ess_frac", "bad_negative_rate", "entropy_mean")
"""The step figures :data:`trustscope.early_warning.DETECTOR` and :data:`trustscope.early_warning.RELATIVE_DETECTOR` read beyond
the overview's (mean |pi - mu|), as :func:`detector_signals` gives them."""


def detector_signals(metrics: Mapping[str, float]) -> dict[str, float]:
    """The fitted early warnings' signals from a step's metrics, as the ``early_signals`` view computes them:
    the population std of log(pi/mu) and the ESS share (sum w)^2 / (n sum w^2) = mean^2 / (mean^2 + std^2) of
    w = pi/mu (NaN where the step's summaries lack the importance-weight rows), the bad-update rate, and the mean
    entropy of pi (the ``entropy`` summary's mean; NaN where the trainer hands the logger no entropy)."""
    mean = metrics.get(f"{PREFIX}/is_weight/mean", math.nan)
    std = metrics.get(f"{PREFIX}/is_weight/std", math.nan)
    spread = mean * mean + std * std
    return {"log_ratio_std": metrics.get(f"{PREFIX}/log_ratio/std", math.nan),
            "ess_frac": mean * mean / spread if spread > 0 else math.nan,
            "bad_negative_rate": metrics.get(f"{PREFIX}/bad_negative_rate", math.nan),
            "entropy_mean": metrics.get(f"{PREFIX}/entropy/mean", math.nan)}


class EarlyWarning:
    """The collapse early warning, step by step, as :func:`trustscope.early_warning.collapse_warnings` computes it over
    a run's logs (the same function, over the steps seen so far): adds ``trustscope/warning`` (0 or 1),
    ``trustscope/warning/bad_rate_recent`` and ``trustscope/warning/mismatch_growth`` to a step's metrics.

    It keeps the run's first steps (the lines' ``window``, or the detector's baseline where longer) and the last
    ``window`` (or the detector's window), so its memory and time stay fixed however long the run. ``lines``: a
    :class:`trustscope.early_warning.WarningLines` (default: its defaults); with ``relative_z`` set, the detector is
    :data:`trustscope.early_warning.RELATIVE_DETECTOR`, on the step's entropy and mean |pi - mu| against the run's first
    steps (score NaN, and the relative lines alone, where the trainer logs no entropy).
    """

    def __init__(self, lines: Any = None):
        from trustscope.early_warning import WarningLines, detector_for

        self.lines = lines or WarningLines()
        self.detector = detector_for(self.lines)
        self._n_first = max(self.lines.window, self.detector.baseline or 0)
        self._n_recent = max(self.lines.window, self.detector.window)
        self._first: list[dict[str, float]] = []
        self._recent: list[dict[str, float]] = []
        self.fired_at: int | None = None
        """The first step that warned, or None."""

    def update(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The warning's metrics at the step of ``metrics`` (a :func:`step_metrics` result); ``{}`` without one."""
        import pandas as pd

        from trustscope.db import Overview
        from trustscope.early_warning import collapse_warnings
        from trustscope.query.analyses import OVERVIEW_COLUMNS

        step = metrics.get(f"{PREFIX}/step")
        if step is None or f"{PREFIX}/tokens/total" not in metrics:
            return {}
        row = {"run_id": "run", "step": int(step), "n_tokens": metrics[f"{PREFIX}/tokens/total"],
               "n_bad_negative": metrics.get(f"{PREFIX}/bad_negative_count", math.nan),
               "bad_negative_rate": metrics.get(f"{PREFIX}/bad_negative_rate", math.nan),
               "mismatch_mean": metrics.get(f"{PREFIX}/mismatch/abs_mean", math.nan),
               "mismatch_max": metrics.get(f"{PREFIX}/mismatch/abs_max", math.nan),
               "reward_mean": math.nan, **detector_signals(metrics)}
        if self._recent and self._recent[-1]["step"] == row["step"]:
            self._recent[-1] = row  # the same step again (a later call of it): its newer figures
            if len(self._first) <= self._n_first and self._first[-1]["step"] == row["step"]:
                self._first[-1] = row
        else:
            if len(self._first) < self._n_first:
                self._first.append(row)
            self._recent = [*self._recent, row][-self._n_recent:]
        # the baseline window, then the recent one: rolling sums of the last window and the position past the
        # baseline come out as over the whole run (the rows between them are not read by either)
        seen = self._first + [r for r in self._recent if r["step"] > self._first[-1]["step"]]
        steps = pd.DataFrame(seen).reindex(columns=list(dict.fromkeys([*OVERVIEW_COLUMNS, *DETECTOR_SIGNALS])))
        try:
            last = collapse_warnings(Overview(steps, pd.DataFrame(), pd.DataFrame()), ["run"], self.lines,
                                     self.detector).iloc[-1]
        except (KeyError, ValueError, IndexError) as err:  # a warning that reads figures these rows lack
            warnings.warn(f"trustscope: the early warning could not be computed from the step summaries: {err!r}",
                          TrackerWarning, stacklevel=2)
            return {}
        fired = bool(last["warning"])
        if fired and self.fired_at is None:
            self.fired_at = int(step)
        return {f"{PREFIX}/warning": float(fired),
                f"{PREFIX}/warning/score": float(last["score"]),
                f"{PREFIX}/warning/bad_rate_recent": float(last["bad_rate_recent"]),
                f"{PREFIX}/warning/mismatch_growth": float(last["mismatch_growth"]),
                **({f"{PREFIX}/warning/bad_rate_z": float(last["bad_rate_z"]),
                    f"{PREFIX}/warning/mismatch_z": float(last["mismatch_z"])}
                   if self.lines.relative_z is not None else {})}

    def reason(self, metrics: Mapping[str, float]) -> str:
        """One line saying why the warning fires, from :meth:`update`'s metrics."""
        from trustscope.early_warning import DETECTOR_LABELS

        detector = self.detector
        rate = metrics.get(f"{PREFIX}/warning/bad_rate_recent", math.nan)
        growth = metrics.get(f"{PREFIX}/warning/mismatch_growth", math.nan)
        score = metrics.get(f"{PREFIX}/warning/score", math.nan)
        why = []
        if score >= detector.threshold:  # NaN (a run logged without the detector's signals) compares False
            why.append(f"early-warning score {score:.2f} >= {detector.threshold:.2f} over the last "
                       f"{detector.window} steps' {', '.join(DETECTOR_LABELS[n] for n in detector.signals)}"
                       + (f", each against the run's first {detector.baseline} steps" if detector.baseline else ""))
        if self.lines.relative_z is not None:
            z = self.lines.relative_z
            for name, said in (("bad_rate_z", f"bad negative updates {rate:.2%} of the last {self.lines.window} "
                                              "steps' tokens"),
                               ("mismatch_z", f"|pi - mu| {growth:.1f}x its first {self.lines.window} steps")):
                value = metrics.get(f"{PREFIX}/warning/{name}", math.nan)
                if value >= z:
                    why.append(f"{said}, {value:.1f} robust deviations above the run's first steps (line {z:g})")
            return "; ".join(why) or "the early-warning lines were crossed"
        if rate >= self.lines.bad_rate:
            why.append(f"bad negative updates {rate:.2%} of the last {self.lines.window} steps' tokens "
                       f"(line {self.lines.bad_rate:.2%})")
        if growth >= self.lines.mismatch_growth:
            why.append(f"|pi - mu| {growth:.1f}x its first {self.lines.window} steps "
                       f"(line {self.lines.mismatch_growth:g}x)")
        return "; ".join(why) or "the early-warning lines were crossed"


def committed_step_rows(run_dir: str | os.PathLike, step: int, ranks: Iterable[int] | None = None) -> list[dict]:
    """The ``summaries`` rows of ``step`` in a local run's committed files (of ``ranks``, default every rank):
    what the loggers of other processes wrote, read once their flush is committed. Only the files whose name
    spans ``step`` are opened."""
    import pyarrow.dataset as ds

    from trustscope import runformat as S

    wanted = None if ranks is None else set(ranks)
    files = []
    for path in S.committed_files(Path(run_dir)).get("summaries", []):
        name = S.parse_data_file(path.name)
        if name is None or (name.first_step <= step <= name.last_step
                            and (wanted is None or name.rank in wanted)):
            files.append(str(path))
    if not files:
        return []
    table = ds.dataset(files, format="parquet").to_table(filter=ds.field("step") == step)
    if wanted is not None:
        table = table.filter(ds.field("rank").isin(sorted(wanted)))
    return [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]


class StepReporter:
    """What an integration calls once a step: the latest summarised step of a
    :class:`~trustscope.logger.TokenLogger` as metrics, with the early warning, each step reported once.

    ``wait_s``: how long :meth:`metrics` may wait for the logger's writer thread to summarise the calls logged so
    far (0: never wait; the figures are then those of the latest step it has finished, which ``trustscope/step``
    names). ``alerts``: an :class:`trustscope.alerts.Alerts` told when the warning fires. ``lines``: the
    warning's :class:`trustscope.early_warning.WarningLines` (default: its defaults; ``relative_z`` for the relative mode).
    ``frameworks``: a :class:`FrameworkReporter`, whose figures (the frameworks' own mismatch figures, named as
    they name them) join each step's metrics.
    """

    def __init__(self, logger: Any, *, wait_s: float = 0.0, warning: bool = True, alerts: Any = None,
                 run_id: str | None = None, lines: Any = None, frameworks: FrameworkReporter | None = None):
        self.frameworks = frameworks
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s < math.inf:
            raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
        self.logger = logger
        self.wait_s = float(wait_s)
        self.warning = EarlyWarning(lines) if warning else None
        self.alerts = alerts
        self.run_id = run_id or getattr(logger, "run_id", None) or "run"
        self._reported: int | None = None
        self._rules: dict[str, set[str]] = {}  # metric -> the rules seen in its rows so far

    def metrics(self) -> dict[str, float]:
        """The metrics of the latest step summarised since the last call, or ``{}`` when there is none new; with
        ``frameworks`` (a :class:`FrameworkReporter`), the frameworks' own figures of the newest step committed
        since the last call too."""
        out = self._summary_metrics()
        return {**out, **self.frameworks.metrics()} if self.frameworks is not None else out

    def _summary_metrics(self) -> dict[str, float]:
        latest = self.logger.step_summaries(wait_s=self.wait_s)
        if latest is None:
            return {}
        step, rows = latest
        if self._reported is not None and step <= self._reported:
            return {}
        self._reported = step
        return self.from_rows(rows, step)

    def from_rows(self, rows: Iterable[Mapping[str, Any]], step: int) -> dict[str, float]:
        """Step ``step``'s metrics from its summary rows, with the early warning; every rule seen at an earlier
        step is reported (0 where it blocked nothing)."""
        rows = list(rows)
        for row in rows:
            if row.get("rule") is not None:
                self._rules.setdefault(str(row["metric"]), set()).add(str(row["rule"]))
        return self.add_warning(step_metrics(rows, step, self._rules)) if rows else {}

    def add_warning(self, out: dict[str, float]) -> dict[str, float]:
        """``out`` with the early warning's metrics; tells :attr:`alerts` when it fires."""
        if self.warning is not None and out:
            out.update(self.warning.update(out))
            if out.get(f"{PREFIX}/warning") and self.alerts is not None:
                self.alerts.warning(self.run_id, int(out[f"{PREFIX}/step"]), self.warning.reason(out))
        return out


# ----------------------------------------------------------------------------------------------------- trackers


def parse_report_to(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"wandb,tensorboard"`` (or a list, or ``"none"``/empty) as a tuple of tracker names, checked."""
    if value is None:
        return ()
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value)]
    names = [n for n in names if n and n != "none"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {unknown}; choose from {list(TRACKERS)} (comma-separated)")
    return tuple(dict.fromkeys(names))


def _own_step(metrics: Mapping[str, float], step: int) -> list[tuple[int, dict[str, float]]]:
    """``metrics`` split by the step each describes: the ``trustscope/...`` ones at ``trustscope/step`` (the step
    the summaries are of), the others at ``step``."""
    ours = {k: v for k, v in metrics.items() if k.startswith(f"{PREFIX}/")}
    rest = {k: v for k, v in metrics.items() if k not in ours}
    at = int(ours.get(f"{PREFIX}/step", step))
    return [(s, m) for s, m in ((step, rest), (at, ours)) if m]


class Tracker:
    """One open tracker: :meth:`log` a step's metrics, :meth:`alert`, :meth:`close`."""

    name = ""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def alert(self, title: str, text: str) -> None:
        """An alert in the tracker itself (W&B and trackio have them; the others ignore it)."""

    def close(self) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    """A W&B run (``wandb.init``; offline unless ``WANDB_MODE`` or a login says otherwise, files under
    ``<run_dir>/wandb``); ``trustscope/*`` metrics are plotted against ``trustscope/step``."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_id: str, config: Mapping[str, Any] | None, project: str):
        import wandb

        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=project, name=run_id, id=run_id, dir=str(run_dir), mode=mode,
                              config=dict(config or {}))
        self.run.define_metric(f"{PREFIX}/step")
        self.run.define_metric(f"{PREFIX}/*", step_metric=f"{PREFIX}/step")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def alert(self, title: str, text: str) -> None:
        self.run.alert(title=title[:63], text=text, level=self.wandb.AlertLevel.WARN)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker(Tracker):
    """Event files under ``<run_dir>/tensorboard`` (``torch.utils.tensorboard``, which needs the tensorboard
    package)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for at, part in _own_step(metrics, step):
            for tag, value in part.items():
                self.writer.add_scalar(tag, value, global_step=at)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker(Tracker):
    """An MLflow run: the tracking URI of ``MLFLOW_TRACKING_URI``, else a file store ``file:<run_dir>/mlruns``
    (MLflow 3 keeps file stores in maintenance mode and opens one only with ``MLFLOW_ALLOW_FILE_STORE=true``, which
    this default sets unless it is set already)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_id: str, config: Mapping[str, Any] | None, project: str):
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local default: a file store beside the run, which MLflow 3 opens only when allowed
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run = self.client.create_run(experiment_id, run_name=run_id)
        self.run_id = self.run.info.run_id
        params = {k: str(v)[:500] for k, v in (config or {}).items() if not isinstance(v, dict | list)}
        if params:
            self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in params.items()])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, at) for at, part in
                                                    _own_step(metrics, step) for k, v in part.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker(Tracker):
    """A trackio run in its local store (``TRACKIO_DIR``, else the Hugging Face cache's ``trackio``)."""

    name = "trackio"

    def __init__(self, run_id: str, config: Mapping[str, Any] | None, project: str):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=run_id, config=dict(config or {}), embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def alert(self, title: str, text: str) -> None:
        self.run.alert(title=title, text=text, level=self.trackio.AlertLevel.WARN)

    def close(self) -> None:
        self.run.finish()


_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio"}


def open_trackers(names: Sequence[str], run_dir: str | os.PathLike, run_id: str,
                  config: Mapping[str, Any] | None = None, project: str = "trustscope") -> list[Tracker]:
    """Open each tracker of ``names`` (:data:`TRACKERS`) for run ``run_id``; files go under ``run_dir``.

    A tracker whose package is missing, or that fails to start, is left out with a :class:`TrackerWarning` naming
    the package and the extra to install (``pip install 'trustscope[trackers]'``); the others open.
    """
    run_dir = Path(run_dir)
    out: list[Tracker] = []
    for name in parse_report_to(list(names)):
        try:
            if name == "wandb":
                out.append(WandbTracker(run_dir, run_id, config, project))
            elif name == "tensorboard":
                out.append(TensorBoardTracker(run_dir))
            elif name == "mlflow":
                out.append(MlflowTracker(run_dir, run_id, config, project))
            else:
                out.append(TrackioTracker(run_id, config, project))
        except ImportError as err:
            warnings.warn(f"trustscope: report_to {name!r} left out: the {_PACKAGES[name]!r} package is not "
                          f"installed ({err}); install it with pip install 'trustscope[{EXTRA}]'. Training goes on.",
                          TrackerWarning, stacklevel=2)
        except Exception as err:  # a tracker that cannot start must not stop the training
            warnings.warn(f"trustscope: report_to {name!r} left out: it failed to start: {type(err).__name__}: "
                          f"{err}. Training goes on.", TrackerWarning, stacklevel=2)
    return out


class Trackers:
    """The open trackers of a run, written to together; a tracker that fails is warned about once and dropped."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def _each(self, what: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, what)(*args)
            except Exception as err:
                warnings.warn(f"trustscope: tracker {tracker.name!r} failed ({what}: {type(err).__name__}: {err}) "
                              f"and is left out from here on. Training goes on.", TrackerWarning, stacklevel=3)
                self.trackers.remove(tracker)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if metrics:
            self._each("log", metrics, step)

    def alert(self, title: str, text: str) -> None:
        self._each("alert", title, text)

    def close(self) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as err:
                warnings.warn(f"trustscope: closing tracker {tracker.name!r} failed: {type(err).__name__}: {err}",
                              TrackerWarning, stacklevel=2)
        self.trackers.clear()


class LiveTrackerAlerts:
    """Alerts raised in the trackers a framework opened itself (TRL's ``report_to``, verl's ``trainer.logger``):
    ``wandb.alert`` on the active W&B run, ``trackio.alert`` on the current trackio run, when ``names`` has them
    and they are running at the time of the alert. Looked up at each alert, never imported here first."""

    def __init__(self, names: Iterable[str] | str):
        given = {names} if isinstance(names, str) else {str(n) for n in names}
        self.names = {"wandb", "trackio"} if "all" in given else given & {"wandb", "trackio"}

    def alert(self, title: str, text: str) -> None:
        import sys

        wandb = sys.modules.get("wandb") if "wandb" in self.names else None
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.run.alert(title=title[:63], text=text, level=wandb.AlertLevel.WARN)
        trackio = sys.modules.get("trackio") if "trackio" in self.names else None
        if trackio is not None:
            from trackio import context_vars

            if context_vars.current_run.get() is not None:
                trackio.alert(title=title, text=text, level=trackio.AlertLevel.WARN)


class RunReporting:
    """The integrated trainer's reporting (``--report-to``, ``--webhook``): each step, the trainer's scalars and
    the newest summarised step's ``trustscope/...`` metrics to every tracker, the early warning to the webhook
    and the trackers' alerts. Each step waits up to ``wait_s`` for the logger's writer thread to summarise it
    (milliseconds, unless the thread is busy writing a flush; past that the step reports the newest step it
    has summarised); :meth:`close` flushes the logger once and reports the last step. Rank 0 only (its logger's
    tokens: with several ranks, its share). ``lines``: the early warning's :class:`trustscope.early_warning.WarningLines`."""

    def __init__(self, logger: Any, report_to: Sequence[str], webhook: str | None, run_dir: str | os.PathLike,
                 run_id: str, config: Mapping[str, Any] | None = None, project: str = "trustscope",
                 wait_s: float = 5.0, lines: Any = None):
        from trustscope.alerts import Alerts, check_webhook_url

        url = check_webhook_url(webhook) if webhook else None
        self.logger = logger
        self.trackers = Trackers(open_trackers(report_to, run_dir, run_id, config, project))
        self.alerts = Alerts(url, logger=logger, trackers=self.trackers) if url or self.trackers.trackers else None
        self.reporter = StepReporter(logger, wait_s=wait_s, alerts=self.alerts, run_id=run_id, lines=lines)
        self._step: int | None = None

    def step(self, step: int, scalars: Mapping[str, float] | None = None) -> dict[str, float]:
        """Report ``step``: the trainer's ``scalars`` and the newest summarised step's metrics. Never raises."""
        try:
            metrics = {**{k: float(v) for k, v in (scalars or {}).items()}, **self.reporter.metrics()}
            self.trackers.log(metrics, step)
            self._step = step
            return metrics
        except Exception as err:
            warnings.warn(f"trustscope: step {step} could not be reported: {type(err).__name__}: {err}",
                          TrackerWarning, stacklevel=2)
            return {}

    def close(self) -> None:
        """Report the steps summarised since the last report, then close the trackers and the alerts."""
        try:
            if self._step is not None:
                self.logger.flush()
                last = self.reporter.metrics()
                if last:
                    self.trackers.log(last, self._step)
        except Exception as err:
            warnings.warn(f"trustscope: the last step could not be reported: {type(err).__name__}: {err}",
                          TrackerWarning, stacklevel=2)
        finally:
            if self.alerts is not None:
                self.alerts.close()
            self.trackers.close()

    def __enter__(self) -> RunReporting:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------------- the frameworks' own figures

def framework_step_metrics(tokens: Any, frameworks: Iterable[str] | None = None, *,
                           variants: Mapping[str, str | None] | None = None, token_fraction: float | None = None,
                           analysis: Mapping[str, float] | None = None) -> dict[str, float]:
    """The frameworks' own mismatch figures of one step's token rows (a ``pyarrow.Table``, see
    :func:`trustscope.framework_metrics.compute`) as flat tracker metrics named ``trustscope/<the framework's own
    name>`` (``trustscope/rollout_corr/kl``, ``trustscope/mismatch_kl/all/mean``, ``trustscope/tis``, ...), from the
    same SQL as the ``framework_metrics`` view. ``frameworks``: which (default all of
    :data:`trustscope.framework_metrics.FRAMEWORK_NAMES`); ``variants``: the setting each is reported under
    (default :data:`trustscope.framework_metrics.DEFAULT_VARIANTS`, each framework's own default; e.g. verl's
    ``rollout_is=token``, slime's ``calculate_per_token_loss``, TRL's ``vllm_importance_sampling_mode=token_mask``).
    ``trustscope/frameworks/exact`` is 0 when the figures come from a sample of the token rows (``token_fraction``
    < 1): estimates, not the framework's numbers. Rows of several steps are refused, naming the steps; no rows give
    ``{}``."""
    from trustscope import framework_metrics as fm

    chosen = tuple(fm.FRAMEWORK_NAMES if frameworks is None else frameworks)
    for name in chosen:
        fm.framework(name)
    wanted = {**fm.DEFAULT_VARIANTS, **(variants or {})}
    if tokens.num_rows == 0:
        return {}
    steps = sorted(set(tokens.column("step").to_pylist()))
    if len(steps) > 1:
        raise ValueError(f"framework_step_metrics takes one step's rows; got steps {steps[:5]}")
    out: dict[str, float] = {f"{PREFIX}/frameworks/step": float(steps[0])}
    exact = True
    for row in fm.compute(tokens, token_fraction=token_fraction, analysis=analysis).to_pylist():
        if row["framework"] not in chosen or row["variant"] not in (None, wanted.get(row["framework"])):
            continue
        out[f"{PREFIX}/{row['metric']}"] = float(row["value"])
        exact = exact and bool(row["exact"])
    out[f"{PREFIX}/frameworks/exact"] = float(exact)
    return out


def committed_token_rows(run_dir: str | os.PathLike, step: int, columns: Sequence[str]) -> Any:
    """``columns`` of the token rows of ``step`` in a local run's committed files, every rank's (a
    ``pyarrow.Table``; columns a file lacks read null). Only the files whose name spans ``step`` are opened."""
    import pyarrow.dataset as ds

    from trustscope import runformat

    files = []
    for path in runformat.committed_files(Path(run_dir)).get("tokens", []):
        name = runformat.parse_data_file(path.name)
        if name is None or name.first_step <= step <= name.last_step:
            files.append(str(path))
    dataset = ds.dataset(files, format="parquet")
    present = [c for c in columns if c in dataset.schema.names]
    return dataset.to_table(columns=present, filter=ds.field("step") == step)


class FrameworkReporter:
    """The frameworks' own figures (:func:`framework_step_metrics`) of the newest step whose token rows a run has
    committed, each step once: what :class:`StepReporter` adds to a step's tracker metrics when given one.

    A step is taken once a committed tokens file of ``rank`` (default: every rank) reaches a later step (the
    loggers write steps in order), so its rows are all in; its figures arrive with a later step's metrics, and
    ``trustscope/frameworks/step`` names the step they describe. It reads committed files only and never waits on
    the writer; reading a step's rows costs a Parquet read of them on the calling thread (opt in). Rows of other
    ranks are counted where committed by then."""

    def __init__(self, run_dir: str | os.PathLike, frameworks: Iterable[str] | None = None, *,
                 variants: Mapping[str, str | None] | None = None, token_fraction: float | None = None,
                 analysis: Mapping[str, float] | None = None, rank: int | None = None):
        from trustscope import framework_metrics as fm

        self.frameworks = tuple(fm.FRAMEWORK_NAMES if frameworks is None else frameworks)
        for name in self.frameworks:
            fm.framework(name)
        unknown = sorted(set(variants or {}) - set(fm.FRAMEWORK_NAMES))
        if unknown:
            raise ValueError(f"variants names unknown framework(s) {unknown}; known: {list(fm.FRAMEWORK_NAMES)}")
        self.run_dir = Path(run_dir)
        self.variants = dict(variants or {})
        self.token_fraction = token_fraction
        self.analysis = dict(analysis or {})
        self.rank = rank
        self._reported: int | None = None

    def complete_step(self) -> int | None:
        """The newest step whose rows are all committed (a committed file of the rank reaches a later step)."""
        from trustscope import runformat

        last = None
        for path in runformat.committed_files(self.run_dir).get("tokens", []):
            name = runformat.parse_data_file(path.name)
            if name is not None and (self.rank is None or name.rank == self.rank):
                last = name.last_step if last is None else max(last, name.last_step)
        return None if last is None else last - 1

    def metrics(self, final: bool = False) -> dict[str, float]:
        """The figures of the newest complete step not reported yet, or ``{}``. ``final``: the run is over, so
        its last step counts as complete too."""
        from trustscope import framework_metrics as fm

        step = self.complete_step()
        if step is not None and final:
            step += 1
        if step is None or step < 0 or (self._reported is not None and step <= self._reported):
            return {}
        self._reported = step
        rows = committed_token_rows(self.run_dir, step, [*fm.NEEDS, "env"])
        return framework_step_metrics(rows, self.frameworks, variants=self.variants,
                                      token_fraction=self.token_fraction, analysis=self.analysis)
