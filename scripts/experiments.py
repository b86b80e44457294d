"""The paper's sanity test at toy scale: every baseline rule against DPPO, same seeds, same budget.

    .venv/bin/python scripts/experiments.py run  [--logdir sample_logs] [--seeds 0 1 2] [--rules ...] [--set lr=1e-4]
    .venv/bin/python scripts/experiments.py plot [--logdir sample_logs runs/sanity-extra] [--out docs/img]

``run`` trains each (rule, seed) pair in turn in this one process (vLLM is imported once), skipping pairs whose run
already finished, so an interrupted sweep picks up where it stopped. ``plot`` reads the runs' ``steps`` tables and
the query layer's per-step summaries and writes PNG figures (matplotlib) plus a table of final numbers.

The setting (justified in docs/experiments.md): bf16 vLLM rollouts against an fp32 trainer (training-inference
mismatch), a high learning rate and four mini-batch updates per rollout batch, so that pi moves away from mu within
a step the way a long large-scale run drifts, and the trust region has something to do at toy scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RULES = ("pg_is", "cispo", "ppo_clip", "minirl", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv")
"""The paper's sanity-test line-up: no trust region, truncated IS, GRPO Clip-Higher, decoupled PPO, DPPO."""

LABELS = {
    "pg_is": "PG-IS",
    "cispo": "CISPO (PG-TIS)",
    "ppo_clip": "GRPO Clip-Higher",
    "minirl": "MiniRL (decoupled)",
    "dppo_binary_tv": "DPPO binary TV",
    "dppo_binary_kl": "DPPO binary KL",
    "dppo_topk_tv": "DPPO top-K TV",
}

SETTING = dict(
    task="add1",
    engine="vllm",
    engine_dtype="bfloat16",
    trainer_dtype="float32",
    prompts_per_step=8,
    group_size=8,
    max_tokens=8,
    topk=8,
    mini_batches=4,
    lr=3e-4,
    grad_clip=1.0,
    steps=100,
    eval_every=10,
    eval_problems=20,
    log_token_fraction=0.25,
    log_topk_precision="float16",
    threads=1,
)
"""Shared by every run; only ``loss`` and ``seed`` vary. See docs/experiments.md for why."""


def run_id(rule: str, seed: int) -> str:
    return f"sanity-{rule}-s{seed}"


def report(step: int, s: dict[str, float]) -> None:
    if step % 10 == 9:
        print(f"  step {step + 1}: reward {s['reward/mean']:.3f} |pi-mu| {s['policy/mismatch_abs_mean']:.4f} "
              f"blocked {s['policy/blocked_frac']:.4f}", flush=True)


def run_sweep(logdir: Path, rules: list[str], seeds: list[int], overrides: dict[str, str]) -> None:
    import torch

    from trustscope.train.config import load_config
    from trustscope.train.loop import train

    torch.set_num_threads(1)
    for seed in seeds:
        for rule in rules:
            rid = run_id(rule, seed)
            manifest = logdir / rid / "run.json"
            if manifest.exists() and json.loads(manifest.read_text()).get("status") == "finished":
                print(f"skip {rid}: finished", flush=True)
                continue
            if (logdir / rid).exists():
                import shutil

                shutil.rmtree(logdir / rid)
            cfg = load_config(None, {**SETTING, "loss": rule, "seed": seed, "logdir": str(logdir), "run_id": rid,
                                     "recompute_old": rule in ("minirl", "minirl_tis"), **overrides})
            t0 = time.perf_counter()
            last = train(cfg, on_step=report)
            print(f"{rid}: {time.perf_counter() - t0:.0f} s, reward {last.get('reward/mean'):.3f}, "
                  f"eval {last.get('eval/reward', float('nan')):.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train every (rule, seed) pair")
    run.add_argument("--logdir", type=Path, default=ROOT / "sample_logs")
    run.add_argument("--rules", nargs="+", default=list(RULES))
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    run.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                     help="override a field of the shared setting (for calibration sweeps)")
    plot = sub.add_parser("plot", help="write the figures and the summary table")
    plot.add_argument("--logdir", type=Path, nargs="+", default=[ROOT / "sample_logs"])
    plot.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    if args.cmd == "run":
        run_sweep(args.logdir, args.rules, args.seeds, dict(kv.split("=", 1) for kv in args.set))
    else:
        make_plots(args.logdir, args.out)


def load(logdirs: list[Path]) -> tuple:
    """Per-step frames of the sanity runs: the trainer's scalars (wide) and the query layer's step summaries."""
    import pandas as pd
    import pyarrow.parquet as pq

    from trustscope.db import connect

    runs = sorted(p for d in logdirs for p in d.glob("sanity-*") if (p / "run.json").exists())
    if not runs:
        raise SystemExit(f"no sanity-* runs under {logdirs}; run `scripts/experiments.py run` first")
    scalars = pd.concat([pq.read_table(r / "steps").to_pandas() for r in runs])
    wide = scalars.pivot_table(index=["run_id", "step"], columns="name", values="value").reset_index()
    with connect(runs) as db:
        summary = db.step_summary()
        cf = db.blocked_fractions()
    for frame in (wide, summary, cf):
        parts = frame.run_id.str.extract(r"^sanity-(?P<rule>.+)-s(?P<seed>\d+)$")
        frame["trained_with"], frame["seed"] = parts.rule, parts.seed.astype(int)
    return wide, summary, cf


