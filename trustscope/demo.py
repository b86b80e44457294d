"""``trustscope demo``: a DPPO run whose reward climbs while the trust region works, end to end, from start to a
served dashboard in one to two minutes on a laptop CPU once its world is built.

Trains a short DPPO (binary TV) run with the logger on in ``toy-v2-warm`` (:mod:`trustscope.train.toy_warm`:
toy world v2 warm-started until it solves about 74% of its problems at temperature 1), the world of the
``sanity-climb-warm`` sweep (docs/experiments.md), where every trust-region rule climbs to a 10-step reward of 0.9:
bf16 vLLM rollouts against an fp32 trainer, one step of policy lag, several mini-batch updates a step, 16 prompts x
16 responses, the learning rate warmed up and decayed linearly to 0 at the last step, so that the run's reward
rises within its 24 steps (:data:`DEMO_STEPS` gives the figures). The console shows each step's reward and what
the trust region blocked (share and count of the tokens with A != 0). It then prints what to look at first, with
the run's own numbers and a comparison with the shipped PG-IS run (the same world, no trust region, two steps of
policy lag: it collapses and recovers), and serves the dashboard over a log directory holding the demo run beside
links to the shipped runs. The world ships built
(:mod:`trustscope.train.toy_models`) and is copied into the cache on the first run; after a change to ``toy.py``
moves its key it is built there instead (a warm start: 4-7 minutes on two busy cores) and cached.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from trustscope.train.config import TrainConfig

DEMO_SETTING: dict[str, Any] = dict(
    model="toy-v2-warm",
    task="addcol2",
    loss="dppo_binary_tv",
    engine="vllm",
    engine_dtype="bfloat16",
    trainer_dtype="float32",
    threads=1,
    prompts_per_step=16,
    group_size=16,
    max_tokens=32,
    topk=8,
    policy_lag=1,
    mini_batches=8,
    lr=1e-4,
    warmup_steps=5,
    lr_schedule="linear",
    grad_clip=1.0,
    eval_every=10,
    eval_problems=50,
    log_topk_precision="float16",
)
"""The ``sanity-climb-warm`` setting (``studies/experiments.py``) in ``toy-v2-warm``, made to rise within the demo's
steps: its mismatch knobs (bf16 rollouts against the fp32 trainer, ``policy_lag`` 1), 16 prompts x 16 responses
and linear decay, but half its peak lr (1e-4, reached after 5 steps, 0 at the last step) and eight mini-batch
updates a step instead of four. At the sweep's 2e-4 every rule's reward rises for 15-20 steps and dips when the lr
peaks (10-step reward 0.79 -> 0.89 -> 0.79 by step 40, seed 0); at 1e-4 with four mini-batches (10 warm-up
steps) it rises (0.79 -> 0.90 over the first/last five of 30 steps) but the trust region blocks almost nothing (0-5
tokens a step); eight mini-batches move pi further from mu within a step, so it blocks up to 1.0-1.4% of the tokens
with A != 0 a step while the lr is high, and the reward still rises (:data:`DEMO_STEPS`). Every token is logged.
One torch thread: on two busy cores the trainer's updates ran 15-30x slower with two (10 steps: 62-79 s against
2-4 s)."""

DEMO_STEPS = 24
"""Steps of the demo run: 2-4 s each on two busy CPU cores, about as long as the toy-v2 demo's 40 steps of 8 x 8
took (80-109 s wall against 74-128 s, same machine, same hour). Measured (``trustscope demo --no-serve --seed S``,
seeds 0, 1, 2): reward 0.80 -> 0.93, 0.76 -> 0.90 and 0.75 -> 0.89 over the first and last five steps, the trust
region blocking 0.4% of the tokens with A != 0 (up to 1.0-1.2% a step); at 30 steps 0.80 -> 0.92, 0.76 -> 0.92,
0.75 -> 0.90, a third longer."""


def demo_config(logdir: Path, steps: int = DEMO_STEPS, seed: int = 0) -> TrainConfig:
    """The demo run: DPPO binary TV in ``toy-v2-warm`` with bf16 vLLM rollouts, lag 1, eight mini-batches a step;
    a run shorter than twice the warm-up warms up over its first half."""
    setting = {**DEMO_SETTING, "warmup_steps": min(DEMO_SETTING["warmup_steps"], steps // 2)}
    return TrainConfig(**setting, steps=steps, seed=seed, logdir=str(logdir),
                       run_id=f"demo-dppo-{time.strftime('%Y%m%d-%H%M%S')}")


def toy_ready(cfg: TrainConfig) -> bool:
    """Whether the toy world of ``cfg`` needs no build: it is in the trustscope cache, or ships built
    (:mod:`trustscope.train.toy_models`)."""
    from trustscope.paths import cache_root
    from trustscope.train.toy import META_FILE
    from trustscope.train.toy_models import entry_name, shipped
    from trustscope.train.worlds import get_world

    world = get_world(cfg.model)
    if world is None:
        raise ValueError(f"model={cfg.model!r}: the demo trains a registered toy world")
    toy = world.config(cfg.task)
    return (cache_root() / "toy" / entry_name(toy) / META_FILE).exists() or shipped(toy) is not None


def check_port(host: str, port: int) -> None:
    """Raise OSError naming the port when nothing can listen on ``host:port`` (checked before the demo trains, so
    a busy port is found in a second, not after the run)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"port {port} on {host} is not free ({exc.strerror}); pick another with --port") from None


