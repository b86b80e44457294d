#!/usr/bin/env bash
# The sanity test at a larger scale, on a GPU machine: plain vLLM (CUDA) rollouts in bf16 against the fp32 trainer,
# the 20M-parameter `toy-gpu` model built and warm-started locally on the GPU (no download), three-digit column
# addition, 8 rules x 3 seeds plus the anchoring probe (preset `sanity-gpu` of studies/experiments.py).
#
#   bash scripts/gpu_sanity.sh                  # everything: setup, model, sweep, summary, figures
#   bash scripts/gpu_sanity.sh --calibrate      # 30 steps of PG-IS and DPPO binary TV, seed 0: check the setting first
#   bash scripts/gpu_sanity.sh --set lr=1e-4    # any field of the shared setting (after --calibrate, for example)
#   bash scripts/gpu_sanity.sh --bench          # only the production-shape benchmarks (below)
#
# Runs go to runs/sanity-gpu (runs/sanity-gpu-calibrate for --calibrate); a finished run is skipped when the script
# is run again, so an interrupted sweep continues. Never needed by CI; needs nvidia-smi and a CUDA GPU.
#
# After the sweep (or alone, with --bench) the benchmarks of docs/performance.md ("Top-K at a real vocabulary") run
# on the GPU at V = 151,936 and write one JSON, runs/gpu-bench/results.json: bench/bench_production_shapes.py
# (TRL's fused log-prob pass in bf16, Qwen3-8B layer shapes x 2 layers, 4k/8k/16k-token responses, against top-K
# from hidden states and the old full-logits pass), bench/bench_engine_logprobs.py (plain vLLM rollout tokens/s
# with logprobs = none, 0, 1, 5, 20) and bench/bench_real_vocab_train.py (the trainer on toy-v2 and toy-v2-152k,
# V = 78 and 151,936, trustscope's hooks off / top-20 / on, on the GPU with plain vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."

calibrate=0
bench_only=0
sets=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --calibrate) calibrate=1; shift ;;
        --bench) bench_only=1; shift ;;
        --set) shift; while [[ $# -gt 0 && "$1" != --* ]]; do sets+=("$1"); shift; done ;;
        *) echo "gpu_sanity.sh: unknown argument $1 (use --calibrate, --bench, --set FIELD=VALUE ...)" >&2; exit 2 ;;
    esac
done

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_sanity.sh: no GPU here (nvidia-smi -L failed); this script is for a CUDA machine" >&2
    exit 1
fi
nvidia-smi -L

# scripts/setup.sh installs trustscope[gpu] (plain vLLM and its CUDA torch) when it sees a GPU
bash scripts/setup.sh
PY=.venv/bin/python
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, 'vllm', vllm.__version__)"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

bench() {
    local out=runs/gpu-bench
    mkdir -p "$out"
    local start
    start=$(date +%s)
    "$PY" -m bench.bench_production_shapes --device cuda --dtype bfloat16 --preset qwen3-8b --layers 2 \
        --tokens 4096 8192 16384 --repeats 3 --warmup 1 --json "$out/production_shapes.json"
    "$PY" -m bench.bench_engine_logprobs --dtype bfloat16 --hidden 1024 --layers 2 --prompts 256 \
        --max-tokens 1024 --repeats 3 --json "$out/engine_logprobs.json"
    "$PY" -m bench.bench_real_vocab_train --steps 5 --topk 20 --json "$out/real_vocab_train.json"
    "$PY" - "$out" <<'JSON'
import json, platform, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "host": platform.node(),
           "production_shapes": json.loads((out / "production_shapes.json").read_text()),
           "engine_logprobs": json.loads((out / "engine_logprobs.json").read_text()),
           "real_vocab_train": json.loads((out / "real_vocab_train.json").read_text())}
(out / "results.json").write_text(json.dumps(results, indent=1))
print("gpu_sanity.sh: benchmark results in", out / "results.json")
JSON
    echo "gpu_sanity.sh: benchmarks took $(( $(date +%s) - start )) s" >&2
}

if [[ $bench_only == 1 ]]; then
    bench
    exit 0
fi
# the toy-gpu build (cached under $TRUSTSCOPE_CACHE, default ~/.cache/trustscope) before any run needs it
"$PY" -c "
from trustscope.train.toy import TOY_PRESETS, build_toy_model, toy_meta
path = build_toy_model(TOY_PRESETS['toy-gpu'])
meta = toy_meta(path)
print(path, meta['parameters'], 'parameters, warm start', meta['warm_start']['steps'], 'steps,',
      round(meta['warm_start']['eval_expected_accuracy'], 3), 'expected accuracy,', meta['build_seconds'], 's')
"

start=$(date +%s)
if [[ $calibrate == 1 ]]; then
    logdir=runs/sanity-gpu-calibrate
    "$PY" -m studies.experiments run --preset sanity-gpu --logdir "$logdir" --rules pg_is dppo_binary_tv --seeds 0 \
        --no-probe --set steps=30 eval_every=10 "${sets[@]}"
else
    logdir=runs/sanity-gpu
    "$PY" -m studies.experiments run --preset sanity-gpu --logdir "$logdir" --set "${sets[@]}"
fi
echo "gpu_sanity.sh: runs took $(( $(date +%s) - start )) s" >&2
"$PY" -m studies.experiments summarize --logdir "$logdir" | tee "$logdir/calibration.md"
if [[ $calibrate == 0 ]]; then
    "$PY" -m studies.experiments plot --logdir "$logdir" --out "$logdir/img" | tee "$logdir/summary.md"
fi
[[ $calibrate == 1 ]] || bench
echo "gpu_sanity.sh: done; open the runs with: $PY -m trustscope.cli dashboard $logdir" >&2
