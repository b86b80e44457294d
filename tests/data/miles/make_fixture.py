"""Run miles' own debug-dump writers (radixark/miles at a commit, its source on PYTHONPATH) on two tiny rollouts.

Usage: PYTHONPATH=<miles checkout at COMMIT>:<trustscope>/tests:<trustscope> python make_fixture.py OUT_DIR
Rollout side: miles.ray.rollout.debug_data.save_debug_rollout_data on real miles ``Sample`` objects. Train side:
miles.utils.train_dump_utils.save_debug_train_data_for_rank, once per rank of a 2 data x 2 context-parallel job
(tensor = pipeline = 1; Megatron's rank order, rank = cp_rank + 2 * dp_rank), each rank holding its data-parallel
shard and, of every per-token field, its context-parallel zigzag slice as miles' own
miles.backends.training_utils.cp_utils.get_logits_and_tokens_offset_with_cp places it (the two logits ranges,
counted from the first response position). The sample values come from tests/test_importers_slime.py
(make_samples, trainer_fields).
"""
import dataclasses
import sys
import types
from pathlib import Path

import numpy as np
import torch
from miles.backends.training_utils.cp_utils import get_logits_and_tokens_offset_with_cp
from miles.ray.rollout.debug_data import save_debug_rollout_data
from miles.utils.train_dump_utils import save_debug_train_data_for_rank
from miles.utils.types import Sample
from test_importers_slime import make_samples, trainer_fields

out = Path(sys.argv[1])
CP, DP = 2, 2
names = {f.name for f in dataclasses.fields(Sample)}
args = types.SimpleNamespace(save_debug_rollout_data=str(out / "rollout_data" / "{rollout_id}.pt"),
                             save_debug_train_data=str(out / "train_data" / "{rollout_id}_{rank}.pt"),
                             save_debug_trajectory_data=None, qkv_format="thd")


def cp_slice(values: torch.Tensor, total: int, resp: int, cp_rank: int) -> torch.Tensor:
    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total, resp, "thd", cp_rank=cp_rank, cp_size=CP)
    start = total - resp - 1  # logits index of the first response token
    return torch.cat([values[a - start:b - start] for a, b in logits])


rng = np.random.default_rng(0)
for rid in (0, 1):
    dicts = make_samples(rng, rid)
    fields = trainer_fields(rng, dicts)
    samples = []
    for d in dicts:
        sample = Sample(**{k: v for k, v in d.items() if k in names and k not in ("status", "spec_info",
                                                                                 "prefix_cache_info")})
        sample.status = Sample.Status(d["status"])
        samples.append(sample)
    save_debug_rollout_data(args, samples, rid, evaluation=False)
    for dp_rank in range(DP):
        shard = list(range(dp_rank, len(samples), DP))
        for cp_rank in range(CP):
            mine = [samples[i] for i in shard]
            data = {"tokens": [torch.tensor(s.tokens) for s in mine],
                    "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int) for s in mine],
                    "total_lengths": [len(s.tokens) for s in mine],
                    "response_lengths": [s.response_length for s in mine],
                    "sample_indices": [s.index for s in mine], "rewards": [float(s.reward) - 0.5 for s in mine],
                    "raw_reward": [s.reward for s in samples],
                    "truncated": [int(s.status == Sample.Status.TRUNCATED) for s in mine]}
            full = {"rollout_log_probs": [torch.tensor(samples[i].rollout_log_probs) for i in shard],
                    **{k: [fields[i][k] for i in shard] for k in fields[0]}}
            for name, values in full.items():
                data[name] = [cp_slice(v, len(s.tokens), s.response_length, cp_rank)
                              for v, s in zip(values, mine, strict=True)]
            save_debug_train_data_for_rank(args, rollout_id=rid, rollout_data=data, rank=cp_rank + CP * dp_rank,
                                           cp_rank=cp_rank, cp_size=CP)
print(sorted(str(p.relative_to(out)) for p in out.rglob("*.pt")))