def link_sample_runs(logdir: Path, samples: Path | None = None) -> list[str]:
    """Link every shipped run (``sample_logs/<run>``) into ``logdir`` beside the demo run, so one log directory
    holds both; existing entries are left alone. Returns the names linked (none when no sample logs are found)."""
    from trustscope import runformat
    from trustscope.paths import sample_logdir

    samples = Path(samples or sample_logdir()).resolve()
    if not samples.is_dir() or samples == Path(logdir).resolve():
        return []
    Path(logdir).mkdir(parents=True, exist_ok=True)
    linked = []
    for run in runformat.run_dirs(samples):
        link = Path(logdir) / run.name
        if link.exists() or link.is_symlink():
            continue
        link.symlink_to(os.path.relpath(run, Path(logdir).resolve()), target_is_directory=True)
        linked.append(run.name)
    return linked


COMPARED = ("ppo_clip", "grpo", "dppo_binary_kl", "dppo_topk_tv")
"""The rules the closing lines set beside the demo's own, as the shipped sweep does (Clip-Higher, GRPO's clip, the
other DPPO masks), when the run's log has their counterfactual columns."""

BASELINE = "pg_is"
"""The shipped runs' rule without a trust region, whose collapse (and recovery as the lr decays) the closing lines
point to."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _share(frame: Any) -> float:
    return float(frame["n_blocked"].sum()) / max(float(frame["n_tokens"].sum()), 1.0)


def _lr(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-")


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The training config a run's manifest records (empty when it records none)."""
    import json

    try:
        config = json.loads((run_dir / "run.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return config if isinstance(config, dict) else {}


def look_first(run_dir: Path, shipped: list[Path] | None = None) -> list[str]:
    """What to look at first in the dashboard, one line each (page, then what it shows), with the numbers of the
    run in ``run_dir`` read through :meth:`trustscope.db.LogDB.overview` (exact, over every token, from the run's
    summaries table); ``shipped``: run directories beside it, of which the first trained with :data:`BASELINE`
    gets a line comparing its mismatch and reward with the demo's."""
    from trustscope.db import connect

    baseline = next((p for p in shipped or [] if p.name.startswith(f"sanity-{BASELINE}-")), None)
    with connect([run_dir] if baseline is None else [run_dir, baseline], cache=False) as db:
        ov = db.overview()
    run_id = run_dir.name
    steps = ov.steps[ov.steps["run_id"] == run_id]
    blocked = ov.blocked[ov.blocked["run_id"] == run_id]
    if steps.empty:
        return [f"The run in {run_dir} logged no step: nothing to look at yet."]
    rule = DEMO_SETTING["loss"]
    mine = blocked[blocked["rule"] == rule]
    applied = float(steps["n_trainer_blocked"].sum()) / max(float(steps["n_nonzero_advantage"].sum()), 1.0)
    worst = steps.loc[steps["trainer_blocked_frac"].idxmax()]
    quiet = int((steps["trainer_blocked_frac"] < 0.001).sum())
    lines = [
        f"Runs: {run_id} beside the shipped runs. {rule} blocked {int(steps['n_trainer_blocked'].sum()):,} of the "
        f"{int(steps['n_nonzero_advantage'].sum()):,} tokens with A != 0 ({_pct(applied)}) over {len(steps)} steps (from "
        f"{_pct(float(steps['trainer_blocked_frac'].min()))} to {_pct(float(worst['trainer_blocked_frac']))} a step, "
        f"{quiet} steps under 0.1%), at mean |pi - mu| {steps['mismatch_mean'].mean():.4f} (largest "
        f"{steps['mismatch_max'].max():.2f}); reward {steps.head(5)['reward_mean'].mean():.2f} over the first 5 "
        f"steps, {steps.tail(5)['reward_mean'].mean():.2f} over the last 5."]
    neg, pos = mine[mine["advantage_side"] == "negative"], mine[mine["advantage_side"] == "positive"]
    if len(neg) and len(pos):
        lines.append(f"Rules side by side: {rule} blocked {_pct(_share(neg))} of the A < 0 tokens and "
                     f"{_pct(_share(pos))} of the A > 0 ones; the page splits them by mu bucket.")
    every = blocked[blocked["advantage_side"] == "all"]
    others = [(r, _share(every[every["rule"] == r])) for r in COMPARED if (every["rule"] == r).any()]
    if others:
        lines.append("Counterfactual: on the same tokens the other rules would have blocked "
                     + ", ".join(f"{_pct(v)} ({r})" for r, v in others)
                     + f", against {_pct(_share(every[every['rule'] == rule]))} for {rule}.")
    n_bad = float(steps["n_bad_negative"].sum())
    lines.append(f"Bad negative updates: {int(n_bad):,} tokens had A < 0 and mu - pi >= "
                 f"{float(steps['bad_negative_delta'].iloc[0]):g} ({_pct(n_bad / max(float(steps['n_tokens'].sum()), 1))}"
                 f" of all tokens, {_pct(n_bad / max(float(steps['n_negative'].sum()), 1))} of those with A < 0).")
    lines.append(f"Token explorer: step {int(worst['step'])}, where {rule} blocked the most "
                 f"({int(worst['n_trainer_blocked'])} tokens), shows each blocked token in its response.")
    other = ov.steps[ov.steps["run_id"] != run_id]
    if baseline is not None and len(other):
        lines.append(compare_baseline(baseline, run_dir, steps, other.sort_values("step"),
                                      ov.blocked[ov.blocked["run_id"] == baseline.name], rule))
    return lines


NOT_COMPARED = frozenset({"loss", "loss_params", "seed", "run_id", "logdir", "resume", "device", "threads",
                          "eval_every", "eval_problems", "save_every", "keep_checkpoints", "report_to", "webhook",
                          "warn_relative"})
"""Config fields the closing comparison leaves out: the rule and seed (what the pair compares), and fields that
change where and how a run is run or logged, not what it trains (with every ``log_*`` field)."""


def _value(key: str, value: Any) -> str:
    return _lr(value) if key == "lr" and isinstance(value, (int, float)) else str(value)


def differing(theirs: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Every training setting two run configs record differently, as ``<field> <theirs> against <mine> here``
    (the model as ``in <theirs>, not this run's <mine>``), model first, then in ``theirs``' order; fields one
    config lacks are left out."""
    out = []
    for key in sorted(theirs.keys() & mine.keys(), key=lambda k: (k != "model", list(theirs).index(k))):
        if key in NOT_COMPARED or key.startswith("log_") or theirs[key] == mine[key]:
            continue
        if key == "model":
            out.append(f"in {theirs[key]}, not this run's {mine[key]}")
        else:
            out.append(f"{key} {_value(key, theirs[key])} against {_value(key, mine[key])} here")
    return out


def compare_baseline(baseline: Path, run_dir: Path, steps: Any, other: Any, other_blocked: Any, rule: str) -> str:
    """The closing line setting the shipped :data:`BASELINE` run beside the demo's: every training setting of the
    two that differs (:func:`differing`), the mismatch of both, what ``rule`` would have blocked of the baseline's
    tokens, and both reward curves: the baseline's 10-step reward at its best before its lowest point, at its
    lowest point (and when) and at its end, so that a run that collapses and recovers shows both; the demo's over
    its first and last five steps."""
    import numpy as np

    setting = [f"{BASELINE}: no trust region", *differing(_run_config(baseline), _run_config(run_dir))]
    window = min(10, len(other))
    reward = other["reward_mean"].rolling(window, min_periods=window).mean().to_numpy()
    step = other["step"].to_numpy()
    low = int(np.nanargmin(reward))
    peak = int(np.nanargmax(reward[: low + 1]))
    every = other_blocked[(other_blocked["advantage_side"] == "all") & (other_blocked["rule"] == rule)]
    would = (f"; on its tokens {rule} would have blocked {_pct(_share(every))} of those with A != 0"
             if len(every) else "")
    first, last = steps.head(5)["reward_mean"].mean(), steps.tail(5)["reward_mean"].mean()
    line = (f"Then {baseline.name} (shipped, {', '.join(setting)}): mean |pi - mu| {other['mismatch_mean'].mean():.4f} "
            f"against {steps['mismatch_mean'].mean():.4f} here{would}; its {window}-step reward from "
            f"{reward[peak]:.2f} at step {int(step[peak])} down to its lowest, {reward[low]:.2f} at step "
            f"{int(step[low])}, and {reward[-1]:.2f} by step {int(step[-1])}, where this run's went from "
            f"{first:.2f} to {last:.2f}.")
    if len(setting) > 1:
        line += (" Different settings: the contrast is a run without a trust region against one with it, not a "
                 "matched pair.")
    return line


def run_demo(logdir: Path, steps: int = DEMO_STEPS, serve: bool = True, port: int = 8501,
             samples: bool = True, seed: int = 0) -> Path:
    """Train the demo run into ``logdir``, link the shipped runs beside it (``samples``), print what to look at
    first and, when ``serve``, replace this process with the dashboard over ``logdir`` (its port checked first)."""
    import warnings

    from trustscope.train.loop import train_with_progress
    from trustscope.train.models import resolve_model

    if serve:
        check_port("127.0.0.1", port)
    warnings.filterwarnings("ignore", category=FutureWarning)  # the engine's import warnings, not the user's
    start = time.perf_counter()
    logdir = Path(logdir)
    linked = link_sample_runs(logdir) if samples else []
    cfg = demo_config(logdir, steps, seed)
    if not toy_ready(cfg):
        print(f"trustscope demo: building the {cfg.model} model (first run only: four to seven minutes on 2 busy "
              "CPU cores, cached for the next runs)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        resolve_model(cfg)
        print(f"trustscope demo: {cfg.model} built in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    train_with_progress(cfg)
    shipped = sorted(p for p in logdir.iterdir() if p.is_symlink()) if samples else []
    print(f"\ntrustscope demo: trained {cfg.run_id} in {time.perf_counter() - start:.0f} s"
          + (f"; {len(shipped)} shipped runs linked beside it ({len(linked)} new)" if shipped else "")
          + ". What to look at first:", file=sys.stderr)
    for line in look_first(cfg.run_dir, shipped):
        print(f"  - {line}", file=sys.stderr)
    sys.stderr.flush()
    if serve:
        from trustscope._dashboard import load

        launcher = load("app.launch")
        os.environ[launcher.FOCUS_ENV] = cfg.run_id  # every page opens on the demo's run, the shipped runs beside it
        launcher.launch(logdir, port=port)
    return cfg.run_dir
