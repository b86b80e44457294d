"""``trustscope parity`` and MoE routing on both sides: bands that hold and bands that must break, bad input
refused with exit code 2, routed-expert arrays checked, agreement counted exactly, the report logged as a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.parity import ParityInputError, parse_band
from trustscope.routing import TrainerRouting, agreement, check_routing, moe_shape

runner = CliRunner()


def tiny_moe(tmp_path, layers: int = 2, experts: int = 4, top_k: int = 2):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("text,band", [("1e-2=0.99", (1e-2, 0.99, False)), ("first:0.1=1", (0.1, 1.0, True)),
                                       (" 1e-3 = 0.5 ", (1e-3, 0.5, False))])
def test_band_parses(text, band):
    b = parse_band(text)
    assert (b.tol, b.share, b.first) == band


@pytest.mark.parametrize("text,says", [("1e-2", "TOL=SHARE"), ("x=0.5", "numbers"), ("0=0.5", "tolerance '0'"),
                                       ("nan=0.5", "finite"), ("1e-2=0", "share '0'"),
                                       ("1e-2=1.5", "(0, 1]"), ("-1=0.5", "> 0")])
def test_bad_band_is_refused(text, says):
    with pytest.raises(ParityInputError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_band(text)


def test_cli_bad_input_exits_2(tmp_path):
    from transformers import ViTConfig

    result = runner.invoke(app, ["parity", "--model", str(tmp_path), "--band", "1e-2=2"])
    assert result.exit_code == 2 and "share '2' must be a number in (0, 1]" in result.output
    result = runner.invoke(app, ["parity", "--model", str(tmp_path)])
    assert result.exit_code == 2 and "no config.json" in result.output
    ViTConfig().save_pretrained(tmp_path)
    result = runner.invoke(app, ["parity", "--model", str(tmp_path), "--engine", "hf"])
    assert result.exit_code == 2 and "model_type 'vit'" in result.output and "not a causal language model" in \
        result.output
    result = runner.invoke(app, ["parity", "--model", "no-such-model"])
    assert result.exit_code == 2 and "nor a toy preset" in result.output


def test_check_routing_refuses_bad_shapes_ids_and_dense():
    shape = (2, 2, 4)
    good = np.array([[[0, 1], [2, 3]]] * 5, dtype=np.int64)
    assert check_routing(good, "engine_experts", shape, tokens=5).dtype == np.int16
    with pytest.raises(ValueError, match=r"engine_experts has shape \(5, 2, 3\), the model routes \(5, 2, 2\)"):
        check_routing(np.zeros((5, 2, 3), dtype=np.int16), "engine_experts", shape, tokens=5)
    with pytest.raises(ValueError, match=r"trainer_experts has shape \(4, 2, 2\), the model routes \(5, 2, 2\)"):
        check_routing(good[:4], "trainer_experts", shape, tokens=5)
    bad = good.copy()
    bad[3, 1, 0] = 4
    with pytest.raises(ValueError, match=r"engine_experts: expert id 4 out of range \[0, 4\)"):
        check_routing(bad, "engine_experts", shape)
    with pytest.raises(ValueError, match="engine_experts: routing given for a dense model"):
        check_routing(good, "engine_experts", None)
    with pytest.raises(ValueError, match="integer expert ids"):
        check_routing(good.astype(float), "engine_experts", shape)


def test_agreement_counts_layer_slot_choices_as_sets():
    engine = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]], dtype=np.int16)
    trainer = np.array([[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[3, 2], [0, 1]]], dtype=np.int16)
    per_token, per_layer = agreement(engine, trainer)
    np.testing.assert_allclose(per_token, [1.0, 0.75, 0.0])  # slot order within a layer does not matter
    np.testing.assert_allclose(per_layer, [[1, 1], [0.5, 1], [0, 0]])
    with pytest.raises(ValueError, match="differ in shape"):
        agreement(engine, trainer[:2])


def test_trainer_routing_hooks_read_each_layers_top_k(tmp_path):
    model = tiny_moe(tmp_path, layers=3, experts=4, top_k=2)
    assert moe_shape(model.config) == (3, 2, 4)
    routing = TrainerRouting(model)
    ids = torch.randint(0, 40, (2, 7))
    with routing.hooked(), torch.no_grad():
        model(input_ids=ids)
    got = routing.take(2, 7)  # (B, S, L, k)
    assert got.shape == (2, 7, 3, 2) and got.dtype == np.int16
    # the recorded ids are each router's top-k of its logits: recount from the logits of a second pass
    logits: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, a, o: logits.append(o[0].detach())) for m in routing.modules]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    for layer, lg in enumerate(logits):
        top = lg.topk(2, -1).indices.reshape(2, 7, 2).numpy()
        assert (np.sort(top, -1) == np.sort(got[:, :, layer], -1)).all()
    with pytest.raises(RuntimeError, match="no forward pass"):
        routing.take(2, 7)
    dense = torch.nn.Linear(2, 2)
    dense.config = type("C", (), {"num_hidden_layers": 1})()
    with pytest.raises(ValueError, match="dense"):
        TrainerRouting(dense)


@pytest.mark.slow
def test_parity_hf_engine_bands_hold_and_break(toy_model_dir, tmp_path):
    """transformers generate against the trainer's forward: float32 within 1e-4 everywhere; a bf16 engine breaks
    that band (exit 1) and the report names it; the logged run reads back with the engine as mu."""
    ok = runner.invoke(app, ["parity", "--model", str(toy_model_dir), "--engine", "hf", "--max-prompts", "6",
                             "--n", "2", "--band", "1e-4=1", "--band", "first:1e-4=1", "--json",
                             str(tmp_path / "ok.json")])
    assert ok.exit_code == 0, ok.output
    report = json.loads((tmp_path / "ok.json").read_text())
    assert report["within"]["0.001"] == 1.0 and all(not b["broken"] for b in report["bands"])
    assert report["first_token"]["tokens"] == 12 and report["tokens"] >= 12
    bad = runner.invoke(app, ["parity", "--model", str(toy_model_dir), "--engine", "hf", "--engine-dtype",
                              "bfloat16", "--max-prompts", "6", "--n", "2", "--band", "1e-4=1", "--band", "1=1",
                              "--logdir", str(tmp_path / "logs"), "--run-id", "parity-bf16"])
    assert bad.exit_code == 1, bad.output
    assert "band 0.0001=1: BROKEN" in bad.output and "band 1=1: ok" in bad.output
    from trustscope.db import connect

    with connect(tmp_path / "logs") as db:
        rows = db.sql("select count(*) as n, max(abs(log_ratio)) as worst, count(routing_agreement) as routed "
                      "from token_metrics where run_id = 'parity-bf16'").to_pandas()
    assert rows["n"][0] >= 12 and rows["worst"][0] > 1e-4 and rows["routed"][0] == 0


@pytest.fixture(scope="module")
def moe_model_dir():
    from trustscope.train.toy_moe import MOE_PRESETS, build_toy_moe_model

    return build_toy_moe_model(MOE_PRESETS["toy-moe"])


@pytest.mark.slow
def test_parity_vllm_dense_and_moe(toy_model_dir, moe_model_dir, tmp_path):
    """The real engine: float32 vLLM on the dense toy meets 1e-4 on every token; on the MoE toy float32 routes
    every token alike, bf16 breaks a tight band, and every routed token is logged with its agreement."""
    from trustscope.parity import log_parity, run_parity, summary

    ok = runner.invoke(app, ["parity", "--model", str(toy_model_dir), "--max-prompts", "4", "--n", "2",
                             "--band", "1e-4=1"])
    assert ok.exit_code == 0, ok.output
    prompts = ["1+2=", "3+4=", "5+5=", "9+8="]
    fp32 = run_parity(moe_model_dir, prompts, engine="vllm", n=2, max_tokens=8)
    assert fp32.engine_experts.shape == (len(fp32.mu), 2, 2) == fp32.trainer_experts.shape
    assert (fp32.routing_agreement == 1.0).all() and np.abs(fp32.diff).max() < 1e-4
    bf16 = run_parity(moe_model_dir, prompts, engine="vllm", engine_dtype="bfloat16", n=2, max_tokens=8, seed=1)
    assert bf16.within(1e-4) < 1.0
    s = summary(bf16)
    assert len(s["routing"]["by_layer"]) == 2 and 0 < s["routing"]["agreement_mean"] <= 1
    assert s["routing"]["agreement_mean"] == pytest.approx(bf16.routing_agreement.mean())
    run = log_parity(bf16, tmp_path / "logs", "moe-bf16")
    from trustscope.db import connect

    with connect(tmp_path / "logs") as db:
        got = db.sql("select sample_id, pos, routing_agreement from token_metrics where run_id = 'moe-bf16' "
                     "order by sample_id, pos").to_pandas()
    assert run == "moe-bf16" and len(got) == len(bf16.mu)
    np.testing.assert_allclose(got["routing_agreement"].to_numpy(), bf16.routing_agreement, atol=1e-7)


# ------------------------------------------------------------------------------------------- routing in the logger

SHAPE = (2, 2, 4)  # MoE layers, top-k, experts


def routed_batch(rng, b: int = 6, t: int = 5):
    engine = np.stack([rng.permutation(4)[:2] for _ in range(b * t * 2)]).reshape(b, t, 2, 2).astype(np.int16)
    trainer = engine.copy()
    flip = rng.random((b, t, 2)) < 0.3  # swap one slot to an expert the engine did not pick
    for i, j, layer in zip(*np.nonzero(flip), strict=True):
        trainer[i, j, layer, 1] = next(e for e in range(4) if e not in engine[i, j, layer])
    tokens = {"token_id": rng.integers(0, 50, (b, t)), "prompt_id": np.arange(b), "mu_logprob": -rng.random((b, t)).astype(np.float32),
              "pi_logprob": -rng.random((b, t)).astype(np.float32), "advantage": rng.normal(size=(b, t)),
              "engine_experts": engine, "trainer_experts": trainer}
    return tokens, engine, trainer


def test_logger_stores_routing_and_summarises_it_exactly_at_any_fraction(tmp_path):
    """Routed experts go in as (B, T, L, k), come back as L * k ids a row for the sampled tokens; the summaries'
    agreement (overall, by layer, by position) equals a recount from every token although half are kept."""
    from trustscope.db import connect
    from trustscope.logger import TokenLogger

    rng = np.random.default_rng(0)
    tokens, engine, trainer = routed_batch(rng)
    mask = np.ones((6, 5), dtype=bool)
    mask[0, 3:] = False
    with TokenLogger(tmp_path, "moe", routing_shape=SHAPE, token_fraction=0.5, seed=3) as logger:
        logger.log_step(0, tokens=tokens, mask=mask)
    per_token, per_layer = agreement(engine[mask], trainer[mask])
    with connect(tmp_path) as db:
        summ = db.sql("select dimension, bucket, count, mean from summaries where metric = 'routing_agreement' "
                      "order by dimension nulls first, bucket").to_pandas()
        rows = db.sql("select sample_id, pos, engine_experts, trainer_experts, routing_agreement from tokens "
                      "order by sample_id, pos").to_pandas()
    overall = summ[summ["dimension"].isna()]
    assert overall["count"].tolist() == [mask.sum()] and overall["mean"].iloc[0] == pytest.approx(per_token.mean())
    layers = summ[summ["dimension"] == "layer"]
    np.testing.assert_allclose(layers["mean"], per_layer.mean(0))
    pos = summ[summ["dimension"] == "position"]
    from trustscope.columns import position_bucket

    buckets = position_bucket(np.nonzero(mask)[1])
    np.testing.assert_allclose(pos["mean"], [per_token[buckets == b].mean() for b in np.unique(buckets)])
    assert 0 < len(rows) < mask.sum()  # the token rows are a sample; the summaries are not
    for _, r in rows.iterrows():
        i, j = int(r["sample_id"]), int(r["pos"])
        assert list(r["engine_experts"]) == engine[i, j].reshape(-1).tolist()
        assert list(r["trainer_experts"]) == trainer[i, j].reshape(-1).tolist()
        assert r["routing_agreement"] == pytest.approx(agreement(engine[i, j][None], trainer[i, j][None])[0][0])


def test_logger_refuses_bad_routing_naming_field_and_shapes(tmp_path):
    from trustscope.db import connect
    from trustscope.logger import TokenLogger
    from trustscope.runformat.errors import SchemaError

    tokens = routed_batch(np.random.default_rng(1))[0]
    with TokenLogger(tmp_path, "dense") as logger, pytest.raises(
            SchemaError, match=r"tokens\['engine_experts'\]: routing given for a dense model.*routing_shape"):
        logger.log_step(0, tokens=tokens)
    with TokenLogger(tmp_path, "moe", routing_shape=SHAPE) as logger:
        good = dict(tokens)
        logger.log_step(0, tokens=good)
        with pytest.raises(SchemaError, match=r"tokens\['trainer_experts'\] has shape \(30, 2, 1\) \(token rows, "
                                              r"MoE layers, top-k\), the run's routing_shape routes \(N, 2, 2\)"):
            logger.log_step(1, tokens=good | {"trainer_experts": good["trainer_experts"][..., :1]})
        bad = good["engine_experts"].copy()
        bad[2, 1, 0, 0] = 7
        with pytest.raises(SchemaError, match=r"tokens\['engine_experts'\]: expert id 7 at sample_id \d+, pos \d+, MoE layer 0, "
                                              r"slot 0 is out of range \[0, 4\)"):
            logger.log_step(1, tokens=good | {"engine_experts": bad})
        with pytest.raises(SchemaError, match=r"tokens\['engine_experts'\] must have shape \(B, T, L, k\)"):
            logger.log_step(1, tokens=good | {"engine_experts": bad[..., 0]})
    with pytest.raises(ValueError, match="routing_shape"):
        TokenLogger(tmp_path, "bad", routing_shape=(2, 5, 4))
    with connect(tmp_path) as db:  # the good step is all there
        assert db.sql("select count(*) as n from tokens where run_id = 'moe'").to_pandas()["n"][0] == 30


@pytest.mark.slow
def test_vllm_weight_sync_moe(moe_model_dir):
    """After the trainer's MoE weights are pushed into vLLM (a reload on CPU must prepack the experts again), the
    engine's log-probs are the updated model's, not the old one's."""
    from transformers import AutoModelForCausalLM

    from trustscope.engines import make_engine

    engine = make_engine("vllm", moe_model_dir, dtype="float32")
    reference = make_engine("hf", moe_model_dir, dtype="float32")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(moe_model_dir), dtype=torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "experts" in name or "gate" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        before = engine.generate(["1+2=", "3+4="], n=4, max_tokens=4, topk=2, seed=1)
        engine.update_weights(model)
        reference.update_weights(model)
        after = engine.generate(["1+2=", "3+4="], n=4, max_tokens=4, topk=2, seed=1)
        lp, _, t = reference.score(after)
        assert float(((lp - t.mu_logprob).abs() * t.mask).max()) < 1e-4
        lp_old, _, t_old = reference.score(before)
        assert float(((lp_old - t_old.mu_logprob).abs() * t_old.mask).max()) > 1e-2  # the update changed mu
    finally:
        engine.close()
        reference.close()


