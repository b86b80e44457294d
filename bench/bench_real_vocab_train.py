"""The integrated trainer at a real vocabulary: what V = 151,936 costs, and which part of it is trustscope's.

    nice -n 10 .venv/bin/python -m bench.bench_real_vocab_train                  # 4 steps, the demo's setting
    nice -n 10 .venv/bin/python -m bench.bench_real_vocab_train --steps 3 --topk 20 --json out.json

The same training, ``trustscope train``'s loop through the real vLLM engine, on two toy worlds that differ only in
their vocabulary: ``toy-v2`` (V = 78) and ``toy-v2-152k`` (``toy-v2`` widened to V = 151,936,
:mod:`trustscope.train.toy_wide`), each with trustscope's hooks off and on, each run in a fresh process:

- ``off``: no token log (``log_tokens=False``: no capture written, no summaries, no vocabulary table, no Parquet)
  and ``topk=1`` (the engine returns the sampled token's log-prob, mu, which the loss needs, and one top entry;
  the trainer's forward gathers one id): what the model and the RL algorithm cost on their own;
- ``topk``: ``off`` with top-K (``--topk``): the engine's K log-probs and pi at mu's K ids in the trainer;
- ``on``: ``topk`` with the token log as the demo writes it (every token, top-K in float16, summaries, samples,
  the vocabulary table of V texts, the manifest).

The setting is the demo's (``trustscope.demo.DEMO_SETTING``) at the batch it had when measured (:data:`BATCH`: 8
prompts x 8 responses of at most 32 tokens, bf16 rollouts, lag 1, four mini-batches, a constant lr, one torch
thread) for ``--steps`` steps, evaluation off. Reported per run: the
process's wall from start to exit (engine start-up, model load, the steps, the logger's close), its peak RSS
(``ru_maxrss``; the engine runs in this process; on a GPU also ``max_memory_allocated``) and its CPU time (all its
threads, the engine's included); the median step wall and step CPU time from step to step, and the wall's parts
from the trainer's own clocks (rollout, update, weight sync; "other" is the rest: the logger call and the step scalars).
Then the split: what V = 151,936 adds with the hooks off (the model's part) and what the hooks add at each V
(trustscope's part), as ratios and seconds. Timings on a shared machine are noisy: compare ratios within one command.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
common.one_thread()

ROOT = Path(__file__).resolve().parents[1]

WORLDS = {"78": "toy-v2", "151936": "toy-v2-152k", "moe-78": "toy-moe", "moe-151936": "toy-moe-152k"}
"""The worlds by label: the dense pair (the default) and the mixture-of-experts pair (``--worlds moe-78
moe-151936``: ``toy-moe`` and its widening, both sides' experts logged on every token with the hooks on)."""
DEFAULT_WORLDS = ("78", "151936")
TASKS = {"toy-moe": "add1", "toy-moe-152k": "add1"}
"""A world's task where it is not the demo's (the MoE worlds are warm-started on one-digit addition)."""


def label(world: str) -> str:
    """``V = 151,936`` or ``MoE V = 78``."""
    moe, v = world.startswith("moe-"), world.removeprefix("moe-")
    return f"{'MoE ' if moe else ''}V = {int(v):,}"
HOOKS = ("off", "topk", "on")
BATCH = dict(prompts_per_step=8, group_size=8, mini_batches=4, lr=1e-4, warmup_steps=0, lr_schedule="constant")
"""The demo's batch and schedule when docs/performance.md's figures were measured (the demo now trains 16 x 16,
eight mini-batches, a warmed-up and decaying lr, in another world): the bench keeps them, so its figures stay
comparable."""


def config(world: str, hooks: str, steps: int, topk: int, logdir: Path):
    from trustscope.demo import DEMO_SETTING
    from trustscope.train.config import TrainConfig

    setting = {**DEMO_SETTING, **BATCH, "model": WORLDS[world], "steps": steps, "eval_every": 0, "logdir": str(logdir),
               "run_id": f"v{world}-{hooks}", "topk": 1 if hooks == "off" else topk, "log_tokens": hooks == "on",
               **({"task": TASKS[WORLDS[world]]} if WORLDS[world] in TASKS else {})}
    return TrainConfig(**setting)


def child(world: str, hooks: str, steps: int, topk: int, logdir: Path) -> dict:
    start = time.perf_counter()
    import torch

    from trustscope.train.loop import train

    stamps: list[float] = []
    cpu: list[float] = []
    parts: list[dict[str, float]] = []

    def on_step(step: int, scalars: dict[str, float]) -> None:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        parts.append({k[5:-2]: float(v) for k, v in scalars.items() if k.startswith("time/") and k.endswith("_s")})

    cfg = config(world, hooks, steps, topk, logdir)
    t0 = time.perf_counter()
    train(cfg, on_step=on_step)
    end = time.perf_counter()
    walls = [b - a for a, b in itertools.pairwise(stamps)]
    later = parts[1:]  # the steps that have a step-to-step wall
    med = {name: statistics.median(p[name] for p in later) for name in ("rollout", "train", "sync", "step")}
    step_wall = statistics.median(walls)
    step_cpu = statistics.median(b - a for a, b in itertools.pairwise(cpu))
    return {"world": world, "hooks": hooks, "model": WORLDS[world], "topk": cfg.topk, "log_tokens": cfg.log_tokens,
            "process_s": end - start, "process_cpu_s": time.process_time(), "step_cpu_s": step_cpu, "imports_s": t0 - start, "until_first_step_s": stamps[0] - t0,
            "after_last_step_s": end - stamps[-1], "step_walls_s": walls, "step_wall_s": step_wall,
            "parts_s": {**med, "other": step_wall - med["step"]},
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "run_bytes": sum(f.stat().st_size for f in (logdir / cfg.run_id).rglob("*") if f.is_file())
            if (logdir / cfg.run_id).exists() else 0}


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--topk", type=int, default=8, help="K of the topk and on runs (the demo's 8)")
    p.add_argument("--worlds", nargs="+", choices=list(WORLDS), default=list(DEFAULT_WORLDS))
    p.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS))
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--child", nargs=2, metavar=("WORLD", "HOOKS"), help=argparse.SUPPRESS)
    p.add_argument("--logdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (a step-to-step wall needs two steps), got {args.steps}")
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.topk, args.logdir)))
        return {}
    from trustscope.train.models import resolve_model

    for world in args.worlds:  # build (or find) both worlds first: no run pays a build
        resolve_model(config(world, "off", args.steps, args.topk, Path(tempfile.gettempdir())))
    results = []
    for world in args.worlds:
        for hooks in args.hooks:
            tmp = Path(tempfile.mkdtemp(prefix="bench_real_vocab."))
            try:
                t0 = time.perf_counter()
                done = subprocess.run([*common.module_cmd(__spec__), "--child", world, hooks, "--logdir", str(tmp),
                                       "--steps", str(args.steps), "--topk", str(args.topk)],
                                      capture_output=True, text=True)
                wall = time.perf_counter() - t0
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            if done.returncode:
                sys.exit(f"V={world} hooks {hooks} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["process_wall_s"] = wall
            results.append(result)
            print(f"  {label(world)} {hooks}: {wall:.0f} s", file=sys.stderr)
    print(f"{args.steps} steps of the demo's setting, K = {args.topk}, fresh processes; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'world':>14} {'hooks':<5} {'process s':>9} {'CPU s':>7} {'step s':>7} {'step CPU':>8} {'rollout':>8} {'update':>7} {'sync':>6} "
          f"{'other':>6} {'RSS GiB':>8} {'log MB':>7}")
    figures: dict = {}
    for r in results:
        q = r["parts_s"]
        print(f"{label(r['world']):>14} {r['hooks']:<5} {r['process_wall_s']:9.1f} {r['process_cpu_s']:7.1f} "
              f"{r['step_wall_s']:7.2f} {r['step_cpu_s']:8.2f} "
              f"{q['rollout']:8.2f} {q['train']:7.2f} {q['sync']:6.2f} {q['other']:6.2f} {r['peak_rss_gib']:8.2f} "
              f"{r['run_bytes'] / 1e6:7.1f}")
        figures[f"{label(r['world'])} hooks {r['hooks']}"] = {
            "process_wall_s": r["process_wall_s"], "process_cpu_s": r["process_cpu_s"], "step_wall_s": r["step_wall_s"],
            "step_cpu_s": r["step_cpu_s"], "step_parts_s": q, "peak_rss_gib": r["peak_rss_gib"],
            "log_mb": r["run_bytes"] / 1e6}
    by = {(r["world"], r["hooks"]): r for r in results}

    def split(a: tuple[str, str], b: tuple[str, str], what: str) -> None:
        if a in by and b in by:
            x, y = by[a], by[b]
            print(f"{what:<44} process x{y['process_wall_s'] / x['process_wall_s']:.2f} "
                  f"({y['process_wall_s'] - x['process_wall_s']:+.1f} s), step x{y['step_wall_s'] / x['step_wall_s']:.2f} "
                  f"({y['step_wall_s'] - x['step_wall_s']:+.2f} s), step CPU x{y['step_cpu_s'] / x['step_cpu_s']:.2f} "
                  f"({y['step_cpu_s'] - x['step_cpu_s']:+.2f} s), RSS {y['peak_rss_gib'] - x['peak_rss_gib']:+.2f} GiB")
            figures[what] = {key: {"x": y[key] / x[key], "added": y[key] - x[key]}
                             for key in ("process_wall_s", "step_wall_s", "step_cpu_s")}
            figures[what]["peak_rss_gib"] = {"added": y["peak_rss_gib"] - x["peak_rss_gib"]}

    for prefix, kind in (("", ""), ("moe-", "MoE ")):
        split((f"{prefix}78", "on"), (f"{prefix}151936", "on"), f"{kind}V = 151,936 against 78, hooks on")
        split((f"{prefix}78", "off"), (f"{prefix}151936", "off"), f"the {kind}model's part: V, hooks off")
    for world in args.worlds:
        split((world, "off"), (world, "topk"), f"top-K at {label(world)}")
        split((world, "topk"), (world, "on"), f"the token log at {label(world)}")
        split((world, "off"), (world, "on"), f"trustscope's part at {label(world)}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "topk": args.topk, "load_average": os.getloadavg(),
                                         "results": results}, indent=2))
    return figures


if __name__ == "__main__":
    main()
