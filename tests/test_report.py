"""The `trustscope sql` and `trustscope report` commands, and the report module behind them."""

from __future__ import annotations

import io
import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from trustscope import db as tsdb
from trustscope import early_warning, report, report_tables, report_where
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


def test_named_queries_bind_parameters_and_refuse_unknown_names(logdir, tmp_path):
    with tsdb.connect(logdir, cache_dir=tmp_path) as conn:
        alpha = conn.query("rules_by_bucket", run_id="alpha", first_step=0, last_step=3)
        none = conn.query("rules_by_bucket", run_id="alpha'; drop view tokens; --", first_step=0, last_step=3)
        before = conn.version()
        with pytest.raises(ValueError, match="unknown query 'nope'"):
            conn.query("nope")
    assert len(alpha) and none.empty  # a value, never SQL
    assert set(alpha["adv_sign"]) <= {"A>0", "A<0"} and (alpha["n_blocked"] <= alpha["n_tokens"]).all()
    import shutil

    copy = shutil.copytree(logdir, tmp_path / "logs")
    with tsdb.connect(copy, cache_dir=tmp_path) as conn:
        same = conn.version()
        generate_run(copy, "gamma", SyntheticConfig(tokens=300, steps=1, edge_cases=False))
        assert conn.version() != same  # a new file changes the version the dashboard caches under
    assert before


def test_sql_prints_float32_at_float32_precision(logdir):
    q = "select 0.3::float as f32, 0.3::double as f64"
    res = runner.invoke(app, ["sql", str(logdir), q])
    assert res.exit_code == 0 and "0.3 " in res.output and "0.300000011920929" not in res.output
    rows = json.loads(runner.invoke(app, ["sql", str(logdir), q, "-f", "json"]).output)
    assert rows == [{"f32": 0.3, "f64": 0.3}]


def test_report_numbers_match_the_step_summary(logdir, tmp_path):
    with tsdb.connect(logdir, cache_dir=tmp_path) as conn:
        reports = {r.run_id: r for r in report.build(conn)}
        summary = conn.step_summary()
    assert set(reports) == {"alpha", "beta"}
    alpha = summary[summary.run_id == "alpha"].sort_values("step")
    r = reports["alpha"]
    assert r.loss_rule == "grpo" and r.n_steps == 4 and r.n_tokens == alpha.n_tokens.sum()
    assert r.mismatch_last == pytest.approx(alpha.mismatch_mean.iloc[-1])
    assert "pg_is" not in r.blocked_by_rule  # blocks nothing: left out
    frac, n = r.blocked_by_rule["grpo"]
    assert r.trainer_blocked_frac == pytest.approx(frac, abs=2e-3)
    assert n == alpha.n_blocked__grpo.sum()
    assert frac == pytest.approx(n / alpha.n_nonzero_advantage.sum())
    assert list(r.clipped.rule.unique()) == ["grpo"]


def test_run_table_counts_tokens_and_groups_seeds(tmp_path):
    cfg = SyntheticConfig(tokens=600, steps=2, edge_cases=False)
    for seed in (0, 1):
        generate_run(tmp_path / "logs", f"cfg-s{seed}", SyntheticConfig(**{**cfg.__dict__, "seed": seed}))
    with tsdb.connect(tmp_path / "logs", cache_dir=tmp_path / "cache") as conn:
        table = report.run_table(conn)
        summary = conn.step_summary()
    assert table["tokens_logged"].tolist() == summary.groupby("run_id")["n_tokens"].sum().tolist()
    assert (table["tokens_generated"] >= table["tokens_logged"]).all()
    assert table["status"].isin(["finished", "crashed", "stale", "running"]).all()


def test_seed_group_drops_only_the_seed():
    a = {"config": {"loss": "ppo_clip", "seed": 0, "run_id": "x-s0", "lr": 1e-3}}
    b = {"config": {"loss": "ppo_clip", "seed": 1, "run_id": "x-s1", "lr": 1e-3}}
    c = {"config": {"loss": "ppo_clip", "seed": 1, "run_id": "y-s1", "lr": 2e-3}}
    assert report.seed_group(a, "x-s0") == report.seed_group(b, "x-s1")
    assert report.seed_group(a, "x-s0")[1] == "x" and report.seed_group(c, "y-s1")[0] != report.seed_group(a, "x-s0")[0]


