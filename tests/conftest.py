"""Settings every test process needs before torch, transformers or vLLM are imported."""

import os

# vLLM runs in this process (no spawn, no __main__ guard), eager, with a capped KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Nothing is ever fetched from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
