"""Mixture-of-experts routing in the integrated trainer: both sides' experts on every logged token from the batched
rollouts, routing replay (``--routing-replay``) declared in run.json and healthy, bad settings refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trustscope.train.config import ConfigError, TrainConfig


def test_replay_runs_with_either_engine():
    assert TrainConfig(run_id="x", routing_replay=True, engine="hf").routing_replay


@pytest.fixture(scope="module")
def random_moe_dir(tmp_path_factory):
    """toy-moe-flip's architecture at its random initialisation (routers std 0.2: experts vary from position to
    position), saved with the toy tokenizer."""
    from trustscope.train import toy
    from trustscope.train.toy_moe import MOE_PRESETS, new_toy_moe_model

    out = tmp_path_factory.mktemp("random-moe")
    tokenizer = toy.toy_tokenizer()
    new_toy_moe_model(MOE_PRESETS["toy-moe-flip"], tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_hf_engine_routes_each_position_as_a_full_forward_does(random_moe_dir, toy_model_dir):
    """The transformers engine's experts (its generate's prefill, then one row per decode step) line up with the
    positions fed: in float32 they equal a teacher-forced forward's at every position of every sample, prompt
    included, and one position off they do not; ``extend`` gives the same layout; dense models are refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from trustscope.engines import make_engine
    from trustscope.routing import TrainerRouting, agreement

    model = AutoModelForCausalLM.from_pretrained(str(random_moe_dir)).eval()
    tracker = TrainerRouting(model)
    with make_engine("hf", random_moe_dir, routing=True) as eng:
        rollouts = [eng.generate(["3+4=", "12+5=", "7+1="], n=2, max_tokens=6, seed=1),
                    eng.extend([[5, 6, 7], [8, 9, 10, 11, 12]], [4, 6], seed=2)]
    for ro in rollouts:
        tensors = ro.to_tensors(pad_id=0)
        with tracker.hooked(), torch.no_grad():
            model(input_ids=tensors.input_ids, attention_mask=tensors.attention_mask,
                  position_ids=tensors.position_ids)
        full = tracker.take(*tensors.input_ids.shape)  # (B, P + T, L, k)
        p, shifted = tensors.prompt_len, []
        for i, rows in enumerate(ro.routed_experts):
            n_p, t = len(ro.prompt_ids[i]), len(ro.response_ids[i])
            assert rows.shape == (n_p + t - 1, 4, 2) and rows.dtype == np.int16
            assert (agreement(rows, full[i, p - n_p: p + t - 1])[0] == 1.0).all()
            shifted.append(agreement(rows[1:], full[i, p - n_p: p + t - 2])[0])
        assert np.concatenate(shifted).mean() < 0.9
    with pytest.raises(ValueError, match=r"routing=True: .* is a dense model"):
        make_engine("hf", toy_model_dir, routing=True)


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


@pytest.mark.slow
def test_hf_engine_training_logs_both_sides_and_replays(tmp_path):
    """``engine=hf`` on an MoE model: bf16 rollouts log the engine copy's experts beside the trainer's, summaries
    equal a recount; with replay every token agrees and the doctor check passes."""
    from trustscope import doctor as D
    from trustscope.db import connect

    train_moe(tmp_path, "hf", engine="hf", engine_dtype="bfloat16")
    train_moe(tmp_path, "hf-replayed", engine="hf", engine_dtype="bfloat16", routing_replay=True)
    with connect(tmp_path, cache=False) as db:
        rows = db.sql("select run_id, engine_experts, trainer_experts, routing_agreement from tokens").to_pandas()
        summ = db.sql("select run_id, sum(count)::bigint as n, (sum(mean * count) / sum(count))::double as agr "
                      "from summaries where metric = 'routing_agreement' and dimension is null "
                      "group by run_id").to_pandas()
        found = {run: {f.check: f for f in fs}["routing_replay"] for run, fs in D.diagnose(db).items()}
    assert set(rows["run_id"]) == {"hf", "hf-replayed"}
    assert rows["engine_experts"].notna().all() and rows["trainer_experts"].notna().all()
    assert all(len(e) == 8 for e in rows["engine_experts"])
    assert (rows.loc[rows["run_id"] == "hf-replayed", "routing_agreement"] == 1.0).all()
    recount = rows.groupby("run_id")["routing_agreement"].agg(["count", "mean"])
    for r in summ.itertuples():
        assert r.n == recount.loc[r.run_id, "count"] and r.agr == pytest.approx(recount.loc[r.run_id, "mean"])
    assert found["hf-replayed"].verdict == "ok" and found["hf"].verdict == "skipped"


def test_parity_with_the_hf_engine_reads_routing_on_both_sides(random_moe_dir):
    """``trustscope parity --engine hf`` on an MoE model: the engine copy's experts beside the trainer's, one row
    per response token; at float32 every choice agrees."""
    from trustscope.parity import run_parity, summary

    result = run_parity(random_moe_dir, ["1+2=", "3+4="], engine="hf", n=2, max_tokens=5)
    assert result.engine_experts.shape == (len(result.mu), 4, 2) == result.trainer_experts.shape
    assert (result.routing_agreement == 1.0).all()
    assert summary(result)["routing"]["agreement_mean"] == 1.0
