"""The SQL macros and views agree with trustscope.divergence and trustscope.losses, token for token."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trustscope import db as tsdb
from trustscope import divergence as D
from trustscope.losses import PolicyBatch, get_loss, list_losses
from trustscope.synthetic import SyntheticConfig, generate_run

KEY = ["run_id", "step", "sample_id", "pos"]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("parity")
    cfg = SyntheticConfig(tokens=30_000, steps=3, mean_length=48, rows_per_file=8_000, edge_cases=True,
                          loss_rule="dppo_binary_tv", drift=0.3, seed=7)
    generate_run(logdir, "run0", cfg)
    tokens = pq.read_table(logdir / "run0" / "tokens").sort_by([(k, "ascending") for k in KEY])
    db = tsdb.connect(logdir, cache_dir=tmp_path_factory.mktemp("cache"))
    yield logdir, tokens, db
    db.close()


def _batch(tokens, dtype=torch.float64) -> PolicyBatch:
    def col(name):
        return torch.from_numpy(tokens.column(name).to_numpy().astype(np.float32)).to(dtype)[None]  # (1, N)

    def lists(name):
        k = len(tokens.column(name)[0])
        flat = tokens.column(name).combine_chunks().flatten().to_numpy().astype(np.float32)
        return torch.from_numpy(flat.reshape(-1, k)).to(dtype)[None]  # (1, N, K)

    return PolicyBatch(
        pi_logprob=col("pi_logprob"), mu_logprob=col("mu_logprob"), advantages=col("advantage"),
        mask=torch.ones(1, tokens.num_rows, dtype=torch.bool), old_logprob=col("old_logprob"),
        mu_topk_logprobs=lists("mu_topk_logprobs"), pi_topk_logprobs=lists("pi_topk_logprobs"),
    )


def _sql(db, query: str):
    cur = db.cursor()
    try:
        return cur.sql(query).to_df()
    finally:
        cur.close()


def test_log_covers_the_edge_cases(log):
    _, tokens, _ = log
    adv = tokens.column("advantage").to_numpy()
    mu = np.exp(tokens.column("mu_logprob").to_numpy().astype(np.float64))
    assert tokens.num_rows > 20_000
    assert (adv == 0).sum() > 100 and (adv > 0).sum() > 100 and (adv < 0).sum() > 100
    assert (mu < 1e-6).any() and (mu > 0.999).any() and (mu == 1.0).any()
    pi = np.exp(tokens.column("pi_logprob").to_numpy().astype(np.float64))
    assert np.isclose(np.abs(pi - mu), 0.15, atol=1e-6).sum() >= 6  # binary TV exactly at delta_TV
    assert np.isclose(mu - pi, 0.5, atol=1e-6).sum() >= 3  # minimal negative mask exactly at delta


def test_rule_blocks_view_matches_every_torch_rule(log):
    """rule_blocks (stored top-K scalars, precomputed ratio) against each rule's keep-mask in float64."""
    _, tokens, db = log
    blocks = _sql(db, "select * from rule_blocks order by run_id, step, sample_id, pos")
    assert len(blocks) == tokens.num_rows
    batch = _batch(tokens)
    stored_tv = tokens.column("topk_tv").to_numpy().astype(np.float64)
    stored_kl = tokens.column("topk_kl").to_numpy().astype(np.float64)
    checked = 0
    for name in list_losses():
        torch_blocked = (~get_loss(name)(batch).keep[0]).numpy()
        sql_blocked = blocks[f"blocks_{name}"].to_numpy()
        differ = torch_blocked != sql_blocked
        if name in ("dppo_topk_tv", "dppo_topk_kl"):
            # The view gates on the float32 scalars stored at capture; torch recomputes from the lists.
            stored, delta = (stored_tv if name.endswith("tv") else stored_kl), get_loss(name).defaults["delta"]
            differ &= np.abs(stored - delta) > 1e-5
        assert not differ.any(), f"{name}: {differ.sum()} token(s) differ, e.g. rows {np.flatnonzero(differ)[:5]}"
        assert name in ("pg_is", "cispo") or torch_blocked.any(), f"{name} blocks nothing on the test log"
        checked += 1
    assert checked == len(list_losses()) >= 13


