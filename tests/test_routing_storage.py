"""Routed experts at production shapes: the logger keeps per-token figures of every token and the full expert lists
on a sampled share of the rows (and on every faulty row); every routing figure trustscope shows stays exact at any
token fraction through the summaries, equal to a recount from the full lists; the replay health checks (replace
rate, fallbacks, shifted and reused buffers) name their rows; bad routing is refused at the call naming the field,
the row and the shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trustscope.logger import TokenLogger
from trustscope.logger.experts import FAULTS, default_fraction

SHAPE = (6, 4, 32)  # MoE layers, top-k, experts


def random_routing(rng: np.random.Generator, lead: tuple[int, ...], shape: tuple[int, int, int] = SHAPE
                   ) -> np.ndarray:
    """``(*lead, L, k)`` int16: k distinct experts a layer, uniformly at random."""
    layers, k, experts = shape
    return np.argsort(rng.random((*lead, layers, experts)), -1)[..., :k].astype(np.int16)


def perturbed(rng: np.random.Generator, experts_: np.ndarray, share: float, experts: int = SHAPE[2]) -> np.ndarray:
    """``experts_`` with each (layer, slot) choice replaced by ``share`` by an expert outside the layer's set."""
    out = experts_.copy()
    flat = out.reshape(-1, out.shape[-1])  # (rows, k)
    for row, slot in zip(*np.nonzero(rng.random(flat.shape) < share), strict=True):
        free = np.setdiff1d(np.arange(experts), flat[row])
        flat[row, slot] = rng.choice(free)
    return out


