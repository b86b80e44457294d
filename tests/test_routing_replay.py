"""Routing replay (R3) on the trainer's side and its health check: the router hooks force the given experts with the
router's own weights at them, positions given -1 keep the router's choice, the trainer's forward then matches the
engine's routing exactly; a corrupted replay buffer leaves disagreement, which ``trustscope doctor`` fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trustscope.routing import RouterReplay, TrainerRouting, agreement, padded_routing


def tiny_moe(layers: int = 2, experts: int = 8, top_k: int = 2):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


def own_routing(model, ids):
    tracker = TrainerRouting(model)
    with torch.no_grad(), tracker.hooked():
        logits = model(input_ids=ids).logits
    return tracker.take(*ids.shape), logits


def engine_like(own: np.ndarray, rng: np.random.Generator, share: float, experts: int) -> np.ndarray:
    """The trainer's routing with ``share`` of the positions' first slot moved to another expert (an engine whose
    routers flipped there)."""
    out = own.copy()
    b, s, layers, _ = own.shape
    flip = rng.random((b, s, layers)) < share
    for i, j, layer in zip(*np.nonzero(flip), strict=True):
        free = [e for e in range(experts) if e not in out[i, j, layer]]
        out[i, j, layer, 0] = rng.choice(free)
    return out


def test_replay_forces_the_given_experts_with_the_routers_weights_and_gradients():
    model = tiny_moe()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(1, 40, (3, 7)))
    own, logits = own_routing(model, ids)
    given = engine_like(own, rng, 0.3, 8)
    given[0, :2] = -1  # columns the engine did not run keep the router's own choice
    replay = RouterReplay(model)
    with replay.replayed(torch.from_numpy(given).long()) as tracker:
        out = model(input_ids=ids).logits
    used = tracker.take(*ids.shape)
    np.testing.assert_array_equal(used[0, :2], own[0, :2])
    np.testing.assert_array_equal(used[given >= 0].reshape(-1), given[given >= 0].reshape(-1))
    flipped = (given[..., 0] != own[..., 0]) & (given[..., 0] >= 0)
    assert flipped.any() and replay.replaced == pytest.approx(flipped.sum() / ((given >= 0).all(-1).sum() * 2))
    assert not torch.allclose(out, logits)  # other experts, another output
    out[..., 3].sum().backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.model.layers)
    with replay.replayed(torch.from_numpy(own).long()):  # replaying its own choices changes nothing
        same = model(input_ids=ids).logits
    torch.testing.assert_close(same, logits, rtol=1e-5, atol=1e-5)


def test_padded_routing_lays_rows_out_like_left_padded_prompts():
    rows = [np.full((4, 2, 2), 1, np.int16), np.full((2, 2, 2), 2, np.int16)]  # prompts of 3 and 1 tokens
    out = padded_routing(rows, [3, 1], prompt_len=3, width=5)
    assert out.shape == (2, 5, 2, 2)
    assert (out[0, :4] == 1).all() and (out[0, 4] == -1).all()
    assert (out[1, :2] == -1).all() and (out[1, 2:4] == 2).all() and (out[1, 4] == -1).all()


def replayed_log(tmp_path, run_id: str, corrupt: bool, replayed: bool = True) -> None:
    """A replayed step as the trainer logs it: the engine's experts, and the experts the replayed forward used,
    from a buffer that is the engine's (or, ``corrupt``, the engine's one position off)."""
    from trustscope.logger import TokenLogger

    model = tiny_moe()
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(1, 40, (4, 12)))
    own, _ = own_routing(model, ids)
    engine = engine_like(own, rng, 0.2, 8)
    buffer = np.roll(engine, 1, axis=1) if corrupt else engine
    with torch.no_grad(), RouterReplay(model).replayed(torch.from_numpy(buffer).long()) as tracker:
        lp = model(input_ids=ids).logits.log_softmax(-1)
    used = tracker.take(*ids.shape)
    p = 4  # columns 3 .. 10 predict the response tokens 4 .. 11
    tok = ids[:, p:]
    pi = lp[:, p - 1: -1].gather(-1, tok[..., None])[..., 0]
    with TokenLogger(tmp_path, run_id, routing_shape=(2, 2, 8), routing_replay=replayed) as logger:
        logger.log_step(0, tokens={"token_id": tok, "mu_logprob": pi, "pi_logprob": pi,
                                   "engine_experts": engine[:, p - 1: -1], "trainer_experts": used[:, p - 1: -1]},
                        samples={"prompt_id": np.arange(4), "advantage": np.zeros(4, np.float32)})


def test_doctor_fails_a_replayed_run_whose_replay_buffer_is_corrupted(tmp_path):
    from trustscope import doctor as D
    from trustscope.db import connect

    replayed_log(tmp_path, "clean", corrupt=False)
    replayed_log(tmp_path, "corrupted", corrupt=True)
    replayed_log(tmp_path, "undeclared", corrupt=True, replayed=False)
    with connect(tmp_path, cache=False) as db:
        found = {run: {f.check: f for f in fs}["routing_replay"] for run, fs in D.diagnose(db).items()}
        recount = db.sql("select run_id, count_if(routing_agreement < 1) as n, 1 - avg(routing_agreement) as share "
                         "from tokens group by run_id").to_pandas().set_index("run_id")
    assert found["clean"].verdict == "ok" and found["clean"].evidence["n_disagree"] == 0
    bad = found["corrupted"]
    assert bad.verdict == "fail" and bad.evidence["n_disagree"] == recount.loc["corrupted", "n"] > 0
    assert bad.evidence["choice_disagreement"] == pytest.approx(recount.loc["corrupted", "share"])
    assert f"{bad.evidence['n_disagree']} of 32 routed tokens" in bad.summary
    assert len(bad.examples) == 3 and all(e["routing_agreement"] < 1 for e in bad.examples)
    assert {"step", "sample_id", "pos", "engine_experts", "trainer_experts"} <= set(bad.examples[0])
    assert found["undeclared"].verdict == "skipped" and "not declared replayed" in found["undeclared"].summary


def test_replay_declared_for_a_dense_model_is_refused(tmp_path):
    from trustscope.logger import TokenLogger

    with pytest.raises(ValueError, match="routing_replay=True needs routing_shape"):
        TokenLogger(tmp_path, "dense", routing_replay=True)


def test_agreement_of_the_replayed_forward_is_full():
    model = tiny_moe()
    rng = np.random.default_rng(2)
    ids = torch.from_numpy(rng.integers(1, 40, (2, 5)))
    engine = engine_like(own_routing(model, ids)[0], rng, 0.5, 8)
    with torch.no_grad(), RouterReplay(model).replayed(torch.from_numpy(engine).long()) as tracker:
        model(input_ids=ids)
    used = tracker.take(*ids.shape).reshape(-1, 2, 2)
    assert agreement(engine.reshape(-1, 2, 2), used)[0].min() == 1.0


def test_routing_analysis_equals_a_recount_from_every_token(tmp_path):
    """The routing_mismatch and routing_blocked queries (the page's section, the report's lines) against numpy on
    the same tokens: |log pi/mu| by agreement, by first differing layer and by position, blocks by agreement."""
    from trustscope import report_where
    from trustscope.columns import position_bucket
    from trustscope.db import connect
    from trustscope.logger import TokenLogger

    rng = np.random.default_rng(5)
    b, t, layers, k = 6, 9, 3, 2
    engine = np.stack([rng.permutation(8)[:k] for _ in range(b * t * layers)]).reshape(b, t, layers, k)
    trainer = engine.copy()
    flip = rng.random((b, t, layers)) < 0.15
    trainer[..., 0][flip] = (engine[..., 0][flip] + 1 + rng.integers(0, 6, flip.sum())) % 8
    trainer[..., 0] = np.where((trainer[..., 0] == trainer[..., 1]) & flip, (trainer[..., 1] + 1) % 8,
                               trainer[..., 0])
    mu = -rng.random((b, t)).astype(np.float32) - 0.05
    pi = mu + rng.normal(0, 0.3, (b, t)).astype(np.float32) * (1 + 3 * flip.any(-1))
    pi = np.minimum(pi, 0.0)
    adv = np.repeat(rng.choice([-1.0, 1.0], b)[:, None], t, 1).astype(np.float32)
    with TokenLogger(tmp_path, "moe", routing_shape=(layers, k, 8), loss_rule="ppo_clip") as logger:
        logger.log_step(0, tokens={"token_id": rng.integers(0, 20, (b, t)), "mu_logprob": mu, "pi_logprob": pi,
                                   "advantage": adv, "engine_experts": engine, "trainer_experts": trainer},
                        samples={"prompt_id": np.arange(b)})
    hit = (engine[..., :, None] == trainer[..., None, :]).any(-1).all(-1)  # (B, T, L): layer agrees
    full = hit.all(-1).reshape(-1)
    first = np.where(full, -1, np.argmin(hit, -1).reshape(-1))
    d = np.abs(pi.astype(np.float64) - mu.astype(np.float64)).reshape(-1)
    pos = np.tile(np.arange(t), b)
    with connect(tmp_path, cache=False) as db:
        mismatch, blocked, exact = report_where.by_routing(db, ["moe"])
        rows = db.sql("select sample_id, pos, blocks_ppo_clip from rule_blocks order by sample_id, pos").to_pandas()
    assert not full.all() and full.any()
    agree = mismatch[mismatch["split"] == "agreement"].set_index("bucket")
    assert agree.loc[0, "n_tokens"] == full.sum() and agree.loc[1, "n_disagree"] == (~full).sum()
    assert agree.loc[0, "mean_abs"] == pytest.approx(d[full].mean(), rel=1e-5)
    assert agree.loc[1, "abs_share"] == pytest.approx(d[~full].sum() / d.sum(), rel=1e-5)
    layer_rows = mismatch[mismatch["split"] == "first_layer"].set_index("bucket")
    for layer in np.unique(first):
        assert layer_rows.loc[layer, "n_tokens"] == (first == layer).sum()
        assert layer_rows.loc[layer, "mean_abs"] == pytest.approx(d[first == layer].mean(), rel=1e-5)
    buckets = position_bucket(pos)
    pos_rows = mismatch[mismatch["split"] == "position"].set_index("bucket")
    for bucket in np.unique(buckets):
        sel = buckets == bucket
        assert pos_rows.loc[bucket, "n_disagree"] == (~full[sel]).sum()
    blocks = rows["blocks_ppo_clip"].to_numpy()
    clip = blocked[blocked["rule"] == "ppo_clip"].set_index("agreement")
    assert clip.loc["disagreement", "n_blocked"] == blocks[~full].sum()
    assert clip.loc["full agreement", "n_nonzero_advantage"] == full.sum()
    per_layer = (engine[..., :, None] == trainer[..., None, :]).any(
        -1).mean(-1).reshape(-1, layers)  # (N, L): share of a layer's slots that agree
    whole = exact[exact["dimension"] == "all"]
    assert whole["n_tokens"].iloc[0] == full.size and whole["agreement"].iloc[0] == pytest.approx(per_layer.mean())
    np.testing.assert_allclose(exact[exact["dimension"] == "layer"]["agreement"], per_layer.mean(0), rtol=1e-6)
    lines = report_where.routing_lines(mismatch, blocked, ["moe", "dense"], {"moe": "ppo_clip"}, exact)
    assert lines[0].startswith(f"moe: {per_layer.mean():.2%} of (layer, slot) expert choices agree")
    assert lines[1].startswith(f"  token rows: {(~full).sum()} of {full.size} routed tokens")
    assert any(line.strip().startswith("ppo_clip blocks") for line in lines)
    assert "Run dense logs no routed experts" in lines[-1]
