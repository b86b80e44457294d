"""The SQL macros and views agree with trustscope.divergence and trustscope.losses, token for token.

Every check runs over the rule catalogue (``list_losses()``): a rule registered with a SQL mask family is held to
its torch mask without a line here naming it. Each run's own rule is checked at the parameters the run trained with
(from its run.json), every other rule at its defaults.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trustscope import db as tsdb
from trustscope import divergence as D
from trustscope import losses as L
from trustscope.losses import PolicyBatch, get_loss
from trustscope.query import connection
from trustscope.synthetic import SyntheticConfig, generate_run

KEY = ["run_id", "step", "sample_id", "pos"]
SAMPLE_LOGS = Path(__file__).resolve().parents[1] / "sample_logs"
OWN_PARAMS = {
    "run_ppo": ("ppo_clip", {"eps_low": 0.1, "eps_high": 0.1, "dual_clip": 1.5}),
    "run_cppo": ("cppo", {"delta": 0.05, "delta_b": 0.01, "w_min": 0.5}),
}
"""Synthetic runs that trained with non-default parameters, recorded in their run.json like the trainer's."""


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("parity")
    cfg = SyntheticConfig(tokens=30_000, steps=3, mean_length=48, rows_per_file=8_000, edge_cases=True,
                          loss_rule="dppo_binary_tv", drift=0.3, seed=7)
    generate_run(logdir, "run0", cfg)
    for i, (run_id, (rule, params)) in enumerate(OWN_PARAMS.items()):
        generate_run(logdir, run_id, SyntheticConfig(tokens=6_000, steps=2, mean_length=24, edge_cases=False,
                                                     loss_rule=rule, loss_params=params, drift=0.3, seed=11 + i))
    tokens = pq.read_table(logdir / "run0" / "tokens").sort_by([(k, "ascending") for k in KEY])
    db = tsdb.connect(logdir, cache_dir=tmp_path_factory.mktemp("cache"))
    yield logdir, tokens, db
    db.close()


def _batch(tokens, dtype=torch.float64) -> PolicyBatch:
    """All tokens as one (1, N) row: for the token-level macros only."""
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


def response_batch(tokens: pa.Table, *, responses: bool, topk: bool) -> tuple[PolicyBatch, np.ndarray, np.ndarray]:
    """One run's tokens in float64 and the (row, column) of every token in the order of ``tokens`` (sorted by
    step, rank, sample_id, pos). ``responses``: right-padded ``(B, T)`` responses, as the trainer sees them (the
    sequence rules need them); else one ``(1, N)`` row (enough for a token-level rule, and far smaller).
    ``topk``: with the top-K lists."""
    step, rank, sample = (tokens.column(c).to_numpy() for c in ("step", "rank", "sample_id"))
    new = np.r_[True, (np.diff(step) != 0) | (np.diff(rank) != 0) | (np.diff(sample) != 0)]
    if not responses:
        new = np.r_[True, np.zeros(len(new) - 1, dtype=bool)]
    row = np.cumsum(new) - 1  # (N,)
    starts = np.flatnonzero(new)
    colpos = np.arange(len(row)) - starts[row]
    b, t = int(row[-1]) + 1, int(colpos.max()) + 1
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[row, colpos] = True

    def dense(name: str) -> torch.Tensor | None:
        column = tokens.column(name)
        if column.null_count == len(column):
            return None
        out = torch.zeros(b, t, dtype=torch.float64)
        out[row, colpos] = torch.from_numpy(column.to_numpy().astype(np.float32).astype(np.float64))
        return out

    def lists(name: str) -> torch.Tensor | None:
        column = tokens.column(name)
        if not topk or column.null_count:
            return None
        k = len(column[0])
        flat = column.combine_chunks().flatten().to_numpy().astype(np.float32).reshape(-1, k)
        out = torch.zeros(b, t, k, dtype=torch.float64)
        out[row, colpos] = torch.from_numpy(flat.astype(np.float64))
        return out

    batch = PolicyBatch(pi_logprob=dense("pi_logprob"), mu_logprob=dense("mu_logprob"),
                        advantages=dense("advantage"), mask=mask, old_logprob=dense("old_logprob"),
                        mu_topk_logprobs=lists("mu_topk_logprobs"), pi_topk_logprobs=lists("pi_topk_logprobs"))
    return batch, row, colpos


def _sql(db, query: str, **params):
    cur = db.cursor()
    try:
        return cur.sql(query, params=params or None).to_df()
    finally:
        cur.close()