def test_positions_for_the_full_comparison_are_spread_and_start_at_the_first_token():
    from trustscope.parity import spread_positions

    assert spread_positions(16, 4, 0) == frozenset()
    assert spread_positions(16, 4, 64) == frozenset(range(16))  # room for every position
    kept = spread_positions(4096, 2, 256)
    assert 0 in kept and len(kept) * 2 <= 256 and max(kept) < 4096
    assert sorted(kept)[1] - sorted(kept)[0] == 32  # evenly: one position in 32


def test_the_full_distributions_are_compared_at_the_same_histories(toy_model_dir, tmp_path):
    """The transformers engine at float32 against the trainer at float32: the whole distributions agree to float
    precision and the kept rows score the sampled token exactly as mu; a bfloat16 engine moves them (TV and KL > 0);
    the figures reach the report and the logged run's manifest; full_positions=0 says it skipped."""
    import json

    from trustscope.parity import format_summary, log_parity, run_parity, summary

    prompts = ["1+2=", "3+4=", "5+1="]
    same = summary(run_parity(toy_model_dir, prompts, engine="hf", n=2, max_tokens=6, full_positions=64))
    f = same["full_distribution"]
    assert f["positions"] == same["tokens"] and f["sampled_gap_max"] < 1e-5  # every token kept: 6 x 6 <= 64
    assert f["tv_max"] < 1e-5 and abs(f["kl_mean"]) < 1e-8
    assert f["first_token"]["positions"] == 6
    result = run_parity(toy_model_dir, prompts, engine="hf", engine_dtype="bfloat16", n=2, max_tokens=6,
                        full_positions=64)
    moved = summary(result)["full_distribution"]
    assert moved["tv_mean"] > 100 * f["tv_mean"] and moved["kl_mean"] > 0 and moved["sampled_gap_max"] < 1e-5
    text = format_summary(summary(result), [], [])
    assert "full distributions at" in text and "TV mean" in text
    run_id = log_parity(result, tmp_path, "parity-bf16")
    stored = json.loads((tmp_path / run_id / "run.json").read_text())["config"]["parity"]["full_distribution"]
    assert stored["tv_mean"] == pytest.approx(moved["tv_mean"])
    off = summary(run_parity(toy_model_dir, prompts, engine="hf", n=1, max_tokens=4, full_positions=0))
    assert off["full_distribution"] == {"skipped": "full_positions=0"}


