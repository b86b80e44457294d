"""TRL's GRPOTrainer with ``attach(topk=K)`` against ``attach(topk=0)`` at Qwen3's vocabulary, V = 151,936.

    .venv/bin/python -m bench.bench_trl_real_vocab                        # 4 completions x 128 tokens, 2 steps
    .venv/bin/python -m bench.bench_trl_real_vocab --tokens 384 --topk 0 20 --steps 2

A ``Qwen3ForCausalLM`` with Qwen3-0.6B's layer shapes (``--layers`` of them, random weights) and V = 151,936 is
built and saved here with the toy's character tokenizer (ids past the tokenizer's are sampled and decode to
nothing; the reward is a constant, TRL's loss still runs), then trained ``--steps`` GRPO steps on the transformers
path (``topk_forward=True`` for K > 0: the trainer's own top-K after each rollout, from the backbone's hidden
states in tiles over the head, and pi at those ids in the loss from the loss forward's hidden states). Each K runs
in a fresh process; reported: the peak RSS of that process and the median step time, with ratios to ``topk=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench import common

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936


def build(model_dir: Path, layers: int) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from trustscope.train.toy import build_toy_model

    tokenizer = AutoTokenizer.from_pretrained(build_toy_model())
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      intermediate_size=3072, num_hidden_layers=layers, tie_word_embeddings=True,
                      max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def run(model_dir: Path, topk: int, steps: int, tokens: int, completions: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trustscope.integrations.trl import attach

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    work = Path(tempfile.mkdtemp(prefix="bench-trl-vocab-"))
    data = Dataset.from_dict({"prompt": ["1+1="] * steps})
    args = GRPOConfig(output_dir=str(work / "out"), max_steps=steps, per_device_train_batch_size=completions,
                      num_generations=completions, max_completion_length=tokens, learning_rate=1e-5, beta=0.0,
                      temperature=1.0, top_k=0, top_p=1.0, logging_steps=1, save_strategy="no", report_to=[],
                      use_cpu=True, bf16=False, disable_tqdm=True, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                          args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir),
                          callbacks=[Clock()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach(trainer, work / "logs", topk=topk, topk_forward=bool(topk), run_id="bench")
    start = time.perf_counter()
    trainer.train()
    steps_s = [b - a for a, b in zip([start, *stamps], stamps, strict=False)]
    return {"topk": topk, "step_s": statistics.median(steps_s), "steps_s": steps_s,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topk", type=int, nargs="+", default=[0, 20])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128, help="max completion length")
    p.add_argument("--completions", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # model dir, topk
    args = p.parse_args()
    if args.child:
        print(json.dumps(run(Path(args.child[0]), int(args.child[1]), args.steps, args.tokens, args.completions)))
        return {}
    if 0 not in args.topk:
        p.error("--topk must include 0, the baseline")
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.layers)
        rows = []
        for k in args.topk:
            done = subprocess.run([*common.module_cmd(__spec__), "--child", tmp, str(k), "--steps", str(args.steps),
                                   "--tokens", str(args.tokens), "--completions", str(args.completions)],
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if done.returncode != 0:
                sys.exit(f"topk={k} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  topk={k}: step {rows[-1]['step_s']:.1f} s, peak RSS {rows[-1]['peak_rss_gib']:.2f} GiB",
                  file=sys.stderr, flush=True)
    base = rows[0] if rows[0]["topk"] == 0 else next(r for r in rows if r["topk"] == 0)
    print(f"\nTRL GRPO, transformers path, Qwen3-0.6B shapes x {args.layers} layers, V = {VOCAB:,}, "
          f"{args.completions} completions x {args.tokens} tokens, {args.steps} steps")
    print(f"{'topk':>5} {'step s':>8} {'x topk=0':>9} {'peak RSS GiB':>13} {'x topk=0':>9}")
    figures = {}
    for r in rows:
        print(f"{r['topk']:>5} {r['step_s']:8.1f} {r['step_s'] / base['step_s']:9.3f} {r['peak_rss_gib']:13.2f} "
              f"{r['peak_rss_gib'] / base['peak_rss_gib']:9.3f}")
        figures[f"topk={r['topk']}"] = {"step_s": r["step_s"], "step_x_topk0": r["step_s"] / base["step_s"],
                                        "peak_rss_gib": r["peak_rss_gib"],
                                        "peak_rss_x_topk0": r["peak_rss_gib"] / base["peak_rss_gib"]}
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "runs": rows},
                                        indent=1))
    return figures


if __name__ == "__main__":
    main()
