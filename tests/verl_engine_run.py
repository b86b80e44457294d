"""One verl actor process of tests/test_integration_verl.py's sharded runs (started by ``torchrun``).

It runs verl's own worker path on CPU: ``TrainingWorker`` (its ``train_mini_batch``) over verl's FSDP engine
(``FSDPEngineWithLMHead``: its device meshes, Ulysses sequence parallelism, ``forward_backward_batch``, the
model's forward and verl's ``ppo_loss``), with trustscope's ``ActorLogHook`` as the loss function, on a real tiny
Qwen2 model saved by the test. The data-parallel ranks get their chunk of the driver batch as verl's dispatch
(``make_nd_compute_dataproto_dispatch_fn``) hands it: the batch cut in data-parallel-size chunks, every rank of one
replica the same chunk.

Two things verl cannot do on a CPU are patched, nothing else:

- verl registers its FSDP engine for ``cuda`` and ``npu`` only: it is registered for ``cpu`` too, with verl's own
  ``EngineRegistry.register``.
- verl's Ulysses attention wraps flash-attention's varlen kernel (CUDA only): the kernel it calls
  (``_flash_attention_forward``) is replaced by a causal attention over each packed sequence in plain torch, and the
  model runs with transformers' flash-attention entry point under a name of its own, so verl's Ulysses
  all-to-all (heads scattered, sequence gathered) runs as on a GPU around it.

Usage: ``torchrun --nproc_per_node N tests/verl_engine_run.py SPEC.json`` with the spec written by the test.
"""

from __future__ import annotations

import itertools
import json
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ATTENTION = "ulysses_cpu_reference"


def varlen_causal_attention(query, key, value, attention_mask, query_length, *args, position_ids=None, **kwargs):
    """What ``_flash_attention_forward`` computes for packed sequences, in torch: ``(1, L, H, D)`` query, key and
    value (key and value may have fewer heads), ``position_ids`` ``(1, L)`` restarting at 0 on each sequence;
    causal attention within each sequence. Returns ``(1, L, H, D)``."""
    q, k, v = query[0], key[0], value[0]  # (L, H, D), (L, Hk, D)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    pos = position_ids.reshape(-1)  # (L,)
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), pos.numel()]
    out = torch.empty_like(q)
    scale = kwargs.get("softmax_scale")
    for a, b in itertools.pairwise(starts):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out.unsqueeze(0)


def cpu_platform():
    """verl's platform plugin (``PlatformRegistry``) for a CPU: device ``cpu``, the gloo backend, no-op device calls."""
    from contextlib import nullcontext

    from verl.plugin.platform.platform_base import PlatformBase

    class CPUModule(types.SimpleNamespace):
        """torch.cpu, and 0 for the accelerator memory counters verl reports (``max_memory_allocated``, ...)."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(torch.cpu, name, lambda *args, **kwargs: 0)

        def mem_get_info(self, device=None):
            return 0, 0

        def get_device_name(self, device=None):
            return "CPU"

    class PlatformCPU(PlatformBase):
        device_name, vendor_name, device_module = "cpu", "cpu", CPUModule()

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # verl moves tensors with .to(get_device_id())

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return PlatformCPU()


def patch_for_cpu() -> None:
    try:  # verl 0.9's platform plugins; verl 0.8 finds the CPU itself
        from verl.plugin.platform.platform_manager import set_platform
    except ImportError:  # its device module is then torch.cpu, without the memory counters verl reports
        for name in ("max_memory_allocated", "max_memory_reserved"):
            if not hasattr(torch.cpu, name):
                setattr(torch.cpu, name, lambda device=None: 0)
    else:
        set_platform(cpu_platform())  # before verl's modules read the device name at import
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    from verl.models.transformers import monkey_patch
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        FSDPEngineWithLMHead)
    monkey_patch._flash_attention_forward = varlen_causal_attention
    monkey_patch.is_trl_available = lambda: False  # TRL 1.16 has no AutoModelForCausalLMWithValueHead to patch
    AttentionInterface.register(ATTENTION, flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, flash_attention_mask)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    patch_for_cpu()
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.config.engine import CheckpointConfig
    from verl.workers.engine_workers import TrainingWorker

    sp = int(spec["sp"])
    model_config = HFModelConfig(path=spec["model"], use_remove_padding=True,
                                 override_config={"attn_implementation": ATTENTION})
    config = TrainingWorkerConfig(
        model_type="language_model", model_config=model_config,
        engine_config=FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=sp, use_torch_compile=False,
                                       model_dtype="float32", micro_batch_size_per_gpu=2, max_token_len_per_gpu=1024,
                                       use_dynamic_bsz=False, seed=0,
                                       mixed_precision={"param_dtype": "fp32"}),  # no bf16 autocast on a CPU
        optimizer_config=FSDPOptimizerConfig(lr=1e-4, clip_grad=1.0),
        checkpoint_config=CheckpointConfig(),
    )
    torch.distributed.init_process_group("gloo")  # before verl's worker, which would ask for NCCL
    worker = TrainingWorker(config)
    worker.reset()
    worker.set_loss_fn(torch.load(spec["loss_fn"], weights_only=False))
    data = torch.load(spec["batch"], weights_only=False)
    dp_rank, dp_size = worker.engine.get_data_parallel_rank(), worker.engine.get_data_parallel_size()
    chunk = data.chunk(dp_size)[dp_rank]  # verl's dispatch: one chunk per data-parallel rank
    output = worker.train_mini_batch(chunk)
    if output is not None:
        print(json.dumps({"rank": torch.distributed.get_rank(), "metrics": sorted(tu.get(output, "metrics"))}))
    torch.distributed.destroy_process_group()


def main_megatron(spec_path: str) -> None:
    """Megatron's parallel state (``megatron.core.parallel_state``, verl's ``mpu``) on gloo, as verl's Megatron
    engine initialises it, and the layout trustscope reads from it; one JSON line per rank into ``spec["out"]``."""
    import megatron.core.parallel_state as mpu

    from trustscope.integrations.verl import VerlLayoutError, actor_layout

    spec = json.loads(Path(spec_path).read_text())
    torch.distributed.init_process_group("gloo")
    rank, rows = torch.distributed.get_rank(), []
    for tp, pp, cp in spec["layouts"]:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      context_parallel_size=cp)
        layout = actor_layout(mpu.get_data_parallel_group())
        try:
            actor_layout(torch.distributed.group.WORLD)  # a group that is not Megatron's data-parallel group
            refused = None
        except VerlLayoutError as err:
            refused = str(err)
        rows.append({"layout": [tp, pp, cp], "rank": rank, "dp_rank": layout.dp_rank, "dp_size": layout.dp_size,
                     "logs": layout.logs, "name": layout.name, "tp": mpu.get_tensor_model_parallel_rank(),
                     "cp": mpu.get_context_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank(),
                     "last_stage": mpu.is_pipeline_last_stage(ignore_virtual=True), "refused": refused})
        mpu.destroy_model_parallel()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    (main_megatron if "megatron" in sys.argv[2:] else main)(sys.argv[1])