def test_the_engine_context_comes_from_the_prompts_and_the_model(toy_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from trustscope.parity import ParityInputError, context_length

    config, tokenizer = AutoConfig.from_pretrained(toy_model_dir), AutoTokenizer.from_pretrained(toy_model_dir)
    assert context_length(config, tokenizer, ["1+2="], 16) == 64  # a floor of 64
    limit = config.max_position_embeddings
    assert context_length(config, tokenizer, ["1+2="], limit - 10) == limit - 10 + len(tokenizer("1+2=")["input_ids"])
    with pytest.raises(ParityInputError, match="max_position_embeddings"):
        context_length(config, tokenizer, ["1+2="], limit)


@pytest.mark.slow
def test_vllm_logits_are_read_at_the_positions_it_sampled(toy_model_dir):
    """vLLM's own compute_logits, read one request at a time: each kept row scores the sampled token as vLLM's
    reported mu does (a row one call off would not), and at float32 the whole distribution is the trainer's."""
    from trustscope.parity import run_parity, summary

    s = summary(run_parity(toy_model_dir, ["1+2=", "3+4=", "5+1="], engine="vllm", n=2, max_tokens=6,
                           full_positions=64))
    f = s["full_distribution"]
    assert f["positions"] == s["tokens"] and f["sampled_gap_max"] < 1e-4
    assert f["tv_max"] < 1e-4


def test_explain_reads_the_numerics_floor_parity_measured(toy_model_dir, tmp_path):
    """A parity run logged beside a training run: ``trustscope explain`` names its floor (the sampled tokens' mean
    |log pi - log mu|, the whole distributions' TV and KL) in its text and JSON."""
    from trustscope.explain.analysis import explain
    from trustscope.explain.render import text, to_json
    from trustscope.parity import log_parity, run_parity

    result = run_parity(toy_model_dir, ["1+2=", "3+4="], engine="hf", engine_dtype="bfloat16", n=2, max_tokens=6,
                        full_positions=32)
    log_parity(result, tmp_path, "floor")
    e = explain(tmp_path, replicates=0)
    [par] = e.parity
    assert par["run_id"] == "floor" and par["engine_dtype"] == "bfloat16" and par["full_tv_mean"] > 0
    assert par["mean_abs_log_ratio"] == pytest.approx(float(np.abs(result.diff).mean()))
    assert "numerics floor (trustscope parity, run floor" in text(e)
    assert '"full_tv_mean"' in to_json(e)
