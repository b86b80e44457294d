"""The early-warning study on toy world v2: a sweep where collapses are common, a detector fitted on some runs and
judged on others (docs/experiments.md, "An early warning fitted on collapsing runs").

    .venv/bin/python -m studies.eval_early_warning sweep [--logdir runs/ew-v2] [--shard 0/2] [--steps 80]
    .venv/bin/python -m studies.eval_early_warning eval  [--logdir runs/ew-v2] [--out docs/img]

``sweep`` trains the runs of :data:`FIT` and :data:`HELD_OUT` (``--shard i/n``: every n-th, from the i-th, so two
processes share the list), skipping finished ones, each at one torch thread. ``eval`` reads the runs' exact
per-step signals (the ``early_signals`` view), fits the detector on the fitting runs only and judges it, each
single signal and the shipped warning on the held-out runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIT = (("pg_is", 2e-4, 2), ("pg_is", 3e-4, 1), ("cispo", 3e-4, 2), ("grpo", 2.5e-4, 4),
       ("dppo_binary_tv", 2e-4, 1), ("ppo_clip", 2e-4, 1))
"""(rule, lr, policy_lag) of the fitting runs, seeds :data:`FIT_SEEDS`: no trust region, truncated IS and GRPO's
clip at high lr and lag, where collapses come, and two trust-region rules at the ``sanity-v2`` setting."""
HELD_OUT = (("pg_is", 2.5e-4, 3), ("pg_is", 3e-4, 0), ("minirl", 3e-4, 2), ("ppo_clip", 3e-4, 4),
            ("dppo_binary_tv", 2.5e-4, 2), ("dppo_binary_kl", 2e-4, 1))
"""(rule, lr, policy_lag) of the held-out runs, seeds :data:`HELD_SEEDS`: other settings and other seeds."""
FIT_SEEDS = (0, 1)
HELD_SEEDS = (2, 3)


def run_name(rule: str, lr: float, lag: int, seed: int) -> str:
    return f"ew-{rule}-lr{lr:.1e}-lag{lag}-s{seed}".replace("e-0", "e-")


def plan() -> list[tuple[str, str, dict]]:
    """``(run_id, split, overrides)`` of every run, fitting and held-out runs interleaved so that every shard and
    a partial sweep have both."""
    fit = [(run_name(r, lr, lag, s), "fit", {"loss": r, "lr": lr, "policy_lag": lag, "seed": s})
           for s in FIT_SEEDS for r, lr, lag in FIT]
    held = [(run_name(r, lr, lag, s), "held_out", {"loss": r, "lr": lr, "policy_lag": lag, "seed": s})
            for s in HELD_SEEDS for r, lr, lag in HELD_OUT]
    runs = [run for j, pair in enumerate(zip(fit, held, strict=True)) for run in (pair if j % 2 == 0 else pair[::-1])]
    for _, _, change in runs:
        if change["loss"] in ("minirl", "minirl_tis"):
            change["recompute_old"] = True
    return runs


def split_of() -> dict[str, str]:
    return {rid: split for rid, split, _ in plan()}


HORIZON = 20
"""Steps a warning may precede a collapse by and still count for it (the collapse warning's 20, eval_collapse_warning)."""
SMOOTH = 5
"""Each signal enters the detector as its mean over the last SMOOTH steps (the step and the SMOOTH - 1 before)."""
SIGNALS = ("mismatch_mean", "ess_frac", "seq_log_ratio_p99", "log_ratio_std", "entropy_mean", "entropy_slope",
           "grad_norm", "bad_negative_rate", "trainer_blocked_frac")
"""The candidates, columns of the ``early_signals`` view."""
SHIPPED = ("mismatch_mean", "entropy_mean", "entropy_slope", "grad_norm", "bad_negative_rate", "trainer_blocked_frac")
"""The signals runs logged before the importance-weight rows have too (the toy-v2 sample logs that
``sample_logs/`` held up to commit d114d27, and ``tests/data/legacy``): the detector fitted on these alone can be
applied to them."""
MAX_TERMS = 3
"""The detector keeps at most this many signals (forward selection on the fitting runs)."""
QUERY_S = 600.0
"""Time limit of each query (the sandbox's default is 30 s; a shared machine under load needs more)."""
RIDGE = 1e-2
"""L2 penalty on the standardised weights of the logistic fit."""


def features_sql(signals: tuple[str, ...] = SIGNALS) -> str:
    """Per (run, step): each signal's mean over the last :data:`SMOOTH` steps, from ``early_signals``."""
    cols = ", ".join(f"avg({s}) over recent as {s}" for s in signals)
    return (f"select run_id, step, reward_mean, {cols} from early_signals "
            f"window recent as (partition by run_id order by step rows between {SMOOTH - 1} preceding and current row)")


def detector_sql(weights: dict[str, float], bias: float, threshold: float) -> str:
    """The fitted detector as one query over ``early_signals``: score = bias + sum weight * (signal's mean over the
    last SMOOTH steps), a warning where score >= threshold (and the run has SMOOTH steps)."""
    terms = " + ".join(f"({w!r}) * avg({s}) over recent" for s, w in weights.items())
    return (f"select run_id, step, {bias!r} + {terms} as score,\n"
            f"       count(*) over recent >= {SMOOTH} and {bias!r} + {terms} >= {threshold!r} as warning\n"
            f"from early_signals\n"
            f"window recent as (partition by run_id order by step rows between {SMOOTH - 1} preceding and current row)\n"
            f"order by run_id, step")


def collapse_step(steps, window: int = 10) -> int | None:
    """The first step whose ``window``-step mean reward is at most half the best such mean so far (the findings'
    collapse, docs/experiments.md), or None. ``steps``: step, reward_mean, sorted."""
    avg = steps["reward_mean"].rolling(window, min_periods=window).mean()
    hit = (avg <= 0.5 * avg.cummax()).to_numpy()
    return int(steps["step"].to_numpy()[hit.argmax()]) if hit.any() else None


def judge(flags, collapses: dict[str, int | None], horizon: int = HORIZON) -> dict:
    """Lead times and false alarms of per-step warnings ``flags`` (run_id, step, warning) against ``collapses``.

    A collapse at step c is warned when a warning step falls in [c - horizon, c]; its lead is c minus the first
    such step. A warning episode (consecutive warning steps) starting at s is a false alarm when no collapse falls
    in [s, s + horizon]; episodes starting after a run's collapse are not counted (the run has collapsed)."""
    import numpy as np

    warned, leads, episodes, false_alarms, runs_false = 0, [], 0, 0, 0
    for run_id, one in flags.groupby("run_id"):
        one = one.sort_values("step")
        c = collapses.get(run_id)
        steps, on = one["step"].to_numpy(), one["warning"].fillna(False).astype(bool).to_numpy()
        starts = steps[on & ~np.concatenate([[False], on[:-1]])]
        if c is not None:
            starts = starts[starts <= c]
            before = steps[on & (steps >= c - horizon) & (steps <= c)]
            if len(before):
                warned += 1
                leads.append(c - int(before.min()))
        false = [s for s in starts if c is None or not s <= c <= s + horizon]
        episodes += len(starts)
        false_alarms += len(false)
        runs_false += bool(false)
    n = sum(c is not None for c in collapses.values())
    return {"collapses": n, "warned": warned, "median_lead": float(np.median(leads)) if leads else float("nan"),
            "episodes": episodes, "false_alarms": false_alarms, "runs_with_false_alarm": runs_false}


def labels(frame, collapses: dict[str, int | None], horizon: int = HORIZON):
    """The fitting rows: steps with SMOOTH steps behind them and before their run's collapse; y = 1 where the
    collapse comes within ``horizon`` steps."""
    rows = frame[frame.step >= SMOOTH - 1].copy()
    c = rows.run_id.map(lambda r: collapses.get(r)).astype(float)  # NaN: no collapse
    rows = rows[~(rows.step >= c)]
    rows["y"] = ((c.loc[rows.index] - rows.step) <= horizon).astype(float)
    return rows


def fit_logistic(x, y, ridge: float = RIDGE, iters: int = 50):
    """Weights ``(d + 1,)`` (bias first) of an L2-penalised logistic regression by Newton's method."""
    import numpy as np

    a = np.column_stack([np.ones(len(x)), x])
    w = np.zeros(a.shape[1])
    penalty = ridge * np.eye(a.shape[1])
    penalty[0, 0] = 0.0
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(a @ w, -30, 30)))
        grad = a.T @ (p - y) + penalty @ w
        hess = (a * (p * (1 - p))[:, None]).T @ a + penalty
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


