"""A vLLM worker extension (``--worker-extension-cls weight_file_sync.WeightFileSync``) for the tests' TRL server.

TRL 1.16 pushes weights to ``trl vllm-serve`` only over vLLM's NCCL weight-transfer engine, which needs CUDA. On CPU
the trainer writes its weights to a safetensors file and asks the server, through vLLM's ``/collective_rpc``
development endpoint (on under ``VLLM_SERVER_DEV_MODE=1``, which ``trl vllm-serve`` sets), to call
:meth:`WeightFileSync.load_weights_file` in its worker.
"""

from safetensors.torch import load_file


class WeightFileSync:
    """Mixed into vLLM's worker class by vLLM itself; ``self`` is the worker."""

    def load_weights_file(self, path: str) -> int:
        """Load the HF-named tensors of ``path`` into the running model; returns how many were loaded.

        vLLM's ``reload_weights`` re-runs each layer's post-load processing, which on CPU re-packs the linear
        weights for the GEMM kernels. A tied ``lm_head`` is not in the file (it is the embedding), and its packed copy
        would stay stale, so it is re-packed from the updated embedding.
        """
        tensors = load_file(path)
        self.reload_weights(weights_iterator=list(tensors.items()))
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        if "lm_head.weight" not in tensors and lm_head is not None and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return len(tensors)