def test_collapse_warning_fires_on_the_configured_line(logdir, tmp_path):
    with tsdb.connect(logdir, cache_dir=tmp_path) as conn:
        never = early_warning.collapse_warnings(conn, ["alpha"], early_warning.WarningLines(
            bad_rate=1.0, mismatch_growth=1e9, window=1), detector=None)
        always = early_warning.collapse_warnings(conn, ["alpha"], early_warning.WarningLines(
            bad_rate=1e-12, mismatch_growth=1e-9, window=1), detector=None)
    assert not never["warning"].any()
    assert always["warning"].tolist() == [False, True, True, True]  # the first window is the baseline
    assert early_warning.first_warnings(always)["alpha"].startswith("collapse warning from step 1")
    with pytest.raises(ValueError, match="bad_rate"):
        early_warning.WarningLines(bad_rate=-1)


@pytest.fixture(scope="module")
def long_ids(tmp_path_factory):
    """Three runs with long ids sharing a prefix, every token logged, with summaries."""
    root = tmp_path_factory.mktemp("wide")
    cfg = SyntheticConfig(tokens=3_000, steps=3, edge_cases=False, loss_rule="dppo_binary_tv", mismatch=0.05)
    ids = [f"sanity-dppo_binary_tv-long-config-name-s{s}" for s in range(3)]
    for i, run_id in enumerate(ids):
        generate_run(root / "logs", run_id, SyntheticConfig(**{**cfg.__dict__, "seed": i}))
    return root / "logs"


def _printed(logdir, width: int, cache) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    with tsdb.connect(logdir, cache_dir=cache) as conn:
        report.print_report(conn, console)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 200])
def test_terminal_report_fits_its_width_without_cutting_a_name_or_a_figure(long_ids, tmp_path, width):
    """At 80 and at 200 columns: no line wider than the terminal, no cell cut short (rich's ellipsis), every rule
    and run named whole, |pi - mu| printed with its significant digits; what a narrow terminal leaves out is
    named under its table, and a wide one shows it."""
    from trustscope.losses import get_loss, list_losses

    text = _printed(long_ids, width, tmp_path / "cache")
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert "\u2026" not in text  # rich's ellipsis: a cell cut short
    overview = text.split("\n\n")[0]
    for seed in range(3):
        assert any(line.startswith(f"s{seed}") for line in overview.splitlines()), overview
    header = next(line for line in lines if line.startswith("run ") and "|pi-mu|" in line)
    rows = [line for line in lines[lines.index(header) + 2:][:3]]
    mismatch = [row.split()[header.split().index("|pi-mu|")] for row in rows]
    assert all(m not in ("0.0000", "0") and float(m) > 0 for m in mismatch), mismatch
    thresholded = [n for n in list_losses() if get_loss(n).threshold is not None and get_loss(n).sql]
    budget_rows = [line.split()[0] for line in lines if line.split() and line.split()[0] in thresholded]
    assert set(budget_rows) >= {"ppo_clip", "dppo_binary_tv", "minimal_negative_mask"}, budget_rows
    if width == 80:
        assert "at this width left out: bracket" in " ".join(text.split())
    else:
        assert "at this width left out" not in text and any(" bracket " in line for line in lines)


def test_significant_digits_for_figures_of_any_size():
    sig = report_tables.sig
    assert sig(2.1e-05) == "2.10e-05" and sig(0.00213) == "0.00213" and sig(0.5) == "0.500"
    assert sig(0) == "0" and sig(None) == "-" and sig(float("nan")) == "-"
    assert sig(1234.5, 4) == "1234" and sig(3.2e7) == "3.20e+07"


def _warned(rewards: list[float], mismatch: list[float]) -> pd.DataFrame:
    from trustscope.db import Overview

    steps = pd.DataFrame({"run_id": "r", "step": range(len(rewards)), "n_tokens": 100.0, "reward_mean": rewards,
                          "n_bad_negative": 0.0, "mismatch_mean": mismatch})
    return early_warning.collapse_warnings(Overview(steps, pd.DataFrame(), pd.DataFrame()), ["r"], detector=None)


def test_the_warning_holds_where_the_reward_then_collapses_or_it_is_still_on():
    """The mismatch line fires on all three runs at step 10; it holds where the reward then falls to half its best
    (10-step means) or where the warning is on at the last step, and not where the run never falls that far."""
    rise = [0.01] * 10 + [0.05] * 10 + [0.01] * 20  # the line fires at steps 10-19 (|pi - mu| 5x), then stops
    dip = [0.5] * 20 + [0.1] * 20  # a collapse: the 10-step mean falls to 0.1, a fifth of its best
    dent = [0.5] * 20 + [0.3] * 20  # never below 60% of its best
    held, why = early_warning.warning_outcome(_warned(dip, rise), "r")
    assert held and "collapsed" in why and "step 26" in why
    held, why = early_warning.warning_outcome(_warned(dent, rise), "r")
    assert not held and "never fell to half its best" in why and "60%" in why
    held, why = early_warning.warning_outcome(_warned(dent, [0.01] * 10 + [0.05] * 30), "r")
    assert held and "still on at the last step" in why
    assert early_warning.warning_outcome(_warned(dent, [0.01] * 40), "r") is None  # never warned