def log_loss(x, y, w) -> float:
    import numpy as np

    z = np.column_stack([np.ones(len(x)), x]) @ w
    return float(np.mean(np.logaddexp(0, z) - y * z))


def fit_detector(rows, signals: tuple[str, ...] = SIGNALS) -> tuple[dict[str, float], float, list[tuple[str, float]]]:
    """Forward selection of up to :data:`MAX_TERMS` of ``signals`` by the fitting rows' log-loss, then the logistic
    fit on them. Returns the weights in the signals' own units, the bias and the selection path (signal,
    log-loss)."""
    import numpy as np

    usable = [s for s in signals if rows[s].notna().mean() > 0.95]
    rows = rows.dropna(subset=usable)
    mean, std = rows[usable].mean(), rows[usable].std().replace(0, 1)
    z = (rows[usable] - mean) / std
    y = rows["y"].to_numpy()
    chosen, path = [], []
    for _ in range(MAX_TERMS):
        best = min((log_loss(z[[*chosen, s]].to_numpy(), y, fit_logistic(z[[*chosen, s]].to_numpy(), y)), s)
                   for s in usable if s not in chosen)
        if path and best[0] > path[-1][1] - 1e-3:  # another signal must buy something
            break
        chosen.append(best[1])
        path.append((best[1], best[0]))
    w = fit_logistic(z[chosen].to_numpy(), y)
    weights = {s: float(w[i + 1] / std[s]) for i, s in enumerate(chosen)}
    bias = float(w[0] - sum(w[i + 1] * mean[s] / std[s] for i, s in enumerate(chosen)))
    assert np.isfinite(list(weights.values())).all()
    return weights, bias, path