def _ordered(db, view: str) -> pa.Table:
    cur = db.cursor()
    try:
        return cur.sql(f"select * from {view} order by run_id, step, rank, sample_id, pos").to_arrow_table()
    finally:
        cur.close()


def assert_views_match_torch(db) -> int:
    """For every run and every rule with a SQL family: ``rule_blocks.blocks_<rule>`` equals the torch rule's
    ``~keep`` at the run's parameters, token for token. Returns the number of (run, rule) pairs checked."""
    rules = db.run_rules().set_index("run_id")
    all_tokens, all_blocks = _ordered(db, "tokens"), _ordered(db, "rule_blocks")
    assert all_tokens.num_rows == all_blocks.num_rows > 0
    run_ids = all_tokens.column("run_id").to_numpy(zero_copy_only=False)
    checked = 0
    for run_id in rules.index:
        where = np.flatnonzero(run_ids == run_id)
        tokens, sql = all_tokens.take(where), all_blocks.take(where)
        assert tokens.num_rows > 0, run_id
        batches = {}
        own, own_params = rules.loc[run_id, "loss_rule"], json.loads(rules.loc[run_id, "parameters"])
        for rule in tsdb.sql_rules():
            column = sql.column(f"blocks_{rule.name}").to_numpy(zero_copy_only=False)
            params = own_params if rule.name == own else {}
            divergence = rule.resolve(**params).get("divergence", "")
            shape = (rule.sql.sequence, divergence.startswith("topk") or "mu_topk_logprobs" in rule.needs)
            if shape not in batches:
                batches[shape] = response_batch(tokens, responses=shape[0], topk=shape[1])
            batch, row, colpos = batches[shape]
            missing = [n for n in rule.needs if getattr(batch, n) is None]
            if missing:  # the view cannot know what the rule would do without these inputs: never blocks
                assert not column.any(), (run_id, rule.name, missing)
                checked += 1
                continue
            torch_blocked = (~rule(batch, **params).keep)[row, colpos].numpy()
            differ = torch_blocked != column
            if divergence.startswith("topk"):
                # The view gates on the float32 scalar stored at capture; torch recomputes it from the lists.
                stored = tokens.column(divergence).to_numpy().astype(np.float64)
                fn = D.topk_tv if divergence == "topk_tv" else D.topk_kl
                recomputed = fn(batch.mu_topk_logprobs, batch.pi_topk_logprobs)[row, colpos].numpy()
                delta = rule.resolve(**params)["delta"]
                differ &= np.abs(stored - delta) > np.abs(stored - recomputed) + 1e-6
            assert not differ.any(), (f"{run_id} {rule.name}: {differ.sum()} token(s) differ, e.g. rows "
                                      f"{np.flatnonzero(differ)[:5]}")
            checked += 1
    return checked


def test_rule_blocks_matches_every_torch_rule_with_each_runs_parameters(log):
    _, _, db = log
    rules = db.run_rules().set_index("run_id")
    for run_id, (rule, params) in OWN_PARAMS.items():
        assert rules.loc[run_id, "loss_rule"] == rule and rules.loc[run_id, "source"] == "run"
        assert json.loads(rules.loc[run_id, "parameters"]) == get_loss(rule).resolve(**params)
    assert assert_views_match_torch(db) == 3 * len(tsdb.sql_rules())
    # the own parameters matter: the same rule at its defaults blocks other tokens on those runs
    got = _sql(db, """
        select run_id, count_if(blocks_ppo_clip) as own, count_if(blocks_grpo) as grpo,
               count_if(blocks_cppo) as cppo
        from rule_blocks group by run_id order by run_id
    """).set_index("run_id")
    assert got.loc["run_ppo", "own"] > got.loc["run_ppo", "grpo"]  # eps 0.1 and dual clip 1.5 against 0.2 / 0.2


def test_every_rule_blocks_something_on_the_test_log(log):
    _, _, db = log
    counts = _sql(db, "select count_if(columns('^blocks_.*$')) from rule_blocks where run_id = 'run0'")
    never = {f"blocks_{r.name}" for r in tsdb.sql_rules() if r.sql.family == "none"}
    for column, n in counts.iloc[0].items():
        assert (n == 0) == (column in never), (column, n)


@pytest.mark.slow
@pytest.mark.skipif(not SAMPLE_LOGS.is_dir() or not any(SAMPLE_LOGS.iterdir()), reason="sample_logs/ is empty")
def test_rule_blocks_matches_torch_on_the_sample_logs(tmp_path):
    """The real logs the project's trainer wrote: every run, every rule, each run's own parameters."""
    with tsdb.connect(SAMPLE_LOGS, cache_dir=tmp_path) as db:
        runs = db.run_rules()
        assert len(runs) == len(list(SAMPLE_LOGS.glob("*/run.json"))) >= 5
        assert runs["source"].isin(["run", "defaults"]).all()
        assert assert_views_match_torch(db) == len(runs) * len(tsdb.sql_rules())


