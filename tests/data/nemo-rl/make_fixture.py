"""Run NeMo-RL's own ``Logger.log_batched_dict_as_jsonl`` (NVIDIA-NeMo/RL at COMMIT) on two GRPO steps' log_data.

Usage: PYTHONPATH=<NeMo-RL checkout at COMMIT>:<trustscope>/tests python make_fixture.py NEMO_RL_CHECKOUT COMMIT OUT_DIR
The log_data dicts have the keys and shapes grpo.py's "Log training data" block builds (tests/test_importers_nemo_rl
make_batch); the method is taken verbatim from nemo_rl/utils/logger.py of the commit (the Logger class itself
starts W&B / TensorBoard / MLflow backends, so it is not built: the method runs with base_log_dir set) and
BatchedDataDict is NeMo-RL's own (nemo_rl/distributed/batched_data_dict.py, imported from the source).
"""
import ast
import json
import os
import subprocess
import sys
import types

import numpy as np
import torch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from test_importers_nemo_rl import make_batch

REPO, commit, out = sys.argv[1], sys.argv[2], sys.argv[3]
src = subprocess.run(["git", "-C", REPO, "show", f"{commit}:nemo_rl/utils/logger.py"], capture_output=True,
                     text=True, check=True).stdout
logger_cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Logger")
method = next(n for n in logger_cls.body if isinstance(n, ast.FunctionDef) and n.name == "log_batched_dict_as_jsonl")
ns = {"os": os, "json": json, "torch": torch, "np": np, "BatchedDataDict": BatchedDataDict, "Any": object}
exec(compile(ast.fix_missing_locations(ast.Module([method], [])), "logger.py", "exec"), ns)
logger = types.SimpleNamespace(base_log_dir=out)
rng = np.random.default_rng(0)
for step in (1, 2):
    log_data = make_batch(rng)
    log_data.pop("truth")
    ns["log_batched_dict_as_jsonl"](logger, log_data, f"train_data_step{step}.jsonl")