def operating_point(flags_at, levels, n_runs: int, collapses: dict) -> float | None:
    """The most permissive of ``levels`` (in the order given) whose warnings ``flags_at(level)`` raise at most
    one false alarm per four runs of ``collapses``: the operating point, chosen on the fitting runs."""
    for level in levels:
        if judge(flags_at(level), collapses)["false_alarms"] <= n_runs / 4:
            return float(level)
    return None


def sweep(logdir: Path, shard: tuple[int, int], steps: int, only: list[str] | None = None) -> None:
    from studies import experiments

    runs = [(rid, change) for i, (rid, _, change) in enumerate(plan()) if i % shard[1] == shard[0]]
    if only:
        unknown = sorted(set(only) - {rid for rid, _ in runs})
        if unknown:
            raise SystemExit(f"--runs: not in the plan (or not in this shard): {unknown}")
        runs = [(rid, change) for rid, change in runs if rid in only]
        runs.sort(key=lambda run: only.index(run[0]))
    experiments.run_sweep(experiments.PRESETS["sanity-v2"], logdir, runs, {"steps": steps, "eval_every": 0})


def single_signal_flags(frame, signal: str, sign: float, level: float):
    """Warnings of one signal alone: its SMOOTH-step mean beyond ``level`` in the direction ``sign``."""
    return frame.assign(warning=(sign * frame[signal] >= sign * level) & (frame.step >= SMOOTH - 1))


def curve(frame, score: str, collapses: dict, sign: float = 1.0, points: int = 40) -> list[dict]:
    """``judge`` at thresholds over the quantiles of ``score`` (higher warns when ``sign`` > 0)."""
    import numpy as np

    values = frame[score].dropna().to_numpy()
    levels = np.unique(np.quantile(values, np.linspace(0.2, 1.0, points)))
    return [{"level": float(v), **judge(single_signal_flags(frame, score, sign, v), collapses)} for v in levels]


def today_rows(conn, run_ids: list[str], collapses: dict) -> list[dict]:
    """The shipped warning (``trustscope.report.WarningLines``) over its grid of lines, judged the same way."""
    from trustscope import report

    rows = []
    for window in (10, 20):
        for bad in (0.002, 0.005, 0.01, 0.02):
            lines = report.WarningLines(bad_rate=bad, mismatch_growth=2.0, window=window)
            flags = report.collapse_warnings(conn, run_ids, lines, detector=None)
            rows.append({"bad_rate": bad, "window": window, **judge(flags, collapses)})
    return rows