def test_generated_rule_columns_bind_every_value():
    """The generated SQL holds identifiers only: no literal number or string, every parameter a bound field."""
    sql = tsdb.rule_columns_sql()
    assert "'" not in sql
    assert not re.search(r"(?<![a-z0-9_\"])\d", sql), sql  # digits only inside identifiers
    for rule in tsdb.sql_rules():
        assert f'as "blocks_{rule.name}"' in sql
        for param in filter(None, rule.sql.params):
            assert f'rule_values()."{rule.name}"."{param}"[rule_set]' in sql


def test_a_rule_from_a_dotted_path_appears_everywhere(tmp_path, monkeypatch):
    """A rule written outside the repo, of an existing family, loaded by dotted path: it gets its rule_blocks
    column, step-summary columns, blocked fractions and a row in LogDB's rule list with no other change."""
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "ts_parity_rules.py").write_text(
        "from trustscope.losses import RATIO_BAND, register_loss, token_mis\n"
        "register_loss('tight_band', sql=RATIO_BAND, low=0.95, high=1.05)(token_mis)\n"
    )
    monkeypatch.syspath_prepend(str(plugin))
    logdir = tmp_path / "logs"
    generate_run(logdir, "run", SyntheticConfig(tokens=3_000, steps=2, mean_length=20, seed=3))
    try:
        with tsdb.connect(logdir, cache_dir=tmp_path / "cache", rules="ts_parity_rules:tight_band") as db:
            assert "tight_band" in set(db.rules()["rule"])
            assert db.rules().set_index("rule").loc["tight_band", "family"] == "ratio_band"
            summary = db.step_summary()
            assert {"blocked_frac__tight_band", "n_blocked__tight_band", "blocked_frac_neg__tight_band"} \
                <= set(summary.columns)
            assert summary["n_blocked__tight_band"].sum() > 0
            assert "tight_band" in set(db.blocked_fractions()["rule"])
            assert "tight_band" in set(db.clipped_tokens(rules="tight_band")["rule"])
            assert "blocks_tight_band" in db.sample_tokens("run", 0, 0).columns
            assert tsdb.check_contracts(db, ["rule_blocks", "blocked_fractions"]) == []
            assert assert_views_match_torch(db) == len(tsdb.sql_rules())
    finally:
        L._REGISTRY.pop("tight_band", None)


