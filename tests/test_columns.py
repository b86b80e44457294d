"""One declaration per column (trustscope/columns.py): weight versions, turns and a run's own columns, checked at the
call, written, read by every tokens view, and absent (NULL) in logs written before them."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from trustscope import columns as C
from trustscope import db as tsdb
from trustscope import runformat as S
from trustscope.cli import app
from trustscope.logger import TokenLogger
from trustscope.logger.checks import CHECKERS, TOKEN_INPUTS
from trustscope.runformat.errors import SchemaError

B, T = 4, 6
EXTRA = {"env": "string", "tool_latency": "float32", "tool_calls": "int32"}
UPDATE_COLUMNS = ("update_index", "rollout_rejected", "is_weight", "policy_version_last")
"""Tokens version 4: the update of the step, the rollout rejection mask, the rollout IS weight, the last version."""


def step_tokens(step: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + step)
    mu = -rng.random((B, T)).astype(np.float32)
    return {"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": mu,
            "pi_logprob": np.minimum(mu + rng.normal(0, 0.1, (B, T)).astype(np.float32), 0),
            "advantage": rng.normal(size=B), "sample_id": np.arange(B), "prompt_id": np.arange(B) // 2,
            "policy_version": np.full(B, max(step - 1, 0)), "turn": np.repeat([0, 0, 1, 1, 2, 2], 1)[None].repeat(B, 0),
            "env": ["math", "code", "math", None], "tool_latency": rng.random((B, T)).astype(np.float32),
            "tool_calls": np.arange(B)}


def test_the_declaration_is_what_the_schema_checks_and_docs_read():
    for table, cols in C.TABLE_COLUMNS.items():
        assert S.SCHEMAS[table].names == [c.name for c in cols]
    assert set(TOKEN_INPUTS) == {c.name for c in C.TOKEN_COLUMNS if c.given != "logger"}
    assert {c.check.kind for cols in C.TABLE_COLUMNS.values() for c in cols if c.check} <= set(CHECKERS) == set(C.CHECKS)
    for cols in C.TABLE_COLUMNS.values():  # a column added later is nullable: older files lack it
        assert all(c.nullable for c in cols if c.since > 1)
    assert S.TABLE_VERSIONS["tokens"] == 4 and {"policy_version", "turn", "engine_token_id", *UPDATE_COLUMNS} <= (
        S.ADDED_COLUMNS["tokens"])
    split = S.WRITE_OPTIONS["tokens"].byte_stream_split  # the float columns (and top-K lists), from the declaration
    assert {"mu_logprob", "topk_kl", "mu_topk_ids.list.element"} <= set(split) and "policy_version" not in split
    with pytest.raises(ValueError, match="must be nullable"):
        C.Column("late", pa.int32(), False, "x", since=4)


def test_versions_turns_and_a_runs_own_columns_reach_every_tokens_view(tmp_path):
    with TokenLogger(tmp_path, "r", extra_columns=EXTRA, max_staleness=1) as lg:
        for step in range(3):
            lg.log_step(step, tokens=step_tokens(step), samples={"reward": np.ones(B)})
    manifest = S.read_manifest(tmp_path / "r")
    assert manifest["logging"]["extra_columns"] == EXTRA and manifest["max_staleness"] == 1
    assert not S.validate_logdir(tmp_path)
    files = S.committed_files(tmp_path / "r")["tokens"]
    written = pq.read_table(files[0])
    assert written.schema.field("env").type == pa.string() and written.schema.field("tool_calls").type == pa.int32()
    with tsdb.connect(tmp_path) as db:
        cur = db.cursor()
        rows = cur.execute("select step, policy_version, staleness, turn, env, tool_latency, tool_calls from tokens "
                           "where step = 2 and sample_id = 3 order by pos").df()
        assert rows.staleness.tolist() == [1] * T and rows.turn.tolist() == [0, 0, 1, 1, 2, 2]
        assert rows.env.isna().all() and (rows.tool_calls == 3).all()
        for view in ("token_metrics", "sample_tokens"):
            got = cur.execute(f"select position_bucket, staleness, turn, env, tool_latency, tool_calls, source_file "
                              f"from {view} where step = 1 and sample_id = 0 order by pos").df()
            assert got.position_bucket.tolist() == [0, 1, 2, 2, 4, 4] and (got.env == "math").all(), view
            assert got.source_file.notna().all()
        assert db.sql("select count(*) as n from tokens where env = 'code'").to_pandas().n[0] == 3 * T


def test_bad_input_is_refused_naming_field_row_and_value_and_nothing_written_is_lost(tmp_path):
    cases = {
        "policy_version": (np.array([0, 5, 0, 0]), r"tokens\['policy_version'\] must be a weight version in \[0, 2\].*"
                                                   r"got 5 at sample_id 1, pos 0"),
        "turn": (np.array([[0, 1, 0, 1, 1, 2]] * B), r"tokens\['turn'\] must not decrease within a response.*got 0 at "
                                                     r"sample_id 0, pos 2"),
        "env": ([1, 2, 3, 4], r"tokens\['env'\] must hold strings.*got 1 at sample_id 0"),
        "tool_latency": (np.full((B, T), np.nan), r"tokens\['tool_latency'\] must be finite, got nan at sample_id 0"),
        "tool_calls": (np.array(["a", "b", "c", "d"]), r"tokens\['tool_calls'\]: expected integers"),
    }
    with TokenLogger(tmp_path, "r", extra_columns=EXTRA) as lg:
        lg.log_step(0, tokens=step_tokens(0))
        lg.log_step(1, tokens=step_tokens(1))
        for name, (value, message) in cases.items():
            with pytest.raises(SchemaError, match=message):
                lg.log_step(2, tokens={**step_tokens(2), name: value})
        with pytest.raises(SchemaError, match=r"unknown column\(s\) \['agent'\].*extra_columns"):
            lg.log_step(2, tokens={**step_tokens(2), "agent": np.zeros(B)})
        lg.log_step(2, tokens=step_tokens(2))
    with tsdb.connect(tmp_path) as db:
        steps = db.sql("select step, count(*) as n from tokens group by 1 order by 1").to_pandas()
    assert steps.n.tolist() == [B * T] * 3
    for declared, message in (({"turn": "int32"}, "shadows a built-in"), ({"staleness": "int64"}, "shadows"),
                              ({"blocks_x": "bool"}, "shadows"), ({"Env": "string"}, "lowercase identifier"),
                              ({"env": "decimal"}, "is not one of")):
        with pytest.raises(ValueError, match=message):
            TokenLogger(tmp_path, "other", extra_columns=declared)
    with pytest.raises(SchemaError, match=r"extra_columns .* differ from the run's"):
        TokenLogger(tmp_path, "r", resume=True, extra_columns={**EXTRA, "tool_latency": "float64"})
    with pytest.raises(ValueError, match="max_staleness"):
        TokenLogger(tmp_path, "other2", max_staleness=-1)


def update_tokens(step: int, update: int) -> dict:
    """One update's tokens: the update index per response, a rejection mask, IS weights, a trajectory's versions."""
    rng = np.random.default_rng(step * 10 + update)
    base = {k: v for k, v in step_tokens(step).items() if k not in EXTRA and k != "turn"}
    return {**base, "update_index": np.full(B, update), "rollout_rejected": rng.random((B, T)) < 0.3,
            "is_weight": rng.random((B, T)).astype(np.float32) * 2, "policy_version_last": np.full(B, step)}


def test_updates_rejection_is_weights_and_last_versions_are_columns_like_the_others(tmp_path):
    """Tokens version 4: one response trained by two updates of a step, its rows in each (update_index), the
    rejection mask, IS weight and last version reach every tokens view; bad values are refused naming field, row
    and value, and nothing already written is lost."""
    with TokenLogger(tmp_path, "r") as lg:
        lg.log_step(1, tokens=update_tokens(1, 0))
        cases = {
            "update_index": (np.array([0, -1, 0, 0]), r"tokens\['update_index'\] must be >= 0.*got -1 at sample_id 1"),
            "is_weight": (np.full((B, T), -0.5), r"tokens\['is_weight'\] must be finite and in \[0.0, inf\].*got -0.5"),
            "policy_version_last": (np.array([1, 1, 3, 1]), r"tokens\['policy_version_last'\] must be a weight "
                                                            r"version in \[0, 2\].*got 3 at sample_id 2"),
            "rollout_rejected": (np.full((B, T), 2), r"tokens\['rollout_rejected'\] must be boolean"),
        }
        for name, (value, message) in cases.items():
            with pytest.raises(SchemaError, match=message):
                lg.log_step(2, tokens={**update_tokens(2, 0), name: value})
        lg.log_step(2, tokens=update_tokens(2, 0))
    assert not S.validate_logdir(tmp_path)
    written = pq.read_table(S.committed_files(tmp_path / "r")["tokens"][0])
    assert [written.schema.field(c).type for c in UPDATE_COLUMNS] == [pa.int32(), pa.bool_(), pa.float32(), pa.int64()]
    with tsdb.connect(tmp_path) as db:
        for view in ("tokens", "token_metrics"):
            got = db.sql(f"select step, sample_id, pos, update_index, rollout_rejected, is_weight, policy_version_last "
                         f"from {view} order by all").to_pandas()
            assert len(got) == 2 * B * T and got.update_index.eq(0).all(), view
            assert got.policy_version_last.tolist() == got.step.tolist(), view
            want = update_tokens(2, 0)
            last = got[got.step == 2]
            assert last.rollout_rejected.tolist() == want["rollout_rejected"].reshape(-1).tolist(), view
            np.testing.assert_allclose(last.is_weight, want["is_weight"].reshape(-1), rtol=1e-6)


def test_runs_logged_before_the_columns_read_them_as_null(tmp_path, legacy_logs):
    """A run written before policy_version, turn and the dimensions (tests/data/legacy) beside a new run: its
    versions, turns and staleness read NULL, it has no dimension rows, and it still validates."""
    (old,) = S.run_dirs(legacy_logs)
    shutil.copytree(old, tmp_path / old.name)
    assert not S.validate_run(tmp_path / old.name)
    with TokenLogger(tmp_path, "new", extra_columns={"env": "string"}) as lg:
        lg.log_step(0, tokens={k: v for k, v in step_tokens(0).items() if k in ("token_id", "mu_logprob",
                    "pi_logprob", "advantage", "prompt_id", "policy_version", "turn", "env")})
    with tsdb.connect(tmp_path) as db:
        got = db.sql("select run_id, count(*) as n, count(policy_version) as v, count(turn) as t, "
                     "count(staleness) as s, count(env) as e, count(update_index) + count(rollout_rejected) + "
                     "count(is_weight) + count(policy_version_last) as u from token_metrics group by 1 order by 1"
                     ).to_pandas()
        dims = db.sql("select distinct run_id, dimension from summary_dimensions order by all").to_pandas()
    old_row = got[got.run_id == old.name].iloc[0]
    assert old_row.n > 0 and old_row.v == old_row.t == old_row.s == old_row.e == old_row.u == 0
    new_row = got[got.run_id == "new"].iloc[0]
    assert new_row.v == new_row.t == new_row.s == new_row.n
    assert set(dims.run_id) == {"new"} and set(dims.dimension) == {"position", "turn", "staleness"}


def test_trustscope_sql_reads_staleness_and_a_runs_own_columns(tmp_path):
    with TokenLogger(tmp_path, "r", extra_columns={"env": "string"}) as lg:
        for step in range(3):
            lg.log_step(step, tokens={**{k: v for k, v in step_tokens(step).items() if k not in EXTRA},
                                      "env": ["a", "b", "a", "b"]})
    result = CliRunner().invoke(app, ["sql", str(tmp_path), "--format", "csv",
                                      "select env, max(staleness) as s, count(*) as n from tokens group by 1 order by 1"])
    assert result.exit_code == 0, result.output
    assert result.output.split() == ['"env","s","n"', f'"a",1,{2 * T * 3}', f'"b",1,{2 * T * 3}']


def test_a_list_per_token_is_a_column_like_the_others(tmp_path):
    """A list per token of its own length (a MoE layer's routed experts, their router weights): ``(B, T, L)``,
    checked element by element, written as an Arrow list, read with SQL's list functions."""
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 64, (B, T, 2))
    weights = rng.random((B, T, 2)).astype(np.float32)
    lists = {"experts": "list<int32>", "router_p": "list<float32>"}
    with TokenLogger(tmp_path, "moe", extra_columns=lists) as lg:
        base = {k: v for k, v in step_tokens(0).items() if k not in EXTRA}
        lg.log_step(0, tokens={**base, "experts": experts, "router_p": weights})
        with pytest.raises(SchemaError, match=r"tokens\['experts'\]: expected integers, got 1.5"):
            lg.log_step(1, tokens={**base, "experts": np.full((B, T, 2), 1.5), "router_p": weights})
        with pytest.raises(SchemaError, match=r"tokens\['router_p'\] must have shape \(B, T, K\)"):
            lg.log_step(1, tokens={**base, "experts": experts, "router_p": weights[..., 0]})
        bad = weights.copy()
        bad[2, 3, 1] = np.inf
        with pytest.raises(SchemaError, match=r"tokens\['router_p'\] must be finite, got inf at sample_id 2, pos 3"):
            lg.log_step(1, tokens={**base, "experts": experts, "router_p": bad})
    written = pq.read_table(S.committed_files(tmp_path / "moe")["tokens"][0])
    assert written.schema.field("experts").type == pa.list_(pa.field("element", pa.int32(), nullable=False))
    assert not S.validate_logdir(tmp_path)
    with tsdb.connect(tmp_path) as db:
        got = db.sql("select sample_id, pos, experts, router_p[2] as p2 from token_metrics "
                     "order by sample_id, pos").to_pandas()
    assert [list(e) for e in got.experts] == experts.reshape(-1, 2).tolist()
    np.testing.assert_allclose(got.p2, weights[..., 1].reshape(-1))
