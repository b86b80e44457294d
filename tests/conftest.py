"""Settings every test process needs before torch, transformers or vLLM are imported."""

import os
from pathlib import Path

# vLLM runs in this process (no spawn, no __main__ guard), eager, with a capped KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Nothing is ever fetched from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- Toy model shared by the engine, trainer and logging tests (owned by trustscope/train/toy.py) ---------------
# `toy_model_dir`: the default warm-started toy model (tiny Qwen2 + character tokenizer, solves ~50% of "add1" at
# temperature 1). Built once per machine (~30 s on 2 cores) and cached under $TRUSTSCOPE_CACHE (default
# ~/.cache/trustscope); later sessions find it at once. Load it with vLLM, transformers or trustscope.engines.
import pytest


@pytest.fixture(scope="session")
def toy_model_dir():
    from trustscope.train.toy import build_toy_model

    return build_toy_model()


@pytest.fixture(autouse=True)
def _pythonpath_as_it_was():
    """``trustscope._dashboard.load`` puts the checkout on ``PYTHONPATH`` for the Streamlit server its process
    becomes; a test that runs the dashboard command in this process must not hand it on to later tests'
    subprocesses (pip, for one, then takes the checkout's trustscope as installed)."""
    before = os.environ.get("PYTHONPATH")
    yield
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before


# --- Logs in the old format (tests/data/legacy/README.md) ----------------------------------------------------------
LEGACY_LOGS = Path(__file__).resolve().parent / "data" / "legacy"


@pytest.fixture(scope="session")
def legacy_logs() -> Path:
    """A log directory of one run written before layout 2, policy_version, turn, the summary dimensions and the
    importance-weight signals; sample_logs/ may be regenerated, this never is. Copy the run before writing to it."""
    return LEGACY_LOGS