def test_rule_macros_match_torch_on_the_list_columns(log):
    """The per-rule macros from logprobs and top-K lists (no stored scalar), against torch, exactly."""
    _, tokens, db = log
    q = """
        select
            ppo_clip_blocks(pi_logprob, mu_logprob, advantage, rule_param('ppo_clip', 'eps_low'),
                            rule_param('ppo_clip', 'eps_high')) as ppo_clip,
            ppo_clip_blocks(pi_logprob, mu_logprob, advantage, rule_param('grpo', 'eps_low'),
                            rule_param('grpo', 'eps_high')) as grpo,
            minirl_blocks(pi_logprob, old_logprob, advantage, 0.2, 0.28) as minirl,
            dppo_blocks('binary_tv', binary_tv(mu_logprob, pi_logprob), binary_kl(mu_logprob, pi_logprob),
                        null, null, pi_logprob, mu_logprob, advantage, 0.15) as dppo_binary_tv,
            dppo_blocks('binary_kl', binary_tv(mu_logprob, pi_logprob), binary_kl(mu_logprob, pi_logprob),
                        null, null, pi_logprob, mu_logprob, advantage, 0.05) as dppo_binary_kl,
            dppo_blocks('topk_tv', null, null, topk_tv(mu_topk_logprobs, pi_topk_logprobs),
                        topk_kl(mu_topk_logprobs, pi_topk_logprobs), pi_logprob, mu_logprob, advantage, 0.15)
                as dppo_topk_tv,
            dppo_blocks('topk_kl', null, null, topk_tv(mu_topk_logprobs, pi_topk_logprobs),
                        topk_kl(mu_topk_logprobs, pi_topk_logprobs), pi_logprob, mu_logprob, advantage, 0.05)
                as dppo_topk_kl,
            dppo_decoupled_blocks('binary_kl', pi_logprob, old_logprob, advantage, 0.05) as dppo_decoupled,
            ppo_lowprob_relax_blocks(pi_logprob, mu_logprob, advantage, 0.2, 0.28, 0.1, 0.1) as ppo_lowprob_relax,
            minimal_negative_mask_blocks(pi_logprob, mu_logprob, advantage, 0.5) as minimal_negative_mask
        from tokens
        order by run_id, step, sample_id, pos
    """
    got = _sql(db, q)
    batch = _batch(tokens)
    for name in got.columns:
        rule = get_loss(name)
        for key, value in rule.defaults.items():  # the literals above are the registered defaults
            if key in ("delta", "eps_low", "eps_high", "alpha_low", "alpha_high") and name not in ("ppo_clip", "grpo"):
                assert str(value) in q, f"{name}.{key}={value} not used in the query"
        torch_blocked = (~rule(batch).keep[0]).numpy()
        differ = torch_blocked != got[name].to_numpy()
        assert not differ.any(), f"{name}: {differ.sum()} token(s) differ"


def test_divergence_macros_match_torch(log):
    _, tokens, db = log
    got = _sql(db, """
        select ratio(pi_logprob, mu_logprob) as ratio,
               binary_tv(mu_logprob, pi_logprob) as binary_tv,
               binary_kl(mu_logprob, pi_logprob) as binary_kl,
               topk_tv(mu_topk_logprobs, pi_topk_logprobs) as topk_tv,
               topk_kl(mu_topk_logprobs, pi_topk_logprobs) as topk_kl
        from tokens order by run_id, step, sample_id, pos
    """)
    b = _batch(tokens)
    mu, pi = b.mu_logprob[0], b.pi_logprob[0]
    expected = {
        "ratio": D.ratio(pi, mu),
        "binary_tv": D.binary_tv(mu, pi),
        "binary_kl": D.binary_kl(mu, pi),
        "topk_tv": D.topk_tv(b.mu_topk_logprobs[0], b.pi_topk_logprobs[0]),
        "topk_kl": D.topk_kl(b.mu_topk_logprobs[0], b.pi_topk_logprobs[0]),
    }
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name].to_numpy(), ref.numpy(), rtol=1e-7, atol=1e-9, err_msg=name)


def test_stored_topk_scalars_match_the_list_macros(log):
    """The capture-time float32 topk_tv/topk_kl the views read agree with the list macros.

    KL is compared where both 'other' buckets exceed 1e-3: float32's ``1 - sum`` has an absolute error near 1e-7,
    so the bucket's log term loses digits at capture time as the bucket shrinks (1e-12 floor at the end).
    """
    _, _, db = log
    got = _sql(db, """
        select max(abs(topk_tv - topk_tv(mu_topk_logprobs, pi_topk_logprobs))) as tv_err,
               max(abs(topk_kl - topk_kl(mu_topk_logprobs, pi_topk_logprobs)))
                   filter (where topk_rest(mu_topk_logprobs) > 1e-3 and topk_rest(pi_topk_logprobs) > 1e-3)
                   as kl_err
        from tokens
    """)
    assert got.tv_err[0] < 1e-5 and got.kl_err[0] < 1e-4


def test_trainer_kept_mask_matches_the_view_for_its_rule(log):
    """``kept`` was written by the float32 rule at capture; the view's counterfactual for that rule agrees
    except on hand-made tokens that sit exactly on a threshold (float32 vs float64 rounding)."""
    _, _, db = log
    got = _sql(db, """
        select count(*) as n, count_if(kept = blocks_dppo_binary_tv) as differ,
               count_if(kept = blocks_dppo_binary_tv and prompt_id >= 0) as differ_random
        from rule_blocks
        where loss_rule = 'dppo_binary_tv'
    """)
    assert got.n[0] > 20_000
    assert got.differ_random[0] == 0
    assert got.differ[0] <= 10
