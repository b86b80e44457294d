"""Mixture-of-experts routing in the integrated trainer: both sides' experts on every logged token from the batched
rollouts, routing replay (``--routing-replay``) declared in run.json and healthy, bad settings refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trustscope.train.config import ConfigError, TrainConfig


def test_replay_needs_the_vllm_engine():
    with pytest.raises(ConfigError, match=r"routing_replay.*engine=vllm"):
        TrainConfig(run_id="x", routing_replay=True, engine="hf")


def test_replay_on_a_dense_model_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trustscope.train import moe

    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match="routing_replay=True: the model 'toy' is dense"):
        moe.routing_shape(TrainConfig(run_id="x", routing_replay=True), dense)
    assert moe.routing_shape(TrainConfig(run_id="x"), dense) is None


def train_moe(tmp_path, run_id: str, **overrides):
    from trustscope.train.loop import train

    cfg = TrainConfig(model="toy-moe-flip", steps=2, prompts_per_step=4, group_size=4, eval_every=0, threads=1,
                      logdir=str(tmp_path), run_id=run_id, **overrides)
    train(cfg)
    return tmp_path / run_id


@pytest.mark.slow
def test_training_logs_both_sides_experts_and_replay_leaves_no_disagreement(tmp_path):
    """fp32 vLLM against the fp32 trainer routes every token alike (so the batched capture lines each request's
    rows up with its tokens); bf16 with replay: declared in run.json, every token agrees, the doctor check passes;
    the summaries' agreement equals a recount from every token."""
    from trustscope import doctor as D
    from trustscope.db import connect

    train_moe(tmp_path, "fp32")
    replayed = train_moe(tmp_path, "replayed", engine_dtype="bfloat16", routing_replay=True)
    manifest = json.loads((replayed / "run.json").read_text())
    assert manifest["routing_replay"] is True and manifest["routing_shape"] == [4, 2, 16]
    with connect(tmp_path, cache=False) as db:
        rows = db.sql("select run_id, engine_experts, trainer_experts, routing_agreement from tokens").to_pandas()
        summ = db.sql("select run_id, sum(count)::bigint as n, (sum(mean * count) / sum(count))::double as agr from summaries "
                      "where metric = 'routing_agreement' and dimension is null group by run_id").to_pandas()
        steps = db.sql("select run_id, count(*) as n from steps where name = 'routing/replay_replaced' "
                       "group by run_id").to_pandas()
        found = {run: {f.check: f for f in fs}["routing_replay"] for run, fs in D.diagnose(db).items()}
    assert len(rows) > 0 and rows["engine_experts"].notna().all() and rows["trainer_experts"].notna().all()
    assert all(len(e) == 8 and len(t) == 8 for e, t in zip(rows["engine_experts"], rows["trainer_experts"],
                                                          strict=True))
    assert (rows["routing_agreement"] == 1.0).all()
    recount = rows.groupby("run_id")["routing_agreement"].agg(["count", "mean"])
    for r in summ.itertuples():
        assert r.n == recount.loc[r.run_id, "count"] and r.agr == pytest.approx(recount.loc[r.run_id, "mean"])
    assert steps.set_index("run_id")["n"].to_dict() == {"replayed": 2}
    assert found["replayed"].verdict == "ok" and found["fp32"].verdict == "skipped"
    assert np.isfinite(rows["routing_agreement"]).all()
