"""How well the collapse early warning (trustscope.report.WarningLines) anticipates reward dips on a log directory.

    .venv/bin/python -m studies.eval_collapse_warning [LOGDIR]          # default: sample_logs/
    .venv/bin/python -m studies.eval_collapse_warning [LOGDIR] --relative   # also the lines against each run's start

A reward dip is a step where the reward's moving average over ``--dip-window`` steps falls ``--dip`` or more below
its best so far (its first step counts; the dip lasts until the average recovers). For each warning line it
reports, over every run: the dips, how many were preceded by a warning within ``--horizon`` steps and by how many
steps, and the warning episodes (consecutive warning steps) followed by no dip within the horizon (false alarms).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

from trustscope import db, report  # noqa: E402


def dips(steps: pd.DataFrame, window: int, depth: float) -> list[int]:
    """First steps of the reward dips of one run (``steps``: step, reward_mean, sorted)."""
    avg = steps["reward_mean"].rolling(window, min_periods=window).mean()
    best = avg.cummax()
    below = (best - avg >= depth).fillna(False).tolist()
    return [int(s) for s, now, before in zip(steps["step"], below, [False, *below[:-1]], strict=True)
            if now and not before]


def episodes(warn: pd.DataFrame) -> list[int]:
    """First steps of the runs of consecutive warning steps."""
    flags = warn["warning"].astype(bool).tolist()
    return [int(s) for s, now, before in zip(warn["step"], flags, [False, *flags[:-1]], strict=True) if now and not before]


def evaluate(conn: db.LogDB, lines: report.WarningLines, dip_window: int, depth: float, horizon: int) -> dict:
    summary = conn.step_summary().sort_values(["run_id", "step"])
    run_ids = sorted(summary["run_id"].unique())
    warnings = report.collapse_warnings(conn, run_ids, lines, detector=None)
    caught, leads, n_dips, false_alarms, n_episodes, warned_runs = 0, [], 0, 0, 0, 0
    for run_id in run_ids:
        steps = summary[summary["run_id"] == run_id]
        warn = warnings[warnings["run_id"] == run_id].sort_values("step")
        run_dips = dips(steps, dip_window, depth)
        starts = episodes(warn)
        warned_runs += bool(starts)
        n_dips += len(run_dips)
        warn_steps = warn.loc[warn["warning"].astype(bool), "step"].tolist()
        for dip in run_dips:
            before = [s for s in warn_steps if dip - horizon <= s <= dip]
            if before:
                caught += 1
                leads.append(dip - min(before))
        n_episodes += len(starts)
        false_alarms += sum(1 for s in starts if not any(s <= d <= s + horizon for d in run_dips))
    return {"bad_rate": lines.bad_rate, "mismatch_growth": lines.mismatch_growth, "window": lines.window,
            "relative_z": lines.relative_z,
            "runs": len(run_ids), "runs_warned": warned_runs, "dips": n_dips, "dips_warned": caught,
            "median_lead_steps": float(pd.Series(leads).median()) if leads else float("nan"),
            "episodes": n_episodes, "false_alarms": false_alarms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logdir", nargs="?", default=str(ROOT / "sample_logs"))
    parser.add_argument("--dip", type=float, default=0.15, help="reward drop below the best moving average")
    parser.add_argument("--dip-window", type=int, default=10)
    parser.add_argument("--horizon", type=int, default=20, help="steps a warning may precede a dip by")
    parser.add_argument("--relative", action="store_true", help="also the run-relative lines (WarningLines."
                                                                "relative_z), in robust deviations")
    args = parser.parse_args()
    grid = [report.WarningLines(bad_rate=b, mismatch_growth=g, window=w)
            for w in (10, 20) for b in (0.005, 0.01, 0.02) for g in (2.0, 3.0)]
    if args.relative:
        grid += [report.WarningLines(window=w, relative_z=z) for w in (10, 20) for z in (3.0, 4.0, 6.0, 8.0)]
    with db.connect(args.logdir) as conn:
        rows = [evaluate(conn, lines, args.dip_window, args.dip, args.horizon) for lines in grid]
    pd.set_option("display.width", 200)
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
