"""The `trustscope sql` and `trustscope report` commands, and the report module behind them."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from trustscope import db as tsdb
from trustscope import report
from trustscope.cli import app
from trustscope.synthetic import SyntheticConfig, generate_run

runner = CliRunner()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    cfg = SyntheticConfig(tokens=4_000, steps=4, edge_cases=False, loss_rule="grpo")
    generate_run(root / "logs", "alpha", cfg)
    generate_run(root / "logs", "beta", SyntheticConfig(**{**cfg.__dict__, "seed": 5, "loss_rule": "dppo_binary_kl"}))
    return root / "logs"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))


def test_sql_table_csv_json_parquet(logdir, tmp_path):
    q = "select run_id, count(*) as n from tokens group by run_id order by run_id"
    res = runner.invoke(app, ["sql", str(logdir), q])
    assert res.exit_code == 0, res.output
    assert "run_id" in res.output and "alpha" in res.output and "beta" in res.output
    res = runner.invoke(app, ["sql", str(logdir), q, "--format", "csv"])
    assert res.output.splitlines()[0] == '"run_id","n"' and res.output.splitlines()[1].startswith('"alpha",')
    res = runner.invoke(app, ["sql", str(logdir), q, "-f", "json"])
    rows = json.loads(res.output)
    assert [r["run_id"] for r in rows] == ["alpha", "beta"] and all(r["n"] > 0 for r in rows)
    out = tmp_path / "out.parquet"
    res = runner.invoke(app, ["sql", str(logdir), q, "-f", "parquet", "--out", str(out)])
    assert res.exit_code == 0 and pq.read_table(out).column("run_id").to_pylist() == ["alpha", "beta"]


def test_sql_errors_go_to_stderr_with_exit_code(logdir):
    res = runner.invoke(app, ["sql", str(logdir), "select * from read_text('/etc/passwd')"])
    assert res.exit_code == 1 and "refused" in res.stderr and "root:" not in res.output
    res = runner.invoke(app, ["sql", str(logdir), "drop view tokens"])
    assert res.exit_code == 1 and "DROP statements are not allowed" in res.stderr
    res = runner.invoke(app, ["sql", str(logdir), "select nope from tokens"])
    assert res.exit_code == 1 and "nope" in res.stderr
    res = runner.invoke(app, ["sql", str(logdir), "select 1", "--format", "xml"])
    assert res.exit_code == 2 and "xml" in res.stderr
    res = runner.invoke(app, ["sql", str(logdir), "select * from range(50)", "--max-rows", "7", "-f", "csv"])
    assert len(res.stdout.splitlines()) == 8 and "cut at 7 rows" in res.stderr


def test_report_numbers_match_the_step_summary(logdir, tmp_path):
    with tsdb.connect(logdir, cache_dir=tmp_path) as conn:
        reports = {r.run_id: r for r in report.build(conn)}
        summary = conn.step_summary()
    assert set(reports) == {"alpha", "beta"}
    alpha = summary[summary.run_id == "alpha"].sort_values("step")
    r = reports["alpha"]
    assert r.loss_rule == "grpo" and r.n_steps == 4 and r.n_tokens == alpha.n_tokens.sum()
    assert r.mismatch_last == pytest.approx(alpha.mismatch_mean.iloc[-1])
    assert r.blocked_by_rule["pg_is"] == 0.0
    assert r.trainer_blocked_frac == pytest.approx(r.blocked_by_rule["grpo"], abs=2e-3)
    assert list(r.clipped.rule.unique()) == ["grpo"]


def test_report_command_and_html(logdir, tmp_path):
    page = tmp_path / "report.html"
    res = runner.invoke(app, ["report", str(logdir), "--html", str(page)])
    assert res.exit_code == 0, res.output
    assert "alpha" in res.output and "beta" in res.output and "dppo_binary_kl" in res.output
    text = page.read_text()
    assert text.count("plotly") > 10 and "Mismatch" in text and "alpha" in text
    assert "<script src=\"http" not in text and len(text) > 1_000_000  # plotly.js inlined: self-contained
    res = runner.invoke(app, ["report", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "missing" in res.stderr