def _band(ax, frame, column: str, smooth: int = 1, log: bool = False) -> None:
    """Mean over seeds per rule, with the min-max band, optionally smoothed over ``smooth`` steps."""
    for rule in RULES:
        sub = frame[frame.trained_with == rule]
        if sub.empty or column not in sub:
            continue
        per_seed = sub.pivot_table(index="step", columns="seed", values=column)
        per_seed = per_seed.rolling(smooth, min_periods=1).mean()
        mean = per_seed.mean(axis=1)
        ax.plot(mean.index, mean.values, label=LABELS[rule], lw=1.6, ls="-" if rule.startswith("dppo") else "--")
        ax.fill_between(mean.index, per_seed.min(axis=1), per_seed.max(axis=1), alpha=0.12)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def make_plots(logdirs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide, summary, cf = load(logdirs)
    out.mkdir(parents=True, exist_ok=True)
    figures = [
        ("sanity_reward.png", wide, "reward/mean", 5, False, "training reward (5-step mean)"),
        ("sanity_eval.png", wide.dropna(subset=["eval/reward"]), "eval/reward", 1, False,
         "held-out greedy accuracy"),
        ("sanity_mismatch.png", summary, "mismatch_mean", 3, True, "mean |pi - mu| over logged tokens"),
        ("sanity_blocked.png", summary, "trainer_blocked_frac", 3, False, "fraction of tokens the rule blocked"),
        ("sanity_bad_negative.png", summary, "bad_negative_rate", 3, False,
         "bad negative updates (A < 0, mu - pi >= 0.5)"),
    ]
    for name, frame, column, smooth, log, title in figures:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _band(ax, frame, column, smooth, log)
        ax.set_title(title)
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    # what every rule would have blocked on the unconstrained PG-IS runs' tokens (counterfactual view)
    # rules anchored on pi_old have nothing to look at in runs that never recomputed it: left out
    pg = cf[(cf.trained_with == "pg_is") & (cf.advantage_side == "all") & cf.rule.isin(RULES)
            & (cf.rule != "minirl")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for rule, sub in pg.groupby("rule"):
        mean = sub.groupby("step").blocked_frac.mean().rolling(3, min_periods=1).mean()
        ax.plot(mean.index, mean.values, label=LABELS.get(rule, rule))
    ax.set_title("on PG-IS's own tokens: what each rule would have blocked")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "sanity_counterfactual.png", dpi=110)
    plt.close(fig)
    print(summary_table(wide, summary))
    both = summary.sort_values(["run_id", "step"]).assign(
        reward_change=lambda f: f.groupby("run_id").reward_mean.diff().abs())
    print(f"correlation of the bad negative-update rate with |reward change| over all steps of all runs: "
          f"{both.bad_negative_rate.corr(both.reward_change):.3f} (Pearson), "
          f"{both.bad_negative_rate.rank().corr(both.reward_change.rank()):.3f} (Spearman)")


def summary_table(wide, summary) -> str:
    """Markdown table: per rule, the mean (min-max over seeds) of each run's numbers."""
    last = wide[wide.step >= wide.step.max() - 9]
    last_s = summary[summary.step >= summary.step.max() - 9]
    final_eval = wide.dropna(subset=["eval/reward"]).sort_values("step").groupby("run_id").tail(1)
    lines = ["| rule | train reward, all steps | train reward, last 10 steps | lowest 5-step reward | eval accuracy, "
             "final | mean abs(pi - mu), last 10 | max abs(pi - mu) | blocked frac | bad negative rate |",
             "|---|---|---|---|---|---|---|---|---|"]

    def fmt(values, digits=3) -> str:
        return f"{values.mean():.{digits}f} ({values.min():.{digits}f}-{values.max():.{digits}f})"

    for rule in RULES:
        runs = wide[wide.trained_with == rule].run_id.unique()
        if not len(runs):
            continue
        train_r = last[last.trained_with == rule].groupby("run_id")["reward/mean"].mean()
        eval_r = final_eval[final_eval.trained_with == rule].set_index("run_id")["eval/reward"]
        whole = wide[wide.trained_with == rule].groupby("run_id")["reward/mean"].mean()
        low = wide[wide.trained_with == rule].groupby("run_id")["reward/mean"].apply(
            lambda r: r.rolling(5).mean().min())
        s = last_s[last_s.trained_with == rule].groupby("run_id")
        all_s = summary[summary.trained_with == rule].groupby("run_id")
        lines.append(f"| {LABELS[rule]} | {fmt(whole)} | {fmt(train_r)} | {fmt(low)} | {fmt(eval_r)} | "
                     f"{fmt(s.mismatch_mean.mean(), 4)} | {fmt(all_s.mismatch_max.max(), 2)} | "
                     f"{fmt(s.trainer_blocked_frac.mean(), 4)} | {fmt(s.bad_negative_rate.mean(), 4)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