def evaluate(logdir: Path, out: Path, unfinished: bool = False, shipped: Path | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd

    from trustscope import db

    splits = split_of()
    with db.connect(logdir) as conn:
        runs = conn.runs()
        status = runs.set_index("run_id").status
        done = sorted(r for r in runs.run_id if r in splits and (unfinished or status[r] == "finished"))
        frame = conn.sql(features_sql(), timeout_s=QUERY_S).to_pandas()
        frame = frame[frame.run_id.isin(done)].sort_values(["run_id", "step"]).reset_index(drop=True)
        collapses = {r: collapse_step(one) for r, one in frame.groupby("run_id")}
        fit_ids = [r for r in done if splits[r] == "fit"]
        held_ids = [r for r in done if splits[r] == "held_out"]
        print(f"runs finished: {len(done)} ({len(fit_ids)} fitting, {len(held_ids)} held out); collapses: "
              f"{sum(collapses[r] is not None for r in fit_ids)} fitting, "
              f"{sum(collapses[r] is not None for r in held_ids)} held out")
        for r in done:
            print(f"  {splits[r]:8s} {r}: collapse at step {collapses[r]}")
        fit = frame[frame.run_id.isin(fit_ids)]
        held = frame[frame.run_id.isin(held_ids)]
        held_collapses = {r: collapses[r] for r in held_ids}
        fit_collapses = {r: collapses[r] for r in fit_ids}
        rows = labels(fit, fit_collapses)
        detectors, curves, table = {}, {}, []
        for name, signals in (("fitted detector", SIGNALS), ("fitted detector, shipped-run signals", SHIPPED)):
            weights, bias, path = fit_detector(rows, signals)
            scores = conn.sql(detector_sql(weights, bias, 0.0), timeout_s=QUERY_S).to_pandas()
            fit_scores = scores[scores.run_id.isin(fit_ids)].copy()
            levels = sorted(np.unique(np.quantile(fit_scores.score.dropna(), np.linspace(0.3, 1.0, 71))))
            threshold = operating_point(lambda t, f=fit_scores: f.assign(warning=f.score >= t), levels,
                                        len(fit_ids), fit_collapses)
            threshold = levels[-1] if threshold is None else threshold
            sql = detector_sql(weights, bias, threshold)
            scores = conn.sql(sql, timeout_s=QUERY_S).to_pandas()
            held_scores = scores[scores.run_id.isin(held_ids)]
            detectors[name] = {"weights": weights, "bias": bias, "threshold": threshold, "path": path, "sql": sql,
                               "fit": judge(scores[scores.run_id.isin(fit_ids)], fit_collapses)}
            curves[name] = curve(held_scores, "score", held_collapses)
            table.append({"warning": f"**{name}**", "setting": f"score >= {threshold:.3g}",
                          **judge(held_scores, held_collapses)})
        today = today_rows(conn, held_ids, held_collapses)
    for name, d in detectors.items():
        print(f"\n{name}: selection path (signal, fitting log-loss) {[(s, round(v, 4)) for s, v in d['path']]}")
        print(f"bias {d['bias']!r}, weights {d['weights']}, threshold {d['threshold']!r}; on the fitting runs: "
              f"{d['fit']}")
        print(f"\n```sql\n{d['sql']}\n```")
    # each single signal: its direction from the fitting runs (the sign of its correlation with the label), its
    # operating point chosen on the fitting runs as the detectors'
    for signal in SIGNALS:
        if rows[signal].notna().mean() < 0.95:
            continue
        sign = 1.0 if rows[signal].corr(rows["y"]) >= 0 else -1.0
        curves[signal] = curve(held, signal, held_collapses, sign)
        levels = sorted(np.unique(np.quantile(fit[signal].dropna(), np.linspace(0.3, 1.0, 71))), key=lambda v: sign * v)
        level = operating_point(lambda v, s=signal, g=sign: single_signal_flags(fit, s, g, v), levels, len(fit_ids),
                                fit_collapses)
        judged = (judge(single_signal_flags(held, signal, sign, level), held_collapses) if level is not None else
                  {"collapses": sum(c is not None for c in held_collapses.values()), "warned": 0,
                   "median_lead": float("nan"), "episodes": 0, "false_alarms": 0, "runs_with_false_alarm": 0})
        table.append({"warning": signal, "setting": "no level meets the budget" if level is None else
                      f"{'>=' if sign > 0 else '<='} {level:.3g}", **judged})
    for row in today:
        table.append({"warning": "shipped (bad rate or 2x mismatch)" + (" **default**" if row["bad_rate"] == 0.01
                                                                         and row["window"] == 10 else ""),
                      "setting": f"bad rate {row['bad_rate']:.1%}, window {row['window']}",
                      **{k: v for k, v in row.items() if k not in ("bad_rate", "window")}})
    df = pd.DataFrame(table)
    print(f"\nheld-out runs: {len(held_ids)}\n")
    print("| warning | setting | collapses | warned | median lead (steps) | warning episodes | false alarms | "
          "runs with a false alarm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in df.itertuples():
        print(f"| {r.warning} | {r.setting} | {r.collapses} | {r.warned} | {r.median_lead:.1f} | {r.episodes} | "
              f"{r.false_alarms} | {r.runs_with_false_alarm} |".replace("nan", "-"))
    if shipped is not None:
        with db.connect(shipped) as conn:
            steps = conn.sql(features_sql(), timeout_s=QUERY_S).to_pandas().sort_values(["run_id", "step"])
            for name, d in detectors.items():
                flags = conn.sql(d["sql"], timeout_s=QUERY_S).to_pandas()
                print(f"\n{name} on {shipped}:")
                for run_id, one in steps.groupby("run_id"):
                    warn = flags[(flags.run_id == run_id) & flags.warning.fillna(False).astype(bool)].step
                    print(f"  {run_id}: collapse at step {collapse_step(one)}, warning steps "
                          f"{warn.tolist()[:12]}{' ...' if len(warn) > 12 else ''}")
    out.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in curves.items():
        c = pd.DataFrame(points).sort_values("false_alarms")
        style = (dict(lw=2.4, color="black") if name == "fitted detector" else
                 dict(lw=2.0, color="grey", ls="--") if name.startswith("fitted") else dict(lw=1.1, alpha=0.8))
        ax.step(c.false_alarms, c.warned, where="post", label=name, **style)
        bx.plot(c.false_alarms, c.median_lead, marker=".", label=name, **style)
    t = pd.DataFrame(today)
    for a, col in ((ax, "warned"), (bx, "median_lead")):
        a.scatter(t.false_alarms, t[col], marker="x", s=50, color="red", label="shipped warning", zorder=5)
        a.set_xlabel("false alarms on the held-out runs (episodes, no collapse within 20 steps)")
        a.grid(alpha=0.3)
    ax.set_ylabel(f"collapses warned (of {table[0]['collapses']})")
    bx.set_ylabel("median lead of the warned collapses (steps)")
    ax.legend(fontsize=7)
    fig.suptitle("early warning on the held-out runs, thresholds swept")
    fig.tight_layout()
    fig.savefig(out / "early_warning_curve.png", dpi=110)
    print(f"\nwrote {out / 'early_warning_curve.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="train the fitting and held-out runs")
    sw.add_argument("--logdir", type=Path, default=ROOT / "runs" / "ew-v2")
    sw.add_argument("--shard", default="0/1", help="i/n: every n-th run of the plan, from the i-th")
    sw.add_argument("--steps", type=int, default=80)
    sw.add_argument("--runs", nargs="+", help="only these run ids of the plan, in this order (a third process on "
                    "runs the shards reach last; never give two processes the same run)")
    sw.add_argument("--dry-run", action="store_true")
    ev = sub.add_parser("eval", help="fit on the fitting runs, judge on the held-out runs")
    ev.add_argument("--logdir", type=Path, default=ROOT / "runs" / "ew-v2")
    ev.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ev.add_argument("--shipped", type=Path, default=ROOT / "sample_logs",
                    help="apply the fitted detectors' SQL to these runs too")
    ev.add_argument("--unfinished", action="store_true", help="also the runs still training (a look at a sweep)")
    args = parser.parse_args()
    if args.cmd == "eval":
        evaluate(args.logdir, args.out, args.unfinished, args.shipped)
    elif args.cmd == "sweep":
        i, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= i < n:
            raise SystemExit(f"--shard {args.shard!r}: write i/n with 0 <= i < n")
        if args.dry_run:
            print("\n".join(f"{rid} {split}" for k, (rid, split, _) in enumerate(plan()) if k % n == i))
            return
        sweep(args.logdir, (i, n), args.steps, args.runs)


if __name__ == "__main__":
    main()