def step_tokens(rng: np.random.Generator, b: int, t: int) -> dict:
    mu = -rng.random((b, t)).astype(np.float32) - 0.05
    return {"token_id": rng.integers(0, 50, (b, t)), "mu_logprob": mu,
            "pi_logprob": np.minimum(mu + rng.normal(0, 0.3, (b, t)).astype(np.float32), 0.0),
            "advantage": np.repeat(rng.choice([-1.0, 1.0], b)[:, None], t, 1).astype(np.float32),
            "prompt_id": np.arange(b) // 2}


def log_run(tmp_path, run_id: str, steps: list[dict], **options) -> None:
    with TokenLogger(tmp_path, run_id, routing_shape=SHAPE, loss_rule="ppo_clip", **options) as logger:
        for step, tokens in enumerate(steps):
            logger.log_step(step, tokens=tokens)


def test_default_share_of_full_lists_follows_the_shape():
    assert default_fraction((4, 2, 8)) == 1.0  # the toy MoE keeps every list, as before
    assert default_fraction((48, 8, 128)) == pytest.approx(16 / 672)  # Qwen3-30B-A3B: 336 bytes a side
    assert default_fraction((58, 8, 256)) == pytest.approx(16 / 928)  # DeepSeek-V3: 464 bytes a side


def test_every_routing_figure_is_exact_at_any_fraction(tmp_path):
    """A run logged at token_fraction 0.3 with lists on 30% of those rows shows the figures a full log recounts: the
    summaries' agreement (overall, by layer, by position), |log pi/mu| by agreement, by first differing layer and
    by position, and the rules' blocks by agreement, against numpy on the full lists and against the same run
    logged in full without summaries (the token-row path old logs take)."""
    from trustscope import report_where
    from trustscope.columns import position_bucket
    from trustscope.db import connect

    rng = np.random.default_rng(0)
    b, t = 16, 16
    steps, engines, trainers = [], [], []
    for _ in range(3):
        tokens = step_tokens(rng, b, t)
        engine = random_routing(rng, (b, t))
        trainer = perturbed(rng, engine, 0.02)
        tokens |= {"engine_experts": engine, "trainer_experts": trainer}
        steps.append(tokens)
        engines.append(engine)
        trainers.append(trainer)
    log_run(tmp_path, "sampled", steps, token_fraction=0.3, routing_fraction=0.3)
    log_run(tmp_path, "full", steps, summaries=False, routing_fraction=1.0)

    engine, trainer = np.concatenate(engines), np.concatenate(trainers)  # (S * B, T, L, k)
    hit = (engine[..., :, None] == trainer[..., None, :]).any(-1)  # (S * B, T, L, k)
    per_layer = hit.mean(-1).reshape(-1, SHAPE[0])  # (N, L)
    layer_full = hit.all(-1).reshape(-1, SHAPE[0])
    full = layer_full.all(-1)
    first = np.where(full, -1, np.argmin(layer_full, -1))
    mu = np.concatenate([s["mu_logprob"] for s in steps]).reshape(-1).astype(np.float64)
    pi = np.concatenate([s["pi_logprob"] for s in steps]).reshape(-1).astype(np.float64)
    d = np.abs(pi - mu)
    buckets = position_bucket(np.tile(np.arange(t), 3 * b))
    assert full.any() and not full.all()

    with connect(tmp_path, cache=False) as db:
        mismatch, blocked, exact = report_where.by_routing(db)
        by_dim, _by_dim_blocked = report_where.by_dimension(db)
        lists = db.sql("select run_id, count(*) as n, count(engine_experts) as n_lists, "
                       "count(routing_first_layer) as n_first from tokens group by run_id").to_pandas()
    lists = lists.set_index("run_id")
    assert lists.loc["full", "n_lists"] == 3 * b * t
    assert lists.loc["sampled", "n_first"] == lists.loc["sampled", "n"] < 0.6 * 3 * b * t
    assert 0 < lists.loc["sampled", "n_lists"] < 0.7 * lists.loc["sampled", "n"]

    mine = exact[exact["run_id"] == "sampled"]
    whole = mine[mine["dimension"] == "all"]
    assert mine["replace_rate"].isna().all()  # no router's own pick logged: no replace rate
    assert not any("routing replay replaced" in line for line in report_where.routing_lines(
        mismatch, blocked, ["sampled"], {"sampled": "ppo_clip"}, exact))
    assert whole["n_tokens"].iloc[0] == full.size and whole["agreement"].iloc[0] == pytest.approx(per_layer.mean())
    np.testing.assert_allclose(mine[mine["dimension"] == "layer"]["agreement"], per_layer.mean(0), rtol=1e-6)
    by_pos = mine[mine["dimension"] == "position"].set_index("bucket")
    for bucket in np.unique(buckets):
        assert by_pos.loc[bucket, "agreement"] == pytest.approx(per_layer[buckets == bucket].mean(), rel=1e-6)

    for run in ("sampled", "full"):
        rows = mismatch[mismatch["run_id"] == run]
        agree = rows[rows["split"] == "agreement"].set_index("bucket")
        assert agree.loc[0, "n_tokens"] == full.sum() and agree.loc[1, "n_disagree"] == (~full).sum()
        assert agree.loc[0, "mean_abs"] == pytest.approx(d[full].mean(), rel=1e-5)
        assert agree.loc[1, "abs_share"] == pytest.approx(d[~full].sum() / d.sum(), rel=1e-5)
        layers = rows[rows["split"] == "first_layer"].set_index("bucket")
        assert sorted(layers.index) == sorted(np.unique(first))
        for layer in np.unique(first):
            assert layers.loc[layer, "n_tokens"] == (first == layer).sum()
            assert layers.loc[layer, "mean_abs"] == pytest.approx(d[first == layer].mean(), rel=1e-5)
        pos = rows[rows["split"] == "position"].set_index("bucket")
        for bucket in np.unique(buckets):
            sel = buckets == bucket
            assert pos.loc[bucket, "n_tokens"] == sel.sum()
            assert pos.loc[bucket, "n_disagree"] == (~full[sel]).sum()
            if (sel & ~full).any():
                assert pos.loc[bucket, "mean_abs_disagree"] == pytest.approx(d[sel & ~full].mean(), rel=1e-5)
    keys = ["dimension", "bucket"]  # the generic dimension pages: the summaries' routing rows = the token rows'
    ours, rows = (by_dim[(by_dim.run_id == run) & (by_dim.dimension == "routing")].drop(columns="run_id")
                  .set_index(keys).sort_index() for run in ("sampled", "full"))
    assert ours.index.equals(rows.index) and sorted(ours.index.get_level_values(1)) == sorted(np.unique(first))
    assert (ours["n_tokens"] == rows["n_tokens"]).all() and ours["n_tokens"].sum() == full.size
    np.testing.assert_allclose(ours["mismatch_mean"], rows["mismatch_mean"], rtol=1e-6)
    both = blocked.set_index(["run_id", "rule", "agreement"])
    for rule in ("ppo_clip", "dppo_binary_tv"):
        for side in ("full agreement", "disagreement"):
            assert both.loc[("sampled", rule, side), "n_blocked"] == both.loc[("full", rule, side), "n_blocked"]
            assert (both.loc[("sampled", rule, side), "n_nonzero_advantage"]
                    == both.loc[("full", rule, side), "n_nonzero_advantage"]
                    == (full if side == "full agreement" else ~full).sum())


def replay_step(rng: np.random.Generator, b: int, t: int, corrupt: bool) -> tuple[dict, np.ndarray]:
    """One step of a replayed run: the router's own pick, the engine's experts 5% away from it; ``corrupt``:
    response 2's engine buffer shifted by one position, response 4 given response 3's buffer, response 5's
    positions 3 and 4 without engine routing (-1). Returns the tokens and the (B, T) rows expected faulty."""
    tokens = step_tokens(rng, b, t)
    own = random_routing(rng, (b, t + 1))  # one more position: the shifted buffer reads the next one
    engine = perturbed(rng, own, 0.05)[:, :t]
    own = own[:, :t]
    fault = np.zeros((b, t), np.int8)
    if corrupt:
        engine[2] = np.concatenate([own[2, 1:], random_routing(rng, (1,))])  # position t gets t + 1's
        engine[4] = engine[3]
        engine[5, 3:5] = -1
        fault[2] |= FAULTS["shifted"]
        fault[3:5] |= FAULTS["reused"]
        fault[5, 3:5] |= FAULTS["fallback"]
    trainer = np.where(engine >= 0, engine, own)  # the experts the replayed forward used
    return tokens | {"engine_experts": engine, "trainer_experts": trainer, "router_experts": own}, fault


def test_replay_health_names_shifted_reused_and_missing_buffers(tmp_path):
    """Corrupted replay buffers (shifted by one position, reused across two responses, two positions without
    engine routing) get their routing_fault bits on exactly those rows, their lists kept, and the doctor checks
    name them; the replace rate by layer and step equals a recount from the router's own pick; a clean run
    passes every check; the trackers' step scalars carry the figures."""
    from trustscope import doctor as D
    from trustscope import report_where, trackers
    from trustscope.db import connect

    rng = np.random.default_rng(1)
    b, t = 8, 10
    clean = [replay_step(rng, b, t, False) for _ in range(2)]
    corrupted = [replay_step(rng, b, t, s == 1) for s in range(2)]
    for run, steps in (("clean", clean), ("corrupted", corrupted)):
        log_run(tmp_path, run, [tokens for tokens, _ in steps], routing_replay=True, routing_fraction=0.2)
    with connect(tmp_path, cache=False) as db:
        found = {run: {f.check: f for f in fs} for run, fs in D.diagnose(db).items()}
        rows = db.sql("select step, sample_id, pos, routing_fault, engine_experts, routing_replaced from tokens "
                      "where run_id = 'corrupted' order by step, sample_id, pos").to_pandas()
        summaries = db.sql("select * from summaries where run_id = 'corrupted'").to_pandas()
        mismatch, blocked, exact = report_where.by_routing(db)
    want = np.concatenate([f.reshape(-1) for _, f in corrupted])
    np.testing.assert_array_equal(rows["routing_fault"].to_numpy(), want)
    missing = (want & FAULTS["fallback"]) != 0
    assert rows.loc[(want != 0) & ~missing, "engine_experts"].notna().all()  # a faulty row keeps its lists
    assert rows.loc[missing, "engine_experts"].isna().all() and rows.loc[missing, "routing_replaced"].isna().all()

    own = np.concatenate([s[0]["router_experts"] for s in corrupted]).reshape(-1, *SHAPE[:2])
    engine = np.concatenate([s[0]["engine_experts"] for s in corrupted]).reshape(-1, *SHAPE[:2])
    ok = engine[:, 0, 0] >= 0
    kept = (own[..., :, None] == engine[..., None, :]).any(-1)  # (N, L, k): the router's choice stayed
    rate = 1 - kept[ok].mean()
    for run in ("clean", "corrupted"):
        assert found[run]["routing_replace_rate"].verdict == "ok"
    check = found["corrupted"]["routing_replace_rate"]
    assert check.evidence["replace_rate"] == pytest.approx(rate, rel=1e-6)
    for layer in range(SHAPE[0]):
        assert check.evidence[f"replace_rate_layer{layer}"] == pytest.approx(1 - kept[ok][:, layer].mean(), rel=1e-6)
    mine = exact[(exact["run_id"] == "corrupted") & exact["dimension"].isin(["all", "layer"])].set_index("label")
    assert mine.loc["all", "replace_rate"] == pytest.approx(rate, rel=1e-6)  # the report's and the page's figure
    for layer in range(SHAPE[0]):
        assert mine.loc[f"layer {layer}", "replace_rate"] == pytest.approx(1 - kept[ok][:, layer].mean(), rel=1e-6)
    lines = report_where.routing_lines(mismatch, blocked, ["corrupted"], {"corrupted": "ppo_clip"}, exact)
    assert sum(line.startswith(f"  routing replay replaced {rate:.2%} of the router's own choices; by layer: 0: ")
               for line in lines) == 1, lines
    step_rates = summaries[(summaries["metric"] == "routing_replaced") & summaries["dimension"].isna()]
    for step, part in step_rates.groupby("step"):
        sel = (np.arange(len(ok)) // (b * t) == step) & ok
        assert part["sum"].sum() / part["count"].sum() == pytest.approx(1 - kept[sel].mean(), rel=1e-6)

    for name in ("routing_fallbacks", "routing_alignment"):
        assert found["clean"][name].verdict == "ok", found["clean"][name].summary
    fallbacks = found["corrupted"]["routing_fallbacks"]
    assert fallbacks.verdict == "fail" and fallbacks.evidence["n_fallback"] == 2
    assert [(e["step"], e["sample_id"], e["pos"]) for e in fallbacks.examples] == [(1, 5, 3), (1, 5, 4)]
    align = found["corrupted"]["routing_alignment"]
    assert align.verdict == "fail" and align.evidence["n_shifted"] == t and align.evidence["n_reused"] == 2 * t
    assert align.evidence["n_responses_shifted"] == 1 and align.evidence["n_responses_reused"] == 2
    assert {e["sample_id"] for e in align.examples} <= {2, 3, 4}

    last = summaries[summaries["step"] == 1].astype(object)
    metrics = trackers.step_metrics(last.where(last.notna(), None).to_dict("records"))
    assert metrics["trustscope/routing_fallback_count"] == 2
    assert metrics["trustscope/routing_shifted_count"] == t
    assert metrics["trustscope/routing_reused_count"] == 2 * t
    assert metrics["trustscope/routing_replaced/mean"] == pytest.approx(1 - kept[(np.arange(len(ok)) >= b * t) & ok]
                                                                        .mean(), rel=1e-6)


def test_bad_routing_is_refused_naming_field_row_and_shapes(tmp_path):
    from trustscope.logger import SchemaError

    rng = np.random.default_rng(2)
    b, t = 3, 5
    with pytest.raises(ValueError, match=r"routing_shape.*32767"):
        TokenLogger(tmp_path, "huge", routing_shape=(4, 2, 40000))  # ids beyond the int16 lists: at construction
    with pytest.raises(ValueError, match="routing_fraction must be in"):
        TokenLogger(tmp_path, "frac", routing_shape=SHAPE, routing_fraction=0.0)
    with TokenLogger(tmp_path, "bad", routing_shape=SHAPE) as logger:
        tokens = step_tokens(rng, b, t)
        engine = random_routing(rng, (b, t))
        with pytest.raises(SchemaError, match=r"tokens\['engine_experts'\] must have shape \(B, T, L, k\) = "
                                              r"\(3, 5, MoE layers, top-k\), got \(3, 4, 6, 4\)"):
            logger.log_step(0, tokens=tokens | {"engine_experts": engine[:, :4]})
        with pytest.raises(SchemaError, match=r"has shape \(15, 6, 3\).*routes \(N, 6, 4\) of 32 experts"):
            logger.log_step(0, tokens=tokens | {"engine_experts": engine[..., :3]})
        wrong = engine.copy()
        wrong[1, 2, 4, 1] = 32
        with pytest.raises(SchemaError, match=r"expert id 32 at sample_id 1, pos 2, MoE layer 4, slot 1 is out of "
                                              r"range \[0, 32\)"):
            logger.log_step(0, tokens=tokens | {"trainer_experts": wrong})
        partial = engine.copy()
        partial[2, 0, 0, 0] = -1  # a -1 in a row that has routing: not a fallback
        with pytest.raises(SchemaError, match="expert id -1 at sample_id 2, pos 0"):
            logger.log_step(0, tokens=tokens | {"engine_experts": partial})
        ragged = {name: [v[i] for i in range(b)] for name, v in tokens.items() if name != "prompt_id"}
        short = [engine[i] for i in range(b)]
        short[1] = short[1][:3]  # a replay buffer shorter than its response
        with pytest.raises(SchemaError, match=r"tokens\['engine_experts'\]\[1\] has shape \(3, 6, 4\), but "
                                              r"tokens\['token_id'\]\[1\] has length 5"):
            logger.log_step(0, tokens=ragged | {"engine_experts": short, "prompt_id": tokens["prompt_id"]})
        logger.log_step(0, tokens=tokens | {"engine_experts": engine})  # nothing logged before is lost
    info = json.loads((tmp_path / "bad" / "run.json").read_text())
    assert info["routing_fraction"] == pytest.approx(default_fraction(SHAPE))


def test_short_responses_of_a_small_model_whose_experts_match_by_chance_are_not_a_reused_buffer():
    """Two two-token answers of a four-expert, top-2, two-layer model (10.3 bits of routing each) routed alike
    after other first tokens: a coincidence, not flagged; the same responses at ten tokens (52 bits) are."""
    from trustscope.logger.experts import REUSED_MIN_BITS, _reused

    bits = 2 * np.log2(6)  # two layers, C(4, 2) choices each
    assert bits < REUSED_MIN_BITS < 10 * bits
    one = np.asarray([[[0, 1], [2, 3]]], np.int16)  # (1, L, k)
    for length, flagged in ((2, False), (10, True)):
        engine = np.concatenate([np.repeat(one, length, 0)] * 2)  # two responses, the same experts throughout
        sid = np.repeat([0, 1], length)
        token_id = np.concatenate([np.arange(length), np.arange(length) + 100])  # their tokens differ
        out = _reused(engine, np.ones(2 * length, bool), sid, token_id, bits)
        assert bool(out.any()) == flagged, length
