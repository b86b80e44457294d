"""Trainer-side capture at production shapes: Qwen3 layer shapes, V = 151,936, responses of thousands of tokens.

    .venv/bin/python -m bench.bench_production_shapes                           # 4096-token response, CPU
    .venv/bin/python -m bench.bench_production_shapes --tokens 4096 8192 --repeats 2 --json out.json
    .venv/bin/python -m bench.bench_production_shapes --device cuda --dtype bfloat16 --preset qwen3-8b \\
        --layers 2 --tokens 4096 8192 16384 --warmup 1 --json gpu.json

The model is ``transformers.Qwen3ForCausalLM`` built here with random weights (no download): the layer shapes of
``--preset`` (qwen3-0.6b: hidden 1024, 16 heads, 8 KV heads, MLP 3072, tied head; qwen3-8b: hidden 4096, 32 heads,
8 KV heads, MLP 12288, untied), ``--layers`` of them, Qwen3's vocabulary of 151,936 ids. One sequence of a
64-token prompt and a ``--tokens`` response. The baseline is the framework's own log-prob pass: TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``, as ``GRPOTrainer`` installs it: log-probs and entropy of the response
tokens, no logits), forward and, unless ``--no-backward``, backward of the mean log-prob. Cases, each in a fresh
process (peak memory is the process's own), the order alternating over ``--repeats``:

- ``trl``: the baseline alone. trustscope's log-prob and entropy are TRL's own outputs: they add nothing.
- ``hidden``: + pi at mu's top-K ids (``--k``, ids drawn at random: the cost does not depend on which) as attach
  computes them: a forward hook keeps the backbone's last hidden states, then
  :func:`trustscope.capture.logprobs_from_hidden` with log Z from TRL's log-prob of the sampled token.
- ``hidden_tiled``: the same without the label's log-prob: log Z computed in tiles over the vocabulary (what a
  caller without a fused head's output pays; no gradient, no ``(N, V)`` tensor).
- ``logits``: + what attach did before: one more no-grad plain forward with ``logits_to_keep = T + 1`` and
  :func:`trustscope.capture.capture` on the ``(1, T + 1, V)`` logits.

Reported per case (medians over repeats): the pass's wall and CPU time (forward + capture + backward; the CPU time
of the process, less blurred than the wall by other work on a shared machine) as ratios to ``trl``; the capture's
own wall and CPU time, also as shares of ``trl``'s pass (``% of trl``, ``CPU %``: what the case adds, read inside
one process, so the machine's drift between processes does not enter it); the peak memory (CPU: the process's peak RSS,
``ru_maxrss``; CUDA: ``max_memory_allocated``) and what it adds over ``trl``. ``--json`` writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import common

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 151_936
PROMPT = 64
PRESETS = {  # Qwen3's published layer shapes
    "qwen3-0.6b": {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 12288, "tie_word_embeddings": False},
}
CASES = ("trl", "hidden", "hidden_tiled", "logits")


def build(args: argparse.Namespace, tokens: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=args.vocab, num_hidden_layers=args.layers, max_position_embeddings=PROMPT + tokens + 8,
                      **PRESETS[args.preset])
    cfg._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, args.dtype))
    return model


def measure(args: argparse.Namespace, case: str, tokens: int) -> dict:
    """One case in this (fresh) process: the timed pass after ``--warmup`` untimed ones."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from trustscope.capture import capture, logprobs_from_hidden

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build(args, tokens)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(1)
    L = PROMPT + tokens
    input_ids = torch.randint(0, args.vocab, (1, L), generator=g).to(device)  # (1, P + T)
    attention = torch.ones_like(input_ids)
    labels = input_ids.masked_fill(torch.arange(L, device=device) < PROMPT, -100)  # the response is scored
    completion = input_ids[:, PROMPT:]  # (1, T)
    mu_ids = torch.randint(0, args.vocab, (1, tokens, args.k), generator=g).to(device)  # (1, T, K)
    kept: list = []
    model.model.register_forward_hook(lambda m, a, out: kept.append(out.last_hidden_state.detach())
                                      if case.startswith("hidden") else None)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def clock() -> tuple[float, float]:
        sync()
        return time.perf_counter(), time.process_time()

    def one_pass() -> dict:
        kept.clear()
        t0, c0 = clock()
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        logps = out.log_probs[:, -tokens:]  # (1, T): TRL's per-token log-probs
        t1, c1 = clock()
        with torch.no_grad():
            if case == "hidden":
                hidden = kept[0][:, -(tokens + 1):-1]  # (1, T, H)
                topk = logprobs_from_hidden(hidden, model.lm_head.weight, mu_ids, label_ids=completion,
                                            label_logprobs=logps.detach())
            elif case == "hidden_tiled":
                topk = logprobs_from_hidden(kept[0][:, -(tokens + 1):-1], model.lm_head.weight, mu_ids)
            elif case == "logits":
                logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=tokens + 1).logits
                topk = capture(logits, completion, response_start=1, mu_topk_ids=mu_ids).topk_logprobs
                del logits
            else:
                topk = None
        t2, c2 = clock()
        if not args.no_backward:
            (-logps.float().mean()).backward()
            model.zero_grad(set_to_none=True)
        t3, c3 = clock()
        if topk is not None:
            assert topk.shape == (1, tokens, args.k) and bool(torch.isfinite(topk).all())
        return {"forward_s": t1 - t0, "capture_s": t2 - t1, "backward_s": t3 - t2, "pass_s": t3 - t0,
                "forward_cpu_s": c1 - c0, "capture_cpu_s": c2 - c1, "backward_cpu_s": c3 - c2, "pass_cpu_s": c3 - c0}

    for _ in range(args.warmup):
        one_pass()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
    result = one_pass()
    result.update(case=case, tokens=tokens, rss_before_gib=rss_before,
                  peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    if device.type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def child_command(args: argparse.Namespace, case: str, tokens: int) -> list[str]:
    cmd = [*common.module_cmd(__spec__), "--child", case, "--tokens", str(tokens), "--preset", args.preset,
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--k", str(args.k), "--device", args.device,
           "--dtype", args.dtype, "--warmup", str(args.warmup), "--threads", str(args.threads)]
    return cmd + (["--no-backward"] if args.no_backward else [])


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096], help="response lengths (batch 1)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--k", type=int, default=20, help="mu's top-K ids per token")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0, help="untimed passes first (1 on a GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-backward", action="store_true", help="time the forward (and capture) only")
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if "trl" not in args.cases:
        p.error("--cases must include trl, the baseline the ratios are against")
    if args.child:
        print(json.dumps(measure(args, args.child, args.tokens[0])))
        return {}

    rows = []
    for tokens in args.tokens:
        for r in range(args.repeats):
            order = args.cases if r % 2 == 0 else list(reversed(args.cases))
            for case in order:
                done = subprocess.run(child_command(args, case, tokens), capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                if done.returncode != 0:
                    sys.exit(f"{case} at {tokens} tokens failed:\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"  {tokens:>6} {case:<13} pass {row['pass_s']:7.2f} s  capture {row['capture_s']:6.2f} s  "
                      f"peak RSS {row['peak_rss_gib']:.2f} GiB"
                      + (f"  peak GPU {row['peak_gpu_gib']:.2f} GiB" if "peak_gpu_gib" in row else ""),
                      file=sys.stderr, flush=True)

    mem = "peak_gpu_gib" if args.device.startswith("cuda") else "peak_rss_gib"
    keys = ("pass_s", "pass_cpu_s", "capture_s", "capture_cpu_s", mem)
    summary = []
    figures: dict = {}
    print(f"\n{args.preset} x {args.layers} layer(s), V = {args.vocab:,}, K = {args.k}, {args.dtype} on {args.device}, "
          f"{'forward only' if args.no_backward else 'forward + backward'}, median of {args.repeats}")
    print(f"{'tokens':>7} {'case':<13} {'wall s':>8} {'x trl':>6} {'CPU s':>8} {'x trl':>6} {'capture s':>10} "
          f"{'% of trl':>8} {'CPU %':>7} {'peak GiB':>9} {'+GiB':>6}")
    for tokens in args.tokens:
        med = {c: {k: statistics.median(r[k] for r in rows if r["case"] == c and r["tokens"] == tokens)
                   for k in keys} for c in args.cases}
        base = med["trl"]
        for c in args.cases:
            m = med[c]
            line = {"tokens": tokens, "case": c, **m, "wall_ratio": m["pass_s"] / base["pass_s"],
                    "cpu_ratio": m["pass_cpu_s"] / base["pass_cpu_s"],
                    "capture_share": m["capture_s"] / base["pass_s"],
                    "capture_cpu_share": m["capture_cpu_s"] / base["pass_cpu_s"], "peak_gib": m[mem],
                    "memory_ratio": m[mem] / base[mem], "memory_added_gib": m[mem] - base[mem]}
            summary.append(line)
            figures.setdefault(f"{tokens} tokens", {})[c] = {k: v for k, v in line.items()
                                                             if k not in ("tokens", "case")}
            print(f"{tokens:>7} {c:<13} {m['pass_s']:8.2f} {line['wall_ratio']:6.3f} {m['pass_cpu_s']:8.2f} "
                  f"{line['cpu_ratio']:6.3f} {m['capture_s']:10.3f} {100 * line['capture_share']:7.2f}% "
                  f"{100 * line['capture_cpu_share']:6.2f}% "
                  f"{m[mem]:9.2f} {line['memory_added_gib']:+6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items() if k != "child"},
                                         "memory": mem, "summary": summary, "runs": rows}, indent=1))
    return figures


if __name__ == "__main__":
    main()