def test_json_report_carries_every_figure_for_scripts(logdir):
    res = runner.invoke(app, ["report", str(logdir), "--format", "json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    runs = {r["run_id"]: r for r in out["runs"]}
    assert set(runs) == {"alpha", "beta"}
    alpha = runs["alpha"]
    assert alpha["loss_rule"] == "grpo" and alpha["n_steps"] == 4 and alpha["mismatch_last"] > 0
    assert alpha["blocked_by_rule"]["grpo"]["n"] >= 1
    budget = {r["rule"]: r for r in alpha["equal_budget"]}
    assert "off" in budget["ppo_clip"] and budget["cispo"]["value"] is None  # NaN reads null
    assert {"by_dimension", "blocked_by_dimension", "by_routing", "broken"} <= set(out)
    bad = runner.invoke(app, ["report", str(logdir), "--format", "yaml"])
    assert bad.exit_code == 2 and "--format 'yaml'" in bad.stderr


def test_a_second_report_reads_the_kept_figures_and_a_new_run_is_computed(logdir, tmp_path, monkeypatch):
    """The report's figures are kept beside the query layer's aggregates under the log directory's version:
    a second report over the same files computes nothing; a new run's files compute them anew."""
    import shutil

    calls = []
    real = report.gather
    monkeypatch.setattr(report, "gather", lambda *a, **k: calls.append(1) or real(*a, **k))
    logs = tmp_path / "logs"
    shutil.copytree(logdir, logs)
    with tsdb.connect(logs, cache_dir=tmp_path / "cache") as conn:
        first = report.kept_gather(conn)
        again = report.kept_gather(conn)
    assert len(calls) == 1 and [r.run_id for r in again.reports] == [r.run_id for r in first.reports]
    assert again.reports[0].equal_budget.equals(first.reports[0].equal_budget)
    generate_run(logs, "gamma", SyntheticConfig(tokens=1_000, steps=2, edge_cases=False, loss_rule="grpo"))
    with tsdb.connect(logs, cache_dir=tmp_path / "cache") as conn:
        assert "gamma" in [r.run_id for r in report.kept_gather(conn).reports]
    assert len(calls) == 2
    with tsdb.connect(logs, cache=False) as conn:  # no cache folder: computed every time
        report.kept_gather(conn)
        report.kept_gather(conn)
    assert len(calls) == 4


def test_report_command_and_html(logdir, tmp_path):
    page = tmp_path / "report.html"
    res = runner.invoke(app, ["report", str(logdir), "--html", str(page)])
    assert res.exit_code == 0, res.output
    assert "alpha" in res.output and "beta" in res.output
    text = page.read_text()
    assert "Reward and mismatch" in text and "Ratio against binary TV" in text and "alpha" in text
    assert "{&#x27;" not in text and "{&quot;" not in text.split("<h2>")[0]  # no raw dicts at the top
    assert (tmp_path / "plotly.min.js").exists() and "<script src='plotly.min.js'>" in text
    assert len(text) < 1_500_000
    inline = tmp_path / "inline.html"
    assert runner.invoke(app, ["report", str(logdir), "--html", str(inline), "--inline-js"]).exit_code == 0
    assert "<script src=" not in inline.read_text() and len(inline.read_text()) > 3_000_000
    res = runner.invoke(app, ["report", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "missing" in res.stderr


def test_report_and_sql_leave_a_corrupt_run_out_and_show_the_others(logdir, tmp_path):
    import shutil

    root = tmp_path / "logs"
    shutil.copytree(logdir, root)
    (root / "beta" / "tokens" / "rank000-999999.parquet").write_bytes(b"this is not parquet")
    res = runner.invoke(app, ["report", str(root)])
    assert res.exit_code == 0, res.output
    assert "alpha" in res.stdout and "beta" in res.stdout and "left out, unreadable" in res.stdout
    # no traceback and no DuckDB error leak (a section may name a query the user can run: that is not an error)
    assert not any(word in res.output for word in ("Traceback", "Error:", "Binder Error", "IO Error"))
    res = runner.invoke(app, ["sql", str(root), "select distinct run_id from tokens"])
    assert res.exit_code == 0 and "alpha" in res.stdout and "beta left out" in res.stderr


def test_no_runs_found_exits_non_zero_with_a_message(tmp_path):
    (tmp_path / "empty").mkdir()
    for command in ("report", "sql"):
        args = [command, str(tmp_path / "empty")] + (["select 1"] if command == "sql" else [])
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and "no runs found" in res.stderr and "Traceback" not in res.output


def test_demo_refuses_a_busy_port_before_training(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = runner.invoke(app, ["demo", "--logdir", str(tmp_path / "demo"), "--port", str(port)])
    assert res.exit_code == 2 and f"port {port}" in res.stderr
    assert not (tmp_path / "demo").exists()  # nothing trained


def test_report_says_where_the_mismatch_lives(tmp_path):
    """The terminal report and the HTML page carry the page's tables by position, turn and staleness, with the
    counts, and a sentence for a run that logs no turn or version."""
    from async_logs import write_async_logdir

    logdir = write_async_logdir(tmp_path / "logs")
    res = runner.invoke(app, ["report", str(logdir), "--html", str(tmp_path / "r.html")], terminal_width=100)
    assert res.exit_code == 0, res.output
    for dimension in ("position", "turn", "staleness"):
        assert f"Where the mismatch lives: by {dimension}" in res.output
    assert "sync-single-turn logs no turn" in res.output and "sync-single-turn logs no policy_version" in res.output
    with tsdb.connect(logdir) as conn:
        mismatch, blocked = report_where.by_dimension(conn, ["async-lag3"])
    stale = mismatch[mismatch.dimension == "staleness"].set_index("bucket")
    assert stale.index.tolist() == [0, 1, 2, 3] and stale.mismatch_mean.is_monotonic_increasing
    own = blocked[(blocked.dimension == "staleness") & (blocked.rule == "dppo_binary_tv")].set_index("bucket")
    row = own.loc[3]
    assert f"{row.n_blocked:,} of {row.n_nonzero_advantage:,}" in res.output  # the counts beside the fraction
    page = (tmp_path / "r.html").read_text()
    assert "Mismatch and ESS by staleness" in page and "What each rule blocks by turn" in page
    assert "Run sync-single-turn logs no turn" in page


def test_a_run_logged_in_full_without_summaries_is_split_by_its_token_rows_exactly(tmp_path):
    """An import logs every token and no summaries: "where the mismatch lives" computes its dimension rows from the
    token rows (token_dimensions), equal to what the logger's exact summaries give for the same tokens; a run that
    keeps only a sample of its tokens and no summaries still gets the sentence, not a sample read as exact."""
    import pandas as pd
    from async_logs import write_async_run

    from trustscope.columns import DIMENSIONS

    logdir = tmp_path / "logs"
    write_async_run(logdir, "summarised", lag=3, seed=5)
    write_async_run(logdir, "full-rows", lag=3, seed=5, summaries=False)
    write_async_run(logdir, "sampled-rows", lag=3, seed=5, summaries=False, token_fraction=0.5)
    with tsdb.connect(logdir, cache=False) as conn:
        mismatch, blocked = report_where.by_dimension(conn)
    keys = ["dimension", "bucket"]
    ours = mismatch[mismatch.run_id == "summarised"].drop(columns="run_id").set_index(keys).sort_index()
    rows = mismatch[mismatch.run_id == "full-rows"].drop(columns="run_id").set_index(keys).sort_index()
    assert set(ours.index.get_level_values(0)) == {d.name for d in DIMENSIONS} - {"routing"}  # MoE runs only
    assert ours.index.equals(rows.index)
    for col in ("n_tokens", "n_nonzero_advantage", "n_bad_negative", "n_steps"):
        assert (ours[col] == rows[col]).all(), col
    for col in ("mismatch_mean", "mismatch_max", "ess_frac", "bad_negative_rate"):
        pd.testing.assert_series_equal(ours[col], rows[col], rtol=1e-6, check_names=False)
    summarised = blocked[blocked.run_id == "summarised"].drop(columns="run_id").set_index([*keys, "rule"])
    from_rows = blocked[blocked.run_id == "full-rows"].drop(columns="run_id").set_index([*keys, "rule"])
    shared = summarised.index.intersection(from_rows.index)
    assert len(shared) == len(summarised) and summarised["n_blocked"].sum() > 0
    assert (summarised.loc[shared, ["n_blocked", "n_nonzero_advantage"]]
            == from_rows.loc[shared, ["n_blocked", "n_nonzero_advantage"]]).all().all()
    assert report_where.lacking(mismatch, "position", ["summarised", "full-rows", "sampled-rows"]) == ["sampled-rows"]
    from trustscope.query.catalogue import view_text

    assert all(f"({d.sql})::bigint as bucket" in view_text("token_dimensions") for d in DIMENSIONS)
