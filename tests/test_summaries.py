"""The summaries table: exact per-step aggregates over every token, whatever token_fraction keeps."""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd
import pytest

from trustscope import db as tsdb
from trustscope import runformat as S
from trustscope.columns import DIMENSIONS, dimension, position_bucket
from trustscope.logger import TokenLogger
from trustscope.logger.summaries import HIST_EDGES, MU_BUCKET_SQL, MU_LOWS
from trustscope.losses import get_loss, list_losses

B, T, K, V = 32, 24, 4, 200


def rollout(seed: int) -> tuple[dict, np.ndarray, dict]:
    """A padded step with every kind of token: A > 0, A < 0, A = 0, mu over all buckets, pi far from mu at places."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) > 0.1
    mask[:, 0] = True
    mu_topk = -np.sort(rng.exponential(2.0, (B, T, K)).astype(np.float32), axis=-1)  # (B, T, K) descending
    mu_topk[..., 0] = np.log(rng.uniform(1e-4, 1.0, (B, T))).astype(np.float32)
    mu_topk = -np.sort(-mu_topk, axis=-1)
    shift = np.where(rng.random((B, T, K)) < 0.1, rng.normal(0, 1.0, (B, T, K)), rng.normal(0, 0.01, (B, T, K)))
    pi_topk = np.minimum(mu_topk + shift.astype(np.float32), 0)
    adv = rng.normal(size=B).astype(np.float32)
    adv[:4] = 0.0
    tokens = {
        "token_id": rng.integers(0, V, (B, T)),
        "mu_logprob": mu_topk[..., 0],
        "pi_logprob": pi_topk[..., 0],
        "old_logprob": np.minimum(mu_topk[..., 0] + rng.normal(0, 0.05, (B, T)).astype(np.float32), 0),
        "entropy": rng.exponential(1.0, (B, T)).astype(np.float32),
        "advantage": adv,
        "mu_topk_ids": rng.integers(0, V, (B, T, K)),
        "mu_topk_logprobs": mu_topk,
        "pi_topk_logprobs": pi_topk,
        "kept": rng.random((B, T)) > 0.2,
    }
    samples = {"sample_id": np.arange(B), "prompt_id": np.arange(B) // 4, "reward": rng.random(B)}
    return tokens, mask, samples


def log_run(logdir, run_id: str, fraction: float, steps: int = 3) -> None:
    with TokenLogger(logdir, run_id, token_fraction=fraction, flush_rows=1, loss_rule="dppo_binary_tv") as lg:
        for step in range(steps):
            tokens, mask, samples = rollout(step)
            half = B // 2  # two micro-batches per step
            for part in (slice(0, half), slice(half, B)):
                lg.log_step(step, tokens={k: v[part] for k, v in tokens.items()}, mask=mask[part],
                            samples={k: v[part] for k, v in samples.items()})


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("summaries")
    log_run(logdir, "full", 1.0)
    log_run(logdir, "tenth", 0.1)
    return logdir


@pytest.fixture(scope="module")
def db(logdir):
    with tsdb.connect(logdir) as conn:
        yield conn


def test_a_tenth_of_the_tokens_gives_the_same_summaries_exactly(db):
    full = db.summaries("full").drop(columns="run_id")
    tenth = db.summaries("tenth").drop(columns="run_id")
    assert len(full) > 100 and set(full.metric) >= {"tokens", "blocked", "bad_negative", "abs_prob_diff_hist"}
    pd.testing.assert_frame_equal(full.reset_index(drop=True), tenth.reset_index(drop=True), check_exact=True)
    assert db.step_summary("tenth").n_tokens.sum() < 0.3 * db.step_summary("full").n_tokens.sum()


def test_summaries_agree_with_the_sql_over_the_full_token_rows(db):
    """At token_fraction 1.0 the rows hold every token: the SQL's counts over them equal the summaries'."""
    summ = db.summaries("full")
    sql = db.step_summary("full").set_index("step")
    tokens = summ[summ.metric == "tokens"].groupby("step")["count"].sum()
    assert (tokens == sql.n_tokens).all()
    bad = summ[summ.metric == "bad_negative"].set_index("step")["count"]
    assert (bad == sql.n_bad_negative).all()
    moments = summ[summ.metric == "abs_prob_diff"].set_index("step")
    np.testing.assert_allclose(moments["mean"], sql.mismatch_mean, rtol=1e-5)
    np.testing.assert_allclose(moments["max"], sql.mismatch_max, rtol=1e-5)
    blocked = summ[summ.metric == "blocked"]
    rules = set(blocked.rule)
    assert {"dppo_binary_tv", "dppo_topk_kl", "minirl", "ppo_clip"} <= rules <= set(list_losses())
    for rule in rules:
        pos = blocked[(blocked.rule == rule) & (blocked.advantage_sign == "positive")].groupby("step")["count"].sum()
        expected = (sql[f"blocked_frac_pos__{rule}"] * sql.n_positive).round()
        assert (pos.reindex(sql.index, fill_value=0) == expected).all(), rule
    cur = db.cursor()
    by_bucket = cur.execute("select step, mu_bucket, count(*) as n from token_metrics where run_id = 'full' "
                            "and advantage != 0 group by all").df().set_index(["step", "mu_bucket"]).n
    ours = summ[(summ.metric == "tokens") & (summ.advantage_sign != "zero")].groupby(["step", "mu_bucket"])["count"]
    pd.testing.assert_series_equal(ours.sum().sort_index(), by_bucket.sort_index(), check_names=False,
                                   check_dtype=False)


def test_fractions_and_quantiles_follow_from_the_rows(db):
    summ = db.summaries("full", metrics=["blocked", "tokens", "topk_tv_hist"])
    hist = summ[(summ.metric == "topk_tv_hist") & (summ.step == 0)].sort_values("bin_low")
    assert hist.cum_fraction.is_monotonic_increasing and hist.cum_fraction.iloc[-1] == pytest.approx(1.0)
    assert set(hist.bin_low) <= set(HIST_EDGES)
    blocked = summ[(summ.metric == "blocked") & (summ.rule == "dppo_binary_tv")]
    assert blocked.advantage_sign.isin(["positive", "negative"]).all()  # A = 0 is left out
    assert ((blocked.fraction > 0) & (blocked.fraction <= 1)).all()


def test_mu_buckets_are_the_sql_macro_buckets():
    con = duckdb.connect()
    con.execute(MU_BUCKET_SQL.read_text())
    labels = [con.execute("select mu_bucket(?)", [float(low)]).fetchone()[0] for low in MU_LOWS]
    below = [con.execute("select mu_bucket(?)", [float(np.nextafter(low, 0))]).fetchone()[0] for low in MU_LOWS[1:]]
    assert len(set(labels)) == len(MU_LOWS) and labels == sorted(labels)
    assert below == labels[:-1]  # each edge is where the macro changes bucket


def test_summaries_commit_with_the_other_tables(logdir):
    run = logdir / "full"
    files = S.committed_files(run)
    flush_of = {t: {S.parse_data_file(p.name).flush for p in files[t]} for t in ("tokens", "summaries")}
    assert flush_of["tokens"] == flush_of["summaries"] and flush_of["summaries"]
    assert not S.validate_run(run)


def test_a_full_call_and_its_rows_shuffled_give_the_same_summaries():
    """Every (sample_id, pos) cell present and in order takes the reshape path; shuffled, the scatter path."""
    from trustscope.logger.summaries import summarize_call

    tokens, _, _ = rollout(3)
    n = B * T
    tokens["advantage"] = np.repeat(tokens["advantage"][:, None], T, axis=1)  # (B, T)
    cols = {name: (v.reshape(n, -1) if v.ndim == 3 else v.reshape(n)) for name, v in tokens.items()}
    cols["sample_id"] = np.repeat(np.arange(B), T)
    cols["pos"] = np.tile(np.arange(T, dtype=np.int32), B)
    order = np.random.default_rng(0).permutation(n)

    def rows(c: dict) -> pd.DataFrame:
        return pd.DataFrame(summarize_call(dict(c))).sort_values(["metric", "rule", "advantage_sign", "mu_low",
                                                                  "bin_low"]).reset_index(drop=True)

    dense, shuffled = rows(cols), rows({k: v[order] for k, v in cols.items()})
    assert (dense.metric == "blocked").sum() > 20
    pd.testing.assert_frame_equal(dense, shuffled, check_exact=False, rtol=1e-12)
    assert (dense["count"].fillna(-1) == shuffled["count"].fillna(-1)).all()


def _summary_rows(logdir, run_id: str) -> pd.DataFrame:
    import pyarrow.parquet as pq

    return pq.read_table(logdir / run_id / "summaries").to_pandas()


def test_a_steps_micro_batches_are_merged_into_one_set_of_rows(tmp_path):
    """Four log_step calls of one step write one row per (step, group), not one per call, with the same counts
    as the step logged in one call, and sums equal to float rounding; the view reads the same either way."""
    tokens, mask, samples = rollout(7)
    quarter = B // 4
    with TokenLogger(tmp_path, "whole", loss_rule="dppo_binary_tv") as lg:
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    with TokenLogger(tmp_path, "micro", loss_rule="dppo_binary_tv") as lg:
        for i in range(4):
            part = slice(i * quarter, (i + 1) * quarter)
            lg.log_step(0, tokens={k: v[part] for k, v in tokens.items()}, mask=mask[part],
                        samples={k: v[part] for k, v in samples.items()})
    whole, micro = _summary_rows(tmp_path, "whole"), _summary_rows(tmp_path, "micro")
    assert set(micro.part) == {0} and len(micro) == len(whole) > 100
    key = ["metric", "rule", "advantage_sign", "mu_low", "bin_low", "dimension", "bucket"]
    whole, micro = (t.sort_values(key, na_position="first").reset_index(drop=True) for t in (whole, micro))
    exact = [*key, "count", "min", "max"]
    pd.testing.assert_frame_equal(micro[exact], whole[exact])
    np.testing.assert_allclose(micro["sum"].astype(float), whole["sum"].astype(float), rtol=1e-12)
    with tsdb.connect(tmp_path, cache=False) as conn:
        by_view = {run: conn.summaries(run).drop(columns="run_id") for run in ("whole", "micro")}
    assert (by_view["whole"]["count"].to_numpy() == by_view["micro"]["count"].to_numpy()).all()


def test_a_flush_inside_a_step_writes_what_is_merged_so_far(tmp_path):
    """An explicit flush between micro-batches commits the merged rows of the calls before it (readers see them
    at once); the step's later calls start a new set at their own part, and the view adds the two up."""
    tokens, mask, samples = rollout(8)
    quarter = B // 4
    with TokenLogger(tmp_path, "split", loss_rule="dppo_binary_tv") as lg:
        for i in range(4):
            part = slice(i * quarter, (i + 1) * quarter)
            lg.log_step(0, tokens={k: v[part] for k, v in tokens.items()}, mask=mask[part],
                        samples={k: v[part] for k, v in samples.items()})
            if i == 1:
                lg.flush()
                assert set(_summary_rows(tmp_path, "split").part) == {0}
    with TokenLogger(tmp_path, "whole", loss_rule="dppo_binary_tv") as lg:
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    assert set(_summary_rows(tmp_path, "split").part) == {0, 2}
    with tsdb.connect(tmp_path, cache=False) as conn:
        split, whole = conn.summaries("split"), conn.summaries("whole")
    tokens_count = {name: t[t.metric == "tokens"]["count"].sum() for name, t in (("split", split), ("whole", whole))}
    assert tokens_count["split"] == tokens_count["whole"] == mask.sum()
    key = ["metric", "rule", "advantage_sign", "mu_bucket", "bin_low"]
    merged = split.merge(whole, on=key, suffixes=("_split", "_whole"), how="outer", validate="one_to_one")
    assert (merged["count_split"] == merged["count_whole"]).all()


