"""What ``trustscope.integrations.trl.attach`` adds to a TRL GRPOTrainer step, on the toy model.

    .venv/bin/python -m bench.bench_trl_attach [--pairs 10] [--steps 30] [--warmup 3] [--threads 1] [--topk 0]

Everything runs in this one process: the toy model, task ``add1``, 8 prompts x 8 completions of at most 8 tokens
a step, one optimizer update per step, TRL's transformers generation. Each pair is two fresh trainers run one after
the other, one without attach and one with it (the order alternates from pair to pair, so a machine that speeds
up or slows down over the run does not favour either side). Per run: the median wall time and the median CPU time
of this process (all threads, the logger's writer thread included) per step, from one step's end to the next,
after ``--warmup`` steps. Reported: the median over pairs of the paired ratio attached / plain, with the range,
and the time spent inside attach's own code per step (tagging the rollout, logging the micro-batch, writing TRL's
scalars), which the machine's drift does not blur, and the CPU time of the logger's own threads (the writer thread
and its encoders, measured on those threads: ``logger_cpu.LoggerCPU``).
``--topk K`` adds mu's top-K through ``topk_forward`` (two
extra no-grad forwards per step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


from bench.logger_cpu import LoggerCPU  # bench/, this script's folder

PROMPTS, GROUP, MAX_TOKENS, LR = 8, 8, 8, 1e-4


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread, the logger's writer included)."""
    return time.perf_counter(), time.process_time()


