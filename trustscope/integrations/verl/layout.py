"""Where an actor process sits in verl's parallel layout: which one process per data-parallel replica logs."""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

SUPPORTED_LAYOUTS = ("FSDP (fsdp, fsdp2) with data parallelism and Ulysses sequence parallelism; Megatron with data, "
                     "tensor, pipeline and context parallelism (not dynamic context parallelism)")
"""The actor layouts :func:`actor_layout` maps (named in the error of any other)."""


class VerlLayoutError(NotImplementedError):
    """verl's actors run in a parallel layout whose ranks trustscope cannot map to data-parallel replicas."""


@dataclass(frozen=True)
class ActorLayout:
    """Where one actor process sits in verl's parallel layout, read from verl's own process groups.

    Attributes:
        dp_rank: its data-parallel rank (trustscope logs it as rank ``dp_rank + 1``).
        dp_size: the number of data-parallel replicas.
        logs: True on the one rank per replica that holds the replica's gathered rows: Ulysses sequence rank 0
            (FSDP), or tensor rank 0 and context rank 0 on the last pipeline stage (Megatron).
        name: the layout in words, e.g. ``FSDP: 2 data x 2 Ulysses sequence``.
    """

    dp_rank: int
    dp_size: int
    logs: bool
    name: str


def _megatron_state() -> Any:
    """Megatron's ``parallel_state`` (verl's ``mpu``) when this process initialised it, else None."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    return mpu


def actor_layout(dp_group: Any = None) -> ActorLayout:
    """This actor's :class:`ActorLayout`, from the data-parallel group verl's engine hands its loss function.

    verl's FSDP engine passes the ``dp`` dimension of its ``(dp, sp)`` device mesh and sets its Ulysses group
    (``verl.utils.ulysses.get_ulysses_sequence_parallel_group``) while it trains; the sequence ranks of a replica
    get the same rows and, after the gather of the outputs, the same log-probs. verl's Megatron engine passes
    ``mpu.get_data_parallel_group()``; tensor and context ranks hold the same gathered outputs and only the last
    pipeline stage computes the loss. Without torch.distributed each process is its own replica (rank from
    ``RANK``). Raises :class:`VerlLayoutError` when the world is not data x (sequence | tensor x pipeline x
    context), naming the layout and :data:`SUPPORTED_LAYOUTS`.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return ActorLayout(int(os.environ.get("RANK", "0")), 1, True, "one process per data-parallel rank")
    world = dist.get_world_size()
    dp_size, dp_rank = dist.get_world_size(group=dp_group), dist.get_rank(group=dp_group)
    mpu = _megatron_state()
    if mpu is not None:
        sizes = {"tensor": mpu.get_tensor_model_parallel_world_size(),
                 "pipeline": mpu.get_pipeline_model_parallel_world_size(),
                 "context": mpu.get_context_parallel_world_size()}
        name = f"Megatron: {dp_size} data x " + " x ".join(f"{n} {k}" for k, n in sizes.items())
        mpu_dp = mpu.get_data_parallel_group()
        if dp_group is not None and dist.get_process_group_ranks(dp_group) != dist.get_process_group_ranks(mpu_dp):
            raise VerlLayoutError(f"verl actor layout {name}: the loss's data-parallel group is not Megatron's "
                                  f"(dynamic context parallelism?); trustscope maps {SUPPORTED_LAYOUTS}")
        if world != dp_size * math.prod(sizes.values()):
            raise VerlLayoutError(f"verl actor layout {name} does not make up its world of {world} ranks; "
                                  f"trustscope maps {SUPPORTED_LAYOUTS}")
        logs = (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
                and mpu.is_pipeline_last_stage(ignore_virtual=True))
        return ActorLayout(dp_rank, dp_size, logs, name)
    ulysses = importlib.import_module("verl.utils.ulysses")
    sp_size, sp_rank = ulysses.get_ulysses_sequence_parallel_world_size(), ulysses.get_ulysses_sequence_parallel_rank()
    name = f"FSDP: {dp_size} data x {sp_size} Ulysses sequence"
    if world != dp_size * sp_size:
        raise VerlLayoutError(
            f"verl actor layout {name} does not make up its world of {world} ranks (ranks in groups trustscope "
            f"cannot see: tensor or pipeline parallelism outside Megatron's parallel state?), so rows would be "
            f"logged more than once or not at all; trustscope maps {SUPPORTED_LAYOUTS}")
    return ActorLayout(dp_rank, dp_size, sp_rank == 0, name)


def check_actor_config(actor_cfg: Any) -> str:
    """The actor layout verl's config asks for, in words; :class:`VerlLayoutError` for one trustscope cannot map
    (a strategy other than FSDP or Megatron with model parallelism, Megatron's dynamic context parallelism).
    :func:`attach` calls it; every actor checks its real groups again at its first micro-batch."""
    strategy = str(actor_cfg.get("strategy", "fsdp"))
    if strategy in ("fsdp", "fsdp2"):
        sp = int(actor_cfg.get("ulysses_sequence_parallel_size", 1) or 1)
        return f"{strategy}: data x {sp} Ulysses sequence"
    block = actor_cfg.get(strategy, None) or {}
    sizes = {k: v for k, v in block.items() if k.endswith("parallel_size") and isinstance(v, int) and v > 1}
    if strategy == "megatron":
        if block.get("dynamic_context_parallel", False):
            raise VerlLayoutError(f"verl actor strategy megatron with dynamic_context_parallel=True: trustscope "
                                  f"maps {SUPPORTED_LAYOUTS}")
        return f"megatron: data x {sizes or 'no model parallelism'}"
    if sizes:
        raise VerlLayoutError(f"verl actor strategy {strategy} with {sizes}: trustscope maps {SUPPORTED_LAYOUTS}; "
                              f"run {strategy} without model parallelism, or with FSDP or Megatron")
    return f"{strategy}: data parallel"
