"""The data contracts of trustscope/sql/contracts.yml hold on a synthetic log and on sample_logs/."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from trustscope import db as tsdb
from trustscope.losses import list_losses
from trustscope.query.contracts import table_problems
from trustscope.synthetic import SyntheticConfig, generate_run

SAMPLE_LOGS = Path(__file__).resolve().parents[1] / "sample_logs"


@pytest.fixture(scope="module")
def synthetic_db(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("contracts")
    cfg = SyntheticConfig(tokens=8_000, steps=3, ranks=2, rows_per_file=1_500, edge_cases=True)
    generate_run(logdir, "run_a", cfg)
    generate_run(logdir, "run_b", SyntheticConfig(**{**cfg.__dict__, "seed": 1, "loss_rule": "grpo"}))
    conn = tsdb.connect(logdir, cache_dir=tmp_path_factory.mktemp("cache"))
    yield conn
    conn.close()


def test_every_view_with_a_contract_exists_and_every_view_has_one():
    contracts = tsdb.load_contracts()
    assert set(contracts) <= set(tsdb.VIEWS)
    public = {"tokens", "samples", "steps", "runs", "vocab", "token_metrics", "rule_blocks", "step_summary",
              "clipped_tokens", "ratio_vs_divergence"}
    assert public <= set(contracts)
    assert contracts["tokens"]["accepted"]["loss_rule"] == list_losses()


def test_rule_blocks_contract_is_generated_from_the_catalogue():
    contracts = tsdb.load_contracts()
    assert set(contracts["rule_blocks"]["not_null"]) == {f"blocks_{r.name}" for r in tsdb.sql_rules()}
    assert {r.name for r in tsdb.sql_rules()} == set(list_losses())  # every built-in rule has a SQL family
    never = {c for c, v in contracts["rule_blocks"]["accepted"].items() if v == [False]}
    assert never and never == {f"blocks_{r.name}" for r in tsdb.sql_rules() if r.sql.family == "none"}


def test_contracts_hold_on_a_synthetic_log(synthetic_db):
    assert tsdb.check_contracts(synthetic_db) == []


def test_contracts_hold_on_an_asynchronous_multi_turn_log(tmp_path):
    """Versions, turns and staleness on the token rows, and the summaries' dimension rows."""
    from async_logs import write_async_logdir

    write_async_logdir(tmp_path / "logs")
    with tsdb.connect(tmp_path / "logs", cache=False) as conn:
        assert tsdb.check_contracts(conn) == []
        dims = conn.sql("select distinct dimension from summary_dimensions order by 1").to_pandas()
    assert dims.dimension.tolist() == ["position", "staleness", "turn"]


def test_contract_checks_catch_broken_data():
    spec = {"unique": ["k"], "not_null": ["v"], "accepted": {"s": ["a", "b"]}, "between": {"v": [0, 1]}}
    data = pa.table({"k": [1, 1, None], "v": [0.5, None, 2.0], "s": ["a", "c", "b"]})
    problems = table_problems("t", spec, data)
    joined = "\n".join(problems)
    assert "t.k: 1 null" in joined and "t.v: 1 null" in joined
    assert "duplicate key" in joined and "['c']" in joined and "outside [0, 1]" in joined


@pytest.mark.skipif(not SAMPLE_LOGS.is_dir() or not any(SAMPLE_LOGS.iterdir()), reason="sample_logs/ is empty")
def test_contracts_hold_on_sample_logs(tmp_path):
    with tsdb.connect(SAMPLE_LOGS, cache_dir=tmp_path) as conn:
        assert tsdb.check_contracts(conn) == []