def test_rules_env_loads_modules_and_refuses_bad_ones(tmp_path, monkeypatch):
    (tmp_path / "ts_env_rules.py").write_text(
        "from trustscope.losses import NO_MASK, register_loss, pg_is\n"
        "register_loss('env_rule', sql=NO_MASK, is_cap=3.0)(pg_is)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(tsdb.RULES_ENV, "ts_env_rules")
    try:
        assert "env_rule" in tsdb.load_rules()
    finally:
        L._REGISTRY.pop("env_rule", None)
    with pytest.raises(ValueError, match="cannot import rule module 'ts_no_such_rules'"):
        tsdb.load_rules("ts_no_such_rules")


def test_counterfactual_parameters_are_the_callers_choice(log, tmp_path):
    """``rule_params`` moves the counterfactual columns; a run's own rule keeps the parameters it trained with."""
    logdir, _, db = log
    base = _sql(db, "select run_id, count_if(blocks_dppo_binary_tv) as n from rule_blocks group by run_id")
    with tsdb.connect(logdir, cache_dir=tmp_path, rule_params={"dppo_binary_tv": {"delta": 0.01}}) as loose:
        moved = _sql(loose, "select run_id, count_if(blocks_dppo_binary_tv) as n from rule_blocks group by run_id")
    base, moved = base.set_index("run_id")["n"], moved.set_index("run_id")["n"]
    assert moved["run_ppo"] > base["run_ppo"] and moved["run_cppo"] > base["run_cppo"]
    assert moved["run0"] == base["run0"]  # run0 trained with dppo_binary_tv at delta 0.15: its own rule
    with pytest.raises(ValueError, match="unknown rule"):
        tsdb.connect(logdir, rule_params={"dppo": {"delta": 0.1}})
    with pytest.raises(ValueError, match="delta=-1"):
        tsdb.connect(logdir, rule_params={"dppo_binary_tv": {"delta": -1}})


def test_divergence_macros_match_torch(log):
    _, tokens, db = log
    got = _sql(db, """
        select ratio(pi_logprob, mu_logprob) as ratio,
               binary_tv(mu_logprob, pi_logprob) as binary_tv,
               binary_kl(mu_logprob, pi_logprob) as binary_kl,
               topk_tv(mu_topk_logprobs, pi_topk_logprobs) as topk_tv,
               topk_kl(mu_topk_logprobs, pi_topk_logprobs) as topk_kl
        from tokens where run_id = 'run0' order by run_id, step, sample_id, pos
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
    own = _sql(db, "select count_if(kept = blocks_ppo_clip) as differ from rule_blocks where run_id = 'run_ppo'")
    assert own.differ[0] == 0  # the run's own parameters, not the defaults


def _flushes(logdir: Path, run: str) -> list[list[Path]]:
    return tsdb.flush_groups(tsdb.data_files(logdir / run, "tokens"))


def test_logged_bits_are_the_sql_flags_token_for_token(log):
    """Where a flush's footer lists a rule at the parameters the views bind for its run, the logger's
    ``blocked_rules`` bit equals the SQL rule's flag on every token; a run's own rule at other parameters is
    left to the SQL."""
    logdir, _, db = log
    rules = {run_id: params for run_id, params in db._run_rule_sets().values()}
    blocks = _sql(db, """
        select r.*, t.blocked_rules from rule_blocks r join tokens t using (run_id, step, rank, sample_id, pos)
    """)
    assert len(blocks) == _sql(db, "select count(*) as n from tokens").n[0] and blocks.blocked_rules.notna().all()
    checked = 0
    for run_id in rules:
        stored = [tsdb.stored_rule_bits(flush, rules[run_id]) for flush in _flushes(logdir, run_id)]
        assert stored and all(s == stored[0] for s in stored)
        own = OWN_PARAMS.get(run_id, ("dppo_binary_tv", {}))[0]
        expected = {r.name for r in tsdb.sql_rules()} - ({own} if run_id in OWN_PARAMS else set())
        assert set(stored[0]) == expected, run_id
        rows = blocks[blocks.run_id == run_id]
        bits = rows.blocked_rules.to_numpy(dtype=np.int64)
        for rule, bit in stored[0].items():
            logged = (bits >> bit) & 1 == 1
            assert (logged == rows[f"blocks_{rule}"].to_numpy(dtype=bool)).all(), (run_id, rule)
            checked += 1
    assert checked == 3 * len(tsdb.sql_rules()) - len(OWN_PARAMS)


def test_a_caller_s_counterfactual_parameters_leave_that_rule_to_the_sql(log):
    logdir, _, db = log
    rules = dict(db._run_rule_sets()[logdir / "run0"][1])
    rules["grpo"] = {**rules["grpo"], "eps_high": 0.5}
    stored = tsdb.stored_rule_bits(_flushes(logdir, "run0")[0], rules)
    assert "grpo" not in stored and "ppo_clip" in stored


def test_files_without_bits_are_aggregated_by_the_sql(tmp_path):
    generate_run(tmp_path, "nobits", SyntheticConfig(tokens=2_000, steps=2, mean_length=24, edge_cases=False,
                                                     summaries=False))
    files = tsdb.data_files(tmp_path / "nobits", "tokens")
    assert pq.read_table(files[0]).column("blocked_rules").null_count == pq.read_metadata(files[0]).num_rows
    with tsdb.connect(tmp_path, cache=False) as db:
        assert tsdb.stored_rule_bits(files, db.rule_params) == {}
        db.step_summary()
        assert db.partials_computed == len(files) and db.stored_bits_files == 0


def test_the_cold_pass_on_logged_bits_gives_the_sql_s_answers(log, monkeypatch):
    """The kept aggregates from the logger's bits equal those the SQL computes from scratch (every run, own
    parameters included), for every view they serve."""
    logdir, _, _ = log

    def answers():
        with tsdb.connect(logdir, cache=False) as db:
            out = {"steps": db.step_summary(), "clipped": db.clipped_tokens(),
                   "ratio": db.ratio_vs_divergence(), "blocked": db.blocked_fractions()}
            return out, db.stored_bits_files, db.partials_computed

    with_bits, used, computed = answers()
    assert used == computed > 0
    monkeypatch.setattr(connection, "stored_rule_bits", lambda files, rules: {})
    from_sql, used, _ = answers()
    assert used == 0
    for name, want in from_sql.items():
        got = with_bits[name]
        keys = [c for c in got.columns if got[c].dtype == object or c in ("step", "token_id")]
        got, want = (d.sort_values(keys).reset_index(drop=True) for d in (got, want))
        pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-12, obj=name)
