"""Trainer throughput: steps/s and tokens/s with the logger on and off, and against TRL's GRPOTrainer.

    .venv/bin/python -m bench.bench_train [--steps 12] [--warmup 2] [--repeats 2] [--engines hf vllm] [--no-trl]

Everything runs in this one process on the same toy model, task (``add1``) and batch (8 prompts x 8 responses,
8 new tokens at most, one optimizer update per step). Reported per configuration: the median wall time and the median
CPU time of this process (all threads) per step, from one step's end to the next (rollout, update, weight sync and
the logger call), steps/s and response tokens/s. Logger overhead is measured four ways: the wall and the CPU
difference between logging on and off (runs alternate, so slow phases of a shared machine hit both; CPU time also
counts the background writer thread and is less disturbed by other processes), the time spent inside
``TokenLogger.log_step`` itself, and the CPU the logger's own work takes on the threads that do it (the caller's
``log_step``, the writer thread, the encoders; ``logger_cpu.LoggerCPU``), which the drift between two runs does not
blur. The TRL baseline is ``GRPOTrainer`` with transformers generation
(TRL's vLLM modes need a GPU or a vLLM server), ``beta=0``, Dr. GRPO loss and no reward scaling: the closest match
to the trainer's own defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from bench.logger_cpu import LoggerCPU  # bench/, this script's folder

PROMPTS, GROUP, MAX_TOKENS, LR = 8, 8, 8, 1e-4


def bench_ours(model_dir: Path, engine: str, log: bool, steps: int, warmup: int, logdir: Path) -> dict[str, float]:
    """One run of the integrated trainer; per-step wall times from the step callback."""
    from trustscope import logger as logger_module
    from trustscope.train.config import TrainConfig
    from trustscope.train.loop import train

    stamps: list[tuple[float, float]] = []
    tokens: list[float] = []
    in_log: list[float] = []
    original = logger_module.TokenLogger.log_step

    def timed_log_step(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            in_log.append(time.perf_counter() - t)

    logger_module.TokenLogger.log_step = timed_log_step
    cfg = TrainConfig(model=str(model_dir), engine=engine, steps=steps, prompts_per_step=PROMPTS, group_size=GROUP,
                      max_tokens=MAX_TOKENS, lr=LR, eval_every=0, log_tokens=log, logdir=str(logdir),
                      run_id=f"bench-{engine}-{'on' if log else 'off'}-{time.time_ns()}")
    try:
        with LoggerCPU() as cpu:
            train(cfg, on_step=lambda step, s: (stamps.append(clock()), tokens.append(s["tokens"])))
    finally:
        logger_module.TokenLogger.log_step = original
    own = cpu.seconds()
    return {**per_step(stamps, warmup), "tokens_per_step": statistics.mean(tokens[warmup + 1 :]),
            "log_call_s": statistics.median(in_log[warmup + 1 :]) if in_log else 0.0,
            **{f"logger_{k.replace(' ', '_')}_cpu_s": v / steps for k, v in own.items()}}


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread, the logger's writer included)."""
    return time.perf_counter(), time.process_time()


def per_step(stamps: list[tuple[float, float]], warmup: int) -> dict[str, float]:
    """Median wall and CPU time between consecutive step ends, after ``warmup`` steps."""
    pairs = list(zip(stamps[warmup:], stamps[warmup + 1 :], strict=False))
    return {"step_s": statistics.median(b[0] - a[0] for a, b in pairs),
            "cpu_s": statistics.median(b[1] - a[1] for a, b in pairs)}


