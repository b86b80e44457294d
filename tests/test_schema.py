"""The log schema: the shared column contract, validation of files and runs, and ``trustscope validate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from trustscope import runformat as S
from trustscope.cli import app
from trustscope.logger import TokenLogger

CONTRACT = {
    "tokens": ["run_id", "step", "rank", "sample_id", "prompt_id", "pos", "token_id", "mu_logprob", "old_logprob",
               "pi_logprob", "advantage", "entropy", "mu_topk_ids", "mu_topk_logprobs", "pi_topk_logprobs",
               "topk_tv", "topk_kl", "kept", "loss_rule", "blocked_rules", "policy_version", "turn", "engine_token_id",
               "routing_agreement", "engine_experts", "trainer_experts", "update_index", "rollout_rejected",
               "is_weight", "policy_version_last", "router_experts", "routing_first_layer", "routing_replaced",
               "routing_fault"],
    "samples": ["run_id", "step", "rank", "sample_id", "prompt_id", "prompt", "response", "reward", "advantage",
                "length", "finish_reason"],
    "steps": ["run_id", "step", "rank", "name", "value"],
    "vocab": ["token_id", "text"],
}


def test_schemas_follow_the_shared_contract():
    for table, names in CONTRACT.items():
        assert S.SCHEMAS[table].names == names
    tokens = S.TOKENS
    assert tokens.field("mu_topk_ids").type.value_type == pa.int32()
    assert tokens.field("mu_topk_logprobs").type.value_type == pa.float32()
    for name in ("old_logprob", "entropy", "pi_topk_logprobs", "topk_tv", "topk_kl"):
        assert tokens.field(name).nullable, name
    for name in ("run_id", "step", "sample_id", "pos", "token_id", "mu_logprob", "pi_logprob", "kept"):
        assert not tokens.field(name).nullable, name
    for table, opts in S.WRITE_OPTIONS.items():
        assert set(opts.dictionary) <= set(S.SCHEMAS[table].names)
        assert {c.split(".")[0] for c in opts.byte_stream_split} <= set(S.SCHEMAS[table].names)
    assert S.tmp_path(Path("x/a.parquet")).name == ".a.parquet.tmp"
    assert not S.is_data_file(S.tmp_path(Path("x/a.parquet")))


@pytest.fixture
def good_logdir(tmp_path):
    rng = np.random.default_rng(0)
    B, T, K = 3, 4, 2
    topk = -np.sort(rng.random((B, T, K)).astype(np.float32), axis=-1)
    with TokenLogger(tmp_path, "good", vocab=["a", "b", "c", "d"]) as lg:
        for step in range(2):
            lg.log_step(step, tokens={"token_id": rng.integers(0, 4, (B, T)), "mu_logprob": topk[..., 0],
                                      "pi_logprob": topk[..., 0], "advantage": np.ones(B),
                                      "mu_topk_ids": rng.integers(0, 4, (B, T, K)), "mu_topk_logprobs": topk,
                                      "pi_topk_logprobs": topk},
                        mask=np.ones((B, T), bool), samples={"sample_id": np.arange(B), "prompt_id": np.zeros(B)},
                        scalars={"loss": 1.0})
    return tmp_path


def one_file(logdir, table):
    return next((logdir / "good" / table).rglob("*.parquet"))


def test_good_logdir_is_clean(good_logdir):
    assert S.validate_logdir(good_logdir) == []
    assert S.validate_logdir(good_logdir / "good") == []  # a run directory works too
    result = CliRunner().invoke(app, ["validate", str(good_logdir)])
    assert result.exit_code == 0, result.output
    assert "ok: 1 run(s)" in result.stdout


def test_truncated_file_is_reported_with_its_path(good_logdir):
    path = one_file(good_logdir, "tokens")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    problems = S.validate_logdir(good_logdir)
    assert [p.path for p in problems] == [path]
    assert "not readable as Parquet" in problems[0].message
    result = CliRunner().invoke(app, ["validate", str(good_logdir)])
    assert result.exit_code == 1
    assert f"{path}: not readable as Parquet" in result.stdout


def test_wrong_schema_and_bad_values(good_logdir):
    path = one_file(good_logdir, "tokens")
    table = pq.read_table(path)
    wrong = table.drop(["entropy"]).append_column("extra", pa.array(np.zeros(table.num_rows)))
    wrong = wrong.set_column(wrong.schema.get_field_index("pos"), "pos", table["pos"].cast(pa.float64()))
    pq.write_table(wrong, path)
    messages = [p.message for p in S.validate_logdir(good_logdir)]
    assert "column 'entropy' is missing (expected float)" in messages
    assert "column 'pos' has type double, expected int32" in messages
    assert any(m.startswith("unknown column 'extra'") for m in messages)

    mu = table["mu_logprob"].to_numpy().copy()
    mu[0], mu[1] = np.nan, 0.5
    bad = table.set_column(table.schema.get_field_index("mu_logprob"), S.TOKENS.field("mu_logprob"), pa.array(mu))
    bad = bad.set_column(bad.schema.get_field_index("run_id"), "run_id",  # a foreign writer's nullable column
                         pa.array([None] + ["good"] * (table.num_rows - 1), pa.string()))
    pq.write_table(bad, path)
    messages = [p.message for p in S.validate_logdir(good_logdir)]
    assert "column 'mu_logprob' has 1 NaN or infinite value(s)" in messages
    assert "column 'mu_logprob' has 1 positive value(s) (max 0.5)" in messages
    assert "column 'run_id' has 1 null(s)" in messages


def test_ragged_topk_duplicate_keys_and_foreign_run(good_logdir):
    path = one_file(good_logdir, "tokens")
    table = pq.read_table(path)
    ids = table["pi_topk_logprobs"].to_pylist()
    ids[0] = ids[0][:1]
    table = table.set_column(table.schema.get_field_index("pi_topk_logprobs"), S.TOKENS.field("pi_topk_logprobs"),
                             pa.array(ids, S.TOKENS.field("pi_topk_logprobs").type))
    pq.write_table(table, path)
    flat = path.parent.parent  # the table folder itself: read as a layout 1 folder, any name
    pq.write_table(table.slice(0, 2), flat / "copy.parquet")
    other = table.set_column(0, S.TOKENS.field("run_id"), pa.array(["other"] * table.num_rows))
    pq.write_table(other, flat / "foreign.parquet")
    pq.write_table(other, path.with_name("by-hand.parquet"))  # in a rank folder: not read, named
    problems = S.validate_logdir(good_logdir)
    text = "\n".join(map(str, problems))
    assert "pi_topk_logprobs and mu_topk_ids lists differ in length on 1 row(s)" in text
    assert "duplicate key(s) ('run_id', 'step', 'sample_id', 'pos', 'update_index')" in text
    assert f"{flat / 'foreign.parquet'}: run_id 'other' in a file of run 'good'" in text
    assert f"{path.with_name('by-hand.parquet')}: read by tools that list the folder" in text


def test_manifest_problems(good_logdir):
    manifest = good_logdir / "good" / S.MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "schema_version": 99, "status": "exploded"}))
    messages = [p.message for p in S.validate_logdir(good_logdir)]
    assert any("schema_version 99" in m for m in messages)
    assert any("status 'exploded'" in m for m in messages)
    manifest.write_text("{not json")
    problems = S.validate_logdir(good_logdir)
    assert problems[0].path == manifest and "unreadable run manifest" in problems[0].message


def test_temporary_files_are_ignored(good_logdir):
    (good_logdir / "good" / "tokens" / ".r0000-open-abc.parquet.tmp").write_bytes(b"PAR1 half a file")
    assert S.validate_logdir(good_logdir) == []


def test_cli_on_missing_or_empty_dirs(tmp_path):
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "is not a directory" in result.stderr
    result = CliRunner().invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1 and "no run found" in result.stdout


def test_manifest_rows_that_disagree_with_the_tables_are_reported(good_logdir):
    path = good_logdir / "good" / S.MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "rows": {**manifest["rows"], "steps": manifest["rows"]["steps"] + 1}}))
    problems = S.validate_logdir(good_logdir)
    assert [(p.path, p.message) for p in problems] == [
        (path, f"manifest of rank 0 counts {manifest['rows']['steps'] + 1} steps row(s), the run's steps files "
               f"of rank 0 hold {manifest['rows']['steps']}")]


def test_files_of_an_uncommitted_flush_are_not_read(good_logdir):
    run = good_logdir / "good"
    manifest = json.loads((run / S.MANIFEST).read_text())
    committed = S.committed_files(run)
    assert manifest["committed_flush"] == 1 and all(len(files) == 1 for files in committed.values())
    torn = run / "tokens" / S.rank_dir_name(0) / S.data_file_name(0, 2, 2, 2)  # a flush no manifest commits
    torn.write_bytes(committed["tokens"][0].read_bytes())  # (an older logger renamed before it committed)
    assert S.committed_files(run) == committed
    assert [(p.path, "which its manifest never committed" in p.message) for p in S.validate_logdir(good_logdir)] \
        == [(torn, True)]  # other tools would read it: validate names it
    with TokenLogger(good_logdir, "good", resume=True) as lg:  # resuming removes it
        assert not torn.exists()
        lg.log_step(2, scalars={"loss": 0.5})
    assert [len(files) for files in S.committed_files(run).values()] == [1, 1, 2, 1]
    assert S.validate_logdir(good_logdir) == []
