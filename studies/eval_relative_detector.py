"""The early-warning detector refitted in the run's own terms, judged on held-out runs of other mismatch scales
(docs/experiments.md, "The detector in the run's own terms").

    .venv/bin/python -m studies.eval_relative_detector --fit runs/cal --held runs/climb-v2w sample_logs [--baseline 10]
        [--z 3 6] [--by-folder]

Every run under the ``--fit`` folders is a fitting run, every run under ``--held`` a held-out one. Each signal of
the ``early_signals`` view enters the relative detector as :func:`trustscope.report.relative_signals` gives it:
the mean of its last 5 steps in robust deviations above the run's first ``--baseline`` steps. The detector is
fitted as the absolute one was (``studies/eval_early_warning.py``: forward selection of up to three signals by the
fitting runs' log-loss, a logistic fit, the most permissive threshold with at most one false alarm per four
fitting runs) and judged on the held-out runs beside: the shipped absolute detector (``report.DETECTOR``), an
absolute detector refitted on the same fitting runs (so that "relative" and "fitted on other runs" are told
apart), the shipped relative detector (``report.RELATIVE_DETECTOR``), the shipped lines, the relative lines, and
the warnings as ``trustscope report`` gives them (the default; ``--warn-relative Z``: the relative lines or the
relative detector). Collapses, leads and false alarms are counted as in ``eval_early_warning.judge``; with
``--by-folder``, for all the held-out runs and for each ``--held`` folder's alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from studies import eval_early_warning as ew  # noqa: E402

RELATIVE = ("mismatch_mean", "ess_frac", "seq_log_ratio_p99", "log_ratio_std", "entropy_mean", "grad_norm",
            "bad_negative_rate")
"""Candidates of the relative detector: the signals whose level has a baseline (slopes are changes already; the
trainer's blocked fraction is 0 in every step of a rule without a trust region)."""
SHIPPED = ("mismatch_mean", "entropy_mean", "grad_norm", "bad_negative_rate")
"""The candidates runs logged before the importance-weight rows have too (the toy-v2 sample logs that
``sample_logs/`` held up to commit d114d27, and ``tests/data/legacy``)."""


def run_dirs(folders: list[Path]) -> list[Path]:
    """The finished runs under ``folders`` (a run still training has no collapse to judge yet)."""
    import json

    from trustscope import runformat

    def finished(run: Path) -> bool:
        try:
            return json.loads((run / runformat.MANIFEST).read_text()).get("status") == "finished"
        except (OSError, ValueError):
            return False

    return sorted({run for folder in folders for run in runformat.run_dirs(folder) if finished(run)})


def label(run: Path) -> str:
    """A run's name here: its folder and its id (calibration runs in different folders share ids)."""
    return f"{run.parent.name}/{run.name}"


def raw_signals(runs: list[Path]):
    """Per run and step: reward_mean and every candidate signal, as the view gives them (one step each); run_id is
    :func:`label`'s name."""
    import pandas as pd

    from trustscope import db

    cols = ", ".join(dict.fromkeys([*ew.SIGNALS, *RELATIVE]))
    parts = []
    for run in runs:
        with db.connect(run, cache=False) as conn:
            part = conn.sql(f"select run_id, step, reward_mean, {cols} from early_signals",
                            timeout_s=ew.QUERY_S).to_pandas()
        parts.append(part.assign(run_id=label(run)))
    return pd.concat(parts, ignore_index=True).sort_values(["run_id", "step"]).reset_index(drop=True)


def line_flags(runs: list[Path], lines):
    """The warning lines (``report.WarningLines``) on each run, run_id as :func:`label` names it."""
    import pandas as pd

    from trustscope import db, report

    parts = []
    for run in runs:
        with db.connect(run, cache=False) as conn:
            ids = conn.runs().run_id.tolist()
            parts.append(report.collapse_warnings(conn, ids, lines, detector=None).assign(run_id=label(run)))
    return pd.concat(parts, ignore_index=True)


def features(raw, signals, relative: bool, baseline: int):
    """The detector's inputs per run and step: each signal's 5-step mean (absolute) or its relative value."""
    import pandas as pd

    from trustscope.report import relative_signals

    parts = []
    for _, one in raw.groupby("run_id", sort=True):
        one = one.sort_values("step")
        if relative:
            x = relative_signals(one, list(signals), ew.SMOOTH, baseline)
        else:
            x = one[list(signals)].astype(float).rolling(ew.SMOOTH, min_periods=1).mean()
        parts.append(pd.concat([one[["run_id", "step", "reward_mean"]], x], axis=1).assign(
            n=range(1, len(one) + 1)))
    return pd.concat(parts, ignore_index=True)


def flags_of(detector, raw, runs: list[str]):
    """Per-step warnings of ``detector`` on ``runs`` (a run lacking one of its signals never warns)."""
    import numpy as np
    import pandas as pd

    parts = []
    for run_id, one in raw[raw.run_id.isin(runs)].groupby("run_id", sort=True):
        one = one.sort_values("step")
        if all(one[s].notna().any() for s in detector.signals):
            score, warn = detector.score(one)
        else:
            score, warn = np.full(len(one), np.nan), np.zeros(len(one), bool)
        parts.append(pd.DataFrame({"run_id": run_id, "step": one.step.to_numpy(), "score": score,
                                   "warning": warn}))
    return pd.concat(parts, ignore_index=True)


def fit(raw, fit_ids, collapses, signals, relative: bool, baseline: int):
    """A detector fitted on the fitting runs (weights, bias, threshold chosen there), and its selection path."""
    import numpy as np

    from trustscope.report import Detector

    frame = features(raw[raw.run_id.isin(fit_ids)], signals, relative, baseline)
    first = max(ew.SMOOTH, baseline + 1) if relative else ew.SMOOTH
    rows = ew.labels(frame[frame.n >= first].assign(step=frame.step), {r: collapses[r] for r in fit_ids})
    usable = [s for s in signals if rows[s].notna().mean() > 0.95]
    rows = rows.replace([np.inf, -np.inf], np.nan).dropna(subset=usable)
    weights, bias, path = ew.fit_detector(rows, tuple(usable))
    def make(t: float) -> Detector:
        return Detector(weights=tuple(weights.items()), bias=bias, threshold=float(t),
                        baseline=baseline if relative else None)

    scores = flags_of(make(-np.inf), raw, fit_ids)
    levels = sorted(np.unique(np.quantile(scores.score.dropna(), np.linspace(0.3, 1.0, 71))))
    fit_c = {r: collapses[r] for r in fit_ids}
    t = ew.operating_point(lambda t: scores.assign(warning=scores.warning & (scores.score >= t)), levels,
                           len(fit_ids), fit_c)
    detector = make(levels[-1] if t is None else t)
    return detector, path, ew.judge(flags_of(detector, raw, fit_ids), fit_c)


def report_flags(runs: list[Path], lines):
    """The collapse warning on each run exactly as ``trustscope report`` gives it with ``lines`` (the lines and the
    detector :func:`trustscope.report.collapse_warnings` picks for them), run_id as :func:`label` names it."""
    import pandas as pd

    from trustscope import db, report

    parts = []
    for run in runs:
        with db.connect(run, cache=False) as conn:
            ids = conn.runs().run_id.tolist()
            parts.append(report.collapse_warnings(conn, ids, lines).assign(run_id=label(run)))
    return pd.concat(parts, ignore_index=True)


def either(a, b):
    """Per-step flags warning where ``a`` or ``b`` does."""
    both = a[["run_id", "step", "warning"]].merge(b[["run_id", "step", "warning"]], on=["run_id", "step"],
                                                  how="outer", suffixes=("", "_b"))
    both["warning"] = both["warning"].fillna(False).astype(bool) | both["warning_b"].fillna(False).astype(bool)
    return both[["run_id", "step", "warning"]]


def group_of(run_id: str) -> str:
    """The held-out group of a run: its folder (:func:`label`'s first part)."""
    return run_id.split("/", 1)[0]


def print_table(table: list[dict]) -> None:
    print("| warning | setting | runs it can score | collapses | warned | median lead (steps) | warning episodes | "
          "false alarms | runs with a false alarm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        lead = "-" if r["median_lead"] != r["median_lead"] else f"{r['median_lead']:.1f}"
        print(f"| {r['warning']} | {r['setting']} | {r['scored']} | {r['collapses']} | {r['warned']} | {lead} | "
              f"{r['episodes']} | {r['false_alarms']} | {r['runs_with_false_alarm']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", type=Path, nargs="+", required=True)
    parser.add_argument("--held", type=Path, nargs="+", required=True)
    parser.add_argument("--baseline", type=int, default=10)
    parser.add_argument("--z", type=float, nargs="+", default=[3.0, 6.0], help="relative lines to judge")
    parser.add_argument("--by-folder", action="store_true", help="also a table for each folder of held-out runs")
    args = parser.parse_args()

    from trustscope import report

    fit_runs, held_runs = run_dirs(args.fit), run_dirs(args.held)
    raw = raw_signals(fit_runs + held_runs)
    names = {p: label(p) for p in fit_runs + held_runs}
    fit_ids = sorted({names[p] for p in fit_runs} & set(raw.run_id))
    held_ids = sorted({names[p] for p in held_runs} & set(raw.run_id))
    if set(fit_ids) & set(held_ids):
        raise SystemExit(f"a run is both fitting and held out: {sorted(set(fit_ids) & set(held_ids))}")
    collapses = {r: ew.collapse_step(one) for r, one in raw.groupby("run_id")}
    for split, ids in (("fit", fit_ids), ("held out", held_ids)):
        print(f"{split}: {len(ids)} runs, {sum(collapses[r] is not None for r in ids)} collapse")
        for r in ids:
            n = int((raw.run_id == r).sum())
            print(f"  {r}: {n} steps, collapse at {collapses[r]}, mean |pi - mu| "
                  f"{raw.loc[raw.run_id == r, 'mismatch_mean'].mean():.4f}")

    def scorable(detector, ids) -> int:
        return sum(all(raw.loc[raw.run_id == r, s].notna().any() for s in detector.signals) for r in ids)

    rows = []  # (warning, setting, detector or None, per-step flags over every held-out run)
    fitted = {}
    for name, signals, relative in (("relative detector", RELATIVE, True),
                                    ("relative detector, shipped-run signals", SHIPPED, True),
                                    ("absolute detector refitted on these runs", ew.SIGNALS, False)):
        detector, path, on_fit = fit(raw, fit_ids, collapses, signals, relative, args.baseline)
        fitted[name] = detector
        print(f"\n{name}: path {[(s, round(v, 4)) for s, v in path]}\n  {detector}\n  on the fitting runs: {on_fit}")
        rows.append((name, f"score >= {detector.threshold:.3g}", detector, flags_of(detector, raw, held_ids)))
    for name, detector in (("shipped relative detector (report.RELATIVE_DETECTOR)", report.RELATIVE_DETECTOR),
                           ("shipped absolute detector (report.DETECTOR)", report.DETECTOR)):
        rows.append((name, f"score >= {detector.threshold:.3g}", detector, flags_of(detector, raw, held_ids)))
    held_paths = [p for p in held_runs if label(p) in held_ids]
    shipped_lines = line_flags(held_paths, report.WarningLines())
    rows.append(("**shipped default** (report.DETECTOR or the lines: `report`)", "as shipped", None,
                 report_flags(held_paths, report.WarningLines())))
    rows.append(("report.RELATIVE_DETECTOR or the shipped lines", "as shipped", None,
                 either(flags_of(report.RELATIVE_DETECTOR, raw, held_ids), shipped_lines)))
    rows.append(("shipped lines (bad rate 1%, 2x mismatch)", "window 10", None, shipped_lines))
    for z in args.z:
        lines = report.WarningLines(relative_z=z)
        rows.append((f"relative lines, {z:g} deviations", f"window {lines.window}", None,
                     line_flags(held_paths, lines)))
        rows.append((f"relative mode (`report --warn-relative {z:g}`: the relative lines or RELATIVE_DETECTOR)",
                     f"window {lines.window}", None, report_flags(held_paths, lines)))

    groups = {"all held-out runs": held_ids}
    if args.by_folder:
        for r in held_ids:
            groups.setdefault(group_of(r), []).append(r)
    for group, ids in groups.items():
        c = {r: collapses[r] for r in ids}
        print(f"\n{group}: {len(ids)} runs, {sum(v is not None for v in c.values())} collapse "
              f"(at steps {sorted(v for v in c.values() if v is not None)})\n")
        print_table([{"warning": name, "setting": setting,
                      "scored": len(ids) if detector is None else scorable(detector, ids),
                      **ew.judge(flags[flags.run_id.isin(ids)], c)} for name, setting, detector, flags in rows])
    d = fitted["relative detector"]
    print(f"\nrelative detector, full precision: weights {d.weights!r}, bias {d.bias!r}, threshold {d.threshold!r}, "
          f"baseline {d.baseline}")


if __name__ == "__main__":
    main()