def bench_trl(model_dir: Path, steps: int, warmup: int, outdir: Path) -> dict[str, float]:
    """TRL's GRPOTrainer on the same model, task and batch; per-step wall times from a callback."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trustscope.train.tasks import get_task

    task = get_task("add1")
    problems = task.split("train")[: PROMPTS * (steps + 2)]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})

    def reward(completions, answer, **kwargs):
        return [task.reward(c, a, "stop") for c, a in zip(completions, answer, strict=True)]

    stamps: list[tuple[float, float]] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(clock())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    args = GRPOConfig(output_dir=str(outdir), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
                      num_generations=GROUP, max_completion_length=MAX_TOKENS, learning_rate=LR, beta=0.0,
                      loss_type="dr_grpo", scale_rewards="none", temperature=1.0, top_k=0, top_p=1.0,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                      disable_tqdm=True, seed=0, shuffle_dataset=False, lr_scheduler_type="constant",
                      warmup_steps=0)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    trainer.train()
    return {**per_step(stamps, warmup), "tokens_per_step": statistics.mean(lengths[warmup + 1 :]) * PROMPTS * GROUP,
            "log_call_s": 0.0}


def row(name: str, r: dict[str, float]) -> str:
    return (f"| {name} | {r['step_s'] * 1e3:.0f} | {r['cpu_s'] * 1e3:.0f} | {1 / r['step_s']:.2f} "
            f"| {r['tokens_per_step'] / r['step_s']:.0f} | {r['log_call_s'] * 1e3:.1f} |")


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from trustscope.train.toy import build_toy_model

    torch.set_num_threads(args.threads)
    model_dir = build_toy_model()
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    print(f"toy model {model_dir}; {args.steps} steps ({args.warmup} warm-up) x {args.repeats} repeats; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    lines = ["| configuration | step wall ms (median) | step CPU ms (median) | steps/s | tokens/s | in log_step ms |",
             "|---|---|---|---|---|---|"]
    figures: dict = {}
    for engine in args.engines:
        results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for log in (False, True):
                results[log].append(bench_ours(model_dir, engine, log, args.steps, args.warmup, work))
                print(engine, "log" if log else "nolog", results[log][-1], flush=True)
        merged = {log: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for log, rs in results.items()}
        off, on = merged[False], merged[True]
        lines.append(row(f"trustscope, engine {engine}, logging off", off))
        lines.append(row(f"trustscope, engine {engine}, logging on", on))
        lines.append(f"| logger overhead, engine {engine} | wall {(on['step_s'] / off['step_s'] - 1) * 100:+.1f}% | "
                     f"CPU {(on['cpu_s'] / off['cpu_s'] - 1) * 100:+.1f}% | log_step call "
                     f"{on['log_call_s'] / on['step_s'] * 100:.1f}% of the step | | |")
        own = {k: statistics.median(r[f"logger_{k}_cpu_s"] for r in results[True])
               for k in ("caller", "writer_thread", "encoders")}
        lines.append(f"| the logger's own CPU, engine {engine} (its threads, per step) | "
                     + " | ".join(f"{k.replace('_', ' ')} {v * 1e3:.2f} ms" for k, v in own.items())
                     + f" | total {sum(own.values()) / off['cpu_s'] * 100:.1f}% of a logging-off step's CPU | |")
        figures[f"engine {engine}"] = {
            "logging off": off, "logging on": on,
            "overhead": {"wall": on["step_s"] / off["step_s"] - 1, "cpu": on["cpu_s"] / off["cpu_s"] - 1,
                         "log_step_share_of_step": on["log_call_s"] / on["step_s"]},
            "logger_cpu_s_per_step": own, "logger_cpu_share_of_off_step": sum(own.values()) / off["cpu_s"]}
        if engine == "hf":
            hf_off = off
    if not args.no_trl:
        try:
            trl = bench_trl(model_dir, args.steps, args.warmup, work / "trl")
            print("trl", trl, flush=True)
            lines.append(row("TRL GRPOTrainer (transformers generate)", trl))
            figures["trl"] = trl
            if "hf" in args.engines:
                lines.append(f"| TRL / trustscope (hf, logging off) | {trl['step_s'] / hf_off['step_s']:.1f}x | "
                             f"{trl['cpu_s'] / hf_off['cpu_s']:.1f}x | | | |")
                figures["trl_over_hf_off"] = {"wall": trl["step_s"] / hf_off["step_s"],
                                              "cpu": trl["cpu_s"] / hf_off["cpu_s"]}
        except Exception as exc:  # report exactly why TRL could not run here
            lines.append(f"| TRL GRPOTrainer | failed: {type(exc).__name__}: {exc} | | | | |")
            figures["trl"] = f"failed: {type(exc).__name__}: {exc}"
    print("\n".join(lines))
    return figures


if __name__ == "__main__":
    main()
