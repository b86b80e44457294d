"""Rollout-engine benchmark on the toy model: start-up time, tokens/s at a realistic batch, weight-sync time.

    .venv/bin/python -m bench.bench_engines                       # 64 prompts x 8 samples x 32 tokens, K = 20
    .venv/bin/python -m bench.bench_engines --dtype bfloat16 --repeats 2

Both engines run in this process, one after the other, on the same model, prompts and sampling settings; the
ratio is against the HF engine (transformers generate), the baseline. By default the model is the toy
architecture with untrained weights (``--model random``), so responses run to ``--max-tokens`` as in a real RL
batch; the warm-started toy model (``--model toy``) answers in 2-3 tokens. Tokens are counted as sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch

from trustscope.engines import make_engine
from trustscope.train.tasks import get_task
from trustscope.train.toy import build_toy_model, load_toy_model


def bench_engine(name: str, model_dir, prompts, args, trainer_model) -> dict:
    t0 = time.perf_counter()
    engine = make_engine(name, model_dir, dtype=args.dtype, seed=0, **({"num_threads": args.threads}))
    start_s = time.perf_counter() - t0
    engine.generate(prompts[:4], n=2, max_tokens=4, topk=args.topk, seed=0)  # warm-up
    times, tokens = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        r = engine.generate(prompts, n=args.n, max_tokens=args.max_tokens, topk=args.topk, seed=100 + i)
        times.append(time.perf_counter() - t0)
        tokens.append(r.num_tokens)
    syncs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.update_weights(trainer_model)
        syncs.append(time.perf_counter() - t0)
    engine.close()
    best = min(range(len(times)), key=times.__getitem__)
    return {
        "engine": name,
        "start_s": round(start_s, 2),
        "generate_s_median": round(statistics.median(times), 3),
        "tokens_per_call": tokens[best],
        "tok_per_s_best": round(tokens[best] / times[best]),
        "tok_per_s_median": round(statistics.median(t / s for t, s in zip(tokens, times, strict=True))),
        "sync_ms_median": round(1000 * statistics.median(syncs), 1),
    }


def random_toy_copy(model_dir) -> str:
    """The toy architecture and tokenizer with freshly initialised weights, in a temporary directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tempfile.mkdtemp(prefix="trustscope-bench-")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    with torch.no_grad():  # std-0.02 init is near-uniform; x3 gives next-token entropy of ~2 nats, like a real LM
        model.model.embed_tokens.weight.mul_(3.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads during rollouts")
    ap.add_argument("--task", default="add2", help="prompt source; add2 answers are longer than add1's")
    ap.add_argument("--model", default="random", choices=["random", "toy"])
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    model_dir = build_toy_model()
    if args.model == "random":
        model_dir = random_toy_copy(model_dir)
    problems = get_task(args.task).split("eval")
    prompts = [problems[i % len(problems)].prompt for i in range(args.prompts)]
    trainer_model, _ = load_toy_model(model_dir)  # weight sync pushes these (same values) into each engine
    print(f"model {model_dir}, {args.prompts} prompts x {args.n} samples x <= {args.max_tokens} tokens, "
          f"K={args.topk}, {args.dtype}, {args.threads} rollout thread(s), torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = [bench_engine(name, model_dir, prompts, args, trainer_model) for name in ("hf", "vllm")]
    base = rows[0]["tok_per_s_median"]
    for row in rows:
        row["speed_vs_hf"] = round(row["tok_per_s_median"] / base, 2)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return {row["engine"]: {k: v for k, v in row.items() if k != "engine"} for row in rows}


if __name__ == "__main__":
    main()
