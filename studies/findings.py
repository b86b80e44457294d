"""The findings of the v2 sanity test, figure by figure, from the runs' own numbers.

    .venv/bin/python -m studies.findings [--logdir runs/sanity-v2] [--out docs/img]

Reads every run of the log directory (the sweep's ``sanity-<rule>-s<seed>`` runs and the anchoring probe's
``anchor-<mu|pi_old>-lag<L>-s<seed>`` runs of ``studies/experiments.py run --preset sanity-v2``) and writes the
``v2_*.png`` figures plus, on stdout, the Markdown tables docs/experiments.md quotes. Every per-step figure but
the entropy of clipped tokens comes from the exact ``summaries`` table (taken by the logger over every token,
whatever ``log_token_fraction`` kept) or from the trainer's step scalars; the clipped tokens' entropy and the
ratio's spread by mu bucket come from the logged token rows (a 25% sample of each step's responses).

Definitions (shared by the tables and the figures):

- a run's **first dip**: the first step where its 10-step mean training reward is 0.15 or more below its best
  10-step mean so far (the reward-dip definition of ``studies/eval_collapse_warning.py``); none if it never is;
- a run's **steps to 0.9**: the first step where its 10-step mean training reward reaches ``TARGET`` (0.9); a run
  that never does counts as its length plus one (censored: it did not get there within its steps);
- a run's **reward area**: its mean training reward over all its steps (the area under the curve over its length);
- a run's **collapse step**: the first step where its 10-step mean training reward is at most half its best
  10-step mean so far; none if it never is;
- **blocked fraction**: tokens a rule blocks over the step's tokens with A != 0 (A = 0 tokens carry no gradient);
- **bad negative rate**: tokens with A < 0 and mu - pi >= 0.5 over all the step's tokens (the paper's Mask-0.5
  threshold; the SQL's ``bad_negative_rate``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]

from studies.experiments import LABELS, step_scalars  # noqa: E402
from trustscope.db import connect  # noqa: E402

DIP_WINDOW, DIP_DEPTH, COLLAPSE_SHARE = 10, 0.15, 0.5
TARGET = 0.9
"""The 10-step mean training reward a run must reach (the paper's stable rules climb toward 100%)."""
HEADLINE = (("dppo_binary_tv", "grpo"), ("dppo_binary_tv", "ppo_clip"), ("dppo_binary_kl", "grpo"),
            ("dppo_binary_kl", "ppo_clip"))
"""The headline's comparisons, DPPO against the PPO clips, on the measures of :data:`MEASURES`."""
MEASURES = (("steps_to_target", "steps to 0.9", -1), ("reward_all", "reward area", 1),
            ("eval_final", "eval accuracy, final", 1), ("collapsed", "collapsed", -1))
"""Pre-stated measures of the headline: (column, label, the sign that favours the first rule)."""
LOW_MU = 0.1
"""Tokens with mu below this are 'low-probability' (the paper's alpha; the mu buckets' edge at 0.1)."""
RUN_ID = re.compile(r"^sanity-(?P<rule>.+)-s(?P<seed>\d+)$")
PROBE_ID = re.compile(r"^anchor-(?P<anchor>mu|pi_old)-lag(?P<lag>\d+)-s(?P<seed>\d+)$")


def first_step(steps: pd.Series, reward: pd.Series, *, depth: float = 0.0, share: float = 1.0) -> float:
    """First step whose 10-step mean reward is ``depth`` below, or at most ``share`` of, its best so far (NaN when
    it never is)."""
    avg = reward.rolling(DIP_WINDOW, min_periods=DIP_WINDOW).mean()
    best = avg.cummax()
    below = ((best - avg >= depth) & (avg <= share * best)).to_numpy()
    return float(steps.to_numpy()[below.argmax()]) if below.any() else float("nan")


def reach_step(steps: pd.Series, reward: pd.Series, target: float = TARGET) -> float:
    """Steps trained until the 10-step mean reward first reaches ``target`` (steps count from 0: reaching it at step
    s took s + 1 steps); the run's length plus one when it never does."""
    reached = (reward.rolling(DIP_WINDOW, min_periods=DIP_WINDOW).mean() >= target).to_numpy()
    return float(steps.to_numpy()[reached.argmax()] + 1) if reached.any() else float(steps.max() + 2)


def headline_markdown(table: pd.DataFrame, n_boot: int = 10_000, seed: int = 0) -> str:
    """Per comparison of :data:`HEADLINE` and measure of :data:`MEASURES`: each rule's mean over its seeds and the
    difference (first - second) with a 95% percentile bootstrap interval, seeds resampled with replacement within
    each rule. "favours" names a rule only when the interval excludes 0."""
    rng = np.random.default_rng(seed)
    sweep = table[table.kind == "sweep"].assign(collapsed=lambda t: t.collapse.notna().astype(float))
    lines = ["| comparison | measure | first: mean (n) | second: mean (n) | difference | 95% bootstrap interval | "
             "favours |", "|---|---|---|---|---|---|---|"]
    for a, b in HEADLINE:
        for column, label, good in MEASURES:
            x = sweep.loc[sweep.rule == a, column].dropna().to_numpy()
            y = sweep.loc[sweep.rule == b, column].dropna().to_numpy()
            if len(x) < 2 or len(y) < 2:
                continue
            diffs = (rng.choice(x, (n_boot, len(x))).mean(1) - rng.choice(y, (n_boot, len(y))).mean(1))
            low, high = np.percentile(diffs, [2.5, 97.5])
            side = "-" if low <= 0 <= high else LABELS[a if (low > 0) == (good > 0) else b]
            lines.append(f"| {LABELS[a]} - {LABELS[b]} | {label} | {x.mean():.3f} ({len(x)}) | {y.mean():.3f} "
                         f"({len(y)}) | {x.mean() - y.mean():+.3f} | {low:+.3f} to {high:+.3f} | {side} |")
    return "\n".join(lines)


def load(logdir: Path) -> dict[str, pd.DataFrame]:
    """Per-step frames of every finished run: the trainer's scalars (wide), the exact per-rule blocked counts,
    the exact mismatch and bad-negative figures, and two token-level tables from the logged rows."""
    runs = sorted(p for p in logdir.iterdir() if (p / "run.json").exists()
                  and json.loads((p / "run.json").read_text()).get("status") == "finished")
    if not runs:
        raise SystemExit(f"no finished runs under {logdir}; run `studies/experiments.py run --preset sanity-v2`")
    wide = step_scalars(runs)
    with connect(runs) as db:
        s = db.summaries()
        step_tokens = s[s.metric == "tokens"].groupby(["run_id", "step"])["count"].sum()
        active = s[(s.metric == "tokens") & (s.advantage_sign != "zero")].groupby(["run_id", "step"])["count"].sum()
        blocked = (s[s.metric == "blocked"].groupby(["run_id", "step", "rule"])["count"].sum()
                   .unstack("rule", fill_value=0).reindex(active.index, fill_value=0))
        blocked_low = (s[(s.metric == "blocked") & (s.mu_low < LOW_MU)].groupby(["run_id", "rule"])["count"].sum()
                       / s[s.metric == "blocked"].groupby(["run_id", "rule"])["count"].sum()).rename("low_mu_share")
        blocked_low.index = blocked_low.index.set_names(["run_id", "blocked_rule"])
        diff = s[s.metric == "abs_prob_diff"].groupby(["run_id", "step"])[["sum", "count"]].sum()
        mismatch = diff["sum"] / diff["count"]
        bad = s[s.metric == "bad_negative"].groupby(["run_id", "step"])["count"].sum().reindex(
            step_tokens.index, fill_value=0)
        exact = pd.DataFrame({"tokens": step_tokens, "active": active, "mismatch": mismatch,
                              "bad_negative_rate": bad / step_tokens}).reset_index()
        frac = blocked.div(active, axis=0).add_prefix("blocked__").reset_index()
        exact = exact.merge(frac, on=["run_id", "step"], how="left")
        clipped = db.cursor().execute(_CLIPPED_SQL).df()
        spread = db.cursor().execute(_SPREAD_SQL).df()
    return {"wide": _tag(wide), "exact": _tag(exact), "clipped": _tag(clipped), "spread": spread,
            "low_mu": _tag(blocked_low.reset_index())}


_CLIPPED_SQL = """
select run_id,
       count(*) filter (where blocks_ppo_clip) as clipped,
       avg(entropy) filter (where blocks_ppo_clip) as clipped_entropy,
       avg(entropy) filter (where not blocks_ppo_clip) as other_entropy,
       avg((mu_prob < 0.1)::int) filter (where blocks_ppo_clip) as clipped_low_mu,
       avg((mu_prob < 0.1)::int) filter (where not blocks_ppo_clip) as other_low_mu
from rule_blocks
where advantage <> 0
group by run_id
"""
"""Per run, over the logged A != 0 tokens: what PPO clip (Clip-Higher) would block, against the rest."""

_SPREAD_SQL = """
select mu_bucket, count(*) as tokens, stddev_samp(log_ratio) as log_ratio_std,
       quantile_cont(abs(ratio - 1), 0.99) as ratio_dev_p99, avg(binary_tv) as tv_mean,
       quantile_cont(binary_tv, 0.99) as tv_p99
from token_metrics
where run_id like 'anchor-%-lag0-%' and step < 10
group by mu_bucket
order by mu_bucket
"""
"""Ratio against binary TV per mu bucket, where pi and mu differ least: the lag-0 probe runs' first ten steps."""


def _tag(frame: pd.DataFrame) -> pd.DataFrame:
    """Add (kind, rule, anchor, lag, seed) parsed from the run id."""
    out = frame.copy()
    sweep = out.run_id.str.extract(RUN_ID)
    probe = out.run_id.str.extract(PROBE_ID)
    out["kind"] = np.where(sweep.rule.notna(), "sweep", np.where(probe.anchor.notna(), "probe", "other"))
    out["rule"], out["anchor"] = sweep.rule, probe.anchor
    out["lag"] = pd.to_numeric(probe.lag)
    out["seed"] = pd.to_numeric(sweep.seed.fillna(probe.seed))
    return out


def markdown(frame: pd.DataFrame) -> str:
    """A frame as a Markdown table (numbers to 4 significant digits)."""
    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    rows = [[str(c) for c in frame.columns], ["---"] * len(frame.columns),
            *[[cell(v) for v in row] for row in frame.itertuples(index=False)]]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _fmt(values: pd.Series, digits: int = 3) -> str:
    values = values.dropna()
    if values.empty:
        return "-"
    return f"{values.mean():.{digits}f} ({values.min():.{digits}f}-{values.max():.{digits}f})"


def run_table(wide: pd.DataFrame, exact: pd.DataFrame) -> pd.DataFrame:
    """One row per run: the reward's course, collapse step, mismatch and what its rule blocked."""
    rows = []
    for rid, w in wide.groupby("run_id"):
        w = w.sort_values("step")
        e = exact[exact.run_id == rid].sort_values("step")
        own = w.rule.iloc[0] if w.kind.iloc[0] == "sweep" else None
        evals = w.dropna(subset=["eval/reward"])
        rows.append({
            "run_id": rid, "kind": w.kind.iloc[0], "rule": own, "anchor": w.anchor.iloc[0], "lag": w.lag.iloc[0],
            "seed": w.seed.iloc[0], "steps": len(w),
            "reward_all": w["reward/mean"].mean(), "reward_last10": w["reward/mean"].tail(10).mean(),
            "reward_best10": w["reward/mean"].rolling(10).mean().max(),
            "reward_low5": w["reward/mean"].rolling(5).mean().min(),
            "eval_best": evals["eval/reward"].max() if len(evals) else np.nan,
            "eval_final": evals["eval/reward"].iloc[-1] if len(evals) else np.nan,
            "steps_to_target": reach_step(w.step, w["reward/mean"]),
            "dip": first_step(w.step, w["reward/mean"], depth=DIP_DEPTH),
            "collapse": first_step(w.step, w["reward/mean"], share=COLLAPSE_SHARE),
            "mismatch_first10": e.mismatch.head(10).mean(), "mismatch_last10": e.mismatch.tail(10).mean(),
            "mismatch_max": e.mismatch.max(),
            "blocked_own": w["policy/blocked_frac"].mean(),
            "bad_negative_rate": e.bad_negative_rate.mean(),
            "s_per_step": w["time/step_s"].median(),
        })
    return pd.DataFrame(rows)


def sweep_markdown(table: pd.DataFrame) -> str:
    lines = ["| rule | train reward, all steps | last 10 steps | best 10-step mean | lowest 5-step mean | "
             "eval accuracy, final | runs with a dip (first step) | runs collapsed (step) | mean abs(pi - mu), first 10 / last 10 steps | "
             "blocked by the rule | bad negative rate | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def when(values: pd.Series) -> str:
        hit = values.dropna()
        return f"{len(hit)}/{len(values)}" + (f" ({', '.join(str(int(c)) for c in sorted(hit))})" if len(hit) else "")

    for rule, label in LABELS.items():
        t = table[(table.kind == "sweep") & (table.rule == rule)]
        if t.empty:
            continue
        lines.append(f"| {label} | {_fmt(t.reward_all)} | {_fmt(t.reward_last10)} | {_fmt(t.reward_best10)} | "
                     f"{_fmt(t.reward_low5)} | {_fmt(t.eval_final)} | {when(t.dip)} | {when(t.collapse)} | "
                     f"{t.mismatch_first10.mean():.4f} / {_fmt(t.mismatch_last10, 4)} | {_fmt(t.blocked_own, 4)} | "
                     f"{_fmt(t.bad_negative_rate, 4)} | {t.s_per_step.median():.2f} |")
    return "\n".join(lines)


def probe_markdown(table: pd.DataFrame) -> str:
    lines = ["| lag | anchor | train reward, all steps | last 10 steps | lowest 5-step mean | eval accuracy, final | "
             "runs collapsed | mean abs(pi - mu), last 10 | blocked by the rule | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    probe = table[table.kind == "probe"]
    for (lag, anchor), t in probe.groupby(["lag", "anchor"]):
        lines.append(f"| {int(lag)} | {anchor} | {_fmt(t.reward_all)} | {_fmt(t.reward_last10)} | "
                     f"{_fmt(t.reward_low5)} | {_fmt(t.eval_final)} | {t.collapse.notna().sum()}/{len(t)} | "
                     f"{_fmt(t.mismatch_last10, 4)} | {_fmt(t.blocked_own, 4)} | {t.s_per_step.median():.2f} |")
    return "\n".join(lines)


def bad_negative_correlation(wide: pd.DataFrame, exact: pd.DataFrame) -> str:
    """Pearson and Spearman correlation of the bad negative rate with |reward change| to the next step, over all
    steps of all sweep runs, and the mean of the per-run correlations."""
    both = wide[["run_id", "step", "reward/mean"]].merge(exact[["run_id", "step", "bad_negative_rate", "kind"]])
    both = both[both.kind == "sweep"].sort_values(["run_id", "step"])
    both["change"] = both.groupby("run_id")["reward/mean"].shift(-1).sub(both["reward/mean"]).abs()
    both = both.dropna(subset=["change"])
    per_run = both.groupby("run_id").apply(
        lambda g: g.bad_negative_rate.rank().corr(g.change.rank()), include_groups=False).dropna()
    return (f"bad negative rate vs |reward change to the next step|, {len(both)} steps of "
            f"{both.run_id.nunique()} runs: Pearson {both.bad_negative_rate.corr(both.change):.3f}, Spearman "
            f"{both.bad_negative_rate.rank().corr(both.change.rank()):.3f}; per run (Spearman) mean "
            f"{per_run.mean():.3f}, range {per_run.min():.3f} to {per_run.max():.3f}")


def _bands(ax, frame: pd.DataFrame, column: str, key: str, labels: dict, smooth: int = 1, styles=None) -> None:
    """Mean over seeds per ``key`` value, with the min-max band, smoothed over ``smooth`` steps."""
    for value, label in labels.items():
        sub = frame[frame[key] == value]
        if sub.empty or column not in sub or sub[column].isna().all():
            continue
        per_seed = sub.pivot_table(index="step", columns="seed", values=column).rolling(smooth, min_periods=1).mean()
        mean = per_seed.mean(axis=1)
        style = (styles or {}).get(value, {})
        line, = ax.plot(mean.index, mean.values, label=label, lw=1.6, **style)
        ax.fill_between(mean.index, per_seed.min(axis=1), per_seed.max(axis=1), alpha=0.12, color=line.get_color())
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def make_figures(data: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide, exact = data["wide"], data["exact"]
    sweep_w, sweep_e = wide[wide.kind == "sweep"], exact[exact.kind == "sweep"]
    rules = {r: LABELS[r] for r in LABELS if r in set(sweep_w.rule)}
    cmap = plt.get_cmap("tab10")
    styles = {r: {"color": cmap(i), "ls": "-" if r.startswith("dppo") else "--"} for i, r in enumerate(LABELS)}
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    out.mkdir(parents=True, exist_ok=True)
    panels = [
        ("v2_reward.png", sweep_w, "reward/mean", 10, "training reward (10-step mean; band: min-max of 3 seeds)", None),
        ("v2_eval.png", sweep_w.dropna(subset=["eval/reward"]), "eval/reward", 1,
         "held-out greedy accuracy (50 problems, every 10 steps)", None),
        ("v2_mismatch.png", sweep_e, "mismatch", 5, "mean |pi - mu| over every token (5-step mean)", None),
        ("v2_bad_negative.png", sweep_e, "bad_negative_rate", 5,
         "bad negative updates: A < 0 and mu - pi >= 0.5, share of all tokens", None),
    ]
    for name, frame, column, smooth, title, scale in panels:
        fig, ax = plt.subplots(figsize=(7.5, 4.4))
        _bands(ax, frame, column, "rule", rules, smooth, styles)
        if scale:
            ax.set_yscale(scale)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, ncol=2)
        save(fig, name)

    # what each rule would have blocked on PG-IS's tokens (no trust region: where the drift goes unchecked)
    pg = sweep_e[sweep_e.rule == "pg_is"]
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for i, rule in enumerate(r for r in ("ppo_clip", "grpo", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv",
                                         "minimal_negative_mask", "ppo_lowprob_relax")):
        col = f"blocked__{rule}"
        if col in pg:
            mean = pg.groupby("step")[col].mean().rolling(5, min_periods=1).mean()
            ax.plot(mean.index, mean.values, label=LABELS.get(rule, rule), **styles.get(rule, {"color": cmap(i)}))
    ax.set_title("on PG-IS's own tokens: share of A != 0 tokens each rule would block (5-step mean)", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    save(fig, "v2_counterfactual.png")

    probe = wide[wide.kind == "probe"]
    lags = sorted(probe.lag.dropna().unique())
    if lags:
        fig, axes = plt.subplots(1, len(lags), figsize=(4.2 * len(lags), 3.8), sharey=True)
        for ax, lag in zip(np.atleast_1d(axes), lags, strict=True):
            _bands(ax, probe[probe.lag == lag], "reward/mean", "anchor",
                   {"mu": "anchored on mu", "pi_old": "anchored on pi_old"}, 10,
                   {"mu": {"color": cmap(4)}, "pi_old": {"color": cmap(3), "ls": "--"}})
            seeds = probe[probe.lag == lag].seed.nunique()
            ax.set_title(f"policy lag {int(lag)}: DPPO binary TV, delta 0.15 (band: {seeds} seeds)", fontsize=10)
        np.atleast_1d(axes)[0].set_ylabel("training reward (10-step mean)")
        np.atleast_1d(axes)[0].legend(fontsize=8)
        save(fig, "v2_anchoring.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", type=Path, default=ROOT / "runs" / "sanity-v2")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    data = load(args.logdir)
    table = run_table(data["wide"], data["exact"])
    try:
        figures = make_figures(data, args.out)
    except ModuleNotFoundError as exc:  # the tables need no plotting library
        print(f"no figures: {exc} (pip install matplotlib)")
        figures = []
    for path in figures:
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print("\n## The sweep (mean (min-max) over seeds)\n")
    print(sweep_markdown(table))
    print("\n## The headline: DPPO against the PPO clips (bootstrap over seeds)\n")
    print(headline_markdown(table))
    print("\n## The anchoring probe\n")
    print(probe_markdown(table))
    print("\n## Bad negative updates\n")
    print(bad_negative_correlation(data["wide"], data["exact"]))
    print("\n## What PPO clip would block, per run (logged A != 0 tokens)\n")
    clipped = data["clipped"][data["clipped"].kind == "sweep"]
    print(clipped.groupby("rule")[["clipped", "clipped_entropy", "other_entropy", "clipped_low_mu", "other_low_mu"]]
          .mean().reset_index().pipe(markdown))
    low = data["low_mu"]
    print(f"\nshare of ppo_clip's blocked tokens with mu < {LOW_MU} (exact, every token of the sweep runs): "
          f"{_fmt(low[(low.blocked_rule == 'ppo_clip') & (low.kind == 'sweep')].low_mu_share)}")
    print("\n## Ratio against binary TV by mu bucket (lag-0 probe runs, first 10 steps)\n")
    print(markdown(data["spread"]))
    print("\n## Per run\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