# ---------------------------------------------------------------------------------------------------------------
# the summary dimensions: position bucket, turn, staleness


def async_rollout(step: int) -> tuple[dict, np.ndarray, dict]:
    """:func:`rollout` as an asynchronous multi-turn step: each response starts under an older weight version and
    switches to a newer one part-way (a partial rollout), and its tokens fall into turns 0, 1, 2."""
    tokens, mask, samples = rollout(step)
    rng = np.random.default_rng(100 + step)
    start = np.maximum(step - rng.integers(0, 3, B), 0)  # (B,) the version each response began under
    switch = rng.integers(0, T, B)  # (B,) where the newer version took over
    pos = np.arange(T)[None, :]  # (1, T)
    tokens["policy_version"] = np.where(pos < switch[:, None], start[:, None], np.minimum(start + 1, step)[:, None])
    boundaries = np.sort(rng.integers(1, T, (B, 2)), axis=1)  # (B, 2) where turns 1 and 2 begin
    tokens["turn"] = (pos >= boundaries[:, :1]).astype(np.int32) + (pos >= boundaries[:, 1:]).astype(np.int32)
    return tokens, mask, samples


@pytest.fixture(scope="module")
def async_db(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("dimensions")
    for run_id, fraction in (("full", 1.0), ("tenth", 0.1)):
        with TokenLogger(logdir, run_id, token_fraction=fraction, flush_rows=1, loss_rule="dppo_binary_tv") as lg:
            for step in range(4):
                tokens, mask, samples = async_rollout(step)
                half = B // 2
                for part in (slice(0, half), slice(half, B)):
                    lg.log_step(step, tokens={k: v[part] for k, v in tokens.items()}, mask=mask[part],
                                samples={k: v[part] for k, v in samples.items()})
    with tsdb.connect(logdir) as conn:
        yield conn


@pytest.mark.parametrize("dim", [d.name for d in DIMENSIONS if d.name != "routing"])  # MoE: test_routing_storage
def test_dimension_summaries_at_a_tenth_equal_those_recomputed_from_every_token(async_db, dim):
    """The summaries by position bucket, turn and staleness of a run logged at token_fraction 0.1 equal those
    recomputed in SQL from every token row of the same run logged at 1.0 (the dimension's own SQL expression)."""
    full, tenth = (async_db.summaries(run, dimension=dim).drop(columns="run_id") for run in ("full", "tenth"))
    pd.testing.assert_frame_equal(full, tenth, check_exact=True)
    tenth = tenth.astype({"bucket": "int64"})
    assert len(tenth) and (tenth.dimension == dim).all() and tenth.mu_low.isna().all()
    assert async_db.step_summary("tenth").n_tokens.sum() < 0.3 * async_db.step_summary("full").n_tokens.sum()
    d = dimension(dim)
    cur = async_db.cursor()
    rules = ["dppo_binary_tv", "ppo_clip", "minirl"]
    delta = float(get_loss("minimal_negative_mask").defaults["delta"])
    blocks = ", ".join(f"count_if(blocks_{r} and advantage != 0) as blocked_{r}" for r in rules)
    rows = cur.execute(f"""
        select step, ({d.sql})::bigint as bucket, count(*) as n, count_if(advantage > 0) as n_pos,
            count_if(advantage = 0) as n_zero,
            sum(abs(pi_prob - mu_prob)) as sum_abs, max(abs(pi_prob - mu_prob)) as max_abs,
            sum(exp(log_ratio)) as w_sum, sum(exp(log_ratio) * exp(log_ratio)) as w_sum_sq,
            count_if(advantage < 0 and mu_prob - pi_prob >= {delta}) as n_bad, {blocks}
        from sample_tokens where run_id = 'full' group by all order by all""").df()
    rows = rows.set_index(["step", "bucket"])
    assert len(rows) > 8 and len(rows.index.get_level_values("bucket").unique()) >= 3
    tokens = tenth[tenth.metric == "tokens"].groupby(["step", "bucket"])["count"].sum()
    pd.testing.assert_series_equal(tokens, rows.n, check_names=False, check_dtype=False)
    pos = tenth[(tenth.metric == "tokens") & (tenth.advantage_sign == "positive")].groupby(["step", "bucket"])["count"]
    assert (pos.sum().reindex(rows.index, fill_value=0) == rows.n_pos).all()
    moments = tenth[tenth.metric == "abs_prob_diff"].set_index(["step", "bucket"])
    np.testing.assert_allclose(moments["sum"], rows.sum_abs, rtol=1e-9)
    np.testing.assert_allclose(moments["max"], rows.max_abs, rtol=1e-12)
    weights = tenth[tenth.metric == "is_weight"].set_index(["step", "bucket"])
    np.testing.assert_allclose(weights["sum"], rows.w_sum, rtol=1e-9)
    np.testing.assert_allclose(weights["sum_sq"], rows.w_sum_sq, rtol=1e-9)
    bad = tenth[tenth.metric == "bad_negative"].set_index(["step", "bucket"])
    assert bad.threshold.unique().tolist() == [delta] and bad["count"].sum() > 0
    assert (bad["count"] == rows.n_bad).all()
    hist = tenth[tenth.metric == "abs_prob_diff_hist"].groupby(["step", "bucket"])["count"].sum()
    assert (hist == rows.n).all()
    for rule in rules:
        got = tenth[(tenth.metric == "blocked") & (tenth.rule == rule)].groupby(["step", "bucket"])["count"].sum()
        assert (got.reindex(rows.index, fill_value=0) == rows[f"blocked_{rule}"]).all(), rule
    assert rows[[f"blocked_{r}" for r in rules]].to_numpy().sum() > 0


def test_dimension_rows_merge_across_calls_like_one_call(tmp_path):
    """A step logged in four micro-batches writes the same dimension rows as the step logged in one call."""
    tokens, mask, samples = async_rollout(3)
    quarter = B // 4
    with TokenLogger(tmp_path, "whole") as lg:
        lg.log_step(3, tokens=tokens, mask=mask, samples=samples)
    with TokenLogger(tmp_path, "micro") as lg:
        for i in range(4):
            part = slice(i * quarter, (i + 1) * quarter)
            lg.log_step(3, tokens={k: v[part] for k, v in tokens.items()}, mask=mask[part],
                        samples={k: v[part] for k, v in samples.items()})
    with tsdb.connect(tmp_path, cache=False) as conn:
        whole, micro = (conn.summaries(run, dimension="*").drop(columns="run_id") for run in ("whole", "micro"))
    assert set(whole.dimension.dropna()) == {"position", "turn", "staleness"}
    exact = ["metric", "rule", "advantage_sign", "dimension", "bucket", "bin_low", "count", "min", "max"]
    pd.testing.assert_frame_equal(whole[exact], micro[exact])
    np.testing.assert_allclose(whole["sum"].astype(float), micro["sum"].astype(float), rtol=1e-12)


def test_position_buckets_are_the_sql_macro_buckets():
    con = duckdb.connect()
    for name in ("position_bucket", "position_bucket_label"):
        con.execute((MU_BUCKET_SQL.parent / f"{name}.sql").read_text())
    pos = np.array([0, 1, 2, 3, 4, 7, 8, 15, 16, 1023, 1024, 2**31 - 1])
    sql = [con.execute("select position_bucket(?::integer)", [int(p)]).fetchone()[0] for p in pos]
    assert position_bucket(pos).tolist() == sql == [0, 1, 2, 2, 4, 4, 8, 8, 16, 512, 1024, 2**30]
    labels = [con.execute("select position_bucket_label(?)", [b]).fetchone()[0] for b in (0, 1, 2, 4, 8)]
    assert labels == ["0", "1", "2-3", "4-7", "8-15"]
