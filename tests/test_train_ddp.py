"""Data-parallel training: a 2-rank torchrun run on CPU (gloo, hf engine) equals the 1-rank run at the same global
batch, and its ranks' files read as one run.

The engine is transformers ``generate`` here: two vLLM engines, one per rank, on a 2-core machine would be too
heavy for CI (and rank 0 alone samples in this design anyway, so the engine does not change what is tested).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.db import connect
from trustscope.losses import AGGREGATIONS, aggregate
from trustscope.train.config import ConfigError, TrainConfig, check_world
from trustscope.train.loop import train
from trustscope.train.ranks import aggregate_weight, local_rows
from trustscope.train.rollouts import step_seed

# token_mean: the aggregation a plain DDP average gets wrong when the ranks hold different token counts;
# mini_batches=4 (4 of the 16 samples each, shuffled over the whole step) gives the ranks unequal shares of a
# mini-batch, and sometimes none of it (checked in test_two_ranks_equal_one_rank).
OPTIONS = {"engine": "hf", "prompts_per_step": 4, "group_size": 4, "max_tokens": 6, "topk": 5, "mini_batches": 4,
           "aggregation": "token_mean", "steps": 2, "save_every": 2, "eval_every": 0, "threads": 1, "lr": 2e-4}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(run_dir, name: str = "loss") -> dict[int, float]:
    df = pq.read_table(run_dir / "steps").to_pandas()
    rows = df[df["name"] == name]
    return dict(zip(rows["step"], rows["value"], strict=True))


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{OPTIONS['steps'] - 1:06d}" / "model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# pure pieces


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_weighted_shares_aggregate_to_the_whole(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.4
    mask[2] = False  # a response without tokens: seq_mean_token_mean skips it
    whole = aggregate(loss, mask, mode, max_len=5)
    parts = [(loss[:2], mask[:2]), (loss[2:], mask[2:])]
    w = [aggregate_weight(mode, m, 5) for _, m in parts]
    split = sum(aggregate(lo, m, mode, max_len=5) * wi / sum(w) for (lo, m), wi in zip(parts, w, strict=True))
    assert torch.allclose(split, whole, atol=1e-6)


def test_local_rows_keep_the_shuffle_order():
    idx = torch.tensor([7, 0, 5, 2, 4])
    assert local_rows(idx, 0, 4).tolist() == [0, 2]
    assert local_rows(idx, 1, 4).tolist() == [3, 1, 0]
    assert local_rows(torch.tensor([0, 1]), 1, 4).tolist() == []


def test_world_must_divide_the_groups():
    cfg = TrainConfig(run_id="x", prompts_per_step=3)
    check_world(cfg, 3)
    with pytest.raises(ConfigError, match=r"prompts_per_step=3: .*multiple of the 2 data-parallel ranks"):
        check_world(cfg, 2)


# ---------------------------------------------------------------------------------------------------------------
# two ranks against one


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tmp_path, toy_model_dir):
    b = OPTIONS["prompts_per_step"] * OPTIONS["group_size"]
    shares = [len(local_rows(idx, 1, b // 2)) for step in range(OPTIONS["steps"])
              for idx in torch.randperm(b, generator=torch.Generator().manual_seed(step_seed(0, step, 3)))
              .chunk(OPTIONS["mini_batches"])]
    assert {0, 1, 4} <= set(shares)  # rank 1 holds none, a quarter and all of some mini-batch

    one = train(TrainConfig(logdir=str(tmp_path / "one"), run_id="dp", **OPTIONS))

    args = [arg for name, value in OPTIONS.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "trustscope.cli", "train", "--logdir", str(tmp_path / "two"),
           "--run-id", "dp", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

    run_one, run_two = tmp_path / "one" / "dp", tmp_path / "two" / "dp"
    losses_one, losses_two = _steps(run_one), _steps(run_two)
    steps = list(range(OPTIONS["steps"]))
    assert sorted(losses_two) == steps
    assert all(losses_one[s] != 0 for s in steps)  # every step has groups with a signal: the comparison bites
    np.testing.assert_allclose([losses_two[s] for s in steps], [losses_one[s] for s in steps], rtol=1e-5, atol=1e-6)
    assert losses_one[steps[-1]] == pytest.approx(one["loss"])
    norms_one, norms_two = _steps(run_one, "grad_norm"), _steps(run_two, "grad_norm")
    np.testing.assert_allclose([norms_two[s] for s in steps], [norms_one[s] for s in steps], rtol=1e-5)
    # Final parameters to float tolerance. Adam divides by sqrt(v), so a parameter whose gradient is float noise
    # around 0 (k_proj's bias: softmax ignores a shift shared by all keys) moves by noise-sized steps; the bound is
    # 2% of what Adam can move a weight in these updates (lr each), far below what training moved them.
    tol = 0.02 * OPTIONS["lr"] * OPTIONS["steps"] * OPTIONS["mini_batches"]
    w0, w1, w2 = load_file(Path(toy_model_dir) / "model.safetensors"), _weights(run_one), _weights(run_two)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=tol, msg=name)
    assert max(float((w1[n] - w0[n]).abs().max()) for n in w1) > 10 * tol

    # each rank wrote its own files, rank 0 alone the checkpoint and the scalars
    tokens = pq.read_table(run_two / "tokens").to_pandas()
    assert sorted(tokens["rank"].unique()) == [0, 1]
    assert (run_two / "ranks" / "rank0001.json").exists()
    assert set(pq.read_table(run_two / "steps").column("rank").to_pylist()) == {0}
    # the same responses under the same step-wide ids as the one-rank run
    samples = {name: pq.read_table(run / "samples").to_pandas().sort_values(["step", "sample_id"])
               for name, run in (("one", run_one), ("two", run_two))}
    for column in ("sample_id", "prompt_id", "response", "reward", "prompt"):
        assert samples["two"][column].tolist() == samples["one"][column].tolist(), column
    assert sorted(samples["two"]["rank"].unique()) == [0, 1]

    # one run for `trustscope validate` and for the dashboard's LogDB, both ranks' tokens in it
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "two")])
    assert result.exit_code == 0, result.output
    assert "ok: 1 run(s)" in result.output
    with connect(tmp_path / "one") as db1, connect(tmp_path / "two") as db2:
        r1, r2 = db1.runs(), db2.runs()
        assert len(r2) == 1 and r2["run_id"].tolist() == ["dp"]
        for column in ("n_steps", "n_samples", "n_response_tokens"):
            assert r2[column].tolist() == r1[column].tolist(), column
        assert r2["mean_reward"].iloc[0] == pytest.approx(r1["mean_reward"].iloc[0])
        s1, s2 = db1.step_summary(), db2.step_summary()
        assert s2["n_tokens"].tolist() == s1["n_tokens"].tolist()
        np.testing.assert_allclose(s2["mismatch_mean"], s1["mismatch_mean"], rtol=1e-3, atol=1e-6)
