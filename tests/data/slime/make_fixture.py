"""Run slime's own debug-dump writers (THUDM/slime at a commit, its source on PYTHONPATH) on two tiny rollouts.

Usage: PYTHONPATH=<slime checkout at COMMIT>:<trustscope>/tests:<trustscope> python make_fixture.py OUT_DIR
(megatron-core from the verl-deps extra)
Rollout side: slime.observability.rollout_data_utils.save_debug_rollout_data on real slime ``Sample`` objects.
Train side: slime.observability.train_data_utils.save_debug_train_data in a one-process gloo group with Megatron's
parallel state initialised (tensor = pipeline = context = data = 1), on the rollout data dict as slime's actor holds
it after training (per-sample lists; log-probs, entropy, advantages, returns per response token).
The sample values come from tests/test_importers_slime.py (make_samples, trainer_fields).
"""
import dataclasses
import os
import sys
import types
from pathlib import Path

import megatron.core.parallel_state as mpu
import numpy as np
import torch
import torch.distributed as dist
from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.observability.train_data_utils import save_debug_train_data
from slime.utils.types import Sample
from test_importers_slime import make_samples, trainer_fields

out = Path(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
dist.init_process_group("gloo", rank=0, world_size=1)
mpu.initialize_model_parallel(1, 1)
names = {f.name for f in dataclasses.fields(Sample)}
rng = np.random.default_rng(0)
for rid in (0, 1):
    dicts = make_samples(rng, rid)
    fields = trainer_fields(rng, dicts)
    samples = []
    for d in dicts:
        kw = {k: v for k, v in d.items() if k in names and k not in ("status", "spec_info", "prefix_cache_info")}
        sample = Sample(**kw)
        sample.status = Sample.Status(d["status"])
        samples.append(sample)
    save_debug_rollout_data(str(out / "rollout_data" / "{rollout_id}.pt"), samples, rollout_id=rid, evaluation=False)
    rollout_data = {
        "sample_indices": [s.index for s in samples], "partition": list(range(len(samples))),
        "tokens": [torch.tensor(s.tokens) for s in samples], "total_lengths": [len(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "loss_masks": [torch.tensor(s.loss_mask) for s in samples],
        "rewards": [float(s.reward) - 0.5 for s in samples], "raw_reward": [s.reward for s in samples],
        "rollout_log_probs": [torch.tensor(s.rollout_log_probs) for s in samples],
        **{k: [f[k] for f in fields] for k in fields[0]},
    }
    args = types.SimpleNamespace(save_debug_train_data=str(out / "train_data" / "{rollout_id}.pt"))
    save_debug_train_data(args, rollout_id=rid, rollout_data=rollout_data)
dist.destroy_process_group()
print(sorted(str(p.relative_to(out)) for p in out.rglob("*.pt")))