def one_run(model_dir: Path, work: Path, attached: bool, steps: int, warmup: int, topk: int,
            in_attach: list[tuple[float, float]], logger_cpu: LoggerCPU) -> dict[str, float]:
    """One fresh GRPOTrainer for ``steps`` steps; median per-step wall and CPU seconds after ``warmup``."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trustscope.integrations.trl import attach
    from trustscope.train.tasks import get_task

    task = get_task("add1")
    problems = task.split("train")[: PROMPTS * (steps + 1)]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})

    def reward(completions, answer, **kwargs):
        return [task.reward(c, a, "stop") for c, a in zip(completions, answer, strict=True)]

    stamps: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(clock())

    args = GRPOConfig(output_dir=str(work / "out"), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
                      num_generations=GROUP, max_completion_length=MAX_TOKENS, learning_rate=LR, beta=0.0,
                      loss_type="dr_grpo", scale_rewards="none", temperature=1.0, top_k=0, top_p=1.0,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                      disable_tqdm=True, seed=0, shuffle_dataset=False, lr_scheduler_type="constant",
                      warmup_steps=0)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    threads_before = logger_cpu.seconds()
    if attached:
        before = len(in_attach)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mu_source='trainer_recompute' notice, once per run
            attach(trainer, work / "logs", topk=topk, topk_forward=bool(topk), run_id=f"bench-{time.time_ns()}")
    trainer.train()
    pairs = list(zip(stamps[warmup:], stamps[warmup + 1 :], strict=False))
    out = {"step_s": statistics.median(b[0] - a[0] for a, b in pairs),
           "cpu_s": statistics.median(b[1] - a[1] for a, b in pairs)}
    if attached:
        mine = in_attach[before:]
        out["attach_s"] = sum(w for w, _ in mine) / steps  # per step, all of attach's own calls
        out["attach_cpu_s"] = sum(c for _, c in mine) / steps
        after = logger_cpu.seconds()  # the run's logger closed at the end of train()
        out["writer_cpu_s"] = sum(after[k] - threads_before[k] for k in ("writer thread", "encoders")) / steps
    return out


def time_attach_code(in_attach: list[tuple[float, float]]) -> None:
    """Record (wall, CPU of the calling thread) seconds of each call of attach's own work (not the TRL methods it
    wraps) into ``in_attach``; the CPU figure is not inflated by other processes competing for the cores."""
    from trustscope.integrations import trl as integration

    def timed(fn):
        def wrapper(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                in_attach.append((time.perf_counter() - t, time.thread_time() - c))

        return wrapper

    for name in ("tag_rollout", "log_micro_batch", "on_log"):
        setattr(integration.Attachment, name, timed(getattr(integration.Attachment, name)))


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--topk", type=int, default=0)
    args = parser.parse_args()

    import torch
    import trl

    from trustscope.train.toy import build_toy_model

    torch.set_num_threads(args.threads)
    model_dir = build_toy_model()
    work = Path(tempfile.mkdtemp(prefix="bench-trl-attach-"))
    in_attach: list[tuple[float, float]] = []
    logger_cpu = LoggerCPU().__enter__()  # for the whole program
    time_attach_code(in_attach)
    print(f"TRL {trl.__version__}, toy model {model_dir}; {args.pairs} pairs x {args.steps} steps "
          f"({args.warmup} warm-up); torch threads {torch.get_num_threads()}; topk {args.topk}", flush=True)
    one_run(model_dir, work / "warm", True, 4, 1, args.topk, in_attach, logger_cpu)  # imports, caches, first-call costs
    ratios_wall, ratios_cpu, plain, attached = [], [], [], []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        res = {on: one_run(model_dir, work / f"p{i}-{int(on)}", on, args.steps, args.warmup, args.topk, in_attach,
                           logger_cpu) for on in order}
        plain.append(res[False])
        attached.append(res[True])
        ratios_wall.append(res[True]["step_s"] / res[False]["step_s"])
        ratios_cpu.append(res[True]["cpu_s"] / res[False]["cpu_s"])
        print(f"pair {i}: plain {res[False]['step_s'] * 1e3:.1f} ms wall {res[False]['cpu_s'] * 1e3:.1f} ms CPU; "
              f"attached {res[True]['step_s'] * 1e3:.1f} ms wall {res[True]['cpu_s'] * 1e3:.1f} ms CPU "
              f"(attach's code {res[True]['attach_s'] * 1e3:.2f} ms wall, {res[True]['attach_cpu_s'] * 1e3:.2f} ms CPU; "
              f"logger writer {res[True]['writer_cpu_s'] * 1e3:.2f} ms CPU); ratio wall {ratios_wall[-1]:.3f} "
              f"CPU {ratios_cpu[-1]:.3f}", flush=True)

    def pct(x: float) -> str:
        return f"{(x - 1) * 100:+.1f}%"

    step = statistics.median(r["step_s"] for r in plain)
    code = statistics.median(r["attach_s"] for r in attached)
    code_cpu = statistics.median(r["attach_cpu_s"] for r in attached)
    step_cpu = statistics.median(r["cpu_s"] for r in plain)
    writer = statistics.median(r["writer_cpu_s"] for r in attached)
    print("\n| measure | plain | attached | attached / plain (median of pairs) | range over pairs |")
    print("|---|---|---|---|---|")
    print(f"| step wall ms (median) | {step * 1e3:.1f} | {statistics.median(r['step_s'] for r in attached) * 1e3:.1f} "
          f"| {pct(statistics.median(ratios_wall))} | {pct(min(ratios_wall))} .. {pct(max(ratios_wall))} |")
    print(f"| step CPU ms (median) | {statistics.median(r['cpu_s'] for r in plain) * 1e3:.1f} | "
          f"{statistics.median(r['cpu_s'] for r in attached) * 1e3:.1f} | {pct(statistics.median(ratios_cpu))} | "
          f"{pct(min(ratios_cpu))} .. {pct(max(ratios_cpu))} |")
    print(f"| inside attach's code, wall ms per step | | {code * 1e3:.2f} | {code / step * 100:.1f}% of a plain step's "
          f"wall | |")
    print(f"| inside attach's code, CPU ms per step (its thread) | | {code_cpu * 1e3:.2f} | "
          f"{code_cpu / step_cpu * 100:.1f}% of a plain step's CPU | |")
    print(f"| the logger's threads (writer, encoders), CPU ms per step | | {writer * 1e3:.2f} | "
          f"{writer / step_cpu * 100:.1f}% of a plain step's CPU | |")
    return {
        "step_wall_s": {"plain": step, "attached": statistics.median(r["step_s"] for r in attached),
                        "x_plain": statistics.median(ratios_wall), "x_plain_min": min(ratios_wall),
                        "x_plain_max": max(ratios_wall)},
        "step_cpu_s": {"plain": step_cpu, "attached": statistics.median(r["cpu_s"] for r in attached),
                       "x_plain": statistics.median(ratios_cpu), "x_plain_min": min(ratios_cpu),
                       "x_plain_max": max(ratios_cpu)},
        "attach_code_s_per_step": {"wall": code, "cpu": code_cpu, "share_of_plain_step_wall": code / step,
                                   "share_of_plain_step_cpu": code_cpu / step_cpu},
        "logger_threads_cpu_s_per_step": {"cpu": writer, "share_of_plain_step_cpu": writer / step_cpu},
    }


if __name__ == "__main__":
    main()
