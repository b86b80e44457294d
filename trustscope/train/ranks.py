"""Data parallelism under torchrun: this process's place among the ranks (:class:`Ranks`, whose collectives are the
identity on one rank), joining the group (:func:`join_ranks`), each rank's share of a step (:func:`shard_batch`)
and what makes a step split over ranks the one-rank step: each rank's weight of a mini-batch's ``aggregate``
(:func:`aggregate_weight`, :func:`local_rows`) and the rule's metrics reduced over the ranks
(:func:`reduce_metrics`). See ``docs/scale.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from trustscope.extras import missing

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.ranks")

from trustscope.engines import Rollout
from trustscope.train.rollouts import StepRollouts


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run: ``rank`` of ``world`` (0 of 1 in a plain run).

    Every collective is the identity when ``world == 1``, so one code path trains both, and a one-rank run computes
    exactly what it computed before data parallelism existed.
    """

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that samples rollouts, evaluates, logs the step scalars and writes checkpoints."""
        return self.rank == 0

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (a new tensor when ``world > 1``)."""
        if self.world == 1:
            return x
        x = x.detach().clone()
        dist.all_reduce(x)
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s element-wise maximum over the ranks."""
        if self.world == 1:
            return x
        x = x.detach().clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.world > 1:
            dist.barrier()

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for small things such as the run id)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, batch: StepRollouts | None) -> StepRollouts:
        """This rank's share of rank 0's step batch (``batch`` is None on the other ranks): see :func:`shard_batch`."""
        if self.world == 1:
            assert batch is not None
            return batch
        parts = [shard_batch(batch, r, self.world) for r in range(self.world)] if self.main else None
        box: list[Any] = [None]
        dist.scatter_object_list(box, parts, src=0)
        return box[0]


def join_ranks(device: torch.device) -> tuple[Ranks, torch.device, bool]:
    """Join the data-parallel group: an initialised ``torch.distributed`` group as it is, else under torchrun
    (``WORLD_SIZE > 1``) a new one, NCCL on GPU and gloo on CPU; else a plain one-rank run. Returns the ranks, the
    trainer's device (``cuda:<LOCAL_RANK>`` on GPU) and whether this call created the group (and must destroy it)."""
    created = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return Ranks(), device, False
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return Ranks(dist.get_rank(), dist.get_world_size()), device, created


def shard_batch(batch: StepRollouts, rank: int, world: int) -> StepRollouts:
    """Rank ``rank``'s share of a step batch: the ``rank``-th of ``world`` equal contiguous blocks of whole groups
    (``prompts_per_step % world == 0``, checked at start), so every group's advantages are those of the one-rank
    run. The block's samples are rows ``first_group * group_size ..`` of the step."""
    per_rank = len(batch.problems) // world
    g0 = rank * per_rank  # first group of the block, within the batch
    s0, s1 = g0 * batch.rollout.n, (g0 + per_rank) * batch.rollout.n  # its sample rows
    ro = batch.rollout
    rollout = Rollout(prompts=ro.prompts[g0 : g0 + per_rank], n=ro.n, topk=ro.topk,
                      prompt_index=[i - g0 for i in ro.prompt_index[s0:s1]], prompt_ids=ro.prompt_ids[s0:s1],
                      response_ids=ro.response_ids[s0:s1], mu_logprobs=ro.mu_logprobs[s0:s1],
                      mu_topk_ids=ro.mu_topk_ids[s0:s1], mu_topk_logprobs=ro.mu_topk_logprobs[s0:s1],
                      finish_reasons=ro.finish_reasons[s0:s1], texts=ro.texts[s0:s1], sampling=ro.sampling,
                      routed_experts=None if ro.routed_experts is None else ro.routed_experts[s0:s1],
                      **{name: getattr(ro, name)[s0:s1] for name in ("sampled", "turns", "engine_ids")
                         if getattr(ro, name) is not None})
    return StepRollouts(batch.weights_step, batch.problems[g0 : g0 + per_rank], rollout, batch.rewards[s0:s1],
                 first_group=batch.first_group + g0,
                 versions=None if batch.versions is None else batch.versions[s0:s1], stats=batch.stats)


def aggregate_weight(mode: str, mask: torch.Tensor, max_len: int) -> float:
    """What ``aggregate(loss, mask, mode, max_len)`` divides its masked sum by (before its clamp at 1): tokens,
    sequences with tokens, or sequences (times ``max_len``). ``mask`` ``(b, T)``.

    A mini-batch split over ranks is aggregated exactly by weighting each rank's ``aggregate`` with its weight
    over the ranks' total: ``sum_r aggregate_r * w_r / sum_r w_r`` is the one-rank ``aggregate`` of the whole.
    """
    if mode == "token_mean":
        return float(mask.sum())
    if mode == "seq_mean_token_mean":
        return float((mask.sum(-1) > 0).sum())
    if mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
        return float(mask.shape[0] * (max_len if mode == "seq_mean_token_sum_norm" else 1))
    raise ValueError(f"aggregate_weight: mode={mode!r} has no known weight; add it next to AGGREGATIONS' entry")


def local_rows(idx: torch.Tensor, rank: int, b: int) -> torch.Tensor:
    """The rows of this rank's block among a mini-batch's step-wide sample indices ``idx``, in ``idx``'s order.
    The rank holds step rows ``rank * b .. rank * b + b - 1``; the result indexes its own ``(b, ...)`` tensors."""
    mine = idx[(idx >= rank * b) & (idx < rank * b + b)]
    return mine - rank * b

def reduce_metrics(metrics: dict[str, torch.Tensor], n_valid: float, ranks: Ranks) -> dict[str, float]:
    """One update's rule metrics over the ranks: means weighted by each rank's valid tokens ``n_valid``, the
    maximum for ``*_max`` names; as they are on one rank."""
    if ranks.world == 1:
        return {name: float(value) for name, value in metrics.items()}
    names = sorted(metrics)
    maxes = [n for n in names if n.endswith("_max")]
    means = [n for n in names if not n.endswith("_max")]
    weighted = ranks.sum(torch.tensor([n_valid, *(float(metrics[n]) * n_valid for n in means)], dtype=torch.float64))
    top = ranks.max(torch.tensor([float(metrics[n]) if n_valid else -math.inf for n in maxes], dtype=torch.float64))
    n = max(float(weighted[0]), 1.0)
    return {**{name: float(v) / n for name, v in zip(means, weighted[1:], strict=True)},
            **{name: float(v) for name, v in zip(maxes, top, strict=True)}}
